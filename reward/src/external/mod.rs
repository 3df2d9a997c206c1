//! Scorers a user writes in any language, reached over a pipe or HTTP.
//!
//! Both speak the same JSON. A request (one line for [`command`], the POST body for [`http`]):
//!
//! ```json
//! {"id": 7, "sample_id": 12, "data_source": "openai/gsm8k",
//!  "prompt": [{"role": "user", "content": "Natalia sold clips to ..."}], "response": "... #### 72",
//!  "ground_truth": "72", "extra": {"split": "train"}, "response_length": 143, "truncated": false}
//! ```
//!
//! A response: `{"id": 7, "score": 1.0, "extras": {"acc": 1.0}, "pred": "72"}` (`extras`
//! optional, values numbers or booleans; `pred` optional, the extracted answer that
//! validation's majority votes count), or `{"id": 7, "error": "why"}` to report a failure. `id` is required on
//! the child-process protocol (answers may come back in any order) and ignored over HTTP, where a
//! bare number is also accepted as the score.
//!
//! The transports (time limits, in-flight bounds, restarts) are the `external` crate's; this
//! module is what a scorer's request and answer hold.

pub mod command;
pub mod http;
pub mod verl_function;

use external::truncate;
use serde::Serialize;

use crate::scorer::{Sample, Score};

/// The request sent to an external scorer.
#[derive(Debug, Serialize)]
pub struct ExternalRequest<'a> {
    /// Request id, unique per scorer instance; echoed in the answer.
    pub id: u64,
    /// The sample's id.
    pub sample_id: u64,
    /// The sample's `data_source`.
    pub data_source: &'a str,
    /// The row's prompt: chat messages, a string, or `null`.
    pub prompt: &'a serde_json::Value,
    /// The response text.
    pub response: &'a str,
    /// The ground truth.
    pub ground_truth: &'a str,
    /// The row's other columns.
    pub extra: &'a serde_json::Value,
    /// Response length in tokens.
    pub response_length: usize,
    /// Whether the response hit the length limit.
    pub truncated: bool,
}

impl<'a> ExternalRequest<'a> {
    /// The request for `sample` with request id `id`.
    pub fn new(id: u64, sample: &'a Sample) -> Self {
        Self {
            id,
            sample_id: sample.id,
            data_source: &sample.data_source,
            prompt: &sample.prompt,
            response: &sample.response,
            ground_truth: &sample.ground_truth,
            extra: &sample.extra,
            response_length: sample.response_length,
            truncated: sample.truncated,
        }
    }
}

/// Interprets an answer object (`score`, optional `extras`, or `error`). `Err` holds a message
/// saying what is wrong with it.
pub fn parse_answer(answer: &serde_json::Value) -> Result<Score, String> {
    let object = answer
        .as_object()
        .ok_or_else(|| format!("expected a JSON object, got {}", truncate(&answer.to_string())))?;
    if let Some(error) = object.get("error") {
        let message = error
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| error.to_string());
        return Err(format!("the scorer reported an error: {}", truncate(&message)));
    }
    let value = match object.get("score") {
        Some(serde_json::Value::Number(number)) => number.as_f64().unwrap_or(f64::NAN),
        Some(serde_json::Value::Bool(flag)) => f64::from(u8::from(*flag)),
        Some(other) => {
            return Err(format!(
                "`score` must be a number, got {}",
                truncate(&other.to_string())
            ))
        }
        None => {
            return Err(format!(
                "the answer has no `score`: {}",
                truncate(&answer.to_string())
            ))
        }
    };
    let mut score = Score::new(value);
    match object.get("extras") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Object(extras)) => {
            for (name, extra) in extras {
                let extra_value = match extra {
                    serde_json::Value::Number(number) => number.as_f64().unwrap_or(f64::NAN),
                    serde_json::Value::Bool(flag) => f64::from(u8::from(*flag)),
                    other => {
                        return Err(format!(
                            "extra `{name}` must be a number or boolean, got {}",
                            truncate(&other.to_string())
                        ))
                    }
                };
                score.extras.insert(name.clone(), extra_value);
            }
        }
        Some(other) => {
            return Err(format!(
                "`extras` must be an object, got {}",
                truncate(&other.to_string())
            ))
        }
    }
    match object.get("pred") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::String(pred)) => score.pred = Some(pred.clone()),
        Some(other) => {
            return Err(format!(
                "`pred` must be a string, got {}",
                truncate(&other.to_string())
            ))
        }
    }
    Ok(score)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_validated() {
        let good =
            parse_answer(&serde_json::json!({"id": 1, "score": 0.5, "extras": {"acc": true, "len": 3}}))
                .unwrap();
        assert_eq!(
            (good.value, good.extras["acc"], good.extras["len"]),
            (0.5, 1.0, 3.0)
        );
        let cases = [
            (serde_json::json!([1]), "expected a JSON object"),
            (serde_json::json!({"id": 1}), "has no `score`"),
            (serde_json::json!({"score": "high"}), "`score` must be a number"),
            (
                serde_json::json!({"score": 1, "extras": {"a": "b"}}),
                "extra `a` must be a number",
            ),
            (
                serde_json::json!({"error": "no sandbox"}),
                "reported an error: no sandbox",
            ),
        ];
        for (answer, expected) in cases {
            let message = parse_answer(&answer).unwrap_err();
            assert!(message.contains(expected), "{message}");
        }
    }
}

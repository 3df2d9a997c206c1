//! Scorers a user writes in any language, reached over a pipe or HTTP.
//!
//! Both speak the same JSON. A request (one line for [`command`], the POST body for [`http`]):
//!
//! ```json
//! {"id": 7, "sample_id": 12, "data_source": "openai/gsm8k", "response": "... #### 72",
//!  "ground_truth": "72", "extra": {"split": "train"}, "response_length": 143, "truncated": false}
//! ```
//!
//! A response: `{"id": 7, "score": 1.0, "extras": {"acc": 1.0}, "pred": "72"}` (`extras`
//! optional, values numbers or booleans; `pred` optional, the extracted answer that
//! validation's majority votes count), or `{"id": 7, "error": "why"}` to report a failure. `id` is required on
//! the child-process protocol (answers may come back in any order) and ignored over HTTP, where a
//! bare number is also accepted as the score.
//!
//! Both bound the requests in flight ([`InFlightLimit`]) and give each request a time limit that
//! includes the wait for a free slot.

pub mod command;
pub mod http;
pub mod verl_function;

use std::sync::{Condvar, Mutex};
use std::time::Instant;

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

/// At most 200 characters of `text`, for error messages.
pub(crate) fn truncate(text: &str) -> String {
    match text.char_indices().nth(200) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_string(),
    }
}

/// A counting semaphore bounding the requests in flight to one external scorer.
#[derive(Debug)]
pub struct InFlightLimit {
    in_flight: Mutex<usize>,
    freed: Condvar,
    max: usize,
}

/// A held slot; released on drop.
#[derive(Debug)]
pub struct InFlightSlot<'a> {
    limit: &'a InFlightLimit,
}

impl InFlightLimit {
    /// A limit of `max` concurrent requests (at least 1).
    pub fn new(max: usize) -> Self {
        Self {
            in_flight: Mutex::new(0),
            freed: Condvar::new(),
            max: max.max(1),
        }
    }

    /// Waits for a free slot until `deadline`; `None` if none became free in time.
    pub fn acquire_until(&self, deadline: Instant) -> Option<InFlightSlot<'_>> {
        let mut in_flight = self
            .in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        while *in_flight >= self.max {
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            in_flight = self
                .freed
                .wait_timeout(in_flight, deadline - now)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
        *in_flight += 1;
        Some(InFlightSlot { limit: self })
    }

    /// Requests currently in flight.
    pub fn in_flight(&self) -> usize {
        *self
            .in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for InFlightSlot<'_> {
    fn drop(&mut self) {
        let mut in_flight = self
            .limit
            .in_flight
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        *in_flight -= 1;
        self.limit.freed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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

    #[test]
    fn in_flight_limit_blocks_until_deadline() {
        let limit = InFlightLimit::new(2);
        let far = Instant::now() + Duration::from_secs(5);
        let first = limit.acquire_until(far).unwrap();
        let _second = limit.acquire_until(far).unwrap();
        let started = Instant::now();
        assert!(limit
            .acquire_until(Instant::now() + Duration::from_millis(30))
            .is_none());
        assert!(started.elapsed() >= Duration::from_millis(30));
        drop(first);
        assert_eq!(limit.in_flight(), 1);
        assert!(limit.acquire_until(Instant::now()).is_some());
    }
}

//! OpenAI's HTTP API as the rollout engine speaks it, shared by `grpo serve` and the endpoint
//! agent programs are trained through ([`crate::agent_program`]): errors in OpenAI's shape, the
//! bearer key, chat messages rendered into a prompt, a model turn as an assistant message (its
//! tool calls parsed in the model's format), and the answers, which add what training needs
//! and the API leaves out: the prompt's and each completion's token ids.

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use model::{ChatTemplate, ModelTokenizer};
use serde_json::{json, Value};

/// An API error as OpenAI writes them.
#[derive(Debug)]
pub struct ApiError(pub StatusCode, pub String);

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.0 {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::BAD_REQUEST => "invalid_request_error",
            _ => "server_error",
        };
        (self.0, Json(json!({"error": {"message": self.1, "type": kind}}))).into_response()
    }
}

/// A 400: the request is wrong, and the message says how.
pub fn bad(message: impl Into<String>) -> ApiError {
    ApiError(StatusCode::BAD_REQUEST, message.into())
}

/// Checks `Authorization: Bearer KEY` when the server has a key.
pub fn authorize(key: Option<&str>, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = key else { return Ok(()) };
    let sent = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if sent == Some(key) {
        Ok(())
    } else {
        Err(ApiError(
            StatusCode::UNAUTHORIZED,
            "missing or wrong API key: send `Authorization: Bearer KEY` with the server's key".into(),
        ))
    }
}

/// A chat request's `messages` (a non-empty list) and `tools` (absent or null: none).
pub fn chat_messages(body: &Value) -> Result<(&Vec<Value>, Option<&Value>), ApiError> {
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .filter(|m| !m.is_empty())
        .ok_or_else(|| bad("`messages` must be a non-empty list of {role, content} messages"))?;
    Ok((messages, body.get("tools").filter(|t| !t.is_null())))
}

/// The prompt ids of a chat conversation: the template's rendering of `messages` (with
/// `tools` passed as its `tools` variable) and the header of the assistant's turn, tokenized.
pub fn chat_prompt(
    template: &ChatTemplate,
    tokenizer: &ModelTokenizer,
    messages: &[Value],
    tools: Option<&Value>,
) -> Result<Vec<u32>, ApiError> {
    let mut extra = serde_json::Map::new();
    if let Some(tools) = tools {
        extra.insert("tools".into(), tools.clone());
    }
    let text = template
        .render_with(&Value::Array(messages.to_vec()), true, &extra)
        .map_err(|e| bad(format!("rendering the messages with the chat template: {e}")))?;
    tokenizer
        .encode(&text, false)
        .map_err(|e| bad(format!("tokenizing the prompt: {e}")))
}

/// A text completion request's prompt: a string (tokenized) or a list of token ids of the
/// model's vocabulary.
pub fn completion_prompt(tokenizer: &ModelTokenizer, body: &Value) -> Result<Vec<u32>, ApiError> {
    match body.get("prompt") {
        Some(Value::String(text)) => tokenizer
            .encode(text, true)
            .map_err(|e| bad(format!("tokenizing the prompt: {e}"))),
        Some(Value::Array(ids)) if !ids.is_empty() => ids
            .iter()
            .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect::<Option<Vec<u32>>>()
            .filter(|ids| ids.iter().all(|&id| (id as usize) < tokenizer.vocab_size()))
            .ok_or_else(|| bad("`prompt` as a list must hold token ids of this model's vocabulary")),
        _ => Err(bad("`prompt` must be a string or a non-empty list of token ids")),
    }
}

/// A model turn's text as the assistant message of a chat answer, and its finish reason. With
/// tools in the request, the calls in the text (in `format`) become `tool_calls` (ids
/// `call_{id}_{k}`) and the content is the text before the first call (null when empty).
pub fn assistant_message(
    format: agent::CallFormat,
    with_tools: bool,
    text: &str,
    id: &str,
    truncated: bool,
) -> (Value, &'static str) {
    let finish = finish_reason(truncated);
    let parsed = if with_tools {
        format.parse(text)
    } else {
        Default::default()
    };
    if parsed.calls.is_empty() {
        return (json!({"role": "assistant", "content": text}), finish);
    }
    let before = text.split("<tool_call>").next().unwrap_or_default().trim();
    let calls: Vec<Value> = parsed
        .calls
        .iter()
        .enumerate()
        .map(|(k, c)| {
            json!({"id": format!("call_{id}_{k}"), "type": "function",
                   "function": {"name": c.name, "arguments": c.arguments.to_string()}})
        })
        .collect();
    let content = (!before.is_empty()).then(|| before.to_string());
    (
        json!({"role": "assistant", "content": content, "tool_calls": calls}),
        "tool_calls",
    )
}

/// Each token's text, for the `logprobs` of an answer.
fn token_texts(tokenizer: &ModelTokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&id| tokenizer.decode(&[id], false).unwrap_or_default())
        .collect()
}

/// `length` for a completion cut by a budget, `stop` otherwise.
pub fn finish_reason(truncated: bool) -> &'static str {
    if truncated {
        "length"
    } else {
        "stop"
    }
}

/// One choice of a chat answer: the assistant `message`, its ids and, when asked for, their
/// log-probabilities.
pub fn chat_choice(
    tokenizer: &ModelTokenizer,
    index: usize,
    (message, finish): (Value, &str),
    ids: &[u32],
    logprobs: Option<&[f32]>,
) -> Value {
    let logprobs = logprobs.map(|lp| chat_logprobs(tokenizer, ids, lp));
    json!({"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs,
           "token_ids": ids})
}

/// One choice of a text completion answer: its text, ids and, when asked for, their
/// log-probabilities.
pub fn text_choice(
    tokenizer: &ModelTokenizer,
    index: usize,
    text: &str,
    truncated: bool,
    ids: &[u32],
    logprobs: Option<&[f32]>,
) -> Value {
    let logprobs = logprobs.map(|lp| json!({"tokens": token_texts(tokenizer, ids), "token_logprobs": lp}));
    json!({"index": index, "text": text, "finish_reason": finish_reason(truncated),
           "logprobs": logprobs, "token_ids": ids})
}

/// A chat answer's `logprobs`.
fn chat_logprobs(tokenizer: &ModelTokenizer, ids: &[u32], logprobs: &[f32]) -> Value {
    let content: Vec<Value> = token_texts(tokenizer, ids)
        .into_iter()
        .zip(logprobs)
        .map(|(token, lp)| json!({"token": token, "logprob": lp, "bytes": null, "top_logprobs": []}))
        .collect();
    json!({"content": content})
}

/// Whether a request asks for log-probabilities (`logprobs: true`, or a count for text
/// completions).
pub fn wants_logprobs(body: &Value) -> bool {
    body.get("logprobs")
        .is_some_and(|v| !v.is_null() && v != &json!(false))
}

/// A whole answer: `object` is `chat.completion` or `text_completion`.
pub fn completion(
    object: &str,
    id: &str,
    model: &str,
    choices: Vec<Value>,
    prompt: &[u32],
    completion_tokens: usize,
) -> Value {
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    json!({
        "id": id,
        "object": object,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt.len(), "completion_tokens": completion_tokens,
                  "total_tokens": prompt.len() + completion_tokens},
        "prompt_token_ids": prompt,
    })
}

//! User tools in any language: a long-lived child process speaking JSON lines, or an HTTP
//! endpoint (the `external` crate's transports, as external reward scorers use them).
//!
//! A request (one line on the process's stdin, or the `POST` body):
//!
//! ```json
//! {"id": 7, "tool": "search", "arguments": {"query": "capital of France"},
//!  "episode": "12-3-0", "kwargs": {"create_kwargs": {"ground_truth": "Paris"}}}
//! ```
//!
//! `episode` is the same for every call of one sample's episode (a program may keep state per
//! episode by it) and new when an episode is run again; `kwargs` is the dataset row's
//! arguments for this tool (VeRL's `extra_info.tools_kwargs.<tool>`), or null.
//!
//! An answer (one line on its stdout with the same `id`, or the response body):
//! `{"id": 7, "result": "Paris"}` (a non-string `result` is shown to the model as JSON), or
//! `{"id": 7, "error": "why"}`, which the model reads as the call's error. Over HTTP a bare JSON
//! string is also a result. One process may serve several tools: the request names the tool.
//!
//! A process that crashes is restarted for the next call; one that hangs past the time limit is
//! killed and restarted; a broken answer fails that call. Each of these is an error observation
//! for the model and a counted tool error, never the end of the rollout.

use std::time::Duration;

use external::{truncate, ExternalError, JsonEndpoint, JsonLinesProcess};
use serde_json::{json, Value};

use crate::schema::ToolSchema;
use crate::tool::{CallContext, Tool, ToolError};

/// How a user tool or an interaction reaches its program.
pub enum Transport {
    /// A JSON-lines child process.
    Command(JsonLinesProcess),
    /// An HTTP endpoint.
    Http(JsonEndpoint),
}

impl Transport {
    /// Sends `request(id)` and returns the answer; `what` names the request in a time-out
    /// message, `who` the program in a failure (`the tool's program`).
    pub fn send<R: serde::Serialize>(
        &self,
        what: &str,
        who: &str,
        request: impl Fn(u64) -> R,
    ) -> Result<Value, ToolError> {
        match self {
            Transport::Command(process) => process.call(what, request),
            Transport::Http(endpoint) => endpoint.post(request),
        }
        .map_err(|error| match error {
            ExternalError::TimedOut(limit) => ToolError::TimedOut(limit),
            ExternalError::Failed(message) => ToolError::Failed(format!("{who} failed: {message}")),
        })
    }
}

/// A tool whose work another program does (see the module documentation).
pub struct ExternalTool {
    schema: ToolSchema,
    transport: Transport,
    timeout: Duration,
}

impl ExternalTool {
    /// A tool described by `schema`, run by the command `program` (executable and arguments)
    /// with a time limit per call and at most `max_in_flight` calls outstanding. `key` names
    /// where the command was configured, for errors.
    pub fn command(
        schema: ToolSchema,
        key: &str,
        program: Vec<String>,
        timeout: Duration,
        max_in_flight: usize,
    ) -> Self {
        let label = format!("tool-{}", schema.name);
        ExternalTool {
            transport: Transport::Command(JsonLinesProcess::new(
                &label,
                key,
                program,
                timeout,
                max_in_flight,
            )),
            schema,
            timeout,
        }
    }

    /// A tool described by `schema`, run by `POST`s to `url`.
    pub fn http(schema: ToolSchema, url: &str, timeout: Duration, max_in_flight: usize) -> Self {
        ExternalTool {
            transport: Transport::Http(JsonEndpoint::new(url, timeout, max_in_flight)),
            schema,
            timeout,
        }
    }

    /// The transport, for its counters (a command's restarts).
    pub fn transport(&self) -> &Transport {
        &self.transport
    }
}

impl Tool for ExternalTool {
    fn schema(&self) -> ToolSchema {
        self.schema.clone()
    }

    fn time_limit(&self) -> Option<Duration> {
        Some(self.timeout)
    }

    fn call(&self, arguments: &Value) -> Result<String, ToolError> {
        self.call_in(arguments, &CallContext::default())
    }

    fn call_in(&self, arguments: &Value, context: &CallContext) -> Result<String, ToolError> {
        let name = &self.schema.name;
        let request = |id: u64| json!({"id": id, "tool": name, "arguments": arguments, "episode": context.episode, "kwargs": context.kwargs});
        let answer = self
            .transport
            .send(&format!("a call of {name}"), "the tool's program", request)?;
        result_of(&answer)
    }
}

/// The observation in an answer: `result` (a string, or any JSON shown as JSON), `error`, or
/// a bare string.
fn result_of(answer: &Value) -> Result<String, ToolError> {
    match answer {
        Value::String(text) => Ok(text.clone()),
        Value::Object(object) => {
            if let Some(error) = object.get("error").filter(|e| !e.is_null()) {
                let message = error
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| error.to_string());
                return Err(ToolError::Failed(message));
            }
            match object.get("result") {
                Some(Value::String(text)) => Ok(text.clone()),
                Some(other) => Ok(other.to_string()),
                None => Err(ToolError::Failed(format!(
                    "the tool's program answered without a `result` or `error`: {}",
                    truncate(&answer.to_string())
                ))),
            }
        }
        other => Err(ToolError::Failed(format!(
            "the tool's program answered {} instead of an object with `result` or `error`",
            truncate(&other.to_string())
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_become_observations_or_errors() {
        assert_eq!(
            result_of(&json!({"id": 1, "result": "Paris"})),
            Ok("Paris".into())
        );
        assert_eq!(
            result_of(&json!({"id": 1, "result": {"hits": 2}})),
            Ok("{\"hits\":2}".into())
        );
        assert_eq!(result_of(&json!("bare")), Ok("bare".into()));
        assert_eq!(
            result_of(&json!({"id": 1, "error": "no such city"})),
            Err(ToolError::Failed("no such city".into()))
        );
        let message = result_of(&json!({"id": 1})).unwrap_err().to_string();
        assert!(message.contains("without a `result` or `error`"), "{message}");
        let message = result_of(&json!([1, 2])).unwrap_err().to_string();
        assert!(
            message.contains("answered [1,2] instead of an object"),
            "{message}"
        );
    }
}

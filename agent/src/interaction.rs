//! Environments for whole episodes, which answer the model's turns as the user would (VeRL's
//! `interaction`): a simulated user, a grader that says "try again", a game. After a model turn
//! without tool calls, the rollout sends the turn to the episode's environment; its reply
//! becomes the next user message, it may end the episode, and it may give a reward for the turn.
//!
//! [`Environment`] is the interface, for environments written in Rust: `reset` from the
//! dataset row when an episode first reaches it, `step` on each model turn (observation, done,
//! reward), `close` when the episode's sample is finished. [`Interaction`] is the same
//! interface for a program in any language, reached as a JSON-lines child process or an HTTP
//! endpoint (the transports of [`crate::external`]). A request:
//!
//! ```json
//! {"id": 3, "interaction": "gsm8k", "episode": "5f3a9c-12-3-0", "user_turns": 0,
//!  "turn": "The answer is 72.", "kwargs": {"name": "gsm8k", "ground_truth": "72"}}
//! ```
//!
//! `turn` is the model's last turn as text, `user_turns` how many replies the episode had
//! before this one (0: the episode is new, reset whatever it keeps for `episode`), `kwargs`
//! the dataset row's `extra_info.interaction_kwargs`. The answer:
//! `{"id": 3, "content": "Correct.", "done": true, "reward": 1.0}` (`done` and `reward`
//! optional: false and none), or `{"id": 3, "error": "why"}`.

use std::time::Duration;

use external::{truncate, JsonEndpoint, JsonLinesProcess};
use serde_json::{json, Value};

use crate::external::Transport;
use crate::tool::ToolError;

/// An interaction's answer to a model turn.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    /// The next user message.
    pub content: String,
    /// Whether the episode ends here.
    pub done: bool,
    /// The reward for the turn, if it gives one.
    pub reward: Option<f64>,
}

/// A model turn an environment answers.
#[derive(Clone, Copy, Debug)]
pub struct EnvTurn<'a> {
    /// The episode's id, unique across the run's processes and restarts.
    pub episode: &'a str,
    /// Replies the episode had before this turn (0: its first step, right after `reset`).
    pub user_turns: u32,
    /// The model's turn as text (special tokens left out).
    pub text: &'a str,
    /// The row's `extra_info.interaction_kwargs` (null without).
    pub kwargs: &'a Value,
}

/// An environment for whole episodes (see the module documentation). Its methods run on
/// threads of the rollout, never on the engine's; `step` is bounded by [`Environment::time_limit`]
/// (the run's `tool_timeout_s` when `None`) and one past it ends the episode, counted as a
/// time-out.
pub trait Environment: Send + Sync {
    /// The name a row picks it by (`extra_info.interaction_kwargs.name`).
    fn name(&self) -> &str;

    /// A new episode, from its dataset row (every column but the prompt as JSON, `extra_info`
    /// among them), before its first step. An error ends the episode, counted.
    fn reset(&self, _episode: &str, _row: &Value) -> Result<(), ToolError> {
        Ok(())
    }

    /// The answer to a model turn that called no tool.
    fn step(&self, turn: &EnvTurn<'_>) -> Result<Reply, ToolError>;

    /// The episode's sample is finished: drop what is kept for it.
    fn close(&self, _episode: &str) {}

    /// Its own limit on one step, when it enforces one itself (a program is killed at it).
    fn time_limit(&self) -> Option<Duration> {
        None
    }
}

/// An environment in another process (see the module documentation).
pub struct Interaction {
    name: String,
    transport: Transport,
    timeout: Duration,
}

impl Interaction {
    /// An interaction named `name` run by the command `program`; `key` names where it was
    /// configured.
    pub fn command(
        name: &str,
        key: &str,
        program: Vec<String>,
        timeout: Duration,
        max_in_flight: usize,
    ) -> Self {
        let label = format!("interaction-{name}");
        Interaction {
            name: name.into(),
            timeout,
            transport: Transport::Command(JsonLinesProcess::new(
                &label,
                key,
                program,
                timeout,
                max_in_flight,
            )),
        }
    }

    /// An interaction named `name` reached by `POST`s to `url`.
    pub fn http(name: &str, url: &str, timeout: Duration, max_in_flight: usize) -> Self {
        Interaction {
            name: name.into(),
            timeout,
            transport: Transport::Http(JsonEndpoint::new(url, timeout, max_in_flight)),
        }
    }
}

impl Environment for Interaction {
    fn name(&self) -> &str {
        &self.name
    }

    /// Sends the turn to the program; `user_turns: 0` tells it the episode is new.
    fn step(&self, turn: &EnvTurn<'_>) -> Result<Reply, ToolError> {
        let request = |id: u64| {
            json!({"id": id, "interaction": self.name, "episode": turn.episode,
                   "user_turns": turn.user_turns, "turn": turn.text, "kwargs": turn.kwargs})
        };
        let answer = self.transport.send(
            &format!("episode {}", turn.episode),
            "the interaction's program",
            request,
        )?;
        reply_of(&answer)
    }

    fn time_limit(&self) -> Option<Duration> {
        Some(self.timeout)
    }
}

fn reply_of(answer: &Value) -> Result<Reply, ToolError> {
    let bad = |what: String| {
        ToolError::Failed(format!(
            "the interaction answered {what}: {}",
            truncate(&answer.to_string())
        ))
    };
    let object = answer
        .as_object()
        .ok_or_else(|| bad("something that is not an object".into()))?;
    if let Some(error) = object.get("error").filter(|e| !e.is_null()) {
        return Err(ToolError::Failed(
            error
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| error.to_string()),
        ));
    }
    let content = match object.get("content") {
        Some(Value::String(text)) => text.clone(),
        _ => return Err(bad("without a string `content`".into())),
    };
    let done = match object.get("done") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(done)) => *done,
        Some(_) => return Err(bad("a `done` that is not a boolean".into())),
    };
    let reward = match object.get("reward") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => match n.as_f64() {
            Some(r) if r.is_finite() => Some(r),
            _ => return Err(bad("a `reward` that is not a finite number".into())),
        },
        Some(Value::Bool(b)) => Some(f64::from(u8::from(*b))),
        Some(_) => return Err(bad("a `reward` that is not a number".into())),
    };
    Ok(Reply {
        content,
        done,
        reward,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_are_read_or_refused() {
        assert_eq!(
            reply_of(&json!({"id": 1, "content": "Try again.", "reward": 0})).unwrap(),
            Reply {
                content: "Try again.".into(),
                done: false,
                reward: Some(0.0)
            }
        );
        assert!(reply_of(&json!({"content": "", "done": true})).unwrap().done);
        for (answer, expected) in [
            (json!({"error": "no episode"}), "no episode"),
            (json!({"done": true}), "without a string `content`"),
            (
                json!({"content": "x", "done": "yes"}),
                "`done` that is not a boolean",
            ),
            (
                json!({"content": "x", "reward": "high"}),
                "`reward` that is not a number",
            ),
            (json!(7), "not an object"),
        ] {
            let message = reply_of(&answer).unwrap_err().to_string();
            assert!(message.contains(expected), "{answer}: {message}");
        }
    }
}

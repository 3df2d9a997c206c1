//! Programs outside `grpo` that it calls with JSON, written by users in any language: external
//! reward scorers and user tools. Two transports with one contract:
//!
//! - [`JsonLinesProcess`]: a long-lived child process, one JSON request per line on its stdin,
//!   one JSON answer per line on its stdout, matched by `id`;
//! - [`JsonEndpoint`]: an HTTP endpoint, one `POST` of the request per call, the answer as the
//!   response body.
//!
//! Both bound the requests in flight ([`InFlightLimit`]) and give each request a time limit that
//! includes the wait for a free slot; every way a call can fail is an [`ExternalError`] whose
//! message says what happened, so the caller can count it and go on. What a request and an
//! answer hold is the caller's business (`reward::external`, `agent::external`).

#![deny(missing_docs)]

mod http;
mod limit;
mod process;

use std::time::Duration;

pub use http::JsonEndpoint;
pub use limit::{InFlightLimit, InFlightSlot};
pub use process::JsonLinesProcess;

/// Why a call got no answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ExternalError {
    /// No answer within the time limit (the wait for a free slot included).
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
    /// The program failed: it could not start, crashed, broke the protocol, answered HTTP
    /// 4xx/5xx, or answered something that is not JSON. The message is the whole sentence.
    #[error("{0}")]
    Failed(String),
}

/// At most 200 characters of `text`, for error messages that quote what a program sent.
pub fn truncate(text: &str) -> String {
    match text.char_indices().nth(200) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_string(),
    }
}

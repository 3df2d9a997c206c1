//! An external scorer behind an HTTP endpoint: each sample is one `POST` of the request JSON
//! (see [`super`]), answered with a JSON object (`score`, optional `extras`) or a bare number.
//! The transport is [`external::JsonEndpoint`]'s.

use std::time::Duration;

use external::{ExternalError, JsonEndpoint};
use serde_json::Value;

use super::command::external_error;
use super::{parse_answer, ExternalRequest};
use crate::scorer::{Sample, Score, ScoreError, Scorer};

/// A scorer backed by an HTTP endpoint.
pub struct HttpScorer {
    name: String,
    endpoint: JsonEndpoint,
}

impl HttpScorer {
    /// A scorer posting to `url`, with a time limit per request (including the wait for a free
    /// slot) and at most `max_in_flight` requests outstanding.
    pub fn new(name: &str, url: &str, timeout: Duration, max_in_flight: usize) -> Self {
        Self {
            name: name.to_string(),
            endpoint: JsonEndpoint::new(url, timeout, max_in_flight),
        }
    }
}

impl Scorer for HttpScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let answer = self
            .endpoint
            .post(|id| ExternalRequest::new(id, sample))
            .map_err(|error| external_error(&self.name, sample, error))?;
        match answer {
            Value::Number(number) => Ok(Score::new(number.as_f64().unwrap_or(f64::NAN))),
            other => parse_answer(&other),
        }
        .map_err(|message| external_error(&self.name, sample, ExternalError::Failed(message)))
    }
}

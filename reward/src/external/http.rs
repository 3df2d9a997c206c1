//! An external scorer behind an HTTP endpoint: each sample is one `POST` of the request JSON
//! (see [`super`]), answered with a JSON object (`score`, optional `extras`) or a bare number.
//!
//! The client is `ureq` (blocking, no TLS, no gzip): every call already runs on a pool worker
//! thread, so an async client would only add a runtime. Connections are kept alive and reused.
//! An HTTP status other than 2xx, a refused connection, a body that is not a valid answer, or no
//! complete answer within the time limit fails the sample.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::{parse_answer, truncate, ExternalRequest, InFlightLimit};
use crate::scorer::{Sample, Score, ScoreError, Scorer};

/// A scorer backed by an HTTP endpoint.
pub struct HttpScorer {
    name: String,
    url: String,
    timeout: Duration,
    limit: InFlightLimit,
    agent: ureq::Agent,
    next_request_id: AtomicU64,
}

impl HttpScorer {
    /// A scorer posting to `url`, with a time limit per request (including the wait for a free
    /// slot) and at most `max_in_flight` requests outstanding.
    pub fn new(name: &str, url: &str, timeout: Duration, max_in_flight: usize) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_idle_connections_per_host(max_in_flight.max(1))
            .build()
            .into();
        Self {
            name: name.to_string(),
            url: url.to_string(),
            timeout,
            limit: InFlightLimit::new(max_in_flight),
            agent,
            next_request_id: AtomicU64::new(0),
        }
    }

    fn external_error(&self, sample: &Sample, message: String) -> ScoreError {
        ScoreError::External {
            scorer: self.name.clone(),
            sample_id: sample.id,
            message,
        }
    }

    fn timed_out(&self, sample: &Sample) -> ScoreError {
        ScoreError::TimedOut {
            scorer: self.name.clone(),
            sample_id: sample.id,
            limit: self.timeout,
        }
    }

    fn classify(&self, sample: &Sample, error: ureq::Error) -> ScoreError {
        match error {
            ureq::Error::Timeout(_) => self.timed_out(sample),
            other => self.external_error(sample, format!("POST {} failed: {other}", self.url)),
        }
    }
}

impl Scorer for HttpScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let deadline = Instant::now() + self.timeout;
        let _slot = self
            .limit
            .acquire_until(deadline)
            .ok_or_else(|| self.timed_out(sample))?;
        let id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
        let body = serde_json::to_vec(&ExternalRequest::new(id, sample))
            .map_err(|error| self.external_error(sample, format!("could not encode the request: {error}")))?;
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(self.timed_out(sample));
        }
        let mut response = self
            .agent
            .post(&self.url)
            .header("content-type", "application/json")
            .config()
            .timeout_global(Some(remaining))
            .build()
            .send(&body[..])
            .map_err(|error| self.classify(sample, error))?;
        let status = response.status();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|error| self.classify(sample, error))?;
        if !status.is_success() {
            return Err(self.external_error(
                sample,
                format!("POST {} answered HTTP {status}: {}", self.url, truncate(&text)),
            ));
        }
        let answer: serde_json::Value = serde_json::from_str(&text).map_err(|error| {
            self.external_error(
                sample,
                format!("the answer is not JSON ({error}): {}", truncate(&text)),
            )
        })?;
        let score = match answer {
            serde_json::Value::Number(number) => Ok(Score::new(number.as_f64().unwrap_or(f64::NAN))),
            other => parse_answer(&other),
        };
        score.map_err(|message| self.external_error(sample, message))
    }
}

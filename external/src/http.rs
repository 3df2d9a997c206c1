//! [`JsonEndpoint`]: an HTTP endpoint answering JSON: each call is one `POST` of the request,
//! answered by a JSON body.
//!
//! The client is `ureq` (blocking, no TLS, no gzip); connections are kept alive and reused. An
//! HTTP status other than 2xx, a refused connection, a body that is not JSON, or no complete
//! answer within the time limit fails the call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::{truncate, ExternalError, InFlightLimit};

/// An HTTP endpoint (see the module documentation).
pub struct JsonEndpoint {
    url: String,
    timeout: Duration,
    limit: InFlightLimit,
    agent: ureq::Agent,
    next_request_id: AtomicU64,
}

impl JsonEndpoint {
    /// An endpoint at `url`, with a time limit per request (including the wait for a free slot)
    /// and at most `max_in_flight` requests outstanding.
    pub fn new(url: &str, timeout: Duration, max_in_flight: usize) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_idle_connections_per_host(max_in_flight.max(1))
            .build()
            .into();
        Self {
            url: url.to_string(),
            timeout,
            limit: InFlightLimit::new(max_in_flight),
            agent,
            next_request_id: AtomicU64::new(0),
        }
    }

    /// The endpoint's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Posts the request `request(id)` makes for a fresh `id` and returns the answer body as JSON.
    pub fn post<R: Serialize>(&self, request: impl Fn(u64) -> R) -> Result<Value, ExternalError> {
        let deadline = Instant::now() + self.timeout;
        let _slot = self
            .limit
            .acquire_until(deadline)
            .ok_or(ExternalError::TimedOut(self.timeout))?;
        let id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
        let body = serde_json::to_vec(&request(id))
            .map_err(|error| ExternalError::Failed(format!("could not encode the request: {error}")))?;
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(ExternalError::TimedOut(self.timeout));
        }
        let classify = |error: ureq::Error| match error {
            ureq::Error::Timeout(_) => ExternalError::TimedOut(self.timeout),
            other => ExternalError::Failed(format!("POST {} failed: {other}", self.url)),
        };
        let mut response = self
            .agent
            .post(&self.url)
            .header("content-type", "application/json")
            .config()
            .timeout_global(Some(remaining))
            .build()
            .send(&body[..])
            .map_err(classify)?;
        let status = response.status();
        let text = response.body_mut().read_to_string().map_err(classify)?;
        if !status.is_success() {
            return Err(ExternalError::Failed(format!(
                "POST {} answered HTTP {status}: {}",
                self.url,
                truncate(&text)
            )));
        }
        serde_json::from_str(&text).map_err(|error| {
            ExternalError::Failed(format!("the answer is not JSON ({error}): {}", truncate(&text)))
        })
    }
}

//! An external scorer run as a long-lived child process speaking JSON lines (the requests and
//! answers of [`super`]); the process, its restarts and time limits are
//! [`external::JsonLinesProcess`]'s. An answer with a valid `id` but no usable score fails only
//! its sample.

use std::time::Duration;

use external::{ExternalError, JsonLinesProcess};

use super::{parse_answer, ExternalRequest};
use crate::scorer::{Sample, Score, ScoreError, Scorer};

/// A scorer backed by a long-lived child process.
pub struct CommandScorer {
    name: String,
    process: JsonLinesProcess,
}

impl CommandScorer {
    /// A scorer that runs `program` (the executable and its arguments) when first needed, with a
    /// time limit per request and at most `max_in_flight` requests outstanding.
    pub fn new(name: &str, program: Vec<String>, timeout: Duration, max_in_flight: usize) -> Self {
        Self::with_key(
            name,
            &format!("reward.scorers.{name}.command"),
            program,
            timeout,
            max_in_flight,
        )
    }

    /// Like [`CommandScorer::new`], naming `key` as the recipe key to check when the command
    /// cannot start.
    pub fn with_key(
        name: &str,
        key: &str,
        program: Vec<String>,
        timeout: Duration,
        max_in_flight: usize,
    ) -> Self {
        Self {
            name: name.to_string(),
            process: JsonLinesProcess::new(&format!("reward-{name}"), key, program, timeout, max_in_flight),
        }
    }

    /// How many processes have been started so far (1 + restarts, once running).
    pub fn starts(&self) -> u64 {
        self.process.starts()
    }
}

impl Scorer for CommandScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let answer = self
            .process
            .call(&format!("sample {}", sample.id), |id| {
                ExternalRequest::new(id, sample)
            })
            .map_err(|error| external_error(&self.name, sample, error))?;
        parse_answer(&answer)
            .map_err(|message| external_error(&self.name, sample, ExternalError::Failed(message)))
    }
}

/// The scorer error for a failed external call.
pub(super) fn external_error(scorer: &str, sample: &Sample, error: ExternalError) -> ScoreError {
    match error {
        ExternalError::TimedOut(limit) => ScoreError::TimedOut {
            scorer: scorer.to_string(),
            sample_id: sample.id,
            limit,
        },
        ExternalError::Failed(message) => ScoreError::External {
            scorer: scorer.to_string(),
            sample_id: sample.id,
            message,
        },
    }
}

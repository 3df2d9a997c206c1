//! The scorer interface: what a scorer receives ([`Sample`]), what it returns ([`Score`]) and how
//! it fails ([`ScoreError`]).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One generated response to be scored, with everything a scorer may look at.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Caller-chosen identifier, returned unchanged with the score.
    pub id: u64,
    /// The dataset row's `data_source` column; selects the scorer in the registry.
    pub data_source: String,
    /// The row's prompt as it was rendered for the policy: chat messages (`[{role, content}]`)
    /// or a plain string; `null` when the caller has none. A reward model reads it with the
    /// response.
    #[serde(default)]
    pub prompt: serde_json::Value,
    /// The decoded response text (special tokens and the trailing EOS already removed).
    pub response: String,
    /// The row's `reward_model.ground_truth`.
    pub ground_truth: String,
    /// The row's other columns (e.g. `extra_info`, or every column of a TRL-style dataset).
    #[serde(default)]
    pub extra: serde_json::Value,
    /// Length of the response in tokens (used by the overlong penalty).
    pub response_length: usize,
    /// Whether generation stopped at the length limit rather than at a stop token.
    pub truncated: bool,
}

/// A scorer's verdict: the reward plus optional named values for the metrics (e.g. `acc`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// The reward.
    pub value: f64,
    /// Named extra values, averaged per name in the run's metrics.
    #[serde(default)]
    pub extras: BTreeMap<String, f64>,
    /// The answer the scorer extracted (VeRL's `pred`), for validation's majority votes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pred: Option<String>,
}

impl Score {
    /// A score with no extras.
    pub fn new(value: f64) -> Self {
        Self {
            value,
            extras: BTreeMap::new(),
            pred: None,
        }
    }

    /// Sets the extracted answer (builder style).
    pub fn with_pred(mut self, pred: impl Into<String>) -> Self {
        self.pred = Some(pred.into());
        self
    }

    /// Adds a named extra value (builder style).
    pub fn with_extra(mut self, name: &str, value: f64) -> Self {
        self.extras.insert(name.to_string(), value);
        self
    }
}

/// Why a sample could not be scored. The pool gives such a sample a reward of 0.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ScoreError {
    /// The registry has no scorer for the sample's `data_source`.
    #[error(
        "no scorer for data_source `{data_source}` and no `reward.default`: add \
         `reward.data_sources.\"{data_source}\": <scorer>` or set `reward.default` in the recipe"
    )]
    NoScorer {
        /// The sample's data source.
        data_source: String,
    },
    /// The scorer panicked (a bug in a built-in or user Rust scorer).
    #[error("scorer `{scorer}` panicked on sample {sample_id}: {message}")]
    Panicked {
        /// Scorer name.
        scorer: String,
        /// Sample id.
        sample_id: u64,
        /// The panic payload, when it was a string.
        message: String,
    },
    /// The scorer did not answer within its time limit.
    #[error("scorer `{scorer}` did not finish sample {sample_id} within {limit:?}; raise its `timeout_s` or fix the scorer")]
    TimedOut {
        /// Scorer name.
        scorer: String,
        /// Sample id.
        sample_id: u64,
        /// The limit that was exceeded.
        limit: Duration,
    },
    /// The scorer returned NaN or an infinity.
    #[error("scorer `{scorer}` returned the non-finite score {value} for sample {sample_id}")]
    NonFinite {
        /// Scorer name.
        scorer: String,
        /// Sample id.
        sample_id: u64,
        /// The returned value.
        value: f64,
    },
    /// The sample's ground truth cannot be used by this scorer.
    #[error("scorer `{scorer}`: ground truth {ground_truth:?} of sample {sample_id} is unusable: {reason}")]
    BadGroundTruth {
        /// Scorer name.
        scorer: String,
        /// Sample id.
        sample_id: u64,
        /// The ground truth as given.
        ground_truth: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An external scorer (child process or HTTP endpoint) failed: it crashed, refused the
    /// connection, answered with an HTTP error, or wrote something that is not a valid answer.
    #[error("external scorer `{scorer}` failed on sample {sample_id}: {message}")]
    External {
        /// Scorer name.
        scorer: String,
        /// Sample id.
        sample_id: u64,
        /// What happened.
        message: String,
    },
    /// A model scorer (a reward model) could not score the sample: the conversation could not
    /// be rendered or tokenized, is too long, or the device failed.
    #[error("reward model `{scorer}` failed on sample {sample_id}: {message}")]
    Model {
        /// Scorer name.
        scorer: String,
        /// Sample id.
        sample_id: u64,
        /// What happened and what to do.
        message: String,
    },
}

impl ScoreError {
    /// A short name of the error kind, used as a metrics key (`timeout`, `panic`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            ScoreError::NoScorer { .. } => "no_scorer",
            ScoreError::Panicked { .. } => "panic",
            ScoreError::TimedOut { .. } => "timeout",
            ScoreError::NonFinite { .. } => "non_finite",
            ScoreError::BadGroundTruth { .. } => "bad_ground_truth",
            ScoreError::External { .. } => "external",
            ScoreError::Model { .. } => "model",
        }
    }
}

/// A scoring rule. Implementations must be cheap to share between the pool's worker threads.
pub trait Scorer: Send + Sync {
    /// The name used in logs, errors and metrics.
    fn name(&self) -> &str;

    /// Scores one sample.
    fn score(&self, sample: &Sample) -> Result<Score, ScoreError>;
}

/// A scorer made from a name and a closure (for tests and for Rust users plugging in their own
/// rule).
pub struct FnScorer<F> {
    name: String,
    function: F,
}

impl<F> FnScorer<F>
where
    F: Fn(&Sample) -> Result<Score, ScoreError> + Send + Sync,
{
    /// Wraps `function` as a scorer called `name`.
    pub fn new(name: &str, function: F) -> Self {
        Self {
            name: name.to_string(),
            function,
        }
    }
}

impl<F> Scorer for FnScorer<F>
where
    F: Fn(&Sample) -> Result<Score, ScoreError> + Send + Sync,
{
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        (self.function)(sample)
    }
}

#[cfg(test)]
pub(crate) fn sample(response: &str, ground_truth: &str) -> Sample {
    Sample {
        id: 0,
        data_source: "test".to_string(),
        prompt: serde_json::Value::Null,
        response: response.to_string(),
        ground_truth: ground_truth.to_string(),
        extra: serde_json::Value::Null,
        response_length: response.len(),
        truncated: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fn_scorer_calls_its_closure_and_errors_name_the_fix() {
        let scorer = FnScorer::new("len", |s: &Sample| {
            Ok(Score::new(s.response.len() as f64).with_extra("x", 2.0))
        });
        let score = scorer.score(&sample("abcd", "")).unwrap();
        assert_eq!(score.value, 4.0);
        assert_eq!(score.extras["x"], 2.0);
        assert_eq!(scorer.name(), "len");
        let error = ScoreError::NoScorer {
            data_source: "foo/bar".into(),
        };
        assert_eq!(error.kind(), "no_scorer");
        assert!(
            error.to_string().contains("reward.data_sources.\"foo/bar\""),
            "{error}"
        );
    }
}

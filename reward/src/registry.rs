//! The reward function of a run: picks a scorer by the sample's `data_source`, runs it, checks
//! the result and adds DAPO's overlong penalty.
//!
//! Lookup order for a data source: an exact entry (recipe `reward.data_sources` entries first,
//! then VeRL's names, [`VERL_DATA_SOURCES`]), then a prefix rule (VeRL's `aime*` →
//! `math_dapo`), then the default scorer (`reward.default`), else a [`ScoreError::NoScorer`]
//! error. VeRL's `default_compute_score` (`verl/utils/reward_score/__init__.py`, commit
//! b178a3cd56f58b2d502255daba591e92833930a7) is the model for the built-in table.

use std::collections::HashMap;
use std::sync::Arc;

use crate::overlong::OverlongPenalty;
use crate::scorer::{Sample, Score, ScoreError, Scorer};

/// VeRL's data-source names and the built-in scorer each maps to, plus this project's
/// arithmetic task.
pub const VERL_DATA_SOURCES: [(&str, &str); 8] = [
    ("openai/gsm8k", "gsm8k"),
    ("lighteval/MATH", "math"),
    ("DigitalLearningGmbH/MATH-lighteval", "math"),
    ("HuggingFaceH4/MATH-500", "math"),
    ("math_dapo", "math_dapo"),
    ("math", "math_dapo"),
    ("math_dapo_reasoning", "math_dapo"),
    (crate::arithmetic::DATA_SOURCE, "arithmetic"),
];

/// Data-source prefixes and their built-in scorer (VeRL: `data_source.startswith("aime")`).
pub const VERL_DATA_SOURCE_PREFIXES: [(&str, &str); 1] = [("aime", "math_dapo")];

/// The run's reward function (see the module documentation).
#[derive(Clone, Default)]
pub struct RewardFunction {
    by_data_source: HashMap<String, Arc<dyn Scorer>>,
    by_prefix: Vec<(String, Arc<dyn Scorer>)>,
    default: Option<Arc<dyn Scorer>>,
    overlong: Option<OverlongPenalty>,
    log_overlong: bool,
}

impl RewardFunction {
    /// An empty reward function: no scorers, no default, no penalty.
    pub fn new() -> Self {
        Self::default()
    }

    /// Uses `scorer` for samples whose `data_source` is exactly `data_source`.
    pub fn with_data_source(mut self, data_source: &str, scorer: Arc<dyn Scorer>) -> Self {
        self.by_data_source.insert(data_source.to_string(), scorer);
        self
    }

    /// Uses `scorer` for data sources starting with `prefix` that have no exact entry.
    pub fn with_prefix(mut self, prefix: &str, scorer: Arc<dyn Scorer>) -> Self {
        self.by_prefix.push((prefix.to_string(), scorer));
        self
    }

    /// Uses `scorer` for every data source without an entry.
    pub fn with_default(mut self, scorer: Arc<dyn Scorer>) -> Self {
        self.default = Some(scorer);
        self
    }

    /// Adds DAPO's overlong penalty to every score; with `log`, also the extras
    /// `overlong_reward` and `overlong` (1 when penalised), as VeRL's `overlong_buffer.log`.
    pub fn with_overlong_penalty(mut self, penalty: OverlongPenalty, log: bool) -> Self {
        self.overlong = Some(penalty);
        self.log_overlong = log;
        self
    }

    /// The scorer for `data_source`, if any.
    pub fn scorer_for(&self, data_source: &str) -> Option<&Arc<dyn Scorer>> {
        self.by_data_source
            .get(data_source)
            .or_else(|| {
                self.by_prefix
                    .iter()
                    .find(|(prefix, _)| data_source.starts_with(prefix.as_str()))
                    .map(|(_, scorer)| scorer)
            })
            .or(self.default.as_ref())
    }

    /// Checks up front that every data source of a dataset has a scorer, so a misconfigured run
    /// fails at start rather than scoring everything 0.
    pub fn check_data_sources<'a>(
        &self,
        data_sources: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), ScoreError> {
        for data_source in data_sources {
            if self.scorer_for(data_source).is_none() {
                return Err(ScoreError::NoScorer {
                    data_source: data_source.to_string(),
                });
            }
        }
        Ok(())
    }

    /// Scores `sample`: its scorer's result (which must be finite), plus the overlong penalty.
    pub fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let scorer = self
            .scorer_for(&sample.data_source)
            .ok_or_else(|| ScoreError::NoScorer {
                data_source: sample.data_source.clone(),
            })?;
        let mut score = scorer.score(sample)?;
        let non_finite = std::iter::once(&score.value)
            .chain(score.extras.values())
            .find(|value| !value.is_finite());
        if let Some(&value) = non_finite {
            return Err(ScoreError::NonFinite {
                scorer: scorer.name().to_string(),
                sample_id: sample.id,
                value,
            });
        }
        if let Some(overlong) = &self.overlong {
            let penalty = overlong.penalty(sample.response_length);
            score.value += penalty;
            if self.log_overlong {
                score.extras.insert("overlong_reward".to_string(), penalty);
                score
                    .extras
                    .insert("overlong".to_string(), if penalty < 0.0 { 1.0 } else { 0.0 });
            }
        }
        Ok(score)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gsm8k::{Gsm8kMethod, Gsm8kScorer};
    use crate::math_dapo::MathDapoScorer;
    use crate::scorer::{sample, FnScorer};

    fn with_source(data_source: &str, response: &str, truth: &str) -> Sample {
        Sample {
            data_source: data_source.to_string(),
            ..sample(response, truth)
        }
    }

    #[test]
    fn lookup_order_and_overlong_penalty() {
        let reward = RewardFunction::new()
            .with_data_source(
                "openai/gsm8k",
                Arc::new(Gsm8kScorer::new("gsm8k", Gsm8kMethod::Strict)),
            )
            .with_prefix("aime", Arc::new(MathDapoScorer::new("math_dapo")))
            .with_overlong_penalty(
                OverlongPenalty {
                    buffer_len: 10,
                    penalty_factor: 1.0,
                    max_response_length: 100,
                },
                true,
            );
        let mut gsm8k = with_source("openai/gsm8k", "#### 3", "3");
        gsm8k.response_length = 95;
        let score = reward.score(&gsm8k).unwrap();
        assert_eq!(score.value, 0.5);
        assert_eq!(
            (score.extras["overlong_reward"], score.extras["overlong"]),
            (-0.5, 1.0)
        );
        let aime = reward.score(&with_source("aime_2024", "Answer: 7", "7")).unwrap();
        assert_eq!(aime.value, 1.0);
        assert_eq!(aime.extras["overlong"], 0.0);
        let error = reward.score(&with_source("unknown/set", "", "")).unwrap_err();
        assert_eq!(
            error,
            ScoreError::NoScorer {
                data_source: "unknown/set".into()
            }
        );
        assert!(reward
            .check_data_sources(["openai/gsm8k", "aime25", "unknown/set"])
            .is_err());
        let reward = reward.with_default(Arc::new(FnScorer::new("nan", |_: &Sample| {
            Ok(Score::new(f64::NAN))
        })));
        assert!(reward.check_data_sources(["unknown/set"]).is_ok());
        let error = reward.score(&with_source("unknown/set", "", "")).unwrap_err();
        assert_eq!(error.kind(), "non_finite");
        assert!(
            error
                .to_string()
                .contains("scorer `nan` returned the non-finite score NaN"),
            "{error}"
        );
    }
}

//! The reward an interaction gave an episode: a multi-turn sample's `turn_scores` (one per
//! interaction reply that carried a reward, VeRL's name), which the rollout passes to scorers
//! in the sample's `extra`, reduced to one number. An episode without any is scored 0.
//!
//! Extras: `turns_scored` (how many turn scores the episode had).

use serde::{Deserialize, Serialize};

use crate::scorer::{Sample, Score, ScoreError, Scorer};

/// How the turn scores become the reward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnReduce {
    /// The last turn's score (an interaction that grades the final answer).
    #[default]
    Last,
    /// Their sum (rewards for each step of a task).
    Sum,
    /// The best of them.
    Max,
}

/// The `turn_scores` scorer.
pub struct TurnScoresScorer {
    name: String,
    reduce: TurnReduce,
}

impl TurnScoresScorer {
    /// A scorer named `name` reducing with `reduce`.
    pub fn new(name: &str, reduce: TurnReduce) -> Self {
        Self {
            name: name.to_string(),
            reduce,
        }
    }
}

impl Scorer for TurnScoresScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let scores: Vec<f64> = sample
            .extra
            .get("turn_scores")
            .and_then(serde_json::Value::as_array)
            .map(|a| a.iter().filter_map(serde_json::Value::as_f64).collect())
            .unwrap_or_default();
        let value = match self.reduce {
            _ if scores.is_empty() => 0.0,
            TurnReduce::Last => scores[scores.len() - 1],
            TurnReduce::Sum => scores.iter().sum(),
            TurnReduce::Max => scores.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        };
        let mut score = Score::new(value);
        score.extras.insert("turns_scored".into(), scores.len() as f64);
        Ok(score)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample(extra: serde_json::Value) -> Sample {
        Sample {
            id: 1,
            data_source: "d".into(),
            prompt: serde_json::Value::Null,
            response: "r".into(),
            ground_truth: String::new(),
            extra,
            response_length: 1,
            truncated: false,
        }
    }

    #[test]
    fn reduces_the_turn_scores() {
        let s = sample(json!({"turn_scores": [0.0, 0.5, 0.25]}));
        let score = |reduce| TurnScoresScorer::new("t", reduce).score(&s).unwrap();
        assert_eq!(score(TurnReduce::Last).value, 0.25);
        assert_eq!(score(TurnReduce::Sum).value, 0.75);
        assert_eq!(score(TurnReduce::Max).value, 0.5);
        assert_eq!(score(TurnReduce::Last).extras["turns_scored"], 3.0);
        let none = TurnScoresScorer::new("t", TurnReduce::Max)
            .score(&sample(json!({})))
            .unwrap();
        assert_eq!((none.value, none.extras["turns_scored"]), (0.0, 0.0));
    }
}

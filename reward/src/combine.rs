//! Weighted combinations of scorers, e.g. `0.9 * correctness + 0.1 * format`.

use std::sync::Arc;

use crate::scorer::{Sample, Score, ScoreError, Scorer};

/// One weighted part.
#[derive(Clone)]
pub struct WeightedPart {
    /// The part's scorer.
    pub scorer: Arc<dyn Scorer>,
    /// Its weight.
    pub weight: f64,
}

/// `Σ weight_i · score_i`. Extras: each part's score under the part's scorer name, and each
/// part's extras as `<scorer name>/<extra name>`. A failing part fails the whole combination.
#[derive(Clone)]
pub struct WeightedScorer {
    name: String,
    parts: Vec<WeightedPart>,
}

impl WeightedScorer {
    /// A weighted sum called `name`.
    pub fn new(name: &str, parts: Vec<WeightedPart>) -> Self {
        Self {
            name: name.to_string(),
            parts,
        }
    }
}

impl Scorer for WeightedScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let mut total = Score::new(0.0);
        for part in &self.parts {
            let score = part.scorer.score(sample)?;
            total.value += part.weight * score.value;
            let name = part.scorer.name();
            total.extras.insert(name.to_string(), score.value);
            for (extra, value) in score.extras {
                total.extras.insert(format!("{name}/{extra}"), value);
            }
        }
        Ok(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::TagFormatScorer;
    use crate::gsm8k::{Gsm8kMethod, Gsm8kScorer};
    use crate::scorer::sample;

    #[test]
    fn correctness_plus_format() {
        let combined = WeightedScorer::new(
            "combo",
            vec![
                WeightedPart {
                    scorer: Arc::new(Gsm8kScorer::new("gsm8k", Gsm8kMethod::Strict)),
                    weight: 0.9,
                },
                WeightedPart {
                    scorer: Arc::new(
                        TagFormatScorer::new("tags", &["think".into(), "answer".into()], 1.0).unwrap(),
                    ),
                    weight: 0.1,
                },
            ],
        );
        let both = combined
            .score(&sample("<think>t</think><answer>#### 5</answer>", "5"))
            .unwrap();
        assert!((both.value - 1.0).abs() < 1e-12);
        assert_eq!(
            (
                both.extras["gsm8k"],
                both.extras["tags"],
                both.extras["gsm8k/correct"]
            ),
            (1.0, 1.0, 1.0)
        );
        let format_only = combined
            .score(&sample("<think>t</think><answer>#### 4</answer>", "5"))
            .unwrap();
        assert!((format_only.value - 0.1).abs() < 1e-12);
        let correct_only = combined.score(&sample("#### 5", "5")).unwrap();
        assert!((correct_only.value - 0.9).abs() < 1e-12);
    }
}

//! The GSM8K scorer, with the behaviour of VeRL's `verl/utils/reward_score/gsm8k.py`
//! (volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7).
//!
//! - Only the final 300 characters (Unicode scalar values, as Python counts them) of the response
//!   are examined.
//! - `strict`: the last match of `#### (-?[0-9.,]+)`; commas are removed (VeRL also removes `$`,
//!   which the pattern can never capture). The text after `####` must follow exactly one space.
//! - `flexible`: the last match of `-?[0-9.,]+` that is neither empty nor a lone `.`; if every
//!   match is a lone `.`, VeRL's loop leaves the *first* match as the answer, and so does this.
//!   Commas are kept (so `1,000` does not equal `1000` in flexible mode).
//! - The extracted text is compared with the ground truth as strings, exactly: `score` when
//!   equal, `format_score` when an answer was found but differs, 0 when there is no answer.

use std::sync::OnceLock;

use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::scorer::{Sample, Score, ScoreError, Scorer};

/// How many trailing characters of the response VeRL examines (`_SOLUTION_CLIP_CHARS`).
pub const SOLUTION_CLIP_CHARS: usize = 300;

/// How the answer is extracted from the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Gsm8kMethod {
    /// The last `#### <number>`.
    #[default]
    Strict,
    /// The last number anywhere.
    Flexible,
}

fn strict_pattern() -> &'static Regex {
    static PATTERN: OnceLock<Regex> = OnceLock::new();
    PATTERN.get_or_init(|| Regex::new(r"#### (-?[0-9.,]+)").expect("valid regex"))
}

fn number_pattern() -> &'static Regex {
    static PATTERN: OnceLock<Regex> = OnceLock::new();
    PATTERN.get_or_init(|| Regex::new(r"-?[0-9.,]+").expect("valid regex"))
}

/// The last `max_chars` characters of `text` (all of it when shorter).
pub(crate) fn last_chars(text: &str, max_chars: usize) -> &str {
    let count = text.chars().count();
    if count <= max_chars {
        return text;
    }
    let start = text
        .char_indices()
        .nth(count - max_chars)
        .map(|(index, _)| index)
        .unwrap_or(0);
    &text[start..]
}

/// Extracts the answer the way VeRL's `extract_solution` does; `None` when there is none.
pub fn extract_solution(response: &str, method: Gsm8kMethod) -> Option<String> {
    let clipped = last_chars(response, SOLUTION_CLIP_CHARS);
    match method {
        Gsm8kMethod::Strict => strict_pattern()
            .captures_iter(clipped)
            .last()
            .map(|captures| captures[1].replace([',', '$'], "")),
        Gsm8kMethod::Flexible => {
            let matches: Vec<&str> = number_pattern().find_iter(clipped).map(|m| m.as_str()).collect();
            let valid = matches
                .iter()
                .rev()
                .find(|candidate| !candidate.is_empty() && **candidate != ".");
            // VeRL's `for final_answer in reversed(answer)` leaves the loop variable at the first
            // element when nothing valid is found.
            valid.or(matches.first()).map(|answer| answer.to_string())
        }
    }
}

/// VeRL's `compute_score` for GSM8K.
pub fn compute_score(
    response: &str,
    ground_truth: &str,
    method: Gsm8kMethod,
    format_score: f64,
    score: f64,
) -> f64 {
    match extract_solution(response, method) {
        None => 0.0,
        Some(answer) if answer == ground_truth => score,
        Some(_) => format_score,
    }
}

/// The GSM8K scorer. Extras: `correct` (1 when correct) and `format` (1 when an answer was found);
/// not `acc`, which VeRL's gsm8k scorer does not report: with it the validation's core metric
/// would be `val-core/openai/gsm8k/acc/...` instead of VeRL's `.../reward/...`.
#[derive(Debug, Clone)]
pub struct Gsm8kScorer {
    name: String,
    /// Extraction method.
    pub method: Gsm8kMethod,
    /// Reward for a found but wrong answer.
    pub format_score: f64,
    /// Reward for a correct answer.
    pub score: f64,
}

impl Gsm8kScorer {
    /// A scorer with VeRL's defaults for `method` (`format_score` 0, `score` 1).
    pub fn new(name: &str, method: Gsm8kMethod) -> Self {
        Self {
            name: name.to_string(),
            method,
            format_score: 0.0,
            score: 1.0,
        }
    }
}

impl Scorer for Gsm8kScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let answer = extract_solution(&sample.response, self.method);
        let correct = answer.as_deref() == Some(sample.ground_truth.as_str());
        let value = match (&answer, correct) {
            (None, _) => 0.0,
            (Some(_), true) => self.score,
            (Some(_), false) => self.format_score,
        };
        Ok(Score::new(value)
            .with_extra("correct", if correct { 1.0 } else { 0.0 })
            .with_extra("format", if answer.is_some() { 1.0 } else { 0.0 }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorer::sample;

    #[test]
    fn strict_takes_the_last_marker_and_strips_commas() {
        assert_eq!(
            extract_solution("#### 1 then #### 1,234", Gsm8kMethod::Strict).as_deref(),
            Some("1234")
        );
        assert_eq!(extract_solution("####1", Gsm8kMethod::Strict), None);
        assert_eq!(extract_solution("no number", Gsm8kMethod::Flexible), None);
        assert_eq!(
            extract_solution("a . b .", Gsm8kMethod::Flexible).as_deref(),
            Some(".")
        );
        assert_eq!(
            extract_solution("7 and 1,000.", Gsm8kMethod::Flexible).as_deref(),
            Some("1,000.")
        );
    }

    #[test]
    fn only_the_last_300_characters_count() {
        let response = format!("#### 42{}", "é".repeat(300));
        assert_eq!(extract_solution(&response, Gsm8kMethod::Strict), None);
        let response = format!("#### 42{}", "é".repeat(293));
        assert_eq!(
            extract_solution(&response, Gsm8kMethod::Strict).as_deref(),
            Some("42")
        );
    }

    #[test]
    fn scorer_reports_score_and_extras() {
        let mut scorer = Gsm8kScorer::new("gsm8k", Gsm8kMethod::Strict);
        scorer.format_score = 0.1;
        let right = scorer.score(&sample("so #### 18", "18")).unwrap();
        assert_eq!(
            (right.value, right.extras["correct"], right.extras["format"]),
            (1.0, 1.0, 1.0)
        );
        let wrong = scorer.score(&sample("so #### 17", "18")).unwrap();
        assert_eq!(
            (wrong.value, wrong.extras["correct"], wrong.extras["format"]),
            (0.1, 0.0, 1.0)
        );
        let none = scorer.score(&sample("so 18", "18")).unwrap();
        assert_eq!((none.value, none.extras["format"]), (0.0, 0.0));
    }
}

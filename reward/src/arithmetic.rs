//! The scorer of this project's synthetic arithmetic task (`data_source` `grpo/arithmetic`).
//!
//! The generator's prompt may ask for any of these forms; all are accepted:
//! **`#### <integer>`** (GSM8K's convention, e.g. `#### -42`), **`<answer><integer></answer>`**,
//! or the integer alone (`grpo preprocess arithmetic --answer-format number`).
//!
//! Exactly:
//! 0. If the whole response, trimmed, is one integer with no inner whitespace (optional sign,
//!    one optional trailing `.`), that is the answer.
//! 1. Otherwise, if the response has an `<answer>...</answer>` pair, the answer is its last one (the last
//!    `</answer>` and the last `<answer>` before it): all whitespace inside is removed, then one
//!    trailing `.`; what is left must be an optional `+`/`-` and ASCII digits (leading zeros
//!    allowed), else there is no answer.
//! 2. Otherwise the answer is the last match of `####`, optional spaces, an optional sign,
//!    optional spaces, and digits that may contain `,` separators (removed); whatever follows the
//!    digits (`.`, units, text) is ignored.
//! 3. The answer must fit in 128 bits; it is compared as an integer with the ground truth (parsed
//!    as in step 1, and an error if it is not an integer): equal gives `score` (default 1),
//!    different gives `format_score` (default 0), no answer gives 0.
//!
//! Extras: `acc` (1 when correct) and `format` (1 when an integer answer was found).

use std::sync::OnceLock;

use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::scorer::{Sample, Score, ScoreError, Scorer};

/// The VeRL `data_source` name of the arithmetic task.
pub const DATA_SOURCE: &str = "grpo/arithmetic";

fn marker_pattern() -> &'static Regex {
    static PATTERN: OnceLock<Regex> = OnceLock::new();
    PATTERN.get_or_init(|| Regex::new(r"####[ \t]*([+-]?)[ \t]*([0-9][0-9,]*)").expect("valid regex"))
}

/// The integer answer of a response (steps 1–2 of the module's rule), if any.
pub fn extract_answer(response: &str) -> Option<i128> {
    let whole = response.trim();
    if !whole.contains(char::is_whitespace) {
        if let Some(n) = parse_integer(whole) {
            return Some(n);
        }
    }
    if let Some(close) = response.rfind("</answer>") {
        if let Some(open) = response[..close].rfind("<answer>") {
            return parse_integer(&response[open + "<answer>".len()..close]);
        }
    }
    let captures = marker_pattern().captures_iter(response).last()?;
    let digits = captures[2].replace(',', "");
    format!("{}{digits}", &captures[1]).parse::<i128>().ok()
}

/// Parses an integer written alone (the rule inside `<answer>` tags, step 1).
pub fn parse_integer(text: &str) -> Option<i128> {
    let compact: String = text.chars().filter(|c| !c.is_whitespace()).collect();
    let compact = compact.strip_suffix('.').unwrap_or(&compact);
    let digits = compact.strip_prefix(['+', '-']).unwrap_or(compact);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    compact.parse::<i128>().ok()
}

/// Scoring parameters of the arithmetic task.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ArithmeticScorer {
    /// Reward for a correct answer.
    pub score: f64,
    /// Reward for a well-formed but wrong answer.
    pub format_score: f64,
}

impl Default for ArithmeticScorer {
    fn default() -> Self {
        Self {
            score: 1.0,
            format_score: 0.0,
        }
    }
}

impl Scorer for ArithmeticScorer {
    fn name(&self) -> &str {
        "arithmetic"
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let expected = parse_integer(&sample.ground_truth).ok_or_else(|| ScoreError::BadGroundTruth {
            scorer: "arithmetic".to_string(),
            sample_id: sample.id,
            ground_truth: sample.ground_truth.clone(),
            reason: "it is not an integer; the arithmetic task's ground truth must be one, e.g. \"-42\""
                .to_string(),
        })?;
        let answer = extract_answer(&sample.response);
        let correct = answer == Some(expected);
        let value = match answer {
            None => 0.0,
            Some(_) if correct => self.score,
            Some(_) => self.format_score,
        };
        Ok(Score::new(value)
            .with_extra("acc", if correct { 1.0 } else { 0.0 })
            .with_extra("format", if answer.is_some() { 1.0 } else { 0.0 }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorer::sample;

    #[test]
    fn answer_rule_table() {
        let cases: [(&str, &str, f64, f64); 23] = [
            ("<answer>42</answer>", "42", 1.0, 1.0),
            ("<answer> 42. </answer>", "42", 1.0, 1.0),
            ("<answer>- 7</answer>", "-7", 1.0, 1.0),
            ("<answer>+7</answer>", "7", 1.0, 1.0),
            ("<answer>007</answer>", "7", 1.0, 1.0),
            ("<answer>1 000</answer>", "1000", 1.0, 1.0),
            ("<answer>41</answer>", "42", 0.0, 1.0),
            ("<answer>1</answer> then <answer>2</answer>", "2", 1.0, 1.0),
            ("<answer>4.5</answer>", "4", 0.0, 0.0),
            ("<answer>42..</answer>", "42", 0.0, 0.0),
            ("<answer>forty-two</answer>", "42", 0.0, 0.0),
            ("so #### 42.\nthanks", "42", 1.0, 1.0),
            ("#### 42 apples", "42", 1.0, 1.0),
            ("#### - 1,234", "-1234", 1.0, 1.0),
            ("#### 3 then #### 4", "3", 0.0, 1.0),
            ("#### forty", "40", 0.0, 0.0),
            ("<answer>x</answer> #### 40", "40", 0.0, 0.0),
            ("42", "42", 1.0, 1.0),
            (" -2.\n", "-2", 1.0, 1.0),
            ("41", "42", 0.0, 1.0),
            ("4 2", "42", 0.0, 0.0),
            ("The answer is 42", "42", 0.0, 0.0),
            ("<answer>42", "42", 0.0, 0.0),
        ];
        let scorer = ArithmeticScorer {
            score: 1.0,
            format_score: 0.0,
        };
        for (response, truth, value, format) in cases {
            let score = scorer.score(&sample(response, truth)).unwrap();
            assert_eq!(
                (score.value, score.extras["format"]),
                (value, format),
                "{response:?} vs {truth:?}"
            );
        }
    }

    #[test]
    fn non_integer_ground_truth_is_an_error() {
        let error = ArithmeticScorer::default()
            .score(&sample("<answer>1</answer>", "1/2"))
            .unwrap_err();
        assert!(
            error.to_string().contains("\"1/2\" of sample 0 is unusable"),
            "{error}"
        );
    }
}

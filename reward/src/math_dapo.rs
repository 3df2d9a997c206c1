//! DAPO's math scorer, with the behaviour of VeRL's `verl/utils/reward_score/math_dapo.py`
//! (volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7; Minerva-style
//! normalisation), used by VeRL for `math_dapo`, `math`, `math_dapo_reasoning` and `aime*`.
//!
//! Only the last 300 characters are examined. The answer is the text after the last
//! `Answer:` (case-insensitive) up to the end of its line; it and the ground truth go through
//! [`normalize_final_answer`] and are compared as strings. Reward 1 when correct, -1 otherwise
//! (VeRL's convention for this scorer); extra `acc` is 1 or 0.
//!
//! Difference from Python: `str.isdigit` also accepts non-ASCII digits (`²`, `٣`); here only
//! ASCII digits count when deciding whether to drop thousands separators.

use std::sync::OnceLock;

use regex::Regex;

use crate::gsm8k::last_chars;
use crate::scorer::{Sample, Score, ScoreError, Scorer};

/// `(before, after)` replacements applied in order (VeRL's `SUBSTITUTIONS`).
const SUBSTITUTIONS: [(&str, &str); 10] = [
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
];

/// Substrings deleted in order (VeRL's `REMOVED_EXPRESSIONS`).
const REMOVED_EXPRESSIONS: [&str; 41] = [
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    "\"",
    "\\dots",
];

struct Patterns {
    dollars: Regex,
    text: Regex,
    textbf: Regex,
    overline: Regex,
    boxed: Regex,
    frac: Regex,
    sqrt: Regex,
    answer: Regex,
}

fn patterns() -> &'static Patterns {
    static PATTERNS: OnceLock<Patterns> = OnceLock::new();
    PATTERNS.get_or_init(|| {
        let compile = |pattern: &str| Regex::new(pattern).expect("valid regex");
        Patterns {
            dollars: compile(r"(.*?)(\$)(.*?)(\$)(.*)"),
            text: compile(r"(\\text\{)(.*?)(\})"),
            textbf: compile(r"(\\textbf\{)(.*?)(\})"),
            overline: compile(r"(\\overline\{)(.*?)(\})"),
            boxed: compile(r"(\\boxed\{)(.*)(\})"),
            frac: compile(r"(frac)([^{])(.)"),
            sqrt: compile(r"(sqrt)([^{])"),
            answer: compile(r"(?i)Answer\s*:\s*([^\n]+)"),
        }
    })
}

/// VeRL's `normalize_final_answer` (Minerva): keep the part after the last `=`, apply the
/// substitutions and removals, unwrap `$...$`, `\text{}`, `\textbf{}`, `\overline{}`, `\boxed{}`,
/// expand `\fracab` and `\sqrta`, drop `$`, drop commas from a pure number, trim.
pub fn normalize_final_answer(answer: &str) -> String {
    let patterns = patterns();
    let mut answer = answer.rsplit('=').next().unwrap_or("").to_string();
    for (before, after) in SUBSTITUTIONS {
        answer = answer.replace(before, after);
    }
    for expression in REMOVED_EXPRESSIONS {
        answer = answer.replace(expression, "");
    }
    answer = patterns.dollars.replace_all(&answer, "$$${3}$$").into_owned();
    answer = patterns.text.replace_all(&answer, "${2}").into_owned();
    answer = patterns.textbf.replace_all(&answer, "${2}").into_owned();
    answer = patterns.overline.replace_all(&answer, "${2}").into_owned();
    answer = patterns.boxed.replace_all(&answer, "${2}").into_owned();
    answer = patterns
        .frac
        .replace_all(&answer, "frac{${2}}{${3}}")
        .into_owned();
    answer = patterns.sqrt.replace_all(&answer, "sqrt{${2}}").into_owned();
    answer = answer.replace('$', "");
    let without_commas = answer.replace(',', "");
    if !without_commas.is_empty() && without_commas.chars().all(|c| c.is_ascii_digit()) {
        answer = without_commas;
    }
    answer.trim().to_string()
}

/// VeRL's `compute_score` for DAPO math with `strict_box_verify=False`: returns the reward
/// (1 or -1) and the normalised prediction (`[INVALID]` when no `Answer:` line was found).
pub fn compute_score(response: &str, ground_truth: &str) -> (f64, String) {
    let clipped = last_chars(response, 300);
    let extracted = patterns()
        .answer
        .captures_iter(clipped)
        .last()
        .map(|captures| captures[1].to_string())
        .unwrap_or_else(|| "[INVALID]".to_string());
    let prediction = normalize_final_answer(&extracted);
    let correct = prediction == normalize_final_answer(ground_truth);
    (if correct { 1.0 } else { -1.0 }, prediction)
}

/// The DAPO math scorer. Extras: `acc` (1 when correct, else 0).
#[derive(Debug, Clone)]
pub struct MathDapoScorer {
    name: String,
}

impl MathDapoScorer {
    /// A DAPO math scorer called `name`.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
        }
    }
}

impl Scorer for MathDapoScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        // VeRL's math_dapo reports its score, accuracy and prediction.
        let (value, pred) = compute_score(&sample.response, &sample.ground_truth);
        Ok(Score::new(value)
            .with_extra("score", value)
            .with_extra("acc", if value > 0.0 { 1.0 } else { 0.0 })
            .with_pred(pred))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minerva_normalisation() {
        assert_eq!(normalize_final_answer("x = 1,000"), "1000");
        assert_eq!(normalize_final_answer("$\\frac12$"), "\\frac{1}{2}");
        assert_eq!(normalize_final_answer("\\text{5 feet}"), "5");
        assert_eq!(normalize_final_answer("\\boxed{34}"), "34");
        assert_eq!(
            compute_score("work...\nAnswer: 34", "34"),
            (1.0, "34".to_string())
        );
        assert_eq!(
            compute_score("no answer line", "34"),
            (-1.0, "[INVALID]".to_string())
        );
    }
}

//! Format rewards: reward a response for its shape, not its correctness.
//!
//! - [`RegexFormatScorer`]: `score` when a regular expression matches the response (anywhere, or
//!   the whole response with `full_match`), else 0;
//! - [`TagFormatScorer`]: `score` when the response is a sequence of tag blocks in a given order,
//!   e.g. `<think>...</think><answer>...</answer>`, else 0.

use regex::Regex;

use crate::scorer::{Sample, Score, ScoreError, Scorer};

/// `score` when `pattern` matches the response. Extra: `format` (1 or 0).
#[derive(Debug, Clone)]
pub struct RegexFormatScorer {
    name: String,
    pattern: Regex,
    score: f64,
}

impl RegexFormatScorer {
    /// Compiles `pattern` (Rust `regex` syntax; prefix `(?s)` to let `.` match newlines). With
    /// `full_match` the pattern must match the whole response.
    pub fn new(name: &str, pattern: &str, full_match: bool, score: f64) -> Result<Self, regex::Error> {
        let pattern = if full_match {
            Regex::new(&format!(r"\A(?:{pattern})\z"))?
        } else {
            Regex::new(pattern)?
        };
        Ok(Self {
            name: name.to_string(),
            pattern,
            score,
        })
    }
}

impl Scorer for RegexFormatScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let matched = self.pattern.is_match(&sample.response);
        Ok(Score::new(if matched { self.score } else { 0.0 })
            .with_extra("format", if matched { 1.0 } else { 0.0 }))
    }
}

/// `score` when the response, ignoring surrounding whitespace, is exactly the blocks
/// `<t1>...</t1>`, `<t2>...</t2>`, ... in order, separated only by whitespace, with every tag
/// opened and closed exactly once (so a nested or repeated `<answer>` fails). Block contents may
/// be anything, including newlines. Extra: `format` (1 or 0).
#[derive(Debug, Clone)]
pub struct TagFormatScorer {
    name: String,
    tags: Vec<String>,
    structure: Regex,
    score: f64,
}

impl TagFormatScorer {
    /// A tag-structure check for `tags` in order (e.g. `["think", "answer"]`).
    pub fn new(name: &str, tags: &[String], score: f64) -> Result<Self, regex::Error> {
        let blocks: Vec<String> = tags
            .iter()
            .map(|tag| {
                let tag = regex::escape(tag);
                format!("<{tag}>.*?</{tag}>")
            })
            .collect();
        let structure = Regex::new(&format!(r"(?s)\A\s*{}\s*\z", blocks.join(r"\s*")))?;
        Ok(Self {
            name: name.to_string(),
            tags: tags.to_vec(),
            structure,
            score,
        })
    }
}

impl Scorer for TagFormatScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &Sample) -> Result<Score, ScoreError> {
        let text = &sample.response;
        let each_once = self.tags.iter().all(|tag| {
            text.matches(&format!("<{tag}>")).count() == 1 && text.matches(&format!("</{tag}>")).count() == 1
        });
        let matched = each_once && self.structure.is_match(text);
        Ok(Score::new(if matched { self.score } else { 0.0 })
            .with_extra("format", if matched { 1.0 } else { 0.0 }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scorer::sample;

    #[test]
    fn tag_structure_table() {
        let scorer = TagFormatScorer::new("tags", &["think".to_string(), "answer".to_string()], 1.0).unwrap();
        let cases = [
            ("<think>a\nb</think><answer>3</answer>", 1.0),
            ("  <think>x</think>\n\n<answer>3</answer>\n", 1.0),
            ("<think></think><answer></answer>", 1.0),
            ("<answer>3</answer><think>x</think>", 0.0),
            ("<think>x</think> so <answer>3</answer>", 0.0),
            ("<think>x</think><answer>3</answer> trailing", 0.0),
            ("<think>x</think><answer>3</answer><answer>4</answer>", 0.0),
            ("<think>x <answer>1</answer></think><answer>3</answer>", 0.0),
            ("<think>x</think>", 0.0),
        ];
        for (response, expected) in cases {
            assert_eq!(
                scorer.score(&sample(response, "")).unwrap().value,
                expected,
                "{response:?}"
            );
        }
    }

    #[test]
    fn regex_search_and_full_match() {
        let search = RegexFormatScorer::new("re", r"#### -?\d+", false, 0.5).unwrap();
        assert_eq!(search.score(&sample("so #### 12 ok", "")).unwrap().value, 0.5);
        assert_eq!(search.score(&sample("so 12", "")).unwrap().value, 0.0);
        let full = RegexFormatScorer::new("re", r"(?s).*#### -?\d+", true, 1.0).unwrap();
        assert_eq!(full.score(&sample("a\nb #### 12", "")).unwrap().value, 1.0);
        assert_eq!(full.score(&sample("a\nb #### 12 more", "")).unwrap().value, 0.0);
        assert!(RegexFormatScorer::new("re", "(", false, 1.0).is_err());
    }
}

//! The MATH scorer, with the behaviour of VeRL's `verl/utils/reward_score/math_reward.py`
//! (volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7; itself adapted from
//! EleutherAI's lm-evaluation-harness `hendrycks_math`), used by VeRL for `lighteval/MATH`,
//! `DigitalLearningGmbH/MATH-lighteval` and `HuggingFaceH4/MATH-500`.
//!
//! The answer is the last `\boxed{...}` (braces balanced, so nested braces work); `\boxed x`
//! (a space instead of a brace) takes the text up to the next `$`. `\fbox{...}` is located as
//! VeRL locates it, but VeRL's `remove_boxed` then rejects it, so it scores 0 — kept for parity.
//! Both the answer and the ground truth go through [`strip_string`] and are compared as strings.
//! Where VeRL's normalisation raises an exception (e.g. a `\sqrt` or `\frac` at the very end, two
//! `\text{ ` units), `is_equiv` falls back to comparing the raw strings; this does the same.
//!
//! Not normalised by VeRL (so not here either): trailing `.0` (`2.0` ≠ `2`), thousands separators,
//! `\dfrac` vs `/` with non-integer parts, word numbers.

/// Score 1 when the last boxed answer is equivalent to `ground_truth`, else 0 (VeRL's
/// `compute_score`).
pub fn compute_score(response: &str, ground_truth: &str) -> f64 {
    match last_boxed_only_string(response).and_then(|boxed| remove_boxed(&boxed)) {
        Some(answer) if is_equiv(&answer, ground_truth) => 1.0,
        _ => 0.0,
    }
}

/// VeRL's `is_equiv`: both strings normalised by [`strip_string`] and compared; if the
/// normalisation of either fails, the raw strings are compared.
pub fn is_equiv(first: &str, second: &str) -> bool {
    match (strip_string(first), strip_string(second)) {
        (Some(a), Some(b)) => a == b,
        _ => first == second,
    }
}

/// VeRL's `last_boxed_only_string`: the last `\boxed ...` or `\boxed{...}` (else `\fbox{...}`)
/// including the command, or `None`.
pub fn last_boxed_only_string(text: &str) -> Option<String> {
    if text.contains("\\boxed ") {
        let after = text.rsplit("\\boxed ").next().unwrap_or("");
        let until_dollar = after.split('$').next().unwrap_or("");
        return Some(format!("\\boxed {until_dollar}"));
    }
    let start = text.rfind("\\boxed").or_else(|| text.rfind("\\fbox"))?;
    let mut open_braces: i64 = 0;
    for (offset, byte) in text.as_bytes()[start..].iter().enumerate() {
        match byte {
            b'{' => open_braces += 1,
            b'}' => {
                open_braces -= 1;
                if open_braces == 0 {
                    return Some(text[start..start + offset + 1].to_string());
                }
            }
            _ => {}
        }
    }
    None
}

/// VeRL's `remove_boxed`: the content of `\boxed {...}`/`\boxed{...}`; `None` where VeRL's
/// assertions fail (e.g. for `\fbox{...}`).
pub fn remove_boxed(boxed: &str) -> Option<String> {
    if boxed.contains("\\boxed ") {
        return boxed.strip_prefix("\\boxed ").map(str::to_string);
    }
    boxed
        .strip_prefix("\\boxed{")
        .and_then(|rest| rest.strip_suffix('}'))
        .map(str::to_string)
}

/// VeRL's `fix_fracs`: `\frac12` → `\frac{1}{2}`, `\frac1{72}` → `\frac{1}{72}`. `None` where
/// VeRL raises (a `\frac` at the very end).
fn fix_fracs(string: &str) -> Option<String> {
    let mut pieces = string.split("\\frac");
    let mut result = pieces.next().unwrap_or("").to_string();
    for piece in pieces {
        result.push_str("\\frac");
        let chars: Vec<char> = piece.chars().collect();
        match chars.as_slice() {
            [] => return None,
            ['{', ..] => result.push_str(piece),
            [_] => return Some(string.to_string()),
            [a, b, rest @ ..] => {
                let rest: String = rest.iter().collect();
                if *b != '{' {
                    result.push_str(&format!("{{{a}}}{{{b}}}{rest}"));
                } else {
                    result.push_str(&format!("{{{a}}}{b}{rest}"));
                }
            }
        }
    }
    Some(result)
}

/// True when Python's `str(int(text)) == text`: an optional `-`, then ASCII digits without a
/// leading zero (or `0` itself, but not `-0`).
fn is_canonical_python_int(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    let canonical_digits = !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    canonical_digits && !(text.starts_with('-') && digits == "0")
}

/// VeRL's `fix_a_slash_b`: `3/4` → `\frac{3}{4}` for two integers written canonically.
fn fix_a_slash_b(string: &str) -> String {
    let parts: Vec<&str> = string.split('/').collect();
    match parts.as_slice() {
        [a, b] if is_canonical_python_int(a) && is_canonical_python_int(b) => {
            format!("\\frac{{{a}}}{{{b}}}")
        }
        _ => string.to_string(),
    }
}

/// VeRL's `remove_right_units`: drops everything from `\text{ ` on. `None` where VeRL's assertion
/// fails (more than one `\text{ `).
fn remove_right_units(string: &str) -> Option<String> {
    if !string.contains("\\text{ ") {
        return Some(string.to_string());
    }
    let parts: Vec<&str> = string.split("\\text{ ").collect();
    (parts.len() == 2).then(|| parts[0].to_string())
}

/// VeRL's `fix_sqrt`: `\sqrt3` → `\sqrt{3}`. `None` where VeRL raises (a `\sqrt` at the end).
fn fix_sqrt(string: &str) -> Option<String> {
    if !string.contains("\\sqrt") {
        return Some(string.to_string());
    }
    let mut pieces = string.split("\\sqrt");
    let mut result = pieces.next().unwrap_or("").to_string();
    for piece in pieces {
        let mut chars = piece.chars();
        match chars.next() {
            None => return None,
            Some('{') => {
                result.push_str("\\sqrt");
                result.push_str(piece);
            }
            Some(first) => {
                result.push_str(&format!("\\sqrt{{{first}}}"));
                result.push_str(chars.as_str());
            }
        }
    }
    Some(result)
}

/// VeRL's `strip_string`, step by step: drop newlines and `\!`; `\\` → `\`; `tfrac`/`dfrac` →
/// `frac`; drop `\left`, `\right`, degree marks, `\$`, units after `\text{ `, `\%`; `.5` → `0.5`;
/// drop a short `k = ` prefix; fix `\sqrt3`; remove spaces; fix `\frac12`; `0.5` → `\frac{1}{2}`;
/// `a/b` → `\frac{a}{b}`. `None` where VeRL's function raises an exception.
pub fn strip_string(input: &str) -> Option<String> {
    let mut string = input.replace('\n', "");
    string = string.replace("\\!", "");
    string = string.replace("\\\\", "\\");
    string = string.replace("tfrac", "frac");
    string = string.replace("dfrac", "frac");
    string = string.replace("\\left", "");
    string = string.replace("\\right", "");
    string = string.replace("^{\\circ}", "");
    string = string.replace("^\\circ", "");
    string = string.replace("\\$", "");
    string = remove_right_units(&string)?;
    string = string.replace("\\\\%", "");
    string = string.replace("\\%", "");
    string = string.replace(" .", " 0.");
    string = string.replace("{.", "{0.");
    if string.is_empty() {
        return Some(string);
    }
    if string.starts_with('.') {
        string.insert(0, '0');
    }
    let sides: Vec<&str> = string.split('=').collect();
    if sides.len() == 2 && sides[0].chars().count() <= 2 {
        string = sides[1].to_string();
    }
    string = fix_sqrt(&string)?;
    string = string.replace(' ', "");
    string = fix_fracs(&string)?;
    if string == "0.5" {
        string = "\\frac{1}{2}".to_string();
    }
    Some(fix_a_slash_b(&string))
}

/// The MATH scorer (`math_reward`). Extras: `acc` (same as the score).
#[derive(Debug, Clone)]
pub struct MathScorer {
    name: String,
}

impl MathScorer {
    /// A MATH scorer called `name`.
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_string(),
        }
    }
}

impl crate::Scorer for MathScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&self, sample: &crate::Sample) -> Result<crate::Score, crate::ScoreError> {
        let value = compute_score(&sample.response, &sample.ground_truth);
        // VeRL's math scorer returns the bare score (so the core metric is `reward`, not `acc`).
        Ok(crate::Score::new(value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalisation_steps() {
        assert_eq!(strip_string("\\dfrac12").as_deref(), Some("\\frac{1}{2}"));
        assert_eq!(strip_string("\\left( 1, 2 \\right)").as_deref(), Some("(1,2)"));
        assert_eq!(strip_string("10\\text{ cm}").as_deref(), Some("10"));
        assert_eq!(strip_string("x = 3/4").as_deref(), Some("\\frac{3}{4}"));
        assert_eq!(strip_string(".5").as_deref(), Some("\\frac{1}{2}"));
        assert_eq!(strip_string("\\sqrt2").as_deref(), Some("\\sqrt{2}"));
        assert_eq!(strip_string("2\\sqrt"), None);
        assert_eq!(strip_string("1\\frac"), None);
        assert_eq!(strip_string("\\frac1").as_deref(), Some("\\frac1"));
        assert_eq!(strip_string("-0/2").as_deref(), Some("-0/2"));
        assert_eq!(strip_string("-3/4").as_deref(), Some("\\frac{-3}{4}"));
    }

    #[test]
    fn boxed_extraction() {
        assert_eq!(
            last_boxed_only_string("a \\boxed{1} b \\boxed{\\frac{1}{2}} c").as_deref(),
            Some("\\boxed{\\frac{1}{2}}")
        );
        assert_eq!(
            last_boxed_only_string("\\boxed 5$ end").as_deref(),
            Some("\\boxed 5")
        );
        assert_eq!(last_boxed_only_string("\\fbox{7}").as_deref(), Some("\\fbox{7}"));
        assert_eq!(remove_boxed("\\fbox{7}"), None);
        assert_eq!(last_boxed_only_string("\\boxed{unclosed"), None);
        assert_eq!(compute_score("so \\boxed{\\dfrac{1}{2}}.", "\\frac12"), 1.0);
        assert_eq!(compute_score("so \\fbox{7}", "7"), 0.0);
    }
}

//! The boundary to the model's tokenizer: the data crate never tokenizes by itself. Whoever owns
//! the chat template (the model crate) implements [`PromptTokenizer`]; the data crate uses it to
//! count prompt tokens for `data.filter_overlong_prompts` and applies `data.truncation` to the
//! token ids ([`Truncation::apply`]).

use serde::{Deserialize, Serialize};

use crate::error::TokenizeError;
use crate::example::Prompt;

/// Turns a prompt into the token ids the policy sees: chat messages rendered with the model's
/// chat template and the generation prompt (`add_generation_prompt=True` in Hugging Face terms),
/// plain text tokenized as it is.
///
/// Any `Fn(&Prompt) -> Result<Vec<u32>, TokenizeError>` closure is a `PromptTokenizer`.
pub trait PromptTokenizer {
    /// The prompt's token ids.
    fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>, TokenizeError>;

    /// The prompt's length in tokens (defaults to encoding it; override when counting is
    /// cheaper).
    fn count_prompt_tokens(&self, prompt: &Prompt) -> Result<usize, TokenizeError> {
        Ok(self.encode_prompt(prompt)?.len())
    }
}

impl<F> PromptTokenizer for F
where
    F: Fn(&Prompt) -> Result<Vec<u32>, TokenizeError>,
{
    fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>, TokenizeError> {
        self(prompt)
    }
}

/// What to do with a prompt longer than `data.max_prompt_length` tokens (VeRL's
/// `data.truncation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Truncation {
    /// Fail, naming the file and row (the default, as in VeRL).
    #[default]
    Error,
    /// Cut tokens from the start, keeping the last `max_prompt_length` (VeRL: `left`).
    Left,
    /// Cut tokens from the end, keeping the first `max_prompt_length` (VeRL: `right`).
    Right,
    /// Keep the first `max / 2` and the last `max - max / 2` tokens (VeRL: `middle`).
    Middle,
}

impl Truncation {
    /// Fits `ids` into `max_len` tokens. `Err(len)` (the prompt's length) when the prompt is too
    /// long and the mode is [`Truncation::Error`]; shorter prompts are returned unchanged.
    pub fn apply(self, mut ids: Vec<u32>, max_len: usize) -> Result<Vec<u32>, usize> {
        let len = ids.len();
        if len <= max_len {
            return Ok(ids);
        }
        match self {
            Truncation::Error => Err(len),
            Truncation::Left => Ok(ids.split_off(len - max_len)),
            Truncation::Right => {
                ids.truncate(max_len);
                Ok(ids)
            }
            Truncation::Middle => {
                let head = max_len / 2;
                let tail = max_len - head;
                let mut kept = ids[..head].to_vec();
                kept.extend_from_slice(&ids[len - tail..]);
                Ok(kept)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::example::Message;

    #[test]
    fn truncation_modes_keep_the_documented_tokens() {
        let ids: Vec<u32> = (0..10).collect();
        assert_eq!(Truncation::Error.apply(ids.clone(), 10), Ok(ids.clone()));
        assert_eq!(Truncation::Error.apply(ids.clone(), 9), Err(10));
        assert_eq!(Truncation::Left.apply(ids.clone(), 4), Ok(vec![6, 7, 8, 9]));
        assert_eq!(Truncation::Right.apply(ids.clone(), 4), Ok(vec![0, 1, 2, 3]));
        assert_eq!(Truncation::Middle.apply(ids.clone(), 5), Ok(vec![0, 1, 7, 8, 9]));
        assert_eq!(Truncation::Left.apply(vec![1, 2], 4), Ok(vec![1, 2]));
    }

    #[test]
    fn truncation_reads_verl_names() {
        for (text, mode) in [
            ("error", Truncation::Error),
            ("left", Truncation::Left),
            ("right", Truncation::Right),
            ("middle", Truncation::Middle),
        ] {
            let parsed: Truncation = serde_json::from_value(serde_json::json!(text)).unwrap();
            assert_eq!(parsed, mode);
        }
        let error = serde_json::from_value::<Truncation>(serde_json::json!("both")).unwrap_err();
        assert!(error.to_string().contains("unknown variant `both`"));
    }

    #[test]
    fn closures_are_tokenizers() {
        let words = |prompt: &Prompt| -> Result<Vec<u32>, TokenizeError> {
            Ok(prompt.text().split_whitespace().map(|w| w.len() as u32).collect())
        };
        let prompt = Prompt::Messages(vec![Message::new("user", "one three")]);
        assert_eq!(words.encode_prompt(&prompt).unwrap(), vec![3, 5]);
        assert_eq!(words.count_prompt_tokens(&prompt).unwrap(), 2);
    }
}

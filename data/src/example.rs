//! What one dataset row becomes: a [`Prompt`] (chat messages or plain text), the fields the
//! reward side needs (`data_source`, `ground_truth`), and every other column as JSON for the
//! scorer.

use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One chat message, as stored in VeRL's `prompt` column (`{role, content}`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl Message {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A prompt as a dataset stores it.
///
/// VeRL's schema and TRL's "conversational" form store chat messages, which the model's chat
/// template renders (with the generation prompt). TRL's "standard" form stores plain text, which
/// is tokenized as it is, without a template (TRL does the same).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Chat messages, to be rendered with the chat template.
    Messages(Vec<Message>),
    /// Plain text, to be tokenized as it is.
    Text(String),
}

impl Prompt {
    /// The prompt's text: the plain text, or the messages' contents joined by newlines (for
    /// logging and for scorers that want the question).
    pub fn text(&self) -> String {
        match self {
            Prompt::Text(text) => text.clone(),
            Prompt::Messages(messages) => messages
                .iter()
                .map(|m| m.content.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// One row of a dataset, ready for rollout and scoring.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    /// Position of the row over all the dataset's files in order (file 0's rows first),
    /// counted before any filtering. Stable for a given list of files.
    pub index: u64,
    /// The Parquet file the row came from.
    pub file: Arc<Path>,
    /// The row within that file (0-based).
    pub row: u64,
    /// The prompt (column `data.prompt_key`).
    pub prompt: Prompt,
    /// The scorer selector (column `data.reward_fn_key`, `data_source` by default), when the
    /// column exists and the value is not null.
    pub data_source: Option<String>,
    /// VeRL's `ability` column (`math`, ...), when present.
    pub ability: Option<String>,
    /// `reward_model.ground_truth` (VeRL), or a top-level `ground_truth` column (TRL-style
    /// datasets), when present; usually a string, kept as JSON because some datasets store lists.
    pub ground_truth: Option<Value>,
    /// Every column except the prompt, converted to JSON (structs become objects, lists arrays,
    /// maps with string keys objects): what the scorer receives, e.g. `extra_info`.
    pub columns: Map<String, Value>,
}

impl Example {
    /// The ground truth as text: a JSON string as it is, any other JSON value in JSON notation.
    pub fn ground_truth_text(&self) -> Option<String> {
        self.ground_truth.as_ref().map(|value| match value {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_text_joins_message_contents() {
        let prompt = Prompt::Messages(vec![
            Message::new("system", "Be brief."),
            Message::new("user", "What is 2 + 3?"),
        ]);
        assert_eq!(prompt.text(), "Be brief.\nWhat is 2 + 3?");
        assert_eq!(Prompt::Text("hi".into()).text(), "hi");
    }

    #[test]
    fn ground_truth_text_keeps_strings_and_renders_other_json() {
        let mut example = Example {
            index: 0,
            file: Arc::from(Path::new("x.parquet")),
            row: 0,
            prompt: Prompt::Text("q".into()),
            data_source: None,
            ability: None,
            ground_truth: Some(Value::String("72".into())),
            columns: Map::new(),
        };
        assert_eq!(example.ground_truth_text().as_deref(), Some("72"));
        example.ground_truth = Some(serde_json::json!(["1/2", "0.5"]));
        assert_eq!(example.ground_truth_text().as_deref(), Some(r#"["1/2","0.5"]"#));
    }
}

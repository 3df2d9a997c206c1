//! Tool calls as the model writes them. Each model family was trained on one format, and its chat
//! template tells it which; the rollout must read calls back in that same format ([`CallFormat`],
//! VeRL's `rollout.multi_turn.format`).
//!
//! Parsing never fails as a whole: every well-formed call comes back as a [`ToolCall`], every
//! malformed one as a [`CallError`] whose message is a short sentence meant for the model, which
//! the rollout shows it as the tool's observation so it can correct itself on the next turn.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// One request from the model to run a tool.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The tool's name as the model wrote it.
    pub name: String,
    /// The arguments: always a JSON object (`{}` when the model gave none).
    pub arguments: Value,
}

/// How a model family writes tool calls; the names are VeRL's `rollout.multi_turn.format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CallFormat {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the turn:
    /// NousResearch's Hermes format, which Qwen2.5 and Qwen3 use.
    Hermes,
    /// Llama 3.1's JSON tool calling (transformers' template): the whole turn, after an optional
    /// `<|python_tag|>`, is `{"name": ..., "parameters": {...}}`, or several such objects
    /// separated by `;`. A turn that does not start with `{` is a plain answer.
    Llama3,
}

/// What a turn held: its calls in order and one error per malformed call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parsed {
    /// Every well-formed call, in the order the model wrote them.
    pub calls: Vec<ToolCall>,
    /// One error per malformed call, in order; each names the call by its position in the turn.
    pub errors: Vec<CallError>,
}

/// What was wrong with one call. `index` counts the turn's calls from 1, well-formed and malformed
/// alike, so "tool call 2" means the second call the model wrote.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// Nothing between the tags.
    #[error("tool call {index} is empty")]
    Empty {
        /// The call's position in the turn, from 1.
        index: usize,
    },
    /// The call's text does not parse as JSON.
    #[error("tool call {index} is not valid JSON: {detail}")]
    NotJson {
        /// The call's position in the turn, from 1.
        index: usize,
        /// The JSON parser's description of the problem and where it is.
        detail: String,
    },
    /// Valid JSON, but not an object.
    #[error("tool call {index} must be a JSON object with \"name\" and \"arguments\"")]
    NotObject {
        /// The call's position in the turn, from 1.
        index: usize,
    },
    /// The object has no `name`.
    #[error("tool call {index} has no \"name\"")]
    NoName {
        /// The call's position in the turn, from 1.
        index: usize,
    },
    /// `name` is not a non-empty string.
    #[error("tool call {index}: \"name\" must be a non-empty string")]
    BadName {
        /// The call's position in the turn, from 1.
        index: usize,
    },
    /// The arguments are neither an object nor a string holding one.
    #[error("tool call {index}: \"{field}\" must be a JSON object")]
    ArgumentsNotObject {
        /// The call's position in the turn, from 1.
        index: usize,
        /// The key the model used: `arguments` or `parameters`.
        field: &'static str,
    },
    /// Hermes: a `<tool_call>` with no `</tool_call>` before the next call or the end of the turn.
    #[error("tool call {index} is not closed by </tool_call>")]
    NotClosed {
        /// The call's position in the turn, from 1.
        index: usize,
    },
    /// Llama 3: something other than `;` and another call after a call.
    #[error(
        "tool call {after} is followed by text that is not a tool call; separate calls with \";\" \
         and write nothing else in a turn that calls tools"
    )]
    TrailingText {
        /// The position of the call the text follows, from 1.
        after: usize,
    },
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
/// Llama 3.1 starts a tool-calling turn with this token when it is decoded with special tokens.
const LLAMA3_PYTHON_TAG: &str = "<|python_tag|>";

impl CallFormat {
    /// Every call in `text`, one model turn, and one error per malformed call.
    pub fn parse(self, text: &str) -> Parsed {
        match self {
            CallFormat::Hermes => parse_hermes(text),
            CallFormat::Llama3 => parse_llama3(text),
        }
    }
}

impl Parsed {
    fn push(&mut self, call: Result<ToolCall, CallError>) {
        match call {
            Ok(call) => self.calls.push(call),
            Err(error) => self.errors.push(error),
        }
    }
}

fn parse_hermes(text: &str) -> Parsed {
    let mut parsed = Parsed::default();
    let mut rest = text;
    let mut index = 0;
    while let Some(start) = rest.find(HERMES_OPEN) {
        index += 1;
        let body = &rest[start + HERMES_OPEN.len()..];
        let next_open = body.find(HERMES_OPEN);
        match body.find(HERMES_CLOSE) {
            Some(end) if next_open.is_none_or(|open| end < open) => {
                parsed.push(decode(index, body[..end].trim()));
                rest = &body[end + HERMES_CLOSE.len()..];
            }
            _ => {
                parsed.errors.push(CallError::NotClosed { index });
                match next_open {
                    Some(open) => rest = &body[open..],
                    None => break,
                }
            }
        }
    }
    parsed
}

fn decode(index: usize, json: &str) -> Result<ToolCall, CallError> {
    if json.is_empty() {
        return Err(CallError::Empty { index });
    }
    let value = serde_json::from_str(json).map_err(|error| CallError::NotJson {
        index,
        detail: error.to_string(),
    })?;
    call_from_value(index, value)
}

fn parse_llama3(text: &str) -> Parsed {
    let text = text.trim();
    let text = text.strip_prefix(LLAMA3_PYTHON_TAG).unwrap_or(text).trim_start();
    let mut parsed = Parsed::default();
    if !text.starts_with('{') {
        return parsed;
    }
    let mut rest = text;
    let mut index = 0;
    loop {
        index += 1;
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let Some(value) = stream.next() else { break };
        match value {
            Ok(value) => {
                parsed.push(call_from_value(index, value));
                rest = rest[stream.byte_offset()..].trim_start();
            }
            Err(error) => {
                parsed.errors.push(CallError::NotJson {
                    index,
                    detail: error.to_string(),
                });
                // The broken object's end is unknown; the next `; {` is the best guess at where
                // the following call starts.
                match next_call_after_error(rest) {
                    Some(next) => {
                        rest = next;
                        continue;
                    }
                    None => break,
                }
            }
        }
        if rest.is_empty() {
            break;
        }
        match rest.strip_prefix(';').map(str::trim_start) {
            Some("") => break,
            Some(next) if next.starts_with('{') => rest = next,
            _ => {
                parsed.errors.push(CallError::TrailingText { after: index });
                break;
            }
        }
    }
    parsed
}

fn next_call_after_error(rest: &str) -> Option<&str> {
    rest.match_indices(';')
        .map(|(at, _)| rest[at + 1..].trim_start())
        .find(|next| next.starts_with('{'))
}

/// The call in a parsed JSON value. Both formats accept `arguments` and `parameters`: models
/// trained on one often write the other, and the meaning is unambiguous.
fn call_from_value(index: usize, value: Value) -> Result<ToolCall, CallError> {
    let Value::Object(mut object) = value else {
        return Err(CallError::NotObject { index });
    };
    let name = match object.remove("name") {
        None => return Err(CallError::NoName { index }),
        Some(Value::String(name)) if !name.trim().is_empty() => name,
        Some(_) => return Err(CallError::BadName { index }),
    };
    let (field, arguments) = ["arguments", "parameters"]
        .into_iter()
        .find_map(|field| object.remove(field).map(|value| (field, value)))
        .unwrap_or(("arguments", Value::Null));
    let arguments = match arguments {
        Value::Null => Value::Object(Map::new()),
        Value::Object(_) => arguments,
        // Some models write the arguments as a JSON string holding the object (the OpenAI API's
        // wire form); an empty string means no arguments.
        Value::String(text) if text.trim().is_empty() => Value::Object(Map::new()),
        Value::String(text) => match serde_json::from_str(&text) {
            Ok(object @ Value::Object(_)) => object,
            _ => return Err(CallError::ArgumentsNotObject { index, field }),
        },
        _ => return Err(CallError::ArgumentsNotObject { index, field }),
    };
    Ok(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, arguments: Value) -> ToolCall {
        ToolCall {
            name: name.to_string(),
            arguments,
        }
    }

    fn messages(parsed: &Parsed) -> Vec<String> {
        parsed.errors.iter().map(ToString::to_string).collect()
    }

    #[test]
    fn hermes_reads_several_calls_in_order_with_text_around_them() {
        let text = "Let me compute both.\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": \
                    {\"expression\": \"2 + 2\"}}\n</tool_call>\nand\n<tool_call>{\"name\": \"search\", \
                    \"arguments\": {\"query\": \"rust\"}}</tool_call> done";
        let parsed = CallFormat::Hermes.parse(text);
        assert_eq!(
            parsed.calls,
            vec![
                call("calculator", json!({"expression": "2 + 2"})),
                call("search", json!({"query": "rust"})),
            ]
        );
        assert!(parsed.errors.is_empty());
    }

    #[test]
    fn hermes_plain_text_has_no_calls_and_no_errors() {
        assert_eq!(CallFormat::Hermes.parse("The answer is 4."), Parsed::default());
        assert_eq!(CallFormat::Hermes.parse(""), Parsed::default());
    }

    #[test]
    fn hermes_malformed_json_is_an_error_naming_the_call_and_the_others_still_parse() {
        let text = "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\
                    <tool_call>{\"name\": \"b\", \"arguments\": {</tool_call>\
                    <tool_call>{\"name\": \"c\"}</tool_call>";
        let parsed = CallFormat::Hermes.parse(text);
        assert_eq!(parsed.calls, vec![call("a", json!({})), call("c", json!({}))]);
        let errors = messages(&parsed);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].starts_with("tool call 2 is not valid JSON: "),
            "{}",
            errors[0]
        );
    }

    #[test]
    fn hermes_missing_or_bad_name_and_bad_arguments_are_errors() {
        let text = "<tool_call>{\"arguments\": {}}</tool_call>\
                    <tool_call>{\"name\": 7}</tool_call>\
                    <tool_call>{\"name\": \"a\", \"arguments\": [1]}</tool_call>\
                    <tool_call>[\"a\"]</tool_call>\
                    <tool_call>  </tool_call>";
        let parsed = CallFormat::Hermes.parse(text);
        assert!(parsed.calls.is_empty());
        assert_eq!(
            messages(&parsed),
            vec![
                "tool call 1 has no \"name\"",
                "tool call 2: \"name\" must be a non-empty string",
                "tool call 3: \"arguments\" must be a JSON object",
                "tool call 4 must be a JSON object with \"name\" and \"arguments\"",
                "tool call 5 is empty",
            ]
        );
    }

    #[test]
    fn hermes_arguments_may_be_a_json_string_holding_an_object() {
        let text = r#"<tool_call>{"name": "calculator", "arguments": "{\"expression\": \"1+1\"}"}</tool_call>
<tool_call>{"name": "now", "arguments": ""}</tool_call>
<tool_call>{"name": "bad", "arguments": "not json"}</tool_call>"#;
        let parsed = CallFormat::Hermes.parse(text);
        assert_eq!(
            parsed.calls,
            vec![
                call("calculator", json!({"expression": "1+1"})),
                call("now", json!({}))
            ]
        );
        assert_eq!(
            messages(&parsed),
            vec!["tool call 3: \"arguments\" must be a JSON object"]
        );
    }

    #[test]
    fn hermes_unclosed_tag_is_an_error_at_the_end_and_before_the_next_call() {
        let parsed = CallFormat::Hermes.parse("<tool_call>{\"name\": \"a\"}");
        assert!(parsed.calls.is_empty());
        assert_eq!(
            messages(&parsed),
            vec!["tool call 1 is not closed by </tool_call>"]
        );

        let text = "<tool_call>{\"name\": \"a\"}\n<tool_call>{\"name\": \"b\"}</tool_call>";
        let parsed = CallFormat::Hermes.parse(text);
        assert_eq!(parsed.calls, vec![call("b", json!({}))]);
        assert_eq!(
            messages(&parsed),
            vec!["tool call 1 is not closed by </tool_call>"]
        );
    }

    #[test]
    fn hermes_keeps_unicode_in_names_text_and_arguments() {
        let text = "Größe berechnen 🧮 <tool_call>{\"name\": \"übersetzen\", \"arguments\": \
                    {\"text\": \"日本語 ✓\"}}</tool_call> ✔";
        let parsed = CallFormat::Hermes.parse(text);
        assert_eq!(
            parsed.calls,
            vec![call("übersetzen", json!({"text": "日本語 ✓"}))]
        );
        assert!(parsed.errors.is_empty());
    }

    #[test]
    fn llama3_reads_a_call_after_the_python_tag_and_accepts_arguments_too() {
        let parsed = CallFormat::Llama3
            .parse("<|python_tag|>{\"name\": \"calculator\", \"parameters\": {\"expression\": \"6*7\"}}");
        assert_eq!(
            parsed.calls,
            vec![call("calculator", json!({"expression": "6*7"}))]
        );
        assert!(parsed.errors.is_empty());

        let parsed = CallFormat::Llama3.parse("  {\"name\": \"now\", \"arguments\": {}}\n");
        assert_eq!(parsed.calls, vec![call("now", json!({}))]);
    }

    #[test]
    fn llama3_reads_semicolon_separated_calls() {
        let text = "{\"name\": \"a\", \"parameters\": {\"s\": \"x; {y}\"}}; {\"name\": \"b\", \
                    \"parameters\": {}};";
        let parsed = CallFormat::Llama3.parse(text);
        assert_eq!(
            parsed.calls,
            vec![call("a", json!({"s": "x; {y}"})), call("b", json!({}))]
        );
        assert!(parsed.errors.is_empty());
    }

    #[test]
    fn llama3_plain_text_is_an_answer() {
        assert_eq!(CallFormat::Llama3.parse("The answer is {4}."), Parsed::default());
        assert_eq!(CallFormat::Llama3.parse("<|python_tag|> 42"), Parsed::default());
        assert_eq!(CallFormat::Llama3.parse(""), Parsed::default());
    }

    #[test]
    fn llama3_text_starting_with_a_brace_that_is_not_a_call_is_an_error() {
        let parsed = CallFormat::Llama3.parse("{\"answer\": 4}");
        assert_eq!(messages(&parsed), vec!["tool call 1 has no \"name\""]);

        let parsed = CallFormat::Llama3.parse("{not json}");
        assert!(parsed.calls.is_empty());
        let errors = messages(&parsed);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].starts_with("tool call 1 is not valid JSON: "),
            "{}",
            errors[0]
        );
    }

    #[test]
    fn llama3_a_broken_call_does_not_hide_the_next_one() {
        let text = "{\"name\": \"a\", \"parameters\": {]}; {\"name\": \"b\", \"parameters\": {}}";
        let parsed = CallFormat::Llama3.parse(text);
        assert_eq!(parsed.calls, vec![call("b", json!({}))]);
        let errors = messages(&parsed);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].starts_with("tool call 1 is not valid JSON"),
            "{}",
            errors[0]
        );
    }

    #[test]
    fn llama3_text_after_a_call_is_an_error_but_the_call_stands() {
        let parsed = CallFormat::Llama3.parse("{\"name\": \"a\", \"parameters\": {}} and then I will answer");
        assert_eq!(parsed.calls, vec![call("a", json!({}))]);
        assert_eq!(
            messages(&parsed),
            vec![
                "tool call 1 is followed by text that is not a tool call; separate calls with \";\" and \
                 write nothing else in a turn that calls tools"
            ]
        );
    }

    #[test]
    fn formats_use_verl_names_in_configs() {
        let formats: Vec<CallFormat> = serde_json::from_str("[\"hermes\", \"llama3\"]").unwrap();
        assert_eq!(formats, vec![CallFormat::Hermes, CallFormat::Llama3]);
    }
}

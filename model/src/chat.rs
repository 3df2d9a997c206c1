//! Chat templates: the Jinja template of a model (from `tokenizer_config.json` or the GGUF key
//! `tokenizer.chat_template`) rendered with `minijinja` the way transformers'
//! `apply_chat_template` renders it (trim_blocks, lstrip_blocks, Python string methods,
//! `raise_exception`, Python-style `tojson`, loop controls), plus the special tokens the
//! template and generation need.

use std::path::Path;

use minijinja::value::{Kwargs, Value as JinjaValue};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde::Serialize;
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with this role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template with the special tokens it refers to.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    origin: String,
    source: String,
    /// The BOS token string (`bos_token` in the template), if any.
    pub bos_token: Option<String>,
    /// The EOS token string (`eos_token` in the template), if any.
    pub eos_token: Option<String>,
    /// The padding token string, if any.
    pub pad_token: Option<String>,
    /// Variables every render passes to the template, as `apply_chat_template(**kwargs)` does
    /// in transformers (VeRL's `data.apply_chat_template_kwargs`, such as Qwen3's
    /// `enable_thinking`); a render's own extra variables take precedence.
    variables: serde_json::Map<String, Value>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("pad_token", &self.pad_token)
            .field("variables", &self.variables)
            .finish()
    }
}

/// Writes `value` as Python's `json.dumps` does (`ensure_ascii`, `indent`, `sort_keys`, and the
/// default separators `", "` and `": "`, or `","` with an indent).
fn python_json(
    value: &Value,
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
    level: usize,
    out: &mut String,
) {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match value {
        Value::String(s) => {
            let quoted = serde_json::to_string(s).expect("strings serialise");
            if ensure_ascii {
                for c in quoted.chars() {
                    if c.is_ascii() {
                        out.push(c);
                    } else {
                        let mut units = [0u16; 2];
                        for unit in c.encode_utf16(&mut units) {
                            out.push_str(&format!("\\u{unit:04x}"));
                        }
                    }
                }
            } else {
                out.push_str(&quoted);
            }
        }
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                python_json(item, indent, sort_keys, ensure_ascii, level + 1, out);
            }
            newline(out, level);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                python_json(
                    &Value::String(k.clone()),
                    indent,
                    sort_keys,
                    ensure_ascii,
                    level + 1,
                    out,
                );
                out.push_str(": ");
                python_json(v, indent, sort_keys, ensure_ascii, level + 1, out);
            }
            newline(out, level);
            out.push('}');
        }
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Null => out.push_str("null"),
        Value::Number(n) => out.push_str(&n.to_string()),
    }
}

/// The `tojson` filter of transformers' chat environment (Python `json.dumps`, non-ASCII kept).
fn tojson_filter(value: JinjaValue, kwargs: Kwargs) -> std::result::Result<JinjaValue, JinjaError> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    python_json(
        &json,
        indent,
        sort_keys.unwrap_or(false),
        ensure_ascii.unwrap_or(false),
        0,
        &mut out,
    );
    Ok(JinjaValue::from_safe_string(out))
}

fn raise_exception(message: String) -> std::result::Result<JinjaValue, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// A special-token entry of `tokenizer_config.json`: a string or an `AddedToken` object.
fn token_string(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl ChatTemplate {
    /// Compiles `source`; `origin` names it in errors.
    pub fn new(
        source: &str,
        origin: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
        pad_token: Option<String>,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson_filter);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ModelError::ChatTemplate {
                origin: origin.to_string(),
                detail: format!("does not compile: {e:#}"),
            })?;
        Ok(ChatTemplate {
            env,
            origin: origin.to_string(),
            source: source.to_string(),
            bos_token,
            eos_token,
            pad_token,
            variables: serde_json::Map::new(),
        })
    }

    /// The template with `variables` passed to every render (the struct's `variables`).
    /// A variable the template never reads is an error naming the ones it does: passing it
    /// would change nothing.
    pub fn with_variables(mut self, variables: serde_json::Map<String, Value>) -> Result<ChatTemplate> {
        let template = self.env.get_template("chat").expect("added at construction");
        let read = template.undeclared_variables(false);
        if let Some(unread) = variables.keys().find(|k| !read.contains(*k)) {
            let given = [
                "messages",
                "add_generation_prompt",
                "bos_token",
                "eos_token",
                "pad_token",
            ];
            let mut names: Vec<&String> = read
                .iter()
                .filter(|n| !given.contains(&n.as_str()) && !self.env.globals().any(|(g, _)| g == n.as_str()))
                .collect();
            names.sort();
            return Err(ModelError::ChatTemplate {
                origin: self.origin.clone(),
                detail: format!(
                    "does not read the variable `{unread}`, so passing it would change nothing; \
                     the variables it reads besides the messages and special tokens: {}",
                    if names.is_empty() {
                        "none".to_string()
                    } else {
                        names
                            .iter()
                            .map(|n| format!("`{n}`"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    }
                ),
            });
        }
        self.variables = variables;
        Ok(self)
    }

    /// The template of a `tokenizer_config.json` (`chat_template` as a string, or the entry
    /// named `default` of a list of named templates), with its `bos_token`, `eos_token` and
    /// `pad_token`. A separate `chat_template.jinja` beside the file is used when the config
    /// has no template (newer transformers writes it there).
    pub fn from_tokenizer_config(path: &Path) -> Result<ChatTemplate> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::io("reading", path, e))?;
        let config: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let origin = path.display().to_string();
        let source = match config.get("chat_template") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .map(str::to_string)
                .ok_or_else(|| ModelError::ChatTemplate {
                    origin: origin.clone(),
                    detail: "chat_template is a list without an entry named `default`".into(),
                })?,
            _ => {
                let jinja = path.with_file_name("chat_template.jinja");
                std::fs::read_to_string(&jinja).map_err(|_| ModelError::ChatTemplate {
                    origin: origin.clone(),
                    detail: "no `chat_template` key (and no chat_template.jinja beside it); this tokenizer has no chat format, so prompt without --chat".into(),
                })?
            }
        };
        ChatTemplate::new(
            &source,
            &origin,
            token_string(config.get("bos_token")),
            token_string(config.get("eos_token")),
            token_string(config.get("pad_token")),
        )
    }

    /// The template stored in a GGUF file (`tokenizer.chat_template`), with the BOS, EOS and
    /// padding tokens named by `tokenizer.ggml.*_token_id`.
    pub fn from_gguf(gguf: &GgufFile) -> Result<ChatTemplate> {
        let origin = format!("{} (tokenizer.chat_template)", gguf.path().display());
        let source = match gguf.metadata("tokenizer.chat_template") {
            Some(_) => gguf.metadata_str("tokenizer.chat_template")?,
            None => {
                return Err(ModelError::ChatTemplate {
                    origin,
                    detail: "the GGUF file has no tokenizer.chat_template; prompt without --chat".into(),
                })
            }
        };
        let tokens = gguf.metadata_strings("tokenizer.ggml.tokens")?;
        let token = |key: &str| -> Result<Option<String>> {
            match gguf.metadata(key) {
                None => Ok(None),
                Some(_) => Ok(tokens.get(gguf.metadata_usize(key)?).map(|s| s.to_string())),
            }
        };
        ChatTemplate::new(
            source,
            &origin,
            token("tokenizer.ggml.bos_token_id")?,
            token("tokenizer.ggml.eos_token_id")?,
            token("tokenizer.ggml.padding_token_id")?,
        )
    }

    /// A `tokenizer_config.json` for a Hugging Face checkpoint: this template and its special
    /// tokens, loaded by transformers as a `PreTrainedTokenizerFast` beside a `tokenizer.json`.
    pub fn tokenizer_config_json(&self, model_max_length: usize) -> Value {
        let mut config = serde_json::Map::new();
        config.insert("tokenizer_class".into(), Value::from("PreTrainedTokenizerFast"));
        for (key, token) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
            ("pad_token", &self.pad_token),
        ] {
            config.insert(key.into(), token.clone().map_or(Value::Null, Value::from));
        }
        config.insert("add_bos_token".into(), Value::Bool(false));
        config.insert("clean_up_tokenization_spaces".into(), Value::Bool(false));
        config.insert("model_max_length".into(), Value::from(model_max_length));
        config.insert("chat_template".into(), Value::from(self.source.clone()));
        Value::Object(config)
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends with the header of an
    /// assistant turn.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with(
            &serde_json::to_value(messages).expect("messages serialise"),
            add_generation_prompt,
            &serde_json::Map::new(),
        )
    }

    /// Renders messages given as JSON (any extra fields, e.g. `reasoning_content`), with extra
    /// template variables (e.g. `enable_thinking`, `tools`).
    pub fn render_with(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, Value>,
    ) -> Result<String> {
        let mut context = serde_json::Map::new();
        context.insert("messages".into(), messages.clone());
        context.insert("add_generation_prompt".into(), Value::Bool(add_generation_prompt));
        for (key, token) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
            ("pad_token", &self.pad_token),
        ] {
            if let Some(t) = token {
                context.insert(key.into(), Value::String(t.clone()));
            }
        }
        for (k, v) in self.variables.iter().chain(extra) {
            context.insert(k.clone(), v.clone());
        }
        let template = self.env.get_template("chat").expect("added at construction");
        template
            .render(JinjaValue::from_serialize(&context))
            .map_err(|e| ModelError::ChatTemplate {
                origin: self.origin.clone(),
                detail: format!("rendering failed: {e:#}"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_methods_loop_controls_and_trimming() {
        let source = "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}\n  {{ m.role.upper() }}: {{ m.content.strip() }}{% if m.content.startswith(' x') %}!{% endif %}|\n{% endfor %}{% if add_generation_prompt %}{{ bos_token }}>{% endif %}";
        let t = ChatTemplate::new(source, "test", Some("<s>".into()), None, None).unwrap();
        let msgs = [
            ChatMessage::new("user", " x y "),
            ChatMessage::new("skip", "no"),
            ChatMessage::new("assistant", "ok"),
        ];
        // Expected strings are what Python's jinja2 renders with transformers' settings.
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "  USER: x y!|\n  ASSISTANT: ok|\n<s>>"
        );
        assert_eq!(
            t.render(&msgs, false).unwrap(),
            "  USER: x y!|\n  ASSISTANT: ok|\n"
        );
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}~{{ x | tojson(indent=2) }}~{{ x | tojson(ensure_ascii=true) }}",
            "t",
            None,
            None,
            None,
        )
        .unwrap();
        let x = serde_json::json!({"b": [1, 2.5, "é<\"\n"], "a": {}, "c": null, "d": true});
        let mut extra = serde_json::Map::new();
        extra.insert("x".into(), x);
        let out = t.render_with(&serde_json::json!([]), false, &extra).unwrap();
        // Python: json.dumps(x, ensure_ascii=False), indent=2, and ensure_ascii=True.
        assert_eq!(
            out,
            "{\"b\": [1, 2.5, \"é<\\\"\\n\"], \"a\": {}, \"c\": null, \"d\": true}~{\n  \"b\": [\n    1,\n    2.5,\n    \"é<\\\"\\n\"\n  ],\n  \"a\": {},\n  \"c\": null,\n  \"d\": true\n}~{\"b\": [1, 2.5, \"\\u00e9<\\\"\\n\"], \"a\": {}, \"c\": null, \"d\": true}"
        );
    }

    #[test]
    fn errors_name_the_template() {
        let e = ChatTemplate::new("{% if %}", "cfg.json", None, None, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("chat template from cfg.json: does not compile:"),
            "{e}"
        );
        let t = ChatTemplate::new(
            "{{ raise_exception('roles must alternate') }}",
            "cfg.json",
            None,
            None,
            None,
        )
        .unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(
            e.contains("rendering failed") && e.contains("roles must alternate"),
            "{e}"
        );
    }
}

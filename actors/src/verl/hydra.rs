//! VeRL's config as `python3 -m verl.trainer.main_ppo` builds it with Hydra: VeRL's defaults
//! (one [`super::version::VerlVersion`]'s, for one engine), then a `--config-path/--config-name`
//! file, then the command line's overrides (`key=value`, `+key=value`, `++key=value`, `~key`),
//! with OmegaConf's `${...}` interpolations resolved when a value is read. The config is held
//! flat, one entry per leaf.

use super::VerlError;
use crate::recipe::closest;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// One command-line override, in Hydra's grammar.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub op: Op,
    pub key: String,
    /// None only for a `~key` without a value.
    pub value: Option<Value>,
    pub raw: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `key=value`: the key must exist.
    Set,
    /// `+key=value`: the key must not exist.
    Add,
    /// `++key=value`: set or add.
    Force,
    /// `~key` or `~key=value`: remove it (and what is under it).
    Delete,
}

impl Override {
    pub fn parse(raw: &str) -> Result<Override, VerlError> {
        let bad = |message: String| VerlError::BadOverride {
            raw: raw.to_string(),
            message,
        };
        let (op, rest) = if let Some(r) = raw.strip_prefix("++") {
            (Op::Force, r)
        } else if let Some(r) = raw.strip_prefix('+') {
            (Op::Add, r)
        } else if let Some(r) = raw.strip_prefix('~') {
            (Op::Delete, r)
        } else {
            (Op::Set, raw)
        };
        let (key, value) = match rest.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None if op == Op::Delete => (rest, None),
            None => {
                return Err(bad("expected key=value (Hydra's override syntax), for example \
                     `actor_rollout_ref.actor.optim.lr=1e-6`"
                    .into()))
            }
        };
        let key_ok = !key.is_empty()
            && key.split('.').all(|part| {
                !part.is_empty()
                    && part
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_-/@".contains(c))
            });
        if !key_ok {
            return Err(bad(format!(
                "`{key}` is not a dotted key such as `data.train_batch_size`"
            )));
        }
        let value = value.map(|v| parse_value(v).map_err(bad)).transpose()?;
        Ok(Override {
            op,
            key: key.to_string(),
            value,
            raw: raw.to_string(),
        })
    }
}

/// A value in Hydra's override grammar (`hydra/grammar/OverrideParser.g4`): a quoted string, a
/// list `[a, b]`, a dict `{k: v}`, or an unquoted primitive (`null`, a bool, an int, a float,
/// else a string, with `\` escaping the grammar's own characters and `${...}` kept whole); an
/// empty value is the empty string. A top-level comma is a sweep, which only `--multirun` takes.
fn parse_value(text: &str) -> Result<Value, String> {
    let chars: Vec<char> = text.chars().collect();
    let mut p = ValueParser { chars: &chars, at: 0 };
    let value = p
        .element(&[','])
        .map_err(|e| format!("`{text}` is not a value Hydra reads: {e}"))?;
    p.spaces();
    match p.peek() {
        None => Ok(value),
        Some(',') => Err(format!(
            "`{text}` is a list of values to sweep over, which runs several jobs (Hydra's \
             --multirun, not supported); for one list value write it in brackets: `[{text}]`"
        )),
        Some(c) => Err(format!(
            "`{text}` is not a value Hydra reads: unexpected `{c}` (quote the whole override for \
             the shell: 'key=[\"a\",\"b\"]')"
        )),
    }
}

struct ValueParser<'a> {
    chars: &'a [char],
    at: usize,
}

impl ValueParser<'_> {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.at).copied()
    }

    fn spaces(&mut self) {
        while self.peek().is_some_and(|c| c == ' ' || c == '\t') {
            self.at += 1;
        }
    }

    /// One element, ending before any of `stops` (at depth 0) or a closing bracket.
    fn element(&mut self, stops: &[char]) -> Result<Value, String> {
        self.spaces();
        match self.peek() {
            Some('[') => {
                self.at += 1;
                let mut items = Vec::new();
                self.spaces();
                if self.peek() == Some(']') {
                    self.at += 1;
                    return Ok(Value::Array(items));
                }
                loop {
                    items.push(self.element(&[','])?);
                    self.spaces();
                    match self.peek() {
                        Some(',') => self.at += 1,
                        Some(']') => {
                            self.at += 1;
                            return Ok(Value::Array(items));
                        }
                        _ => return Err("an unclosed quote or bracket (quote the whole override for the shell: 'key=[\"a\",\"b\"]')".into()),
                    }
                }
            }
            Some('{') => {
                self.at += 1;
                let mut map = serde_json::Map::new();
                self.spaces();
                if self.peek() == Some('}') {
                    self.at += 1;
                    return Ok(Value::Object(map));
                }
                loop {
                    let key = match self.element(&[':', ','])? {
                        Value::String(s) => s,
                        other => other.to_string(),
                    };
                    if self.peek() != Some(':') {
                        return Err(format!("the dict key `{key}` has no `:` and value"));
                    }
                    self.at += 1;
                    let value = self.element(&[','])?;
                    map.insert(key, value);
                    self.spaces();
                    match self.peek() {
                        Some(',') => self.at += 1,
                        Some('}') => {
                            self.at += 1;
                            return Ok(Value::Object(map));
                        }
                        _ => return Err("an unclosed quote or bracket (quote the whole override for the shell: 'key=[\"a\",\"b\"]')".into()),
                    }
                }
            }
            Some(q @ ('\'' | '"')) => {
                self.at += 1;
                let mut out = String::new();
                loop {
                    match self.peek() {
                        None => return Err("an unclosed quote or bracket (quote the whole override for the shell: 'key=[\"a\",\"b\"]')".into()),
                        Some('\\') if self.chars.get(self.at + 1) == Some(&q) => {
                            out.push(q);
                            self.at += 2;
                        }
                        Some(c) if c == q => {
                            self.at += 1;
                            return Ok(Value::String(out));
                        }
                        Some(c) => {
                            out.push(c);
                            self.at += 1;
                        }
                    }
                }
            }
            _ => self.primitive(stops),
        }
    }

    /// Unquoted text up to a stop, a bracket or the end; typed as Hydra types it.
    fn primitive(&mut self, stops: &[char]) -> Result<Value, String> {
        let mut out = String::new();
        let mut escaped = false;
        while let Some(c) = self.peek() {
            if c == '\\' {
                match self.chars.get(self.at + 1) {
                    Some(&next) if "\\()[]{}:=, \t".contains(next) => {
                        out.push(next);
                        escaped = true;
                        self.at += 2;
                        continue;
                    }
                    _ => {}
                }
            } else if c == '$' && self.chars.get(self.at + 1) == Some(&'{') {
                // An interpolation, kept as written.
                let mut depth = 0;
                while let Some(c) = self.peek() {
                    out.push(c);
                    self.at += 1;
                    match c {
                        '{' => depth += 1,
                        '}' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                if depth != 0 {
                    return Err("an unclosed `${`".into());
                }
                continue;
            } else if stops.contains(&c) || "[]{}".contains(c) || (c == '\'' || c == '"') {
                if "[{'\"".contains(c) {
                    return Err(format!("an unexpected `{c}` inside a value (quote the value)"));
                }
                break;
            }
            out.push(c);
            self.at += 1;
        }
        let text = out.trim();
        if escaped {
            return Ok(Value::String(text.to_string()));
        }
        Ok(match text {
            "null" | "NULL" | "Null" => Value::Null,
            t if t.eq_ignore_ascii_case("true") => Value::Bool(true),
            t if t.eq_ignore_ascii_case("false") => Value::Bool(false),
            t => match t.replace('_', "").parse::<i64>() {
                Ok(n) if !t.starts_with('_') => Value::from(n),
                _ => match t.parse::<f64>() {
                    Ok(f) if t.chars().any(|c| c.is_ascii_digit()) => serde_json::Number::from_f64(f)
                        .map(Value::Number)
                        .unwrap_or(Value::String(t.into())),
                    _ => Value::String(t.to_string()),
                },
            },
        })
    }
}

/// The leaves of a value under `prefix` (a non-empty mapping is a section, anything else a leaf).
pub fn flatten(prefix: &str, value: &Value, out: &mut Vec<(String, Value)>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        _ => out.push((prefix.to_string(), value.clone())),
    }
}

/// A `--config-path/--config-name` file: its Hydra `defaults` list and its keys.
pub struct ConfigFile {
    pub file: String,
    /// `defaults` entries as `(group, option)`: `ppo_trainer` is `("ppo_trainer", None)`,
    /// `model_engine: megatron` is `("model_engine", Some("megatron"))`, and Hydra's
    /// `override model_engine: megatron` the same.
    pub defaults: Vec<(String, Option<String>)>,
    /// Everything else in it but Hydra's own `hydra` section.
    pub body: Value,
}

impl ConfigFile {
    pub fn read(path: &Path) -> Result<ConfigFile, VerlError> {
        let file = path.display().to_string();
        let bad = |message: String| VerlError::ConfigFile {
            file: file.clone(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
        let yaml: serde_yaml::Value =
            serde_yaml::from_str(&text).map_err(|e| bad(format!("this is not valid YAML: {e}")))?;
        let mut body = serde_json::to_value(&yaml).map_err(|e| bad(e.to_string()))?;
        let Some(map) = body.as_object_mut() else {
            return Err(bad("expected a mapping of VeRL's config sections".into()));
        };
        let mut defaults = Vec::new();
        for item in map
            .remove("defaults")
            .as_ref()
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            match item {
                Value::String(name) => defaults.push((name.clone(), None)),
                Value::Object(choice) if choice.len() == 1 => {
                    let (group, option) = choice.iter().next().expect("one entry");
                    let group = group.strip_prefix("override ").unwrap_or(group).trim();
                    defaults.push((group.to_string(), option.as_str().map(str::to_string)));
                }
                other => {
                    return Err(bad(format!(
                        "`defaults` entry {other}: expected a config name or `group: option`"
                    )))
                }
            }
        }
        // Hydra's own settings (search paths, run directories) say nothing about the run.
        map.remove("hydra");
        Ok(ConfigFile { file, defaults, body })
    }
}

/// VeRL's config, flat: leaf key -> value, and where each value the user gave came from.
pub struct Config {
    pub values: BTreeMap<String, Value>,
    pub defaults: BTreeMap<String, Value>,
    /// Leaf key -> the override or file entry that set it.
    pub origin: BTreeMap<String, String>,
}

impl Config {
    /// VeRL's config before any file or override: `defaults`, leaf by leaf.
    pub fn new(defaults: BTreeMap<String, Value>) -> Config {
        Config {
            values: defaults.clone(),
            defaults,
            origin: BTreeMap::new(),
        }
    }

    fn is_section(&self, key: &str) -> bool {
        let prefix = format!("{key}.");
        self.values
            .range(prefix.clone()..)
            .next()
            .is_some_and(|(k, _)| k.starts_with(&prefix))
    }

    fn exists(&self, key: &str) -> bool {
        self.values.contains_key(key) || self.is_section(key)
    }

    pub fn remove(&mut self, key: &str) {
        self.values.retain(|k, _| !super::table::within(k, key));
        self.origin.retain(|k, _| !super::table::within(k, key));
    }

    /// Sets `key` to `value`; a non-empty dict merges into what is there, as OmegaConf's
    /// `update(merge=True)` and a config file's merge do.
    fn put(&mut self, key: &str, value: &Value, origin: &str) {
        match value {
            Value::Object(map) if !map.is_empty() && !key.is_empty() => {
                self.values.remove(key);
                self.origin.remove(key);
            }
            _ => self.remove(key),
        }
        let mut leaves = Vec::new();
        flatten(key, value, &mut leaves);
        for (k, v) in leaves {
            self.origin.insert(k.clone(), origin.to_string());
            self.values.insert(k, v);
        }
    }

    /// A config file's keys, merged over what is there.
    pub fn merge(&mut self, file: &ConfigFile) {
        if file.body.as_object().is_some_and(|m| m.is_empty()) {
            return;
        }
        let mut leaves = Vec::new();
        flatten("", &file.body, &mut leaves);
        for (key, value) in leaves {
            let origin = format!("{}: {key}", file.file);
            self.put(&key, &value, &origin);
        }
    }

    /// Moves the leaves under `from` to `to` (a leaf or a section), keeping where each came
    /// from; what was at `to` is replaced.
    pub fn rename(&mut self, from: &str, to: &str) {
        let moved: Vec<(String, Value)> = self
            .values
            .iter()
            .filter(|(k, _)| super::table::within(k, from))
            .map(|(k, v)| (format!("{to}{}", &k[from.len()..]), v.clone()))
            .collect();
        let origins: Vec<(String, String)> = self
            .origin
            .iter()
            .filter(|(k, _)| super::table::within(k, from))
            .map(|(k, o)| (format!("{to}{}", &k[from.len()..]), o.clone()))
            .collect();
        self.remove(from);
        self.remove(to);
        self.values.extend(moved);
        self.origin.extend(origins);
    }

    /// One command-line override, as Hydra applies it to VeRL's (struct-mode) config.
    pub fn apply(&mut self, o: &Override) -> Result<(), VerlError> {
        let exists = self.exists(&o.key);
        match o.op {
            Op::Set if !exists => Err(VerlError::UnknownKey {
                raw: o.raw.clone(),
                key: o.key.clone(),
                suggestion: closest(&o.key, self.values.keys().map(String::as_str)),
                layout: String::new(),
            }),
            Op::Add
                if exists
                    && !matches!(o.value, Some(Value::Object(_) | Value::Array(_)))
                    && !matches!(self.get(&o.key)?, Some(Value::Null)) =>
            {
                Err(VerlError::BadOverride {
                    raw: o.raw.clone(),
                    message: format!(
                        "`{}` is already in VeRL's config with a value; `+` adds a key it lacks or \
                     one that is null (Hydra refuses this too): drop the `+`, or write `++` to \
                     set it either way",
                        o.key
                    ),
                })
            }
            Op::Delete if !exists => Err(VerlError::BadOverride {
                raw: o.raw.clone(),
                message: format!(
                    "`{}` is not in VeRL's config, so there is nothing to delete",
                    o.key
                ),
            }),
            Op::Delete => {
                self.remove(&o.key);
                Ok(())
            }
            _ => {
                self.put(&o.key, o.value.as_ref().expect("set ops carry a value"), &o.raw);
                Ok(())
            }
        }
    }

    /// The value of a leaf with its interpolations resolved; None when the key is not there.
    pub fn get(&self, key: &str) -> Result<Option<Value>, VerlError> {
        match self.values.get(key) {
            None => Ok(None),
            Some(v) => self.resolve(key, v, 0).map(Some),
        }
    }

    fn resolve(&self, key: &str, value: &Value, depth: usize) -> Result<Value, VerlError> {
        let Value::String(s) = value else {
            return Ok(value.clone());
        };
        if !s.contains("${") {
            return Ok(value.clone());
        }
        let bad = |message: String| VerlError::Interpolation {
            key: key.to_string(),
            value: s.clone(),
            message,
        };
        if depth > 16 {
            return Err(bad("interpolations refer to each other in a loop".into()));
        }
        let mut out = String::new();
        let mut rest = s.as_str();
        let mut whole = None;
        while let Some(start) = rest.find("${") {
            let end = rest[start..]
                .find('}')
                .ok_or_else(|| bad("an unclosed `${`".into()))?
                + start;
            let resolved = self
                .expression(key, rest[start + 2..end].trim(), depth)
                .map_err(bad)?;
            if start == 0 && end + 1 == rest.len() && out.is_empty() {
                whole = Some(resolved.clone());
            }
            out.push_str(&rest[..start]);
            out.push_str(&match &resolved {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            });
            rest = &rest[end + 1..];
        }
        out.push_str(rest);
        Ok(whole.unwrap_or(Value::String(out)))
    }

    /// `a.b`, `.sibling`, `oc.select:a.b,default`, `oc.env:NAME,default`.
    fn expression(&self, key: &str, expr: &str, depth: usize) -> Result<Value, String> {
        let (func, args) = match expr.split_once(':') {
            Some((f, a)) if f.starts_with("oc.") => (Some(f), a),
            _ => (None, expr),
        };
        let (target, default) = match args.split_once(',') {
            Some((t, d)) => (t.trim(), Some(d.trim())),
            None => (args.trim(), None),
        };
        let default_value = || -> Result<Value, String> {
            parse_value(default.unwrap_or("null")).map_err(|e| format!("its default: {e}"))
        };
        match func {
            Some("oc.env") => match std::env::var(target) {
                Ok(v) => Ok(Value::String(v)),
                Err(_) if default.is_some() => default_value(),
                Err(_) => Err(format!("the environment variable {target} is not set")),
            },
            None | Some("oc.select") => {
                let absolute = relative_to(key, target);
                match self.values.get(&absolute) {
                    Some(v) => self.resolve(&absolute, v, depth + 1).map_err(|e| e.to_string()),
                    None if func.is_some() => default_value(),
                    None => Err(format!("`{absolute}` is not in the config")),
                }
            }
            Some(f) => Err(format!(
                "the resolver `{f}` is not one grpo verl knows (oc.select, oc.env)"
            )),
        }
    }
}

/// A `${.x}` (or `${..x}`) reference made absolute from the key holding it.
fn relative_to(key: &str, target: &str) -> String {
    let dots = target.chars().take_while(|&c| c == '.').count();
    if dots == 0 {
        return target.to_string();
    }
    let mut parts: Vec<&str> = key.split('.').collect();
    for _ in 0..dots.min(parts.len()) {
        parts.pop();
    }
    let name = &target[dots..];
    if parts.is_empty() {
        name.to_string()
    } else {
        format!("{}.{name}", parts.join("."))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// VeRL 0.7.0's FSDP config, whose values these tests name.
    fn config() -> Config {
        Config::new(super::super::version::VERSIONS[1].defaults("dp").unwrap())
    }

    #[test]
    fn hydra_values() {
        let v = |raw: &str| Override::parse(raw).unwrap().value.unwrap();
        assert_eq!(v("a.b=True"), json!(true));
        assert_eq!(v("a.b=1e-6"), json!(1e-6));
        assert_eq!(v("a.b=null"), Value::Null);
        assert_eq!(v("a.b="), json!(""));
        assert_eq!(v(r#"a.b=["console","wandb"]"#), json!(["console", "wandb"]));
        assert_eq!(v("a.b=[console,wandb]"), json!(["console", "wandb"]));
        assert_eq!(v("a.b='x,y'"), json!("x,y"));
        assert_eq!(v("a.b=~/data/train.parquet"), json!("~/data/train.parquet"));
        assert_eq!(Override::parse("+a.b=1").unwrap().op, Op::Add);
        assert_eq!(Override::parse("++a.b=1").unwrap().op, Op::Force);
        assert_eq!(Override::parse("~a.b").unwrap().op, Op::Delete);
    }

    #[test]
    fn hydras_grammar() {
        let v = |raw: &str| Override::parse(raw).unwrap().value.unwrap();
        // Escapes of the grammar's own characters, `*` unquoted, nested dicts.
        assert_eq!(
            v(r"a.b={model.visual.blocks.\{*\}:{},lm_head:{}}"),
            json!({"model.visual.blocks.{*}": {}, "lm_head": {}})
        );
        assert_eq!(v("a.b=[full]"), json!(["full"]));
        assert_eq!(v("a.b=uv -v run --frozen"), json!("uv -v run --frozen"));
        assert_eq!(v("a.b=${oc.env:HOME}/x"), json!("${oc.env:HOME}/x"));
        assert_eq!(v("a.b=3e-4"), json!(3e-4));
        assert_eq!(v("a.b=1_000"), json!(1000));
        assert_eq!(v("a.b=TRUE"), json!(true));
        assert_eq!(v(r"a.b='it\'s'"), json!("it's"));
    }

    #[test]
    fn plus_adds_over_null_and_dicts_merge() {
        let mut c = Config::new(super::super::version::VERSIONS[0].defaults("megatron").unwrap());
        let key = "actor_rollout_ref.actor.megatron.override_transformer_config";
        // Hydra's `+` takes a key whose value is null (VeRL's Megatron scripts rely on it).
        c.apply(&Override::parse(&format!("+{key}.recompute_method=uniform")).unwrap())
            .unwrap();
        assert_eq!(
            c.get(&format!("{key}.recompute_method")).unwrap(),
            Some(json!("uniform"))
        );
        let err = c
            .apply(&Override::parse(&format!("+{key}.attention_backend=fused")).unwrap())
            .unwrap_err();
        assert!(
            err.to_string().contains("already in VeRL's config with a value"),
            "{err}"
        );
        // A dict merges into the section, as OmegaConf's update(merge=True).
        c.apply(&Override::parse(&format!("{key}={{recompute_num_layers: 2}}")).unwrap())
            .unwrap();
        assert_eq!(
            c.get(&format!("{key}.recompute_num_layers")).unwrap(),
            Some(json!(2))
        );
        assert_eq!(
            c.get(&format!("{key}.recompute_method")).unwrap(),
            Some(json!("uniform"))
        );
    }

    #[test]
    fn malformed_overrides_say_why() {
        let err = |raw: &str| Override::parse(raw).unwrap_err().to_string();
        assert!(
            err("data.train_batch_size").contains("expected key=value"),
            "{}",
            err("x")
        );
        assert!(err("data..x=1").contains("is not a dotted key"));
        assert!(err("trainer.logger=console,wandb").contains("sweep over"));
        assert!(err("trainer.logger=[console,wandb").contains("unclosed quote or bracket"));
    }

    #[test]
    fn interpolations_resolve() {
        let mut c = config();
        let project = Override::parse("trainer.project_name=p").unwrap();
        c.apply(&project).unwrap();
        assert_eq!(
            c.get("trainer.default_local_dir").unwrap().unwrap(),
            json!("checkpoints/p/gsm8k")
        );
        assert_eq!(
            c.get("actor_rollout_ref.actor.rollout_n").unwrap().unwrap(),
            json!(1)
        );
        c.apply(&Override::parse("actor_rollout_ref.rollout.n=5").unwrap())
            .unwrap();
        assert_eq!(
            c.get("actor_rollout_ref.actor.rollout_n").unwrap().unwrap(),
            json!(5)
        );
        // `${.save_contents}` is a sibling.
        assert_eq!(
            c.get("critic.checkpoint.load_contents").unwrap().unwrap(),
            json!(["model", "optimizer", "extra"])
        );
    }

    #[test]
    fn struct_mode_as_hydra() {
        let mut c = config();
        let err = c
            .apply(&Override::parse("data.train_batch_sise=4").unwrap())
            .unwrap_err();
        assert!(
            err.to_string().contains("did you mean `data.train_batch_size`"),
            "{err}"
        );
        let err = c
            .apply(&Override::parse("+data.train_batch_size=4").unwrap())
            .unwrap_err();
        assert!(err.to_string().contains("already in VeRL's config"), "{err}");
        c.apply(&Override::parse("+custom_reward_function.reward_kwargs.scale=2").unwrap())
            .unwrap();
        assert_eq!(
            c.get("custom_reward_function.reward_kwargs.scale").unwrap(),
            Some(json!(2))
        );
        c.apply(&Override::parse("~custom_reward_function.reward_kwargs").unwrap())
            .unwrap();
        assert_eq!(c.get("custom_reward_function.reward_kwargs.scale").unwrap(), None);
    }
}

//! VeRL's config as `python3 -m verl.trainer.main_ppo` builds it with Hydra: VeRL's defaults
//! (`verl_defaults.tsv`), then a `--config-path/--config-name` file, then the command line's
//! overrides (`key=value`, `+key=value`, `++key=value`, `~key`), with OmegaConf's `${...}`
//! interpolations resolved when a value is read. The config is held flat, one entry per leaf.

use super::VerlError;
use crate::recipe::closest;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

const DEFAULTS: &str = include_str!("verl_defaults.tsv");

/// VeRL's defaults, leaf by leaf.
pub fn defaults() -> BTreeMap<String, Value> {
    DEFAULTS
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (key, value) = l.split_once('\t').expect("verl_defaults.tsv: key<TAB>json");
            (
                key.to_string(),
                serde_json::from_str(value).expect("verl_defaults.tsv: json"),
            )
        })
        .collect()
}

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

/// A value as Hydra reads it: YAML's scalars, `[a,b]` lists and `{k: v}` maps; an empty value is
/// the empty string. A top-level comma is a sweep, which only `--multirun` takes.
fn parse_value(text: &str) -> Result<Value, String> {
    if text.is_empty() {
        return Ok(Value::String(String::new()));
    }
    let (mut depth, mut quote) = (0i32, None::<char>);
    for c in text.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '[' | '{' | '(') => depth += 1,
            (None, ']' | '}' | ')') => depth -= 1,
            (None, ',') if depth == 0 => {
                return Err(format!(
                    "`{text}` is a list of values to sweep over, which runs several jobs \
                     (Hydra's --multirun, not supported); for one list value write it in \
                     brackets: `[{text}]`"
                ))
            }
            _ => {}
        }
    }
    if quote.is_some() || depth != 0 {
        return Err(format!(
            "`{text}` has an unclosed quote or bracket (quote the whole override for the shell: \
             'key=[\"a\",\"b\"]')"
        ));
    }
    let yaml: serde_yaml::Value =
        serde_yaml::from_str(text).map_err(|e| format!("`{text}` is not a value Hydra reads: {e}"))?;
    serde_json::to_value(&yaml).map_err(|e| format!("`{text}`: {e}"))
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

/// VeRL's config, flat: leaf key -> value, and where each value the user gave came from.
pub struct Config {
    pub values: BTreeMap<String, Value>,
    pub defaults: BTreeMap<String, Value>,
    /// Leaf key -> the override or file entry that set it.
    pub origin: BTreeMap<String, String>,
}

impl Config {
    pub fn new() -> Config {
        let defaults = defaults();
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

    fn remove(&mut self, key: &str) {
        self.values.retain(|k, _| !super::table::within(k, key));
        self.origin.retain(|k, _| !super::table::within(k, key));
    }

    fn put(&mut self, key: &str, value: &Value, origin: &str) {
        self.remove(key);
        let mut leaves = Vec::new();
        flatten(key, value, &mut leaves);
        for (k, v) in leaves {
            self.origin.insert(k.clone(), origin.to_string());
            self.values.insert(k, v);
        }
    }

    /// A `--config-path/--config-name` file: its `defaults` list may name VeRL's own
    /// `ppo_trainer` and `_self_` (what a user's config composes onto); its keys are merged over
    /// VeRL's defaults.
    pub fn merge_file(&mut self, path: &Path) -> Result<(), VerlError> {
        let file = path.display().to_string();
        let bad = |message: String| VerlError::ConfigFile {
            file: file.clone(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
        let yaml: serde_yaml::Value =
            serde_yaml::from_str(&text).map_err(|e| bad(format!("this is not valid YAML: {e}")))?;
        let mut tree = serde_json::to_value(&yaml).map_err(|e| bad(e.to_string()))?;
        let Some(map) = tree.as_object_mut() else {
            return Err(bad("expected a mapping of VeRL's config sections".into()));
        };
        if let Some(list) = map.remove("defaults") {
            for item in list.as_array().into_iter().flatten() {
                match item.as_str() {
                    Some("ppo_trainer" | "_self_") => {}
                    _ => {
                        return Err(bad(format!(
                            "`defaults` entry {item}: grpo verl composes VeRL's `ppo_trainer` \
                             config only; choosing other config groups (megatron, other \
                             workers) is not supported"
                        )))
                    }
                }
            }
        }
        // Hydra's own settings (search paths, run directories) say nothing about the run.
        map.remove("hydra");
        let mut leaves = Vec::new();
        flatten("", &tree, &mut leaves);
        for (key, value) in leaves {
            let origin = format!("{file}: {key}");
            self.put(&key, &value, &origin);
        }
        Ok(())
    }

    /// One command-line override, as Hydra applies it to VeRL's (struct-mode) config.
    pub fn apply(&mut self, o: &Override) -> Result<(), VerlError> {
        let exists = self.exists(&o.key);
        match o.op {
            Op::Set if !exists => Err(VerlError::UnknownKey {
                raw: o.raw.clone(),
                key: o.key.clone(),
                suggestion: closest(&o.key, self.values.keys().map(String::as_str)),
            }),
            Op::Add if exists => Err(VerlError::BadOverride {
                raw: o.raw.clone(),
                message: format!(
                    "`{}` is already in VeRL's config; `+` adds a key it lacks (Hydra refuses \
                     this too): drop the `+`, or write `++` to set it either way",
                    o.key
                ),
            }),
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
        let mut c = Config::new();
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
        let mut c = Config::new();
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

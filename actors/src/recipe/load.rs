//! Reading a recipe: YAML text -> [`Recipe`], with errors a person can act on.

use super::validate::{validate, Violation};
use super::Recipe;
use std::fmt;
use std::path::Path;

/// Everything that can be wrong with a recipe. Each message says what, where and what to do.
#[derive(Debug, thiserror::Error)]
pub enum RecipeError {
    #[error("cannot read recipe {file}: {source}")]
    Io {
        file: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{at}: this is not valid YAML: {message}")]
    Syntax { at: Location, message: String },
    #[error("{at}: unknown key `{key}`{}", suggestion_text(.suggestion))]
    UnknownKey {
        at: Location,
        key: String,
        suggestion: Option<String>,
    },
    #[error("{at}: `{key}` expects {expected}, but found {found}")]
    WrongType {
        at: Location,
        key: String,
        expected: String,
        found: String,
    },
    #[error("{at}: `{key}` must be one of {allowed}, but found `{found}`{}", suggestion_text(.suggestion))]
    UnknownVariant {
        at: Location,
        key: String,
        found: String,
        allowed: String,
        suggestion: Option<String>,
    },
    #[error("{file}: missing required key `{key}`: add it under `{section}:`{}", example_text(.example))]
    Missing {
        file: String,
        key: String,
        section: String,
        example: Option<&'static str>,
    },
    #[error("{at}: `{key}`: {message}")]
    Invalid {
        at: Location,
        key: String,
        message: String,
    },
    #[error("--set {raw}: {message}")]
    BadOverride { raw: String, message: String },
    #[error("{file}: {} invalid value{}:\n{}", .violations.len(), if .violations.len() == 1 { "" } else { "s" }, render_violations(.violations))]
    OutOfRange {
        file: String,
        violations: Vec<Violation>,
    },
}

fn suggestion_text(s: &Option<String>) -> String {
    match s {
        Some(s) => format!("; did you mean `{s}`?"),
        None => String::new(),
    }
}

fn example_text(e: &Option<&'static str>) -> String {
    match e {
        Some(e) => format!(" (for example `{e}`)"),
        None => String::new(),
    }
}

fn render_violations(v: &[Violation]) -> String {
    v.iter().map(|v| format!("  {v}")).collect::<Vec<_>>().join("\n")
}

/// Where in the recipe something is: a file with a line and column, or a `--set` override.
#[derive(Debug, Clone, PartialEq)]
pub enum Location {
    File {
        file: String,
        line: usize,
        column: usize,
    },
    FileOnly {
        file: String,
    },
    Override {
        raw: String,
    },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::File { file, line, column } => write!(f, "{file}:{line}:{column}"),
            Location::FileOnly { file } => write!(f, "{file}"),
            Location::Override { raw } => write!(f, "--set {raw}"),
        }
    }
}

/// Read, parse, override and validate a recipe file.
///
/// `overrides` are `KEY=VALUE` strings with dotted keys (`rollout.n=8`); each value is read
/// as YAML (`[a, b]` is a list, an empty value is null) and checked like a key in the file.
pub fn load_recipe(path: &Path, overrides: &[String]) -> Result<Recipe, RecipeError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| RecipeError::Io {
        file: file.clone(),
        source,
    })?;
    let recipe = load_recipe_str(&text, &file)?;
    let recipe = apply_overrides(&recipe, overrides, &file)?;
    let violations = validate(&recipe, &text, &file, overrides);
    if violations.is_empty() {
        Ok(recipe)
    } else {
        Err(RecipeError::OutOfRange { file, violations })
    }
}

/// Parse recipe text (no overrides, no range checks). `file` names it in messages.
pub fn load_recipe_str(text: &str, file: &str) -> Result<Recipe, RecipeError> {
    let de = serde_yaml::Deserializer::from_str(text);
    let recipe: Recipe = serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let at = match inner.location() {
            Some(l) => Location::File {
                file: file.into(),
                line: l.line(),
                column: l.column(),
            },
            None => Location::FileOnly { file: file.into() },
        };
        classify(&path, &bare_message(&inner.to_string()), at, file)
    })?;
    if recipe.data.train_files.0.is_empty() {
        return Err(RecipeError::Missing {
            file: file.into(),
            key: "data.train_files".into(),
            section: "data".into(),
            example: example_for("data.train_files"),
        });
    }
    Ok(recipe)
}

/// Apply `--set KEY=VALUE` overrides to a parsed recipe, checking each like a key in the file.
pub fn apply_overrides(recipe: &Recipe, overrides: &[String], file: &str) -> Result<Recipe, RecipeError> {
    if overrides.is_empty() {
        return Ok(recipe.clone());
    }
    let mut tree = serde_yaml::to_value(recipe).expect("recipes serialize");
    for raw in overrides {
        let (key, value) = raw.split_once('=').ok_or_else(|| RecipeError::BadOverride {
            raw: raw.clone(),
            message: "expected KEY=VALUE, for example `--set rollout.n=8`".into(),
        })?;
        let key = key.trim();
        if key.is_empty() || key.split('.').any(str::is_empty) {
            return Err(RecipeError::BadOverride {
                raw: raw.clone(),
                message: format!("`{key}` is not a dotted key such as `actor.optim.lr`"),
            });
        }
        let value: serde_yaml::Value = serde_yaml::from_str(value).map_err(|e| RecipeError::BadOverride {
            raw: raw.clone(),
            message: format!("the value is not valid YAML: {}", bare_message(&e.to_string())),
        })?;
        set_path(&mut tree, key, value).map_err(|message| RecipeError::BadOverride {
            raw: raw.clone(),
            message,
        })?;
        // Check after each override so an error names the override that caused it.
        serde_path_to_error::deserialize::<_, Recipe>(tree.clone()).map_err(|e| {
            let path = e.path().to_string();
            let message = bare_message(&e.into_inner().to_string());
            classify(&path, &message, Location::Override { raw: raw.clone() }, file)
        })?;
    }
    Ok(serde_yaml::from_value(tree).expect("checked above"))
}

pub(crate) fn set_path(
    tree: &mut serde_yaml::Value,
    key: &str,
    value: serde_yaml::Value,
) -> Result<(), String> {
    let parts: Vec<&str> = key.split('.').collect();
    let mut node = tree;
    for (i, part) in parts.iter().enumerate() {
        let map = match node {
            serde_yaml::Value::Mapping(m) => m,
            serde_yaml::Value::Null => {
                *node = serde_yaml::Value::Mapping(Default::default());
                node.as_mapping_mut().expect("just made a mapping")
            }
            _ => {
                return Err(format!(
                    "`{}` is a value, not a section with keys",
                    parts[..i].join(".")
                ))
            }
        };
        let k = serde_yaml::Value::String((*part).to_string());
        if i + 1 == parts.len() {
            map.insert(k, value);
            return Ok(());
        }
        node = map.entry(k).or_insert(serde_yaml::Value::Null);
    }
    Ok(())
}

/// serde_yaml appends " at line L column C" and may prefix "path: "; keep only the message.
pub(crate) fn bare_message(msg: &str) -> String {
    let msg = match msg.rfind(" at line ") {
        Some(i) => &msg[..i],
        None => msg,
    };
    // A leading "some.path: " added by serde_yaml duplicates what we print ourselves.
    match msg.split_once(": ") {
        Some((head, rest))
            if !head.contains(' ')
                && (head.contains('.') || !head.starts_with("invalid"))
                && !rest.is_empty() =>
        {
            if head.chars().all(|c| c.is_alphanumeric() || "._[]-".contains(c)) {
                return rest.to_string();
            }
            msg.to_string()
        }
        _ => msg.to_string(),
    }
}

/// Turn one serde message at a key path into a [`RecipeError`].
fn classify(path: &str, message: &str, at: Location, file: &str) -> RecipeError {
    let path = if path == "." { "" } else { path };
    if let Some(rest) = message.strip_prefix("unknown field `") {
        let name = rest.split('`').next().unwrap_or_default();
        // serde_path_to_error's path stops at the struct holding the unknown key.
        let key = join(parent_of_unknown(path, name), name);
        let parent = key.rsplit_once('.').map(|(p, _)| p).unwrap_or("");
        // serde lists the fields the struct has: the nearest of them first (it also knows the
        // fields of a map's values and of tagged variants, which the recipe's key table does not).
        let fields = backticked(rest.split_once("expected").map(|(_, r)| r).unwrap_or(""));
        let suggestion = closest(name, fields.iter().map(String::as_str))
            .map(|field| join(parent, &field))
            .or_else(|| suggest_key(&key, parent, name));
        return RecipeError::UnknownKey { suggestion, key, at };
    }
    if let Some(rest) = message.strip_prefix("missing field `") {
        let name = rest.split('`').next().unwrap_or_default();
        let key = join(path, name);
        let section = if path.is_empty() {
            "the top level".to_string()
        } else {
            path.to_string()
        };
        return RecipeError::Missing {
            file: file.into(),
            example: example_for(&key),
            key,
            section,
        };
    }
    if let Some(rest) = message.strip_prefix("unknown variant `") {
        let found = rest.split('`').next().unwrap_or_default().to_string();
        let choices = backticked(rest.split_once("expected").map(|(_, r)| r).unwrap_or(""));
        let suggestion = closest(&found, choices.iter().map(String::as_str));
        let allowed = choices
            .iter()
            .map(|c| format!("`{c}`"))
            .collect::<Vec<_>>()
            .join(", ");
        return RecipeError::UnknownVariant {
            at,
            key: path.into(),
            found,
            allowed,
            suggestion,
        };
    }
    for prefix in ["invalid type: ", "invalid value: "] {
        if let Some(rest) = message.strip_prefix(prefix) {
            if let Some((found, expected)) = rest.split_once(", expected ") {
                return RecipeError::WrongType {
                    at,
                    key: path.into(),
                    expected: describe_expected(expected),
                    found: found.to_string(),
                };
            }
        }
    }
    if let Some(rest) = message.strip_prefix("duplicate field `") {
        let name = rest.split('`').next().unwrap_or_default();
        return RecipeError::Invalid {
            at,
            key: join(path, name),
            message: "written twice; keep one".into(),
        };
    }
    if path.is_empty() && message.contains("invalid type: unit value") {
        return RecipeError::Invalid {
            at,
            key: "<recipe>".into(),
            message: "the recipe is empty".into(),
        };
    }
    if at_is_syntax(message) {
        return RecipeError::Syntax {
            at,
            message: message.to_string(),
        };
    }
    RecipeError::Invalid {
        at,
        key: if path.is_empty() {
            "<recipe>".into()
        } else {
            path.into()
        },
        message: message.into(),
    }
}

fn at_is_syntax(message: &str) -> bool {
    [
        "did not find expected",
        "mapping values are not allowed",
        "found character",
        "while parsing",
        "while scanning",
        "found unexpected",
        "could not find expected",
    ]
    .iter()
    .any(|m| message.contains(m))
}

fn parent_of_unknown<'a>(path: &'a str, name: &str) -> &'a str {
    // Depending on the serde_path_to_error version the path may already end in the key.
    match path.rsplit_once('.') {
        Some((parent, last)) if last == name => parent,
        None if path == name => "",
        _ => path,
    }
}

fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_string()
    } else {
        format!("{parent}.{name}")
    }
}

fn backticked(s: &str) -> Vec<String> {
    s.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// Translate serde's Rust-flavoured expectations into recipe words.
fn describe_expected(expected: &str) -> String {
    let e = expected.trim();
    let word = match e {
        "usize" | "u64" | "u32" | "u16" | "u8" => "a non-negative integer",
        "i64" | "i32" | "isize" => "an integer",
        "f64" | "f32" => "a number",
        "a boolean" | "bool" => "true or false",
        "a string" => "a string",
        "a sequence" => "a list",
        "an array of length 2" => "a list of two numbers",
        _ => return e.to_string(),
    };
    format!("{word} ({e})")
}

/// The candidate nearest to a misspelt `word`, if any is near (recipe keys, VeRL keys).
pub(crate) fn closest<'a>(word: &str, candidates: impl Iterator<Item = &'a str>) -> Option<String> {
    candidates
        .map(|c| {
            (
                strsim::damerau_levenshtein(word, c),
                strsim::jaro_winkler(word, c),
                c,
            )
        })
        .filter(|(d, jw, c)| *d <= (word.len().max(c.len()) / 3).max(2) || *jw > 0.88)
        .min_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)))
        .map(|(_, _, c)| c.to_string())
}

/// The closest valid key: first among the siblings of the unknown key, then anywhere (a key
/// placed in the wrong section, such as `rollout.clip_ratio_low`).
/// Keys inside list entries (`cluster.pools[2].nme`) are matched against the documented
/// `cluster.pools[].name` and suggested with their index (`cluster.pools[2].name`).
fn suggest_key(key: &str, parent: &str, name: &str) -> Option<String> {
    let all = Recipe::all_keys();
    let generic_parent = without_indices(parent);
    let siblings: Vec<&str> = all
        .iter()
        .filter_map(|k| {
            let (p, n) = k.rsplit_once('.').unwrap_or(("", k.as_str()));
            (p == generic_parent).then_some(n)
        })
        .collect();
    if let Some(s) = closest(name, siblings.into_iter()) {
        return Some(join(parent, &s));
    }
    let exact_elsewhere: Vec<&String> = all
        .iter()
        .filter(|k| k.rsplit('.').next() == Some(name))
        .collect();
    if let Some(k) = exact_elsewhere.first() {
        return Some((*k).clone());
    }
    closest(key, all.iter().map(String::as_str))
}

/// `cluster.pools[2].roles` -> `cluster.pools[].roles`.
fn without_indices(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    let mut in_brackets = false;
    for c in key.chars() {
        match c {
            '[' => {
                in_brackets = true;
                out.push(c);
            }
            ']' => {
                in_brackets = false;
                out.push(c);
            }
            _ if in_brackets => {}
            _ => out.push(c),
        }
    }
    out
}

fn example_for(key: &str) -> Option<&'static str> {
    match key {
        "model" => Some("model: {path: models/SmolLM2-135M-Instruct.Q4_1.gguf}"),
        "model.path" => Some("path: models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        "data" => Some("data: {train_files: data/train.parquet}"),
        "data.train_files" => Some("train_files: data/train.parquet"),
        "cluster.ray.address" => Some("address: http://127.0.0.1:8265"),
        _ if key.starts_with("cluster.pools[") && key.ends_with("].name") => Some("name: cpu-reward"),
        _ if key.starts_with("cluster.pools[") && key.ends_with("].roles") => Some("roles: [reward]"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "model:\n  path: m.gguf\ndata:\n  train_files: t.parquet\n";

    fn err(text: &str) -> String {
        load_recipe_str(text, "r.yaml").unwrap_err().to_string()
    }

    #[test]
    fn unknown_keys_inside_scorer_definitions_suggest_the_scorer_s_own_fields() {
        let m = err(&format!(
            "{MINIMAL}reward:\n  scorers:\n    rm: {{kind: reward_model, path: x, max_lenght: 10}}\n"
        ));
        assert!(
            m.contains(
                "unknown key `reward.scorers.rm.max_lenght`; did you mean `reward.scorers.rm.max_length`?"
            ),
            "{m}"
        );
    }

    #[test]
    fn minimal_recipe_gets_defaults() {
        let r = load_recipe_str(MINIMAL, "r.yaml").unwrap();
        assert_eq!(r.rollout.n, 4);
        assert_eq!(r.data.train_files.0, vec![std::path::PathBuf::from("t.parquet")]);
        assert_eq!(r.actor.optim.betas, [0.9, 0.999]);
    }

    #[test]
    fn unknown_key_names_file_line_column_and_nearest_key() {
        let m = err(&format!("{MINIMAL}rollout:\n  nn: 8\n"));
        assert_eq!(
            m,
            "r.yaml:6:3: unknown key `rollout.nn`; did you mean `rollout.n`?"
        );
        let m = err(&format!("{MINIMAL}actor:\n  optim:\n    lrr: 0.1\n"));
        assert_eq!(
            m,
            "r.yaml:7:5: unknown key `actor.optim.lrr`; did you mean `actor.optim.lr`?"
        );
    }

    #[test]
    fn key_in_the_wrong_section_points_to_the_right_one() {
        let m = err(&format!("{MINIMAL}rollout:\n  clip_ratio_low: 0.2\n"));
        assert!(
            m.contains("unknown key `rollout.clip_ratio_low`; did you mean `actor.clip_ratio_low`?"),
            "{m}"
        );
    }

    #[test]
    fn trainer_logger_takes_a_name_or_a_list_as_verl_does() {
        use tracking::Logger;
        let r = load_recipe_str(MINIMAL, "r.yaml").unwrap();
        assert_eq!(r.trainer.logger, [Logger::Console, Logger::File]);
        let r = load_recipe_str(&format!("{MINIMAL}trainer:\n  logger: wandb\n"), "r.yaml").unwrap();
        assert_eq!(r.trainer.logger, [Logger::Wandb]);
        let r = load_recipe_str(
            &format!("{MINIMAL}trainer:\n  logger: [console, tensorboard, mlflow]\n"),
            "r.yaml",
        )
        .unwrap();
        assert_eq!(
            r.trainer.logger,
            [Logger::Console, Logger::Tensorboard, Logger::Mlflow]
        );
        let m = err(&format!("{MINIMAL}trainer:\n  logger: [console, wandbb]\n"));
        assert!(
            m.starts_with("r.yaml:6:")
                && m.contains(
                    "unknown logger `wandbb`; the loggers are console, file, tensorboard, mlflow and wandb"
                ),
            "{m}"
        );
    }

    #[test]
    fn unknown_section_is_named() {
        let m = err(&format!("{MINIMAL}rolout:\n  n: 8\n"));
        assert_eq!(m, "r.yaml:5:1: unknown key `rolout`; did you mean `rollout`?");
    }

    #[test]
    fn wrong_type_names_key_line_expected_and_found() {
        let m = err(&format!("{MINIMAL}rollout:\n  n: many\n"));
        assert_eq!(
            m,
            "r.yaml:6:6: `rollout.n` expects a non-negative integer (usize), but found string \"many\""
        );
        let m = err(&format!("{MINIMAL}trainer:\n  val_before_train: 3\n"));
        assert!(
            m.starts_with("r.yaml:6:21: `trainer.val_before_train` expects"),
            "{m}"
        );
        assert!(m.contains("integer `3`"), "{m}");
    }

    #[test]
    fn unknown_enum_value_lists_choices() {
        let m = err(&format!("{MINIMAL}actor:\n  loss_agg_mode: token_mean\n"));
        assert!(
            m.contains("`actor.loss_agg_mode` must be one of `token-mean`"),
            "{m}"
        );
        assert!(m.contains("did you mean `token-mean`?"), "{m}");
    }

    #[test]
    fn missing_required_keys_say_where_they_belong() {
        let m = err("model:\n  path: m\ndata:\n  train_batch_size: 4\n");
        assert!(
            m.starts_with("r.yaml: missing required key `data.train_files`: add it under `data:`"),
            "{m}"
        );
        let m = err("data:\n  train_files: t\n");
        assert!(
            m.contains("missing required key `model`: add it under `the top level:`"),
            "{m}"
        );
    }

    #[test]
    fn duplicate_keys_are_named() {
        let m = err(&format!("{MINIMAL}data:\n  train_files: u\n"));
        assert!(m.ends_with("`data`: written twice; keep one"), "{m}");
    }

    #[test]
    fn syntax_errors_have_a_location() {
        let m = err("model:\n  path: m\n  - x\ndata: {}\n");
        assert!(m.starts_with("r.yaml:"), "{m}");
        assert!(m.contains("not valid YAML"), "{m}");
    }

    #[test]
    fn overrides_are_checked_like_file_keys() {
        let r = load_recipe_str(MINIMAL, "r.yaml").unwrap();
        let set = |s: &str| apply_overrides(&r, &[s.to_string()], "r.yaml");
        assert_eq!(set("rollout.n=16").unwrap().rollout.n, 16);
        assert_eq!(
            set("actor.optim.betas=[0.8, 0.9]").unwrap().actor.optim.betas,
            [0.8, 0.9]
        );
        assert_eq!(set("model.tokenizer=").unwrap().model.tokenizer, None);
        assert_eq!(
            set("data.val_files=v.parquet").unwrap().data.val_files.0,
            vec![std::path::PathBuf::from("v.parquet")]
        );
        let m = set("rollout.n=abc").unwrap_err().to_string();
        assert_eq!(m, "--set rollout.n=abc: `rollout.n` expects a non-negative integer (usize), but found string \"abc\"");
        let m = set("rollout.nn=3").unwrap_err().to_string();
        assert_eq!(
            m,
            "--set rollout.nn=3: unknown key `rollout.nn`; did you mean `rollout.n`?"
        );
        let m = set("rollout.n").unwrap_err().to_string();
        assert!(m.contains("expected KEY=VALUE"), "{m}");
        let m = set("rollout.n.x=1").unwrap_err().to_string();
        assert!(m.contains("`rollout.n` is a value, not a section"), "{m}");
    }

    #[test]
    fn unknown_keys_in_list_entries_suggest_the_entry_key() {
        let m = err(&format!(
            "{MINIMAL}cluster:\n  launcher: ray\n  pools:\n    - name: a\n      roles: [reward]\n      wokers: 2\n"
        ));
        assert_eq!(
            m,
            "r.yaml:10:7: unknown key `cluster.pools[0].wokers`; did you mean `cluster.pools[0].workers`?"
        );
        let m = err(&format!("{MINIMAL}cluster:\n  ray:\n    adress: http://h:8265\n"));
        assert_eq!(
            m,
            "r.yaml:7:5: unknown key `cluster.ray.adress`; did you mean `cluster.ray.address`?"
        );
    }

    #[test]
    fn pool_devices_and_roles_are_checked_when_read() {
        let pool = |fields: &str| format!("{MINIMAL}cluster:\n  pools:\n    - {{name: a, {fields}}}\n");
        let m = err(&pool("roles: [reward], device: gpux"));
        assert!(
            m.contains("`cluster.pools[0].device` must be one of `cpu`, `cuda`, `gpu`, `tpu`, but found `gpux`; did you mean `gpu`?"),
            "{m}"
        );
        let m = err(&pool("roles: [rollouts]"));
        assert!(
            m.contains("`cluster.pools[0].roles[0]` must be one of `reward`, `rollout`, `learner`, but found `rollouts`; did you mean `rollout`?"),
            "{m}"
        );
        let m = err(&pool("workers: 2"));
        assert_eq!(
            m,
            "r.yaml: missing required key `cluster.pools[0].roles`: add it under `cluster.pools[0]:` (for example `roles: [reward]`)"
        );
        let r = load_recipe_str(&pool("roles: [rollout], device: cuda"), "r.yaml").unwrap();
        assert_eq!(r.cluster.pools[0].device, super::super::PoolDevice::Gpu);
        let m = err(&format!(
            "{MINIMAL}cluster:\n  ray:\n    address: a\n    runtime_env: [pip]\n"
        ));
        assert!(
            m.starts_with("r.yaml:8:18: `cluster.ray.runtime_env` expects a map"),
            "{m}"
        );
    }
}

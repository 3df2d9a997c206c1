//! The recipe documentation and the ready recipes stay in step with the recipe types.

use actors::recipe::{load_recipe, Recipe};
use std::collections::BTreeSet;
use std::path::PathBuf;

fn recipes_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../recipes")
}

/// Keys documented in recipes/README.md: the first cell of each row of the tables whose
/// header starts with `| key |`.
fn documented_keys() -> BTreeSet<String> {
    let text = std::fs::read_to_string(recipes_dir().join("README.md")).unwrap();
    let mut keys = BTreeSet::new();
    let mut in_key_table = false;
    for line in text.lines() {
        if line.starts_with("| key |") {
            in_key_table = true;
        } else if !line.starts_with('|') {
            in_key_table = false;
        } else if in_key_table {
            if let Some((key, _)) = line.strip_prefix("| `").and_then(|l| l.split_once("` |")) {
                keys.insert(key.to_string());
            }
        }
    }
    keys
}

#[test]
fn every_recipe_key_is_documented() {
    let documented = documented_keys();
    let missing: Vec<String> = Recipe::all_keys()
        .into_iter()
        .filter(|k| !documented.contains(k))
        .collect();
    assert!(
        missing.is_empty(),
        "keys missing from recipes/README.md: {missing:?}"
    );
}

#[test]
fn every_documented_key_exists() {
    let keys: BTreeSet<String> = Recipe::all_keys().into_iter().collect();
    let stale: Vec<String> = documented_keys()
        .into_iter()
        .filter(|k| !keys.contains(k))
        .collect();
    assert!(
        stale.is_empty(),
        "recipes/README.md documents keys that do not exist: {stale:?}"
    );
}

/// Every recipe under `recipes/` and its subdirectories (`recipes/kuberay/`), leaving out the
/// Kubernetes manifests beside them (they have an `apiVersion`).
#[test]
fn every_ready_recipe_loads_and_is_valid() {
    let mut seen = Vec::new();
    let mut dirs = vec![recipes_dir()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml") {
                let text = std::fs::read_to_string(&path).unwrap();
                if text.lines().any(|l| l.starts_with("apiVersion:")) {
                    continue;
                }
                load_recipe(&path, &[]).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                seen.push(path);
            }
        }
    }
    assert!(
        seen.iter().any(|p| p.ends_with("kuberay/gsm8k-ray.yaml")),
        "recipes checked: {seen:?}"
    );
}

/// Rust sources of the workspace's crates that run a recipe: everything under a crate's `src/`
/// except the recipe's loading and validation (parsing and checking a key is not using it; the
/// recipe types' own methods, which turn sections into the crates' configs, count).
fn sources_that_use_recipes() -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let not_use = [
        root.join("actors/src/recipe/load.rs"),
        root.join("actors/src/recipe/validate.rs"),
    ];
    let mut text = String::new();
    let mut dirs: Vec<PathBuf> = [
        "src",
        "actors/src",
        "data/src",
        "reward/src",
        "trainer/src",
        "rollout/src",
    ]
    .iter()
    .map(|d| root.join(d))
    .collect();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if not_use.contains(&path) {
                continue;
            }
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                text.push_str(&std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    text
}

/// Keys that are read only where they are validated, or read by matching an enum's variants
/// rather than as a field, with the reason.
const READ_BY_VALIDATION_ONLY: &[(&str, &str)] = &[
    (
        "algorithm.kl_ctrl.type",
        "the tag of trainer::config::KlControl: KlController::update matches it",
    ),
    (
        "algorithm.kl_ctrl.target_kl",
        "a field of KlControl::Adaptive, bound by KlController::update's match",
    ),
    (
        "algorithm.kl_ctrl.horizon",
        "a field of KlControl::Adaptive, bound by KlController::update's match",
    ),
];

/// A recipe key that parses but that nothing reads is a key that silently does nothing. Every
/// key's field must be read (`.name`) somewhere outside the recipe's loading and validation, or
/// be listed in [`READ_BY_VALIDATION_ONLY`] with why.
#[test]
fn every_recipe_key_is_read_by_the_run() {
    let sources = sources_that_use_recipes();
    let read = |field: &str| {
        let access = format!(".{field}");
        sources.match_indices(&access).any(|(i, _)| {
            let next = sources[i + access.len()..].chars().next();
            !next.is_some_and(|c| c.is_alphanumeric() || c == '_')
        })
    };
    let unread: Vec<String> = Recipe::all_keys()
        .into_iter()
        .filter(|key| !READ_BY_VALIDATION_ONLY.iter().any(|(k, _)| k == key))
        .filter(|key| !read(key.rsplit('.').next().unwrap()))
        .collect();
    assert!(
        unread.is_empty(),
        "recipe keys parsed but never read outside recipe/load.rs and recipe/validate.rs: {unread:?}; \
         make the run \
         use each, or refuse values it cannot honour and list it in READ_BY_VALIDATION_ONLY"
    );
    for (key, _) in READ_BY_VALIDATION_ONLY {
        assert!(
            Recipe::all_keys().iter().any(|k| k == key),
            "READ_BY_VALIDATION_ONLY lists `{key}`, which is not a recipe key"
        );
    }
}

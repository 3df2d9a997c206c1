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

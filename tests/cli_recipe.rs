//! `grpo run` as a new user meets it: the resolved recipe, and errors that say what to do.

use std::path::Path;
use std::process::{Command, Output};

fn grpo(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_grpo"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("grpo runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn write_recipe(dir: &Path, text: &str) -> String {
    let path = dir.join("recipe.yaml");
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[test]
fn print_config_shows_defaults_and_overrides() {
    let o = grpo(&[
        "run",
        "recipes/quickstart.yaml",
        "--print-config",
        "--set",
        "rollout.n=16",
        "--output",
        "runs/x",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let yaml = String::from_utf8(o.stdout).unwrap();
    assert!(yaml.contains("\n  n: 16\n"), "{yaml}");
    assert!(yaml.contains("output_dir: runs/x"), "{yaml}");
    assert!(
        yaml.contains("kl_loss_type: low_var_kl"),
        "defaults filled in: {yaml}"
    );
    // The printed recipe is itself a valid recipe that resolves to the same thing.
    let dir = tempfile::tempdir().unwrap();
    let path = write_recipe(dir.path(), &yaml);
    let again = grpo(&["run", &path, "--print-config"]);
    assert_eq!(String::from_utf8(again.stdout).unwrap(), yaml);
}

#[test]
fn misspelt_key_names_line_and_nearest_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_recipe(
        dir.path(),
        "model:\n  path: m.gguf\ndata:\n  train_files: t.parquet\nrollout:\n  nn: 8\n",
    );
    let o = grpo(&["run", &path, "--print-config"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        stderr(&o),
        format!("error: {path}:6:3: unknown key `rollout.nn`; did you mean `rollout.n`?\n")
    );
}

#[test]
fn bad_override_names_the_key_and_expected_type() {
    let o = grpo(&["run", "recipes/quickstart.yaml", "--set", "rollout.n=abc"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        stderr(&o),
        "error: --set rollout.n=abc: `rollout.n` expects a non-negative integer (usize), but found string \"abc\"\n"
    );
}

#[test]
fn missing_required_key_says_where_it_belongs() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_recipe(
        dir.path(),
        "model:\n  path: m.gguf\ndata:\n  train_batch_size: 4\n",
    );
    let o = grpo(&["run", &path]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("missing required key `data.train_files`: add it under `data:`"),
        "{e}"
    );
}

#[test]
fn out_of_range_values_are_rejected_before_work_with_the_rule() {
    let o = grpo(&[
        "run",
        "recipes/quickstart.yaml",
        "--set",
        "actor.clip_ratio_low=1.5",
        "--set",
        "rollout.temperature=-1",
        "--set",
        "actor.ppo_mini_batch_size=3",
    ]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.starts_with("error: recipes/quickstart.yaml: 4 invalid values:\n"),
        "{e}"
    );
    assert!(
        e.contains("--set rollout.temperature=-1: `rollout.temperature` = -1: must be 0 (greedy) or more"),
        "{e}"
    );
    assert!(
        e.contains("--set actor.clip_ratio_low=1.5: `actor.clip_ratio_low` = 1.5: must be in [0, 1)"),
        "{e}"
    );
    assert!(e.contains("must divide data.train_batch_size (4)"), "{e}");
    assert!(
        e.contains("(actor.ppo_mini_batch_size x rollout.n = 3 x 8 = 24)"),
        "{e}"
    );
}

#[test]
fn missing_recipe_file_is_named() {
    let o = grpo(&["run", "no/such/recipe.yaml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).starts_with("error: cannot read recipe no/such/recipe.yaml: "),
        "{}",
        stderr(&o)
    );
}

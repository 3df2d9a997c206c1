//! The guides' shell blocks, run as a user runs them: in a directory laid out as a checkout after
//! `scripts/quickstart.sh` (the repository's recipes, scripts, test fixtures and .venv, the test
//! assets as `models/`, the quickstart's datasets made by its own lines), with `grpo` on the PATH, each block by bash
//! with `-euo pipefail`, the guides in order (README.md, docs/first-run.md, then the others by
//! name) so a later block finds what an earlier one wrote.
//!
//! Which blocks run is written at each fence (`src/guide_blocks.rs`): plain ```sh blocks on every
//! test run; ```sh long blocks, which train, only with `GRPO_GUIDES=long`; ```sh not-run: WHY
//! never. So that the long ones take minutes and not hours, the `grpo` on the PATH runs every
//! `grpo run` and `grpo verl` for one training step validated on 8 samples (its last `--set` /
//! override wins), each
//! guide's runs are removed when its blocks are done (but the quickstart's), and
//! before them the quickstart's own run (`grpo run recipes/quickstart.yaml`, what
//! `scripts/quickstart.sh` leaves in outputs/quickstart) is made the same way.
//! `GRPO_GUIDES_ONLY=REGEX` runs only the guides whose path matches.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "../src/guide_blocks.rs"]
#[allow(dead_code)] // Block::first_line is docs_check's
mod guide_blocks;

use guide_blocks::{blocks, guides, Run};

fn link(from: &Path, to: &Path) {
    std::os::unix::fs::symlink(from, to)
        .unwrap_or_else(|e| panic!("link {} -> {}: {e}", to.display(), from.display()));
}

/// A user's checkout, as the guides expect it, in `home`; returns the PATH entry with the `grpo`
/// that caps training at one step.
fn lay_out(home: &Path, root: &Path) -> PathBuf {
    let assets = std::env::var_os("GRPO_TEST_ASSETS")
        .map(PathBuf::from)
        .expect("GRPO_TEST_ASSETS (the models scripts/test.sh fetches) is required");
    link(&assets, &home.join("models"));
    for shared in ["recipes", "scripts", "tests", "data", ".venv"] {
        link(&root.join(shared), &home.join(shared));
    }
    let shim = format!(
        "#!/bin/sh\n# grpo, each training run capped at one step (tests/guides.rs)\n\
         real='{}'\n\
         case \"$1\" in\n\
         run) exec \"$real\" \"$@\" --set trainer.total_training_steps=1 --set data.val_max_samples=8 ;;\n\
         verl) exec \"$real\" \"$@\" trainer.total_training_steps=1 data.val_max_samples=8 ;;\n\
         *) exec \"$real\" \"$@\" ;;\n\
         esac\n",
        env!("CARGO_BIN_EXE_grpo")
    );
    let bin = home.join("target/release");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(bin.join("grpo"), shim).unwrap();
    let mut perms = std::fs::metadata(bin.join("grpo")).unwrap().permissions();
    perms.set_mode(0o755);
    std::fs::set_permissions(bin.join("grpo"), perms).unwrap();
    // The quickstart's datasets, made by its own `grpo preprocess` lines (a fresh checkout has
    // none until scripts/quickstart.sh runs).
    let quickstart = std::fs::read_to_string(root.join("scripts/quickstart.sh")).unwrap();
    let made: Vec<String> = quickstart
        .replace("\\\n", " ")
        .lines()
        .filter(|l| l.contains(" preprocess "))
        .map(str::to_string)
        .collect();
    assert!(
        !made.is_empty(),
        "scripts/quickstart.sh makes no dataset with `grpo preprocess`"
    );
    bash(home, &bin, &made.join("\n")).unwrap_or_else(|e| panic!("the quickstart's datasets: {e}"));
    bin
}

/// Removes what a guide's runs wrote (a checkpoint of SmolLM2-135M is 1.6 GB), but for the
/// quickstart's run, which the later guides read as the user's.
fn forget_runs(home: &Path) {
    for dir in ["exported", "checkpoints"] {
        let _ = std::fs::remove_dir_all(home.join(dir));
    }
    for run in std::fs::read_dir(home.join("outputs"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if run.file_name() != "quickstart" {
            let _ = std::fs::remove_dir_all(run.path());
        }
    }
}

/// Runs `script` with bash in `home`, `bin` first on the PATH; `Err` holds the end of its output.
fn bash(home: &Path, bin: &Path, script: &str) -> Result<(), String> {
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", script])
        .current_dir(home)
        .env("PATH", path)
        .output()
        .expect("run bash");
    if out.status.success() {
        return Ok(());
    }
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let tail: Vec<&str> = text.lines().rev().take(15).collect();
    Err(format!(
        "{}\n{}",
        out.status,
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    ))
}

#[test]
fn the_guides_blocks_run_as_written() {
    let long = std::env::var("GRPO_GUIDES").is_ok_and(|v| v == "long");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let home = tempfile::tempdir().unwrap();
    let bin = lay_out(home.path(), root);
    if long {
        bash(home.path(), &bin, "grpo run recipes/quickstart.yaml --quiet")
            .unwrap_or_else(|e| panic!("the quickstart's run: {e}"));
    }
    let (mut ran, mut left, mut failures) = (0, 0, Vec::new());
    let only = std::env::var("GRPO_GUIDES_ONLY")
        .ok()
        .map(|r| regex::Regex::new(&r).expect("GRPO_GUIDES_ONLY is a regular expression"));
    for file in guides(root) {
        let name = file.strip_prefix(root).unwrap().display().to_string();
        if only.as_ref().is_some_and(|r| !r.is_match(&name)) {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        for block in blocks(&name, &text).unwrap_or_else(|e| panic!("{e}")) {
            match block.run {
                Run::Always => {}
                Run::Long if long => {}
                Run::Long | Run::Never(_) => {
                    left += 1;
                    continue;
                }
            }
            ran += 1;
            let started = std::time::Instant::now();
            let result = bash(home.path(), &bin, &block.text);
            eprintln!(
                "{} {:.0} s: {}",
                block.at,
                started.elapsed().as_secs_f64(),
                if result.is_ok() { "ok" } else { "FAILED" }
            );
            if let Err(e) = result {
                failures.push(format!("{}:\n{}\n  -> {e}", block.at, block.text.trim_end()));
            }
        }
        forget_runs(home.path());
    }
    eprintln!("{ran} blocks run, {left} not run");
    assert!(
        failures.is_empty(),
        "guide blocks that fail:\n\n{}",
        failures.join("\n\n")
    );
    assert!(
        ran >= 3 || only.is_some(),
        "only {ran} guide blocks ran: are the fences marked right?"
    );
}

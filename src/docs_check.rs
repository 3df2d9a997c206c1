//! The guides' commands are real: every `grpo` command line in a ```sh block of README.md and
//! docs/*.md parses as this binary's arguments, and the ones that read a recipe build it: `grpo
//! run` and `grpo compile` load and validate theirs (what `--print-config` does), `grpo verl`
//! translates its VeRL command line (what `--print-recipe` does). `tests/guides.rs` then runs the
//! blocks themselves; a guide that names a missing recipe, a removed option or a key the recipe
//! refuses fails here first, in seconds.

use crate::guide_blocks::{blocks, guides, Block, Run};
use crate::{commands, Cli, Command};
use clap::Parser;
use std::path::Path;

/// A command line of a guide: where it is, and its words after `grpo`.
struct DocCommand {
    at: String,
    words: Vec<String>,
}

/// The `grpo` command lines of a shell block: `\`-continued lines joined, heredoc bodies
/// skipped, leading `NAME=value` assignments dropped; `grpo` or `target/release/grpo` as the
/// program.
fn commands_in(file: &str, block: &Block) -> Vec<DocCommand> {
    let mut out = Vec::new();
    let mut heredoc: Option<String> = None;
    let mut pending: Option<(usize, String)> = None;
    for (n, line) in block.text.lines().enumerate() {
        let trimmed = line.trim();
        if let Some(end) = &heredoc {
            if trimmed == end {
                heredoc = None;
            }
            continue;
        }
        let (start, joined) = match pending.take() {
            Some((start, before)) => (start, format!("{before} {trimmed}")),
            None => (block.first_line + n, trimmed.to_string()),
        };
        if let Some(stripped) = joined.strip_suffix('\\') {
            pending = Some((start, stripped.trim_end().to_string()));
            continue;
        }
        if let Some(at) = joined.find("<<") {
            let tag = joined[at + 2..].trim_start_matches('-').trim();
            heredoc = Some(tag.trim_matches(|c| c == '\'' || c == '"').to_string());
        }
        let Some(words) = shlex::split(&joined) else {
            continue;
        };
        let mut words = words.into_iter().skip_while(|w| is_assignment(w));
        if let Some("grpo" | "target/release/grpo") = words.next().as_deref() {
            out.push(DocCommand {
                at: format!("{file}:{start}"),
                words: words.collect(),
            });
        }
    }
    out
}

fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

/// Parses `c` and builds what it reads: `Err` says what is wrong.
fn check(c: &DocCommand) -> Result<(), String> {
    let argv = std::iter::once("grpo".to_string()).chain(c.words.iter().cloned());
    let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
    let built = match cli.command {
        Command::Run(mut args) => {
            args.print_config = true;
            commands::run::run(args).map(drop)
        }
        Command::Verl(mut args) => {
            args.print_recipe = true;
            commands::verl::run(args).map(drop)
        }
        Command::Compile(args) => actors::recipe::load_recipe(&args.recipe, &args.overrides)
            .map(drop)
            .map_err(Into::into),
        _ => Ok(()),
    };
    built.map_err(|e| format!("{e:#}"))
}

#[test]
fn every_command_of_the_guides_parses_and_builds_its_recipe() {
    // Relative paths in the guides are read from the repository root, as a user runs them
    // (and cargo runs tests from the package root, which is that root).
    let mut checked = 0;
    let mut failures = Vec::new();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for file in guides(root) {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(root).unwrap().display().to_string();
        let blocks = blocks(&name, &text).unwrap_or_else(|e| panic!("{e}"));
        for c in blocks.iter().flat_map(|b| commands_in(&name, b)) {
            checked += 1;
            if let Err(e) = check(&c) {
                failures.push(format!("{}: grpo {}\n  {e}", c.at, c.words.join(" ")));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "guide commands that fail:\n{}",
        failures.join("\n")
    );
    assert!(
        checked >= 40,
        "only {checked} guide commands found: is the ```sh block reader broken?"
    );
}

#[test]
fn command_lines_are_read_as_a_shell_reads_them() {
    let text = "intro\n```sh\nFOO=1 grpo run r.yaml \\\n    --set 'a={b: c}'  # note\ncat > x <<'PY'\ngrpo run not-a-command\nPY\nls\n```\n```text\ngrpo run RECIPE\n```\n```sh not-run: a TPU\ngrpo devices\n```\n";
    let blocks = blocks("g.md", text).unwrap();
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks[1].run, Run::Never("a TPU".into()));
    let found = commands_in("g.md", &blocks[0]);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].at, "g.md:3");
    assert_eq!(found[0].words, ["run", "r.yaml", "--set", "a={b: c}"]);
}

#[test]
fn a_fence_says_whether_its_block_runs_or_why_not() {
    let bad = blocks("g.md", "```sh later\ngrpo devices\n```\n").err().unwrap();
    assert!(bad.contains("g.md:1") && bad.contains("not-run: WHY"), "{bad}");
    assert!(blocks("g.md", "```sh not-run:\n```\n").is_err());
    assert!(blocks("g.md", "```sh\ngrpo devices\n")
        .err()
        .unwrap()
        .contains("never closed"));
    let long = blocks("g.md", "```sh long\ngrpo run r.yaml\n```\n").unwrap();
    assert_eq!(long[0].run, Run::Long);
}

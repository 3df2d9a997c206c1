//! The shell blocks of the guides (README.md and docs/*.md), read by the binary's own unit tests
//! (`docs_check`: every `grpo` line parses and builds its recipe) and by `tests/guides.rs` (the
//! blocks are run). The words after a fence's language say whether a block is run:
//!
//! - ```` ```sh ````: run by `tests/guides.rs` on every test run (CI);
//! - ```` ```sh long ````: it trains, so it is run only with `GRPO_GUIDES=long`, each
//!   `grpo run` / `grpo verl` for one step;
//! - ```` ```sh not-run: WHY ````: never run, for the reason given (an accelerator, a cloud, a
//!   download, the README's own two commands).

use std::path::{Path, PathBuf};

/// A ```sh (or bash, shell) block of a guide.
pub struct Block {
    /// `file:line` of its opening fence.
    pub at: String,
    /// The line (1-based) of its first line of text.
    pub first_line: usize,
    pub run: Run,
    pub text: String,
}

/// Whether and when `tests/guides.rs` runs a block.
#[derive(Debug, Clone, PartialEq)]
pub enum Run {
    Always,
    Long,
    Never(String),
}

/// The shell blocks of `text` (from `file`). Errors name a block whose fence's words are not one
/// of the forms above.
pub fn blocks(file: &str, text: &str) -> Result<Vec<Block>, String> {
    enum State {
        Outside,
        Shell(usize, Run, String),
        Other,
    }
    let mut out = Vec::new();
    let mut state = State::Outside;
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        let Some(info) = trimmed.strip_prefix("```") else {
            if let State::Shell(_, _, body) = &mut state {
                body.push_str(line);
                body.push('\n');
            }
            continue;
        };
        state = match state {
            State::Shell(start, run, text) => {
                out.push(Block {
                    at: format!("{file}:{start}"),
                    first_line: start + 1,
                    run,
                    text,
                });
                State::Outside
            }
            State::Other => State::Outside,
            State::Outside => {
                let (lang, rest) = info.split_once(' ').unwrap_or((info, ""));
                if !matches!(lang, "sh" | "bash" | "shell") {
                    State::Other
                } else {
                    let run = match rest.trim() {
                        "" => Run::Always,
                        "long" => Run::Long,
                        rest => match rest.strip_prefix("not-run:").map(str::trim) {
                            Some(why) if !why.is_empty() => Run::Never(why.to_string()),
                            _ => {
                                return Err(format!(
                                    "{file}:{}: ```{lang} {rest}: after the language write nothing \
                                     (run in CI), `long` (run with GRPO_GUIDES=long) or \
                                     `not-run: WHY`",
                                    n + 1
                                ))
                            }
                        },
                    };
                    State::Shell(n + 1, run, String::new())
                }
            }
        };
    }
    if let State::Shell(start, ..) = state {
        return Err(format!("{file}:{start}: a block that is never closed"));
    }
    Ok(out)
}

/// README.md, docs/first-run.md (the guide the others build on), then the other guides by name.
pub fn guides(root: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    files.sort_by_key(|p| (!p.ends_with("first-run.md"), p.clone()));
    files.insert(0, root.join("README.md"));
    files
}

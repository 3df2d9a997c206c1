//! ARCHITECTURE.md is a map a stranger follows, so what it names must be there: every file or
//! folder it names exists, and every item it places in a file (`` `Name` (`file.rs`) ``,
//! `` `Name` in `file.rs` ``, `` `Type::method` (`file.rs`: ...) ``) is defined in that file.

use regex::Regex;
use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every file of the repository's source folders, relative to the root.
fn files() -> Vec<String> {
    let mut out = Vec::new();
    let mut stack: Vec<PathBuf> = vec![root().to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.')
                || ["target", "models", "outputs", "datasets", "node_modules"].contains(&name.as_str())
            {
                continue;
            }
            if path.is_dir() {
                out.push(format!("{}/", path.strip_prefix(root()).unwrap().display()));
                stack.push(path);
            } else {
                out.push(path.strip_prefix(root()).unwrap().display().to_string());
            }
        }
    }
    out
}

/// The repository file `named` stands for, said in the section of crate folder `section`: the
/// path itself, the crate's `src/` or folder joined with it (the map writes `step/learner.rs` in
/// the trainer's section), or the one file it ends.
fn resolve<'a>(named: &str, section: &str, files: &'a [String]) -> Result<&'a str, String> {
    let named = named.trim_start_matches("./");
    for local in [format!("{section}src/{named}"), format!("{section}{named}")] {
        if let Some(f) = files.iter().find(|f| !section.is_empty() && **f == local) {
            return Ok(f.as_str());
        }
    }
    let matches: Vec<&String> = files
        .iter()
        .filter(|f| *f == named || f.ends_with(&format!("/{named}")))
        .collect();
    match matches.as_slice() {
        [one] => Ok(one.as_str()),
        [] => Err(format!("`{named}` is not in the repository")),
        many => {
            // A path given from the root wins over longer ones that end with it.
            match many.iter().find(|f| f.as_str() == named) {
                Some(exact) => Ok(exact.as_str()),
                None => Err(format!("`{named}` could be any of {many:?}")),
            }
        }
    }
}

/// Whether `file` defines `name` (a function, type, trait, constant, module, macro, enum
/// variant or field).
fn defines(file: &str, name: &str) -> bool {
    let text = std::fs::read_to_string(root().join(file)).unwrap_or_default();
    let item = Regex::new(&format!(
        r"(?m)(\b(fn|struct|enum|trait|type|const|static|mod|macro_rules!)\s+{name}\b|^\s*{name}\s*[\(\{{,:]|^\s*pub(\([a-z]+\))?\s+{name}\s*:|^{name}\s*=|\bdef\s+{name}\b)"
    ))
    .unwrap();
    item.is_match(&text)
}

#[test]
fn what_the_codemap_names_is_where_it_says() {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let files = files();
    let mut wrong = Vec::new();

    // Every path-like name: a file with an extension, or a folder ending in `/`.
    let path = Regex::new(
        r"`([A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-<>]*)+|[A-Za-z0-9_\-]+\.(rs|md|py|sh|toml|yaml|tsv|proto))`",
    )
    .unwrap();
    let placed = Regex::new(
        r"`([A-Za-z_][A-Za-z0-9_]*(::[A-Za-z_][A-Za-z0-9_]*)*)`(,? (in|from)|) ?\(?`([^`]+\.(rs|py))`",
    )
    .unwrap();
    let heading = Regex::new(r"^### `([a-z_]+/)`").unwrap();
    let mut section = String::new();
    let mut checked = 0;
    for line in text.lines() {
        if line.starts_with("## ") {
            section.clear();
        }
        if let Some(c) = heading.captures(line) {
            section = c[1].to_string();
        }
        // Every path-like name: a file with an extension, or a folder ending in `/`.
        for c in path.captures_iter(line) {
            let named = &c[1];
            if named.contains('<') || named.starts_with("OUTPUT/") || named.starts_with("../") {
                continue; // a placeholder, or what a run writes
            }
            if let Err(e) = resolve(named, &section, &files) {
                wrong.push(e);
            }
        }
        // Every item placed in a file.
        for c in placed.captures_iter(line) {
            let item = &c[1];
            let Ok(file) = resolve(&c[5], &section, &files) else {
                continue; // reported above
            };
            let name = item.rsplit("::").next().unwrap();
            checked += 1;
            if !defines(file, name) {
                wrong.push(format!("`{item}` is not defined in `{file}`"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "ARCHITECTURE.md names what is not there:\n{}",
        wrong.join("\n")
    );
    assert!(
        checked >= 30,
        "only {checked} placed items found: is the reader broken?"
    );
}

//! No import circle between files: within each crate, file A depends on file B when A names a path (`crate::x::y`, `super::x`,
//! `self::x`, brace groups included) that resolves to B's module, outside comments and test
//! modules; a set of files that reach each other is a circle. Re-exports at a crate's root are
//! not counted (everything would reach everything through `lib.rs`).
//!
//! Where two files need each other, the shared piece gets its own home.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

/// Every `.rs` file under `src`, by module path (`a/b.rs` and `a/b/mod.rs` are `[a, b]`).
fn modules(src: &Path) -> BTreeMap<Module, PathBuf> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let rel = path.strip_prefix(src).unwrap().with_extension("");
                let mut parts: Module = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
                if matches!(parts.last().map(String::as_str), Some("mod" | "lib" | "main")) {
                    parts.pop();
                }
                out.insert(parts, path);
            }
        }
    }
    out
}

/// The text of a file without line comments and without its `#[cfg(test)] mod tests { ... }`.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let text = match text.find("#[cfg(test)]\nmod tests {") {
        Some(at) => &text[..at],
        None => &text,
    };
    text.lines()
        .map(|l| match l.find("//") {
            Some(at) if !l[..at].contains('"') => &l[..at],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every path starting `crate`, `super` or `self` in `text`, `::`-joined, with brace groups
/// (`a::{b, c::{d, e}}`) expanded.
fn paths(text: &str) -> Vec<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < text.len() {
        let boundary = i == 0 || !(is_ident(bytes[i - 1] as char) || bytes[i - 1] == b':');
        let rest = text.get(i..).unwrap_or("");
        let head = ["crate::", "super::", "self::"]
            .into_iter()
            .find(|h| rest.starts_with(h));
        let Some(head) = head.filter(|_| boundary) else {
            i += 1;
            continue;
        };
        // The path: identifiers and `::`, then maybe a `{...}` group.
        let mut end = i + head.len();
        while end < text.len() && (is_ident(bytes[end] as char) || text[end..].starts_with("::")) {
            end += if bytes[end] == b':' { 2 } else { 1 };
        }
        let prefix = text[i..end].trim_end_matches("::");
        if end < text.len() && bytes[end] == b'{' {
            let close = matching_brace(text, end);
            out.extend(expand(prefix, &text[end + 1..close]));
            i = close + 1;
        } else {
            out.push(prefix.to_string());
            i = end.max(i + 1);
        }
    }
    out
}

/// The index of the `}` closing the `{` at `open`.
fn matching_brace(text: &str, open: usize) -> usize {
    let mut depth = 0;
    for (k, c) in text[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return open + k;
                }
            }
            _ => {}
        }
    }
    text.len()
}

/// The paths of the group `prefix::{body}`.
fn expand(prefix: &str, body: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let (mut depth, mut from) = (0, 0);
    for (k, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&body[from..k]);
                from = k + 1;
            }
            _ => {}
        }
    }
    parts.push(&body[from..]);
    let mut out = Vec::new();
    for part in parts.into_iter().map(str::trim).filter(|p| !p.is_empty()) {
        if let Some(at) = part.find("::{") {
            let close = matching_brace(part, at + 2);
            out.extend(expand(
                &format!("{prefix}::{}", &part[..at]),
                &part[at + 3..close],
            ));
        } else if part == "self" {
            out.push(prefix.to_string());
        } else {
            let name: String = part.chars().take_while(|c| is_ident(*c) || *c == ':').collect();
            out.push(format!("{prefix}::{}", name.trim_end_matches(':')));
        }
    }
    out
}

/// The file that `path`, said in module `from`, names: the longest prefix that is a module of
/// the crate; `None` for the crate's root or `from` itself.
fn target(path: &str, from: &Module, files: &BTreeMap<Module, PathBuf>) -> Option<Module> {
    let segments: Vec<&str> = path.split("::").collect();
    let mut full: Module = match segments[0] {
        "crate" => Vec::new(),
        "self" => from.clone(),
        "super" => from[..from.len().saturating_sub(1)].to_vec(),
        _ => return None,
    };
    let mut rest = &segments[1..];
    while rest.first() == Some(&"super") {
        full.pop();
        rest = &rest[1..];
    }
    full.extend(rest.iter().map(|s| s.to_string()));
    (0..=full.len())
        .rev()
        .map(|n| full[..n].to_vec())
        .find(|m| files.contains_key(m))
        .filter(|m| !m.is_empty() && m != from)
}

/// The circles of one crate: sets of two or more files that reach each other.
fn circles(src: &Path) -> Vec<Vec<String>> {
    let files = modules(src);
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, path) in &files {
        let targets = paths(&code(path))
            .into_iter()
            .filter_map(|p| target(&p, module, &files))
            .collect();
        edges.insert(module.clone(), targets);
    }
    // Two files are in one circle when each reaches the other.
    let reach = |from: &Module| -> BTreeSet<Module> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(m) = todo.pop() {
            for t in &edges[&m] {
                if seen.insert(t.clone()) {
                    todo.push(t.clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&Module, BTreeSet<Module>> = files.keys().map(|m| (m, reach(m))).collect();
    let mut groups: BTreeSet<Vec<String>> = BTreeSet::new();
    for m in files.keys() {
        let group: Vec<String> = files
            .keys()
            .filter(|o| o == &m || reached[m].contains(*o) && reached[*o].contains(m))
            .map(|o| o.join("/"))
            .collect();
        if group.len() > 1 {
            groups.insert(group);
        }
    }
    groups.into_iter().collect()
}

#[test]
fn no_import_circles_between_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut found = Vec::new();
    for entry in std::fs::read_dir(root).unwrap().flatten() {
        let src = entry.path().join("src");
        if entry.path().join("Cargo.toml").is_file() && src.is_dir() {
            let name = entry.file_name().to_string_lossy().into_owned();
            found.extend(circles(&src).into_iter().map(|c| (name.clone(), c)));
        }
    }
    found.extend(
        circles(&root.join("src"))
            .into_iter()
            .map(|c| ("grpo".to_string(), c)),
    );
    assert!(
        found.is_empty(),
        "import circles between files (crate, files that reach each other): {found:?}; where two \
         files need each other, give the shared piece its own home"
    );
}

#[test]
fn a_circle_is_found() {
    let dir = std::env::temp_dir().join(format!("import-circles-src-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("c")).unwrap();
    std::fs::write(dir.join("lib.rs"), "mod a;\nmod b;\nmod c;\n").unwrap();
    std::fs::write(dir.join("a.rs"), "use crate::b::B;\n").unwrap();
    std::fs::write(dir.join("b.rs"), "pub struct B;\nfn f() { crate::c::d::g() }\n").unwrap();
    std::fs::write(dir.join("c/mod.rs"), "mod d;\n").unwrap();
    std::fs::write(dir.join("c/d.rs"), "use super::super::a;\npub fn g() {}\n").unwrap();
    let found = circles(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(found, [vec!["a".to_string(), "b".to_string(), "c/d".to_string()]]);
}

#[test]
fn paths_and_groups_are_read_as_rust_writes_them() {
    let joined = paths("use super::{a::{B, c}, self, d};\nlet x = crate::m::f();\n");
    assert!(joined.contains(&"super::a::B".to_string()), "{joined:?}");
    assert!(joined.contains(&"super::a::c".to_string()), "{joined:?}");
    assert!(joined.contains(&"super::d".to_string()), "{joined:?}");
    assert!(joined.contains(&"crate::m::f".to_string()), "{joined:?}");
    assert!(joined.contains(&"super".to_string()), "{joined:?}");
    let file = std::env::temp_dir().join(format!("import-circles-{}.rs", std::process::id()));
    std::fs::write(
        &file,
        "use crate::a; // crate::b\n#[cfg(test)]\nmod tests {\n    use crate::c;\n}\n",
    )
    .unwrap();
    assert_eq!(paths(&code(&file)), ["crate::a"]);
    std::fs::remove_file(file).unwrap();
}

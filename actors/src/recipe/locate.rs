//! Where a dotted recipe key is written in the YAML text, so that errors found after parsing
//! (by `load` and `validate` alike) still name the line and column.

/// The 1-based line and column of a dotted key in block-style YAML text, if it is written there.
/// List entries are addressed by index: `cluster.pools[1].workers` is the `workers:` key of the
/// second `- ` entry under `cluster.pools`, and `cluster.pools[1]` is that entry's dash.
pub(crate) fn locate_key(text: &str, key: &str) -> Option<(usize, usize)> {
    #[derive(PartialEq)]
    enum Part {
        Key(String),
        Index(usize),
    }
    let mut target = Vec::new();
    for segment in key.split('.') {
        let mut pieces = segment.split('[');
        target.push(Part::Key(pieces.next().unwrap_or_default().to_string()));
        for index in pieces {
            target.push(Part::Index(index.trim_end_matches(']').parse().ok()?));
        }
    }
    // The open keys and list entries above the current line: (indent, what, entries seen so far
    // in the list it holds).
    let mut stack: Vec<(usize, Part, usize)> = Vec::new();
    let matches = |stack: &[(usize, Part, usize)]| {
        stack.len() == target.len() && stack.iter().zip(&target).all(|((_, a, _), b)| a == b)
    };
    for (i, line) in text.lines().enumerate() {
        let content = line.split(" #").next().unwrap_or("");
        let mut trimmed = content.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let mut indent = content.len() - trimmed.len();
        // A list entry: `- key: value` (or `- value`), possibly several dashes deep.
        while let Some(rest) = trimmed
            .strip_prefix('-')
            .filter(|r| r.is_empty() || r.starts_with(' '))
        {
            // The entry belongs to the nearest open key at this indent or less (YAML lets a
            // list sit at its key's own indent); entries of the same list end here.
            while stack.last().is_some_and(|(ind, part, _)| {
                *ind > indent || (*ind == indent && matches!(part, Part::Index(_)))
            }) {
                stack.pop();
            }
            let index = match stack.last_mut() {
                Some((_, _, seen)) => {
                    *seen += 1;
                    *seen - 1
                }
                None => return None,
            };
            stack.push((indent, Part::Index(index), 0));
            if matches(&stack) {
                return Some((i + 1, indent + 1));
            }
            let inner = rest.trim_start();
            indent += 1 + (rest.len() - inner.len());
            trimmed = inner;
        }
        let Some((name, _)) = trimmed.split_once(':') else {
            continue;
        };
        let name = name.trim().trim_matches(|c| c == '"' || c == '\'');
        while stack.last().is_some_and(|(ind, _, _)| *ind >= indent) {
            stack.pop();
        }
        stack.push((indent, Part::Key(name.to_string()), 0));
        if matches(&stack) {
            return Some((i + 1, indent + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_located_in_block_yaml() {
        let text = "model:\n  path: m\n# c\nactor:\n  optim:\n    lr: 1\n  clip_ratio_low: 2\n";
        assert_eq!(locate_key(text, "actor.optim.lr"), Some((6, 5)));
        assert_eq!(locate_key(text, "actor.clip_ratio_low"), Some((7, 3)));
        assert_eq!(locate_key(text, "rollout.n"), None);
    }

    #[test]
    fn keys_in_list_entries_are_located_by_index() {
        let text = "cluster:\n  pools:\n    - name: a\n      roles: [rollout]\n    - name: b\n      \
                    resources:\n        TPU: 4\n  ray:\n    address: x\n";
        assert_eq!(locate_key(text, "cluster.pools[0].name"), Some((3, 7)));
        assert_eq!(locate_key(text, "cluster.pools[0].roles"), Some((4, 7)));
        assert_eq!(locate_key(text, "cluster.pools[1]"), Some((5, 5)));
        assert_eq!(locate_key(text, "cluster.pools[1].name"), Some((5, 7)));
        assert_eq!(locate_key(text, "cluster.pools[1].resources.TPU"), Some((7, 9)));
        assert_eq!(locate_key(text, "cluster.pools[2]"), None);
        assert_eq!(locate_key(text, "cluster.ray.address"), Some((9, 5)));
        // A list at its key's own indent.
        let text = "cluster:\n  pools:\n  - name: a\n  - name: b\n    workers: 2\n  launcher: ray\n";
        assert_eq!(locate_key(text, "cluster.pools[1].workers"), Some((5, 5)));
        assert_eq!(locate_key(text, "cluster.launcher"), Some((6, 3)));
    }
}

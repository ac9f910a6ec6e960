//! The module map stays a one-way graph: within every crate of the workspace, no two
//! sibling modules use each other, directly or through other siblings. (Crates cannot
//! form circles; Cargo refuses them.) A module may use its parent or its children.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The workspace's crates: name and source directory.
fn crates() -> Vec<(String, PathBuf)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut out = vec![("tether".to_string(), root.join("src"))];
    for dir in std::fs::read_dir(&root).unwrap().flatten() {
        let src = dir.path().join("src");
        if dir.path().join("Cargo.toml").exists() && src.join("lib.rs").exists() {
            out.push((dir.file_name().to_string_lossy().into_owned(), src));
        }
    }
    out
}

/// Every module file under `src`, by its module path (`["router", "select"]`; the
/// crate root is `[]`).
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    fn walk(dir: &Path, prefix: &[String], out: &mut BTreeMap<Vec<String>, PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if name == "bin" {
                    continue;
                }
                let mut p = prefix.to_vec();
                p.push(name);
                walk(&path, &p, out);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                let mut p = prefix.to_vec();
                if !matches!(stem, "mod" | "lib" | "main") {
                    p.push(stem.to_string());
                }
                out.insert(p, path);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, &[], &mut out);
    out
}

/// The module paths a file names through `crate::` and `super::`, resolved from
/// `module` (`is_dir_module`: the file is a `mod.rs`/`lib.rs`, so `super` is one level
/// closer).
fn references(text: &str, module: &[String], is_dir_module: bool) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = text.as_bytes();
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < bytes.len() {
        let starts_word = i == 0 || !ident(bytes[i - 1]);
        if !text.is_char_boundary(i) {
            i += 1;
            continue;
        }
        let rest = &text[i..];
        let (mut base, mut len) = if starts_word && rest.starts_with("crate::") {
            (Vec::new(), "crate::".len())
        } else if starts_word && rest.starts_with("super::") {
            let mut b = module.to_vec();
            if !is_dir_module {
                b.pop();
            }
            b.pop();
            (b, "super::".len())
        } else {
            i += 1;
            continue;
        };
        // Further `super::` and the path's segments.
        loop {
            let seg: String = text[i + len..]
                .bytes()
                .take_while(|c| ident(*c))
                .map(char::from)
                .collect();
            if seg.is_empty() {
                break;
            }
            len += seg.len();
            if seg == "super" {
                base.pop();
            } else {
                base.push(seg);
            }
            if text[i + len..].starts_with("::") {
                len += 2;
            } else {
                break;
            }
        }
        out.push(base);
        i += len.max(1);
    }
    out
}

/// The longest known module that `path` starts with.
fn owner(path: &[String], known: &BTreeMap<Vec<String>, PathBuf>) -> Vec<String> {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| known.contains_key(p))
        .unwrap_or_default()
}

/// Circles among the sibling modules of one crate, each as the modules on it.
fn circles(src: &Path) -> Vec<Vec<String>> {
    let known = modules(src);
    // Edges between siblings: `a -> b` reduced to the children of their common parent.
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (module, file) in &known {
        let text = std::fs::read_to_string(file).unwrap();
        let is_dir = matches!(
            file.file_name().and_then(|n| n.to_str()),
            Some("mod.rs" | "lib.rs" | "main.rs")
        );
        for target in references(&text, module, is_dir) {
            let target = owner(&target, &known);
            let common = module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            if common == module.len() || common == target.len() {
                continue; // a parent and its descendant
            }
            edges
                .entry(module[..=common].to_vec())
                .or_default()
                .insert(target[..=common].to_vec());
        }
    }
    // Depth-first search for back edges.
    fn visit(
        n: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        stack: &mut Vec<Vec<String>>,
        done: &mut BTreeSet<Vec<String>>,
        found: &mut Vec<Vec<String>>,
    ) {
        if let Some(at) = stack.iter().position(|s| s == n) {
            found.push(stack[at..].iter().map(|m| m.join("::")).collect());
            return;
        }
        if !done.insert(n.clone()) {
            return;
        }
        stack.push(n.clone());
        for next in edges.get(n).into_iter().flatten() {
            visit(next, edges, stack, done, found);
        }
        stack.pop();
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for n in edges.keys() {
        visit(n, &edges, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

#[test]
fn no_crate_has_an_import_circle() {
    let mut all = Vec::new();
    let crates = crates();
    assert!(crates.len() >= 8, "found the crates: {crates:?}");
    for (name, src) in crates {
        for circle in circles(&src) {
            all.push(format!("{name}: {}", circle.join(" -> ")));
        }
    }
    assert!(
        all.is_empty(),
        "modules that use each other (move what both need below them, or pass it in):\n{}",
        all.join("\n")
    );
}

#[test]
fn references_resolve_crate_and_super_paths() {
    let m = |s: &[&str]| s.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let text = "use crate::router::select::Pick; let x = super::super::flow::F; tokio::spawn";
    assert_eq!(
        references(text, &m(&["a", "b"]), false),
        [m(&["router", "select", "Pick"]), m(&["flow", "F"])]
    );
    assert_eq!(references("super::X", &m(&["a"]), true), [m(&["X"])]);
}

/// Functions on the data path (server, agent, core, client), in the CCM and in the
/// `tether` binary's subcommands (`src/cmd`) longer than this read as more than one
/// job.
const MAX_FUNCTION_LINES: usize = 60;

/// Each function of `text` (outside its test module) with its length in lines, from
/// its `fn` line to its closing brace.
fn function_lengths(text: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        if line.trim_start() == "#[cfg(test)]"
            && lines
                .get(i + 1)
                .is_some_and(|l| l.trim_start().starts_with("mod tests"))
        {
            break;
        }
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let words: Vec<&str> = trimmed.split_whitespace().collect();
        let at = words.iter().position(|w| *w == "fn");
        let is_fn = at.is_some_and(|at| {
            words[..at]
                .iter()
                .all(|w| w.starts_with("pub") || matches!(*w, "async" | "const" | "unsafe"))
        });
        if !is_fn {
            i += 1;
            continue;
        }
        let name: String = words[at.unwrap() + 1]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // The body opens on the signature's last line; a declaration ends in `;`.
        let mut open = i;
        while open < lines.len() && !lines[open].trim_end().ends_with('{') {
            if lines[open].trim_end().ends_with(';') {
                break;
            }
            open += 1;
        }
        if open >= lines.len() || !lines[open].trim_end().ends_with('{') {
            i = open + 1;
            continue;
        }
        let close = (open + 1..lines.len())
            .find(|&k| {
                let l = lines[k];
                l.len() > indent && l[..indent].trim().is_empty() && l[indent..].starts_with('}')
            })
            .unwrap_or(lines.len() - 1);
        out.push((name, close - i + 1));
        i = close + 1;
    }
    out
}

#[test]
fn data_path_and_controller_functions_are_short() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let dirs = [
        "server/src",
        "agent/src",
        "core/src",
        "client/src",
        "ccm/src",
        "src/cmd",
    ];
    let files: Vec<PathBuf> = dirs
        .iter()
        .flat_map(|d| modules(&root.join(d)).into_values())
        .collect();
    let mut long = Vec::new();
    for file in files {
        let shown = file.strip_prefix(&root).unwrap().display().to_string();
        if shown.ends_with("tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&file).unwrap();
        for (name, n) in function_lengths(&text) {
            if n > MAX_FUNCTION_LINES {
                long.push(format!("{shown}: {name} is {n} lines"));
            }
        }
    }
    assert!(
        long.is_empty(),
        "split these by job (at most {MAX_FUNCTION_LINES} lines):\n{}",
        long.join("\n")
    );
}

#[test]
fn function_lengths_run_from_fn_to_closing_brace() {
    let text = "fn a() {\n    x;\n}\n\npub(crate) async fn b(\n    y: u8,\n) -> u8 {\n    y\n}\n    fn c();\n#[cfg(test)]\nmod tests {\n    fn d() {}\n}\n";
    assert_eq!(
        function_lengths(text),
        [("a".to_string(), 3), ("b".to_string(), 5)]
    );
}

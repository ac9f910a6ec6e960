//! The documentation stays true to the code: the flag and metric references in
//! `docs/reference/` are what the code renders (`TETHER_BLESS=1` rewrites them), and
//! every relative link and `#anchor` in the Markdown files resolves.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Compares `path` with `rendered`; with `TETHER_BLESS=1` writes it instead.
fn check_generated(path: &str, rendered: &str) {
    tether_testkit::generated::check(
        &root().join(path),
        rendered,
        "TETHER_BLESS=1 cargo test --test reference",
    );
}

#[test]
fn the_flag_reference_is_what_clap_parses() {
    check_generated(
        "docs/reference/flags.md",
        &tether::reference::flags_markdown(),
    );
}

#[test]
fn the_metric_reference_is_what_the_binaries_serve() {
    check_generated(
        "docs/reference/metrics.md",
        &tether::reference::metrics_markdown(),
    );
}

/// Every Markdown file a reader reaches from the README: the README, `docs/`,
/// `deploy/` and the architecture map.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut files = vec![root().join("README.md"), root().join("ARCHITECTURE.md")];
    walk(&root().join("docs"), &mut files);
    walk(&root().join("deploy"), &mut files);
    files
}

/// GitHub's anchor for a heading: lower case, only letters, digits, spaces, `-` and
/// `_` kept, spaces turned into `-`.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors a Markdown file's headings make (repeats get `-1`, `-2`, ...), outside
/// fenced code.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced || !line.starts_with('#') {
            continue;
        }
        let heading = line.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base = slug(heading);
        let mut anchor = base.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

/// The targets of inline links `[text](target)` outside code spans and fences.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        // Drop code spans, where `](` is text.
        let mut plain = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                plain.push_str(part);
            }
        }
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let mut broken = Vec::new();
    let files = markdown_files();
    assert!(files.len() > 3, "found the Markdown files: {files:?}");
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for link in links(&text) {
            let link = link.split_whitespace().next().unwrap_or("").to_string();
            if link.is_empty() || link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = match link.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (link.as_str(), None),
            };
            let target = if path.is_empty() {
                file.clone()
            } else {
                file.parent().unwrap().join(path)
            };
            let shown = file.strip_prefix(root()).unwrap().display().to_string();
            if !target.exists() {
                broken.push(format!("{shown}: {link}: no such file"));
                continue;
            }
            if let Some(anchor) = anchor {
                if target.extension().is_some_and(|e| e == "md") {
                    let text = std::fs::read_to_string(&target).unwrap();
                    if !anchors(&text).contains(anchor) {
                        broken.push(format!("{shown}: {link}: no heading makes #{anchor}"));
                    }
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_follow_githubs_rules() {
    let text = "# Tether\n## `tether server`\n## Logging (server and agent)\n## A\n## A\n```\n# not a heading\n```\n";
    let a = anchors(text);
    for want in [
        "tether",
        "tether-server",
        "logging-server-and-agent",
        "a",
        "a-1",
    ] {
        assert!(a.contains(want), "{want} in {a:?}");
    }
    assert!(!a.contains("not-a-heading"));
    assert_eq!(
        links("see [x](docs/a.md#b) and `[y](z)` and [w](https://e.org)"),
        ["docs/a.md#b", "https://e.org"]
    );
}

/// The man pages: `tether(1)` and one page a subcommand (`tether-server(1)`, ...), as
/// clap_mangen renders the clap definitions `--help` prints.
#[test]
fn the_man_pages_are_what_clap_parses() {
    use clap::CommandFactory;
    let cli = tether::cli::Cli::command();
    let render = |cmd: clap::Command| {
        let mut page = Vec::new();
        clap_mangen::Man::new(cmd).render(&mut page).unwrap();
        String::from_utf8(page).unwrap()
    };
    check_generated("docs/man/tether.1", &render(cli.clone()));
    for sub in cli.get_subcommands().filter(|s| !s.is_hide_set()) {
        let name: &'static str = format!("tether-{}", sub.get_name()).leak();
        let page = render(sub.clone().name(name).display_name(name));
        check_generated(&format!("docs/man/{name}.1"), &page);
    }
}

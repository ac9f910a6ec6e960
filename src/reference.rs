//! The flag and metric references in `docs/reference/`, rendered from the code itself:
//! the flags from the clap definitions `tether` parses, the metrics from the catalogs
//! the server, the agent and the CCM serve on `/metrics`. `tests/reference.rs` fails
//! when the files differ from what this renders.

use clap::{Args, CommandFactory};
use tether_ops::metrics::FamilyDoc;

use crate::cli::Cli;

/// How the generated files say they are made.
const REGENERATE: &str = "TETHER_BLESS=1 cargo test --test reference";

/// `docs/reference/flags.md`.
pub fn flags_markdown() -> String {
    let cli = Cli::command();
    let logging: Vec<String> = crate::cmd::LogArgs::augment_args(clap::Command::new("log"))
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect();
    let mut out = format!(
        "# Flag reference\n\n\
         Generated from the code (`{REGENERATE}` rewrites it); `tether SUBCOMMAND --help` \
         prints the same text. Durations are Go-style (`30s`, `1h`, `500ms`); booleans \
         take `--flag`, `--flag=true` and `--flag=false`; a repeated flag's last value \
         wins, and a list flag adds to its list, as with Go's pflag. Flags marked \
         \"Tether only\" are not upstream's; every other flag keeps upstream's name and \
         default. How they fit together: [operating](../operating.md).\n\n\
         - [`tether server`](#tether-server)\n\
         - [`tether agent`](#tether-agent)\n\
         - [Logging (server and agent)](#logging-server-and-agent)\n\
         - [`tether ccm`](#tether-ccm)\n\
         - [`tether certs`](#tether-certs)\n\
         - [`tether local`](#tether-local)\n\
         - [`tether status`](#tether-status)\n"
    );
    let sub = |name: &str| {
        cli.find_subcommand(name)
            .unwrap_or_else(|| panic!("tether has a {name} subcommand"))
    };
    section(&mut out, "tether server", sub("server"), &logging, false);
    out.push_str(
        "\nThe image also answers to upstream's program names: `/proxy-server` and \
         `/usr/bin/proxy-server` are `tether server --log-format=klog`.\n",
    );
    section(&mut out, "tether agent", sub("agent"), &logging, false);
    out.push_str(
        "\n`tether-agent` (the agent-only binary in the image, also `/proxy-agent` and \
         `/usr/bin/proxy-agent`) takes exactly these flags.\n",
    );
    out.push_str(
        "\n## Logging (server and agent)\n\nklog's flags, on both `tether server` and \
         `tether agent`.\n\n",
    );
    table(
        &mut out,
        sub("server")
            .get_arguments()
            .filter(|a| logging.contains(&a.get_id().to_string())),
    );
    section(&mut out, "tether ccm", sub("ccm"), &logging, false);
    let certs = sub("certs");
    out.push_str(&format!("\n## `tether certs`\n\n{}\n", about(certs)));
    for c in certs.get_subcommands() {
        section(
            &mut out,
            &format!("tether certs {}", c.get_name()),
            c,
            &logging,
            true,
        );
    }
    section(&mut out, "tether local", sub("local"), &logging, false);
    section(&mut out, "tether status", sub("status"), &logging, false);
    out
}

/// One subcommand's heading, summary and flag table (without the logging flags).
fn section(out: &mut String, title: &str, cmd: &clap::Command, logging: &[String], sub: bool) {
    let level = if sub { "###" } else { "##" };
    out.push_str(&format!("\n{level} `{title}`\n\n{}\n\n", about(cmd)));
    let own: Vec<&clap::Arg> = cmd
        .get_arguments()
        .filter(|a| !logging.contains(&a.get_id().to_string()))
        .collect();
    if own.iter().any(|a| shown(a)) {
        table(out, own.into_iter());
    } else {
        out.push_str("No flags.\n");
    }
}

fn about(cmd: &clap::Command) -> String {
    cmd.get_long_about()
        .or(cmd.get_about())
        .map(|s| s.to_string())
        .unwrap_or_default()
}

/// Flags a user can pass: not positionals, not hidden, not `--help`/`--version`.
fn shown(arg: &clap::Arg) -> bool {
    arg.get_long().is_some()
        && !arg.is_hide_set()
        && !matches!(arg.get_id().as_str(), "help" | "version")
}

fn table<'a>(out: &mut String, args: impl Iterator<Item = &'a clap::Arg>) {
    out.push_str("| flag | default | meaning |\n|---|---|---|\n");
    for arg in args.filter(|a| shown(a)) {
        let mut flag = format!("`--{}`", arg.get_long().expect("shown flags are long"));
        if let Some(aliases) = arg.get_visible_aliases() {
            for alias in aliases {
                flag.push_str(&format!(", `--{alias}`"));
            }
        }
        let defaults: Vec<String> = arg
            .get_default_values()
            .iter()
            .map(|v| v.to_string_lossy().into_owned())
            .collect();
        let mut default = match defaults.as_slice() {
            [] => String::new(),
            [one] if one.is_empty() => "`\"\"`".to_string(),
            many => format!("`{}`", many.join(",")),
        };
        if let Some(env) = arg.get_env() {
            default.push_str(&format!(" (`${}`)", env.to_string_lossy()));
        }
        let mut meaning = arg
            .get_long_help()
            .or(arg.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default();
        let values: Vec<String> = arg
            .get_possible_values()
            .iter()
            .filter(|v| !v.is_hide_set())
            .map(|v| format!("`{}`", v.get_name()))
            .collect();
        let boolean = values == ["`true`", "`false`"];
        if !values.is_empty() && !boolean {
            meaning.push_str(&format!(" One of: {}.", values.join(", ")));
        }
        out.push_str(&format!(
            "| {flag} | {} | {} |\n",
            cell(default.trim()),
            cell(&meaning)
        ));
    }
}

/// Table-cell text: paragraphs joined on one line, pipes escaped.
fn cell(text: &str) -> String {
    text.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

/// `docs/reference/metrics.md`.
pub fn metrics_markdown() -> String {
    let mut out = format!(
        "# Metric reference\n\n\
         Generated from the metric declarations the binaries serve (`{REGENERATE}` \
         rewrites it). Upstream's families keep upstream's names, labels and buckets; \
         the `tether_*` families are Tether's own. A labelled family has no series until \
         its first event, as client_golang's vectors, unless its help says otherwise. \
         How to use them: [operating](../operating.md#metrics).\n\n\
         - [`tether server`](#tether-server) (health port `/metrics` and admin port \
         `/metrics`)\n\
         - [`tether agent`](#tether-agent) (the same two ports)\n\
         - [`tether ccm`](#tether-ccm) (the secure port's `/metrics`)\n"
    );
    let server = tether_server::metrics::Metrics::new();
    family_table(&mut out, "tether server", &server.catalog.families());
    let agent = tether_agent::metrics::Metrics::new();
    family_table(&mut out, "tether agent", &agent.catalog.families());
    family_table(
        &mut out,
        "tether ccm",
        &tether_ccm::metrics::Metrics::new().catalog.families(),
    );
    out
}

fn family_table(out: &mut String, title: &str, families: &[FamilyDoc]) {
    out.push_str(&format!(
        "\n## `{title}`\n\n| metric | type | labels | help |\n|---|---|---|---|\n"
    ));
    for f in families {
        let labels: Vec<String> = f.labels.iter().map(|l| format!("`{l}`")).collect();
        out.push_str(&format!(
            "| `{}` | {} | {} | {} |\n",
            f.name,
            f.kind,
            labels.join(", "),
            cell(&f.help)
        ));
    }
}

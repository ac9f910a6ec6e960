//! Subcommands and the flag plumbing they share (Go-style booleans and durations,
//! one-line flag errors; the logging flags live in `logging`).

pub mod agent;
pub mod ccm;
pub mod certs;
pub mod klog;
pub mod local;
pub mod logging;
pub mod rollout;
pub mod server;
pub mod status;

pub use logging::LogArgs;

/// The audit log's flags, the server's and the agent's alike: kube-apiserver's names.
#[derive(clap::Args, Debug, Clone)]
pub struct AuditArgs {
    /// Write an audit record (one JSON line) for every tunnel, dial and refusal to this
    /// file, or to stdout with -. Empty: no audit (the default).
    ///
    /// kube-apiserver's flag name. See docs/audit.md for the format: the server records
    /// each tunnel when it ends and each refusal; the agent each dial's outcome and each
    /// connection's end.
    #[arg(long, default_value = "")]
    pub audit_log_path: String,
    /// Megabytes the audit log may reach before it is rotated (path -> path.1).
    ///
    /// At least 1 (kube-apiserver's 0 would mean lumberjack's 100).
    #[arg(long, default_value_t = tether_ops::audit::DEFAULT_MAX_SIZE_MB)]
    pub audit_log_maxsize: u64,
    /// Rotated audit files kept (path.1 ... path.N); the oldest is removed.
    ///
    /// At least 1: kube-apiserver's 0 (keep every file) is refused, so the audit
    /// never fills a disk.
    #[arg(long, default_value_t = tether_ops::audit::DEFAULT_MAX_BACKUPS)]
    pub audit_log_maxbackup: usize,
}

impl AuditArgs {
    /// The validated settings; `None` when the audit is off.
    pub fn config(
        &self,
    ) -> Result<Option<tether_ops::audit::AuditConfig>, tether_ops::audit::AuditError> {
        tether_ops::audit::AuditConfig::from_flags(
            &self.audit_log_path,
            self.audit_log_maxsize,
            self.audit_log_maxbackup,
        )
    }
}

use std::time::Duration;
use tether_core::error::chain;

/// Parses a Go-style duration flag value.
pub fn duration(s: &str) -> Result<Duration, String> {
    tether_ops::duration::parse(s)
}

/// `--dead-link-timeout`: `None` for 0 (the kernel's defaults); below 2 s one retransmit
/// on a slow link would end the connection.
pub fn dead_link(d: Duration) -> anyhow::Result<Option<Duration>> {
    if d.is_zero() {
        return Ok(None);
    }
    if d < Duration::from_secs(2) {
        anyhow::bail!("--dead-link-timeout must be 0 (kernel defaults) or at least 2s");
    }
    Ok(Some(d))
}

/// Parses a Go-style boolean (`true`, `false`, `1`, `0`, `t`, `f`).
pub fn go_bool(s: &str) -> Result<bool, String> {
    match s {
        "true" | "1" | "t" | "T" | "TRUE" | "True" => Ok(true),
        "false" | "0" | "f" | "F" | "FALSE" | "False" => Ok(false),
        other => Err(format!("{other:?} is not a boolean (use true or false)")),
    }
}

/// Parses the command line; help and version are printed as usual, anything else
/// wrong is one `error: ...` line naming the flag (exit code 2).
pub fn parse_args<P: clap::Parser>() -> Result<P, std::process::ExitCode> {
    parse_args_from(std::env::args_os())
}

/// The file name this process was run as (`args[0]` without its directory).
pub(crate) fn program_name(args: &[std::ffi::OsString]) -> String {
    args.first()
        .and_then(|a| std::path::Path::new(a).file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Arguments that are not flags, as upstream's binaries take them: ignored with a
/// warning; but a flag after `--` (which pflag would drop silently, a security flag
/// among them) is refused.
pub fn check_positionals(positional: &[String], program: &str) -> anyhow::Result<()> {
    if let Some(flag) = positional.iter().find(|a| a.starts_with('-')) {
        anyhow::bail!("{flag:?} comes after `--`, so it is not read as a flag: remove the `--`");
    }
    if !positional.is_empty() {
        tracing::warn!(
            arguments = ?positional,
            "ignoring arguments that are not flags (upstream's {program} ignores them too)"
        );
    }
    Ok(())
}

/// The command line as `tether` takes it, from upstream's program names: invoked as
/// `proxy-server` (the image links `/proxy-server` and `/usr/bin/proxy-server` to
/// `/tether`) it is `tether server --log-format=klog ARGS`, as `proxy-agent` `tether
/// agent --log-format=klog ARGS`, so upstream's manifests run unchanged and log klog's
/// lines. Other names pass through.
pub fn upstream_program_args(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = args.into_iter().collect();
    let subcommand = match program_name(&args).as_str() {
        "proxy-server" => "server",
        "proxy-agent" => "agent",
        _ => return args,
    };
    // Upstream's names log upstream's klog lines; a later --log-format still wins.
    args.splice(1..1, [subcommand.into(), "--log-format=klog".into()]);
    args
}

/// `tether-agent`'s command line: invoked as `proxy-agent` (the image's upstream name
/// for it) the default log format is klog's, as for `tether` run as `proxy-agent`.
pub fn agent_program_args(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = args.into_iter().collect();
    if program_name(&args) == "proxy-agent" {
        args.insert(1, "--log-format=klog".into());
    }
    args
}

/// [`parse_args`] from `args` (the program name first).
pub fn parse_args_from<P: clap::Parser>(
    args: impl IntoIterator<Item = std::ffi::OsString>,
) -> Result<P, std::process::ExitCode> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let e = match P::try_parse_from(args) {
        Ok(p) => return Ok(p),
        Err(e) => e,
    };
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    let arg = match e.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(s)) => s.clone(),
        _ => String::new(),
    };
    let line = match e.kind() {
        ErrorKind::UnknownArgument if !arg.starts_with('-') => {
            format!(
                "unexpected argument '{arg}' (see --help for the commands and flags this takes)"
            )
        }
        ErrorKind::UnknownArgument => {
            let flag = arg.split('=').next().unwrap_or(&arg).to_string();
            format!("unknown flag {flag} (see --help for the flags this command takes)")
        }
        _ => {
            let rendered = e.render().to_string();
            let first = rendered.lines().next().unwrap_or_default();
            let line = first.strip_prefix("error: ").unwrap_or(first).to_string();
            // clap lists a value flag's choices on a line of their own: keep them.
            match e.get(ContextKind::ValidValue) {
                Some(ContextValue::Strings(values)) if !values.is_empty() => {
                    format!("{line} (one of: {})", values.join(", "))
                }
                _ => line,
            }
        }
    };
    eprintln!("error: {line}");
    // As upstream's binaries (pflag, cobra) exit on a bad command line.
    Err(std::process::ExitCode::from(1))
}

/// A command's outcome as the process exit code; an error is printed as one
/// `error: ...` line with its causes.
pub fn exit_code(result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            let e: &(dyn std::error::Error + 'static) = e.as_ref();
            eprintln!("error: {}", chain(e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Builds the runtime and runs `fut` on it: `worker_threads` threads run tasks (0 = one
/// per CPU the process may use, or `TOKIO_WORKER_THREADS`).
pub fn block_on<F: std::future::Future>(worker_threads: usize, fut: F) -> F::Output {
    tether_ops::memory::tune_allocator();
    raise_open_files();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if worker_threads > 0 {
        runtime.worker_threads(worker_threads);
    }
    runtime
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(fut)
}

/// Raises the open-file soft limit to the hard limit, as Go programs do (upstream's
/// server among them): a server holds a descriptor per agent stream and per tunnel,
/// and 1,024 (a systemd unit's or some container runtimes' default soft limit) would
/// stop it accepting agents at about a thousand nodes.
fn raise_open_files() {
    match tether_ops::limits::raise_open_files() {
        Ok(l) if l.now > l.was => tracing::info!(
            was = l.was,
            now = l.now,
            "raised the open-file soft limit to the hard limit"
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %chain(&e), "cannot raise the open-file soft limit"),
    }
}

/// `host:port` for a bind address flag that may be empty (all interfaces).
pub fn bind_addr(host: &str, port: u16, flag: &str) -> anyhow::Result<std::net::SocketAddr> {
    let host = if host.is_empty() { "0.0.0.0" } else { host };
    if let Ok(ip) = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
    {
        return Ok(std::net::SocketAddr::new(ip, port));
    }
    // A host name, as Go's net.Listen takes one (k0s passes `localhost`): its first
    // address, IPv4 first as Go prefers.
    use std::net::ToSocketAddrs;
    let addrs: Vec<std::net::SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| {
            anyhow::anyhow!("--{flag} {host:?} is neither an IP address nor a name this host resolves ({e}); use e.g. 127.0.0.1 or ::")
        })?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| anyhow::anyhow!("--{flag} {host:?} resolves to no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Go's pflag semantics, for the server's and the agent's flags (klog's included):
    /// the last value of a repeated flag wins, a list flag appends.
    #[test]
    fn a_repeated_flag_takes_its_last_value_and_lists_append() {
        #[derive(clap::Parser, Debug)]
        struct Server {
            #[command(flatten)]
            args: super::server::ServerArgs,
        }
        #[derive(clap::Parser, Debug)]
        struct Agent {
            #[command(flatten)]
            args: super::agent::AgentArgs,
        }
        let os = |v: &[&str]| -> Vec<std::ffi::OsString> { v.iter().map(|s| s.into()).collect() };
        let server: Server = parse_args_from(os(&[
            "proxy-server",
            "-v=2",
            "--mode=http-connect",
            "--cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
            "--mode=grpc",
            "--v=1",
            "--cipher-suites=TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
        ]))
        .unwrap();
        assert_eq!(server.args.mode, tether_server::Mode::Grpc);
        assert_eq!(server.args.log.verbosity, 1);
        assert_eq!(
            server.args.cipher_suites,
            [
                "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
                "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
                "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"
            ]
        );
        let agent: Agent = parse_args_from(os(&[
            "proxy-agent",
            "--agent-id=first",
            "--proxy-server-port=8132",
            "--agent-id=second",
            "--proxy-server-port=8133",
        ]))
        .unwrap();
        assert_eq!(agent.args.agent_id, "second");
        assert_eq!(agent.args.proxy_server_port, 8133);
    }

    #[test]
    fn upstream_program_names_are_subcommands() {
        let args = |v: &[&str]| -> Vec<std::ffi::OsString> { v.iter().map(|s| s.into()).collect() };
        assert_eq!(
            upstream_program_args(args(&["/usr/bin/proxy-server", "--mode=grpc"])),
            args(&[
                "/usr/bin/proxy-server",
                "server",
                "--log-format=klog",
                "--mode=grpc"
            ])
        );
        assert_eq!(
            upstream_program_args(args(&["proxy-agent", "--agent-id=a"])),
            args(&["proxy-agent", "agent", "--log-format=klog", "--agent-id=a"])
        );
        assert_eq!(
            upstream_program_args(args(&["/tether", "certs", "dev"])),
            args(&["/tether", "certs", "dev"])
        );
        assert_eq!(
            agent_program_args(args(&["/proxy-agent", "--v=2"])),
            args(&["/proxy-agent", "--log-format=klog", "--v=2"])
        );
        assert_eq!(
            agent_program_args(args(&["/tether-agent", "--v=2"])),
            args(&["/tether-agent", "--v=2"])
        );
    }

    #[test]
    fn each_cause_is_printed_once() {
        let io = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        let start = tether_server::StartError::Bind {
            what: "agent port",
            addr: "0.0.0.0:8091".into(),
            source: io,
        };
        let e = anyhow::Error::new(start).context("server start-up failed");
        let line = chain(e.as_ref()).to_string();
        assert_eq!(line.matches("address in use").count(), 1, "{line}");
        assert!(
            line.starts_with("server start-up failed: cannot listen on agent port 0.0.0.0:8091: "),
            "{line}"
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(chain(plain.as_ref()).to_string(), "outer: inner");
    }
}

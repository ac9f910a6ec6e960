//! Subcommands and the flag plumbing they share (Go-style booleans and durations,
//! klog compatibility flags, logging set-up).

pub mod agent;
pub mod ccm;
pub mod certs;
pub mod local;
pub mod server;

use std::time::Duration;

use clap::Args;

/// Parses a Go-style duration flag value.
pub fn duration(s: &str) -> Result<Duration, String> {
    tether_core::duration::parse(s)
}

/// Parses a Go-style boolean (`true`, `false`, `1`, `0`, `t`, `f`).
pub fn go_bool(s: &str) -> Result<bool, String> {
    match s {
        "true" | "1" | "t" | "T" | "TRUE" | "True" => Ok(true),
        "false" | "0" | "f" | "F" | "FALSE" | "False" => Ok(false),
        other => Err(format!("{other:?} is not a boolean (use true or false)")),
    }
}

/// Logging flags, including the klog ones found in upstream manifests.
#[derive(Args, Debug, Clone)]
pub struct LogArgs {
    /// klog verbosity: 0-2 info, 3-4 debug, 5+ trace (RUST_LOG overrides).
    #[arg(long = "v", short = 'v', default_value_t = 0, value_name = "LEVEL")]
    pub verbosity: u8,
    /// Log format: text or json.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Accepted for klog compatibility; Tether always logs to stderr.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    pub logtostderr: Option<bool>,
    /// Accepted for klog compatibility; Tether always logs to stderr.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    pub alsologtostderr: Option<bool>,
}

impl LogArgs {
    /// Installs the global tracing subscriber.
    pub fn init(&self) {
        use tracing_subscriber::EnvFilter;
        let level = match self.verbosity {
            0..=2 => "info",
            3..=4 => "debug",
            _ => "trace",
        };
        let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
            EnvFilter::new(format!(
                "{level},h2=info,tower=info,hyper=info,rustls=info,hyper_util=info"
            ))
        });
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr);
        if self.log_format == "json" {
            builder.json().flatten_event(true).init();
        } else {
            builder.init();
        }
        if self.logtostderr.is_some() || self.alsologtostderr.is_some() {
            tracing::info!("--logtostderr/--alsologtostderr accepted for klog compatibility; Tether always logs to stderr");
        }
    }
}

/// Fails when an upstream flag this version does not implement was given.
pub fn reject_unsupported(flags: &[(&str, bool)]) -> anyhow::Result<()> {
    for (name, given) in flags {
        if *given {
            anyhow::bail!(
                "--{name} is an upstream flag this Tether version does not support yet; remove it (see README.md, Flags)"
            );
        }
    }
    Ok(())
}

/// A command's outcome as the process exit code; an error is printed as one
/// `error: ...` line with its causes.
pub fn exit_code(result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Builds the runtime and runs `fut` on it: `worker_threads` threads run tasks (0 = one
/// per CPU the process may use, or `TOKIO_WORKER_THREADS`).
pub fn block_on<F: std::future::Future>(worker_threads: usize, fut: F) -> F::Output {
    tether_core::memory::tune_allocator();
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

/// `host:port` for a bind address flag that may be empty (all interfaces).
pub fn bind_addr(host: &str, port: u16, flag: &str) -> anyhow::Result<std::net::SocketAddr> {
    let host = if host.is_empty() { "0.0.0.0" } else { host };
    let ip: std::net::IpAddr = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .map_err(|_| {
            anyhow::anyhow!("--{flag} {host:?} is not an IP address (use e.g. 127.0.0.1 or ::)")
        })?;
    Ok(std::net::SocketAddr::new(ip, port))
}

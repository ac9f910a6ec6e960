//! Logging flags (klog's, as both upstream binaries register them, plus
//! `--log-format`) and the tracing subscriber they build: stderr, a log file capped
//! the way klog caps it, or both.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use tracing::Level;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use super::{duration, go_bool};

/// Logging flags: klog's names, defaults and meaning (underscore spellings accepted).
#[derive(Args, Debug, Clone)]
pub struct LogArgs {
    /// klog verbosity: 0-2 info, 3-4 debug, 5+ trace (RUST_LOG overrides).
    #[arg(long = "v", short = 'v', default_value_t = 0, value_name = "LEVEL")]
    pub verbosity: u8,
    /// Per-module verbosity, `pattern=N[,pattern=N]`.
    ///
    /// Tether modules whose name matches the pattern (a klog glob with `*` and `?`, e.g.
    /// `router=5`, `agent*=4`) log at level N. Upstream's patterns name Go files; one that
    /// matches no Tether module is logged once and has no effect.
    #[arg(long, default_value = "")]
    pub vmodule: String,
    /// Log line format: text (tracing's), json, or klog (upstream's lines).
    ///
    /// klog writes `I1127 15:04:05.000000 pid file:line] "msg" k="v"` lines, for log
    /// shippers that parse upstream's. The default is text, and klog when invoked as
    /// proxy-server or proxy-agent (upstream's program names). Tether only.
    #[arg(long, default_value = "text", value_parser = ["text", "json", "klog"])]
    pub log_format: String,
    /// Log to standard error only; false logs to --log-file or --log-dir.
    #[arg(long, default_value = "true", num_args = 0..=1, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    pub logtostderr: bool,
    /// With a log file, log to standard error as well.
    ///
    /// Lines at or above --alsologtostderrthreshold (by default, every line) go to both.
    #[arg(long, default_value = "false", num_args = 0..=1, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    pub alsologtostderr: bool,
    /// With --logtostderr=false and no --log-file: write the log in this directory.
    ///
    /// The file is `tether.log`; with --log-format=klog, klog's
    /// `PROGRAM.HOST.USER.log.INFO.DATE-TIME.PID` and a `PROGRAM.INFO` link to it (one
    /// file for every severity). Empty: the temporary directory, as klog. The directory is
    /// created if missing.
    #[arg(long, alias = "log_dir", default_value = "")]
    pub log_dir: String,
    /// With --logtostderr=false: write the log to this file.
    ///
    /// Created with its directory if missing, and appended to.
    #[arg(long, alias = "log_file", default_value = "")]
    pub log_file: String,
    /// Largest log file in MB (0 = unlimited).
    ///
    /// As klog does, a full file starts over (truncated); no rotated copies are kept.
    #[arg(long, alias = "log_file_max_size", default_value_t = 1800)]
    pub log_file_max_size: u64,
    /// Add the source file's path to each line's header.
    ///
    /// text and json lines gain the source `file:line`; klog lines, which always name the
    /// file, name its directory too.
    #[arg(long, alias = "add_dir_header", default_value = "false", num_args = 0..=1, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    pub add_dir_header: bool,
    /// Lines without the time/level/target header.
    ///
    /// klog lines then have no header at all; json lines are unchanged.
    #[arg(long, alias = "skip_headers", default_value = "false", num_args = 0..=1, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    pub skip_headers: bool,
    /// Accepted: Tether writes no header when it opens a log file.
    #[arg(long, alias = "skip_log_headers", default_value = "false", num_args = 0..=1, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    pub skip_log_headers: bool,
    /// Accepted: Tether writes one log file, never one per severity.
    #[arg(long, alias = "one_output", default_value = "false", num_args = 0..=1, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    pub one_output: bool,
    /// Severity from which a log file's lines also go to standard error.
    ///
    /// With --logtostderr=false and without --alsologtostderr: lines at or above it
    /// (INFO, WARNING, ERROR, FATAL or 0-3) also go to standard error. With
    /// --legacy-stderr-threshold-behavior=false it applies with --logtostderr too.
    #[arg(long, default_value = "ERROR", value_parser = severity)]
    pub stderrthreshold: Level,
    /// Severity from which --alsologtostderr copies a log file's lines to standard error.
    ///
    /// klog's; no effect with --logtostderr.
    #[arg(long, default_value = "INFO", value_parser = severity)]
    pub alsologtostderrthreshold: Level,
    /// klog's: true ignores --stderrthreshold while --logtostderr is on.
    ///
    /// Every line then goes to standard error; false applies --stderrthreshold there too
    /// (lines below it are not written).
    #[arg(long, alias = "legacy_stderr_threshold_behavior", default_value = "true", num_args = 0..=1, default_missing_value = "true", value_parser = go_bool, value_name = "BOOL")]
    pub legacy_stderr_threshold_behavior: bool,
    /// Accepted: `file:line` backtraces are a Go facility; Tether logs none.
    #[arg(long, alias = "log_backtrace_at", default_value = "")]
    pub log_backtrace_at: String,
    /// Accepted: Tether writes every line at once; nothing waits to be flushed.

    #[arg(long, default_value = "5s", value_parser = duration)]
    pub log_flush_frequency: Duration,
}

/// Parses a klog severity name or number.
fn severity(s: &str) -> Result<Level, String> {
    match s.to_ascii_uppercase().as_str() {
        "INFO" | "0" => Ok(Level::INFO),
        "WARNING" | "1" => Ok(Level::WARN),
        "ERROR" | "2" | "FATAL" | "3" => Ok(Level::ERROR),
        other => Err(format!(
            "{other:?} is not a severity (use INFO, WARNING, ERROR or FATAL)"
        )),
    }
}

/// The modules `--vmodule` patterns are matched against, by crate (the unit test
/// `every_module_is_listed` keeps this list in step with the source tree).
const MODULES: &[(&str, &str)] = &[
    ("tether", "cli"),
    ("tether", "cmd"),
    ("tether", "reference"),
    ("tether_core", "admission"),
    ("tether_core", "drain"),
    ("tether_core", "error"),
    ("tether_core", "flow"),
    ("tether_core", "grpc"),
    ("tether_core", "host"),
    ("tether_core", "identifiers"),
    ("tether_core", "pump"),
    ("tether_core", "queue"),
    ("tether_core", "quic"),
    ("tether_core", "ratelimit"),
    ("tether_core", "read_ahead"),
    ("tether_core", "tls"),
    ("tether_core", "transport"),
    ("tether_core", "write_through"),
    ("tether_core", "ws"),
    ("tether_ops", "audit"),
    ("tether_ops", "authz"),
    ("tether_ops", "duration"),
    ("tether_ops", "health"),
    ("tether_ops", "heap_profile"),
    ("tether_ops", "kubeclient"),
    ("tether_ops", "limits"),
    ("tether_ops", "memory"),
    ("tether_ops", "metrics"),
    ("tether_ops", "profiling"),
    ("tether_ops", "reload"),
    ("tether_ops", "shutdown"),
    ("tether_server", "accept"),
    ("tether_server", "agent_link"),
    ("tether_server", "auth"),
    ("tether_server", "config"),
    ("tether_server", "frontend"),
    ("tether_server", "identity"),
    ("tether_server", "lease"),
    ("tether_server", "metrics"),
    ("tether_server", "nodes"),
    ("tether_server", "router"),
    ("tether_server", "serve"),
    ("tether_server", "side"),
    ("tether_server", "start"),
    ("tether_server", "status"),
    ("tether_agent", "audit"),
    ("tether_agent", "config"),
    ("tether_agent", "dialer"),
    ("tether_agent", "lease_count"),
    ("tether_agent", "link"),
    ("tether_agent", "metrics"),
    ("tether_agent", "policy"),
    ("tether_agent", "proxy"),
    ("tether_agent", "servers"),
    ("tether_client", "grpc"),
    ("tether_ccm", "cloud"),
    ("tether_ccm", "controllers"),
    ("tether_ccm", "credentials"),
    ("tether_ccm", "endpoints"),
    ("tether_ccm", "informer"),
    ("tether_ccm", "lb"),
    ("tether_ccm", "leader"),
    ("tether_ccm", "manager"),
    ("tether_ccm", "metrics"),
    ("tether_ccm", "netlink"),
    ("tether_ccm", "provider"),
    ("tether_ccm", "serving"),
    ("tether_ccm", "translate"),
    ("tether_ccm", "workqueue"),
    ("tether_certs", "csr"),
    ("tether_certs", "inspect"),
    ("tether_certs", "key"),
];

/// klog's `--vmodule` glob (Go's `filepath.Match` without character classes): `*`
/// matches any run of characters, `?` one.
fn glob_match(pattern: &str, name: &str) -> bool {
    fn go(p: &[u8], n: &[u8]) -> bool {
        match p.split_first() {
            None => n.is_empty(),
            Some((b'*', rest)) => (0..=n.len()).any(|i| go(rest, &n[i..])),
            Some((b'?', rest)) => !n.is_empty() && go(rest, &n[1..]),
            Some((c, rest)) => n.first() == Some(c) && go(rest, &n[1..]),
        }
    }
    // klog matches a pattern with a `/` against the whole path, else the file's base
    // name: for Tether, the last path element of the pattern against the module.
    let pattern = pattern.rsplit('/').next().unwrap_or(pattern);
    let pattern = pattern.strip_suffix(".go").unwrap_or(pattern);
    let pattern = pattern.strip_suffix(".rs").unwrap_or(pattern);
    go(pattern.as_bytes(), name.as_bytes())
}

/// The program name klog puts in its file names: the name this process was run as.
fn program_name() -> String {
    let first: Vec<std::ffi::OsString> = std::env::args_os().take(1).collect();
    Some(super::program_name(&first))
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "tether".into())
}

/// klog's log file name in `--log-dir`: `PROGRAM.HOST.USER.log.INFO.YYYYMMDD-HHMMSS.PID`.
fn klog_file_name(now: time::OffsetDateTime) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknownhost".into());
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(u32::MAX);
    let user = std::fs::read_to_string("/etc/passwd")
        .ok()
        .and_then(|p| {
            p.lines().find_map(|l| {
                let mut f = l.split(':');
                let name = f.next()?;
                (f.nth(1)? == uid.to_string()).then(|| name.to_string())
            })
        })
        .unwrap_or_else(|| "unknownuser".into());
    format!(
        "{}.{host}.{user}.log.INFO.{:04}{:02}{:02}-{:02}{:02}{:02}.{}",
        program_name(),
        now.year(),
        u8::from(now.month()),
        now.day(),
        now.hour(),
        now.minute(),
        now.second(),
        std::process::id()
    )
}

fn level_of(v: u8) -> &'static str {
    match v {
        0..=2 => "info",
        3..=4 => "debug",
        _ => "trace",
    }
}

impl LogArgs {
    /// The log file when logging goes to a file: `--log-file`, else `tether.log` in
    /// `--log-dir` (or the temporary directory, as klog does).
    pub fn file_path(&self) -> Option<PathBuf> {
        if self.logtostderr {
            return None;
        }
        if !self.log_file.is_empty() {
            return Some(PathBuf::from(&self.log_file));
        }
        let dir = if self.log_dir.is_empty() {
            std::env::temp_dir()
        } else {
            PathBuf::from(&self.log_dir)
        };
        if self.log_format == "klog" {
            return Some(dir.join(klog_file_name(time::OffsetDateTime::now_utc())));
        }
        Some(dir.join("tether.log"))
    }

    /// The level filter, and the `--vmodule` patterns that name no Tether module.
    fn filter(&self) -> Result<(EnvFilter, Vec<String>), String> {
        if let Ok(f) = EnvFilter::try_from_default_env() {
            return Ok((f, Vec::new()));
        }
        let mut directives = format!(
            "{},h2=info,tower=info,hyper=info,rustls=info,hyper_util=info",
            level_of(self.verbosity)
        );
        let mut unmatched = Vec::new();
        for entry in self.vmodule.split(',').filter(|e| !e.trim().is_empty()) {
            let (pattern, n) = entry
                .trim()
                .split_once('=')
                .ok_or_else(|| format!("--vmodule {entry:?}: expected pattern=N"))?;
            let n: u8 = n
                .parse()
                .map_err(|_| format!("--vmodule {entry:?}: {n:?} is not a level"))?;
            let mut matched = false;
            for (krate, module) in MODULES {
                if glob_match(pattern, module) {
                    directives.push_str(&format!(",{krate}::{module}={}", level_of(n)));
                    matched = true;
                }
            }
            if !matched {
                unmatched.push(pattern.to_string());
            }
        }
        Ok((
            EnvFilter::try_new(&directives).map_err(|e| format!("--vmodule: {e}"))?,
            unmatched,
        ))
    }

    /// Checks the flags and installs the global tracing subscriber; an error names the
    /// flag to fix.
    pub fn init(&self) -> anyhow::Result<()> {
        let (filter, unmatched) = self.filter().map_err(anyhow::Error::msg)?;
        let path = self.file_path();
        let file = match &path {
            Some(path) => Some(CappedFile::open(
                path,
                self.log_file_max_size * 1024 * 1024,
            )?),
            None => None,
        };
        if let (Some(path), true, true) =
            (&path, self.log_file.is_empty(), self.log_format == "klog")
        {
            // klog's `PROGRAM.INFO` link to the newest file; best effort, as klog's.
            if let (Some(dir), Some(name)) = (path.parent(), path.file_name()) {
                let link = dir.join(format!("{}.INFO", program_name()));
                let _ = std::fs::remove_file(&link);
                let _ = std::os::unix::fs::symlink(name, &link);
            }
        }
        let mut layers: Vec<Box<dyn Layer<Registry> + Send + Sync>> = Vec::new();
        match &file {
            None if self.legacy_stderr_threshold_behavior => {
                layers.push(self.layer(std::io::stderr))
            }
            None => layers.push(Box::new(
                self.layer(std::io::stderr)
                    .with_filter(LevelFilter::from_level(self.stderrthreshold)),
            )),
            Some(f) => {
                layers.push(self.layer(f.clone()));
                let stderr = self.layer(std::io::stderr);
                layers.push(if self.alsologtostderr {
                    Box::new(
                        stderr.with_filter(LevelFilter::from_level(self.alsologtostderrthreshold)),
                    )
                } else {
                    Box::new(stderr.with_filter(LevelFilter::from_level(self.stderrthreshold)))
                });
            }
        }
        tracing_subscriber::registry()
            .with(layers)
            .with(filter)
            .try_init()
            .map_err(|e| anyhow::anyhow!("cannot install the logger: {e}"))?;
        if !unmatched.is_empty() {
            tracing::warn!(
                patterns = %unmatched.join(","),
                "--vmodule: these patterns match no Tether module (upstream's name Go source files); modules: {}",
                MODULES.iter().map(|(_, m)| *m).collect::<Vec<_>>().join(",")
            );
        }
        Ok(())
    }

    fn layer<W>(&self, writer: W) -> Box<dyn Layer<Registry> + Send + Sync>
    where
        W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
    {
        let base = tracing_subscriber::fmt::layer()
            .with_writer(writer)
            .with_ansi(false)
            .with_file(self.add_dir_header)
            .with_line_number(self.add_dir_header);
        if self.log_format == "klog" {
            return Box::new(base.fmt_fields(super::klog::KlogSpanFields).event_format(
                super::klog::Klog {
                    dir_header: self.add_dir_header,
                    skip_headers: self.skip_headers,
                },
            ));
        }
        if self.log_format == "json" {
            return Box::new(base.json().flatten_event(true));
        }
        // Peers' values quoted, so that none forges a field or a line.
        let text = base.fmt_fields(super::klog::TextFields);
        match self.skip_headers {
            true => Box::new(text.without_time().with_level(false).with_target(false)),
            false => Box::new(text),
        }
    }
}

/// A log file that, like klog's, is appended to at start-up and starts over
/// (truncated) when a line would take it past its cap.
#[derive(Clone)]
pub struct CappedFile {
    inner: Arc<Mutex<(File, u64)>>,
    cap: u64,
}

impl CappedFile {
    /// Opens (creating it and its directory) `path`; `cap` in bytes, 0 = unlimited.
    pub fn open(path: &Path, cap: u64) -> anyhow::Result<CappedFile> {
        let what = |e: std::io::Error| {
            anyhow::anyhow!(
                "--log-file/--log-dir {}: {e} (check the directory exists and is writable)",
                path.display()
            )
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(what)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(what)?;
        let len = file.metadata().map_err(what)?.len();
        Ok(CappedFile {
            inner: Arc::new(Mutex::new((file, len))),
            cap,
        })
    }
}

impl Write for &CappedFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut guard = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let (file, len) = &mut *guard;
        if self.cap > 0 && *len + buf.len() as u64 > self.cap && *len > 0 {
            file.set_len(0)?;
            *len = 0;
        }
        file.write_all(buf)?;
        *len += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for CappedFile {
    type Writer = &'a CappedFile;
    fn make_writer(&'a self) -> Self::Writer {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_file_starts_over() {
        let dir = std::env::temp_dir().join(format!("tether-log-{}", std::process::id()));
        let path = dir.join("sub/t.log");
        let f = CappedFile::open(&path, 10).unwrap();
        (&f).write_all(b"12345\n").unwrap();
        (&f).write_all(b"678\n").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"12345\n678\n");
        (&f).write_all(b"abc\n").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"abc\n");
        // Reopened: appended to.
        let g = CappedFile::open(&path, 0).unwrap();
        (&g).write_all(b"def\n").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"abc\ndef\n");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn every_module_is_listed() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        for (krate, dir) in [
            ("tether_core", "core"),
            ("tether_ops", "ops"),
            ("tether_server", "server"),
            ("tether_agent", "agent"),
            ("tether_client", "client"),
            ("tether_ccm", "ccm"),
            ("tether_certs", "certs"),
        ] {
            for entry in std::fs::read_dir(root.join(dir).join("src")).unwrap() {
                let path = entry.unwrap().path();
                let name = path.file_stem().unwrap().to_str().unwrap().to_string();
                if ["lib", "tests"].contains(&name.as_str()) {
                    continue;
                }
                assert!(
                    MODULES.contains(&(krate, name.as_str())),
                    "MODULES lacks ({krate:?}, {name:?})"
                );
            }
        }
    }

    #[test]
    fn klog_file_names() {
        let now = time::OffsetDateTime::from_unix_timestamp(1795791845).unwrap();
        let name = klog_file_name(now);
        assert!(name.contains(".log.INFO.20261127-150405."), "{name}");
    }

    #[test]
    fn severities_and_vmodule() {
        assert_eq!(severity("warning").unwrap(), Level::WARN);
        assert_eq!(severity("2").unwrap(), Level::ERROR);
        assert!(severity("loud").is_err());
        let mut args = LogArgs {
            verbosity: 0,
            vmodule: "router=5,dialer=3".into(),
            log_format: "text".into(),
            logtostderr: true,
            alsologtostderr: false,
            log_dir: String::new(),
            log_file: String::new(),
            log_file_max_size: 1800,
            add_dir_header: false,
            skip_headers: false,
            skip_log_headers: false,
            one_output: false,
            stderrthreshold: Level::ERROR,
            alsologtostderrthreshold: Level::INFO,
            legacy_stderr_threshold_behavior: true,
            log_backtrace_at: String::new(),
            log_flush_frequency: Duration::from_secs(5),
        };
        if std::env::var_os("RUST_LOG").is_none() {
            let (f, unmatched) = args.filter().unwrap();
            let f = f.to_string();
            assert!(f.contains("tether_server::router=trace"), "{f}");
            assert!(f.contains("tether_agent::dialer=debug"), "{f}");
            assert!(unmatched.is_empty());
            args.vmodule = "router".into();
            assert!(args.filter().is_err());
            // klog globs, and upstream's Go file names (which match nothing here).
            args.vmodule = "agent*=4,pkg/server/backend_manager.go=5,l?nk=5".into();
            let (f, unmatched) = args.filter().unwrap();
            let f = f.to_string();
            assert!(f.contains("tether_server::agent_link=debug"), "{f}");
            assert!(f.contains("tether_agent::link=trace"), "{f}");
            assert!(!f.contains("dialer"), "{f}");
            assert_eq!(unmatched, ["pkg/server/backend_manager.go"]);
        }
        assert_eq!(args.file_path(), None);
        args.logtostderr = false;
        args.log_file = "/var/log/x.log".into();
        assert_eq!(args.file_path(), Some(PathBuf::from("/var/log/x.log")));
    }
}

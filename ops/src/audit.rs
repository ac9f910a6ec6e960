//! The audit log both ends write: records handed to one writer thread through a bounded
//! queue, serialised there as JSON lines to a file rotated by size (`path` -> `path.1`
//! ... `path.N`) or to stdout. A full queue or a failing disk drops records and counts
//! them; it never makes a tunnel wait.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use prometheus::IntCounter;
use serde::Serialize;
use tether_core::ratelimit::LogLimit;

use crate::metrics::Catalog;

/// `--audit-log-path` for standard output.
pub const STDOUT: &str = "-";
/// `--audit-log-maxsize`'s default, in megabytes.
pub const DEFAULT_MAX_SIZE_MB: u64 = 100;
/// `--audit-log-maxbackup`'s default.
pub const DEFAULT_MAX_BACKUPS: usize = 10;
/// Records that may wait for the writer; past this they are dropped.
pub const QUEUE: usize = 4096;
/// How long the writer rests after a write before it takes the next batch. While it
/// rests, recording costs a queue push and no wake-up (waking a parked writer is a
/// futex call and a context switch on the recording thread, per record): at most
/// 50 wake-ups a second, records on disk within 20 ms, and 4,096 records of room
/// is 200,000 a second.
const PAUSE: Duration = Duration::from_millis(20);

/// Where records go and when the file rotates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditConfig {
    /// The file, or `None` for standard output.
    pub path: Option<PathBuf>,
    /// Bytes a file may reach before it is rotated.
    pub max_size: u64,
    /// Rotated files kept (`path.1` is the newest).
    pub max_backups: usize,
}

impl AuditConfig {
    /// The settings `--audit-log-path`, `--audit-log-maxsize` (megabytes) and
    /// `--audit-log-maxbackup` make; `Ok(None)` when the path is empty (no audit).
    pub fn from_flags(
        path: &str,
        max_size_mb: u64,
        max_backups: usize,
    ) -> Result<Option<Self>, AuditError> {
        if max_size_mb == 0 {
            return Err(AuditError::Flag("--audit-log-maxsize must be at least 1 (megabytes before the audit log is rotated; the default is 100)"));
        }
        if max_size_mb > u64::MAX >> 20 {
            return Err(AuditError::Flag(
                "--audit-log-maxsize is in megabytes: give a size below a petabyte",
            ));
        }
        if max_backups == 0 {
            return Err(AuditError::Flag("--audit-log-maxbackup must be at least 1 (rotated audit files kept; Tether never keeps an unbounded number)"));
        }
        let path = match path.trim() {
            "" => return Ok(None),
            STDOUT => None,
            p if p.ends_with('/') => {
                return Err(AuditError::Flag(
                    "--audit-log-path names a directory: give a file in it (e.g. /var/log/tether/audit.log), or - for stdout",
                ))
            }
            p => Some(PathBuf::from(p)),
        };
        Ok(Some(AuditConfig {
            path,
            max_size: max_size_mb << 20,
            max_backups,
        }))
    }
}

/// Why the audit log could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuditError {
    /// A flag's value is unusable; the message says which and what to give.
    #[error("{0}")]
    Flag(&'static str),
    /// The file could not be opened for appending.
    #[error("cannot open the audit log {}: create its directory and let this process write there, or give another --audit-log-path", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The writer thread could not be started.
    #[error("cannot start the audit writer thread")]
    Thread(#[source] std::io::Error),
}

/// `tether_audit_records_total` and `tether_audit_records_dropped_total`.
#[derive(Clone)]
pub struct AuditMetrics {
    /// Records written.
    pub records: IntCounter,
    /// Records lost: the queue was full or the write failed.
    pub dropped: IntCounter,
}

impl AuditMetrics {
    /// Both counters, registered in `catalog`.
    pub fn new(catalog: &Catalog) -> Self {
        AuditMetrics {
            records: catalog.made(IntCounter::new(
                "tether_audit_records_total",
                "Audit records written (--audit-log-path).",
            )),
            dropped: catalog.made(IntCounter::new(
                "tether_audit_records_dropped_total",
                "Audit records lost because the writer could not keep up (its queue was full) or the write failed (a full or failing disk); tunnels never wait for the audit log.",
            )),
        }
    }
}

/// A record's time, written as RFC 3339 in UTC with microseconds (formatted by the
/// writer thread, not the caller).
#[derive(Debug, Clone, Copy)]
pub struct Time(pub SystemTime);

impl Time {
    /// Now.
    pub fn now() -> Self {
        Time(SystemTime::now())
    }
}

impl Serialize for Time {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&format_args!("{}", Rfc3339(self.0)))
    }
}

/// `2026-11-29T14:28:17.123456Z`.
struct Rfc3339(SystemTime);

impl std::fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = k8s_openapi::jiff::Timestamp::try_from(self.0).unwrap_or_default();
        write!(f, "{t:.6}")
    }
}

/// A duration in milliseconds, to the microsecond (the records' `*_ms` fields).
pub fn millis(d: Duration) -> f64 {
    (d.as_micros() as f64) / 1000.0
}

enum Msg<R> {
    Record(R),
    /// Answer once everything before it is written.
    Sync(mpsc::Sender<()>),
}

/// Where records are sent. Clones share the writer; with the audit off, recording is
/// a branch on `None`.
pub struct AuditLog<R> {
    inner: Option<Arc<Inner<R>>>,
}

struct Inner<R> {
    tx: SyncSender<Msg<R>>,
    metrics: AuditMetrics,
    warn: LogLimit,
}

impl<R> Clone for AuditLog<R> {
    fn clone(&self) -> Self {
        AuditLog {
            inner: self.inner.clone(),
        }
    }
}

impl<R> Default for AuditLog<R> {
    fn default() -> Self {
        AuditLog::off()
    }
}

impl<R> AuditLog<R> {
    /// No audit: records are not even built (see [`AuditLog::enabled`]).
    pub fn off() -> Self {
        AuditLog { inner: None }
    }

    /// Is the audit on? Callers build a record only then.
    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }
}

impl<R: Serialize + Send + 'static> AuditLog<R> {
    /// Opens (or creates, mode 0600) the file, or takes stdout, and starts the writer
    /// thread. `name` names the thread.
    pub fn open(
        config: &AuditConfig,
        metrics: AuditMetrics,
        name: &str,
    ) -> Result<Self, AuditError> {
        Self::open_with_queue(config, metrics, name, QUEUE)
    }

    /// [`AuditLog::open`] with a queue of `queue` records (tests).
    pub fn open_with_queue(
        config: &AuditConfig,
        metrics: AuditMetrics,
        name: &str,
        queue: usize,
    ) -> Result<Self, AuditError> {
        let out = match &config.path {
            Some(path) => Out::File(Rotating::open(path, config.max_size, config.max_backups)?),
            None => Out::Stdout,
        };
        let (tx, rx) = mpsc::sync_channel(queue);
        let writer = Writer {
            out,
            metrics: metrics.clone(),
            warn: LogLimit::new(1.0 / 30.0, 1),
        };
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || writer.run(rx))
            .map_err(AuditError::Thread)?;
        Ok(AuditLog {
            inner: Some(Arc::new(Inner {
                tx,
                metrics,
                warn: LogLimit::new(1.0 / 30.0, 1),
            })),
        })
    }

    /// Queues `record` for the writer, or drops and counts it when the queue is full.
    /// Never waits.
    pub fn record(&self, record: R) {
        let Some(inner) = &self.inner else { return };
        match inner.tx.try_send(Msg::Record(record)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                inner.metrics.dropped.inc();
                if let Some(left_out) = inner.warn.allow() {
                    tracing::warn!(
                        dropped_total = inner.metrics.dropped.get(),
                        left_out,
                        "audit records dropped: the audit writer cannot keep up (a slow or stuck disk, or a reader of --audit-log-path that stopped); see tether_audit_records_dropped_total"
                    );
                }
            }
        }
    }

    /// Waits up to `timeout` for what was queued so far to be written (at shutdown).
    /// False when the writer did not get there in time.
    pub fn sync(&self, timeout: Duration) -> bool {
        let Some(inner) = &self.inner else {
            return true;
        };
        let (done, wait) = mpsc::channel();
        if inner.tx.try_send(Msg::Sync(done)).is_err() {
            return false;
        }
        wait.recv_timeout(timeout).is_ok()
    }
}

// === impl Writer ===

enum Out {
    Stdout,
    File(Rotating),
}

struct Writer {
    out: Out,
    metrics: AuditMetrics,
    warn: LogLimit,
}

impl Writer {
    /// Writes what comes until every sender is gone: each record as one line, a batch
    /// (what waited) in one write.
    fn run<R: Serialize>(mut self, rx: Receiver<Msg<R>>) {
        let mut batch = Vec::with_capacity(64 << 10);
        let mut syncs = Vec::new();
        while let Ok(first) = rx.recv() {
            let mut next = Some(first);
            let mut records = 0u64;
            while let Some(msg) = next.take() {
                match msg {
                    Msg::Record(r) => {
                        let start = batch.len();
                        if serde_json::to_writer(&mut batch, &r).is_ok() {
                            batch.push(b'\n');
                            records += 1;
                            let full = batch.len();
                            if matches!(&self.out, Out::File(f) if f.must_rotate(full - start, full))
                            {
                                // Write what came before this line, then rotate.
                                let line = batch.split_off(start);
                                self.write(&mut batch, records - 1);
                                records = 1;
                                batch = line;
                                if let Out::File(f) = &mut self.out {
                                    if let Err(e) = f.rotate() {
                                        self.failed(&e, "rotating");
                                    }
                                }
                            }
                        } else {
                            batch.truncate(start);
                            self.metrics.dropped.inc();
                        }
                    }
                    Msg::Sync(done) => syncs.push(done),
                }
                if batch.len() < 1 << 20 {
                    next = rx.try_recv().ok();
                }
            }
            self.write(&mut batch, records);
            let synced = !syncs.is_empty();
            for done in syncs.drain(..) {
                let _ = done.send(());
            }
            if !synced {
                std::thread::sleep(PAUSE);
            }
        }
    }

    /// Writes the batch of `records` lines; counts them written or dropped.
    fn write(&mut self, batch: &mut Vec<u8>, records: u64) {
        if batch.is_empty() {
            return;
        }
        let written = match &mut self.out {
            Out::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(batch).and_then(|()| out.flush())
            }
            Out::File(f) => f.write(batch),
        };
        match written {
            Ok(()) => self.metrics.records.inc_by(records),
            Err(e) => {
                self.metrics.dropped.inc_by(records);
                self.failed(&e, "writing");
            }
        }
        batch.clear();
        if batch.capacity() > 1 << 20 {
            batch.shrink_to(64 << 10);
        }
    }

    fn failed(&self, e: &std::io::Error, doing: &str) {
        if let Some(left_out) = self.warn.allow() {
            tracing::warn!(error = %e, left_out, "audit log: {doing} failed; records are dropped and counted in tether_audit_records_dropped_total");
        }
    }
}

// === impl Rotating ===

/// A file rotated by size: `path` is renamed `path.1`, `path.1` `path.2`, and so on;
/// the oldest past `max_backups` is removed.
struct Rotating {
    path: PathBuf,
    file: std::fs::File,
    size: u64,
    max_size: u64,
    max_backups: usize,
}

impl Rotating {
    fn open(path: &Path, max_size: u64, max_backups: usize) -> Result<Self, AuditError> {
        let file = open_append(path).map_err(|source| AuditError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        Ok(Rotating {
            path: path.to_path_buf(),
            file,
            size,
            max_size,
            max_backups,
        })
    }

    /// Would the file pass its size with the last `line` bytes of a `pending`-byte
    /// batch? (A file already empty takes the line whatever its size.)
    fn must_rotate(&self, line: usize, pending: usize) -> bool {
        let before = self.size + (pending - line) as u64;
        before > 0 && before + line as u64 > self.max_size
    }

    fn write(&mut self, batch: &[u8]) -> std::io::Result<()> {
        self.file.write_all(batch)?;
        self.size += batch.len() as u64;
        Ok(())
    }

    fn backup(&self, n: usize) -> PathBuf {
        let mut p = self.path.clone().into_os_string();
        p.push(format!(".{n}"));
        p.into()
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        let ignore_missing = |r: std::io::Result<()>| match r {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            r => r,
        };
        ignore_missing(std::fs::remove_file(self.backup(self.max_backups)))?;
        for n in (1..self.max_backups).rev() {
            ignore_missing(std::fs::rename(self.backup(n), self.backup(n + 1)))?;
        }
        std::fs::rename(&self.path, self.backup(1))?;
        self.file = open_append(&self.path)?;
        self.size = 0;
        Ok(())
    }
}

fn open_append(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Rec {
        n: u32,
        pad: String,
    }

    fn metrics() -> AuditMetrics {
        AuditMetrics::new(&Catalog::default())
    }

    #[test]
    fn time_is_rfc3339_utc() {
        let t = SystemTime::UNIX_EPOCH + Duration::new(1_795_962_497, 123_456_789);
        assert_eq!(
            Rfc3339(t).to_string(),
            "2026-11-29T14:28:17.123456Z".to_string()
        );
        assert_eq!(
            Rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(951_782_400)).to_string(),
            "2000-02-29T00:00:00.000000Z"
        );
    }

    #[test]
    fn flags() {
        assert_eq!(AuditConfig::from_flags("", 100, 10).unwrap(), None);
        let c = AuditConfig::from_flags("-", 100, 10).unwrap().unwrap();
        assert_eq!(c.path, None);
        assert_eq!(c.max_size, 100 << 20);
        for (p, s, b) in [("/x", 0, 1), ("/x", 1, 0), ("/var/log/", 1, 1)] {
            assert!(AuditConfig::from_flags(p, s, b).is_err());
        }
    }

    #[test]
    fn writes_lines_and_rotates() {
        let dir = std::env::temp_dir().join(format!("tether-audit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("audit.log");
        let config = AuditConfig {
            path: Some(path.clone()),
            max_size: 1000,
            max_backups: 2,
        };
        let m = metrics();
        let log = AuditLog::open(&config, m.clone(), "audit-test").unwrap();
        for n in 0..100 {
            log.record(Rec {
                n,
                pad: "x".repeat(80),
            });
        }
        assert!(log.sync(Duration::from_secs(30)));
        assert_eq!(m.records.get() + m.dropped.get(), 100);
        assert_eq!(m.dropped.get(), 0);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        files.sort();
        assert_eq!(files, ["audit.log", "audit.log.1", "audit.log.2"]);
        for f in &files {
            let text = std::fs::read_to_string(dir.join(f)).unwrap();
            assert!(text.len() <= 1000, "{f} is {} bytes", text.len());
            for line in text.lines() {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                assert!(v["n"].is_u64());
            }
        }
        // The newest records are in the current file.
        let last = std::fs::read_to_string(&path).unwrap();
        assert!(last.contains("\"n\":99"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_full_disk_drops_and_counts() {
        let config = AuditConfig {
            path: Some("/dev/full".into()),
            max_size: u64::MAX,
            max_backups: 1,
        };
        let m = metrics();
        let log = AuditLog::open(&config, m.clone(), "audit-test").unwrap();
        for n in 0..10 {
            log.record(Rec {
                n,
                pad: String::new(),
            });
        }
        assert!(log.sync(Duration::from_secs(30)));
        assert_eq!(m.dropped.get(), 10);
        assert_eq!(m.records.get(), 0);
    }

    #[test]
    fn off_costs_nothing_and_records_nothing() {
        let log: AuditLog<Rec> = AuditLog::off();
        assert!(!log.enabled());
        log.record(Rec {
            n: 1,
            pad: String::new(),
        });
        assert!(log.sync(Duration::from_secs(1)));
    }
}

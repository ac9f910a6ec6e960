//! Reloadable TLS material: a config rebuilt from its files when they change (polled)
//! or on SIGHUP. New handshakes use the new config; established connections keep the
//! one they were made with, so rotation never drops a tunnel. A reload that fails
//! (half-written files, mismatched pair) keeps the previous config and logs why.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};
use tether_core::error::chain;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use tether_core::tls::TlsError;

type Build<T> = Box<dyn Fn() -> Result<Arc<T>, TlsError> + Send + Sync>;
type Stamp = Option<(SystemTime, u64)>;
/// Runs after every successful (re)load with the watched paths.
pub type OnLoad = Box<dyn Fn(&[PathBuf]) + Send + Sync>;

/// A value built from files, rebuilt when they change.
pub struct Reloadable<T> {
    label: String,
    paths: Vec<PathBuf>,
    build: Build<T>,
    current: RwLock<Arc<T>>,
    stamps: Mutex<Vec<Stamp>>,
    on_load: Option<OnLoad>,
}

fn stamps(paths: &[PathBuf]) -> Vec<Stamp> {
    paths
        .iter()
        .map(|p| {
            std::fs::metadata(p)
                .ok()
                .and_then(|m| Some((m.modified().ok()?, m.len())))
        })
        .collect()
}

impl<T: Send + Sync + 'static> Reloadable<T> {
    /// Builds the first value (errors here are start-up errors). `on_load` runs after
    /// every successful (re)load, e.g. to publish certificate expiry.
    pub fn new(
        label: impl Into<String>,
        paths: Vec<PathBuf>,
        build: impl Fn() -> Result<Arc<T>, TlsError> + Send + Sync + 'static,
        on_load: Option<OnLoad>,
    ) -> Result<Arc<Self>, TlsError> {
        let first = build()?;
        let this = Reloadable {
            label: label.into(),
            stamps: Mutex::new(stamps(&paths)),
            paths,
            build: Box::new(build),
            current: RwLock::new(first),
            on_load,
        };
        if let Some(f) = &this.on_load {
            f(&this.paths);
        }
        Ok(Arc::new(this))
    }

    /// A TLS configuration built from certificate and key files `paths`, rebuilt when
    /// they change, publishing each certificate's expiry to `expiry` on every load.
    pub fn watching_certs(
        label: impl Into<String>,
        paths: Vec<PathBuf>,
        build: impl Fn() -> Result<Arc<T>, TlsError> + Send + Sync + 'static,
        expiry: crate::metrics::CertExpiry,
    ) -> Result<Arc<Self>, TlsError> {
        let label = label.into();
        let source = label.clone();
        let on_load: OnLoad = Box::new(move |p: &[PathBuf]| expiry.observe_files(&source, p));
        Reloadable::new(label, paths, build, Some(on_load))
    }

    /// The current value.
    pub fn get(&self) -> Arc<T> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Something that can be reloaded.
pub trait Reload: Send + Sync {
    /// Rebuilds when a file changed; true when a new value is in use.
    fn reload_if_changed(&self) -> bool;
    /// Rebuilds unconditionally (SIGHUP).
    fn reload(&self) -> bool;
}

impl<T: Send + Sync + 'static> Reload for Reloadable<T> {
    fn reload_if_changed(&self) -> bool {
        let now = stamps(&self.paths);
        if *self.stamps.lock().unwrap_or_else(|e| e.into_inner()) == now {
            return false;
        }
        self.reload()
    }

    fn reload(&self) -> bool {
        let now = stamps(&self.paths);
        match (self.build)() {
            Ok(v) => {
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = v;
                *self.stamps.lock().unwrap_or_else(|e| e.into_inner()) = now;
                if let Some(f) = &self.on_load {
                    f(&self.paths);
                }
                tracing::info!(what = %self.label, "reloaded TLS material; new handshakes use it");
                true
            }
            Err(e) => {
                // Remember the stamps so a broken file is reported once, not every poll.
                *self.stamps.lock().unwrap_or_else(|e| e.into_inner()) = now;
                tracing::error!(what = %self.label, error = %chain(&e), "TLS reload failed; still using the previous certificates");
                false
            }
        }
    }
}

/// Polls every `interval` and reloads everything on SIGHUP, until `hard_stop`.
pub fn spawn_watcher(
    items: Vec<Arc<dyn Reload>>,
    interval: Duration,
    hard_stop: CancellationToken,
) {
    tokio::spawn(
        async move {
            let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(error = %chain(&e), "cannot watch SIGHUP; reloading on file changes only");
                    None
                }
            };
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let forced = tokio::select! {
                    _ = hard_stop.cancelled() => return,
                    _ = tick.tick() => false,
                    Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => true,
                };
                if forced {
                    tracing::info!("SIGHUP: reloading certificates");
                }
                for item in &items {
                    if forced {
                        item.reload();
                    } else {
                        item.reload_if_changed();
                    }
                }
            }
        }
        .instrument(tracing::info_span!("cert_reload")),
    );
}

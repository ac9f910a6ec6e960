//! Tether's agent: `servers` keeps one stream up to every proxy server (backoff,
//! jitter, server counting), `link` establishes and serves one stream (through the
//! egress `proxy` when one is configured), and the `dialer` opens the target
//! connection for each DIAL_REQ and pumps its bytes. Never depends on the server.

pub mod audit;
mod config;
pub mod dialer;
pub mod lease_count;
mod link;
pub mod metrics;
pub mod policy;
pub mod proxy;
mod servers;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::{AgentConfig, AgentTls, CountSource, LeaseCount, Transport};
pub use link::LinkError;

use crate::metrics::Metrics;

/// How long before the end of a drain of `drain_timeout` its connections begin to close
/// at their quiet moments ([`Agent::close_when_quiet`]): 5 s, or half the drain when
/// that is shorter. A stream quiet then (a `logs -f` between lines) ends up to that
/// much early; it would have been cut at the end anyway.
pub fn quiet_close_window(drain_timeout: std::time::Duration) -> std::time::Duration {
    (drain_timeout / 2).min(std::time::Duration::from_secs(5))
}

/// A running agent's shared state.
#[derive(Clone)]
pub struct Agent {
    config: AgentConfig,
    tls: Arc<tether_ops::reload::Reloadable<rustls::ClientConfig>>,
    /// TLS to an https:// egress proxy.
    proxy_tls: Option<Arc<tether_ops::reload::Reloadable<rustls::ClientConfig>>>,
    metrics: Metrics,
    /// What servers may have this agent dial.
    policy: Arc<policy::DialPolicy>,
    /// The drain the sessions share: a watch per open connection, the quiet close.
    drain: dialer::AgentDrain,
    streams: Arc<AtomicI64>,
    /// Of those, the streams whose server said DRAIN (not counted for readiness).
    leaving: Arc<AtomicI64>,
    header_count: Arc<AtomicI64>,
    /// The HTTP/2 keepalive interval new streams use, in milliseconds: `--keepalive-time`,
    /// doubled each time a server closes a stream for pinging too often.
    keepalive_ms: Arc<AtomicU64>,
    /// The place in `--transports` of the transport the last stream opened over: the
    /// next stream tries it first.
    working: Arc<std::sync::atomic::AtomicUsize>,
    /// The audit record of each dial and connection (`--audit-log-path`).
    audit: audit::Audit,
}

impl Agent {
    /// A new agent (nothing runs until [`Agent::run`]); fails on unusable TLS files.
    pub fn new(config: AgentConfig) -> Result<Self, tether_core::tls::TlsError> {
        let metrics = Metrics::new();
        let in_force = if config.policy.any { "any" } else { "node" };
        metrics.dial_policy.with_label_values(&[in_force]).set(1);
        let expiry = metrics.cert_expiry.clone();
        let t = config.tls.clone();
        let mut paths = vec![t.ca.clone()];
        if let Some((c, k)) = &t.identity {
            paths.extend([c.clone(), k.clone()]);
        }
        let tls = tether_ops::reload::Reloadable::watching_certs(
            "agent client TLS",
            paths,
            move || {
                let alpn: Vec<&[u8]> = t.alpn.iter().map(Vec::as_slice).collect();
                tether_core::tls::client_config(
                    &t.ca,
                    t.identity.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
                    &alpn,
                )
            },
            expiry,
        )?;
        let proxy_tls = config.egress.tls(metrics.cert_expiry.clone())?;
        Ok(Agent {
            tls,
            proxy_tls,
            metrics,
            policy: policy::DialPolicy::new(config.policy.clone()),
            drain: dialer::AgentDrain::default(),
            streams: Arc::new(AtomicI64::new(0)),
            leaving: Arc::new(AtomicI64::new(0)),
            header_count: Arc::new(AtomicI64::new(1)),
            keepalive_ms: Arc::new(AtomicU64::new(
                config.keepalive.as_millis().try_into().unwrap_or(u64::MAX),
            )),
            working: Arc::new(std::sync::atomic::AtomicUsize::new(0)),
            config,
            audit: audit::Audit::off(),
        })
    }

    /// Waits (up to 2 s) for the audit records queued so far to be written.
    pub async fn sync_audit(&self) {
        let audit = self.audit.clone();
        let synced =
            tokio::task::spawn_blocking(move || audit.sync(std::time::Duration::from_secs(2)));
        if !matches!(synced.await, Ok(true)) {
            tracing::warn!("the audit log's last records were not written within 2s of the stop");
        }
    }

    /// The same agent, recording each dial and connection in `audit` (open it with
    /// `metrics().audit` as its counters).
    pub fn with_audit(mut self, audit: audit::Audit) -> Self {
        self.audit = audit;
        self
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The dial policy.
    pub fn policy(&self) -> &Arc<policy::DialPolicy> {
        &self.policy
    }

    /// Begins the drain's end: each open connection closes at its first quiet moment
    /// (the target sent last, then nothing moved for [`dialer::QUIET`]), so that a
    /// client's keep-alive connection (kube-apiserver's to a webhook, an aggregated
    /// API, a kubelet) ends between requests and its next request opens a connection
    /// through another agent, instead of failing under the hard stop. The stop calls it
    /// [`quiet_close_window`] before `--drain-timeout` ends.
    pub fn close_when_quiet(&self) {
        self.drain.closing.cancel();
    }

    /// Open target connections.
    pub fn open_connections(&self) -> i64 {
        self.drain.work.open() as i64
    }

    /// Streams to servers held now.
    pub fn server_streams(&self) -> i64 {
        self.streams.load(Ordering::Relaxed)
    }

    /// Serves `/healthz`, `/readyz` (see [`readiness`]) and `/metrics`.
    pub fn serve_health(&self, listener: TcpListener, hard_stop: CancellationToken) {
        let (streams, leaving) = (self.streams.clone(), self.leaving.clone());
        let known = self.metrics.known_server_count.clone();
        let every = self.config.ready_with_every_server;
        let ready: tether_ops::health::ReadyCheck = Arc::new(move || {
            let counted = streams.load(Ordering::Relaxed) - leaving.load(Ordering::Relaxed);
            readiness(counted, known.get(), every)
        });
        tether_ops::health::spawn(
            "health",
            listener,
            tether_ops::health::health_router(
                self.metrics.registry().clone(),
                ready,
                StatusCode::SERVICE_UNAVAILABLE,
            ),
            hard_stop,
        );
    }

    /// Serves `/metrics` on the admin port.
    pub fn serve_admin(&self, listener: TcpListener, hard_stop: CancellationToken) {
        tether_ops::health::spawn(
            "admin",
            listener,
            tether_ops::health::admin_router(
                self.metrics.registry().clone(),
                self.config.profiling,
            ),
            hard_stop,
        );
    }
}

/// `/readyz`: ready with a stream up (`streams`), or with `every`, with a stream up to
/// each of the `known` servers (0: unknown, so one will do).
pub fn readiness(streams: i64, known: i64, every: bool) -> Result<String, String> {
    let want = if every { known.max(1) } else { 1 };
    if streams >= want {
        Ok(format!("{streams} proxy server stream(s) connected"))
    } else if streams <= 0 {
        Err("not connected to any proxy server".into())
    } else {
        Err(format!(
            "connected to {streams} of {want} proxy servers (--ready-when=every-server)"
        ))
    }
}

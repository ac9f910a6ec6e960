//! Tether's agent: the link dials out to the proxy server over mutual TLS, keeps its
//! stream up with exponential backoff and jitter, and hands each DIAL_REQ to the dialer,
//! which opens the target connection and pumps its bytes. Never depends on the server.

pub mod dialer;
pub mod lease_count;
pub mod metrics;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::StatusCode;
use rand::Rng;
use tether_core::transport::{grpc_channel_tls, ChannelSettings};
use tether_proto::agent_service_client::AgentServiceClient;
use tether_proto::header;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::metadata::MetadataValue;
use tracing::Instrument;

use crate::dialer::Session;
use crate::lease_count::LeaseCounter;
use crate::metrics::Metrics;

/// Everything the agent needs, already validated.
#[derive(Clone)]
pub struct AgentConfig {
    /// Proxy server addresses (host, port); the host is also the TLS server name. One
    /// load-balancer address or every server's own address.
    pub servers: Vec<(String, u16)>,
    /// Keep dialling even when the known server count is reached (new servers).
    pub sync_forever: bool,
    /// Count servers from their Leases (`--count-server-leases`).
    pub lease_count: Option<LeaseCount>,
    /// How the target number of servers is chosen.
    pub count_source: CountSource,
    /// TLS to the server (CA and optional client certificate), reloaded on change.
    pub tls: AgentTls,
    /// How often certificate files are checked for changes (SIGHUP reloads at once).
    pub cert_reload_interval: Duration,
    /// `agentid`.
    pub agent_id: String,
    /// `agentidentifiers` query string (validated).
    pub identifiers: String,
    /// Bearer token file, re-read on every connect.
    pub token_path: Option<PathBuf>,
    /// First reconnect delay.
    pub sync_interval: Duration,
    /// Largest reconnect delay.
    pub sync_interval_cap: Duration,
    /// HTTP/2 keepalive to the server.
    pub keepalive: Duration,
    /// Target dial timeout.
    pub dial_timeout: Duration,
    /// Capacity of the stream's outbound packet channel (`--xfr-channel-size`).
    pub channel_size: usize,
    /// Offer per-connection credit flow control to the server (`tether-flow-window`).
    pub flow_control: bool,
    /// With an upstream server: how long one connection's full queue may hold up the
    /// stream before that connection is closed.
    pub stall_timeout: Duration,
    /// Serve pprof profiles on the admin port (`--enable-profiling`).
    pub profiling: bool,
}

/// How long opening one stream (TCP, TLS, the server's response headers) may take.
const ESTABLISH_TIMEOUT: Duration = Duration::from_secs(20);

/// Where server Leases are counted.
#[derive(Debug, Clone)]
pub struct LeaseCount {
    /// Kubeconfig (`None` = in-cluster).
    pub kubeconfig: Option<PathBuf>,
    /// `--lease-namespace`.
    pub namespace: String,
    /// `--lease-label-selector`.
    pub selector: String,
}

/// `--server-count-source`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CountSource {
    /// Leases when counting leases, else the servers' `servercount` header.
    #[default]
    Default,
    /// The larger of the two.
    Max,
}

/// The agent's TLS files.
#[derive(Debug, Clone)]
pub struct AgentTls {
    /// CA bundle that signs the server certificate.
    pub ca: PathBuf,
    /// Client certificate and key, if the server wants one.
    pub identity: Option<(PathBuf, PathBuf)>,
    /// ALPN protocols offered.
    pub alpn: Vec<Vec<u8>>,
}

impl std::fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConfig")
            .field("servers", &self.servers)
            .field("agent_id", &self.agent_id)
            .finish_non_exhaustive()
    }
}

/// Why one stream to the server ended.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// TCP/TLS/HTTP2 connection failed.
    #[error("cannot connect to proxy server: {0}")]
    Connect(#[from] tonic::transport::Error),
    /// The server refused or broke the stream.
    #[error("proxy server stream failed: {}", .0.message())]
    Stream(#[from] tonic::Status),
    /// The token file could not be read.
    #[error("cannot read service account token {path}: {source}")]
    Token {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The server's response headers were not as the protocol requires.
    #[error("proxy server response: {0}")]
    Protocol(String),
    /// Connecting and reading the response headers took too long.
    #[error("proxy server did not answer within {0:?}")]
    Timeout(Duration),
}

/// A running agent's shared state.
#[derive(Clone)]
pub struct Agent {
    config: AgentConfig,
    tls: Arc<tether_core::reload::Reloadable<rustls::ClientConfig>>,
    metrics: Metrics,
    open_conns: Arc<AtomicI64>,
    streams: Arc<AtomicI64>,
    header_count: Arc<AtomicI64>,
}

impl Agent {
    /// A new agent (nothing runs until [`Agent::run`]); fails on unusable TLS files.
    pub fn new(config: AgentConfig) -> Result<Self, tether_core::tls::TlsError> {
        let metrics = Metrics::new();
        let expiry = tether_core::metrics::CertExpiry::new(&metrics.registry);
        let t = config.tls.clone();
        let mut paths = vec![t.ca.clone()];
        if let Some((c, k)) = &t.identity {
            paths.extend([c.clone(), k.clone()]);
        }
        let tls = tether_core::reload::Reloadable::new(
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
            Some(Box::new(move |p: &[PathBuf]| expiry.observe_files(p))),
        )?;
        Ok(Agent {
            config,
            tls,
            metrics,
            open_conns: Arc::new(AtomicI64::new(0)),
            streams: Arc::new(AtomicI64::new(0)),
            header_count: Arc::new(AtomicI64::new(1)),
        })
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Open target connections.
    pub fn open_connections(&self) -> i64 {
        self.open_conns.load(Ordering::Relaxed)
    }

    /// Serves `/healthz`, `/readyz` (ready iff a stream is up) and `/metrics`.
    pub fn serve_health(&self, listener: TcpListener, shutdown: CancellationToken) {
        let streams = self.streams.clone();
        let ready: tether_core::health::ReadyCheck = Arc::new(move || {
            let n = streams.load(Ordering::Relaxed);
            if n > 0 {
                Ok(format!("{n} proxy server stream(s) connected"))
            } else {
                Err("not connected to any proxy server".into())
            }
        });
        tether_core::health::spawn(
            "health",
            listener,
            tether_core::health::health_router(
                self.metrics.registry.clone(),
                ready,
                StatusCode::SERVICE_UNAVAILABLE,
            ),
            shutdown,
        );
    }

    /// Serves `/metrics` on the admin port.
    pub fn serve_admin(&self, listener: TcpListener, shutdown: CancellationToken) {
        tether_core::health::spawn(
            "admin",
            listener,
            tether_core::health::admin_router(self.metrics.registry.clone(), self.config.profiling),
            shutdown,
        );
    }

    /// Keeps one stream to every server up until `shutdown`: dials (round-robin over the
    /// configured addresses) until it holds as many distinct server ids as there are
    /// servers, closing duplicates. When `drain` is cancelled every stream sends DRAIN,
    /// new dials are refused, and `run` returns once the connections have finished.
    pub async fn run(&self, drain: CancellationToken, shutdown: CancellationToken) {
        let open = self.open_conns.clone();
        tether_core::memory::spawn_trimmer(move || open.load(Ordering::Relaxed), shutdown.clone());
        tether_core::reload::spawn_watcher(
            vec![self.tls.clone() as Arc<dyn tether_core::reload::Reload>],
            self.config.cert_reload_interval,
            shutdown.clone(),
        );
        let sessions: Arc<Mutex<HashMap<String, CancellationToken>>> = Arc::default();
        let ended = Arc::new(tokio::sync::Notify::new());
        let leases = match &self.config.lease_count {
            Some(lc) => match tether_core::kubeclient::client(lc.kubeconfig.as_deref()).await {
                Ok(c) => Some(LeaseCounter::spawn(
                    c,
                    lc,
                    self.metrics.lease_metrics(),
                    shutdown.clone(),
                )),
                Err(e) => {
                    tracing::error!(error = %e, "cannot count server leases; using the servers' servercount");
                    None
                }
            },
            None => None,
        };
        let mut delay = self.config.sync_interval;
        let mut next = 0usize;
        loop {
            if shutdown.is_cancelled() || (drain.is_cancelled() && self.open_connections() == 0) {
                break;
            }
            let have = sessions.lock().unwrap_or_else(|e| e.into_inner()).len() as i64;
            let target = self.target_count(leases.as_ref());
            self.metrics.known_server_count.set(target);
            let want_more = !drain.is_cancelled() && (have < target || self.config.sync_forever);
            let mut backoff = false;
            if want_more {
                let (host, port) = &self.config.servers[next % self.config.servers.len()];
                next = next.wrapping_add(1);
                let established =
                    tokio::time::timeout(ESTABLISH_TIMEOUT, self.establish(host, *port))
                        .await
                        .unwrap_or(Err(LinkError::Timeout(ESTABLISH_TIMEOUT)));
                match established {
                    Ok(est) => {
                        let server_id = est.server_id.clone();
                        let mut set = sessions.lock().unwrap_or_else(|e| e.into_inner());
                        if set.contains_key(&server_id) {
                            tracing::info!(%server_id, %host, have, target, "reached a server this agent is already connected to; closing the duplicate stream and retrying");
                            backoff = true;
                        } else {
                            let stop = shutdown.child_token();
                            set.insert(server_id.clone(), stop.clone());
                            drop(set);
                            delay = self.config.sync_interval;
                            let (this, sessions, ended, drain) =
                                (self.clone(), sessions.clone(), ended.clone(), drain.clone());
                            tokio::spawn(async move {
                                if let Err(e) = this.serve(est, &drain, &stop).await {
                                    tracing::warn!(%server_id, error = %format!("{e:#}"), "proxy server stream down; reconnecting");
                                }
                                sessions
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .remove(&server_id);
                                ended.notify_one();
                            });
                            continue;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(%host, port, error = %format!("{e:#}"), "proxy server stream down; reconnecting");
                        backoff = true;
                    }
                }
            }
            let wait = if backoff {
                let jitter = 1.0 + rand::rng().random_range(0.0..0.1);
                let w = delay.mul_f64(jitter);
                delay = delay.mul_f64(1.5).min(self.config.sync_interval_cap);
                w
            } else {
                self.config.sync_interval
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = ended.notified() => {}
                _ = shutdown.cancelled() => break,
                _ = wait_idle(&self.open_conns), if drain.is_cancelled() => {}
            }
        }
        for stop in sessions.lock().unwrap_or_else(|e| e.into_inner()).values() {
            stop.cancel();
        }
    }

    fn target_count(&self, leases: Option<&LeaseCounter>) -> i64 {
        let header = self.header_count.load(Ordering::Relaxed).max(1);
        let Some(leases) = leases else { return header };
        let counted = leases.count();
        match (self.config.count_source, counted) {
            (_, None) => header,
            (CountSource::Default, Some(n)) => n.max(1),
            (CountSource::Max, Some(n)) => n.max(header),
        }
    }

    /// Opens a stream to the server at `host:port` and reads its id and count.
    async fn establish(&self, host: &str, port: u16) -> Result<Established, LinkError> {
        let cfg = &self.config;
        let settings = ChannelSettings {
            keepalive: Some(cfg.keepalive),
            keepalive_timeout: cfg.keepalive.min(Duration::from_secs(20)),
            ..Default::default()
        };
        let channel = grpc_channel_tls(host, port, self.tls.get(), &settings).await?;
        let (out_tx, out_rx) = mpsc::channel(cfg.channel_size);
        let mut request = tonic::Request::new(ReceiverStream::new(out_rx));
        let md = request.metadata_mut();
        md.insert(
            header::AGENT_ID,
            MetadataValue::try_from(cfg.agent_id.as_str())
                .map_err(|_| LinkError::Protocol("agent id is not valid ASCII".into()))?,
        );
        if !cfg.identifiers.is_empty() {
            md.insert(
                header::AGENT_IDENTIFIERS,
                MetadataValue::try_from(cfg.identifiers.as_str()).map_err(|_| {
                    LinkError::Protocol("agent identifiers are not valid ASCII".into())
                })?,
            );
        }
        if let Some(path) = &cfg.token_path {
            let token = std::fs::read_to_string(path).map_err(|source| LinkError::Token {
                path: path.clone(),
                source,
            })?;
            let value =
                MetadataValue::try_from(format!("Bearer {}", token.trim())).map_err(|_| {
                    LinkError::Protocol(format!("token in {} is not valid ASCII", path.display()))
                })?;
            md.insert(header::AUTHORIZATION, value);
        }
        if cfg.flow_control {
            md.insert(
                header::FLOW_WINDOW,
                MetadataValue::from(tether_core::flow::DEFAULT_WINDOW),
            );
        }
        let mut client = AgentServiceClient::new(channel)
            .max_decoding_message_size(tether_proto::MAX_MESSAGE)
            .max_encoding_message_size(tether_proto::MAX_MESSAGE);
        let response = client.connect(request).await?;
        let server_id = single_header(response.metadata(), header::SERVER_ID)?;
        let server_count: i64 = single_header(response.metadata(), header::SERVER_COUNT)?
            .parse()
            .map_err(|_| LinkError::Protocol("servercount is not a number".into()))?;
        self.header_count.store(server_count, Ordering::Relaxed);
        // Credit flow control only when we offered it and the server answered.
        let peer_window = cfg
            .flow_control
            .then(|| {
                tether_core::flow::parse_window(
                    response
                        .metadata()
                        .get(header::FLOW_WINDOW)
                        .and_then(|v| v.to_str().ok()),
                )
            })
            .flatten();
        Ok(Established {
            server_id,
            server_count,
            peer_window,
            out_tx,
            inbound: response.into_inner(),
        })
    }

    /// Serves one established stream until it fails (Err), the agent is drained and
    /// idle, or `stop` (Ok).
    async fn serve(
        &self,
        est: Established,
        drain: &CancellationToken,
        stop: &CancellationToken,
    ) -> Result<(), LinkError> {
        let cfg = &self.config;
        let Established {
            server_id,
            server_count,
            peer_window,
            out_tx,
            mut inbound,
        } = est;
        let session = Session::new(
            out_tx,
            cfg.dial_timeout,
            peer_window,
            cfg.stall_timeout,
            self.metrics.clone(),
            self.open_conns.clone(),
        );
        let _close_on_exit = session.closed.clone().drop_guard();
        self.metrics.open_server_connections.inc();
        self.streams.fetch_add(1, Ordering::Relaxed);
        let _count = Decrement(
            self.streams.clone(),
            self.metrics.open_server_connections.clone(),
        );
        tracing::info!(%server_id, server_count, flow_control = peer_window.is_some(), "connected to proxy server");

        let span = tracing::info_span!("server_stream", %server_id);
        async {
            let mut draining = false;
            loop {
                let packet = tokio::select! {
                    p = inbound.message() => p,
                    _ = drain.cancelled(), if !draining => {
                        draining = true;
                        tracing::info!("draining: DRAIN sent; dials the server still sends are served");
                        session.drain().await;
                        continue;
                    }
                    _ = wait_idle(&self.open_conns), if draining => {
                        tracing::info!("drained: no connections left");
                        return Ok(());
                    }
                    _ = stop.cancelled() => return Ok(()),
                };
                match packet {
                    Ok(Some(p)) => session.handle(p).await,
                    Ok(None) => return Err(LinkError::Protocol("server closed the stream".into())),
                    Err(status) => {
                        self.metrics
                            .stream_errors
                            .with_label_values(&[
                                "to_agent",
                                tether_core::metrics::grpc_code_name(status.code()),
                                tether_core::metrics::NO_PACKET,
                            ])
                            .inc();
                        self.metrics
                            .server_connection_failures
                            .with_label_values(&["from_server"])
                            .inc();
                        return Err(status.into());
                    }
                }
            }
        }
        .instrument(span)
        .await
    }
}

/// A stream whose response headers have arrived.
struct Established {
    server_id: String,
    server_count: i64,
    /// The server's per-connection window when it agreed to credit flow control.
    peer_window: Option<u32>,
    out_tx: mpsc::Sender<tether_proto::Packet>,
    inbound: tonic::Streaming<tether_proto::Packet>,
}

struct Decrement(Arc<AtomicI64>, prometheus::IntGauge);
impl Drop for Decrement {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        self.1.dec();
    }
}

async fn wait_idle(open: &AtomicI64) {
    while open.load(Ordering::Relaxed) > 0 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn single_header(md: &tonic::metadata::MetadataMap, key: &str) -> Result<String, LinkError> {
    let values: Vec<_> = md.get_all(key).iter().collect();
    match values.as_slice() {
        [one] => one
            .to_str()
            .map(str::to_string)
            .map_err(|_| LinkError::Protocol(format!("{key} is not valid ASCII"))),
        [] => Err(LinkError::Protocol(format!("missing {key} header"))),
        _ => Err(LinkError::Protocol(format!("expected one {key} header"))),
    }
}

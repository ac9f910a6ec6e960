//! Tether's proxy server: frontends (gRPC ProxyService and HTTP CONNECT, over a Unix
//! socket or mutual-TLS TCP) -> the server core (backend selection, dial and connection
//! bookkeeping) -> agent links (one task per agent connection), plus health and admin HTTP.
//!
//! [`Server::bind`] binds every listener (so bad addresses and certificates fail at
//! start-up); [`BoundServer::run`] serves until the shutdown token is cancelled.

pub mod agent_link;
pub mod auth;
pub mod frontend;
pub mod identity;
pub mod lease;
pub mod metrics;
pub mod nodes;
pub mod router;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use axum::http::StatusCode;
use tether_core::tls::{self, TlsError, TlsFiles};
use tether_core::transport::{self, ServerConfigSource};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use frontend::Mode;
pub use router::{parse_strategies, Router, RouterConfig, Strategy};

/// Agent streams per agent ID and per verified identity, by default: an agent holds
/// one per server, and a reconnect briefly overlaps the old one.
pub const DEFAULT_MAX_AGENT_STREAMS: usize = 8;

/// Where a frontend listens.
#[derive(Debug, Clone)]
pub enum Listen {
    /// A Unix socket; an existing socket file is replaced when `delete_existing`.
    Uds {
        /// Socket path.
        path: PathBuf,
        /// Remove a stale socket file first.
        delete_existing: bool,
        /// Access to the socket: mode and group (None: as created, owned by us).
        access: transport::SocketAccess,
    },
    /// TCP with mandatory mutual TLS.
    Tcp {
        /// Bind address.
        addr: SocketAddr,
        /// Serving certificate, key and the CA client certificates must chain to.
        tls: TlsFiles,
        /// Which of the certificates that CA signed may open tunnels.
        clients: FrontendClients,
    },
}

/// Who may use a TCP frontend beyond chaining to its CA: an agent's certificate must
/// never open tunnels, so either the frontend's CA signs no agent (`tether certs init`
/// gives it a CA of its own) or the client must carry one of `names`.
#[derive(Debug, Clone, Default)]
pub struct FrontendClients {
    /// `--frontend-client-names`: the client certificate's CN or a DNS SAN must be one
    /// of these (empty: any certificate the CA signed).
    pub names: Vec<String>,
    /// `--unsafe-shared-frontend-ca`: start even though the agents' CA also signs
    /// frontend clients and no name is required.
    pub allow_shared_ca: bool,
}

impl FrontendClients {
    /// Is `cert` (the client's leaf certificate) allowed? `Err` says why not.
    pub fn admit(&self, cert: Option<&rustls_pki_types::CertificateDer<'_>>) -> Result<(), String> {
        if self.names.is_empty() {
            return Ok(());
        }
        let cert = cert.ok_or("no client certificate")?;
        let info = tether_certs::inspect::parse_der(cert)?;
        let names: Vec<&String> = info
            .common_name
            .iter()
            .chain(info.dns_sans.iter())
            .collect();
        if names.iter().any(|n| self.names.iter().any(|a| a == *n)) {
            Ok(())
        } else {
            Err(format!(
                "client certificate {:?} is not one of --frontend-client-names",
                info.subject
            ))
        }
    }
}

/// One frontend.
#[derive(Debug, Clone)]
pub struct FrontendConfig {
    /// Protocol.
    pub mode: Mode,
    /// Listener.
    pub listen: Listen,
}

/// Everything the server needs, already validated.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// This server's id (sent to agents as `serverid`).
    pub server_id: String,
    /// How many servers agents should connect to (`servercount`).
    pub server_count: u32,
    /// Frontends (upstream runs one; `tether local` runs two).
    pub frontends: Vec<FrontendConfig>,
    /// Agent listener address.
    pub agent_addr: SocketAddr,
    /// Agent listener TLS; `ca` set = agents must present a client certificate.
    pub agent_tls: TlsFiles,
    /// Caps on the TCP listeners' connections and handshakes (each listener its own).
    pub admission: tether_core::admission::AdmissionLimits,
    /// HTTP/2 keepalive on agent connections.
    pub agent_keepalive: Duration,
    /// HTTP/2 keepalive on frontend connections.
    pub frontend_keepalive: Duration,
    /// An agent connection whose peer has been silent this long is closed, whatever
    /// `agent_keepalive` is (TCP keepalive and user timeout); `None` = kernel defaults.
    pub agent_dead_link: Option<Duration>,
    /// Health endpoint (`/healthz`, `/readyz`, `/metrics`).
    pub health_addr: Option<SocketAddr>,
    /// Admin endpoint (`/metrics`).
    pub admin_addr: Option<SocketAddr>,
    /// Backend selection and dial timeout.
    pub router: RouterConfig,
    /// Packets queued towards each agent stream (`--xfr-channel-size`).
    pub channel_size: usize,
    /// How long established connections may finish after shutdown begins.
    pub graceful_shutdown_timeout: Duration,
    /// Agent authentication by service-account token (TokenReview).
    pub agent_auth: Option<auth::TokenAuthConfig>,
    /// Refuse agents whose agentid/identifiers are not in their client certificate.
    pub require_agent_identity_match: bool,
    /// How often certificate files are checked for changes (SIGHUP reloads at once).
    pub cert_reload_interval: Duration,
    /// Publish a Lease and tell agents the number of live servers.
    pub lease: Option<lease::LeaseConfig>,
    /// Watch Nodes: their addresses and pod networks verify token-authenticated
    /// agents' identifiers, and (`route_pod_ips`) `destCIDR` routes pod IPs by node.
    pub nodes: Option<nodes::WatchConfig>,
    /// Serve pprof profiles on the admin port (`--enable-profiling`).
    pub profiling: bool,
    /// Who may read `/agents` on the admin port.
    pub agents_access: AgentsAccess,
}

/// The audience a token must be bound to for `/agents` off loopback (a projected
/// ServiceAccount token with this audience): kube-apiserver refuses such a token, so
/// one read off the admin port's plain HTTP cannot be replayed against the cluster.
pub const AGENTS_AUDIENCE: &str = "tether-admin";

/// Who may read `/agents` (agent ids, node names, addresses and verified identities)
/// on the admin port.
#[derive(Debug, Clone, PartialEq)]
pub enum AgentsAccess {
    /// Anyone who reaches the port: for an admin port bound to loopback.
    Anyone,
    /// A bearer token bound to [`AGENTS_AUDIENCE`] that a TokenReview accepts and a
    /// SubjectAccessReview allowing `get` on the non-resource URL `/agents`, asked of
    /// the cluster in `kubeconfig` (or in-cluster). Without a usable client, nobody.
    Authorized {
        /// `--kubeconfig`, or `None` for the in-cluster configuration.
        kubeconfig: Option<std::path::PathBuf>,
    },
}

impl AgentsAccess {
    /// `Anyone` on a loopback bind, else `Authorized`.
    pub fn for_bind(admin: Option<SocketAddr>, kubeconfig: Option<std::path::PathBuf>) -> Self {
        match admin {
            Some(a) if !a.ip().is_loopback() => AgentsAccess::Authorized { kubeconfig },
            _ => AgentsAccess::Anyone,
        }
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A listener could not be bound.
    #[error("cannot listen on {what} {addr}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// Its address or path.
        addr: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// TLS material is unusable.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The Kubernetes client (agent authentication, leases, Nodes) could not be set up.
    #[error(transparent)]
    Kube(#[from] tether_ops::kubeclient::KubeSetupError),
    /// The TCP frontend would let agents' certificates open tunnels.
    #[error("--server-ca-cert and --cluster-ca-cert share the CA {subject:?}, so every agent certificate could open frontend tunnels: give the frontend a CA of its own (tether certs init does), or require the apiserver's client certificate name with --frontend-client-names")]
    SharedCa {
        /// The shared CA's subject.
        subject: String,
    },
    /// A CA file could not be read for the comparison above.
    #[error("cannot read CA file {path}: {reason}")]
    CaFile {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
}

/// Refuses a TCP frontend whose CA also signs agents, unless client names are required
/// or the operator opted out.
fn check_frontend_trust(config: &ServerConfig) -> Result<(), StartError> {
    let tcp_without_names = config
        .frontends
        .iter()
        .any(|fe| matches!(&fe.listen, Listen::Tcp { clients, .. } if clients.names.is_empty()));
    let Some(agent_ca) = &config.agent_tls.ca else {
        if tcp_without_names {
            tracing::warn!("the TCP frontend accepts any client certificate --server-ca-cert signed: if that CA also signs kubelet or other client certificates, set --frontend-client-names to the apiserver's");
        }
        return Ok(());
    };
    let read = |p: &std::path::Path| -> Result<Vec<tether_certs::inspect::CertInfo>, StartError> {
        let pem = std::fs::read_to_string(p).map_err(|e| StartError::CaFile {
            path: p.display().to_string(),
            reason: e.to_string(),
        })?;
        tether_certs::inspect::parse_pem(&pem).map_err(|reason| StartError::CaFile {
            path: p.display().to_string(),
            reason,
        })
    };
    for fe in &config.frontends {
        let Listen::Tcp { tls, clients, .. } = &fe.listen else {
            continue;
        };
        let Some(frontend_ca) = &tls.ca else { continue };
        if !clients.names.is_empty() {
            continue;
        }
        let agents = read(agent_ca)?;
        // The same certificate, the same key under another certificate, or the agents'
        // CA issued by the frontend's.
        let shared = read(frontend_ca)?.into_iter().find(|c| {
            agents
                .iter()
                .any(|a| a.der == c.der || a.public_key_der == c.public_key_der || a.signed_by(c))
        });
        if let Some(ca) = shared {
            if clients.allow_shared_ca {
                tracing::warn!(ca = %ca.subject, "UNSAFE: the frontend trusts the agents' CA (--unsafe-shared-frontend-ca): a stolen agent certificate can open tunnels to any address");
            } else {
                return Err(StartError::SharedCa {
                    subject: ca.subject,
                });
            }
        }
    }
    Ok(())
}

/// What was bound, for logs and tests.
#[derive(Debug, Clone)]
pub struct BoundAddrs {
    /// Agent listener.
    pub agent: SocketAddr,
    /// Frontends, in configuration order: a TCP address or a socket path.
    pub frontends: Vec<String>,
    /// Health endpoint.
    pub health: Option<SocketAddr>,
    /// Admin endpoint.
    pub admin: Option<SocketAddr>,
}

enum FrontendListener {
    Uds(UnixListener, PathBuf),
    Tls(TcpListener, ServerConfigSource, FrontendClients),
}

/// The server, bound and ready to run.
pub struct BoundServer {
    agents_delegation: Option<tether_ops::authz::Delegation>,
    lease_client: Option<kube::Client>,
    nodes_client: Option<kube::Client>,
    reloadables: Vec<Arc<dyn tether_ops::reload::Reload>>,
    authenticator: Option<Arc<auth::TokenAuthenticator>>,
    config: ServerConfig,
    router: Arc<Router>,
    agent_listener: TcpListener,
    agent_tls: ServerConfigSource,
    frontends: Vec<(Mode, FrontendListener)>,
    health: Option<TcpListener>,
    admin: Option<TcpListener>,
    addrs: BoundAddrs,
}

/// Entry point.
pub struct Server;

fn bind_tcp(what: &'static str, addr: SocketAddr) -> Result<TcpListener, StartError> {
    transport::bind_tcp(addr).map_err(|source| StartError::Bind {
        what,
        addr: addr.to_string(),
        source,
    })
}

/// The reloadable TLS configurations of the listeners, watched together.
struct TlsSources {
    expiry: tether_ops::metrics::CertExpiry,
    reloadables: Vec<Arc<dyn tether_ops::reload::Reload>>,
}

impl TlsSources {
    /// Loads `files` now (failing start-up when they are unusable) and again whenever
    /// they change.
    fn source(
        &mut self,
        label: &str,
        files: &TlsFiles,
        alpn: &'static [&'static [u8]],
    ) -> Result<ServerConfigSource, StartError> {
        let mut paths = vec![files.cert.clone(), files.key.clone()];
        paths.extend(files.ca.clone());
        let build_files = files.clone();
        let r = tether_ops::reload::Reloadable::watching_certs(
            label,
            paths,
            move || tls::server_config(&build_files, alpn),
            self.expiry.clone(),
        )?;
        self.reloadables.push(r.clone());
        Ok(Arc::new(move || r.get()))
    }
}

/// Binds one frontend; its listener and the address it is reached at.
async fn bind_frontend(
    fe: &FrontendConfig,
    tls_sources: &mut TlsSources,
) -> Result<(FrontendListener, String), StartError> {
    match &fe.listen {
        Listen::Uds {
            path,
            delete_existing,
            access,
        } => {
            let l = transport::bind_uds_with(path, *delete_existing, access).map_err(|source| {
                StartError::Bind {
                    what: "frontend socket",
                    addr: path.display().to_string(),
                    source,
                }
            })?;
            Ok((
                FrontendListener::Uds(l, path.clone()),
                path.display().to_string(),
            ))
        }
        Listen::Tcp {
            addr,
            tls: files,
            clients,
        } => {
            let alpn: &'static [&'static [u8]] = match fe.mode {
                Mode::Grpc => &[tls::ALPN_H2],
                Mode::HttpConnect => &[tls::ALPN_HTTP11],
            };
            let cfg = tls_sources.source("frontend", files, alpn)?;
            let l = bind_tcp("frontend port", *addr)?;
            let at = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
            Ok((FrontendListener::Tls(l, cfg, clients.clone()), at))
        }
    }
}

fn bind_optional(
    what: &'static str,
    addr: Option<SocketAddr>,
) -> Result<Option<TcpListener>, StartError> {
    match addr {
        Some(a) => Ok(Some(bind_tcp(what, a)?)),
        None => Ok(None),
    }
}

impl Server {
    /// Loads TLS material and binds every listener.
    pub async fn bind(config: ServerConfig) -> Result<BoundServer, StartError> {
        check_frontend_trust(&config)?;
        let metrics = metrics::Metrics::new();
        let mut tls_sources = TlsSources {
            expiry: metrics.cert_expiry.clone(),
            reloadables: Vec::new(),
        };
        let agent_tls = tls_sources.source("agent listener", &config.agent_tls, &[tls::ALPN_H2])?;
        let agent_listener = bind_tcp("agent port", config.agent_addr)?;
        let mut frontends = Vec::new();
        let mut frontend_addrs = Vec::new();
        for fe in &config.frontends {
            let (listener, at) = bind_frontend(fe, &mut tls_sources).await?;
            frontends.push((fe.mode, listener));
            frontend_addrs.push(at);
        }
        let health = bind_optional("health port", config.health_addr)?;
        let admin = bind_optional("admin port", config.admin_addr)?;
        let addrs = BoundAddrs {
            agent: agent_listener.local_addr().expect("bound"),
            frontends: frontend_addrs,
            health: health.as_ref().and_then(|l| l.local_addr().ok()),
            admin: admin.as_ref().and_then(|l| l.local_addr().ok()),
        };
        let authenticator = match &config.agent_auth {
            Some(a) => Some(Arc::new(
                auth::TokenAuthenticator::new(a, metrics.token_reviews.clone()).await?,
            )),
            None => None,
        };
        let lease_client = match &config.lease {
            Some(l) => Some(tether_ops::kubeclient::client(l.kubeconfig.as_deref()).await?),
            None => None,
        };
        let nodes_client = match &config.nodes {
            Some(w) => Some(tether_ops::kubeclient::client(w.kubeconfig.as_deref()).await?),
            None => None,
        };
        let agents_delegation = match &config.agents_access {
            AgentsAccess::Anyone => None,
            AgentsAccess::Authorized { kubeconfig } => {
                match tether_ops::kubeclient::client(kubeconfig.as_deref()).await {
                    Ok(c) => Some(tether_ops::authz::Delegation::with(c)),
                    Err(e) => {
                        tracing::warn!(error = %chain(&e), "/agents is refused to everyone: the admin port is not bound to loopback, so /agents needs a bearer token reviewed by the cluster, and there is no Kubernetes client (set --kubeconfig, or bind the admin port to 127.0.0.1)");
                        None
                    }
                }
            }
        };
        let router = Router::new(config.router.clone(), metrics);
        if config.nodes.as_ref().is_some_and(|w| w.route_pod_ips) {
            router.registry().nodes().route_pod_ips();
        }
        Ok(BoundServer {
            agents_delegation,
            lease_client,
            nodes_client,
            reloadables: tls_sources.reloadables,
            authenticator,
            config,
            router,
            agent_listener,
            agent_tls,
            frontends,
            health,
            admin,
            addrs,
        })
    }
}

impl BoundServer {
    /// The bound addresses.
    pub fn addrs(&self) -> &BoundAddrs {
        &self.addrs
    }

    /// The server core (for in-process embedding and tests).
    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// Serves until `drain` is cancelled, then stops taking frontend connections,
    /// lets established tunnels finish for up to the graceful shutdown timeout, and
    /// returns after the hard stop.
    pub async fn run(mut self, drain: CancellationToken) {
        // Agents and in-flight tunnels outlive the frontend listeners during a graceful
        // drain; `hard_stop` ends them.
        let hard_stop = CancellationToken::new();
        let server_count = Arc::new(AtomicU32::new(self.config.server_count));
        let lease_task = self.spawn_background(&server_count, &drain, &hard_stop);
        if let Some(l) = self.health.take() {
            spawn_health(&self.router, l, &hard_stop);
        }
        if let Some(l) = self.admin.take() {
            let access = match (&self.config.agents_access, self.agents_delegation.take()) {
                (AgentsAccess::Anyone, _) => AgentsReaders::Anyone,
                (AgentsAccess::Authorized { .. }, delegation) => AgentsReaders::Authorized {
                    delegation,
                    decisions: Arc::default(),
                },
            };
            spawn_admin(&self.router, l, self.config.profiling, access, &hard_stop);
        }
        let (config, router) = (self.config.clone(), self.router.clone());
        let (agent_task, frontends) = self.spawn_listeners(server_count, &drain, &hard_stop);

        drain.cancelled().await;
        tracing::info!("shutting down: no new frontend connections");
        // TCP frontends stop accepting at once; a Unix socket's path is removed so no
        // new client can reach it.
        for path in &frontends.sockets {
            let _ = std::fs::remove_file(path);
        }
        if let Some(task) = lease_task {
            // Stop advertising this server before waiting for its tunnels to finish.
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        // Pending dials and established connections each hold a drain watch.
        let grace = config.graceful_shutdown_timeout;
        let drained = tokio::time::timeout(grace, router.work().drain());
        if !grace.is_zero() && drained.await.is_err() {
            tracing::info!(
                open = router.work().open(),
                "graceful shutdown timeout reached; closing remaining tunnels"
            );
        }
        hard_stop.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(2), async {
            for task in frontends.tasks {
                let _ = task.await;
            }
            let _ = agent_task.await;
        });
        if stopped.await.is_err() {
            tracing::warn!("listeners still open 2s after the hard stop; exiting anyway");
        }
        tracing::info!("server stopped");
    }

    /// Starts what runs beside the listeners: the memory trimmer, certificate reload,
    /// the Node watch and the Lease (returned: it stops at `drain`).
    fn spawn_background(
        &self,
        server_count: &Arc<AtomicU32>,
        drain: &CancellationToken,
        hard_stop: &CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let router = self.router.clone();
        let open = move || router.work().open() as i64;
        tether_ops::memory::spawn_trimmer(
            open,
            tether_ops::memory::Looks::Steady,
            hard_stop.clone(),
        );
        tether_ops::reload::spawn_watcher(
            self.reloadables.clone(),
            self.config.cert_reload_interval,
            hard_stop.clone(),
        );
        if let Some(client) = &self.nodes_client {
            let inventory = self.router.registry().nodes().clone();
            nodes::spawn(client.clone(), inventory, hard_stop.clone());
        }
        let (Some(client), Some(cfg)) = (&self.lease_client, &self.config.lease) else {
            return None;
        };
        Some(tokio::spawn(lease::run(
            client.clone(),
            cfg.clone(),
            self.config.server_id.clone(),
            server_count.clone(),
            self.router.metrics.clone(),
            drain.clone(),
        )))
    }

    /// Starts the agent listener and the frontends (which stop accepting at `drain`).
    fn spawn_listeners(
        self,
        server_count: Arc<AtomicU32>,
        drain: &CancellationToken,
        hard_stop: &CancellationToken,
    ) -> (tokio::task::JoinHandle<()>, Frontends) {
        let config = self.config;
        let link = agent_link::AgentLink {
            router: self.router.clone(),
            server_id: config.server_id.clone(),
            server_count,
            channel_size: config.channel_size,
            shutdown: hard_stop.clone(),
            authenticator: self.authenticator,
            require_identity_match: config.require_agent_identity_match,
            unverified_warnings: tether_ops::ratelimit::TokenBucket::new(
                agent_link::UNVERIFIED_WARNINGS.0,
                agent_link::UNVERIFIED_WARNINGS.1,
            ),
        };
        let keepalive = config.agent_keepalive;
        let agent_task = spawn_agent_listener(
            link,
            self.agent_listener,
            self.agent_tls,
            keepalive,
            config.agent_dead_link,
            admission(&self.router, "agent", config.admission),
            hard_stop,
        );
        let mut frontends = Frontends::default();
        for (mode, listener) in self.frontends {
            if let FrontendListener::Uds(_, path) = &listener {
                frontends.sockets.push(path.clone());
            }
            let (router, stop, hard) = (self.router.clone(), drain.clone(), hard_stop.clone());
            let keepalive = config.frontend_keepalive;
            let span = tracing::info_span!("frontend_listener", %mode);
            let admission = admission(&self.router, "frontend", config.admission);
            frontends.tasks.push(tokio::spawn(
                serve_frontend(mode, listener, router, keepalive, admission, stop, hard)
                    .instrument(span),
            ));
        }
        (agent_task, frontends)
    }
}

/// The running frontends: their tasks and the Unix socket files they serve on.
#[derive(Default)]
struct Frontends {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    sockets: Vec<PathBuf>,
}

/// `/healthz`, `/readyz` (ready with at least one agent stream) and `/metrics`.
fn spawn_health(router: &Arc<Router>, listener: TcpListener, hard_stop: &CancellationToken) {
    let r = router.clone();
    let ready: tether_ops::health::ReadyCheck = Arc::new(move || match r.registry().len() {
        0 => Err("no agent connected".into()),
        n => Ok(format!("{n} agent stream(s) connected")),
    });
    let registry = router.metrics.registry().clone();
    let app = tether_ops::health::health_router(registry, ready, StatusCode::INTERNAL_SERVER_ERROR);
    tether_ops::health::spawn("health", listener, app, hard_stop.clone());
}

/// How `/agents` requests are checked.
#[derive(Clone)]
enum AgentsReaders {
    Anyone,
    Authorized {
        /// `None`: no Kubernetes client, so every request is refused.
        delegation: Option<tether_ops::authz::Delegation>,
        decisions: Arc<tether_ops::authz::DecisionCache>,
    },
}

/// `/metrics`, the profiles and `/agents` on the admin port.
fn spawn_admin(
    router: &Arc<Router>,
    listener: TcpListener,
    profiling: bool,
    readers: AgentsReaders,
    hard_stop: &CancellationToken,
) {
    use axum::response::IntoResponse;
    let r = router.clone();
    let agents = axum::routing::get(move |headers: axum::http::HeaderMap| {
        let (r, readers) = (r.clone(), readers.clone());
        async move {
            if let AgentsReaders::Authorized {
                delegation,
                decisions,
            } = &readers
            {
                let decision = match delegation {
                    Some(d) => {
                        decisions
                            .authorize(d, &headers, "/agents", Some(&[AGENTS_AUDIENCE]))
                            .await
                    }
                    None => Err((
                        StatusCode::FORBIDDEN,
                        "/agents: the admin port is not on loopback and the server has no Kubernetes client to review tokens (set --kubeconfig or bind --admin-bind-address=127.0.0.1)".into(),
                    )),
                };
                if let Err((status, why)) = decision {
                    tracing::debug!(reason = %why, %status, "/agents request refused");
                    return (status, format!("{why}\n")).into_response();
                }
            }
            (
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                r.registry().agents_json(),
            )
                .into_response()
        }
    });
    let registry = router.metrics.registry().clone();
    let app = tether_ops::health::admin_router(registry, profiling).route("/agents", agents);
    tether_ops::health::spawn("admin", listener, app, hard_stop.clone());
}

/// A TCP listener's admission under `limits`, counting refusals in
/// `tether_server_connections_refused_total{listener}`.
fn admission(
    router: &Arc<Router>,
    listener: &'static str,
    limits: tether_core::admission::AdmissionLimits,
) -> Arc<tether_core::admission::Admission> {
    let refused = router.metrics.connections_refused.clone();
    Arc::new(tether_core::admission::Admission::new(
        limits,
        Arc::new(move |why| {
            refused.with_label_values(&[listener, why.label()]).inc();
        }),
    ))
}

/// The agent listener: mutual TLS, then one task per connection serving
/// `AgentService` with HTTP/2 keepalive; after the hard stop it waits for those tasks
/// (each ends within `tether_core::grpc::server::CLOSE_GRACE`).
fn spawn_agent_listener(
    link: agent_link::AgentLink,
    listener: TcpListener,
    tls: ServerConfigSource,
    keepalive: Duration,
    dead_link: Option<Duration>,
    admission: Arc<tether_core::admission::Admission>,
    hard_stop: &CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let mut incoming = transport::tls_incoming_with(
        listener,
        tls,
        "agent",
        dead_link,
        admission,
        hard_stop.clone(),
    );
    let link = Arc::new(link);
    tokio::spawn(
        async move {
            let connections = tokio_util::task::TaskTracker::new();
            while let Some(conn) = incoming.recv().await {
                let info = conn.info().clone();
                let span = tracing::debug_span!("agent_connection", peer = %info.remote_addr);
                let serve = link.clone().serve_connection(conn, info, keepalive);
                connections.spawn(serve.instrument(span));
            }
            connections.close();
            connections.wait().await;
        }
        .instrument(tracing::info_span!("agent_listener")),
    )
}

/// Accepts frontend connections until `stop`, each served in a task of its own until
/// its client goes or `hard_stop`: established streams and tunnels outlive `stop`.
async fn serve_frontend(
    mode: Mode,
    listener: FrontendListener,
    router: Arc<Router>,
    keepalive: Duration,
    admission: Arc<tether_core::admission::Admission>,
    stop: CancellationToken,
    hard_stop: CancellationToken,
) {
    let serve = Accepted {
        mode,
        router,
        keepalive,
        hard_stop,
    };
    match listener {
        FrontendListener::Uds(l, _) => loop {
            let sock = tokio::select! {
                _ = stop.cancelled() => return,
                a = l.accept() => match a {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(error = %chain(&e), "accept failed");
                        // EMFILE and friends: back off a little instead of spinning.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            match mode {
                Mode::Grpc => serve.spawn(frontend::uds_authority::AuthorityFix::new(sock), "uds"),
                Mode::HttpConnect => serve.spawn(sock, "uds"),
            }
        },
        FrontendListener::Tls(l, cfg, clients) => {
            let mut incoming =
                transport::tls_incoming_with(l, cfg, "frontend", None, admission, stop);
            while let Some(conn) = incoming.recv().await {
                let peer = conn.info().remote_addr.to_string();
                let leaf = conn.info().peer_certs.as_ref().and_then(|c| c.first());
                if let Err(why) = clients.admit(leaf) {
                    tracing::warn!(%peer, reason = %why, "frontend client refused");
                    continue;
                }
                serve.spawn(conn, &peer);
            }
        }
    }
}

/// How an accepted frontend connection is served.
struct Accepted {
    mode: Mode,
    router: Arc<Router>,
    keepalive: Duration,
    hard_stop: CancellationToken,
}

impl Accepted {
    fn spawn<S>(&self, sock: S, peer: &str)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (router, stop) = (self.router.clone(), self.hard_stop.clone());
        match self.mode {
            Mode::Grpc => {
                let span = tracing::debug_span!("frontend_connection", kind = "grpc", %peer);
                let conn = frontend::grpc::serve_connection(sock, router, self.keepalive, stop);
                tokio::spawn(conn.instrument(span));
            }
            Mode::HttpConnect => {
                let span = tracing::info_span!("frontend", kind = "http-connect", %peer, address = tracing::field::Empty);
                let conn = frontend::http_connect::serve_connection(router, sock, stop);
                tokio::spawn(conn.instrument(span));
            }
        }
    }
}

//! Start-up: every listener bound and every certificate loaded before anything is
//! served, so a bad address or file fails with one error naming it.

use std::net::SocketAddr;
use std::sync::Arc;
use tether_core::error::chain;
use tether_core::tls::{self, TlsError, TlsFiles};
use tether_core::transport::{self, ServerConfigSource};
use tokio::net::{TcpListener, UnixListener};

use crate::config::{AgentsAccess, FrontendClients, FrontendConfig, Listen, ServerConfig};
use crate::{auth, metrics, Mode, Router};

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
    /// The QUIC agent listener could not be set up (`--agent-quic-port`).
    #[error("--agent-quic-port: {0}")]
    Quic(String),
    /// TLS material is unusable.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The Kubernetes client (agent authentication, leases, Nodes) could not be set up.
    #[error(transparent)]
    Kube(#[from] tether_ops::kubeclient::KubeSetupError),
    /// The TCP frontend would let agents' certificates open tunnels.
    #[error("--server-ca-cert and --cluster-ca-cert share the CA {subject:?} (one trusts it, the other trusts it or a CA it issued), so agent certificates could open frontend tunnels: give the frontend a CA of its own (tether certs init does), or require the apiserver's client certificate name with --frontend-client-names")]
    SharedCa {
        /// The CA both trusts reach.
        subject: String,
    },
    /// A CA bundle holds an intermediate whose issuers are not at hand, so the guard
    /// above cannot tell whether the two trusts meet.
    #[error("{flag} holds the intermediate CA {subject:?}, whose issuer {issuer:?} is in neither CA file: the server cannot tell whether agent certificates chain to the frontend's CA. Add the issuing CAs up to the root to that file, or set --frontend-client-names to the apiserver's client certificate name")]
    UnprovenCa {
        /// `--server-ca-cert` or `--cluster-ca-cert`.
        flag: &'static str,
        /// The intermediate.
        subject: String,
        /// Its issuer, not found.
        issuer: String,
    },
    /// A CA file could not be read for the comparison above.
    #[error("cannot read CA file {path}: {reason}")]
    CaFile {
        /// The file.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// The audit log could not be opened.
    #[error(transparent)]
    Audit(#[from] tether_ops::audit::AuditError),
}

use tether_certs::inspect::CertInfo;

/// Refuses a TCP frontend whose CA also signs agents, unless client names are required
/// or the operator opted out.
pub(crate) fn check_frontend_trust(config: &ServerConfig) -> Result<(), StartError> {
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
    for fe in &config.frontends {
        let Listen::Tcp { tls, clients, .. } = &fe.listen else {
            continue;
        };
        let Some(frontend_ca) = &tls.ca else { continue };
        if !clients.names.is_empty() {
            continue;
        }
        let trusts = Trusts {
            frontend: read_cas(frontend_ca)?,
            agents: read_cas(agent_ca)?,
        };
        match trusts.meet() {
            Ok(None) => {}
            Ok(Some(subject)) if clients.allow_shared_ca => {
                tracing::warn!(ca = %subject, "UNSAFE: the frontend trusts the agents' CA (--unsafe-shared-frontend-ca): a stolen agent certificate can open tunnels to any address");
            }
            Ok(Some(subject)) => return Err(StartError::SharedCa { subject }),
            Err(e) if clients.allow_shared_ca => {
                tracing::warn!(error = %e, "UNSAFE: --unsafe-shared-frontend-ca");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_cas(p: &std::path::Path) -> Result<Vec<CertInfo>, StartError> {
    let pem = std::fs::read_to_string(p).map_err(|e| StartError::CaFile {
        path: p.display().to_string(),
        reason: e.to_string(),
    })?;
    tether_certs::inspect::parse_pem(&pem).map_err(|reason| StartError::CaFile {
        path: p.display().to_string(),
        reason,
    })
}

/// The two trusts of a server with a TCP frontend: the CAs frontend clients chain to,
/// and the CAs agents chain to.
struct Trusts {
    frontend: Vec<CertInfo>,
    agents: Vec<CertInfo>,
}

impl Trusts {
    /// Does any certificate chain to both? That happens when one trust's CA is the
    /// other's or its ancestor, or shares a key with one along the way: a leaf issued
    /// under the lower CA then chains to both (a client sends the intermediates). Each
    /// CA's ancestors are found among both files; one whose chain ends at an issuer in
    /// neither file cannot be judged (`Err`). Siblings under one root do not meet.
    fn meet(&self) -> Result<Option<String>, StartError> {
        let all: Vec<&CertInfo> = self.frontend.iter().chain(self.agents.iter()).collect();
        fn line<'a>(
            c: &'a CertInfo,
            all: &[&'a CertInfo],
            flag: &'static str,
        ) -> Result<Vec<&'a CertInfo>, StartError> {
            ancestry(c, all).map_err(|top| StartError::UnprovenCa {
                flag,
                subject: top.subject.clone(),
                issuer: top.issuer.clone(),
            })
        }
        for f in &self.frontend {
            let f_line = line(f, &all, "--server-ca-cert")?;
            for a in &self.agents {
                let a_line = line(a, &all, "--cluster-ca-cert")?;
                let same = |x: &&CertInfo, y: &CertInfo| {
                    x.der == y.der || x.public_key_der == y.public_key_der
                };
                // f is a or above it, or a is f or above it.
                if a_line.iter().any(|x| same(x, f)) {
                    return Ok(Some(f.subject.clone()));
                }
                if f_line.iter().any(|x| same(x, a)) {
                    return Ok(Some(a.subject.clone()));
                }
            }
        }
        Ok(None)
    }
}

/// `c` and its issuers up to a self-signed root, found among `all`; `Err` with the
/// highest certificate reached when its issuer is not among them.
fn ancestry<'a>(c: &'a CertInfo, all: &[&'a CertInfo]) -> Result<Vec<&'a CertInfo>, &'a CertInfo> {
    let mut line = vec![c];
    let mut top = c;
    while !top.signed_by(top) {
        let issuer = all
            .iter()
            .find(|i| !line.iter().any(|l| l.der == i.der) && top.signed_by(i))
            .copied()
            .ok_or(top)?;
        line.push(issuer);
        top = issuer;
    }
    Ok(line)
}

/// What was bound, for logs and tests.
#[derive(Debug, Clone)]
pub struct BoundAddrs {
    /// Agent listener.
    pub agent: SocketAddr,
    /// The agent listener over QUIC (UDP), when on.
    pub agent_quic: Option<SocketAddr>,
    /// Frontends, in configuration order: a TCP address or a socket path.
    pub frontends: Vec<String>,
    /// Health endpoint.
    pub health: Option<SocketAddr>,
    /// Admin endpoint.
    pub admin: Option<SocketAddr>,
}

pub(crate) enum FrontendListener {
    Uds(UnixListener, transport::SocketFile),
    Tls(TcpListener, ServerConfigSource, FrontendClients),
}

/// The server, bound and ready to run.
pub struct BoundServer {
    pub(crate) agents_delegation: Option<tether_ops::authz::Delegation>,
    pub(crate) lease_client: Option<kube::Client>,
    pub(crate) nodes_client: Option<kube::Client>,
    pub(crate) reloadables: Vec<Arc<dyn tether_ops::reload::Reload>>,
    pub(crate) authenticator: Option<Arc<auth::TokenAuthenticator>>,
    pub(crate) config: ServerConfig,
    pub(crate) router: Arc<Router>,
    pub(crate) agent_listener: TcpListener,
    pub(crate) agent_tls: ServerConfigSource,
    pub(crate) agent_quic: Option<crate::agent_link::quic::QuicPort>,
    pub(crate) frontends: Vec<(Mode, FrontendListener)>,
    pub(crate) health: Option<TcpListener>,
    pub(crate) admin: Option<TcpListener>,
    /// `--admin-cert`/`--admin-key`: the admin port speaks TLS.
    pub(crate) admin_tls: Option<ServerConfigSource>,
    pub(crate) addrs: BoundAddrs,
}

/// Entry point.
pub struct Server;

pub(crate) fn bind_tcp(
    what: &'static str,
    addr: SocketAddr,
    reuse_port: bool,
) -> Result<TcpListener, StartError> {
    transport::bind_tcp_with(addr, reuse_port).map_err(|source| StartError::Bind {
        what,
        addr: addr.to_string(),
        source,
    })
}

/// The reloadable TLS configurations of the listeners, watched together.
pub(crate) struct TlsSources {
    pub(crate) expiry: tether_ops::metrics::CertExpiry,
    pub(crate) reloadables: Vec<Arc<dyn tether_ops::reload::Reload>>,
}

impl TlsSources {
    /// Loads `files` now (failing start-up when they are unusable) and again whenever
    /// they change.
    pub(crate) fn source(
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

/// What the agent listener offers by ALPN: h2, and HTTP/1.1 for agents that carry
/// their stream over WebSocket (`--agent-websocket`).
fn agent_alpn(websocket: bool) -> &'static [&'static [u8]] {
    match websocket {
        true => &[tls::ALPN_H2, tls::ALPN_HTTP11],
        false => &[tls::ALPN_H2],
    }
}

/// Binds one frontend; its listener and the address it is reached at.
pub(crate) async fn bind_frontend(
    fe: &FrontendConfig,
    tls_sources: &mut TlsSources,
    reuse_port: bool,
) -> Result<(FrontendListener, String), StartError> {
    match &fe.listen {
        Listen::Uds {
            path,
            delete_existing,
            access,
        } => {
            let (l, file) =
                transport::bind_uds_with(path, *delete_existing, access).map_err(|source| {
                    StartError::Bind {
                        what: "frontend socket",
                        addr: path.display().to_string(),
                        source,
                    }
                })?;
            Ok((FrontendListener::Uds(l, file), path.display().to_string()))
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
            let l = bind_tcp("frontend port", *addr, reuse_port)?;
            let at = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
            Ok((FrontendListener::Tls(l, cfg, clients.clone()), at))
        }
    }
}

/// The audit log `--audit-log-path` asks for, or none.
fn open_audit(
    config: &ServerConfig,
    metrics: &metrics::Metrics,
) -> Result<crate::router::audit::Audit, StartError> {
    Ok(match &config.audit {
        Some(a) => crate::router::audit::Audit::open(a, metrics.audit.clone(), "tether-audit")?,
        None => crate::router::audit::Audit::off(),
    })
}

/// Binds every frontend: their listeners (with their modes) and where each is reached.
async fn bind_frontends(
    configs: &[FrontendConfig],
    tls_sources: &mut TlsSources,
    reuse_port: bool,
) -> Result<(Vec<(Mode, FrontendListener)>, Vec<String>), StartError> {
    let mut frontends = Vec::new();
    let mut addrs = Vec::new();
    for fe in configs {
        let (listener, at) = bind_frontend(fe, tls_sources, reuse_port).await?;
        frontends.push((fe.mode, listener));
        addrs.push(at);
    }
    Ok((frontends, addrs))
}

pub(crate) fn bind_optional(
    what: &'static str,
    addr: Option<SocketAddr>,
    reuse_port: bool,
) -> Result<Option<TcpListener>, StartError> {
    match addr {
        Some(a) => Ok(Some(bind_tcp(what, a, reuse_port)?)),
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
        let alpn = agent_alpn(config.agent_websocket);
        let agent_tls = tls_sources.source("agent listener", &config.agent_tls, alpn)?;
        let reuse = config.reuse_port;
        let agent_listener = bind_tcp("agent port", config.agent_addr, reuse)?;
        // The agent key signs QUIC's stateless resets: a restarted server's are good.
        let secret = std::fs::read(&config.agent_tls.key).unwrap_or_default();
        let agent_quic = config
            .agent_quic_addr
            .map(|addr| crate::agent_link::quic::bind(addr, &agent_tls, &secret, reuse))
            .transpose()
            .map_err(StartError::Quic)?;
        let (frontends, frontend_addrs) =
            bind_frontends(&config.frontends, &mut tls_sources, reuse).await?;
        let health = bind_optional("health port", config.health_addr, reuse)?;
        let admin = bind_optional("admin port", config.admin_addr, reuse)?;
        let admin_tls = match &config.admin_tls {
            Some(files) => Some(tls_sources.source("admin port", files, &[tls::ALPN_HTTP11])?),
            None => None,
        };
        let addrs = BoundAddrs {
            agent: agent_listener.local_addr().expect("bound"),
            agent_quic: agent_quic.as_ref().and_then(|p| p.addr()),
            frontends: frontend_addrs,
            health: health.as_ref().and_then(|l| l.local_addr().ok()),
            admin: admin.as_ref().and_then(|l| l.local_addr().ok()),
        };
        let clients = KubeClients::of(&config, &metrics).await?;
        let audit = open_audit(&config, &metrics)?;
        let router = Router::with_audit(config.router.clone(), metrics, audit);
        if config.nodes.as_ref().is_some_and(|w| w.route_pod_ips) {
            router.registry().nodes().route_pod_ips();
        }
        Ok(BoundServer {
            agents_delegation: clients.agents_delegation,
            lease_client: clients.lease,
            nodes_client: clients.nodes,
            reloadables: tls_sources.reloadables,
            authenticator: clients.authenticator,
            config,
            router,
            agent_listener,
            agent_tls,
            agent_quic,
            frontends,
            health,
            admin,
            admin_tls,
            addrs,
        })
    }
}

/// What the server asks the cluster, each built from its own kubeconfig (or the
/// in-cluster one) when its feature is on.
struct KubeClients {
    authenticator: Option<Arc<auth::TokenAuthenticator>>,
    lease: Option<kube::Client>,
    nodes: Option<kube::Client>,
    agents_delegation: Option<tether_ops::authz::Delegation>,
}

impl KubeClients {
    async fn of(config: &ServerConfig, metrics: &metrics::Metrics) -> Result<Self, StartError> {
        let authenticator = match &config.agent_auth {
            Some(a) => Some(Arc::new(
                auth::TokenAuthenticator::new(a, metrics.token_reviews.clone()).await?,
            )),
            None => None,
        };
        let lease = match &config.lease {
            Some(l) => Some(tether_ops::kubeclient::client(l.kubeconfig.as_deref()).await?),
            None => None,
        };
        let nodes = match &config.nodes {
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
        Ok(KubeClients {
            authenticator,
            lease,
            nodes,
            agents_delegation,
        })
    }
}

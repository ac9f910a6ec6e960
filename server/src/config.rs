//! The server's settings: where each listener binds, which frontend clients are
//! admitted, who may read `/agents`, and the rest of `ServerConfig`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use tether_core::tls::TlsFiles;
use tether_core::transport::{self};

use crate::{auth, lease, nodes, Mode, RouterConfig};

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
    /// `--reuse-port`: every TCP listener binds with `SO_REUSEPORT`, so a successor
    /// can bind beside this server; the agent listener then closes at the drain.
    pub reuse_port: bool,
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
    /// Admin endpoint (`/metrics`, `/agents`, `/status`).
    pub admin_addr: Option<SocketAddr>,
    /// `--admin-cert`/`--admin-key`: serve the admin endpoint over TLS (no client
    /// certificate asked; `/agents` off loopback still needs a reviewed token).
    pub admin_tls: Option<TlsFiles>,
    /// Backend selection and dial timeout.
    pub router: RouterConfig,
    /// Packets queued towards each agent stream (`--xfr-channel-size`).
    pub channel_size: usize,
    /// How long established connections may finish once the drain begins.
    pub graceful_shutdown_timeout: Duration,
    /// Agent authentication by service-account token (TokenReview).
    pub agent_auth: Option<auth::TokenAuthConfig>,
    /// Refuse agents whose agentid/identifiers are not in their client certificate.
    pub require_agent_identity_match: bool,
    /// Agents may carry their stream over WebSocket on the agent port (`--agent-websocket`).
    pub agent_websocket: bool,
    /// Agents may carry their stream over QUIC on this UDP address (`--agent-quic-port`).
    pub agent_quic_addr: Option<SocketAddr>,
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
    /// The audit log of tunnels and refusals (`--audit-log-path`); `None`: off.
    pub audit: Option<tether_ops::audit::AuditConfig>,
}

/// The audience a token must be bound to for `/agents` off loopback (a projected
/// ServiceAccount token with this audience): kube-apiserver refuses such a token, so
/// one read off an admin port in plain HTTP cannot be replayed against the cluster.
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

//! The agent's settings, validated by the command line before anything starts.

use std::path::PathBuf;
use std::time::Duration;

use crate::policy::PolicyConfig;
use crate::proxy::Egress;

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
    /// A server connection silent this long is closed, whatever `keepalive` is (TCP
    /// keepalive and user timeout); `None` = kernel defaults.
    pub dead_link: Option<Duration>,
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
    /// How servers are reached: directly or through an egress proxy (`--egress-proxy`,
    /// HTTPS_PROXY, NO_PROXY).
    pub egress: Egress,
    /// Which targets servers may have this agent dial (`--dial-policy`, `--dial-allow`).
    pub policy: PolicyConfig,
    /// `/readyz` only once a stream is up to every server the agent knows of
    /// (`--ready-when=every-server`), not to any one.
    pub ready_with_every_server: bool,
    /// How streams to servers are carried, in order of preference (`--transports`);
    /// never empty.
    pub transports: Vec<Transport>,
    /// The server's UDP port for QUIC (`--proxy-server-quic-port`); `None`: the same
    /// number as its TCP port.
    pub quic_port: Option<u16>,
}

/// What carries a stream to a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// gRPC over HTTP/2 and TLS, as upstream's agent (the default).
    H2,
    /// The agent protocol's packets as WebSocket messages over HTTP/1.1 and TLS, for
    /// paths that pass only HTTP/1.1 (a TLS-terminating reverse proxy).
    WebSocket,
    /// Tether's agent link over QUIC (UDP), a stream per tunnel: for lossy links (a
    /// loss stalls one tunnel, not all) and roaming ones (the connection survives the
    /// node's address changing). Only a Tether server with `--agent-quic-port` takes it.
    Quic,
}

impl Transport {
    /// Every transport, by its flag name.
    pub const ALL: [Transport; 3] = [Transport::H2, Transport::WebSocket, Transport::Quic];

    /// Its name in `--transports`, the metrics, logs and `/agents`.
    pub fn name(self) -> &'static str {
        match self {
            Transport::H2 => "h2",
            Transport::WebSocket => "websocket",
            Transport::Quic => "quic",
        }
    }

    /// The transport `--transports` names `s`.
    pub fn parse(s: &str) -> Option<Transport> {
        Transport::ALL.into_iter().find(|t| t.name() == s)
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

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
            .field("egress", &self.egress)
            .finish_non_exhaustive()
    }
}

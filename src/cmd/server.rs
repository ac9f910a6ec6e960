//! `tether server`: flags (upstream names and defaults), validation, and running the
//! proxy server until SIGTERM/SIGINT.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use tether_core::tls::TlsFiles;
use tether_server::{FrontendConfig, Listen, Mode, RouterConfig, Server, ServerConfig};

use super::{bind_addr, dead_link, duration, go_bool, LogArgs};

/// A server keepalive interval as grpc-go's server applies it: 0 is its default of two
/// hours, and anything below one second is one second.
fn grpc_server_keepalive(time: Duration) -> Duration {
    if time.is_zero() {
        Duration::from_secs(2 * 3600)
    } else {
        time.max(Duration::from_secs(1))
    }
}

/// Proxy server flags.
#[derive(Args, Debug)]
// Go's pflag: a repeated flag's last value wins (managed offerings append overrides
// after their defaults); list flags append.
#[command(args_override_self = true)]
pub struct ServerArgs {
    /// Frontend protocol: grpc or http-connect.
    #[arg(long, default_value = "grpc")]
    pub mode: Mode,
    /// Frontend Unix socket path (kube-apiserver's udsName); empty = TCP with mTLS.
    #[arg(long, default_value = "")]
    pub uds_name: String,
    /// Remove a stale socket file at --uds-name before listening.
    ///
    /// A file there that is not a socket is never removed: start-up fails instead.
    #[arg(long, default_value = "true", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub delete_existing_uds_file: bool,
    /// Permission bits of the --uds-name socket, octal (e.g. 0660).
    ///
    /// 0660 lets the owner and the group connect. Empty: 0770, as upstream creates the
    /// socket (umask 0007). Needs --uds-name. Tether only.
    #[arg(long, default_value = "")]
    pub uds_socket_mode: String,
    /// Numeric group ID given the --uds-name socket.
    ///
    /// Lets a non-root client in that group (kube-apiserver, the CCM's load balancers)
    /// connect. Empty: the server's group. Needs --uds-name; a group other than the
    /// server's own must be among the server's groups (a pod's supplementalGroups), or the
    /// server needs CAP_CHOWN. Tether only.
    #[arg(long, default_value = "")]
    pub uds_socket_group: String,
    /// Frontend TCP port (must be 0 with --uds-name).
    #[arg(long, default_value_t = 8090)]
    pub server_port: u16,
    /// Frontend bind address (empty = all interfaces).
    #[arg(long, default_value = "")]
    pub server_bind_address: String,
    /// Frontend serving certificate (TCP mode; also the agent listener's without
    /// --cluster-cert).
    #[arg(long, default_value = "")]
    pub server_cert: String,
    /// Frontend serving key (TCP mode; also the agent listener's without --cluster-key).
    #[arg(long, default_value = "")]
    pub server_key: String,
    /// CA that frontend client certificates must chain to (mandatory in TCP mode).
    ///
    /// It must not be the agents' CA (--cluster-ca-cert) unless --frontend-client-names is
    /// set, since an agent's certificate must never open tunnels: start-up fails otherwise
    /// (--unsafe-shared-frontend-ca overrides). `tether certs init` writes a CA of its own
    /// for this, frontend-ca.crt.
    #[arg(long, default_value = "")]
    pub server_ca_cert: String,
    /// Names (CN or DNS SAN) a TCP frontend client certificate must carry, comma-separated.
    ///
    /// For a PKI whose one CA also signs agents: e.g. the CN of kube-apiserver's
    /// konnectivity client certificate. Empty: any certificate --server-ca-cert signed.
    /// Tether only.
    #[arg(long, default_value = "", value_delimiter = ',')]
    pub frontend_client_names: Vec<String>,
    /// UNSAFE: let the TCP frontend trust the agents' CA with no required client name.
    ///
    /// A stolen agent certificate then opens tunnels to any address (upstream's
    /// behaviour). Logs UNSAFE at start; see docs/threat-model.md. Tether only.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub unsafe_shared_frontend_ca: bool,
    /// HTTP/2 keepalive interval on frontend connections.
    ///
    /// 0 is grpc-go's server default, 2h; anything below 1s is 1s.
    #[arg(long, default_value = "1h", value_parser = duration)]
    pub frontend_keepalive_time: Duration,

    /// Agent listener port (always TLS).
    #[arg(long, default_value_t = 8091)]
    pub agent_port: u16,
    /// Agent listener bind address (empty = all interfaces).
    #[arg(long, default_value = "")]
    pub agent_bind_address: String,
    /// Agent listener serving certificate (falls back to --server-cert).
    #[arg(long, default_value = "")]
    pub cluster_cert: String,
    /// Agent listener serving key (falls back to --server-key).
    #[arg(long, default_value = "")]
    pub cluster_key: String,
    /// CA that agent client certificates must chain to; set = certificates required.
    ///
    /// Without it or token authentication (--agent-namespace, --agent-service-account,
    /// --authentication-audience) the server does not start, unless
    /// --unsafe-allow-unauthenticated-agents is set. Exclusive with token authentication.
    #[arg(long, default_value = "")]
    pub cluster_ca_cert: String,
    /// HTTP/2 keepalive interval on agent connections.
    ///
    /// 0 is grpc-go's server default, 2h; anything below 1s is 1s. However long it is, a
    /// silent agent connection is closed after --dead-link-timeout.
    #[arg(long, default_value = "1h", value_parser = duration)]
    pub keepalive_time: Duration,
    /// Close an agent connection whose peer has been silent this long.
    ///
    /// Whatever --keepalive-time is, the kernel watches the TCP connection: idle, it is
    /// probed after half of this and given up after three unanswered probes a sixth of it
    /// apart; data left unacknowledged this long ends it too (TCP_USER_TIMEOUT). Probes
    /// are invisible to HTTP/2, so no ping policy objects. 0 leaves the kernel's defaults;
    /// otherwise at least 2s. Tether only.
    #[arg(long, default_value = "30s", value_parser = duration)]
    pub dead_link_timeout: Duration,

    /// This server's ID, sent to agents as `serverid` (empty: a random UUID).
    #[arg(long, env = "PROXY_SERVER_ID", default_value = "")]
    pub server_id: String,
    /// Number of proxy servers, sent to agents as `servercount`.
    ///
    /// 0 tells them the count is unknown, so they keep connecting to find every server.
    /// With --enable-lease-controller the number of live Leases is sent instead.
    #[arg(long, default_value_t = 1)]
    pub server_count: u32,

    /// Ordered backend selection: default, destHost, defaultRoute, destCIDR.
    ///
    /// destHost: an agent verified to reach the dial's host; destCIDR: an agent whose
    /// `cidr=` identifier holds the address, or with --watch-node-pod-cidrs the agent on
    /// the node whose pod CIDR holds it; defaultRoute: an agent with
    /// `default-route=true`; default: any agent. Only verified identifiers count: no
    /// credential proves `default-route=true`, so defaultRoute needs
    /// --unsafe-trust-agent-identifiers. A dial to a watched Node's name or address, or
    /// into a pod network, never falls back to default or defaultRoute (see
    /// docs/threat-model.md).
    #[arg(long, default_value = "default")]
    pub proxy_strategies: String,
    /// Fail a dial the agent has not answered within this (0 = a 30 s backstop).
    ///
    /// It bounds the whole dial: the wait to queue the DIAL_REQ on the agent's stream and
    /// the agent's answer. The caller gets a timeout error (504 over HTTP-CONNECT). An
    /// agent stream that took nothing for the whole timeout is stuck and is disconnected,
    /// as upstream does. Upstream's 0 waits for ever; 30 s is how long HTTP-CONNECT
    /// clients wait.
    #[arg(long, default_value = "0", value_parser = duration)]
    pub backend_dial_timeout: Duration,
    /// Packets queued towards each agent stream.
    #[arg(long, default_value_t = 10)]
    pub xfr_channel_size: usize,
    /// Per-connection credit flow control with agents that offer it (Tether agents).
    ///
    /// Upstream agents never offer it. `false` behaves like an upstream server. Tether
    /// only.
    #[arg(long, default_value = "true", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub flow_control: bool,
    /// Without flow control (an upstream agent): how long a client may leave data unread.
    ///
    /// A connection whose client has left its queued data (4 MiB) unread for this long is
    /// closed instead of holding up the agent's stream. Tether only.
    #[arg(long, default_value = "30s", value_parser = duration)]
    pub stalled_reader_timeout: Duration,

    /// Health port: /healthz, /readyz and /metrics.
    ///
    /// /readyz answers 200 while at least one agent stream is connected, else 500.
    #[arg(long, default_value_t = 8092)]
    pub health_port: u16,
    /// Health bind address (empty = all interfaces).
    #[arg(long, default_value = "")]
    pub health_bind_address: String,
    /// Admin port: /metrics, /agents, and the pprof profiles with --enable-profiling.
    ///
    /// /agents lists the connected agents as JSON (what `tether ccm` reads).
    #[arg(long, default_value_t = 8095)]
    pub admin_port: u16,
    /// Admin bind address.
    ///
    /// Off loopback, /agents answers only a bearer token bound to the audience
    /// `tether-admin` that a TokenReview accepts and a SubjectAccessReview allows `get` on
    /// /agents, asked of the cluster (--kubeconfig or in-cluster configuration).
    #[arg(long, default_value = "127.0.0.1")]
    pub admin_bind_address: String,
    /// Certificate (PEM chain) for TLS on the admin port, with --admin-key; empty = plain
    /// HTTP.
    ///
    /// For an admin port off loopback: readers (`tether status --cacert`, the
    /// CCM's agents.caFile) verify the server, and their bearer tokens travel
    /// encrypted. Reloaded when the files change, as the other certificates are. The
    /// same --cipher-suites and --tls-min-version apply. Tether only.
    #[arg(long, default_value = "")]
    pub admin_cert: String,
    /// Private key for --admin-cert (PKCS#1, SEC1 or PKCS#8 PEM).
    #[arg(long, default_value = "")]
    pub admin_key: String,
    /// Watch Nodes' spec.podCIDRs so that destCIDR sends a dial to a pod IP to its node.
    ///
    /// The dial goes to the agent verified (by token or certificate) as the node whose
    /// pod CIDR holds the address. Needs destCIDR in --proxy-strategies, --kubeconfig or
    /// in-cluster configuration, and list/watch on nodes (deploy/rbac.yaml), which token
    /// authentication needs anyway. Tether only.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub watch_node_pod_cidrs: bool,
    /// How long a dial that no connected agent can take waits for one (0 = fail it at
    /// once, as upstream).
    ///
    /// Covers the seconds after this server starts or takes over from a predecessor, and
    /// a node's agent reconnecting: kube-apiserver's call waits instead of failing with
    /// "No agent available". Bounded by --backend-dial-timeout. Tether only.
    #[arg(long, default_value = "0", value_parser = duration)]
    pub wait_for_agent: Duration,
    /// Bind the agent, frontend TCP, health and admin ports with SO_REUSEPORT, so a
    /// successor can start on the same ports while this server still runs.
    ///
    /// The kernel spreads new connections over both until one closes its listeners (at
    /// SIGTERM this server closes its frontend at once and its agent port after its
    /// tunnels). Only a process of the same user can join the port. See
    /// docs/operating.md, "Upgrading the server". Tether only.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub reuse_port: bool,
    /// How long established tunnels may finish after SIGTERM (0 = close at once).
    #[arg(long, default_value = "0", value_parser = duration)]
    pub graceful_shutdown_timeout: Duration,
    /// Threads running the server's tasks (0 = one per CPU the process may use). Tether
    /// only.
    #[arg(long, default_value_t = 0)]
    pub worker_threads: usize,

    /// Refuse agents with any identifier the server cannot verify.
    ///
    /// Verified means by the agent's client certificate (see `tether certs agent`), or by
    /// its pod-bound token's node and that Node's addresses and pod CIDRs. Without this
    /// flag such identifiers are ignored for routing, counted and logged. Needs
    /// --cluster-ca-cert or token authentication. Tether only.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub require_agent_identity_match: bool,
    /// Agents may carry their stream over WebSocket (HTTP/1.1) on the agent port, beside
    /// HTTP/2.
    ///
    /// For agents behind reverse proxies that pass only HTTP/1.1 (agent
    /// `--transports=websocket`). `false` offers only h2 by ALPN and closes HTTP/1.1
    /// requests. Tether only.
    #[arg(long, default_value = "true", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub agent_websocket: bool,
    /// UDP port for agents that carry their stream over QUIC (0 = off).
    ///
    /// On --agent-bind-address, with the agent port's certificate and client
    /// verification (TLS 1.3 only). For lossy and roaming links (agent
    /// `--transports=quic,h2`): each tunnel is a QUIC stream of its own, and a
    /// connection survives the node's address changing. Tether only.
    #[arg(long, default_value_t = 0)]
    pub agent_quic_port: u16,
    /// UNSAFE: route dials by identifiers agents claim but the server could not verify.
    ///
    /// Upstream's behaviour, for fleets with agents that cannot be verified: a
    /// compromised node can then take other nodes' traffic. Logs UNSAFE at start; see
    /// docs/threat-model.md. Tether only.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub unsafe_trust_agent_identifiers: bool,
    /// UNSAFE: accept agents that present neither a client certificate nor a token.
    ///
    /// Without --cluster-ca-cert or token authentication (--agent-namespace,
    /// --agent-service-account, --authentication-audience) the server refuses to start
    /// unless this is set: anyone who reaches the agent port can then serve dials. Logs
    /// UNSAFE at start; see docs/threat-model.md. Tether only.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub unsafe_allow_unauthenticated_agents: bool,
    /// Most agent streams per verified identity, else per agent ID; more are refused.
    ///
    /// A verified identity is a token's node or a per-node certificate. A dial picks an
    /// agent first, then one of its streams. 0 = no cap. Tether only.
    #[arg(long, default_value_t = tether_server::DEFAULT_MAX_AGENT_STREAMS)]
    pub max_agent_streams: usize,
    /// Most open connections per TCP listener (agent, frontend), handshaking or served.
    ///
    /// At the cap new clients wait in the kernel's backlog. 0 = three quarters of the
    /// open-file limit (at least 64), which start-up first raises to its hard limit.
    /// Tether only.
    #[arg(long, default_value_t = 0)]
    pub max_connections: usize,
    /// Most unproven connections per TCP listener: handshaking, or not yet authenticated.
    ///
    /// At the cap a new connection evicts the oldest unproven one of the source prefix
    /// that holds the most, so a flood never queues a real agent behind it. 0 = no cap.
    /// Tether only.
    #[arg(long, default_value_t = tether_core::admission::DEFAULT_MAX_HANDSHAKES)]
    pub max_concurrent_handshakes: usize,
    /// Most unproven connections from one source address per TCP listener.
    ///
    /// Beyond it a new connection is closed at once; raise it when many nodes share one
    /// NAT address. 0 = no cap. Tether only.
    #[arg(long, default_value_t = tether_core::admission::DEFAULT_MAX_HANDSHAKES_PER_SOURCE)]
    pub max_handshakes_per_source: usize,
    /// Most unproven connections from one source prefix (/24 IPv4, /64 IPv6) per TCP
    /// listener.
    ///
    /// Beyond it a new connection is closed at once; raise it when many nodes share one
    /// prefix and reconnect at once. 0 = no cap. Tether only.
    #[arg(long, default_value_t = tether_core::admission::DEFAULT_MAX_HANDSHAKES_PER_PREFIX)]
    pub max_handshakes_per_prefix: usize,
    /// How often certificate files are checked for changes (SIGHUP reloads at once).
    ///
    /// New handshakes use the new material; established tunnels keep going. A reload
    /// that fails (a half-written file, a key that does not match) keeps the old
    /// certificates and logs why. Tether only.
    #[arg(long, default_value = "1m", value_parser = duration)]
    pub cert_reload_interval: Duration,
    #[command(flatten)]
    pub audit: super::AuditArgs,

    #[command(flatten)]
    pub log: LogArgs,
    /// Arguments that are not flags: ignored with a warning, as proxy-server ignores them.
    #[arg(hide = true)]
    pub positional: Vec<String>,

    /// Namespace of the agents' service account (token authentication).
    ///
    /// --agent-namespace, --agent-service-account and --authentication-audience go
    /// together: agents then authenticate with a bound service-account token, checked by
    /// TokenReview. Exclusive with --cluster-ca-cert.
    #[arg(long, default_value = "")]
    pub agent_namespace: String,
    /// Agents' service account (token authentication).
    ///
    /// Set with --agent-namespace and --authentication-audience.
    #[arg(long, default_value = "")]
    pub agent_service_account: String,
    /// Audience agent tokens must carry (token authentication).
    ///
    /// Set with --agent-namespace and --agent-service-account.
    #[arg(long, default_value = "")]
    pub authentication_audience: String,
    /// Kubeconfig for TokenReviews, Leases and Nodes (empty = in-cluster configuration).
    ///
    /// The server's identity for token authentication (and the Node watch it needs),
    /// watching Nodes with agent certificates (so that each node's names and addresses
    /// go to its agent only, from start-up), --enable-lease-controller,
    /// --watch-node-pod-cidrs, and authorizing /agents on a non-loopback
    /// --admin-bind-address; unused otherwise.
    #[arg(long, default_value = "")]
    pub kubeconfig: String,
    /// TokenReviews per second (0 = 50).
    ///
    /// Upstream's 0 means client-go's 5; Tether keeps 50 so that a reconnect storm of
    /// thousands of token-authenticated agents is not held to 5 TokenReviews a second (at
    /// 5, a thousand agents need over three minutes to be readmitted after a restart).
    /// Positive reviews are cached for 30 s. Only token authentication's reviews are
    /// limited, not the Lease and Node calls.
    #[arg(long, default_value_t = 0.0)]
    pub kubeconfig_qps: f64,
    /// TokenReview burst (0 = 100).
    ///
    /// Upstream's 0 means client-go's 10; see --kubeconfig-qps.
    #[arg(long, default_value_t = 0)]
    pub kubeconfig_burst: u32,
    /// Accepted: Tether always talks JSON to the apiserver.
    #[arg(long, default_value = "application/vnd.kubernetes.protobuf")]
    pub kube_api_content_type: String,

    /// Publish a Lease per server and tell agents the number of live servers.
    ///
    /// The Lease is `konnectivity-proxy-server-<id>` (valid 30 s, renewed every 15 s).
    /// Expired ones are garbage-collected (only if unchanged since listed), and this
    /// server's is deleted on shutdown. `servercount` then follows the live Leases instead
    /// of --server-count. Needs --kubeconfig or in-cluster configuration.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub enable_lease_controller: bool,
    /// Namespace of the Leases (--enable-lease-controller).
    #[arg(long, default_value = "kube-system")]
    pub lease_namespace: String,
    /// Labels of the Leases (key=value[,key=value]; --enable-lease-controller).
    #[arg(long, default_value = "k8s-app=konnectivity-server")]
    pub lease_label: String,
    /// TLS 1.2 cipher suites both TLS listeners offer, by Go's IANA names.
    ///
    /// Comma-separated, and repeats add to the list; Go's `..._CHACHA20_POLY1305` spelling
    /// without `_SHA256` is accepted. Empty: rustls' defaults (the ECDHE AES-GCM and
    /// CHACHA20 suites). TLS 1.3 suites are always on, as in Go; a list of TLS 1.3 names
    /// only serves TLS 1.3 only. Go's CBC and static-RSA names are dropped with a warning
    /// (rustls has none), and start-up fails if that leaves no TLS 1.2 suite (unless
    /// --tls-min-version=VersionTLS13). Names upstream refuses too (RC4, 3DES, CBC-SHA256)
    /// and unknown names fail start-up.
    #[arg(long, default_value = "", value_delimiter = ',', action = clap::ArgAction::Append)]
    pub cipher_suites: Vec<String>,
    /// Lowest TLS version the TLS listeners accept: VersionTLS12 (empty) or VersionTLS13.
    ///
    /// VersionTLS10 and VersionTLS11 are accepted with a warning and serve TLS 1.2
    /// (rustls has no TLS 1.0 or 1.1).
    #[arg(long, default_value = "")]
    pub tls_min_version: String,
    /// Serve pprof CPU and heap profiles under /debug/pprof/ on the admin port.
    ///
    /// /debug/pprof/profile?seconds=N (CPU) and /debug/pprof/heap (sampled heap, one
    /// sample per 512 KiB allocated, as Go), in the pprof protobuf `go tool pprof` reads;
    /// /debug/pprof/goroutine lists threads and tokio tasks. Costs memory once used: the
    /// CPU profiler (pprof-rs) keeps its 64 MiB sample table from its first profile on;
    /// the debug info parsed to name a profile's functions is dropped once each profile
    /// is written.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub enable_profiling: bool,
    /// Accepted (needs --enable-profiling): Rust has no block or mutex profile like Go's.
    ///
    /// /debug/pprof/block answers 404.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub enable_contention_profiling: bool,
    /// Accepted: Tether bounds what waits for a client in bytes, not packets.
    ///
    /// Each connection's queue towards its client is bounded by the flow-control window
    /// (with an upstream agent, by --stalled-reader-timeout). Must be at least 1.
    #[arg(long, default_value_t = 10)]
    pub frontend_write_channel_size: usize,
    /// Accepted: deprecated upstream, and always on there.
    ///
    /// A connection waiting on a full receive window is counted in the
    /// full_receive_channels gauge.

    #[arg(long, default_value = "true", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub warn_on_channel_limit: bool,
}

fn opt_path(s: &str) -> Option<PathBuf> {
    (!s.is_empty()).then(|| PathBuf::from(s))
}

impl ServerArgs {
    /// `--uds-socket-mode` and `--uds-socket-group`.
    fn socket_access(&self) -> anyhow::Result<tether_core::transport::SocketAccess> {
        let mode = match self.uds_socket_mode.trim() {
            // Upstream creates the socket under umask 0007: owner and group may connect
            // (GCE's non-root kube-apiserver in the socket's group relies on it).
            "" if !self.uds_name.is_empty() => Some(DEFAULT_SOCKET_MODE),
            "" => None,
            m => {
                let bits = u32::from_str_radix(m.trim_start_matches("0o"), 8)
                    .ok()
                    .filter(|b| *b <= 0o777)
                    .ok_or_else(|| {
                        anyhow::anyhow!("--uds-socket-mode {m:?} is not an octal mode like 0660")
                    })?;
                Some(bits)
            }
        };
        let group = match self.uds_socket_group.trim() {
            "" => None,
            g => Some(g.parse::<u32>().map_err(|_| {
                anyhow::anyhow!("--uds-socket-group {g:?} is not a numeric group ID (e.g. 65532)")
            })?),
        };
        if (!self.uds_socket_mode.trim().is_empty() || group.is_some()) && self.uds_name.is_empty()
        {
            bail!("--uds-socket-mode and --uds-socket-group apply to the --uds-name socket: set --uds-name too");
        }
        Ok(tether_core::transport::SocketAccess { mode, group })
    }

    /// --enable-contention-profiling needs --enable-profiling; queues hold something.
    fn check_profiling_and_queues(&self) -> anyhow::Result<()> {
        if self.enable_contention_profiling && !self.enable_profiling {
            bail!("--enable-contention-profiling needs --enable-profiling");
        }
        if self.frontend_write_channel_size == 0 {
            bail!("--frontend-write-channel-size must be at least 1");
        }
        Ok(())
    }

    /// Validates the flags into a [`ServerConfig`].
    pub fn config(&self) -> anyhow::Result<ServerConfig> {
        super::check_positionals(&self.positional, "proxy-server")?;
        let policy = self.tls_policy()?;
        self.check_profiling_and_queues()?;
        let strategies = tether_server::parse_strategies(&self.proxy_strategies)
            .map_err(|e| anyhow::anyhow!("--proxy-strategies: {e}"))?;
        let agent_auth = self.agent_auth()?;
        let lease = self.lease()?;
        let nodes = self.nodes(&strategies, agent_auth.is_some())?;
        if self.cert_reload_interval.is_zero() {
            bail!("--cert-reload-interval must be positive (e.g. 1m)");
        }
        let listen = self.frontend_listen(&policy)?;
        let agent_tls = self.agent_tls(&policy)?;
        self.check_agent_streams(agent_auth.is_some())?;
        let agent_dead_link = dead_link(self.dead_link_timeout)?;
        let server_id = if self.server_id.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            self.server_id.clone()
        };
        let endpoints = self.endpoints(&policy)?;
        Ok(ServerConfig {
            server_id,
            server_count: self.server_count,
            frontends: vec![FrontendConfig {
                mode: self.mode,
                listen,
            }],
            agent_addr: endpoints.agent,
            reuse_port: self.reuse_port,
            agent_tls,
            agent_keepalive: grpc_server_keepalive(self.keepalive_time),
            frontend_keepalive: grpc_server_keepalive(self.frontend_keepalive_time),
            agent_dead_link,
            health_addr: Some(endpoints.health),
            admin_addr: Some(endpoints.admin),
            admin_tls: endpoints.admin_tls,
            router: self.router(strategies),
            channel_size: self.xfr_channel_size,
            graceful_shutdown_timeout: self.graceful_shutdown_timeout,
            agent_auth,
            require_agent_identity_match: self.require_agent_identity_match,
            agent_websocket: self.agent_websocket,
            agent_quic_addr: (self.agent_quic_port != 0)
                .then(|| std::net::SocketAddr::new(endpoints.agent.ip(), self.agent_quic_port)),
            cert_reload_interval: self.cert_reload_interval,
            lease,
            nodes,
            admission: self.admission(),
            profiling: self.enable_profiling,
            agents_access: tether_server::AgentsAccess::for_bind(
                Some(endpoints.admin),
                opt_path(&self.kubeconfig),
            ),
            audit: self.audit.config()?,
        })
    }

    /// The TLS versions and cipher suites from --tls-min-version and --cipher-suites,
    /// warning about those rustls cannot serve (they are dropped).
    fn tls_policy(&self) -> anyhow::Result<tether_core::tls::TlsPolicy> {
        let (policy, not_offered) = tether_core::tls::TlsPolicy::parse(
            &self.cipher_suites.join(","),
            &self.tls_min_version,
        )
        .map_err(anyhow::Error::msg)?;
        if let Some(warning) = not_offered {
            tracing::warn!("{warning}");
        }
        Ok(policy)
    }

    /// The server's Lease, with --enable-lease-controller.
    fn lease(&self) -> anyhow::Result<Option<tether_server::lease::LeaseConfig>> {
        if !self.enable_lease_controller {
            return Ok(None);
        }
        Ok(Some(tether_server::lease::LeaseConfig {
            namespace: self.lease_namespace.clone(),
            labels: tether_server::lease::parse_labels(&self.lease_label)
                .map_err(|e| anyhow::anyhow!("--lease-label: {e}"))?,
            kubeconfig: opt_path(&self.kubeconfig),
            renew_interval: tether_server::lease::RENEW_INTERVAL,
            duration: tether_server::lease::LEASE_DURATION,
        }))
    }

    /// Watching Node objects: for routing pod IPs (--watch-node-pod-cidrs, which needs
    /// the destCIDR strategy) and for pinning nodes to authenticated agents.
    fn nodes(
        &self,
        strategies: &[tether_server::Strategy],
        token_auth: bool,
    ) -> anyhow::Result<Option<tether_server::nodes::WatchConfig>> {
        if self.watch_node_pod_cidrs && !strategies.contains(&tether_server::Strategy::DestCidr) {
            bail!("--watch-node-pod-cidrs routes pod IPs by destCIDR: add destCIDR to --proxy-strategies (e.g. destHost,destCIDR,default)");
        }
        // Token-authenticated agents prove a node; its Node object proves addresses.
        // With certificates, the Node objects pin each node's names and addresses to
        // its agent from start-up on, not only once its agent has connected.
        let watch_nodes = self.watch_node_pod_cidrs
            || token_auth
            || (!self.kubeconfig.is_empty() && !self.cluster_ca_cert.is_empty());
        Ok(watch_nodes.then(|| tether_server::nodes::WatchConfig {
            kubeconfig: opt_path(&self.kubeconfig),
            route_pod_ips: self.watch_node_pod_cidrs,
        }))
    }

    /// The frontend's listener: the --uds-name socket, else TCP with mutual TLS.
    fn frontend_listen(&self, policy: &tether_core::tls::TlsPolicy) -> anyhow::Result<Listen> {
        if !self.uds_name.is_empty() {
            if self.server_port != 0 {
                bail!(
                    "--server-port must be 0 when --uds-name is set (got {}); add --server-port=0",
                    self.server_port
                );
            }
            return Ok(Listen::Uds {
                path: self.uds_name.clone().into(),
                delete_existing: self.delete_existing_uds_file,
                access: self.socket_access()?,
            });
        }
        let (Some(cert), Some(key), Some(ca)) = (
            opt_path(&self.server_cert),
            opt_path(&self.server_key),
            opt_path(&self.server_ca_cert),
        ) else {
            bail!("a TCP frontend needs --server-cert, --server-key and --server-ca-cert (mutual TLS is mandatory), or use --uds-name with --server-port=0");
        };
        Ok(Listen::Tcp {
            addr: bind_addr(
                &self.server_bind_address,
                self.server_port,
                "server-bind-address",
            )?,
            tls: TlsFiles {
                cert,
                key,
                ca: Some(ca),
                policy: policy.clone(),
            },
            clients: tether_server::FrontendClients {
                names: self
                    .frontend_client_names
                    .iter()
                    .map(|n| n.trim().to_string())
                    .filter(|n| !n.is_empty())
                    .collect(),
                allow_shared_ca: self.unsafe_shared_frontend_ca,
            },
        })
    }

    /// The agent listener's TLS: --cluster-cert and --cluster-key (else the frontend's),
    /// verifying agents by --cluster-ca-cert when given.
    fn agent_tls(&self, policy: &tether_core::tls::TlsPolicy) -> anyhow::Result<TlsFiles> {
        let agent_cert = opt_path(&self.cluster_cert).or_else(|| opt_path(&self.server_cert));
        let agent_key = opt_path(&self.cluster_key).or_else(|| opt_path(&self.server_key));
        let (Some(agent_cert), Some(agent_key)) = (agent_cert, agent_key) else {
            bail!("the agent listener always uses TLS: set --cluster-cert and --cluster-key (or --server-cert and --server-key)");
        };
        Ok(TlsFiles {
            cert: agent_cert,
            key: agent_key,
            ca: opt_path(&self.cluster_ca_cert),
            policy: policy.clone(),
        })
    }

    /// Checks the agent streams' settings: the stall timeout, the queue size, and that
    /// agents are authenticated (by certificate or `token_auth`) unless explicitly not.
    fn check_agent_streams(&self, token_auth: bool) -> anyhow::Result<()> {
        if self.stalled_reader_timeout.is_zero() {
            bail!("--stalled-reader-timeout must be positive (e.g. 30s)");
        }
        if self.xfr_channel_size == 0 {
            bail!("--xfr-channel-size must be at least 1");
        }
        if !token_auth && self.cluster_ca_cert.is_empty() {
            if !self.unsafe_allow_unauthenticated_agents {
                bail!("agents are not authenticated: set --cluster-ca-cert (agent client certificates) or --agent-namespace, --agent-service-account and --authentication-audience (ServiceAccount tokens); --unsafe-allow-unauthenticated-agents accepts any agent");
            }
            if self.require_agent_identity_match {
                bail!("--require-agent-identity-match needs authenticated agents: set --cluster-ca-cert or token authentication");
            }
        }
        Ok(())
    }

    /// The health, admin and agent listeners' addresses, and the admin port's TLS.
    fn endpoints(&self, policy: &tether_core::tls::TlsPolicy) -> anyhow::Result<Endpoints> {
        let health = bind_addr(
            &self.health_bind_address,
            self.health_port,
            "health-bind-address",
        )?;
        let admin = bind_addr(
            &self.admin_bind_address,
            self.admin_port,
            "admin-bind-address",
        )?;
        let admin_tls = match (opt_path(&self.admin_cert), opt_path(&self.admin_key)) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert,
                key,
                ca: None,
                policy: policy.clone(),
            }),
            (None, None) => None,
            (Some(_), None) => {
                bail!("--admin-cert needs --admin-key (the certificate's private key)")
            }
            (None, Some(_)) => {
                bail!("--admin-key needs --admin-cert (the certificate for TLS on the admin port)")
            }
        };
        let agent = bind_addr(
            &self.agent_bind_address,
            self.agent_port,
            "agent-bind-address",
        )?;
        Ok(Endpoints {
            health,
            admin,
            admin_tls,
            agent,
        })
    }

    /// The router's settings: `strategies`, timeouts, flow control and trust.
    fn router(&self, strategies: Vec<tether_server::Strategy>) -> RouterConfig {
        RouterConfig {
            strategies,
            backend_dial_timeout: (!self.backend_dial_timeout.is_zero())
                .then_some(self.backend_dial_timeout),
            flow_control: self.flow_control,
            stall_timeout: self.stalled_reader_timeout,
            trust_claims: self.unsafe_trust_agent_identifiers,
            max_agent_streams: self.max_agent_streams,
            agent_wait: self.wait_for_agent,
        }
    }
}

/// Where the server listens besides its frontend, from the flags.
struct Endpoints {
    /// The health listener (--health-bind-address, --health-port).
    health: std::net::SocketAddr,
    /// The admin listener (--admin-bind-address, --admin-port).
    admin: std::net::SocketAddr,
    /// The admin port's TLS (--admin-cert, --admin-key); `None`: plain HTTP.
    admin_tls: Option<TlsFiles>,
    /// The agent listener (--agent-bind-address, --agent-port).
    agent: std::net::SocketAddr,
}

impl ServerArgs {
    /// The TCP listeners' caps, from the flags and the open-file limit.
    fn admission(&self) -> tether_core::admission::AdmissionLimits {
        let nofile = tether_ops::limits::open_file_limit().unwrap_or(FEW_OPEN_FILES);
        let mut limits = tether_core::admission::AdmissionLimits::for_open_files(nofile);
        if self.max_connections > 0 {
            limits.max_connections = self.max_connections;
        }
        limits.max_handshakes = self.max_concurrent_handshakes;
        limits.max_handshakes_per_source = self.max_handshakes_per_source;
        limits.max_handshakes_per_prefix = self.max_handshakes_per_prefix;
        limits
    }

    /// Says at start-up which unsafe compatibility modes are on, and when verified routing
    /// has less to pin dials by than it could.
    fn warn_unsafe(&self) {
        let any_agent = ["default", "defaultRoute"]
            .iter()
            .any(|s| self.proxy_strategies.split(',').any(|p| p.trim() == *s));
        if !self.cluster_ca_cert.is_empty()
            && self.kubeconfig.is_empty()
            && !self.unsafe_trust_agent_identifiers
            && any_agent
        {
            tracing::warn!("agents authenticate by certificate and the server watches no Nodes (no --kubeconfig): a node's names and addresses are pinned to its agent only once that agent has connected since start-up; until then a dial to them may go to any agent that --proxy-strategies' default or defaultRoute allows. Give --kubeconfig (tether certs init writes konnectivity-server.conf) so that Node objects pin them from the start");
        }
        if self.unsafe_trust_agent_identifiers {
            tracing::warn!("UNSAFE: --unsafe-trust-agent-identifiers routes dials by identifiers agents claim; a compromised node can take other nodes' traffic by claiming their names and addresses");
        }
        if self.unsafe_allow_unauthenticated_agents
            && self.cluster_ca_cert.is_empty()
            && self.agent_namespace.is_empty()
        {
            tracing::warn!("UNSAFE: --unsafe-allow-unauthenticated-agents: agents are not authenticated; anyone who reaches the agent port can serve dials");
        }
    }

    fn agent_auth(&self) -> anyhow::Result<Option<tether_server::auth::TokenAuthConfig>> {
        let parts = [
            &self.agent_namespace,
            &self.agent_service_account,
            &self.authentication_audience,
        ];
        let set = parts.iter().filter(|p| !p.is_empty()).count();
        if set == 0 {
            let admin_loopback = self
                .admin_bind_address
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
            if !self.kubeconfig.is_empty()
                && !self.enable_lease_controller
                && !self.watch_node_pod_cidrs
                && self.cluster_ca_cert.is_empty()
                && admin_loopback
            {
                // Upstream accepts it too.
                tracing::warn!("--kubeconfig is unused: the server reads it only for agent token authentication (--agent-namespace, --agent-service-account, --authentication-audience), watching Nodes (with --cluster-ca-cert or --watch-node-pod-cidrs), --enable-lease-controller or authorizing /agents on a non-loopback --admin-bind-address");
            }
            return Ok(None);
        }
        if set != 3 {
            bail!("--agent-namespace, --agent-service-account and --authentication-audience go together; set all three");
        }
        if !self.cluster_ca_cert.is_empty() {
            bail!("agent token authentication and --cluster-ca-cert (agent client certificates) are exclusive; drop one");
        }
        let kubeconfig = opt_path(&self.kubeconfig);
        if let Some(k) = &kubeconfig {
            std::fs::metadata(k)
                .with_context(|| format!("--kubeconfig {}: cannot read the file", k.display()))?;
        }
        Ok(Some(tether_server::auth::TokenAuthConfig {
            namespace: self.agent_namespace.clone(),
            service_account: self.agent_service_account.clone(),
            audience: self.authentication_audience.clone(),
            kubeconfig,
            qps: if self.kubeconfig_qps > 0.0 {
                self.kubeconfig_qps
            } else {
                50.0
            },
            burst: if self.kubeconfig_burst > 0 {
                self.kubeconfig_burst
            } else {
                100
            },
        }))
    }
}

/// The `--uds-name` socket's mode without `--uds-socket-mode`: upstream's (umask 0007).
const DEFAULT_SOCKET_MODE: u32 = 0o770;

/// Below this open-file limit the server says at start-up how to raise it.
const FEW_OPEN_FILES: u64 = 8192;

/// Warns when the open-file limit (already raised to the hard limit) leaves room for
/// only a few thousand agents and tunnels.
fn warn_if_few_open_files() {
    if let Ok(limit) = tether_ops::limits::open_file_limit() {
        if limit < FEW_OPEN_FILES {
            tracing::warn!(
                limit,
                "the open-file limit is low: every agent stream and every tunnel holds a descriptor; raise the hard limit (LimitNOFILE= in a systemd unit, the container runtime's nofile ulimit) for clusters of more than a few thousand nodes"
            );
        }
    }
}

/// Runs the server until SIGTERM/SIGINT.
pub fn main(args: ServerArgs) -> anyhow::Result<()> {
    args.log.init()?;
    let config = args.config()?;
    args.warn_unsafe();
    super::block_on(args.worker_threads, async move {
        warn_if_few_open_files();
        let server_id = config.server_id.clone();
        let bound = Server::bind(config)
            .await
            .context("server start-up failed")?;
        let addrs = bound.addrs().clone();
        tracing::info!(
            server_id = %server_id,
            agent = %addrs.agent,
            agent_quic = %addrs.agent_quic.map(|a| a.to_string()).unwrap_or_default(),
            frontend = %addrs.frontends.join(","),
            health = %addrs.health.map(|a| a.to_string()).unwrap_or_default(),
            admin = %addrs.admin.map(|a| a.to_string()).unwrap_or_default(),
            "server listening"
        );
        let drain = tokio_util::sync::CancellationToken::new();
        tokio::spawn({
            let drain = drain.clone();
            async move {
                tether_ops::shutdown::signal().await;
                drain.cancel();
            }
        });
        bound.run(drain).await;
        Ok(())
    })
}

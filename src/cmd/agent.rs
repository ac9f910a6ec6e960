//! `tether agent`: flags (upstream names and defaults), validation, and running the
//! agent: the first SIGTERM drains, a second one (or --drain-timeout) exits.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use tether_agent::{Agent, AgentConfig};
use tether_core::identifiers::AgentIdentifiers;
use tokio_util::sync::CancellationToken;

use super::{bind_addr, duration, go_bool, LogArgs};

/// The system CA bundle used when --ca-cert is not given (as upstream uses the system pool).
const SYSTEM_CA: &str = "/etc/ssl/certs/ca-certificates.crt";

/// grpc-go raises a client's keepalive interval to at least this (0 included).
const GRPC_MIN_CLIENT_KEEPALIVE: Duration = Duration::from_secs(10);

/// Agent flags.
#[derive(Args, Debug)]
// Go's pflag: a repeated flag's last value wins (managed offerings append overrides
// after their defaults); list flags append.
#[command(args_override_self = true)]
pub struct AgentArgs {
    /// Proxy server host name or IP, also the name its certificate must carry.
    ///
    /// One address (a load balancer's), or a comma-separated list of every server
    /// (`HOST`, `HOST:PORT` or `[IPV6]:PORT`; no load balancer needed, a Tether
    /// extension). A host without a port uses --proxy-server-port.
    #[arg(long, default_value = "127.0.0.1")]
    pub proxy_server_host: String,
    /// Proxy server agent port (for hosts given without one).
    #[arg(long, default_value_t = 8091)]
    pub proxy_server_port: u16,
    /// CA bundle that signs the server's certificate (empty: the system bundle).
    ///
    /// The system bundle is /etc/ssl/certs/ca-certificates.crt.
    #[arg(long, default_value = "")]
    pub ca_cert: String,
    /// Client certificate presented to the server (with --agent-key).
    #[arg(long, default_value = "")]
    pub agent_cert: String,
    /// Client key (with --agent-cert).
    #[arg(long, default_value = "")]
    pub agent_key: String,
    /// ALPN protocols offered besides h2, comma-separated.
    ///
    /// h2 is added at the end of the list unless it is named in it, as grpc-go's
    /// credentials do.
    #[arg(long, value_delimiter = ',')]
    pub alpn_proto: Vec<String>,
    /// Egress proxy to reach the servers through (empty: from the environment).
    ///
    /// Empty reads HTTPS_PROXY, else https_proxy, as grpc-go (upstream's agent) does;
    /// `direct` or `none` never uses a proxy. The URL is http://[USER:PASSWORD@]HOST:PORT
    /// (CONNECT over plain TCP) or https://... (CONNECT inside TLS to the proxy, verified
    /// with --egress-proxy-ca-cert); without a scheme it is http://, without a port 80 or
    /// 443. User info is sent as `Proxy-Authorization: Basic`. Servers that NO_PROXY (else
    /// no_proxy) covers, `localhost` and loopback addresses are reached directly, by Go's
    /// rules: host names (a leading `.` or none matches subdomains), IPs, CIDRs, each with
    /// an optional `:PORT`, or `*`. Prefer the environment from a Secret for a password:
    /// a flag shows in the process list. Tether only.
    #[arg(long, default_value = "")]
    pub egress_proxy: String,
    /// CA bundle that signs an https:// egress proxy's certificate (empty: the system bundle).
    ///
    /// Reloaded on change, as --ca-cert is. Unused without an https:// proxy. Tether
    /// only.
    #[arg(long, default_value = "")]
    pub egress_proxy_ca_cert: String,
    /// Service-account token file, sent as a bearer token (re-read on every connect).
    #[arg(long, default_value = "")]
    pub service_account_token_path: String,
    /// This agent's ID, sent as `agentid` (empty: a random UUID).
    #[arg(long, env = "PROXY_AGENT_ID", default_value = "")]
    pub agent_id: String,
    /// What this agent can reach: host=..&ipv4=..&ipv6=..&cidr=..&default-route=true.
    ///
    /// A Tether server routes only by the identifiers it verified (by the agent's
    /// certificate or its token's node) unless it runs with
    /// --unsafe-trust-agent-identifiers. A value that does not parse is logged and
    /// ignored.
    #[arg(long, default_value = "")]
    pub agent_identifiers: String,
    /// First reconnect delay (grows x1.5 with 10% jitter).
    #[arg(long, default_value = "1s", value_parser = duration)]
    pub sync_interval: Duration,
    /// Largest reconnect delay.
    #[arg(long, default_value = "10s", value_parser = duration)]
    pub sync_interval_cap: Duration,
    /// Accepted: readiness follows the streams directly.
    #[arg(long, default_value = "1s", value_parser = duration)]
    pub probe_interval: Duration,
    /// Keep dialling even when connected to every known server.
    ///
    /// Finds new servers behind a load balancer when their count is not announced.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub sync_forever: bool,
    /// Keepalive interval to the server: HTTP/2 pings, or WebSocket pings.
    ///
    /// A stream that has heard nothing for this long pings the server. 0 is 10s,
    /// grpc-go's minimum; shorter positive values are honoured, where grpc-go raises them
    /// to 10s. Each time a server closes the connection for pinging too often (GOAWAY
    /// ENHANCE_YOUR_CALM, grpc-go's `too_many_pings`), the interval is doubled for later
    /// streams, as grpc-go clients do. Keep it below the idle timeout of any proxy on the
    /// way (nginx's proxy_read_timeout is 60s by default), or the proxy cuts idle streams
    /// and their tunnels. However long it is, a silent connection is closed after
    /// --dead-link-timeout.
    #[arg(long, default_value = "1h", value_parser = duration)]
    pub keepalive_time: Duration,
    /// Close a server connection that has been silent this long, and redial.
    ///
    /// Whatever --keepalive-time is, the kernel watches the TCP connection: idle, it is
    /// probed after half of this and given up after three unanswered probes a sixth of it
    /// apart; data left unacknowledged this long ends it too (TCP_USER_TIMEOUT). Probes
    /// are invisible to HTTP/2, so no server ping policy objects. 0 leaves the kernel's
    /// defaults; otherwise at least 2s. Tether only.
    #[arg(long, default_value = "30s", value_parser = duration)]
    pub dead_link_timeout: Duration,
    /// Packets queued towards the server on each stream.
    #[arg(long, default_value_t = 150)]
    pub xfr_channel_size: usize,
    /// Offer per-connection credit flow control to the server (`tether-flow-window`).
    ///
    /// Upstream servers ignore the offer. `false` behaves like an upstream agent. Tether
    /// only.
    #[arg(long, default_value = "true", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub flow_control: bool,
    /// Without flow control (an upstream server): how long a target may leave data unread.
    ///
    /// A connection whose target has left its queued data (4 MiB) unread for this long is
    /// closed instead of holding up the stream. Tether only.
    #[arg(long, default_value = "30s", value_parser = duration)]
    pub stalled_reader_timeout: Duration,
    /// Target dial timeout (upstream hard-codes 5s). Tether only.
    #[arg(long, default_value = "5s", value_parser = duration)]
    pub dial_timeout: Duration,
    /// After the first SIGTERM, exit at the latest after this.
    ///
    /// The agent sends DRAIN and keeps serving (new dials included, as upstream's agent)
    /// for this long, then exits; a second signal exits at once. Keep it below the pod's
    /// terminationGracePeriodSeconds. Tether only.
    #[arg(long, default_value = "30s", value_parser = duration)]
    pub drain_timeout: Duration,
    /// When /readyz says ready: with a stream up to any server (as upstream), or to
    /// every server the agent knows of (the server count, or the Leases counted).
    ///
    /// every-server keeps a rolling update (maxSurge, `tether rollout agents`) from
    /// draining a node's old agent before its new one reaches every server; while a
    /// server is down it holds the update back. Tether only.
    #[arg(long, value_enum, default_value = "any-server")]
    pub ready_when: ReadyWhen,
    /// How streams to the servers are carried, in order of preference: h2, websocket,
    /// quic.
    ///
    /// h2 is gRPC over HTTP/2, as upstream (any server, Tether or upstream). websocket
    /// carries the same packets over HTTP/1.1 (a Tether server), for paths that pass
    /// only HTTP/1.1: a TLS-terminating reverse proxy, an L7 firewall. quic carries
    /// them over QUIC on UDP (a Tether server with --agent-quic-port), a stream per
    /// tunnel, for lossy and roaming links; it passes no HTTP proxy. A stream that
    /// cannot be opened over one is tried over the next (each try within 20 s), and the
    /// one that worked is tried first from then on. Tether only.
    #[arg(long, value_delimiter = ',', default_value = "h2")]
    pub transports: Vec<String>,
    /// The server's UDP port for --transports=quic (0 = the number of
    /// --proxy-server-port). Tether only.
    #[arg(long, default_value_t = 0)]
    pub proxy_server_quic_port: u16,
    /// Threads running the agent's tasks (0 = one per CPU).
    ///
    /// One thread carries an agent's traffic with the fewest cross-thread wake-ups and
    /// the least memory; raise it on nodes whose tunnels carry more than one core can
    /// encrypt. Tether only.
    #[arg(long, default_value_t = 1)]
    pub worker_threads: usize,
    /// Health bind address (empty = all interfaces).
    #[arg(long, default_value = "")]
    pub health_server_host: String,
    /// Health port: /healthz, /readyz and /metrics.
    ///
    /// /readyz answers 503 until a stream to a server is up.
    #[arg(long, default_value_t = 8093)]
    pub health_server_port: u16,
    /// Admin bind address.
    #[arg(long, default_value = "127.0.0.1")]
    pub admin_bind_address: String,
    /// Admin port: /metrics, and the pprof profiles with --enable-profiling.
    #[arg(long, default_value_t = 8094)]
    pub admin_server_port: u16,

    /// Which targets servers may have this agent dial: node or any.
    ///
    /// node (the default): the kubelet on this node's addresses (--node-ip, and its Node
    /// object's InternalIP and ExternalIP addresses, at the port the Node gives, else
    /// 10250) and their NodePorts (--service-node-port-range), pods in the Node's pod
    /// ranges (spec.podCIDRs), the Service ranges of
    /// --service-cidr, and what --dial-allow adds. A name is resolved by the agent and
    /// judged by its addresses. Anything else is refused: the apiserver gets the error,
    /// the agent logs it and counts it in tether_agent_dial_refusals_total. any: dial
    /// whatever a server asks, as upstream's agent does; then a stolen frontend
    /// credential or a compromised server can use every agent to reach its node's
    /// network (logged as UNSAFE at start). Tether only.
    ///
    /// Unset, an agent whose flags name nothing of its node (no --node-name, --node-ip,
    /// --service-cidr or --dial-allow: an upstream command line) dials anything, logged
    /// as UNSAFE; `--dial-policy=node` given so refuses to start instead.
    #[arg(long, value_parser = ["node", "any"])]
    pub dial_policy: Option<String>,
    /// More targets the dial policy allows, comma-separated or repeated.
    ///
    /// Each is a network or address (10.20.0.0/16, 192.168.1.5, fd00::/64), this node's
    /// addresses (`node`, with a port: hostNetwork pods' ports), or a host name
    /// (registry.example.com, or *.example.com for the names under it), with an
    /// optional :PORT or :LOW-HIGH (IPv6 in brackets when a port follows:
    /// [fd00::/64]:443). A name rule allows whatever the name resolves to. Tether only.
    #[arg(long, value_delimiter = ',')]
    pub dial_allow: Vec<String>,
    /// The cluster's Service ranges (kube-apiserver's --service-cluster-ip-range), comma-separated.
    ///
    /// Webhooks and aggregated APIs are dialled at their Service's ClusterIP (unless
    /// kube-apiserver runs --enable-aggregator-routing, which dials pod IPs). Empty:
    /// no ClusterIP is allowed. Tether only.
    #[arg(long, value_delimiter = ',')]
    pub service_cidr: Vec<String>,
    /// The NodePort range the dial policy allows on the node's addresses (LOW-HIGH; empty: none).
    ///
    /// kube-apiserver's --service-node-port-range: the CCM's load balancers dial a
    /// Service's NodePorts on its nodes. Tether only.
    #[arg(long, default_value = "30000-32767")]
    pub service_node_port_range: String,
    /// This agent's node, whose Node object the dial policy reads (needs get on nodes).
    ///
    /// Set it from the downward API (spec.nodeName). The Node is read with --kubeconfig,
    /// else the in-cluster configuration, at start and every 30s, and again when a dial
    /// would be refused. Empty: no pod range is known. Tether only.
    #[arg(long, default_value = "")]
    pub node_name: String,
    /// This node's addresses, comma-separated, for the dial policy before (or without)
    /// its Node object.
    ///
    /// Set it from the downward API (status.hostIP). Tether only.
    #[arg(long, value_delimiter = ',')]
    pub node_ip: Vec<String>,

    /// How often certificate files are checked for changes (SIGHUP reloads at once).
    ///
    /// New connections use the new material; established streams keep going. A reload
    /// that fails (a half-written file, a key that does not match) keeps the old
    /// certificates and logs why. Tether only.
    #[arg(long, default_value = "1m", value_parser = duration)]
    pub cert_reload_interval: Duration,
    #[command(flatten)]
    pub audit: super::AuditArgs,

    #[command(flatten)]
    pub log: LogArgs,
    /// Arguments that are not flags: ignored with a warning, as proxy-agent ignores them.
    #[arg(hide = true)]
    pub positional: Vec<String>,

    /// Take the number of servers from their live Leases.
    ///
    /// One list, then a watch, with --kubeconfig or the in-cluster configuration; needs
    /// get, list and watch on leases in --lease-namespace.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub count_server_leases: bool,
    /// Kubeconfig for counting leases and reading the Node (empty = in-cluster configuration).
    ///
    /// Read with --count-server-leases, and with --node-name under --dial-policy=node.
    #[arg(long, default_value = "")]
    pub kubeconfig: String,
    /// Namespace of the servers' Leases.
    #[arg(long, default_value = "kube-system")]
    pub lease_namespace: String,
    /// Label selector of the servers' Leases.
    ///
    /// `--lease-label` is v0.36.0's name for it (a hidden alias on upstream's main); both
    /// are accepted.
    #[arg(
        long,
        alias = "lease-label",
        default_value = "k8s-app=konnectivity-server"
    )]
    pub lease_label_selector: String,
    /// Where the number of servers comes from: default or max (empty is default).
    ///
    /// default: the live Leases with --count-server-leases, else the servers'
    /// `servercount`; max: the larger of the two.
    #[arg(long, default_value = "default", value_parser = ["", "default", "max"])]
    pub server_count_source: String,
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
    /// Accepted: Tether always talks JSON to the apiserver.
    #[arg(long, default_value = "application/vnd.kubernetes.protobuf")]
    pub kube_api_content_type: String,
    /// Accepted: deprecated upstream, and always on there.

    #[arg(long, default_value = "true", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub warn_on_channel_limit: bool,
}

/// A list flag's values, trimmed, without the empty ones.
fn nonempty(v: &[String]) -> Vec<String> {
    v.iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

/// The ALPN offer: `--alpn-proto`'s protocols, then h2 unless listed (as grpc-go's
/// credentials append it).
fn offered_alpn(extra: &[String]) -> Vec<Vec<u8>> {
    let mut alpn: Vec<Vec<u8>> = extra
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| p.as_bytes().to_vec())
        .collect();
    if !alpn.iter().any(|p| p == tether_core::tls::ALPN_H2) {
        alpn.push(tether_core::tls::ALPN_H2.to_vec());
    }
    alpn
}

/// Warns about Service ranges that look wrong: wider than kube-apiserver allows (/12
/// for IPv4, /108 for IPv6: more of the network than Services), or not holding the
/// `kubernetes` Service's ClusterIP (`KUBERNETES_SERVICE_HOST`, unless that is the
/// apiserver's own address, as in clusters without kube-proxy).
fn check_service_ranges(ranges: &[tether_core::identifiers::Cidr], host: Option<String>) {
    for r in ranges {
        let widest = if r.network().is_ipv4() { 12 } else { 108 };
        if r.prefix() < widest {
            tracing::warn!(service_cidr = %r, "--service-cidr is wider than any Service range kube-apiserver takes (/{widest}): the agent dials anything in it; give --service-cluster-ip-range");
        }
    }
    let Some(ip) = host.and_then(|h| h.parse::<std::net::IpAddr>().ok()) else {
        return;
    };
    let family = ranges
        .iter()
        .filter(|r| r.network().is_ipv4() == ip.is_ipv4());
    if family.clone().count() > 0 && !family.clone().any(|r| r.contains(ip)) {
        tracing::warn!(
            kubernetes_service_host = %ip,
            "--service-cidr does not hold KUBERNETES_SERVICE_HOST: unless that is the apiserver's own address (no kube-proxy), --service-cidr is not kube-apiserver's --service-cluster-ip-range"
        );
    }
}

/// Parses `--proxy-server-host`: `HOST`, `HOST:PORT`, `[V6]:PORT`, comma-separated.
fn parse_servers(list: &str, default_port: u16) -> anyhow::Result<Vec<(String, u16)>> {
    let mut out = Vec::new();
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (host, port) = if let Some(rest) = entry.strip_prefix('[') {
            let (h, p) = rest
                .split_once(']')
                .ok_or_else(|| anyhow::anyhow!("--proxy-server-host {entry:?}: missing ']'"))?;
            let port = match p.strip_prefix(':') {
                Some(p) => p
                    .parse()
                    .map_err(|_| anyhow::anyhow!("--proxy-server-host {entry:?}: bad port"))?,
                None => default_port,
            };
            (h.to_string(), port)
        } else {
            match entry.rsplit_once(':') {
                Some((h, p)) if !h.contains(':') => (
                    h.to_string(),
                    p.parse()
                        .map_err(|_| anyhow::anyhow!("--proxy-server-host {entry:?}: bad port"))?,
                ),
                _ => (entry.to_string(), default_port),
            }
        };
        tether_core::tls::server_name(&host)
            .map_err(|e| anyhow::anyhow!("--proxy-server-host: {e}"))?;
        out.push((host, port));
    }
    if out.is_empty() {
        bail!("--proxy-server-host is empty");
    }
    Ok(out)
}

/// `--ready-when`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadyWhen {
    /// A stream is up to some server.
    AnyServer,
    /// A stream is up to every server the agent knows of.
    EveryServer,
}

impl AgentArgs {
    /// Validates the flags into an [`AgentConfig`].
    pub fn config(&self) -> anyhow::Result<AgentConfig> {
        super::check_positionals(&self.positional, "proxy-agent")?;
        // Upstream checks only the identifiers' kinds, so a value such as an unexpanded
        // `ipv4=${HOST_IP}` (in one of its own examples) starts; it can never match a
        // dial, and the server skips it. Say so loudly instead of refusing to start.
        if let Err(e) = AgentIdentifiers::parse(&self.agent_identifiers, true) {
            tracing::warn!(
                "--agent-identifiers: {e}; it is ignored (no dial can match it): fix the value"
            );
        }
        let tls = self.tls()?;
        if self.enable_contention_profiling && !self.enable_profiling {
            bail!("--enable-contention-profiling needs --enable-profiling");
        }
        let servers = parse_servers(&self.proxy_server_host, self.proxy_server_port)?;
        let policy = self.policy()?;
        let reads_node = policy.node_name.is_some() && !policy.any;
        if !self.kubeconfig.is_empty() && !self.count_server_leases && !reads_node {
            // Upstream accepts it too.
            tracing::warn!(
                "--kubeconfig is unused: the agent reads it only with --count-server-leases or --node-name"
            );
        }
        let token_path = self.token_path()?;
        self.check_stream_limits()?;
        let keepalive = self.keepalive();
        let dead_link = super::dead_link(self.dead_link_timeout)?;
        let egress = self.egress()?;
        Ok(AgentConfig {
            servers,
            sync_forever: self.sync_forever,
            lease_count: self.lease_count(),
            count_source: self.count_source(),
            tls,
            cert_reload_interval: self.cert_reload_interval,
            agent_id: if self.agent_id.is_empty() {
                uuid::Uuid::new_v4().to_string()
            } else {
                self.agent_id.clone()
            },
            identifiers: self.agent_identifiers.clone(),
            token_path,
            sync_interval: self.sync_interval,
            sync_interval_cap: self.sync_interval_cap,
            keepalive,
            dead_link,
            dial_timeout: self.dial_timeout,
            channel_size: self.xfr_channel_size,
            flow_control: self.flow_control,
            stall_timeout: self.stalled_reader_timeout,
            profiling: self.enable_profiling,
            egress,
            policy,
            ready_with_every_server: self.ready_when == ReadyWhen::EveryServer,
            transports: self.transports()?,
            quic_port: (self.proxy_server_quic_port != 0).then_some(self.proxy_server_quic_port),
        })
    }

    /// The TLS settings towards the servers: --ca-cert (else the system bundle), the
    /// client certificate and key (both or neither), and the ALPN offer.
    fn tls(&self) -> anyhow::Result<tether_agent::AgentTls> {
        let ca = if self.ca_cert.is_empty() {
            PathBuf::from(SYSTEM_CA)
        } else {
            PathBuf::from(&self.ca_cert)
        };
        let identity = match (self.agent_cert.is_empty(), self.agent_key.is_empty()) {
            (true, true) => None,
            (false, false) => Some((
                PathBuf::from(&self.agent_cert),
                PathBuf::from(&self.agent_key),
            )),
            _ => bail!("--agent-cert and --agent-key go together; set both or neither"),
        };
        let alpn = offered_alpn(&self.alpn_proto);
        Ok(tether_agent::AgentTls { ca, identity, alpn })
    }

    /// --server-count-source.
    fn count_source(&self) -> tether_agent::CountSource {
        match self.server_count_source.as_str() {
            "max" => tether_agent::CountSource::Max,
            _ => tether_agent::CountSource::Default,
        }
    }

    /// --transports: known names, none twice, at least one.
    fn transports(&self) -> anyhow::Result<Vec<tether_agent::Transport>> {
        parse_transports(&self.transports)
    }

    /// --service-account-token-path, checked to exist; `None` when empty.
    fn token_path(&self) -> anyhow::Result<Option<PathBuf>> {
        let token_path = (!self.service_account_token_path.is_empty())
            .then(|| PathBuf::from(&self.service_account_token_path));
        if let Some(p) = &token_path {
            std::fs::metadata(p).with_context(|| {
                format!(
                    "--service-account-token-path {}: cannot read the token file",
                    p.display()
                )
            })?;
        }
        Ok(token_path)
    }

    /// Checks the queue size, the reconnect delays and the dial and stall timeouts.
    fn check_stream_limits(&self) -> anyhow::Result<()> {
        if self.xfr_channel_size == 0 {
            bail!("--xfr-channel-size must be at least 1");
        }
        if self.sync_interval.is_zero() || self.sync_interval_cap < self.sync_interval {
            bail!("--sync-interval must be positive and not above --sync-interval-cap");
        }
        if self.dial_timeout.is_zero() || self.stalled_reader_timeout.is_zero() {
            bail!("--dial-timeout and --stalled-reader-timeout must be positive (e.g. 5s)");
        }
        Ok(())
    }

    /// The HTTP/2 keepalive interval: --keepalive-time, with 0 read as grpc-go's 10s.
    fn keepalive(&self) -> Duration {
        // grpc-go raises 0 (and anything below 10s) to 10s. Tether honours a
        // shorter positive interval (it finds a dead link sooner), but 0 has no
        // meaning of its own: it is grpc-go's 10s.
        if self.keepalive_time.is_zero() {
            tracing::warn!(
                "--keepalive-time=0: pinging every 10s, as grpc-go (and so upstream's agent) does"
            );
            GRPC_MIN_CLIENT_KEEPALIVE
        } else {
            self.keepalive_time
        }
    }

    /// Counting the servers' Leases, with --count-server-leases.
    fn lease_count(&self) -> Option<tether_agent::LeaseCount> {
        self.count_server_leases.then(|| tether_agent::LeaseCount {
            kubeconfig: (!self.kubeconfig.is_empty()).then(|| PathBuf::from(&self.kubeconfig)),
            namespace: self.lease_namespace.clone(),
            selector: self.lease_label_selector.clone(),
        })
    }

    /// The dial policy from --dial-policy, --dial-allow, --service-cidr, --node-name,
    /// --node-ip and --kubeconfig.
    fn policy(&self) -> anyhow::Result<tether_agent::policy::PolicyConfig> {
        use tether_agent::policy::{Allow, PolicyConfig};
        let allow = nonempty(&self.dial_allow)
            .iter()
            .map(|a| Allow::parse(a))
            .collect::<Result<Vec<_>, _>>()?;
        let service_cidrs = self.service_cidrs()?;
        let node_ips = self.node_ips()?;
        let node_name = Some(self.node_name.trim().to_string()).filter(|n| !n.is_empty());
        if let Some(n) = &node_name {
            if n.contains('$') || n.contains('/') {
                bail!("--node-name {n:?} is not a node name (an unexpanded $(NODE_NAME)? set NODE_NAME from spec.nodeName)");
            }
        }
        let node_ports = self.node_ports()?;
        let mut any = self.dial_policy.as_deref() == Some("any");
        let blind = node_name.is_none()
            && node_ips.is_empty()
            && allow.is_empty()
            && service_cidrs.is_empty();
        if blind && self.dial_policy.as_deref() == Some("node") {
            bail!("--dial-policy=node allows nothing without knowing the node: set --node-name (with get on nodes) or --node-ip, and --service-cidr (deploy/konnectivity-agent.yaml)");
        }
        if !any && blind {
            // An upstream command line: nothing says which node this is, so the policy
            // could allow nothing. Dial as upstream's agent does, and say so.
            tracing::warn!(
                "UNSAFE: the dial policy knows nothing of this node (no --node-name, --node-ip, --service-cidr or --dial-allow): \
                 dialling any target, as upstream's agent does; set them (deploy/konnectivity-agent.yaml) to allow only this node's kubelet, its pods and Services"
            );
            any = true;
        }
        check_service_ranges(
            &service_cidrs,
            std::env::var("KUBERNETES_SERVICE_HOST").ok(),
        );
        Ok(PolicyConfig {
            any,
            node_name,
            node_ips,
            service_cidrs,
            allow,
            node_ports,
            kubeconfig: (!self.kubeconfig.is_empty()).then(|| PathBuf::from(&self.kubeconfig)),
        })
    }

    /// --service-cidr's ranges, normalized.
    fn service_cidrs(&self) -> anyhow::Result<Vec<tether_core::identifiers::Cidr>> {
        nonempty(&self.service_cidr)
            .iter()
            .map(|c| {
                c.parse::<tether_core::identifiers::Cidr>()
                    .map(|c| c.normalized())
                    .map_err(|e| {
                        anyhow::anyhow!("--service-cidr {c:?}: {e}; give kube-apiserver's --service-cluster-ip-range")
                    })
            })
            .collect::<anyhow::Result<Vec<_>>>()
    }

    /// --node-ip's addresses, in canonical form.
    fn node_ips(&self) -> anyhow::Result<Vec<std::net::IpAddr>> {
        nonempty(&self.node_ip)
            .iter()
            .map(|ip| {
                ip.parse::<std::net::IpAddr>()
                    .map(tether_agent::policy::rules::canonical)
                    .map_err(|_| {
                        anyhow::anyhow!(
                            "--node-ip {ip:?} is not an IP address (set it from status.hostIP)"
                        )
                    })
            })
            .collect::<anyhow::Result<Vec<_>>>()
    }

    /// --service-node-port-range as a range of ports; `None` when empty.
    fn node_ports(&self) -> anyhow::Result<Option<std::ops::RangeInclusive<u16>>> {
        Ok(match self.service_node_port_range.trim() {
            "" => None,
            r => Some(
                r.split_once('-')
                    .and_then(|(lo, hi)| Some(lo.parse::<u16>().ok()?..=hi.parse::<u16>().ok()?))
                    .filter(|r| *r.start() > 0 && r.start() <= r.end())
                    .ok_or_else(|| {
                        anyhow::anyhow!("--service-node-port-range {r:?} is not LOW-HIGH (e.g. 30000-32767, kube-apiserver's)")
                    })?,
            ),
        })
    }

    /// The egress proxy from --egress-proxy and the environment (HTTPS_PROXY, NO_PROXY).
    fn egress(&self) -> anyhow::Result<tether_agent::proxy::Egress> {
        let ca = (!self.egress_proxy_ca_cert.is_empty())
            .then(|| PathBuf::from(&self.egress_proxy_ca_cert));
        let egress = tether_agent::proxy::Egress::from_flag_and_env(&self.egress_proxy, ca, |k| {
            std::env::var(k).ok()
        })
        .context("--egress-proxy or HTTPS_PROXY")?;
        let https =
            egress.proxy.as_ref().map(|p| p.scheme()) == Some(tether_agent::proxy::Scheme::Https);
        if egress.proxy_ca.is_some() && !https {
            tracing::warn!(
                "--egress-proxy-ca-cert is unused: it verifies an https:// egress proxy only"
            );
        }
        Ok(egress)
    }
}

/// Runs the agent until the drain timeout after a signal, or a second signal.
pub fn main(args: AgentArgs) -> anyhow::Result<()> {
    args.log.init()?;
    let config = args.config()?;
    let audit = args.audit.config()?;
    let health = bind_addr(
        &args.health_server_host,
        args.health_server_port,
        "health-server-host",
    )?;
    let admin = bind_addr(
        &args.admin_bind_address,
        args.admin_server_port,
        "admin-bind-address",
    )?;
    let drain_timeout = args.drain_timeout;
    super::block_on(args.worker_threads, async move {
        // Certificates first: a bad one is reported as such, even when a port is taken.
        let (agent_id, servers) = (config.agent_id.clone(), config.servers.clone());
        let agent = with_audit(Agent::new(config)?, audit.as_ref())?;
        let health = tokio::net::TcpListener::bind(health)
            .await
            .with_context(|| format!("cannot listen on health port {health}"))?;
        let admin = tokio::net::TcpListener::bind(admin)
            .await
            .with_context(|| format!("cannot listen on admin port {admin}"))?;
        tracing::info!(
            %agent_id,
            ?servers,
            health = %health.local_addr()?,
            admin = %admin.local_addr()?,
            "agent starting"
        );
        log_dial_policy(args.dial_policy.as_deref(), &agent);
        let drain = CancellationToken::new();
        let hard_stop = CancellationToken::new();
        agent.serve_health(health, hard_stop.clone());
        agent.serve_admin(admin, hard_stop.clone());
        spawn_signal_handler(&agent, drain.clone(), hard_stop.clone(), drain_timeout);
        agent.run(drain, hard_stop.clone()).await;
        hard_stop.cancel();
        agent.sync_audit().await;
        tracing::info!("agent stopped");
        Ok(())
    })
}

/// The agent writing its audit log to `audit`'s file, when the audit is on.
fn with_audit(
    agent: Agent,
    audit: Option<&tether_ops::audit::AuditConfig>,
) -> anyhow::Result<Agent> {
    Ok(match audit {
        Some(a) => {
            let counters = agent.metrics().audit.clone();
            let log = tether_ops::audit::AuditLog::open(a, counters, "tether-audit")?;
            agent.with_audit(log)
        }
        None => agent,
    })
}

/// Logs the dial policy at start: a warning for --dial-policy=any, else what it allows.
fn log_dial_policy(dial_policy: Option<&str>, agent: &Agent) {
    if dial_policy == Some("any") {
        tracing::warn!(
            "UNSAFE: --dial-policy=any: any server, or anyone holding a frontend credential, may have this agent dial any address its node reaches"
        );
    } else if !agent.policy().config().any {
        tracing::info!(allows = %agent.policy().describe(), "dial policy");
    }
}

/// Spawns the task that drains at the first signal (publishing the deadline), closes
/// connections at their quiet moments in the drain's last seconds, and stops hard at a
/// second signal or after `drain_timeout`.
fn spawn_signal_handler(
    agent: &Agent,
    drain: CancellationToken,
    hard_stop: CancellationToken,
    drain_timeout: Duration,
) {
    let deadline = agent.metrics().drain_deadline.clone();
    let agent = agent.clone();
    tokio::spawn(async move {
        tether_ops::shutdown::signal().await;
        tracing::info!(timeout = ?drain_timeout, "draining; signal again to exit now");
        let end = std::time::SystemTime::now() + drain_timeout;
        let end = end
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        deadline.set(end.as_secs().try_into().unwrap_or(i64::MAX));
        drain.cancel();
        // No server to say DRAIN to and no connection to finish (a node that never
        // reached its servers): nothing to wait for.
        if agent.server_streams() == 0 && agent.open_connections() == 0 {
            tracing::info!("no server stream and no open connection: nothing to drain; exiting");
            hard_stop.cancel();
            return;
        }
        let window = tether_agent::quiet_close_window(drain_timeout);
        let timed_out = async {
            tokio::time::sleep(drain_timeout - window).await;
            tracing::info!(
                open = agent.open_connections(),
                within = ?window,
                "drain ends soon: closing each connection at its first quiet moment"
            );
            agent.close_when_quiet();
            tokio::time::sleep(window).await;
        };
        tokio::select! {
            _ = tether_ops::shutdown::signal() => tracing::info!("second signal: exiting"),
            _ = timed_out => tracing::info!("drain timeout: exiting"),
        }
        hard_stop.cancel();
    });
}

/// `--transports` (the agent's and `tether local`'s): known names, none twice, at least
/// one, in the order given.
pub(crate) fn parse_transports(names: &[String]) -> anyhow::Result<Vec<tether_agent::Transport>> {
    let mut out = Vec::new();
    for name in names.iter().map(|t| t.trim()) {
        let Some(t) = tether_agent::Transport::parse(name) else {
            let known: Vec<_> = tether_agent::Transport::ALL
                .iter()
                .map(|t| t.name())
                .collect();
            bail!(
                "--transports: unknown transport {name:?} (known: {})",
                known.join(", ")
            );
        };
        if out.contains(&t) {
            bail!("--transports: {name} is listed twice");
        }
        out.push(t);
    }
    if out.is_empty() {
        bail!("--transports: name at least one transport (h2, websocket, quic)");
    }
    Ok(out)
}

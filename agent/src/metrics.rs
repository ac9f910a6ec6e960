//! Agent metrics under upstream's names (`konnectivity_network_proxy_agent_*`).

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};
use tether_ops::kubeclient::CallMetrics;

use crate::lease_count::LeaseMetrics;
use tether_ops::metrics::{Catalog, CertExpiry, PacketCounters};

const NAMESPACE: &str = "konnectivity_network_proxy";
const SUBSYSTEM: &str = "agent";
/// Upstream's agent `latencyBuckets` (5 ms to 30 s).
const LATENCY_BUCKETS: [f64; 7] = [0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 30.0];

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help)
        .namespace(NAMESPACE)
        .subsystem(SUBSYSTEM)
}

/// Upstream's agent histogram options: its namespace, subsystem and latency buckets.
fn hopts(name: &str, help: &str) -> HistogramOpts {
    HistogramOpts::new(name, help)
        .namespace(NAMESPACE)
        .subsystem(SUBSYSTEM)
        .buckets(LATENCY_BUCKETS.to_vec())
}

/// A counter of the agent's lease calls of one verb, by HTTP code and reason.
fn lease_calls(catalog: &Catalog, name: &str, verb: &str) -> IntCounterVec {
    catalog.made(IntCounterVec::new(
        opts(name, &format!("Count of server lease {verb} calls made by the agent to the k8s apiserver, labeled by HTTP response code and reason")),
        &["http_response_code", "reason"],
    ))
}

tether_ops::metric_set! {
    /// Every agent metric, each declared once.
    pub struct Metrics in catalog {
        /// Time to dial a target.
        pub dial_duration: Histogram = catalog.made(Histogram::with_opts(hopts(
            "dial_duration_seconds",
            "Latency of dial to the remote endpoint in seconds",
        ))),
        /// Failed target dials by reason (timeout, refused, unknown).
        pub dial_failures: IntCounterVec = catalog.made(IntCounterVec::new(
            opts(
                "endpoint_dial_failure_total",
                "Number of failures dialing the remote endpoint, by reason (example: timeout).",
            ),
            &["reason"],
        )),
        /// Streams to servers currently open.
        pub open_server_connections: IntGauge = catalog.made(IntGauge::with_opts(opts(
            "open_server_connections",
            "Current number of open server connections.",
        ))),
        /// Streams to servers currently open, by transport.
        pub server_streams: IntGaugeVec = catalog.made(IntGaugeVec::new(
            Opts::new(
                "tether_agent_server_streams",
                "Open streams to proxy servers by transport: h2 (gRPC over HTTP/2, as upstream), websocket (over WebSocket on HTTP/1.1), quic (over QUIC).",
            ),
            &["transport"],
        )),
        /// Attempts over one transport that failed and fell back to the next.
        pub transport_fallbacks: IntCounterVec = catalog.made(IntCounterVec::new(
            Opts::new(
                "tether_agent_transport_fallbacks_total",
                "Attempts to open a stream that failed over one transport (label: the transport that failed) and went on to the next one --transports lists.",
            ),
            &["transport"],
        )),
        /// Servers the agent was told about (`servercount`).
        pub known_server_count: IntGauge = catalog.made(IntGauge::with_opts(opts(
            "known_server_count",
            "Current number of servers agent is trying to connect to.",
        ))),
        /// Target connections currently open.
        pub open_endpoint_connections: IntGauge = catalog.made(IntGauge::with_opts(opts(
            "open_endpoint_connections",
            "Current number of open endpoint connections.",
        ))),
        /// Packets by direction (0 = from_server, 1 = to_server) and type. Upstream's
        /// segments: what the agent receives travels to_agent, what it sends from_agent
        /// (indexes FROM_SERVER and TO_SERVER).
        pub packets: PacketCounters = catalog.add(PacketCounters::new(
            "konnectivity_network_proxy_agent_stream_packets_total",
            "Count of packets processed, by segment and packet type (example: from_agent, DIAL_RSP).",
            &["to_agent", "from_agent"],
        )),
        /// Stream errors by direction.
        pub stream_errors: IntCounterVec = catalog.made(IntCounterVec::new(
            opts(
                "stream_errors_total",
                "Count of gRPC stream errors, by segment, grpc Code, packet type. (example: from_agent, Code.Unavailable, DIAL_RSP)",
            ),
            &["segment", "code", "packet_type"],
        )),
        /// `server_connection_failure_count{direction}` (deprecated upstream).
        pub server_connection_failures: IntCounterVec = catalog.made(IntCounterVec::new(
            opts(
                "server_connection_failure_count",
                "Count of failures to send to or receive from the proxy server, labeled by the direction (from_server or to_server). DEPRECATED, please use stream_errors_total",
            ),
            &["direction"],
        )),
        /// Attempts to open a stream to a server that failed, by reason.
        pub server_connect_failures: IntCounterVec = catalog.made(IntCounterVec::new(
            Opts::new(
                "tether_agent_server_connect_failures_total",
                "Attempts to open a stream to a proxy server that failed, by reason: connect (TCP, TLS or HTTP/2), proxy (the egress proxy could not be reached, or refused CONNECT), refused (the server refused the stream, e.g. Unauthenticated), timeout, token (the service account token could not be read), other.",
            ),
            &["reason"],
        )),
        /// 1 for the dial policy in force (`node` or `any`).
        pub dial_policy: IntGaugeVec = catalog.made(IntGaugeVec::new(
            Opts::new(
                "tether_agent_dial_policy",
                "1 for the dial policy in force: node (only the node's kubelet, NodePorts, pods, Services and --dial-allow) or any (whatever a server asks: --dial-policy=any, or an upstream command line naming nothing of the node).",
            ),
            &["policy"],
        )),
        /// Dials the dial policy refused.
        pub dial_refusals: IntCounter = catalog.made(IntCounter::with_opts(Opts::new(
            "tether_agent_dial_refusals_total",
            "Dials a server asked for that the agent's dial policy refused (--dial-policy, --dial-allow); each is logged with its address.",
        ))),
        /// When a drain started, its deadline; 0 while not draining.
        pub drain_deadline: IntGauge = catalog.made(IntGauge::with_opts(Opts::new(
            "tether_agent_drain_deadline_timestamp_seconds",
            "When the agent is draining (after its first SIGTERM), the Unix time at which --drain-timeout ends it; 0 while not draining. An agent still up well past this time is stuck.",
        ))),
        /// The lease counter's calls (`lease_lists_total`, `lease_list_latency_seconds`,
        /// `lease_watches_total`).
        pub lease: LeaseMetrics = LeaseMetrics {
            lists: CallMetrics::new(
                lease_calls(&catalog, "lease_lists_total", "list"),
                Some(catalog.made(HistogramVec::new(
                    hopts("lease_list_latency_seconds", "Latency of server lease listing in seconds"),
                    &["http_response_code"],
                ))),
            ),
            watches: CallMetrics::new(lease_calls(&catalog, "lease_watches_total", "watch"), None),
        },
        /// Loaded certificates' expiry (`tether_certificate_expiry_timestamp_seconds`).
        pub cert_expiry: CertExpiry = CertExpiry::new(&catalog),
        /// Audit records written and dropped (`tether_audit_records_*`).
        pub audit: tether_ops::audit::AuditMetrics = tether_ops::audit::AuditMetrics::new(&catalog),
    }
}

impl Metrics {
    /// Creates and registers every metric, beside the process's own families.
    pub fn new() -> Self {
        Self::declare(Catalog::with_process())
    }

    /// The registry `/metrics` renders.
    pub fn registry(&self) -> &Registry {
        self.catalog.registry()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

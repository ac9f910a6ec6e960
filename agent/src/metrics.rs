//! Agent metrics under upstream's names (`konnectivity_network_proxy_agent_*`).

use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry};
use tether_ops::kubeclient::CallMetrics;

use crate::lease_count::LeaseMetrics;
use tether_ops::metrics::PacketCounters;

const NAMESPACE: &str = "konnectivity_network_proxy";
const SUBSYSTEM: &str = "agent";
/// Upstream's agent `latencyBuckets` (5 ms to 30 s).
const LATENCY_BUCKETS: [f64; 7] = [0.005, 0.025, 0.1, 0.5, 2.5, 10.0, 30.0];

/// Every agent metric, registered in one registry.
#[derive(Clone)]
pub struct Metrics {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// Time to dial a target.
    pub dial_duration: Histogram,
    /// Failed target dials by reason (timeout, refused, unknown).
    pub dial_failures: IntCounterVec,
    /// Streams to servers currently open.
    pub open_server_connections: IntGauge,
    /// Servers the agent was told about (`servercount`).
    pub known_server_count: IntGauge,
    /// Target connections currently open.
    pub open_endpoint_connections: IntGauge,
    /// Packets by direction (0 = from_server, 1 = to_server) and type.
    pub packets: PacketCounters,
    /// Stream errors by direction.
    pub stream_errors: IntCounterVec,
    /// `server_connection_failure_count{direction}` (deprecated upstream).
    pub server_connection_failures: IntCounterVec,
    lease_lists: IntCounterVec,
    lease_watches: IntCounterVec,
    lease_list_latency: HistogramVec,
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = tether_ops::metrics::registry_with_process();
        let opts = |n: &str, h: &str| Opts::new(n, h).namespace(NAMESPACE).subsystem(SUBSYSTEM);
        let dial_duration = Histogram::with_opts(
            HistogramOpts::new(
                "dial_duration_seconds",
                "Latency of dial to the remote endpoint in seconds",
            )
            .namespace(NAMESPACE)
            .subsystem(SUBSYSTEM)
            .buckets(LATENCY_BUCKETS.to_vec()),
        )
        .unwrap();
        let dial_failures = IntCounterVec::new(
            opts(
                "endpoint_dial_failure_total",
                "Number of failures dialing the remote endpoint, by reason (example: timeout).",
            ),
            &["reason"],
        )
        .unwrap();
        let open_server_connections = IntGauge::with_opts(opts(
            "open_server_connections",
            "Current number of open server connections.",
        ))
        .unwrap();
        let known_server_count = IntGauge::with_opts(opts(
            "known_server_count",
            "Current number of servers agent is trying to connect to.",
        ))
        .unwrap();
        let open_endpoint_connections = IntGauge::with_opts(opts(
            "open_endpoint_connections",
            "Current number of open endpoint connections.",
        ))
        .unwrap();
        // Upstream's segments: what the agent receives travels to_agent, what it sends
        // from_agent (indexes FROM_SERVER and TO_SERVER).
        let packets = PacketCounters::new(
            "konnectivity_network_proxy_agent_stream_packets_total",
            "Count of packets processed, by segment and packet type (example: from_agent, DIAL_RSP).",
            &["to_agent", "from_agent"],
        );
        let stream_errors = IntCounterVec::new(
            opts(
                "stream_errors_total",
                "Count of gRPC stream errors, by segment, grpc Code, packet type. (example: from_agent, Code.Unavailable, DIAL_RSP)",
            ),
            &["segment", "code", "packet_type"],
        )
        .unwrap();
        let server_connection_failures = IntCounterVec::new(
            opts(
                "server_connection_failure_count",
                "Count of failures to send to or receive from the proxy server, labeled by the direction (from_server or to_server). DEPRECATED, please use stream_errors_total",
            ),
            &["direction"],
        )
        .unwrap();
        let lease_calls = |name: &str, verb: &str| {
            IntCounterVec::new(
                opts(name, &format!("Count of server lease {verb} calls made by the agent to the k8s apiserver, labeled by HTTP response code and reason")),
                &["http_response_code", "reason"],
            )
            .unwrap()
        };
        let lease_lists = lease_calls("lease_lists_total", "list");
        let lease_watches = lease_calls("lease_watches_total", "watch");
        let lease_list_latency = HistogramVec::new(
            HistogramOpts::new(
                "lease_list_latency_seconds",
                "Latency of server lease listing in seconds",
            )
            .namespace(NAMESPACE)
            .subsystem(SUBSYSTEM)
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["http_response_code"],
        )
        .unwrap();
        for c in [
            Box::new(dial_duration.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(dial_failures.clone()),
            Box::new(open_server_connections.clone()),
            Box::new(known_server_count.clone()),
            Box::new(open_endpoint_connections.clone()),
            Box::new(packets.clone()),
            Box::new(stream_errors.clone()),
            Box::new(server_connection_failures.clone()),
            Box::new(lease_lists.clone()),
            Box::new(lease_watches.clone()),
            Box::new(lease_list_latency.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        Metrics {
            registry,
            dial_duration,
            dial_failures,
            open_server_connections,
            known_server_count,
            open_endpoint_connections,
            packets,
            stream_errors,
            server_connection_failures,
            lease_lists,
            lease_watches,
            lease_list_latency,
        }
    }

    /// The lease counter's metrics.
    pub fn lease_metrics(&self) -> LeaseMetrics {
        LeaseMetrics {
            lists: CallMetrics::new(
                self.lease_lists.clone(),
                Some(self.lease_list_latency.clone()),
            ),
            watches: CallMetrics::new(self.lease_watches.clone(), None),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

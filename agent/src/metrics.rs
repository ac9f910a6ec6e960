//! Agent metrics under upstream's names (`konnectivity_network_proxy_agent_*`).

use prometheus::{Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry};
use tether_core::metrics::PacketCounters;

const NAMESPACE: &str = "konnectivity_network_proxy";
const SUBSYSTEM: &str = "agent";

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
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = Registry::new();
        let opts = |n: &str, h: &str| Opts::new(n, h).namespace(NAMESPACE).subsystem(SUBSYSTEM);
        let dial_duration = Histogram::with_opts(
            HistogramOpts::new(
                "dial_duration_seconds",
                "Latency of dial to the remote endpoint in seconds",
            )
            .namespace(NAMESPACE)
            .subsystem(SUBSYSTEM)
            .buckets(vec![0.005, 0.025, 0.1, 0.5, 2.5, 12.5]),
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
        for reason in ["timeout", "refused", "unknown"] {
            dial_failures.with_label_values(&[reason]);
        }
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
        let packets_vec = IntCounterVec::new(
            opts(
                "stream_packets_total",
                "Count of packets processed, by direction and packet type.",
            ),
            &["direction", "packet_type"],
        )
        .unwrap();
        let packets = PacketCounters::new(&packets_vec, &["from_server", "to_server"]);
        let stream_errors = IntCounterVec::new(
            opts(
                "stream_errors_total",
                "Count of gRPC stream errors, by direction and gRPC code.",
            ),
            &["direction", "code"],
        )
        .unwrap();
        for c in [
            Box::new(dial_duration.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(dial_failures.clone()),
            Box::new(open_server_connections.clone()),
            Box::new(known_server_count.clone()),
            Box::new(open_endpoint_connections.clone()),
            Box::new(packets_vec),
            Box::new(stream_errors.clone()),
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
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

//! Server metrics under upstream's names (`konnectivity_network_proxy_server_*`), so
//! existing dashboards and alerts keep working.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};
use tether_ops::kubeclient::CallMetrics;
use tether_ops::metrics::PacketCounters;

const NAMESPACE: &str = "konnectivity_network_proxy";
const SUBSYSTEM: &str = "server";

/// Where a packet was seen, as upstream's `segment` label.
#[derive(Debug, Clone, Copy)]
pub enum Segment {
    /// Received from a frontend client.
    FromClient = 0,
    /// Sent to a frontend client.
    ToClient = 1,
    /// Received from an agent.
    FromAgent = 2,
    /// Sent to an agent.
    ToAgent = 3,
}

/// Upstream's `latencyBuckets` (1 us to 12.5 s) for dial, frontend-write and lease
/// call latencies.
const LATENCY_BUCKETS: [f64; 9] = [0.000001, 0.00001, 0.0001, 0.005, 0.025, 0.1, 0.5, 2.5, 12.5];

const SEGMENTS: [&str; 4] = ["from_client", "to_client", "from_agent", "to_agent"];

/// Why a dial failed, as upstream's `reason` label.
#[derive(Debug, Clone, Copy)]
pub enum DialFailure {
    /// No agent was connected (or matched).
    NoAgent,
    /// The agent answered with an error.
    ErrorResponse,
    /// A DIAL_RSP nobody was waiting for.
    UnrecognizedResponse,
    /// The DIAL_RSP could not be sent to the frontend.
    SendRsp,
    /// The agent's stream closed while the dial was pending.
    BackendClose,
    /// `--backend-dial-timeout` passed.
    BackendDialTimeout,
    /// The frontend went away while the dial was pending.
    FrontendClose,
}

impl DialFailure {
    fn label(self) -> &'static str {
        match self {
            DialFailure::NoAgent => "no_agent",
            DialFailure::ErrorResponse => "error_response",
            DialFailure::UnrecognizedResponse => "unrecognized_response",
            DialFailure::SendRsp => "send_rsp",
            DialFailure::BackendClose => "backend_close",
            DialFailure::BackendDialTimeout => "backend_dial_timeout",
            DialFailure::FrontendClose => "frontend_close",
        }
    }
}

/// Every server metric, registered in one registry.
#[derive(Clone)]
pub struct Metrics {
    /// The registry `/metrics` renders.
    pub registry: Registry,
    /// Time from DIAL_REQ to a successful DIAL_RSP.
    pub dial_duration: Histogram,
    /// Time spent handing a packet to a frontend.
    pub frontend_write_duration: Histogram,
    /// Open gRPC streams by method.
    pub grpc_connections: IntGaugeVec,
    /// Open HTTP-CONNECT connections.
    pub http_connections: IntGauge,
    /// Connected agent streams.
    pub ready_backends: IntGaugeVec,
    /// Lifespan of established connections (`connection_duration_seconds`).
    pub connection_duration: Histogram,
    /// Agent streams connected (`ready_backend_connections`, deprecated upstream).
    pub ready_backend_connections: IntGauge,
    /// Dials sent to an agent and not yet answered.
    pub pending_backend_dials: IntGauge,
    /// Tunnelled connections currently open.
    pub established_connections: IntGauge,
    /// Frontend channels that were full when a packet arrived.
    pub full_receive_channels: IntGaugeVec,
    dial_failures: IntCounterVec,
    /// Agent TokenReviews by result (authenticated, cached, rejected, error).
    pub token_reviews: IntCounterVec,
    /// Identifiers agents claimed that the server could not verify, by kind.
    pub unverified_identifiers: IntCounterVec,
    /// Agent streams refused by reason (`too_many_streams`).
    pub agent_streams_refused: IntCounterVec,
    /// Connections a listener closed unserved, by listener and reason (`per_source`,
    /// `unadmitted`).
    pub connections_refused: IntCounterVec,
    packets: PacketCounters,
    stream_errors: IntCounterVec,
    /// Expired leases the lease controller deleted (`culled_leases_count`).
    pub culled_leases: IntCounter,
    /// Lease list calls (`lease_list_total`, `lease_list_latency_seconds`).
    pub lease_lists: CallMetrics,
    /// Lease delete calls (`lease_delete_total`, `lease_delete_latency_seconds`).
    pub lease_deletes: CallMetrics,
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = tether_ops::metrics::registry_with_process();
        let opts = |name: &str, help: &str| {
            Opts::new(name, help)
                .namespace(NAMESPACE)
                .subsystem(SUBSYSTEM)
        };
        let hopts = |name: &str, help: &str| {
            HistogramOpts::new(name, help)
                .namespace(NAMESPACE)
                .subsystem(SUBSYSTEM)
                .buckets(LATENCY_BUCKETS.to_vec())
        };
        let dial_duration = Histogram::with_opts(hopts(
            "dial_duration_seconds",
            "Latency of dial to the remote endpoint in seconds",
        ))
        .unwrap();
        let connection_duration = Histogram::with_opts(
            hopts(
                "connection_duration_seconds",
                "Duration of established connections, from a successful dial until close, in seconds",
            )
            // Upstream main's buckets.
            .buckets(vec![
                1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 14400.0, 43200.0,
                86400.0,
            ]),
        )
        .unwrap();
        let frontend_write_duration = Histogram::with_opts(hopts(
            "frontend_write_duration_seconds",
            "Latency of write to the frontend in seconds",
        ))
        .unwrap();
        let grpc_connections = IntGaugeVec::new(
            opts(
                "grpc_connections",
                "Number of current grpc connections, partitioned by service method.",
            ),
            &["service_method"],
        )
        .unwrap();
        let http_connections = IntGauge::with_opts(opts(
            "http_connections",
            "Number of current HTTP CONNECT connections",
        ))
        .unwrap();
        let ready_backends = IntGaugeVec::new(
            opts(
                "ready_backends",
                "Number of konnectivity agent connected to the proxy server",
            ),
            &["proxy_strategy"],
        )
        .unwrap();
        let ready_backend_connections = IntGauge::with_opts(opts(
            "ready_backend_connections",
            "Number of konnectivity agent connected to the proxy server. DEPRECATED, please use ready_backends",
        ))
        .unwrap();
        let pending_backend_dials = IntGauge::with_opts(opts(
            "pending_backend_dials",
            "Current number of pending backend dial requests",
        ))
        .unwrap();
        let established_connections = IntGauge::with_opts(opts(
            "established_connections",
            "Current number of established end-to-end connections (post-dial).",
        ))
        .unwrap();
        let full_receive_channels = IntGaugeVec::new(
            opts("full_receive_channels", "Number of current connections blocked by a full receive channel, partitioned by service method."),
            &["service_method"],
        )
        .unwrap();
        let dial_failures = IntCounterVec::new(
            opts(
                "dial_failure_count",
                "Number of dial failures observed, by reason (example: remote endpoint error)",
            ),
            &["reason"],
        )
        .unwrap();
        let token_reviews = IntCounterVec::new(
            Opts::new("tether_server_token_reviews_total", "Agent token checks by result: authenticated, cached (no TokenReview sent), rejected, error."),
            &["result"],
        )
        .unwrap();
        let unverified_identifiers = IntCounterVec::new(
            Opts::new("tether_server_unverified_identifiers_total", "Identifiers agents claimed that the server could not verify (ignored for routing unless --unsafe-trust-agent-identifiers), by kind: agent_id, host, ip, cidr, default_route."),
            &["kind"],
        )
        .unwrap();
        for kind in ["agent_id", "host", "ip", "cidr", "default_route"] {
            unverified_identifiers.with_label_values(&[kind]);
        }
        let agent_streams_refused = IntCounterVec::new(
            Opts::new("tether_server_agent_streams_refused_total", "Agent streams refused after authentication, by reason: too_many_streams (--max-agent-streams per agent ID or verified identity), unverified (--require-agent-identity-match)."),
            &["reason"],
        )
        .unwrap();
        for reason in ["too_many_streams", "unverified"] {
            agent_streams_refused.with_label_values(&[reason]);
        }
        let connections_refused = IntCounterVec::new(
            Opts::new("tether_server_connections_refused_total", "TCP connections a listener closed without serving them, by listener (agent, frontend) and reason: per_source (over --max-handshakes-per-source), unadmitted (an agent connection on which no agent was admitted within 10 s). At --max-connections and --max-concurrent-handshakes new clients wait in the kernel's backlog instead."),
            &["listener", "reason"],
        )
        .unwrap();
        for (listener, reason) in [
            ("agent", "per_source"),
            ("agent", "unadmitted"),
            ("frontend", "per_source"),
        ] {
            connections_refused.with_label_values(&[listener, reason]);
        }
        let packets = PacketCounters::new(
            &format!("{NAMESPACE}_{SUBSYSTEM}_stream_packets_total"),
            "Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ)",
            &SEGMENTS,
        );
        let stream_errors = IntCounterVec::new(
            opts("stream_errors_total", "Count of gRPC stream errors, by segment, grpc Code, packet type. (example: from_agent, Code.Unavailable, DIAL_RSP)"),
            &["segment", "code", "packet_type"],
        )
        .unwrap();
        let culled_leases = IntCounter::with_opts(opts(
            "culled_leases_count",
            "Count of expired leases that the lease garbage collection controller has culled.",
        ))
        .unwrap();
        let calls = |verb: &str| {
            let total = IntCounterVec::new(
                opts(
                    &format!("lease_{verb}_total"),
                    &format!("Count of lease {verb} calls made by the server to the k8s apiserver, labeled by HTTP status code and reason"),
                ),
                &["http_status_code", "reason"],
            )
            .unwrap();
            // Upstream gives these client_golang's default buckets.
            let latency = HistogramVec::new(
                hopts(
                    &format!("lease_{verb}_latency_seconds"),
                    &format!(
                        "Latency of lease {verb} calls by the server to the apiserver in seconds"
                    ),
                )
                .buckets(prometheus::DEFAULT_BUCKETS.to_vec()),
                &["http_status_code"],
            )
            .unwrap();
            (total, latency)
        };
        let (list_total, list_latency) = calls("list");
        let (delete_total, delete_latency) = calls("delete");
        for c in [
            Box::new(dial_duration.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(frontend_write_duration.clone()),
            Box::new(grpc_connections.clone()),
            Box::new(http_connections.clone()),
            Box::new(ready_backends.clone()),
            Box::new(ready_backend_connections.clone()),
            Box::new(pending_backend_dials.clone()),
            Box::new(established_connections.clone()),
            Box::new(full_receive_channels.clone()),
            Box::new(dial_failures.clone()),
            Box::new(packets.clone()),
            Box::new(stream_errors.clone()),
            Box::new(token_reviews.clone()),
            Box::new(unverified_identifiers.clone()),
            Box::new(agent_streams_refused.clone()),
            Box::new(connections_refused.clone()),
            Box::new(connection_duration.clone()),
            Box::new(culled_leases.clone()),
            Box::new(list_total.clone()),
            Box::new(list_latency.clone()),
            Box::new(delete_total.clone()),
            Box::new(delete_latency.clone()),
        ] {
            registry.register(c).expect("metric names are unique");
        }
        Metrics {
            registry,
            dial_duration,
            frontend_write_duration,
            grpc_connections,
            http_connections,
            ready_backends,
            ready_backend_connections,
            connection_duration,
            pending_backend_dials,
            established_connections,
            full_receive_channels,
            dial_failures,
            token_reviews,
            unverified_identifiers,
            agent_streams_refused,
            connections_refused,
            packets,
            stream_errors,
            culled_leases,
            lease_lists: CallMetrics::new(list_total, Some(list_latency)),
            lease_deletes: CallMetrics::new(delete_total, Some(delete_latency)),
        }
    }

    /// Counts one dial failure.
    pub fn dial_failed(&self, reason: DialFailure) {
        self.dial_failures
            .with_label_values(&[reason.label()])
            .inc();
    }

    /// Counts one packet of type `ty` (raw enum value) on `segment`.
    pub fn packet(&self, segment: Segment, ty: i32) {
        self.packets.inc(segment as usize, ty);
    }

    /// An established connection closed: the gauge and its lifespan.
    pub fn connection_ended(&self, established: std::time::Instant) {
        self.established_connections.dec();
        self.connection_duration
            .observe(established.elapsed().as_secs_f64());
    }

    /// Counts one failed send of a packet of type `ty` (raw enum value).
    pub fn send_error(&self, segment: Segment, code: tonic::Code, ty: i32) {
        self.count_error(segment, code, tether_ops::metrics::packet_type_name(ty));
    }

    /// Counts one failed read (no packet: `packet_type="Unknown"`, as upstream).
    pub fn stream_error(&self, segment: Segment, code: tonic::Code) {
        self.count_error(segment, code, tether_ops::metrics::NO_PACKET);
    }

    fn count_error(&self, segment: Segment, code: tonic::Code, packet_type: &str) {
        self.stream_errors
            .with_label_values(&[
                SEGMENTS[segment as usize],
                tether_ops::metrics::grpc_code_name(code),
                packet_type,
            ])
            .inc();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

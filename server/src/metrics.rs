//! Server metrics under upstream's names (`konnectivity_network_proxy_server_*`), so
//! existing dashboards and alerts keep working.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};
use tether_ops::kubeclient::CallMetrics;
use tether_ops::metrics::{Catalog, CertExpiry, PacketCounters};

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

fn opts(name: &str, help: &str) -> Opts {
    Opts::new(name, help)
        .namespace(NAMESPACE)
        .subsystem(SUBSYSTEM)
}

/// Upstream's histogram options: its namespace, subsystem and latency buckets.
fn hopts(name: &str, help: &str) -> HistogramOpts {
    HistogramOpts::new(name, help)
        .namespace(NAMESPACE)
        .subsystem(SUBSYSTEM)
        .buckets(LATENCY_BUCKETS.to_vec())
}

/// `vec` with the series for each of `labels` created up front (at zero), so that a
/// rate over them exists before the first event.
fn with_series<B: prometheus::core::MetricVecBuilder>(
    vec: prometheus::core::MetricVec<B>,
    labels: &[&[&str]],
) -> prometheus::core::MetricVec<B> {
    for l in labels {
        vec.with_label_values(l);
    }
    vec
}

/// The counter and latency of one kind of lease call (`lease_<verb>_total`,
/// `lease_<verb>_latency_seconds`).
fn lease_calls(catalog: &Catalog, verb: &str) -> CallMetrics {
    let total = catalog.made(IntCounterVec::new(
        opts(
            &format!("lease_{verb}_total"),
            &format!("Count of lease {verb} calls made by the server to the k8s apiserver, labeled by HTTP status code and reason"),
        ),
        &["http_status_code", "reason"],
    ));
    // Upstream gives these client_golang's default buckets.
    let latency = catalog.made(HistogramVec::new(
        hopts(
            &format!("lease_{verb}_latency_seconds"),
            &format!("Latency of lease {verb} calls by the server to the apiserver in seconds"),
        )
        .buckets(prometheus::DEFAULT_BUCKETS.to_vec()),
        &["http_status_code"],
    ));
    CallMetrics::new(total, Some(latency))
}

tether_ops::metric_set! {
    /// Every server metric, each declared once.
    pub struct Metrics in catalog {
        /// Time from DIAL_REQ to a successful DIAL_RSP.
        pub dial_duration: Histogram = catalog.made(Histogram::with_opts(hopts(
            "dial_duration_seconds",
            "Latency of dial to the remote endpoint in seconds",
        ))),
        /// Lifespan of established connections (`connection_duration_seconds`).
        pub connection_duration: Histogram = catalog.made(Histogram::with_opts(
            hopts(
                "connection_duration_seconds",
                "Duration of established connections, from a successful dial until close, in seconds",
            )
            // Upstream main's buckets.
            .buckets(vec![
                1.0, 5.0, 15.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 14400.0, 43200.0,
                86400.0,
            ]),
        )),
        /// Time spent handing a packet to a frontend.
        pub frontend_write_duration: Histogram = catalog.made(Histogram::with_opts(hopts(
            "frontend_write_duration_seconds",
            "Latency of write to the frontend in seconds",
        ))),
        /// Open gRPC streams by method.
        pub grpc_connections: IntGaugeVec = catalog.made(IntGaugeVec::new(
            opts(
                "grpc_connections",
                "Number of current grpc connections, partitioned by service method.",
            ),
            &["service_method"],
        )),
        /// Open HTTP-CONNECT connections.
        pub http_connections: IntGauge = catalog.made(IntGauge::with_opts(opts(
            "http_connections",
            "Number of current HTTP CONNECT connections",
        ))),
        /// Connected agent streams.
        pub ready_backends: IntGaugeVec = catalog.made(IntGaugeVec::new(
            opts(
                "ready_backends",
                "Number of konnectivity agent connected to the proxy server",
            ),
            &["proxy_strategy"],
        )),
        /// Agent streams connected (`ready_backend_connections`, deprecated upstream).
        pub ready_backend_connections: IntGauge = catalog.made(IntGauge::with_opts(opts(
            "ready_backend_connections",
            "Number of konnectivity agent connected to the proxy server. DEPRECATED, please use ready_backends",
        ))),
        /// Dials sent to an agent and not yet answered.
        pub pending_backend_dials: IntGauge = catalog.made(IntGauge::with_opts(opts(
            "pending_backend_dials",
            "Current number of pending backend dial requests",
        ))),
        /// Tunnelled connections currently open.
        pub established_connections: IntGauge = catalog.made(IntGauge::with_opts(opts(
            "established_connections",
            "Current number of established end-to-end connections (post-dial).",
        ))),
        /// Frontend channels that were full when a packet arrived.
        pub full_receive_channels: IntGaugeVec = catalog.made(IntGaugeVec::new(
            opts("full_receive_channels", "Number of current connections blocked by a full receive channel, partitioned by service method."),
            &["service_method"],
        )),
        dial_failures: IntCounterVec = catalog.made(IntCounterVec::new(
            opts(
                "dial_failure_count",
                "Number of dial failures observed, by reason (example: remote endpoint error)",
            ),
            &["reason"],
        )),
        /// Agent TokenReviews by result (authenticated, cached, rejected, error).
        pub token_reviews: IntCounterVec = catalog.made(IntCounterVec::new(
            Opts::new("tether_server_token_reviews_total", "Agent token checks by result: authenticated, cached (no TokenReview sent), rejected, error."),
            &["result"],
        )),
        /// Identifiers agents claimed that the server could not verify, by kind.
        pub unverified_identifiers: IntCounterVec = catalog.add(with_series(
            IntCounterVec::new(
                Opts::new("tether_server_unverified_identifiers_total", "Identifiers agents claimed that the server could not verify (ignored for routing unless --unsafe-trust-agent-identifiers), by kind: agent_id, host, ip, cidr, default_route."),
                &["kind"],
            )
            .expect("valid metric"),
            &[&["agent_id"], &["host"], &["ip"], &["cidr"], &["default_route"]],
        )),
        /// Agent streams refused by reason (`too_many_streams`, `unverified`,
        /// `too_many_connections`).
        pub agent_streams_refused: IntCounterVec = catalog.add(with_series(
            IntCounterVec::new(
                Opts::new("tether_server_agent_streams_refused_total", "Agent streams refused after authentication, by reason: too_many_streams (--max-agent-streams per agent ID or verified identity), too_many_connections (a verified identity already holds --max-agent-streams connections), unverified (--require-agent-identity-match)."),
                &["reason"],
            )
            .expect("valid metric"),
            &[&["too_many_streams"], &["too_many_connections"], &["unverified"]],
        )),
        /// Dials that waited for an agent (`--wait-for-agent`), by result.
        pub dials_waited: IntCounterVec = catalog.add(with_series(
            IntCounterVec::new(
                Opts::new("tether_server_dials_waited_total", "Dials that found no agent to take them and waited for one (--wait-for-agent), by result: arrived (an agent that may take it connected in time), gave_up (none did; the dial failed with No agent available)."),
                &["result"],
            )
            .expect("valid metric"),
            &[&["arrived"], &["gave_up"]],
        )),
        /// Open agent streams by the transport that carries them.
        pub agent_streams: IntGaugeVec = catalog.add(with_series(
            IntGaugeVec::new(
                Opts::new("tether_server_agent_streams", "Open agent streams by transport: h2 (gRPC over HTTP/2, as upstream), websocket (the agent protocol over WebSocket on HTTP/1.1), quic (over QUIC, a stream per tunnel)."),
                &["transport"],
            )
            .expect("valid metric"),
            &[&["h2"], &["websocket"]],
        )),
        /// Live agent streams ended because their token no longer passes a review.
        pub agent_streams_revoked: IntCounter = catalog.made(IntCounter::with_opts(Opts::new(
            "tether_server_agent_streams_revoked_total",
            "Live agent streams ended because their token, reviewed again when its cached review expired, no longer passes (its Pod deleted, its service account removed).",
        ))),
        /// Connections a listener closed unserved, by listener and reason.
        pub connections_refused: IntCounterVec = catalog.add(with_series(
            IntCounterVec::new(
                Opts::new("tether_server_connections_refused_total", "TCP connections a listener closed without serving them, by listener (agent, frontend, health, admin) and reason: per_source and per_prefix (over --max-handshakes-per-source or --max-handshakes-per-prefix unproven connections), evicted (unproven and only holding its place, to make room when --max-concurrent-handshakes or --max-connections were open), handshake (the TLS handshake failed, timed out, or its first byte did not come within 5 s), unadmitted (an agent connection on which no agent stream was admitted within 10 s), idle (an agent connection with no open agent stream for 10 s). At --max-connections new clients wait in the kernel's backlog instead."),
                &["listener", "reason"],
            )
            .expect("valid metric"),
            &[
                &["agent", "per_source"],
                &["agent", "per_prefix"],
                &["agent", "evicted"],
                &["agent", "handshake"],
                &["agent", "unadmitted"],
                &["agent", "idle"],
                &["frontend", "per_source"],
                &["frontend", "handshake"],
            ],
        )),
        packets: PacketCounters = catalog.add(PacketCounters::new(
            &format!("{NAMESPACE}_{SUBSYSTEM}_stream_packets_total"),
            "Count of packets processed, by segment and packet type (example: from_client, DIAL_REQ)",
            &SEGMENTS,
        )),
        stream_errors: IntCounterVec = catalog.made(IntCounterVec::new(
            opts("stream_errors_total", "Count of gRPC stream errors, by segment, grpc Code, packet type. (example: from_agent, Code.Unavailable, DIAL_RSP)"),
            &["segment", "code", "packet_type"],
        )),
        tunnel_bytes: IntCounterVec = catalog.made(IntCounterVec::new(
            Opts::new("tether_server_tunnel_bytes_total", "Payload bytes of DATA packets relayed between frontends and agents, by direction: to_agent (from kube-apiserver towards the targets), from_agent."),
            &["direction"],
        )),
        /// `tether_server_tunnel_bytes_total{direction="to_agent"}`, resolved once.
        pub bytes_to_agent: IntCounter = tunnel_bytes.with_label_values(&["to_agent"]),
        /// `tether_server_tunnel_bytes_total{direction="from_agent"}`, resolved once.
        pub bytes_from_agent: IntCounter = tunnel_bytes.with_label_values(&["from_agent"]),
        /// Expired leases the lease controller deleted (`culled_leases_count`).
        pub culled_leases: IntCounter = catalog.made(IntCounter::with_opts(opts(
            "culled_leases_count",
            "Count of expired leases that the lease garbage collection controller has culled.",
        ))),
        /// Lease list calls (`lease_list_total`, `lease_list_latency_seconds`).
        pub lease_lists: CallMetrics = lease_calls(&catalog, "list"),
        /// Lease delete calls (`lease_delete_total`, `lease_delete_latency_seconds`).
        pub lease_deletes: CallMetrics = lease_calls(&catalog, "delete"),
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

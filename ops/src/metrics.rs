//! Metric helpers shared by server and agent.

use prometheus::{IntCounter, IntCounterVec};
use tether_proto::PacketType;

/// Upstream's `packet_type` label values, indexed by the enum value, then Tether's
/// WINDOW_UPDATE extension.
pub const PACKET_TYPES: [&str; 8] = [
    "DIAL_REQ",
    "DIAL_RSP",
    "CLOSE_REQ",
    "CLOSE_RSP",
    "DATA",
    "DIAL_CLS",
    "DRAIN",
    "WINDOW_UPDATE",
];

/// A gRPC status code spelled as grpc-go prints it (the `code` label upstream's
/// `stream_errors_total` carries): `OK`, `Canceled`, `Unavailable`, ...
pub fn grpc_code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "Canceled",
        Unknown => "Unknown",
        InvalidArgument => "InvalidArgument",
        DeadlineExceeded => "DeadlineExceeded",
        NotFound => "NotFound",
        AlreadyExists => "AlreadyExists",
        PermissionDenied => "PermissionDenied",
        ResourceExhausted => "ResourceExhausted",
        FailedPrecondition => "FailedPrecondition",
        Aborted => "Aborted",
        OutOfRange => "OutOfRange",
        Unimplemented => "Unimplemented",
        Internal => "Internal",
        Unavailable => "Unavailable",
        DataLoss => "DataLoss",
        Unauthenticated => "Unauthenticated",
    }
}

/// A registry holding the standard `process_*` metrics (CPU seconds, resident and
/// virtual memory, open and maximum fds, start time), as every Go binary exports, and
/// the heap's in-use and free bytes ([`crate::memory::HeapCollector`]).
pub fn registry_with_process() -> prometheus::Registry {
    let registry = prometheus::Registry::new();
    registry
        .register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))
        .expect("process metrics registered once");
    registry
        .register(Box::new(crate::memory::HeapCollector::new()))
        .expect("heap metrics registered once");
    registry
}

/// The `packet_type` label of a stream error that carried no packet.
pub const NO_PACKET: &str = "Unknown";

/// Index of a packet type in `PACKET_TYPES`.
fn type_index(ty: PacketType) -> usize {
    match ty {
        PacketType::WindowUpdate => 7,
        other => other as usize,
    }
}

/// Per-packet counters resolved once, so counting a DATA packet costs one atomic add
/// instead of a label lookup.
#[derive(Clone)]
pub struct PacketCounters {
    counters: Vec<IntCounter>,
}

impl PacketCounters {
    /// Resolves `vec{<first label>=segment, packet_type=..}` for every segment.
    pub fn new(vec: &IntCounterVec, segments: &[&str]) -> Self {
        let mut counters = Vec::with_capacity(segments.len() * PACKET_TYPES.len());
        for seg in segments {
            for ty in PACKET_TYPES {
                counters.push(vec.with_label_values(&[seg, ty]));
            }
        }
        PacketCounters { counters }
    }

    /// Counts one packet of raw type `ty` on the segment with index `segment`.
    pub fn inc(&self, segment: usize, ty: i32) {
        if let Ok(ty) = PacketType::try_from(ty) {
            if let Some(c) = self
                .counters
                .get(segment * PACKET_TYPES.len() + type_index(ty))
            {
                c.inc();
            }
        }
    }
}

/// Warn this long before a loaded certificate expires.
pub const EXPIRY_WARNING: i64 = 30 * 86_400;

/// Publishes every loaded certificate's not-after as
/// `tether_certificate_expiry_timestamp_seconds{source,file,index}` (which listener or
/// client loaded it, the file's name without its directory, the certificate's place in
/// the file) and logs a warning when one expires within 30 days. Subjects and
/// directories stay out of the labels: `/metrics` is often reachable from the network,
/// and subjects name nodes.
#[derive(Clone)]
pub struct CertExpiry {
    gauge: prometheus::IntGaugeVec,
}

impl CertExpiry {
    /// Registers the gauge in `registry`.
    pub fn new(registry: &prometheus::Registry) -> Self {
        let gauge = prometheus::IntGaugeVec::new(
            prometheus::Opts::new(
                "tether_certificate_expiry_timestamp_seconds",
                "Not-after time (Unix seconds) of each loaded certificate, by what loaded it (source), its file's name and its place in that file.",
            ),
            &["source", "file", "index"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(gauge.clone()))
            .expect("metric registered once");
        CertExpiry { gauge }
    }

    /// Reads the certificates in `paths` (files without certificates, such as keys,
    /// are skipped) and publishes their expiry under `source`.
    pub fn observe_files(&self, source: &str, paths: &[std::path::PathBuf]) {
        let now = tether_certs::inspect::now();
        for path in paths {
            let Ok(pem) = std::fs::read_to_string(path) else {
                continue;
            };
            let Ok(certs) = tether_certs::inspect::parse_pem(&pem) else {
                continue;
            };
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            for (index, cert) in certs.into_iter().enumerate() {
                let file = path.display().to_string();
                self.gauge
                    .with_label_values(&[source, &name, &index.to_string()])
                    .set(cert.not_after);
                let left = cert.not_after - now;
                if left < 0 {
                    tracing::error!(path = %file, subject = %cert.subject, "certificate has EXPIRED; issue a new one (tether certs)");
                } else if left < EXPIRY_WARNING {
                    tracing::warn!(path = %file, subject = %cert.subject, days_left = left / 86_400, "certificate expires within 30 days; rotate it");
                }
            }
        }
    }
}

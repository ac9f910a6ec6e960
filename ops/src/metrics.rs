//! Metric helpers shared by server and agent.

use prometheus::IntCounterVec;
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

/// A metric registry that keeps what was registered on it, so that the metric
/// reference in `docs/` is generated from the same declarations `/metrics` serves.
/// Clones share the registry.
#[derive(Clone, Default)]
pub struct Catalog {
    registry: prometheus::Registry,
    collectors: std::sync::Arc<std::sync::Mutex<Vec<Shared>>>,
}

/// A collector registered once and also kept by the catalog.
#[derive(Clone)]
struct Shared(std::sync::Arc<dyn prometheus::core::Collector>);

impl prometheus::core::Collector for Shared {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.0.desc()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        self.0.collect()
    }
}

/// One metric family as the reference lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyDoc {
    /// The family's full name.
    pub name: String,
    /// `counter`, `gauge`, `histogram`, `summary` or `untyped`.
    pub kind: &'static str,
    /// Its help text.
    pub help: String,
    /// Its label names (variable, then constant).
    pub labels: Vec<String>,
}

impl Catalog {
    /// A catalog holding the standard `process_*` metrics (CPU seconds, resident and
    /// virtual memory, open and maximum fds, start time, and the families
    /// client_golang added since: network bytes and the address-space limit), as every
    /// Go binary exports, `promhttp_metric_handler_*` (shared by every registry of the
    /// process, as Go's default registry is), and the heap's in-use and free bytes
    /// ([`crate::memory::HeapCollector`]).
    pub fn with_process() -> Self {
        let catalog = Catalog::default();
        catalog.keep(prometheus::process_collector::ProcessCollector::for_self());
        catalog.keep(ProcessExtras::new());
        let handler = promhttp();
        catalog.add(handler.requests.clone());
        catalog.add(handler.in_flight.clone());
        catalog.keep(crate::memory::HeapCollector::new());
        catalog
    }

    /// The registry `/metrics` renders.
    pub fn registry(&self) -> &prometheus::Registry {
        &self.registry
    }

    /// Registers `collector` and returns it. Names are fixed at compile time, so a
    /// clash is a programming error and panics.
    pub fn add<C: prometheus::core::Collector + Clone + 'static>(&self, collector: C) -> C {
        self.keep(collector.clone());
        collector
    }

    /// Registers a collector nobody else keeps a handle to (one that reads the
    /// process's state when scraped).
    pub fn keep(&self, collector: impl prometheus::core::Collector + 'static) {
        let shared = Shared(std::sync::Arc::new(collector));
        self.registry
            .register(Box::new(shared.clone()))
            .expect("metric names are unique");
        self.collectors.lock().expect("catalog lock").push(shared);
    }

    /// Registers what a prometheus constructor made ([`Catalog::add`]); its options
    /// are fixed at compile time, so an error is a programming error and panics.
    pub fn made<C: prometheus::core::Collector + Clone + 'static>(
        &self,
        made: Result<C, prometheus::Error>,
    ) -> C {
        self.add(made.expect("valid metric"))
    }

    /// Every family registered, sorted by name.
    pub fn families(&self) -> Vec<FamilyDoc> {
        use prometheus::core::Collector;
        use prometheus::proto::MetricType;
        let collectors = self.collectors.lock().expect("catalog lock");
        let mut out = Vec::new();
        for c in collectors.iter() {
            let collected = c.collect();
            for desc in c.desc() {
                let kind = collected
                    .iter()
                    .find(|f| f.name() == desc.fq_name)
                    .map(|f| match f.get_field_type() {
                        MetricType::COUNTER => "counter",
                        MetricType::GAUGE => "gauge",
                        MetricType::HISTOGRAM => "histogram",
                        MetricType::SUMMARY => "summary",
                        MetricType::UNTYPED => "untyped",
                    })
                    .unwrap_or("untyped");
                let labels = desc
                    .variable_labels
                    .iter()
                    .cloned()
                    .chain(desc.const_label_pairs.iter().map(|l| l.name().to_string()))
                    .collect();
                out.push(FamilyDoc {
                    name: desc.fq_name.clone(),
                    kind,
                    help: desc.help.clone(),
                    labels,
                });
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }
}

/// Declares a set of metrics once: each field's name, type and construction sit
/// together, and `declare(catalog)` builds them in order (each initialiser sees the
/// catalog under the name given after `in`, and the fields built before it) and
/// returns the set. The struct also gets `catalog`, the registry `/metrics` renders.
#[macro_export]
macro_rules! metric_set {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident in $cat:ident {
            $( $(#[$fmeta:meta])* $fvis:vis $field:ident : $ty:ty = $init:expr ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone)]
        $vis struct $name {
            /// The registry `/metrics` renders, and what was declared on it.
            pub catalog: $crate::metrics::Catalog,
            $( $(#[$fmeta])* $fvis $field: $ty, )*
        }

        impl $name {
            /// Builds every metric of the set and registers it in `catalog`.
            pub fn declare($cat: $crate::metrics::Catalog) -> Self {
                $( let $field: $ty = $init; )*
                $name { catalog: $cat, $( $field, )* }
            }
        }
    };
}

/// client_golang's `promhttp.Handler()` instrumentation of the `/metrics` handler.
#[derive(Clone)]
pub struct PromHttp {
    /// `promhttp_metric_handler_requests_total{code}`: scrapes served, by status.
    pub requests: IntCounterVec,
    /// `promhttp_metric_handler_requests_in_flight`: scrapes being served.
    pub in_flight: prometheus::IntGauge,
}

/// The process's one [`PromHttp`], as Go's default registry has one.
pub fn promhttp() -> &'static PromHttp {
    static HANDLER: std::sync::OnceLock<PromHttp> = std::sync::OnceLock::new();
    HANDLER.get_or_init(|| {
        let requests = IntCounterVec::new(
            prometheus::Opts::new(
                "promhttp_metric_handler_requests_total",
                "Total number of scrapes by HTTP status code.",
            ),
            &["code"],
        )
        .expect("valid metric");
        // client_golang creates these three up front.
        for code in ["200", "500", "503"] {
            requests.with_label_values(&[code]);
        }
        let in_flight = prometheus::IntGauge::new(
            "promhttp_metric_handler_requests_in_flight",
            "Current number of scrapes being served.",
        )
        .expect("valid metric");
        PromHttp {
            requests,
            in_flight,
        }
    })
}

/// client_golang's newer process families: `process_network_receive_bytes_total` and
/// `process_network_transmit_bytes_total` (the IP octets of `/proc/self/net/netstat`,
/// which count the network namespace, as Go's do) and `process_virtual_memory_max_bytes`
/// (the address-space limit; unlimited is 2^64-1, as procfs reads it).
pub struct ProcessExtras {
    received: prometheus::Counter,
    sent: prometheus::Counter,
    vsize_max: prometheus::Gauge,
}

impl ProcessExtras {
    /// The three families, unregistered.
    pub fn new() -> Self {
        ProcessExtras {
            received: prometheus::Counter::new(
                "process_network_receive_bytes_total",
                "Number of bytes received by the process over the network.",
            )
            .expect("valid metric"),
            sent: prometheus::Counter::new(
                "process_network_transmit_bytes_total",
                "Number of bytes sent by the process over the network.",
            )
            .expect("valid metric"),
            vsize_max: prometheus::Gauge::new(
                "process_virtual_memory_max_bytes",
                "Maximum amount of virtual memory available in bytes.",
            )
            .expect("valid metric"),
        }
    }
}

impl Default for ProcessExtras {
    fn default() -> Self {
        Self::new()
    }
}

/// `InOctets` and `OutOctets` of the `IpExt` lines of a `/proc/PID/net/netstat` text.
fn ip_octets(netstat: &str) -> Option<(f64, f64)> {
    let mut lines = netstat.lines().filter(|l| l.starts_with("IpExt:"));
    let names: Vec<&str> = lines.next()?.split_whitespace().collect();
    let values: Vec<&str> = lines.next()?.split_whitespace().collect();
    let get = |name: &str| -> Option<f64> {
        let i = names.iter().position(|n| *n == name)?;
        values.get(i)?.parse().ok()
    };
    Some((get("InOctets")?, get("OutOctets")?))
}

/// The soft "Max address space" of a `/proc/PID/limits` text, in bytes.
fn address_space_limit(limits: &str) -> Option<f64> {
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))?;
    let soft = line["Max address space".len()..]
        .split_whitespace()
        .next()?;
    if soft == "unlimited" {
        Some(u64::MAX as f64)
    } else {
        soft.parse().ok()
    }
}

impl prometheus::core::Collector for ProcessExtras {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.received
            .desc()
            .into_iter()
            .chain(self.sent.desc())
            .chain(self.vsize_max.desc())
            .collect()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let mut out = Vec::new();
        if let Some((rx, tx)) = std::fs::read_to_string("/proc/self/net/netstat")
            .ok()
            .as_deref()
            .and_then(ip_octets)
        {
            // Counters only go up; reset and add the kernel's totals.
            self.received.reset();
            self.received.inc_by(rx);
            self.sent.reset();
            self.sent.inc_by(tx);
            out.extend(self.received.collect());
            out.extend(self.sent.collect());
        }
        if let Some(max) = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .as_deref()
            .and_then(address_space_limit)
        {
            self.vsize_max.set(max);
            out.extend(self.vsize_max.collect());
        }
        out
    }
}

/// A number as Go's `strconv.FormatFloat(f, 'g', -1, 64)` writes it, which is how
/// client_golang prints `le` and `quantile` label values: `1e-06`, `0.005`, `2.5`,
/// `1e+06`. Prometheus 2.x keys series by the label's text, so `le="0.000001"` and
/// `le="1e-06"` would be two series to it.
pub fn go_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "+Inf" } else { "-Inf" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0" } else { "0" }.into();
    }
    // Rust's `{:e}` is the shortest round-trip digits: "1.5e-6", "1e0", "-2.5e5".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent is an integer");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    // strconv's shortest %g: the exponent form when exp < -4 || exp >= 6.
    if !(-4..6).contains(&exp) {
        let mut m = digits[..1].to_string();
        if digits.len() > 1 {
            m.push('.');
            m.push_str(&digits[1..]);
        }
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{m}e{esign}{:02}", exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    let body = if point <= 0 {
        format!("0.{}{}", "0".repeat((-point) as usize), digits)
    } else if point as usize >= digits.len() {
        format!("{}{}", digits, "0".repeat(point as usize - digits.len()))
    } else {
        format!(
            "{}.{}",
            &digits[..point as usize],
            &digits[point as usize..]
        )
    };
    format!("{sign}{body}")
}

/// Rewrites the `le` and `quantile` label values of a text exposition as
/// client_golang prints them ([`go_float`]).
pub fn go_label_floats(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 64);
    for line in text.split_inclusive('\n') {
        if line.starts_with('#') || !(line.contains("le=\"") || line.contains("quantile=\"")) {
            out.push_str(line);
            continue;
        }
        let mut rest = line;
        // A label is `le` or `quantile` only right after `{` or `,` (not `file=`).
        let find = |rest: &str| -> Option<usize> {
            ["{le=\"", ",le=\"", "{quantile=\"", ",quantile=\""]
                .iter()
                .filter_map(|k| rest.find(k).map(|i| i + k.len()))
                .min()
        };
        while let Some(i) = find(rest) {
            out.push_str(&rest[..i]);
            rest = &rest[i..];
            let end = rest.find('"').unwrap_or(rest.len());
            let value = &rest[..end];
            match value.parse::<f64>() {
                Ok(f) => out.push_str(&go_float(f)),
                Err(_) => out.push_str(value),
            }
            rest = &rest[end..];
        }
        out.push_str(rest);
    }
    out
}

/// The `packet_type` label of a stream error that carried no packet.
pub const NO_PACKET: &str = "Unknown";

/// The `packet_type` label of raw packet type `ty`: its name, or `Unknown`.
pub fn packet_type_name(ty: i32) -> &'static str {
    PacketType::try_from(ty)
        .map(|t| PACKET_TYPES[type_index(t)])
        .unwrap_or(NO_PACKET)
}

/// Index of a packet type in `PACKET_TYPES`.
fn type_index(ty: PacketType) -> usize {
    match ty {
        PacketType::WindowUpdate => 7,
        other => other as usize,
    }
}

/// `stream_packets_total{segment,packet_type}`: one atomic add per packet (no label
/// lookup), and, as client_golang's vectors do, a series only once its first packet is
/// counted (no zero series for packet types never seen).
#[derive(Clone)]
pub struct PacketCounters {
    desc: prometheus::core::Desc,
    segments: Vec<&'static str>,
    counters: std::sync::Arc<Vec<std::sync::atomic::AtomicU64>>,
}

impl PacketCounters {
    /// Counters for every `segments` x packet type, under the full metric `name`.
    pub fn new(name: &str, help: &str, segments: &[&'static str]) -> Self {
        let desc = prometheus::core::Desc::new(
            name.into(),
            help.into(),
            vec!["segment".into(), "packet_type".into()],
            Default::default(),
        )
        .expect("valid metric");
        PacketCounters {
            desc,
            segments: segments.to_vec(),
            counters: std::sync::Arc::new(
                (0..segments.len() * PACKET_TYPES.len())
                    .map(|_| std::sync::atomic::AtomicU64::new(0))
                    .collect(),
            ),
        }
    }

    /// Counts one packet of raw type `ty` on the segment with index `segment`.
    pub fn inc(&self, segment: usize, ty: i32) {
        if let Ok(ty) = PacketType::try_from(ty) {
            if let Some(c) = self
                .counters
                .get(segment * PACKET_TYPES.len() + type_index(ty))
            {
                c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }
}

impl prometheus::core::Collector for PacketCounters {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        use prometheus::proto;
        let mut family = proto::MetricFamily::default();
        family.set_name(self.desc.fq_name.clone());
        family.set_help(self.desc.help.clone());
        family.set_field_type(proto::MetricType::COUNTER);
        let label = |name: &str, value: &str| {
            let mut l = proto::LabelPair::default();
            l.set_name(name.into());
            l.set_value(value.into());
            l
        };
        let mut metrics = Vec::new();
        for (s, segment) in self.segments.iter().enumerate() {
            for (t, ty) in PACKET_TYPES.iter().enumerate() {
                let n = self.counters[s * PACKET_TYPES.len() + t]
                    .load(std::sync::atomic::Ordering::Relaxed);
                if n == 0 {
                    continue;
                }
                let mut counter = proto::Counter::default();
                counter.set_value(n as f64);
                let mut m = proto::Metric::default();
                m.set_label(vec![label("packet_type", ty), label("segment", segment)]);
                m.set_counter(counter);
                metrics.push(m);
            }
        }
        // An empty family still says what it is; the registry leaves it out of pages.
        family.set_metric(metrics);
        vec![family]
    }
}

/// Warn this long before a loaded certificate expires.
pub const EXPIRY_WARNING: i64 = 30 * 86_400;

/// Each source's (file, index) series, as last published.
type Published = std::collections::HashMap<String, Vec<(String, String)>>;

/// Publishes every loaded certificate's not-after as
/// `tether_certificate_expiry_timestamp_seconds{source,file,index}` (which listener or
/// client loaded it, the file's name without its directory, the certificate's place in
/// the file) and logs a warning when one expires within 30 days. Subjects and
/// directories stay out of the labels: `/metrics` is often reachable from the network,
/// and subjects name nodes.
#[derive(Clone)]
pub struct CertExpiry {
    gauge: prometheus::IntGaugeVec,
    /// The (file, index) series each source published last, so that a reload drops
    /// those of certificates no longer loaded (a renewed bundle that got shorter).
    published: std::sync::Arc<std::sync::Mutex<Published>>,
}

impl CertExpiry {
    /// Registers the gauge in `catalog`.
    pub fn new(catalog: &Catalog) -> Self {
        let gauge = catalog.made(prometheus::IntGaugeVec::new(
            prometheus::Opts::new(
                "tether_certificate_expiry_timestamp_seconds",
                "Not-after time (Unix seconds) of each loaded certificate, by what loaded it (source), its file's name and its place in that file.",
            ),
            &["source", "file", "index"],
        ));
        CertExpiry {
            gauge,
            published: Default::default(),
        }
    }

    /// Drops `source`'s series from its previous load that `now` does not have.
    fn forget_stale(&self, source: &str, now: Vec<(String, String)>) {
        let mut published = self.published.lock().unwrap_or_else(|e| e.into_inner());
        let before = published.insert(source.to_string(), now.clone());
        for (file, index) in before.unwrap_or_default() {
            if !now.contains(&(file.clone(), index.clone())) {
                let _ = self.gauge.remove_label_values(&[source, &file, &index]);
            }
        }
    }

    /// Reads the certificates in `paths` (files without certificates, such as keys,
    /// are skipped) and publishes their expiry under `source`.
    pub fn observe_files(&self, source: &str, paths: &[std::path::PathBuf]) {
        let now = tether_certs::inspect::now();
        let mut loaded = Vec::new();
        let mut complete = true;
        for path in paths {
            let Ok(pem) = std::fs::read_to_string(path) else {
                complete = false;
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
                loaded.push((name.clone(), index.to_string()));
                let left = cert.not_after - now;
                if left < 0 {
                    tracing::error!(path = %file, subject = %cert.subject, "certificate has EXPIRED; issue a new one (tether certs)");
                } else if left < EXPIRY_WARNING {
                    tracing::warn!(path = %file, subject = %cert.subject, days_left = left / 86_400, "certificate expires within 30 days; rotate it");
                }
            }
        }
        // A file that could not be read (mid-rotation, say) keeps its old series.
        if complete {
            self.forget_stale(source, loaded);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shorter_bundle_drops_the_series_of_what_it_no_longer_holds() {
        let dir = std::env::temp_dir().join(format!("tether-expiry-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bundle = dir.join("ca.crt");
        let a = tether_certs::Ca::new("a").unwrap().pair().cert_pem.clone();
        let b = tether_certs::Ca::new("b").unwrap().pair().cert_pem.clone();
        let expiry = CertExpiry::new(&Catalog::default());
        let series = |e: &CertExpiry| {
            let families = prometheus::core::Collector::collect(&e.gauge);
            families[0].get_metric().len()
        };
        std::fs::write(&bundle, format!("{a}{b}")).unwrap();
        expiry.observe_files("client-ca", std::slice::from_ref(&bundle));
        assert_eq!(series(&expiry), 2);
        std::fs::write(&bundle, &a).unwrap();
        expiry.observe_files("client-ca", std::slice::from_ref(&bundle));
        assert_eq!(series(&expiry), 1, "index 1 is gone from the bundle");
        // An unreadable file keeps what was published.
        expiry.observe_files("client-ca", &[dir.join("missing.crt")]);
        assert_eq!(series(&expiry), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn floats_print_as_go_prints_them() {
        for (f, go) in [
            (0.000001, "1e-06"),
            (0.00001, "1e-05"),
            (0.0001, "0.0001"),
            (0.005, "0.005"),
            (0.025, "0.025"),
            (2.5, "2.5"),
            (1.0, "1"),
            (12.5, "12.5"),
            (86400.0, "86400"),
            (100000.0, "100000"),
            (1e6, "1e+06"),
            (1234567.0, "1.234567e+06"),
            (u64::MAX as f64, "1.8446744073709552e+19"),
            (-0.5, "-0.5"),
            (f64::INFINITY, "+Inf"),
            (0.0, "0"),
        ] {
            assert_eq!(go_float(f), go, "{f}");
        }
        let text = "# HELP x_bucket le=\"0.000001\"\nx_bucket{a=\"b\",le=\"0.000001\"} 3\nx_bucket{le=\"+Inf\"} 4\nq{quantile=\"0.5\"} 1\nc{file=\"0.000001\"} 1\n";
        assert_eq!(
            go_label_floats(text),
            "# HELP x_bucket le=\"0.000001\"\nx_bucket{a=\"b\",le=\"1e-06\"} 3\nx_bucket{le=\"+Inf\"} 4\nq{quantile=\"0.5\"} 1\nc{file=\"0.000001\"} 1\n"
        );
    }

    #[test]
    fn proc_files_parse() {
        let netstat = "TcpExt: SyncookiesSent X\nTcpExt: 0 1\nIpExt: InNoRoutes InOctets OutOctets\nIpExt: 0 1234 5678\n";
        assert_eq!(ip_octets(netstat), Some((1234.0, 5678.0)));
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax address space         unlimited            unlimited            bytes\n";
        assert_eq!(address_space_limit(limits), Some(u64::MAX as f64));
        let limits = "Max address space         4096            unlimited            bytes\n";
        assert_eq!(address_space_limit(limits), Some(4096.0));
    }
}

//! `/status` on the admin port, what `tether status` reads: who this server is (id,
//! frontends, version, uptime), its agents (the registry's `/agents` listing), its
//! certificates' not-after times (read back from
//! `tether_certificate_expiry_timestamp_seconds`, so `/metrics` and `/status` cannot
//! disagree) and its lease view (the server count agents are told, the last count of
//! live Leases).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use crate::config::{Listen, ServerConfig};
use crate::lease::LastCount;
use crate::Router;

/// The certificate family `/status` reads.
const CERT_EXPIRY: &str = "tether_certificate_expiry_timestamp_seconds";

/// What `/status` reports beside the router's tables, fixed at start but for the
/// shared counts.
#[derive(Clone)]
pub(crate) struct StatusSource {
    server_id: String,
    frontends: Vec<(String, &'static str)>,
    started: SystemTime,
    configured_count: u32,
    /// The `servercount` agents are told (`--server-count`, or the live Leases).
    server_count: Arc<AtomicU32>,
    /// `Some` with `--enable-lease-controller`: the last count and the renew interval.
    lease: Option<(Arc<LastCount>, Duration)>,
    /// What agents may carry their streams over here, and where QUIC is taken.
    agent_transports: Vec<&'static str>,
    agent_quic: Option<std::net::SocketAddr>,
}

impl StatusSource {
    /// The view of a server about to serve with `config`.
    pub(crate) fn new(
        config: &ServerConfig,
        server_count: Arc<AtomicU32>,
        counted: Arc<LastCount>,
    ) -> Self {
        let frontends = config
            .frontends
            .iter()
            .map(|f| {
                let transport = match f.listen {
                    Listen::Uds { .. } => "uds",
                    Listen::Tcp { .. } => "tcp",
                };
                (f.mode.to_string(), transport)
            })
            .collect();
        StatusSource {
            server_id: config.server_id.clone(),
            frontends,
            started: SystemTime::now(),
            configured_count: config.server_count,
            server_count,
            lease: config.lease.as_ref().map(|l| (counted, l.renew_interval)),
            agent_transports: std::iter::once("h2")
                .chain(config.agent_websocket.then_some("websocket"))
                .chain(config.agent_quic_addr.map(|_| "quic"))
                .collect(),
            agent_quic: config.agent_quic_addr,
        }
    }

    /// The `/status` document.
    pub(crate) fn render(&self, router: &Router) -> String {
        let now = SystemTime::now();
        let mode: Vec<String> = self
            .frontends
            .iter()
            .map(|(mode, transport)| format!("{mode}/{transport}"))
            .collect();
        json!({
            "serverId": self.server_id,
            "mode": mode.join(", "),
            "frontends": self.frontends.iter().map(|(mode, transport)| json!({
                "mode": mode,
                "transport": transport,
            })).collect::<Vec<_>>(),
            "agentTransports": self.agent_transports,
            "agentQuic": self.agent_quic.map(|a| a.to_string()),
            "version": env!("CARGO_PKG_VERSION"),
            "startTime": rfc3339(unix(self.started)),
            "uptimeSeconds": now.duration_since(self.started).unwrap_or_default().as_secs(),
            "agents": router.registry().agents(),
            "certificates": certificates(router.metrics.registry(), unix(now)),
            "lease": self.lease_view(now),
        })
        .to_string()
    }

    fn lease_view(&self, now: SystemTime) -> Value {
        let in_use = self.server_count.load(Ordering::Relaxed);
        let Some((counted, renew)) = &self.lease else {
            return json!({
                "enabled": false,
                "serverCount": in_use,
                "configuredServerCount": self.configured_count,
            });
        };
        let last = counted.get();
        json!({
            "enabled": true,
            "serverCount": in_use,
            "configuredServerCount": self.configured_count,
            "renewIntervalSeconds": renew.as_secs_f64(),
            "liveLeases": last.map(|(n, _)| n),
            "countedSecondsAgo": last.map(|(_, at)| now.duration_since(at).unwrap_or_default().as_secs()),
        })
    }
}

/// Every series of [`CERT_EXPIRY`] in `registry`: source, file, index, not-after and
/// the seconds left at `now` (negative once expired), soonest first.
fn certificates(registry: &prometheus::Registry, now: i64) -> Vec<Value> {
    let mut out: Vec<(i64, Value)> = Vec::new();
    for family in registry.gather() {
        if family.name() != CERT_EXPIRY {
            continue;
        }
        for m in family.get_metric() {
            let label = |name: &str| {
                m.get_label()
                    .iter()
                    .find(|l| l.name() == name)
                    .map(|l| l.value().to_string())
                    .unwrap_or_default()
            };
            let not_after = m.get_gauge().get_value() as i64;
            out.push((
                not_after,
                json!({
                    "source": label("source"),
                    "file": label("file"),
                    "index": label("index").parse::<u32>().unwrap_or(0),
                    "notAfter": rfc3339(not_after),
                    "notAfterSeconds": not_after,
                    "expiresInSeconds": not_after - now,
                }),
            ));
        }
    }
    out.sort_by_key(|(not_after, _)| *not_after);
    out.into_iter().map(|(_, v)| v).collect()
}

fn unix(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// `secs` (Unix) as RFC 3339 in UTC.
fn rfc3339(secs: i64) -> String {
    k8s_openapi::jiff::Timestamp::from_second(secs)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificates_come_from_the_expiry_family() {
        let metrics = crate::metrics::Metrics::new();
        let dir = std::env::temp_dir().join(format!("tether-status-{}", std::process::id()));
        let pki = tether_certs::DevPki::generate(&dir).unwrap();
        metrics
            .cert_expiry
            .observe_files("agent-listener", std::slice::from_ref(&pki.server_cert));
        let now = unix(SystemTime::now());
        let certs = certificates(metrics.registry(), now);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(certs.len(), 1, "{certs:?}");
        assert_eq!(certs[0]["source"], "agent-listener");
        assert_eq!(
            certs[0]["file"],
            pki.server_cert.file_name().unwrap().to_str().unwrap()
        );
        assert_eq!(certs[0]["index"], 0);
        let left = certs[0]["expiresInSeconds"].as_i64().unwrap();
        assert!(left > 300 * 86_400, "{left}");
        assert!(certs[0]["notAfter"].as_str().unwrap().ends_with('Z'));
    }

    #[test]
    fn timestamps_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
    }
}

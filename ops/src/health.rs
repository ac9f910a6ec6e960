//! The health and admin HTTP endpoints every Tether process serves: `/healthz`,
//! `/readyz` (with `?verbose`) and `/metrics` in Prometheus text format.

use std::sync::Arc;
use tether_core::error::chain;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus::{Encoder, Registry, TextEncoder};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Reports readiness: `Ok(detail)` when ready, `Err(reason)` when not.
pub type ReadyCheck = Arc<dyn Fn() -> Result<String, String> + Send + Sync>;

#[derive(Clone)]
struct HealthState {
    registry: Registry,
    ready: ReadyCheck,
    not_ready: StatusCode,
}

/// `/healthz`, `/readyz` (and `/ready`, its deprecated alias, which upstream still
/// serves) and `/metrics`. `not_ready` is the status for an unready process (upstream:
/// 500 on the server, 503 on the agent).
pub fn health_router(registry: Registry, ready: ReadyCheck, not_ready: StatusCode) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/ready", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(HealthState {
            registry,
            ready,
            not_ready,
        })
}

/// The admin endpoint: `/metrics`, and with `profiling` the pprof endpoints.
pub fn admin_router(registry: Registry, profiling: bool) -> Router {
    let router = health_router(registry, Arc::new(|| Ok("ok".into())), StatusCode::OK);
    if profiling {
        router.merge(crate::profiling::router())
    } else {
        router
    }
}

async fn readyz(
    State(state): State<HealthState>,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> impl IntoResponse {
    let verbose = q.contains_key("verbose");
    match (state.ready)() {
        Ok(detail) if verbose => (StatusCode::OK, format!("ready: {detail}\n")),
        Ok(_) => (StatusCode::OK, "ok".to_string()),
        Err(reason) => (state.not_ready, format!("not ready: {reason}\n")),
    }
}

async fn metrics(State(state): State<HealthState>) -> impl IntoResponse {
    // As client_golang's promhttp.Handler(): in flight while rendering, counted after.
    let handler = crate::metrics::promhttp();
    handler.in_flight.inc();
    let page = render(&state.registry);
    handler.in_flight.dec();
    handler.requests.with_label_values(&["200"]).inc();
    page
}

/// Renders `registry` in Prometheus text exposition format, `le` and `quantile`
/// values spelt as client_golang spells them.
pub fn render(registry: &Registry) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    let mut buf = Vec::new();
    let encoder = TextEncoder::new();
    if let Err(e) = encoder.encode(&registry.gather(), &mut buf) {
        tracing::warn!(error = %chain(&e), "encoding metrics failed");
    }
    let text = String::from_utf8(buf).unwrap_or_default();
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        crate::metrics::go_label_floats(&text),
    )
}

/// How long a client of a health or admin port may take to send a request head, and
/// may leave a kept-alive connection idle before its next one.
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves `router` on `listener` until `hard_stop`, under [`AdmissionLimits::SIDE`]:
/// at most 256 connections (more wait in the kernel's backlog), 16 per source address
/// and 64 per /24 (or /64) beyond which a new one is closed at once, and at 128 open a
/// new client evicts the oldest connection of the busiest prefix, so a kubelet probe
/// gets in during a flood. A request head must come within [`HEADER_READ_TIMEOUT`] of
/// the connection or of the previous answer.
///
/// [`AdmissionLimits::SIDE`]: tether_core::admission::AdmissionLimits::SIDE
pub fn spawn(
    name: &'static str,
    listener: TcpListener,
    router: Router,
    hard_stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    spawn_counted(name, listener, router, Arc::new(|_| {}), None, hard_stop)
}

/// [`spawn`], with `on_refusal` hearing each connection closed unserved, and over TLS
/// when `tls` is given (its current configuration taken for each connection, so a
/// renewed certificate serves the next client).
pub fn spawn_counted(
    name: &'static str,
    listener: TcpListener,
    router: Router,
    on_refusal: tether_core::admission::OnRefusal,
    tls: Option<tether_core::transport::ServerConfigSource>,
    hard_stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let addr = listener.local_addr().ok();
    // On loopback, only clients of this machine connect, but a browser on it can be
    // led there by a page whose name an attacker re-points at 127.0.0.1.
    let router = match addr {
        Some(a) if a.ip().is_loopback() => {
            router.layer(axum::middleware::from_fn(refuse_foreign_host))
        }
        _ => router,
    };
    let admission = Arc::new(tether_core::admission::Admission::new(
        tether_core::admission::AdmissionLimits::SIDE,
        on_refusal,
    ));
    tokio::spawn(
        serve(listener, router, admission, tls, hard_stop)
            .instrument(tracing::info_span!("http", endpoint = name, addr = ?addr)),
    )
}

/// Is `host` (a request's `Host`) what a client of a loopback listener writes: an IP
/// address, `localhost` or a name under `.localhost` (RFC 6761: never resolved
/// elsewhere), with or without a port? A page that DNS rebinding brought to
/// 127.0.0.1 sends its own name instead.
pub fn loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        // `[v6]` or `[v6]:port`.
        return match rest.split_once(']') {
            Some((ip, port)) => {
                ip.parse::<std::net::Ipv6Addr>().is_ok()
                    && (port.is_empty() || port.strip_prefix(':').is_some_and(is_port))
            }
            None => false,
        };
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if is_port(port) => name,
            Some(_) => return false,
            None => host,
        }
    };
    if name.parse::<std::net::Ipv4Addr>().is_ok() {
        return true;
    }
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    name == "localhost" || name.ends_with(".localhost")
}

fn is_port(s: &str) -> bool {
    !s.is_empty() && s.len() <= 5 && s.bytes().all(|b| b.is_ascii_digit())
}

/// Refuses a request to a loopback listener whose `Host` names something else
/// (see [`loopback_host`]); a request without one (HTTP/1.0) is not a browser's.
async fn refuse_foreign_host(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let host = request
        .headers()
        .get(axum::http::header::HOST)
        .map(|h| h.to_str().unwrap_or("\u{fffd}"));
    match host {
        Some(h) if !loopback_host(h) => {
            tracing::debug!(host = ?h, path = %request.uri().path(), "request refused: foreign Host on a loopback listener");
            (
                StatusCode::FORBIDDEN,
                format!(
                    "Host {h:?} is not this loopback listener's: ask for 127.0.0.1, [::1] or localhost (a guard against DNS rebinding)\n"
                ),
            )
                .into_response()
        }
        _ => next.run(request).await,
    }
}

/// The accept loop of [`spawn`]; each connection is served in a task of its own.
async fn serve(
    listener: TcpListener,
    router: Router,
    admission: Arc<tether_core::admission::Admission>,
    tls: Option<tether_core::transport::ServerConfigSource>,
    hard_stop: CancellationToken,
) {
    let failures = tether_core::ratelimit::TokenBucket::new(1.0, 5);
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        let slot = tokio::select! {
            _ = hard_stop.cancelled() => break,
            slot = admission.connection_slot() => slot,
        };
        let (tcp, peer) = tokio::select! {
            _ = hard_stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    if failures.try_acquire() {
                        tracing::warn!(error = %chain(&e), "accept failed");
                    }
                    // EMFILE and friends: back off a little instead of spinning.
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let pending = tokio::select! {
            _ = hard_stop.cancelled() => break,
            admitted = admission.admit(peer.ip()) => admitted,
        };
        let Ok(pending) = pending else {
            continue;
        };
        let router = router.clone();
        let hard_stop = hard_stop.clone();
        let tls = tls.as_ref().map(|source| source());
        connections.spawn(async move {
            let _slot = slot;
            match tls {
                None => serve_one(tcp, router, &pending, &hard_stop).await,
                Some(config) => {
                    let accept = tokio_rustls::TlsAcceptor::from(config).accept(tcp);
                    let tls = tokio::select! {
                        _ = hard_stop.cancelled() => return,
                        _ = pending.evicted() => return,
                        done = tokio::time::timeout(HEADER_READ_TIMEOUT, accept) => done,
                    };
                    match tls {
                        Ok(Ok(stream)) => serve_one(stream, router, &pending, &hard_stop).await,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %chain(&e), "TLS handshake failed")
                        }
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                }
            }
        });
    }
    connections.close();
    connections.wait().await;
}

/// Serves HTTP/1.1 on one connection until it ends, its client is evicted, or
/// `hard_stop` (then its request in flight gets a second).
async fn serve_one<IO>(
    io: IO,
    router: Router,
    pending: &tether_core::admission::Pending,
    hard_stop: &CancellationToken,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let service = hyper_util::service::TowerToHyperService::new(router);
    let conn = http.serve_connection(hyper_util::rt::TokioIo::new(io), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        _ = pending.evicted() => {}
        _ = hard_stop.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(std::time::Duration::from_secs(1), conn).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::loopback_host;

    #[test]
    fn loopback_hosts_are_addresses_and_localhost() {
        for ok in [
            "127.0.0.1",
            "127.0.0.1:8133",
            "[::1]",
            "[::1]:8133",
            "localhost",
            "LocalHost:8133",
            "localhost.:8133",
            "tether.localhost:8133",
            "10.0.0.1:8133",
        ] {
            assert!(loopback_host(ok), "{ok}");
        }
        for refused in [
            "evil.example",
            "evil.example:8133",
            "localhost.evil.example",
            "evillocalhost:8133",
            "127.0.0.1:port",
            "127.0.0.1:",
            "[::1",
            "[::1]8133",
            "[evil]:80",
            "::1",
            "",
        ] {
            assert!(!loopback_host(refused), "{refused}");
        }
    }
}

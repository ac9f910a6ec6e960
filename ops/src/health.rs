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

/// Serves `router` on `listener` until `hard_stop`.
pub fn spawn(
    name: &'static str,
    listener: TcpListener,
    router: Router,
    hard_stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let addr = listener.local_addr().ok();
    tokio::spawn(
        async move {
            if let Err(e) = axum::serve(listener, router)
                .with_graceful_shutdown(hard_stop.cancelled_owned())
                .await
            {
                tracing::error!(error = %chain(&e), "HTTP endpoint failed");
            }
        }
        .instrument(tracing::info_span!("http", endpoint = name, addr = ?addr)),
    )
}

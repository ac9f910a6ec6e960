//! The side services: the health port (`/healthz`, `/readyz`, `/metrics`) and the
//! admin port (`/metrics`, `/agents`, `/status`, pprof).

use axum::http::StatusCode;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::AGENTS_AUDIENCE;
use crate::status::StatusSource;
use crate::Router;

/// `/healthz`, `/readyz` (ready with at least one agent stream) and `/metrics`.
pub(crate) fn spawn_health(
    router: &Arc<Router>,
    listener: TcpListener,
    hard_stop: &CancellationToken,
) {
    let r = router.clone();
    let ready: tether_ops::health::ReadyCheck = Arc::new(move || match r.registry().len() {
        0 => Err("no agent connected".into()),
        n => Ok(format!("{n} agent stream(s) connected")),
    });
    let registry = router.metrics.registry().clone();
    let app = tether_ops::health::health_router(registry, ready, StatusCode::INTERNAL_SERVER_ERROR);
    let refused = crate::accept::refusals(router, "health");
    tether_ops::health::spawn_counted("health", listener, app, refused, None, hard_stop.clone());
}

/// How `/agents` requests are checked.
#[derive(Clone)]
pub(crate) enum AgentsReaders {
    Anyone,
    Authorized {
        /// `None`: no Kubernetes client, so every request is refused.
        delegation: Option<tether_ops::authz::Delegation>,
        decisions: Arc<tether_ops::authz::DecisionCache>,
    },
}

/// Refuses a request for `path` (`/agents` or `/status`) that `readers` do not
/// admit; `None` lets it through. Both paths need what `/agents` needs: `get` on the
/// non-resource URL `/agents`, so one grant (and one cached decision) covers both.
async fn refusal(
    readers: &AgentsReaders,
    headers: &axum::http::HeaderMap,
    path: &str,
) -> Option<axum::response::Response> {
    use axum::response::IntoResponse;
    let AgentsReaders::Authorized {
        delegation,
        decisions,
    } = readers
    else {
        return None;
    };
    let decision = match delegation {
        Some(d) => {
            decisions
                .authorize(d, headers, "/agents", Some(&[AGENTS_AUDIENCE]))
                .await
        }
        None => Err((
            StatusCode::FORBIDDEN,
            format!("{path}: the admin port is not on loopback and the server has no Kubernetes client to review tokens (set --kubeconfig or bind --admin-bind-address=127.0.0.1)"),
        )),
    };
    let (status, why) = decision.err()?;
    tracing::debug!(reason = %why, %status, %path, "admin request refused");
    Some((status, format!("{why}\n")).into_response())
}

/// `/metrics`, the profiles, `/agents` and `/status` on the admin port, over TLS with
/// `tls` (`--admin-cert`).
pub(crate) fn spawn_admin(
    router: &Arc<Router>,
    listener: TcpListener,
    profiling: bool,
    readers: AgentsReaders,
    status: StatusSource,
    tls: Option<tether_core::transport::ServerConfigSource>,
    hard_stop: &CancellationToken,
) {
    use axum::response::IntoResponse;
    let json = |body: String| {
        (
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    };
    let (r, agents_readers) = (router.clone(), readers.clone());
    let agents = axum::routing::get(move |headers: axum::http::HeaderMap| {
        let (r, readers) = (r.clone(), agents_readers.clone());
        async move {
            match refusal(&readers, &headers, "/agents").await {
                Some(refused) => refused,
                None => json(r.registry().agents_json()),
            }
        }
    });
    let r = router.clone();
    let status = axum::routing::get(move |headers: axum::http::HeaderMap| {
        let (r, readers, status) = (r.clone(), readers.clone(), status.clone());
        async move {
            match refusal(&readers, &headers, "/status").await {
                Some(refused) => refused,
                None => json(status.render(&r)),
            }
        }
    });
    let registry = router.metrics.registry().clone();
    let app = tether_ops::health::admin_router(registry, profiling)
        .route("/agents", agents)
        .route("/status", status);
    let refused = crate::accept::refusals(router, "admin");
    tether_ops::health::spawn_counted("admin", listener, app, refused, tls, hard_stop.clone());
}

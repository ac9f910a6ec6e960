//! The side services: the health port (`/healthz`, `/readyz`, `/metrics`) and the
//! admin port (`/metrics`, `/agents`, pprof).

use axum::http::StatusCode;
use std::sync::Arc;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::AGENTS_AUDIENCE;
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
    tether_ops::health::spawn("health", listener, app, hard_stop.clone());
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

/// `/metrics`, the profiles and `/agents` on the admin port.
pub(crate) fn spawn_admin(
    router: &Arc<Router>,
    listener: TcpListener,
    profiling: bool,
    readers: AgentsReaders,
    hard_stop: &CancellationToken,
) {
    use axum::response::IntoResponse;
    let r = router.clone();
    let agents = axum::routing::get(move |headers: axum::http::HeaderMap| {
        let (r, readers) = (r.clone(), readers.clone());
        async move {
            if let AgentsReaders::Authorized {
                delegation,
                decisions,
            } = &readers
            {
                let decision = match delegation {
                    Some(d) => {
                        decisions
                            .authorize(d, &headers, "/agents", Some(&[AGENTS_AUDIENCE]))
                            .await
                    }
                    None => Err((
                        StatusCode::FORBIDDEN,
                        "/agents: the admin port is not on loopback and the server has no Kubernetes client to review tokens (set --kubeconfig or bind --admin-bind-address=127.0.0.1)".into(),
                    )),
                };
                if let Err((status, why)) = decision {
                    tracing::debug!(reason = %why, %status, "/agents request refused");
                    return (status, format!("{why}\n")).into_response();
                }
            }
            (
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                r.registry().agents_json(),
            )
                .into_response()
        }
    });
    let registry = router.metrics.registry().clone();
    let app = tether_ops::health::admin_router(registry, profiling).route("/agents", agents);
    tether_ops::health::spawn("admin", listener, app, hard_stop.clone());
}

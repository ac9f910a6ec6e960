//! The CCM's HTTPS endpoint (`--secure-port`, 10258, as upstream): `/healthz` (also
//! `/livez`, `/readyz`; anonymous) runs one check per controller plus leader election;
//! `/metrics` needs a bearer token that a TokenReview accepts and a SubjectAccessReview
//! allowing `get` on `/metrics` for its user (upstream's delegated authentication and
//! authorization). Decisions are cached for 10 s per token, as upstream's delegated
//! authenticator and authorizer do, so a scraper costs no API calls per scrape.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tether_core::error::chain;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tether_core::transport::{tls_incoming, ServerConfigSource, TlsConn};
pub use tether_ops::authz::{DecisionCache, Delegation, DECISION_TTL};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

type Check = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// Named health checks; `/healthz` is ok when all pass.
#[derive(Default, Clone)]
pub struct Health {
    checks: Arc<Mutex<BTreeMap<String, Check>>>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health").finish_non_exhaustive()
    }
}

impl Health {
    /// Adds (or replaces) check `name`.
    pub fn add(&self, name: &str, check: impl Fn() -> Result<(), String> + Send + Sync + 'static) {
        self.lock().insert(name.into(), Arc::new(check));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Check>> {
        self.checks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs every check: (all ok, report in Kubernetes' `[+]name ok` format).
    pub fn run(&self) -> (bool, String) {
        let checks: Vec<(String, Check)> = self
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut ok = true;
        let mut report = String::new();
        for (name, check) in checks {
            match check() {
                Ok(()) => report.push_str(&format!("[+]{name} ok\n")),
                Err(why) => {
                    ok = false;
                    report.push_str(&format!("[-]{name} failed: {why}\n"));
                }
            }
        }
        (ok, report)
    }
}

#[derive(Clone)]
struct Ctx {
    delegation: Delegation,
    health: Health,
    registry: prometheus::Registry,
    decisions: Arc<DecisionCache>,
}

/// Serves until `hard_stop` on `listener` with `tls`.
pub fn spawn(
    listener: TcpListener,
    tls: ServerConfigSource,
    delegation: Delegation,
    health: Health,
    registry: prometheus::Registry,
    hard_stop: CancellationToken,
) {
    let ctx = Ctx {
        delegation,
        health,
        registry,
        decisions: Arc::default(),
    };
    let router = Router::new()
        .route("/healthz", get(healthz))
        .route("/livez", get(healthz))
        .route("/readyz", get(healthz))
        .route("/metrics", get(metrics))
        .with_state(ctx);
    let incoming = Incoming(tls_incoming(listener, tls, "ccm-secure", hard_stop.clone()));
    tokio::spawn(
        async move {
            let served = axum::serve(incoming, router)
                .with_graceful_shutdown(hard_stop.cancelled_owned())
                .await;
            if let Err(e) = served {
                tracing::error!(error = %chain(&e), "secure endpoint failed");
            }
        }
        .instrument(tracing::info_span!("secure_serving")),
    );
}

struct Incoming(tokio::sync::mpsc::Receiver<TlsConn>);

impl axum::serve::Listener for Incoming {
    type Io = TlsConn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (TlsConn, SocketAddr) {
        match self.0.recv().await {
            Some(conn) => {
                let addr = conn.info().remote_addr;
                (conn, addr)
            }
            // The hard stop: axum's graceful shutdown ends the server.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(SocketAddr::from(([0, 0, 0, 0], 0)))
    }
}

async fn healthz(State(ctx): State<Ctx>) -> Response {
    let (ok, report) = ctx.health.run();
    if ok {
        (StatusCode::OK, "ok").into_response()
    } else {
        tracing::warn!(%report, "health check failed");
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("{report}healthz check failed\n"),
        )
            .into_response()
    }
}

async fn metrics(State(ctx): State<Ctx>, headers: HeaderMap) -> Response {
    match ctx
        .decisions
        .authorize(&ctx.delegation, &headers, "/metrics", None)
        .await
    {
        Ok(()) => tether_ops::health::render(&ctx.registry).into_response(),
        Err((status, why)) => {
            tracing::info!(reason = %why, "metrics request refused");
            (status, format!("{why}\n")).into_response()
        }
    }
}

//! The CCM's HTTPS endpoint (`--secure-port`, 10258, as upstream): `/healthz` (also
//! `/livez`, `/readyz`; anonymous) runs one check per controller plus leader election;
//! `/metrics` needs a bearer token that a TokenReview accepts and a SubjectAccessReview
//! allowing `get` on `/metrics` for its user (upstream's delegated authentication and
//! authorization). Decisions are cached for 10 s per token, as upstream's delegated
//! authenticator and authorizer do, so a scraper costs no API calls per scrape.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use tether_core::transport::{tls_incoming, ServerConfigSource, TlsConn};
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

/// How long an authentication + authorization decision is reused (upstream: 10 s).
pub const DECISION_TTL: std::time::Duration = std::time::Duration::from_secs(10);
/// At most this many tokens are remembered.
const DECISION_CAP: usize = 1024;

type Decision = Result<(), (StatusCode, String)>;

/// Recent decisions by SHA-256 of the token (the token itself is not kept).
#[derive(Default)]
pub struct DecisionCache {
    map: Mutex<std::collections::HashMap<[u8; 32], (std::time::Instant, Decision)>>,
}

impl DecisionCache {
    fn key(token: &str) -> [u8; 32] {
        let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
        let mut k = [0u8; 32];
        k.copy_from_slice(d.as_ref());
        k
    }

    fn get(&self, token: &str, now: std::time::Instant) -> Option<Decision> {
        let map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.get(&Self::key(token))
            .filter(|(at, _)| now.saturating_duration_since(*at) < DECISION_TTL)
            .map(|(_, d)| d.clone())
    }

    /// Remembers a definite answer (allowed, 401, 403); failures to ask are not kept.
    fn put(&self, token: &str, decision: &Decision, now: std::time::Instant) {
        if matches!(decision, Err((StatusCode::INTERNAL_SERVER_ERROR, _))) {
            return;
        }
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        map.retain(|_, (at, _)| now.saturating_duration_since(*at) < DECISION_TTL);
        if map.len() >= DECISION_CAP {
            map.clear();
        }
        map.insert(Self::key(token), (now, decision.clone()));
    }
}

/// The clients delegated authentication and authorization use
/// (`--authentication-kubeconfig`, `--authorization-kubeconfig`; by default the
/// controller manager's own).
#[derive(Clone)]
pub struct Delegation {
    /// Sends TokenReviews.
    pub authentication: kube::Client,
    /// Sends SubjectAccessReviews.
    pub authorization: kube::Client,
}

/// Serves until `shutdown` on `listener` with `tls`.
pub fn spawn(
    listener: TcpListener,
    tls: ServerConfigSource,
    delegation: Delegation,
    health: Health,
    registry: prometheus::Registry,
    shutdown: CancellationToken,
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
    let incoming = Incoming(tls_incoming(listener, tls, "ccm-secure", shutdown.clone()));
    tokio::spawn(
        async move {
            let served = axum::serve(incoming, router)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "secure endpoint failed");
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
            // Shutting down: graceful shutdown ends the server.
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
    let token = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty());
    let Some(token) = token else {
        return (StatusCode::UNAUTHORIZED, "Unauthorized\n").into_response();
    };
    let now = std::time::Instant::now();
    let decision = match ctx.decisions.get(token, now) {
        Some(d) => d,
        None => {
            let d = authorize(&ctx.delegation, token, "/metrics").await;
            ctx.decisions.put(token, &d, now);
            d
        }
    };
    match decision {
        Ok(()) => tether_ops::health::render(&ctx.registry).into_response(),
        Err((status, why)) => {
            tracing::info!(reason = %why, "metrics request refused");
            (status, format!("{why}\n")).into_response()
        }
    }
}

/// TokenReview, then SubjectAccessReview for `get` on `path`.
async fn authorize(
    delegation: &Delegation,
    token: &str,
    path: &str,
) -> Result<(), (StatusCode, String)> {
    let reviews: Api<TokenReview> = Api::all(delegation.authentication.clone());
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.into()),
            audiences: None,
        },
        ..Default::default()
    };
    let status = reviews
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("token review failed: {e}"),
            )
        })?
        .status
        .unwrap_or_default();
    if status.authenticated != Some(true) {
        return Err((StatusCode::UNAUTHORIZED, "Unauthorized".into()));
    }
    let user = status.user.unwrap_or_default();
    let sars: Api<SubjectAccessReview> = Api::all(delegation.authorization.clone());
    let sar = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: user.username.clone(),
            groups: user.groups.clone(),
            uid: user.uid.clone(),
            extra: user.extra.clone(),
            non_resource_attributes: Some(NonResourceAttributes {
                path: Some(path.into()),
                verb: Some("get".into()),
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let allowed = sars
        .create(&PostParams::default(), &sar)
        .await
        .map_err(|e| {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("access review failed: {e}"),
            )
        })?
        .status
        .is_some_and(|s| s.allowed);
    if allowed {
        Ok(())
    } else {
        Err((
            StatusCode::FORBIDDEN,
            format!(
                "forbidden: user {:?} may not get {path}",
                user.username.unwrap_or_default()
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn decisions_are_reused_for_ten_seconds_but_failures_to_ask_are_not() {
        let cache = DecisionCache::default();
        let t0 = Instant::now();
        cache.put("a", &Ok(()), t0);
        cache.put("b", &Err((StatusCode::FORBIDDEN, "no".into())), t0);
        cache.put(
            "c",
            &Err((StatusCode::INTERNAL_SERVER_ERROR, "down".into())),
            t0,
        );
        assert_eq!(cache.get("a", t0 + Duration::from_secs(9)), Some(Ok(())));
        assert!(matches!(
            cache.get("b", t0),
            Some(Err((StatusCode::FORBIDDEN, _)))
        ));
        assert_eq!(cache.get("c", t0), None);
        assert_eq!(cache.get("a", t0 + DECISION_TTL), None);
        assert_eq!(cache.get("z", t0), None);
    }
}

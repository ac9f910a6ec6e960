//! Delegated authentication and authorization of HTTP endpoints, as Kubernetes
//! components do it: a bearer token that a TokenReview accepts, then a
//! SubjectAccessReview allowing `get` on the path for its user. Decisions are cached for
//! 10 s per token (by its SHA-256; the token itself is not kept), so a scraper costs no
//! API calls per scrape.

use std::sync::Mutex;
use tether_core::error::chain;

use axum::http::{HeaderMap, StatusCode};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};

/// How long an authentication + authorization decision is reused (upstream: 10 s).
pub const DECISION_TTL: std::time::Duration = std::time::Duration::from_secs(10);
/// At most this many tokens are remembered.
const DECISION_CAP: usize = 1024;

/// Allowed, or the status and reason to answer with.
pub type Decision = Result<(), (StatusCode, String)>;

/// At most this many reviews are in flight; a request beyond them gets 429, so that
/// callers with made-up tokens cannot turn one endpoint into a flood of TokenReviews.
const MAX_REVIEWS_IN_FLIGHT: usize = 4;
/// A review that takes longer is abandoned (500, not cached).
const REVIEW_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Recent decisions by SHA-256 of the path and token (the token itself is not kept),
/// and the reviews in flight.
pub struct DecisionCache {
    map: Mutex<std::collections::HashMap<[u8; 32], (std::time::Instant, Decision)>>,
    in_flight: tokio::sync::Semaphore,
}

impl Default for DecisionCache {
    fn default() -> Self {
        DecisionCache {
            map: Mutex::default(),
            in_flight: tokio::sync::Semaphore::new(MAX_REVIEWS_IN_FLIGHT),
        }
    }
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

impl Delegation {
    /// Both reviews sent with one client.
    pub fn with(client: kube::Client) -> Self {
        Delegation {
            authentication: client.clone(),
            authorization: client,
        }
    }
}

impl DecisionCache {
    /// Decides whether the bearer token in `headers` may `get` `path`: 401 without a
    /// token or with one the TokenReview rejects, 403 when the SubjectAccessReview
    /// denies, 429 while [`MAX_REVIEWS_IN_FLIGHT`] reviews are pending, 500 when a review
    /// could not be sent (not cached; the caller learns no more than that). With
    /// `audiences`, the token must have been issued for one of them: a token bound to
    /// such an audience is useless against kube-apiserver itself, so one read off the
    /// wire cannot be replayed there.
    pub async fn authorize(
        &self,
        delegation: &Delegation,
        headers: &HeaderMap,
        path: &str,
        audiences: Option<&[&str]>,
    ) -> Decision {
        let token = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty());
        let Some(token) = token else {
            return Err((StatusCode::UNAUTHORIZED, "Unauthorized".into()));
        };
        let key = format!("{path} {token}");
        let now = std::time::Instant::now();
        if let Some(d) = self.get(&key, now) {
            return d;
        }
        let Ok(_slot) = self.in_flight.try_acquire() else {
            return Err((
                StatusCode::TOO_MANY_REQUESTS,
                "too many authorization checks in flight; retry".into(),
            ));
        };
        let d =
            match tokio::time::timeout(REVIEW_TIMEOUT, review(delegation, token, path, audiences))
                .await
            {
                Ok(d) => d,
                Err(_) => Err((
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("no review answer within {REVIEW_TIMEOUT:?}"),
                )),
            };
        self.put(&key, &d, now);
        match d {
            Err((StatusCode::INTERNAL_SERVER_ERROR, why)) => {
                tracing::warn!(%path, error = %why, "cannot check an HTTP caller's token");
                Err((
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the authorization check failed; see the server's log".into(),
                ))
            }
            d => d,
        }
    }
}

/// TokenReview, then SubjectAccessReview for `get` on `path`.
async fn review(
    delegation: &Delegation,
    token: &str,
    path: &str,
    audiences: Option<&[&str]>,
) -> Result<(), (StatusCode, String)> {
    let reviews: Api<TokenReview> = Api::all(delegation.authentication.clone());
    let review = TokenReview {
        spec: TokenReviewSpec {
            token: Some(token.into()),
            audiences: audiences.map(|a| a.iter().map(|s| s.to_string()).collect()),
        },
        ..Default::default()
    };
    let status = reviews
        .create(&PostParams::default(), &review)
        .await
        .map_err(|e| {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("token review failed: {}", chain(&e)),
            )
        })?
        .status
        .unwrap_or_default();
    if status.authenticated != Some(true) {
        return Err((StatusCode::UNAUTHORIZED, "Unauthorized".into()));
    }
    // An authenticator that ignores the audiences asked for answers none: not bound.
    if let Some(wanted) = audiences {
        let bound = status
            .audiences
            .as_ref()
            .is_some_and(|got| got.iter().any(|a| wanted.contains(&a.as_str())));
        if !bound {
            return Err((StatusCode::UNAUTHORIZED, "Unauthorized".into()));
        }
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
                format!("access review failed: {}", chain(&e)),
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

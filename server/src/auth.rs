//! Agent authentication without client certificates: the agent sends a bound
//! service-account token (`authorization: Bearer ...`); the server checks it with a
//! TokenReview against kube-apiserver (audience and `system:serviceaccount:<ns>:<sa>`).
//! Positive reviews are cached briefly and reviews are rate limited, so a thousand
//! agents reconnecting at once cannot flood the apiserver. A token bound to a Pod also
//! says which node the agent runs on (the review's `node-name`, or the bound Pod's
//! `spec.nodeName`): the identifiers naming that node count as verified. A live stream's
//! token is reviewed again whenever its cached review expires ([`TokenAuthenticator::
//! still_valid`]), so a revoked token (its Pod deleted) ends the streams it opened.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tether_core::error::chain;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use kube::api::{Api, PostParams};
use prometheus::IntCounterVec;
use tether_ops::ratelimit::TokenBucket;

/// How long a positive review is trusted without asking again; also how often a live
/// stream's token is reviewed again.
pub const POSITIVE_CACHE_TTL: Duration = Duration::from_secs(30);
/// Most tokens remembered at once.
const CACHE_CAP: usize = 16_384;

/// What identity agents must prove.
#[derive(Debug, Clone)]
pub struct TokenAuthConfig {
    /// `--agent-namespace`.
    pub namespace: String,
    /// `--agent-service-account`.
    pub service_account: String,
    /// `--authentication-audience`.
    pub audience: String,
    /// `--kubeconfig`; `None` = in-cluster configuration.
    pub kubeconfig: Option<PathBuf>,
    /// TokenReviews per second.
    pub qps: f64,
    /// Burst of TokenReviews.
    pub burst: u32,
}

pub use tether_ops::kubeclient::KubeSetupError as AuthSetupError;

/// Why an agent was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// No `authorization` metadata.
    #[error("no bearer token (set --service-account-token-path on the agent)")]
    Missing,
    /// The header is not `Bearer <token>`.
    #[error("authorization metadata is not \"Bearer <token>\"")]
    Malformed,
    /// The apiserver did not authenticate the token.
    #[error("token rejected by kube-apiserver: {0}")]
    Rejected(String),
    /// Authenticated, but as someone else.
    #[error("token belongs to {got:?}, expected {expected:?}")]
    WrongIdentity {
        /// Who the token is.
        got: String,
        /// Who it must be.
        expected: String,
    },
    /// The TokenReview call failed.
    #[error("TokenReview failed")]
    Api(#[source] kube::Error),
}

impl AuthError {
    /// What the agent is told: the server's own words for what it can fix, and nothing
    /// of the apiserver's answer (which an unauthenticated client must not read).
    pub fn public_message(&self) -> &'static str {
        match self {
            AuthError::Missing => "no bearer token (set --service-account-token-path on the agent)",
            AuthError::Malformed => "authorization metadata is not \"Bearer <token>\"",
            AuthError::Rejected(_) | AuthError::WrongIdentity { .. } => "token not accepted",
            AuthError::Api(_) => "the token could not be reviewed now; retry",
        }
    }
}

/// What a token proved: the node (and Pod) it is bound to, if it is bound to one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bound {
    /// The node the token's Pod runs on.
    pub node: Option<String>,
    /// The Pod the token is bound to: (name, uid).
    pub pod: Option<(String, String)>,
}

/// Positive reviews by token hash: until when, and what the token is bound to.
type ReviewCache = HashMap<[u8; 32], (Instant, Bound)>;

/// Checks agent tokens by TokenReview.
pub struct TokenAuthenticator {
    reviews: Api<TokenReview>,
    pods: Api<Pod>,
    accounts: Api<ServiceAccount>,
    /// The agents' ServiceAccount, by name.
    service_account: String,
    expected_user: String,
    audience: String,
    cache: Mutex<ReviewCache>,
    limiter: TokenBucket,
    /// Reviews of live streams' tokens: half the rate, so that they never hold up
    /// agents waiting to be admitted.
    relimiter: TokenBucket,
    counter: IntCounterVec,
}

/// The token in an `authorization` value of the form `Bearer <token>`.
fn bearer_token(authorization: Option<&str>) -> Result<&str, AuthError> {
    let header = authorization.ok_or(AuthError::Missing)?;
    header
        .strip_prefix("Bearer ")
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or(AuthError::Malformed)
}

impl TokenAuthenticator {
    /// Builds the Kubernetes client from the kubeconfig (or in-cluster config).
    pub async fn new(
        config: &TokenAuthConfig,
        counter: IntCounterVec,
    ) -> Result<Self, AuthSetupError> {
        let client = tether_ops::kubeclient::client(config.kubeconfig.as_deref()).await?;
        for result in ["authenticated", "cached", "rejected", "error"] {
            counter.with_label_values(&[result]);
        }
        Ok(TokenAuthenticator {
            reviews: Api::all(client.clone()),
            pods: Api::namespaced(client.clone(), &config.namespace),
            accounts: Api::namespaced(client, &config.namespace),
            service_account: config.service_account.clone(),
            expected_user: format!(
                "system:serviceaccount:{}:{}",
                config.namespace, config.service_account
            ),
            audience: config.audience.clone(),
            cache: Mutex::new(HashMap::new()),
            limiter: TokenBucket::new(config.qps, config.burst),
            relimiter: TokenBucket::new(config.qps / 2.0, (config.burst / 2).max(1)),
            counter,
        })
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, ReviewCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks the `authorization` metadata value of an agent stream; answers what the
    /// token is bound to.
    pub async fn authenticate(&self, authorization: Option<&str>) -> Result<Bound, AuthError> {
        let token = bearer_token(authorization)?;
        let key = hash(token);
        if let Some(bound) = self.cached(&key) {
            return Ok(bound);
        }
        self.limiter.acquire().await;
        self.review_and_remember(token, key).await
    }

    async fn review_and_remember(&self, token: &str, key: [u8; 32]) -> Result<Bound, AuthError> {
        let extra = self.review(token).await?;
        self.counter.with_label_values(&["authenticated"]).inc();
        let bound = self.bound(&extra).await?;
        self.remember(key, bound.clone());
        Ok(bound)
    }

    /// Does the token of a live stream, admitted as `bound`, still pass? Reviewed again
    /// (at the re-review rate) unless a review of it is cached. A token that only
    /// expired (the kubelet gave its Pod a new one, which the agent sends on its next
    /// connection) still passes while the Pod it is bound to runs, with the same UID, on
    /// the same node. When the apiserver cannot answer, the stream is kept (`Ok`): an
    /// outage of the apiserver must not cut every tunnel.
    pub async fn still_valid(&self, token: &str, bound: &Bound) -> Result<(), AuthError> {
        let key = hash(token);
        if self.cached(&key).is_some() {
            return Ok(());
        }
        self.relimiter.acquire().await;
        if self.cached(&key).is_some() {
            return Ok(());
        }
        match self.review_and_remember(token, key).await {
            Ok(now) if now.node == bound.node => Ok(()),
            Ok(now) => Err(AuthError::Rejected(format!(
                "the token now names node {:?}, not {:?}",
                now.node, bound.node
            ))),
            Err(AuthError::Api(e)) => {
                tracing::warn!(error = %chain(&e), "cannot review a live agent stream's token again; the stream is kept");
                Ok(())
            }
            Err(AuthError::Rejected(why)) if expired(token) => {
                match self.binding_holds(token, bound).await {
                    Ok(true) => Ok(()),
                    Ok(false) => Err(AuthError::Rejected(why)),
                    Err(e) => {
                        tracing::warn!(error = %chain(&e), "cannot check an expired agent token's binding; the stream is kept");
                        Ok(())
                    }
                }
            }
            Err(e) => Err(e),
        }
    }

    /// An expired token's binding, which the kubelet's newer token for the same Pod
    /// carries too: the Pod it is bound to still runs, with the same UID, on the same
    /// node, as the expected service account, and that account is the one that signed
    /// (same UID). `Err` when the apiserver cannot say.
    async fn binding_holds(&self, token: &str, bound: &Bound) -> Result<bool, AuthError> {
        let Some((name, uid)) = bound.pod.as_ref() else {
            return Ok(false);
        };
        let pod = match self.pods.get_opt(name).await.map_err(AuthError::Api)? {
            Some(p) => p,
            None => return Ok(false),
        };
        let sa_name = self.service_account.as_str();
        let spec = pod.spec.unwrap_or_default();
        if pod.metadata.uid.as_deref() != Some(uid.as_str())
            || pod.metadata.deletion_timestamp.is_some()
            || spec.node_name != bound.node
            || spec.service_account_name.as_deref() != Some(sa_name)
        {
            return Ok(false);
        }
        let Some(sa_uid) = claim(token, &["kubernetes.io", "serviceaccount", "uid"]) else {
            return Ok(false);
        };
        let account = self
            .accounts
            .get_opt(sa_name)
            .await
            .map_err(AuthError::Api)?;
        Ok(account.is_some_and(|a| a.metadata.uid.as_deref() == Some(sa_uid.as_str())))
    }

    /// A positive review of the token hashed to `key` still trusted: what it is bound
    /// to (counted as `cached`).
    fn cached(&self, key: &[u8; 32]) -> Option<Bound> {
        if let Some((until, bound)) = self.cache().get(key) {
            if *until > Instant::now() {
                self.counter.with_label_values(&["cached"]).inc();
                return Some(bound.clone());
            }
        }
        None
    }

    /// Asks kube-apiserver to review `token` and checks the answer (authenticated, for
    /// our audience, as the expected service account): the user's extra fields.
    async fn review(&self, token: &str) -> Result<BTreeMap<String, Vec<String>>, AuthError> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..Default::default()
        };
        let result = match self.reviews.create(&PostParams::default(), &review).await {
            Ok(r) => r,
            Err(e) => {
                self.counter.with_label_values(&["error"]).inc();
                return Err(AuthError::Api(e));
            }
        };
        let checked = self.check(result.status.unwrap_or_default());
        if checked.is_err() {
            self.counter.with_label_values(&["rejected"]).inc();
        }
        checked
    }

    /// Whether a review's `status` admits the agent: authenticated, for our audience
    /// (or an audience-unaware authenticator), as the expected service account.
    fn check(&self, status: TokenReviewStatus) -> Result<BTreeMap<String, Vec<String>>, AuthError> {
        if status.authenticated != Some(true) {
            let why = status
                .error
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "not authenticated".into());
            return Err(AuthError::Rejected(why));
        }
        let audiences = status.audiences.unwrap_or_default();
        if !audiences.is_empty() && !audiences.contains(&self.audience) {
            return Err(AuthError::Rejected(format!(
                "token audiences {audiences:?} do not include {:?}",
                self.audience
            )));
        }
        let user_info = status.user.unwrap_or_default();
        let extra = user_info.extra.clone().unwrap_or_default();
        let user = user_info.username.unwrap_or_default();
        if user != self.expected_user {
            return Err(AuthError::WrongIdentity {
                got: user,
                expected: self.expected_user.clone(),
            });
        }
        Ok(extra)
    }

    /// Trusts the token hashed to `key`, bound to `bound`, for [`POSITIVE_CACHE_TTL`];
    /// a full cache loses its expired entries first, then everything.
    fn remember(&self, key: [u8; 32], bound: Bound) {
        let now = Instant::now();
        let mut cache = self.cache();
        if cache.len() >= CACHE_CAP {
            cache.retain(|_, (until, _)| *until > now);
            if cache.len() >= CACHE_CAP {
                cache.clear();
            }
        }
        cache.insert(key, (now + POSITIVE_CACHE_TTL, bound));
    }

    /// What a pod-bound token's review names: the Pod (`authentication.kubernetes.io/
    /// pod-name` and `pod-uid`) and its node (`node-name`, Kubernetes 1.30+, else the
    /// bound Pod's `spec.nodeName` when its UID matches). No node when the token is not
    /// pod-bound or the Pod cannot be read (the agent is still admitted; its
    /// identifiers just count as unverified).
    async fn bound(&self, extra: &BTreeMap<String, Vec<String>>) -> Result<Bound, AuthError> {
        let one = |k: &str| extra.get(k).and_then(|v| v.first()).cloned();
        let pod = one("authentication.kubernetes.io/pod-name")
            .zip(one("authentication.kubernetes.io/pod-uid"));
        if let Some(node) = one("authentication.kubernetes.io/node-name") {
            return Ok(Bound {
                node: Some(node),
                pod,
            });
        }
        let Some((name, uid)) = pod.clone() else {
            return Ok(Bound::default());
        };
        // A failed read is the apiserver's, not the token's: the agent retries, rather
        // than being admitted (or kept) as no node.
        let node = match self.pods.get_opt(&name).await {
            Ok(Some(p)) if p.metadata.uid.as_deref() == Some(uid.as_str()) => {
                p.spec.and_then(|s| s.node_name).filter(|n| !n.is_empty())
            }
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(pod = %name, error = %chain(&e), "cannot read the agent's Pod to learn its node (the server needs get on pods in the agent namespace)");
                return Err(AuthError::Api(e));
            }
        };
        Ok(Bound { node, pod })
    }
}

/// SHA-256 of a token: what the cache is keyed by (no token is kept).
fn hash(token: &str) -> [u8; 32] {
    ring::digest::digest(&ring::digest::SHA256, token.as_bytes())
        .as_ref()
        .try_into()
        .expect("sha256 is 32 bytes")
}

/// The JWT `token`'s claims, read without checking the signature: they only choose how
/// a token that already failed a review is judged, and every fact they lead to is read
/// from the apiserver.
fn claims(token: &str) -> Option<serde_json::Value> {
    use base64::Engine;
    let payload = token.split('.').nth(1)?;
    let json = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload)
        .ok()?;
    serde_json::from_slice(&json).ok()
}

/// The string claim at `path` of `token`.
fn claim(token: &str, path: &[&str]) -> Option<String> {
    let claims = claims(token)?;
    let v = path.iter().try_fold(&claims, |v, p| v.get(p))?;
    v.as_str().map(str::to_string)
}

/// Has the JWT `token` expired, by its own `exp` claim?
fn expired(token: &str) -> bool {
    let exp = claims(token).and_then(|v| v["exp"].as_u64());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    exp.is_some_and(|exp| exp <= now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jwt_is_expired_by_its_exp_claim() {
        use base64::Engine;
        let jwt = |claims: &str| {
            let b = base64::engine::general_purpose::URL_SAFE_NO_PAD;
            format!("{}.{}.sig", b.encode("{}"), b.encode(claims))
        };
        assert!(expired(&jwt(r#"{"exp": 1000}"#)));
        let bound = jwt(r#"{"kubernetes.io": {"serviceaccount": {"name": "a", "uid": "u-1"}}}"#);
        assert_eq!(
            claim(&bound, &["kubernetes.io", "serviceaccount", "uid"]).as_deref(),
            Some("u-1")
        );
        assert!(!expired(&jwt(r#"{"exp": 99999999999}"#)));
        assert!(!expired(&jwt("{}")));
        assert!(!expired("not a jwt"));
    }

    #[test]
    fn refusals_carry_none_of_the_apiservers_words() {
        let e = AuthError::Rejected(
            "[invalid bearer token, service account token has been invalidated]".into(),
        );
        assert_eq!(e.public_message(), "token not accepted");
    }
}

//! Agent authentication without client certificates: the agent sends a bound
//! service-account token (`authorization: Bearer ...`); the server checks it with a
//! TokenReview against kube-apiserver (audience and `system:serviceaccount:<ns>:<sa>`).
//! Positive reviews are cached briefly and reviews are rate limited, so a thousand
//! agents reconnecting at once cannot flood the apiserver. A token bound to a Pod also
//! says which node the agent runs on (the review's `node-name`, or the bound Pod's
//! `spec.nodeName`): the identifiers naming that node count as verified.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tether_core::error::chain;

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec, TokenReviewStatus};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use prometheus::IntCounterVec;
use tether_ops::ratelimit::TokenBucket;

/// How long a positive review is trusted without asking again.
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

/// Positive reviews by token hash: until when, and the node the token is bound to.
type ReviewCache = HashMap<[u8; 32], (Instant, Option<String>)>;

/// Checks agent tokens by TokenReview.
pub struct TokenAuthenticator {
    reviews: Api<TokenReview>,
    pods: Api<Pod>,
    expected_user: String,
    audience: String,
    cache: Mutex<ReviewCache>,
    limiter: TokenBucket,
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
            pods: Api::namespaced(client, &config.namespace),
            expected_user: format!(
                "system:serviceaccount:{}:{}",
                config.namespace, config.service_account
            ),
            audience: config.audience.clone(),
            cache: Mutex::new(HashMap::new()),
            limiter: TokenBucket::new(config.qps, config.burst),
            counter,
        })
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, ReviewCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Checks the `authorization` metadata value of an agent stream; answers the node
    /// the token is bound to, if it is.
    pub async fn authenticate(
        &self,
        authorization: Option<&str>,
    ) -> Result<Option<String>, AuthError> {
        let token = bearer_token(authorization)?;
        let key: [u8; 32] = ring::digest::digest(&ring::digest::SHA256, token.as_bytes())
            .as_ref()
            .try_into()
            .expect("sha256 is 32 bytes");
        if let Some(node) = self.cached(&key) {
            return Ok(node);
        }
        self.limiter.acquire().await;
        let extra = self.review(token).await?;
        self.counter.with_label_values(&["authenticated"]).inc();
        let node = self.bound_node(&extra).await;
        self.remember(key, node.clone());
        Ok(node)
    }

    /// A positive review of the token hashed to `key` still trusted: the node it names
    /// (counted as `cached`).
    fn cached(&self, key: &[u8; 32]) -> Option<Option<String>> {
        if let Some((until, node)) = self.cache().get(key) {
            if *until > Instant::now() {
                self.counter.with_label_values(&["cached"]).inc();
                return Some(node.clone());
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

    /// Trusts the token hashed to `key`, bound to `node`, for [`POSITIVE_CACHE_TTL`];
    /// a full cache loses its expired entries first, then everything.
    fn remember(&self, key: [u8; 32], node: Option<String>) {
        let now = Instant::now();
        let mut cache = self.cache();
        if cache.len() >= CACHE_CAP {
            cache.retain(|_, (until, _)| *until > now);
            if cache.len() >= CACHE_CAP {
                cache.clear();
            }
        }
        cache.insert(key, (now + POSITIVE_CACHE_TTL, node));
    }

    /// The node a pod-bound token's review names: `authentication.kubernetes.io/
    /// node-name` (Kubernetes 1.30+), else the bound Pod's `spec.nodeName` when its UID
    /// matches. `None` when the token is not pod-bound or the Pod cannot be read (the
    /// agent is still admitted; its identifiers just count as unverified).
    async fn bound_node(&self, extra: &BTreeMap<String, Vec<String>>) -> Option<String> {
        let one = |k: &str| extra.get(k).and_then(|v| v.first()).cloned();
        if let Some(node) = one("authentication.kubernetes.io/node-name") {
            return Some(node);
        }
        let (name, uid) = (
            one("authentication.kubernetes.io/pod-name")?,
            one("authentication.kubernetes.io/pod-uid")?,
        );
        match self.pods.get_opt(&name).await {
            Ok(Some(pod)) if pod.metadata.uid.as_deref() == Some(uid.as_str()) => {
                pod.spec.and_then(|s| s.node_name).filter(|n| !n.is_empty())
            }
            Ok(_) => None,
            Err(e) => {
                tracing::warn!(pod = %name, error = %chain(&e), "cannot read the agent's Pod; its identifiers stay unverified (the server needs get on pods in the agent namespace)");
                None
            }
        }
    }
}

//! Building a Kubernetes client from `--kubeconfig` (or the in-cluster configuration),
//! with errors that say which file and what to do.

use std::path::Path;

/// Why no Kubernetes client could be built.
#[derive(Debug, thiserror::Error)]
pub enum KubeSetupError {
    /// The kubeconfig could not be read or used.
    #[error("--kubeconfig {path}: {source} (check the file is a valid kubeconfig)")]
    Kubeconfig {
        /// The file.
        path: String,
        /// What kube said.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// No kubeconfig and not running in a cluster.
    #[error("no --kubeconfig given and no in-cluster configuration: {0}")]
    InCluster(#[source] kube::config::InClusterError),
    /// The client could not be built.
    #[error("cannot build a Kubernetes client: {0}")]
    Client(#[source] kube::Error),
}

/// A client for the cluster in `kubeconfig`, or in-cluster when `None`.
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, KubeSetupError> {
    kube::Client::try_from(config(kubeconfig).await?).map_err(KubeSetupError::Client)
}

/// Like [`client`], with every request first taking a token from `limit` (client-go's
/// `--kube-api-qps`/`--kube-api-burst`) and counted in `calls`.
pub async fn limited_client(
    kubeconfig: Option<&Path>,
    limit: std::sync::Arc<crate::ratelimit::TokenBucket>,
    calls: prometheus::IntCounter,
) -> Result<kube::Client, KubeSetupError> {
    let builder = kube::client::ClientBuilder::try_from(config(kubeconfig).await?)
        .map_err(KubeSetupError::Client)?;
    Ok(builder.with_layer(&RateLimitLayer { limit, calls }).build())
}

/// Rate limit and count requests (see [`limited_client`]).
#[derive(Clone)]
struct RateLimitLayer {
    limit: std::sync::Arc<crate::ratelimit::TokenBucket>,
    calls: prometheus::IntCounter,
}

impl<S> tower::Layer<S> for RateLimitLayer {
    type Service = RateLimited<S>;
    fn layer(&self, inner: S) -> RateLimited<S> {
        RateLimited {
            inner,
            layer: self.clone(),
            permit: None,
            ready: false,
        }
    }
}

type Permit = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// The service: `poll_ready` waits for a token (kube drives it behind a buffer, so
/// requests queue there, in order).
struct RateLimited<S> {
    inner: S,
    layer: RateLimitLayer,
    permit: Option<Permit>,
    ready: bool,
}

impl<S, R> tower::Service<R> for RateLimited<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        if !self.ready {
            let limit = self.layer.limit.clone();
            let permit = self
                .permit
                .get_or_insert_with(|| Box::pin(async move { limit.acquire().await }));
            std::task::ready!(permit.as_mut().poll(cx));
            self.permit = None;
            self.ready = true;
        }
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> Self::Future {
        self.ready = false;
        self.layer.calls.inc();
        self.inner.call(req)
    }
}

async fn config(kubeconfig: Option<&Path>) -> Result<kube::Config, KubeSetupError> {
    Ok(match kubeconfig {
        Some(path) => {
            let err = |source| KubeSetupError::Kubeconfig {
                path: path.display().to_string(),
                source,
            };
            let kc = kube::config::Kubeconfig::read_from(path).map_err(err)?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(err)?
        }
        None => kube::Config::incluster().map_err(KubeSetupError::InCluster)?,
    })
}

/// Is `lease` still held at `now` (renewTime + leaseDurationSeconds in the future)?
pub fn lease_is_live(
    lease: &k8s_openapi::api::coordination::v1::Lease,
    now: k8s_openapi::jiff::Timestamp,
) -> bool {
    let Some(spec) = &lease.spec else {
        return false;
    };
    match (&spec.renew_time, spec.lease_duration_seconds) {
        (Some(renew), Some(secs)) => renew
            .0
            .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(i64::from(
                secs,
            )))
            .is_ok_and(|until| until > now),
        _ => false,
    }
}

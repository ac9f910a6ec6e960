//! Building a Kubernetes client from `--kubeconfig` (or the in-cluster configuration),
//! with errors that say which file and what to do.

use std::path::Path;

/// Why no Kubernetes client could be built.
#[derive(Debug, thiserror::Error)]
pub enum KubeSetupError {
    /// The kubeconfig could not be read or used.
    #[error("--kubeconfig {path} is not a usable kubeconfig")]
    Kubeconfig {
        /// The file.
        path: String,
        /// What kube said.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// No kubeconfig and not running in a cluster.
    #[error("no --kubeconfig given and no in-cluster configuration")]
    InCluster(#[source] kube::config::InClusterError),
    /// The client could not be built.
    #[error("cannot build a Kubernetes client")]
    Client(#[source] kube::Error),
}

/// A client for the cluster in `kubeconfig`, or in-cluster when `None`.
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, KubeSetupError> {
    kube::Client::try_from(config(kubeconfig).await?).map_err(KubeSetupError::Client)
}

/// client-go's REST client metrics: `rest_client_requests_total{code,method,host}` and
/// `rest_client_request_duration_seconds{verb,host}`. Clones share the series.
#[derive(Clone)]
pub struct RestMetrics {
    requests: prometheus::IntCounterVec,
    duration: prometheus::HistogramVec,
}

impl RestMetrics {
    /// Both families, registered in `catalog`.
    pub fn new(catalog: &crate::metrics::Catalog) -> Self {
        RestMetrics {
            requests: catalog.made(prometheus::IntCounterVec::new(
                prometheus::Opts::new(
                    "rest_client_requests_total",
                    "Number of HTTP requests, partitioned by status code, method, and host.",
                ),
                &["code", "method", "host"],
            )),
            duration: catalog.made(prometheus::HistogramVec::new(
                prometheus::HistogramOpts::new(
                    "rest_client_request_duration_seconds",
                    "Request latency in seconds. Broken down by verb, and host.",
                )
                .buckets(vec![
                    0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0,
                ]),
                &["verb", "host"],
            )),
        }
    }

    /// Requests sent so far, every code and method.
    pub fn total(&self) -> u64 {
        use prometheus::core::Collector;
        self.requests
            .collect()
            .iter()
            .flat_map(|f| f.get_metric())
            .map(|m| m.get_counter().get_value() as u64)
            .sum()
    }
}

/// A client for `config` with every request first taking a token from `limit`
/// (client-go's `--kube-api-qps`/`--kube-api-burst`) and counted in `metrics`.
pub fn limited_client_from(
    config: kube::Config,
    limit: std::sync::Arc<crate::ratelimit::TokenBucket>,
    metrics: RestMetrics,
) -> Result<kube::Client, KubeSetupError> {
    let host = config
        .cluster_url
        .authority()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let builder = kube::client::ClientBuilder::try_from(config).map_err(KubeSetupError::Client)?;
    Ok(builder
        .with_layer(&RateLimitLayer {
            limit,
            metrics,
            host,
        })
        .build())
}

/// Rate limit and count requests (see [`limited_client_from`]).
#[derive(Clone)]
struct RateLimitLayer {
    limit: std::sync::Arc<crate::ratelimit::TokenBucket>,
    metrics: RestMetrics,
    host: String,
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

impl<S, B, RB> tower::Service<http::Request<B>> for RateLimited<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

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

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        self.ready = false;
        let method = req.method().as_str().to_string();
        let (metrics, host) = (self.layer.metrics.clone(), self.layer.host.clone());
        let started = std::time::Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let result = fut.await;
            let code = match &result {
                Ok(resp) => resp.status().as_u16().to_string(),
                Err(_) => "<error>".to_string(),
            };
            metrics
                .requests
                .with_label_values(&[code.as_str(), method.as_str(), host.as_str()])
                .inc();
            metrics
                .duration
                .with_label_values(&[method.as_str(), host.as_str()])
                .observe(started.elapsed().as_secs_f64());
            result
        })
    }
}

/// The configuration `kubeconfig` (or the in-cluster one) gives.
pub async fn config(kubeconfig: Option<&Path>) -> Result<kube::Config, KubeSetupError> {
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

/// The HTTP status code and reason of an apiserver call's outcome, as upstream's lease
/// metrics label it: `("200", "")` for success, the API status's code and reason for
/// an API error, `None` when no status came back (connection refused, timeout):
/// upstream does not record those either.
pub fn call_status<T>(result: &Result<T, kube::Error>) -> Option<(String, String)> {
    match result {
        Ok(_) => Some(("200".into(), String::new())),
        Err(kube::Error::Api(status)) => Some((status.code.to_string(), status.reason.clone())),
        Err(_) => None,
    }
}

/// Counts (`<name>_total{code,reason}`) and times (`<name>_latency_seconds{code}`) one
/// kind of apiserver call, the shape of upstream's lease list/delete/watch metrics.
#[derive(Clone)]
pub struct CallMetrics {
    total: prometheus::IntCounterVec,
    latency: Option<prometheus::HistogramVec>,
}

impl CallMetrics {
    /// Wraps a counter labelled (code, reason) and an optional histogram labelled (code).
    pub fn new(
        total: prometheus::IntCounterVec,
        latency: Option<prometheus::HistogramVec>,
    ) -> Self {
        CallMetrics { total, latency }
    }

    /// Records one call that started at `started`.
    pub fn observe<T>(&self, started: std::time::Instant, result: &Result<T, kube::Error>) {
        let Some((code, reason)) = call_status(result) else {
            return;
        };
        self.total.with_label_values(&[&code, &reason]).inc();
        if let Some(h) = &self.latency {
            h.with_label_values(&[&code])
                .observe(started.elapsed().as_secs_f64());
        }
    }
}

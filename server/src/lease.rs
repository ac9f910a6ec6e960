//! The lease controller (`--enable-lease-controller`): every server publishes a
//! coordination.k8s.io Lease `konnectivity-proxy-server-<id>` (30 s, renewed every
//! 15 s), counts the live ones so the `servercount` it tells agents follows reality,
//! garbage-collects expired leases, and deletes its own at the drain.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};

use crate::metrics::Metrics;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Lease validity.
pub const LEASE_DURATION: Duration = Duration::from_secs(30);
/// Renewal period.
pub const RENEW_INTERVAL: Duration = Duration::from_secs(15);

/// Where leases live.
#[derive(Debug, Clone)]
pub struct LeaseConfig {
    /// `--lease-namespace`.
    pub namespace: String,
    /// `--lease-label` as key=value pairs.
    pub labels: BTreeMap<String, String>,
    /// `--kubeconfig`; `None` = in-cluster.
    pub kubeconfig: Option<std::path::PathBuf>,
    /// Renewal period (15 s; shorter in tests).
    pub renew_interval: Duration,
    /// Lease duration (30 s; shorter in tests).
    pub duration: Duration,
}

/// Parses `k=v,k2=v2`.
pub fn parse_labels(s: &str) -> Result<BTreeMap<String, String>, String> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (k, v) = p
                .split_once('=')
                .ok_or_else(|| format!("label {p:?} is not key=value"))?;
            Ok((k.trim().to_string(), v.trim().to_string()))
        })
        .collect()
}

/// The label selector string for `labels`.
pub fn selector(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

pub use tether_ops::kubeclient::lease_is_live as is_live;

/// The last count of live leases and when it was made (`None` until the first list
/// succeeds), for `/status`: beside the server count in use, it shows a lease list
/// that keeps failing or a count that never took.
#[derive(Debug, Default)]
pub struct LastCount(std::sync::Mutex<Option<(u32, std::time::SystemTime)>>);

impl LastCount {
    /// Records a count made now.
    pub fn record(&self, live: u32) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((live, std::time::SystemTime::now()));
    }

    /// The last count and when it was made.
    pub fn get(&self) -> Option<(u32, std::time::SystemTime)> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs until `drain`, then deletes this server's lease. `live` receives the number
/// of live leases (at least 1) after every renewal, `counted` the count as listed.
pub async fn run(
    client: kube::Client,
    cfg: LeaseConfig,
    server_id: String,
    live: Arc<AtomicU32>,
    counted: Arc<LastCount>,
    metrics: Metrics,
    drain: CancellationToken,
) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let name = format!("konnectivity-proxy-server-{server_id}");
    let span = tracing::info_span!("lease", %name, namespace = %cfg.namespace);
    async {
        loop {
            if let Err(e) = renew(&api, &cfg, &name, &server_id).await {
                tracing::warn!(error = %chain(&e), "cannot renew lease; retrying");
            }
            match count_and_collect(&api, &cfg, &name, &metrics).await {
                Ok(n) => {
                    live.store(n.max(1), Ordering::Relaxed);
                    counted.record(n);
                }
                Err(e) => tracing::warn!(error = %chain(&e), "cannot list leases"),
            }
            tokio::select! {
                _ = tokio::time::sleep(cfg.renew_interval) => {}
                _ = drain.cancelled() => break,
            }
        }
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => tracing::info!("lease deleted"),
            Err(e) => {
                tracing::warn!(error = %chain(&e), "cannot delete lease at the drain; it expires on its own")
            }
        }
    }
    .instrument(span)
    .await
}

async fn renew(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    name: &str,
    server_id: &str,
) -> Result<(), kube::Error> {
    let now = MicroTime(Timestamp::now());
    let spec = LeaseSpec {
        holder_identity: Some(server_id.to_string()),
        lease_duration_seconds: Some(cfg.duration.as_secs().max(1) as i32),
        renew_time: Some(now.clone()),
        ..Default::default()
    };
    match api.get_opt(name).await? {
        Some(mut lease) => {
            let mut s = lease.spec.take().unwrap_or_default();
            s.holder_identity = spec.holder_identity;
            s.lease_duration_seconds = spec.lease_duration_seconds;
            s.renew_time = spec.renew_time;
            lease.spec = Some(s);
            api.replace(name, &PostParams::default(), &lease).await?;
        }
        None => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(name.to_string()),
                    namespace: Some(cfg.namespace.clone()),
                    labels: Some(cfg.labels.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    acquire_time: Some(now),
                    ..spec
                }),
            };
            api.create(&PostParams::default(), &lease).await?;
            tracing::info!("lease created");
        }
    }
    Ok(())
}

/// Counts the live leases and deletes expired ones (only if unchanged since the list:
/// a lease renewed in between is kept), recording upstream's lease metrics.
async fn count_and_collect(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    own: &str,
    metrics: &Metrics,
) -> Result<u32, kube::Error> {
    let started = std::time::Instant::now();
    let listed = api
        .list(&ListParams::default().labels(&selector(&cfg.labels)))
        .await;
    metrics.lease_lists.observe(started, &listed);
    let now = Timestamp::now();
    let mut live = 0;
    for lease in listed? {
        let name = lease.metadata.name.clone().unwrap_or_default();
        if is_live(&lease, now) || name == own {
            live += 1;
            continue;
        }
        tracing::info!(lease = %name, "garbage-collecting expired lease");
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: lease.metadata.resource_version.clone(),
                uid: None,
            }),
            ..Default::default()
        };
        let started = std::time::Instant::now();
        let deleted = api.delete(&name, &params).await;
        metrics.lease_deletes.observe(started, &deleted);
        match deleted {
            Ok(_) => metrics.culled_leases.inc(),
            Err(e) => {
                tracing::debug!(lease = %name, error = %chain(&e), "expired lease not deleted (gone or renewed meanwhile)")
            }
        }
    }
    Ok(live)
}

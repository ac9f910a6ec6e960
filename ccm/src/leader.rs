//! Leader election on a coordination.k8s.io Lease, as upstream's client-go does it:
//! the holder renews every retry period; another replica takes over once it has seen the
//! same record unchanged for a whole lease duration (measured on its own clock, so
//! clock skew between replicas does not matter); a leader that cannot renew within the
//! renew deadline steps down. On graceful shutdown the lease is released so that a
//! standby takes over at once.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Where and how to elect.
#[derive(Debug, Clone)]
pub struct LeaderElection {
    /// Lease namespace (`--leader-elect-resource-namespace`, kube-system).
    pub namespace: String,
    /// Lease name (`--leader-elect-resource-name`, cloud-controller-manager).
    pub name: String,
    /// This replica's identity (hostname plus a random suffix).
    pub identity: String,
    /// `--leader-elect-lease-duration` (15 s).
    pub lease_duration: Duration,
    /// `--leader-elect-renew-deadline` (10 s).
    pub renew_deadline: Duration,
    /// `--leader-elect-retry-period` (2 s).
    pub retry_period: Duration,
    /// After a release, wait up to this long for another replica to hold the lease
    /// (a rolling update then never ends with nobody holding it). `None`: do not wait.
    pub await_successor: Option<Duration>,
}

/// What went wrong talking to the API server.
#[derive(Debug, thiserror::Error)]
#[error("leader election lease {namespace}/{name}: {source}")]
pub struct LeaseError {
    namespace: String,
    name: String,
    #[source]
    source: kube::Error,
}

struct Elector {
    api: Api<Lease>,
    cfg: LeaderElection,
    /// The last record seen and when we first saw it.
    observed: Option<(String, Instant)>,
    /// When the lease another replica holds runs out, as last observed.
    expires: Option<Instant>,
}

impl Elector {
    fn err(&self, source: kube::Error) -> LeaseError {
        LeaseError {
            namespace: self.cfg.namespace.clone(),
            name: self.cfg.name.clone(),
            source,
        }
    }

    /// Acquires or renews; true when we hold the lease afterwards.
    async fn try_acquire_or_renew(&mut self) -> Result<bool, LeaseError> {
        let now = MicroTime(Timestamp::now());
        let secs = self.cfg.lease_duration.as_secs().max(1) as i32;
        let existing = match self.api.get_opt(&self.cfg.name).await {
            Ok(l) => l,
            Err(e) => return Err(self.err(e)),
        };
        let Some(mut lease) = existing else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.cfg.name.clone()),
                    namespace: Some(self.cfg.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.cfg.identity.clone()),
                    lease_duration_seconds: Some(secs),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(true),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(self.err(e)),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let record = format!(
            "{holder}|{:?}|{:?}",
            spec.renew_time.as_ref().map(|t| t.0),
            spec.lease_transitions
        );
        let first_seen = match &self.observed {
            Some((r, at)) if *r == record => *at,
            _ => {
                let at = Instant::now();
                self.observed = Some((record, at));
                at
            }
        };
        let duration = spec
            .lease_duration_seconds
            .map(|s| Duration::from_secs(s.max(0) as u64))
            .unwrap_or(self.cfg.lease_duration);
        let ours = holder == self.cfg.identity;
        if !ours && !holder.is_empty() && first_seen.elapsed() < duration {
            self.expires = Some(first_seen + duration);
            return Ok(false);
        }
        self.expires = None;
        let mut new = spec;
        if !ours {
            new.acquire_time = Some(now.clone());
            new.lease_transitions = Some(new.lease_transitions.unwrap_or(0) + 1);
            new.holder_identity = Some(self.cfg.identity.clone());
        }
        new.renew_time = Some(now);
        new.lease_duration_seconds = Some(secs);
        lease.spec = Some(new);
        // Replace carries the resourceVersion we read: a concurrent writer wins, we
        // lose with a conflict.
        match self
            .api
            .replace(&self.cfg.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(self.err(e)),
        }
    }

    /// Gives the lease up (only if we still hold it).
    /// Polls the lease until another replica holds it, for at most `within`.
    async fn await_successor(&self, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(lease)) = self.api.get_opt(&self.cfg.name).await {
                let holder = lease
                    .spec
                    .and_then(|s| s.holder_identity)
                    .unwrap_or_default();
                if !holder.is_empty() && holder != self.cfg.identity {
                    tracing::info!(%holder, "lease handed over");
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tracing::info!(waited = ?within, "no other replica took the lease");
    }

    async fn release(&self) {
        let Ok(Some(mut lease)) = self.api.get_opt(&self.cfg.name).await else {
            return;
        };
        let Some(spec) = lease.spec.as_mut() else {
            return;
        };
        if spec.holder_identity.as_deref() != Some(&self.cfg.identity) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        match self
            .api
            .replace(&self.cfg.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => tracing::info!("leader lease released"),
            Err(e) => tracing::warn!(error = %e, "cannot release the leader lease"),
        }
    }
}

/// Leadership held: `lost` is cancelled when it is lost; [`Leadership::release`] gives
/// it up.
pub struct Leadership {
    /// Cancelled when the lease is lost (taken, or not renewed in time).
    pub lost: CancellationToken,
    release: CancellationToken,
    released: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Drop for Leadership {
    /// Leadership dropped without [`Leadership::release`] (an early return) is given
    /// up in the background rather than renewed on.
    fn drop(&mut self) {
        self.release.cancel();
    }
}

/// How long a release (and the wait for a successor) may take before the process goes
/// anyway (10 s).
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

impl Leadership {
    /// Gives the lease up and waits (at most 5 s) until kube-apiserver has the
    /// release: called once what only the leader holds (addresses, routes) is gone, so
    /// a standby takes over at its next retry instead of after the lease duration, and
    /// never while this process still holds them.
    pub async fn release(mut self) {
        self.release.cancel();
        let Some(released) = self.released.take() else {
            return;
        };
        if tokio::time::timeout(RELEASE_TIMEOUT, released)
            .await
            .is_err()
        {
            tracing::warn!(timeout = ?RELEASE_TIMEOUT, "leader lease release not confirmed in time");
        }
    }
}

/// Waits until this replica leads (`None` if `shutdown` comes first). The lease is then
/// renewed in the background until it is lost or [`Leadership::release`]d.
pub async fn lead(
    client: kube::Client,
    cfg: LeaderElection,
    shutdown: CancellationToken,
) -> Option<Leadership> {
    let span = tracing::info_span!("leader_election", lease = %format!("{}/{}", cfg.namespace, cfg.name), identity = %cfg.identity);
    let mut elector = Elector {
        api: Api::namespaced(client, &cfg.namespace),
        cfg,
        observed: None,
        expires: None,
    };
    async {
        tracing::info!("waiting to become leader");
        let mut acquired_at;
        loop {
            acquired_at = Instant::now();
            match elector.try_acquire_or_renew().await {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election attempt failed"),
            }
            let jitter = elector.cfg.retry_period.mul_f64(rand::random::<f64>() * 0.2);
            // The next try at the next retry, or just after the holder's lease runs
            // out if that is sooner: a crashed holder is replaced without waiting up
            // to a retry period more.
            let mut wait = elector.cfg.retry_period + jitter;
            if let Some(at) = elector.expires.take() {
                let margin = Duration::from_millis(10);
                wait = wait.min(at.saturating_duration_since(Instant::now()) + margin);
            }
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.cancelled() => return None,
            }
        }
        tracing::info!("became leader");
        let lost = CancellationToken::new();
        let release = CancellationToken::new();
        let (released_tx, released) = tokio::sync::oneshot::channel();
        let leadership = Leadership {
            lost: lost.clone(),
            release: release.clone(),
            released: Some(released),
        };
        tokio::spawn(
            async move {
                let mut last_renewed = acquired_at;
                loop {
                    tokio::select! {
                        _ = tokio::time::sleep(elector.cfg.retry_period) => {}
                        _ = release.cancelled() => {
                            elector.release().await;
                            if let Some(within) = elector.cfg.await_successor {
                                elector.await_successor(within).await;
                            }
                            let _ = released_tx.send(());
                            return;
                        }
                    }
                    // An attempt may not outlast the deadline: a leader cut off from the
                    // apiserver steps down by then, well before the lease can expire
                    // for anyone else.
                    // A renewal counts from when its attempt started: the write may have
                    // been seen by a standby (whose clock starts then) before we had
                    // the answer.
                    let left = elector
                        .cfg
                        .renew_deadline
                        .saturating_sub(last_renewed.elapsed());
                    if left.is_zero() {
                        tracing::error!(deadline = ?elector.cfg.renew_deadline, "could not renew the leader lease in time; stepping down");
                        lost.cancel();
                        return;
                    }
                    let started = Instant::now();
                    let attempt =
                        tokio::time::timeout(left, elector.try_acquire_or_renew()).await;
                    match attempt {
                        Ok(Ok(true)) => last_renewed = started,
                        Ok(Ok(false)) => {
                            tracing::error!("leader lease taken by another replica; stepping down");
                            lost.cancel();
                            return;
                        }
                        Ok(Err(e)) => tracing::warn!(error = %e, "lease renewal failed"),
                        Err(_) => tracing::warn!("lease renewal timed out"),
                    }
                    if last_renewed.elapsed() >= elector.cfg.renew_deadline {
                        tracing::error!(deadline = ?elector.cfg.renew_deadline, "could not renew the leader lease in time; stepping down");
                        lost.cancel();
                        return;
                    }
                }
            }
            .in_current_span(),
        );
        Some(leadership)
    }
    .instrument(span)
    .await
}

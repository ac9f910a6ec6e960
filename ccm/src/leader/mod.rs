//! Leader election on a coordination.k8s.io Lease, as upstream's client-go does it:
//! the holder renews every retry period; another replica takes over once it has seen the
//! same record unchanged for a whole lease duration (measured on its own clock, so
//! clock skew between replicas does not matter); a leader that cannot renew within the
//! renew deadline steps down. At the drain the lease is released so that a standby
//! takes over at once.
//!
//! Leases of a kind a replica may hold several of (the load-balancer pools') can be
//! balanced ([`LeaderElection::balance`]): [`balance`] holds that part.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tether_core::error::chain;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

mod balance;
pub use balance::{Balance, HANDOVER_ANNOTATION, HELD_ANNOTATION, REQUEST_ANNOTATION};

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
    /// This replica's share of leases of this kind (see the module's doc): set, they
    /// are balanced over the replicas.
    pub balance: Option<Arc<Balance>>,
}

/// What went wrong talking to the API server.
#[derive(Debug, thiserror::Error)]
#[error("leader election lease {namespace}/{name}")]
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
    /// A handover was asked for (by us, of the holder) or granted to us: look again
    /// soon rather than at the next retry.
    eager: bool,
    /// Set when the holder granted a standby's request: the identity to release to.
    granted: Option<String>,
}

/// What one attempt found.
enum Attempt {
    /// We hold the lease.
    Held,
    /// Another replica does (or a write raced ours).
    NotHeld,
}

impl Elector {
    fn err(&self, source: kube::Error) -> LeaseError {
        LeaseError {
            namespace: self.cfg.namespace.clone(),
            name: self.cfg.name.clone(),
            source,
        }
    }

    /// Acquires or renews; true when we hold the lease afterwards. A write that loses
    /// to another (a standby's request on a balanced lease) is read again and retried.
    async fn try_acquire_or_renew(&mut self) -> Result<bool, LeaseError> {
        for _ in 0..3 {
            match self.attempt().await {
                Ok(Some(Attempt::Held)) => return Ok(true),
                Ok(Some(Attempt::NotHeld)) => return Ok(false),
                // Conflict: read again.
                Ok(None) => continue,
                Err(e) => return Err(e),
            }
        }
        // Not "taken": a holder decides by its renew deadline.
        Err(LeaseError {
            namespace: self.cfg.namespace.clone(),
            name: self.cfg.name.clone(),
            source: kube::Error::Service("three write conflicts in a row".into()),
        })
    }

    /// One read and write; `None` when the write lost to a concurrent one.
    async fn attempt(&mut self) -> Result<Option<Attempt>, LeaseError> {
        self.eager = false;
        // The times written are taken before the read, as client-go takes them.
        let now = MicroTime(Timestamp::now());
        let existing = match self.api.get_opt(&self.cfg.name).await {
            Ok(l) => l,
            Err(e) => return Err(self.err(e)),
        };
        let Some(lease) = existing else {
            return self.create(now).await.map(Some);
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let first_seen = self.first_seen(&spec);
        let duration = spec
            .lease_duration_seconds
            .map(|s| Duration::from_secs(s.max(0) as u64))
            .unwrap_or(self.cfg.lease_duration);
        let ours = holder == self.cfg.identity;
        let balanced = self.cfg.balance.is_some();
        if !ours && !holder.is_empty() && first_seen.elapsed() < duration {
            self.expires = Some(first_seen + duration);
            if balanced {
                return self.maybe_ask(lease).await;
            }
            return Ok(Some(Attempt::NotHeld));
        }
        if !ours && holder.is_empty() && self.left_to_another(&lease, first_seen) {
            return Ok(Some(Attempt::NotHeld));
        }
        self.expires = None;
        let new = self.renewal(spec, ours, now);
        if balanced {
            return self.write_balanced(lease, new, ours).await;
        }
        self.write(lease, new).await
    }

    /// Creates the lease, held by us since `now`; `NotHeld` when another replica
    /// created it first.
    async fn create(&self, now: MicroTime) -> Result<Attempt, LeaseError> {
        let mut annotations = BTreeMap::new();
        if self.cfg.balance.is_some() {
            annotations.insert(HELD_ANNOTATION.to_string(), (self.held() + 1).to_string());
        }
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.cfg.name.clone()),
                namespace: Some(self.cfg.namespace.clone()),
                annotations: (!annotations.is_empty()).then_some(annotations),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.cfg.identity.clone()),
                lease_duration_seconds: Some(self.lease_seconds()),
                acquire_time: Some(now.clone()),
                renew_time: Some(now),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        match self.api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(Attempt::Held),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(Attempt::NotHeld),
            Err(e) => Err(self.err(e)),
        }
    }

    /// `--leader-elect-lease-duration` in whole seconds, at least 1.
    fn lease_seconds(&self) -> i32 {
        self.cfg.lease_duration.as_secs().max(1) as i32
    }

    /// When we first saw the lease's current record (holder, renewal, transitions): a
    /// record unchanged for a lease duration on our own clock has expired.
    fn first_seen(&mut self, spec: &LeaseSpec) -> Instant {
        let record = format!(
            "{}|{:?}|{:?}",
            spec.holder_identity.as_deref().unwrap_or_default(),
            spec.renew_time.as_ref().map(|t| t.0),
            spec.lease_transitions
        );
        match &self.observed {
            Some((r, at)) if *r == record => *at,
            _ => {
                let at = Instant::now();
                self.observed = Some((record, at));
                at
            }
        }
    }

    /// The lease's spec as we write it: renewed at `now`, and ours if it was not.
    fn renewal(&self, spec: LeaseSpec, ours: bool, now: MicroTime) -> LeaseSpec {
        let mut new = spec;
        if !ours {
            new.acquire_time = Some(now.clone());
            new.lease_transitions = Some(new.lease_transitions.unwrap_or(0) + 1);
            new.holder_identity = Some(self.cfg.identity.clone());
        }
        new.renew_time = Some(now);
        new.lease_duration_seconds = Some(self.lease_seconds());
        new
    }

    /// Writes `lease` with `spec`. Replace carries the resourceVersion we read: a
    /// concurrent writer wins, we lose with a conflict (`None`).
    async fn write(
        &self,
        mut lease: Lease,
        spec: LeaseSpec,
    ) -> Result<Option<Attempt>, LeaseError> {
        lease.spec = Some(spec);
        match self
            .api
            .replace(&self.cfg.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(Some(Attempt::Held)),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
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
        // A standby's request written meanwhile is a conflict: read again.
        for _ in 0..3 {
            match self.release_once().await {
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                Err(e) => {
                    tracing::warn!(error = %chain(&e), "cannot release the leader lease");
                    return;
                }
                Ok(()) => return,
            }
        }
        tracing::warn!("cannot release the leader lease: three write conflicts in a row");
    }

    async fn release_once(&self) -> Result<(), kube::Error> {
        let Some(mut lease) = self.api.get_opt(&self.cfg.name).await? else {
            return Ok(());
        };
        if let Some(to) = &self.granted {
            let annotations = lease.metadata.annotations.get_or_insert_with(BTreeMap::new);
            annotations.insert(HANDOVER_ANNOTATION.to_string(), to.clone());
            annotations.remove(REQUEST_ANNOTATION);
            annotations.insert(HELD_ANNOTATION.to_string(), "0".into());
        }
        let Some(spec) = lease.spec.as_mut() else {
            return Ok(());
        };
        if spec.holder_identity.as_deref() != Some(&self.cfg.identity) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        self.api
            .replace(&self.cfg.name, &PostParams::default(), &lease)
            .await?;
        tracing::info!("leader lease released");
        Ok(())
    }
}

/// Leadership held: `lost` is cancelled when it is lost; [`Leadership::release`] gives
/// it up.
pub struct Leadership {
    /// Cancelled when the lease is lost (taken, or not renewed in time).
    pub lost: CancellationToken,
    /// Balanced leases: cancelled when the holder granted a standby's request; the
    /// term lets go, then [`Leadership::release`] hands the lease to the asker.
    pub handover: CancellationToken,
    /// When the last successful renewal started.
    renewed: Arc<std::sync::Mutex<Instant>>,
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
    /// How long ago the last successful renewal started (the acquisition, at first).
    pub fn since_renewal(&self) -> Duration {
        self.renewed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
    }

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

/// Waits until this replica leads (`None` if `drain` comes first). The lease is then
/// renewed in the background until it is lost or [`Leadership::release`]d.
pub async fn lead(
    client: kube::Client,
    cfg: LeaderElection,
    drain: CancellationToken,
) -> Option<Leadership> {
    let span = tracing::info_span!("leader_election", lease = %format!("{}/{}", cfg.namespace, cfg.name), identity = %cfg.identity);
    let mut elector = Elector {
        api: Api::namespaced(client, &cfg.namespace),
        cfg,
        observed: None,
        expires: None,
        eager: false,
        granted: None,
    };
    async {
        tracing::info!("waiting to become leader");
        let acquired_at = elector.acquire(&drain).await?;
        tracing::info!("became leader");
        let (leadership, term) = Term::start(acquired_at);
        tokio::spawn(elector.renew(term).in_current_span());
        Some(leadership)
    }
    .instrument(span)
    .await
}

/// The renewal task's side of a [`Leadership`].
struct Term {
    lost: CancellationToken,
    handover: CancellationToken,
    renewed: Arc<std::sync::Mutex<Instant>>,
    release: CancellationToken,
    released: tokio::sync::oneshot::Sender<()>,
    /// When the last successful renewal started.
    last_renewed: Instant,
}

impl Term {
    /// A term that began with the attempt at `acquired_at`: the caller's half and the
    /// renewal task's.
    fn start(acquired_at: Instant) -> (Leadership, Term) {
        let (lost, handover, release) = Default::default();
        let (released_tx, released) = tokio::sync::oneshot::channel();
        let renewed = Arc::new(std::sync::Mutex::new(acquired_at));
        let leadership = Leadership {
            lost: CancellationToken::clone(&lost),
            handover: CancellationToken::clone(&handover),
            renewed: renewed.clone(),
            release: CancellationToken::clone(&release),
            released: Some(released),
        };
        let term = Term {
            lost,
            handover,
            renewed,
            release,
            released: released_tx,
            last_renewed: acquired_at,
        };
        (leadership, term)
    }

    /// Steps down: the deadline passed without a renewal.
    fn missed_deadline(&self, deadline: Duration) {
        tracing::error!(
            ?deadline,
            "could not renew the leader lease in time; stepping down"
        );
        self.lost.cancel();
    }
}

impl Elector {
    /// Tries until the lease is ours; when the winning attempt started, or `None` if
    /// `drain` comes first.
    async fn acquire(&mut self, drain: &CancellationToken) -> Option<Instant> {
        loop {
            let started = Instant::now();
            match self.try_acquire_or_renew().await {
                Ok(true) => return Some(started),
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %chain(&e), "leader election attempt failed"),
            }
            tokio::select! {
                _ = tokio::time::sleep(self.next_try()) => {}
                _ = drain.cancelled() => return None,
            }
        }
    }

    /// How long until the next try: the next retry (with jitter), or just after the
    /// holder's lease runs out if that is sooner, so a crashed holder is replaced
    /// without waiting up to a retry period more.
    fn next_try(&mut self) -> Duration {
        let jitter = self.cfg.retry_period.mul_f64(rand::random::<f64>() * 0.2);
        let mut wait = self.cfg.retry_period + jitter;
        if let Some(at) = self.expires.take() {
            let margin = Duration::from_millis(10);
            wait = wait.min(at.saturating_duration_since(Instant::now()) + margin);
        }
        if self.eager {
            // A handover asked for: the holder answers within a retry period.
            wait = wait.min(Duration::from_millis(100));
        } else if self.held() > 0 {
            // One more retry period for a replica that holds leases of the kind
            // already: one holding none takes a free one first. (Not more: a
            // takeover after a crash must stay within seconds.)
            wait += self.cfg.retry_period;
        }
        wait
    }

    /// Renews the lease every retry period until it is lost or released.
    async fn renew(mut self, mut term: Term) {
        // However this task ends (a panic included), the term hears of it.
        let _lost = term.lost.clone().drop_guard();
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.cfg.retry_period) => {}
                _ = term.release.cancelled() => {
                    self.release().await;
                    if self.granted.is_none() {
                        // (A granted lease the asker takes at once: nothing to wait for.)
                        if let Some(within) = self.cfg.await_successor {
                            self.await_successor(within).await;
                        }
                    }
                    let _ = term.released.send(());
                    return;
                }
            }
            if !self.renew_once(&mut term).await {
                return;
            }
        }
    }

    /// One renewal; false once the term is over (taken, or the deadline passed).
    async fn renew_once(&mut self, term: &mut Term) -> bool {
        // An attempt may not outlast the deadline: a leader cut off from the apiserver
        // steps down by then, well before the lease can expire for anyone else. A
        // renewal counts from when its attempt started: the write may have been seen
        // by a standby (whose clock starts then) before we had the answer.
        let deadline = self.cfg.renew_deadline;
        let left = deadline.saturating_sub(term.last_renewed.elapsed());
        if left.is_zero() {
            term.missed_deadline(deadline);
            return false;
        }
        let started = Instant::now();
        match tokio::time::timeout(left, self.try_acquire_or_renew()).await {
            Ok(Ok(true)) => {
                term.last_renewed = started;
                *term.renewed.lock().unwrap_or_else(|e| e.into_inner()) = started;
                if self.granted.is_some() {
                    term.handover.cancel();
                }
            }
            Ok(Ok(false)) => {
                tracing::error!("leader lease taken by another replica; stepping down");
                term.lost.cancel();
                return false;
            }
            Ok(Err(e)) => tracing::warn!(error = %chain(&e), "lease renewal failed"),
            Err(_) => tracing::warn!("lease renewal timed out"),
        }
        if term.last_renewed.elapsed() >= deadline {
            term.missed_deadline(deadline);
            return false;
        }
        true
    }
}

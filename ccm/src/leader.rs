//! Leader election on a coordination.k8s.io Lease, as upstream's client-go does it:
//! the holder renews every retry period; another replica takes over once it has seen the
//! same record unchanged for a whole lease duration (measured on its own clock, so
//! clock skew between replicas does not matter); a leader that cannot renew within the
//! renew deadline steps down. At the drain the lease is released so that a standby
//! takes over at once.
//!
//! Leases of a kind a replica may hold several of (the load-balancer pools') can be
//! balanced ([`LeaderElection::balance`]): a replica waits one more retry period per
//! lease of the kind it holds before taking a free one, the holder writes how many it
//! holds on the lease, and a standby holding at least two fewer asks for it in an
//! annotation; the holder hands it over gracefully (its term lets go first, then the
//! lease is released to the asker, whom the others leave it to).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tether_core::error::chain;

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
    /// This replica's share of leases of this kind (see the module's doc): set, they
    /// are balanced over the replicas.
    pub balance: Option<Arc<Balance>>,
}

/// A replica's share of balanced leases.
#[derive(Debug, Default)]
pub struct Balance {
    /// How many it holds. The caller keeps it current as its terms start and end; a
    /// granted handover takes one off as soon as it is written.
    pub held: AtomicUsize,
    /// The lease it asked for, and when: one request at a time, so that an asker
    /// does not collect several leases on one stale count.
    asking: std::sync::Mutex<Option<(String, Instant)>>,
}

impl Balance {
    fn asking(&self) -> std::sync::MutexGuard<'_, Option<(String, Instant)>> {
        self.asking.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A count taken off until the grant it was reserved for is written (put back if the
/// write fails or is abandoned).
struct Reserved<'a> {
    balance: &'a Balance,
    committed: bool,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if !self.committed {
            self.balance.held.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// The holder's count of leases of the kind (balanced leases).
pub const HELD_ANNOTATION: &str = "tether.dev/leases-held";
/// A standby's request for the lease: `<identity> <leases it holds>`.
pub const REQUEST_ANNOTATION: &str = "tether.dev/handover-request";
/// Released to this identity: the others leave it to it for a lease duration.
pub const HANDOVER_ANNOTATION: &str = "tether.dev/handover-to";

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

fn annotation<'a>(lease: &'a Lease, key: &str) -> Option<&'a str> {
    lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
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

    /// How many leases of the kind we hold, 0 when not balanced.
    fn held(&self) -> usize {
        self.cfg
            .balance
            .as_ref()
            .map(|b| b.held.load(Ordering::SeqCst))
            .unwrap_or(0)
    }

    /// Whether our pending request is for this lease (and not stale).
    fn asked_for_this(&self) -> bool {
        let Some(b) = &self.cfg.balance else {
            return false;
        };
        let mut asking = b.asking();
        match &*asking {
            Some((_, at)) if at.elapsed() > self.cfg.lease_duration * 2 => {
                *asking = None;
                false
            }
            Some((name, _)) => *name == self.cfg.name,
            None => false,
        }
    }

    /// One read and write; `None` when the write lost to a concurrent one.
    async fn attempt(&mut self) -> Result<Option<Attempt>, LeaseError> {
        self.eager = false;
        let now = MicroTime(Timestamp::now());
        let secs = self.cfg.lease_duration.as_secs().max(1) as i32;
        let existing = match self.api.get_opt(&self.cfg.name).await {
            Ok(l) => l,
            Err(e) => return Err(self.err(e)),
        };
        let Some(mut lease) = existing else {
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
                    lease_duration_seconds: Some(secs),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(Some(Attempt::Held)),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(Some(Attempt::NotHeld)),
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
        let balanced = self.cfg.balance.is_some();
        if !ours && !holder.is_empty() && first_seen.elapsed() < duration {
            self.expires = Some(first_seen + duration);
            if balanced {
                return self.maybe_ask(lease).await;
            }
            return Ok(Some(Attempt::NotHeld));
        }
        // Released to another replica: theirs for two retry periods (it polls fast).
        if !ours && holder.is_empty() && balanced {
            if let Some(to) = annotation(&lease, HANDOVER_ANNOTATION) {
                let reserved = self.cfg.retry_period * 2;
                if to != self.cfg.identity && first_seen.elapsed() < reserved {
                    self.expires = Some(first_seen + reserved);
                    return Ok(Some(Attempt::NotHeld));
                }
            }
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
        if balanced {
            let request = annotation(&lease, REQUEST_ANNOTATION).map(str::to_string);
            let annotations = lease.metadata.annotations.get_or_insert_with(BTreeMap::new);
            annotations.remove(HANDOVER_ANNOTATION);
            annotations.remove(REQUEST_ANNOTATION);
            let mut held = self.held() + usize::from(!ours);
            let mut grant = None;
            if ours && self.granted.is_none() {
                if let (Some((asker, theirs)), Some(balance)) = (
                    request.as_deref().and_then(parse_request),
                    self.cfg.balance.as_deref(),
                ) {
                    // Granted only if it leaves both nearer an even share. The count
                    // drops now, so another request this round sees it, and comes back
                    // if the grant is not written.
                    let reserved = balance
                        .held
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |mine| {
                            (mine > theirs.saturating_add(1)).then(|| mine - 1)
                        })
                        .is_ok();
                    if reserved {
                        held = held.saturating_sub(1);
                        grant = Some((
                            asker.to_string(),
                            theirs,
                            Reserved {
                                balance,
                                committed: false,
                            },
                        ));
                    }
                }
            }
            annotations.insert(HELD_ANNOTATION.to_string(), held.to_string());
            if !ours {
                if let Some(b) = &self.cfg.balance {
                    // What we asked for, or not: we hold one more now.
                    b.asking().take();
                }
            }
            lease.spec = Some(new);
            let written = self
                .api
                .replace(&self.cfg.name, &PostParams::default(), &lease)
                .await;
            return match written {
                Ok(_) => {
                    if let Some((asker, theirs, mut reserved)) = grant {
                        reserved.committed = true;
                        tracing::info!(%asker, theirs, mine = held, "handing the lease over to even out the replicas' shares");
                        self.granted = Some(asker);
                    }
                    Ok(Some(Attempt::Held))
                }
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
                Err(e) => Err(self.err(e)),
            };
        }
        lease.spec = Some(new);
        // Replace carries the resourceVersion we read: a concurrent writer wins, we
        // lose with a conflict.
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

    /// A standby of a balanced lease held by another: asks for it when the holder
    /// holds at least two more of the kind than we do (and nobody asked yet).
    async fn maybe_ask(&mut self, mut lease: Lease) -> Result<Option<Attempt>, LeaseError> {
        let theirs: Option<usize> =
            annotation(&lease, HELD_ANNOTATION).and_then(|h| h.parse().ok());
        let mine = self.held();
        let ours_pending = annotation(&lease, REQUEST_ANNOTATION)
            .is_some_and(|r| r.starts_with(&format!("{} ", self.cfg.identity)));
        if self.asked_for_this() {
            // Answered at the holder's next renewal: a grant is released to us.
            self.eager = true;
            if !ours_pending {
                // Denied (the request is gone and the holder kept it).
                if let Some(b) = &self.cfg.balance {
                    b.asking().take();
                }
            }
            return Ok(Some(Attempt::NotHeld));
        }
        let Some(theirs) = theirs.filter(|t| *t > mine.saturating_add(1)) else {
            return Ok(Some(Attempt::NotHeld));
        };
        if annotation(&lease, REQUEST_ANNOTATION).is_some() {
            // Another's is pending: the holder answers it first.
            return Ok(Some(Attempt::NotHeld));
        }
        // One request at a time.
        {
            let Some(b) = &self.cfg.balance else {
                return Ok(Some(Attempt::NotHeld));
            };
            let mut asking = b.asking();
            if asking.is_some() {
                return Ok(Some(Attempt::NotHeld));
            }
            *asking = Some((self.cfg.name.clone(), Instant::now()));
        }
        lease
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(
                REQUEST_ANNOTATION.to_string(),
                format!("{} {mine}", self.cfg.identity),
            );
        match self
            .api
            .replace(&self.cfg.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => {
                tracing::info!(holds = theirs, mine, "asked the holder for the lease");
                self.eager = true;
            }
            Err(e) => {
                if let Some(b) = &self.cfg.balance {
                    b.asking().take();
                }
                if !matches!(&e, kube::Error::Api(a) if a.code == 409) {
                    return Err(self.err(e));
                }
            }
        }
        Ok(Some(Attempt::NotHeld))
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

/// `<identity> <count>` of a handover request.
fn parse_request(r: &str) -> Option<(&str, usize)> {
    let (who, n) = r.rsplit_once(' ')?;
    Some((who, n.parse().ok()?))
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
        let mut acquired_at;
        loop {
            acquired_at = Instant::now();
            match elector.try_acquire_or_renew().await {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %chain(&e), "leader election attempt failed"),
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
            if elector.eager {
                // A handover asked for: the holder answers within a retry period.
                wait = wait.min(Duration::from_millis(100));
            } else if elector.held() > 0 {
                // One more retry period for a replica that holds leases of the kind
                // already: one holding none takes a free one first. (Not more: a
                // takeover after a crash must stay within seconds.)
                wait += elector.cfg.retry_period;
            }
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = drain.cancelled() => return None,
            }
        }
        tracing::info!("became leader");
        let lost = CancellationToken::new();
        let handover = CancellationToken::new();
        let release = CancellationToken::new();
        let (released_tx, released) = tokio::sync::oneshot::channel();
        let renewed = Arc::new(std::sync::Mutex::new(acquired_at));
        let leadership = Leadership {
            lost: lost.clone(),
            handover: handover.clone(),
            renewed: renewed.clone(),
            release: release.clone(),
            released: Some(released),
        };
        tokio::spawn(
            async move {
                // However this task ends (a panic included), the term hears of it.
                let _lost = lost.clone().drop_guard();
                let mut last_renewed = acquired_at;
                loop {
                    tokio::select! {
                        _ = tokio::time::sleep(elector.cfg.retry_period) => {}
                        _ = release.cancelled() => {
                            elector.release().await;
                            if elector.granted.is_some() {
                                // The asker takes it at once; nothing to wait for.
                            } else if let Some(within) = elector.cfg.await_successor {
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
                        Ok(Ok(true)) => {
                            last_renewed = started;
                            *renewed.lock().unwrap_or_else(|e| e.into_inner()) = started;
                            if elector.granted.is_some() {
                                handover.cancel();
                            }
                        }
                        Ok(Ok(false)) => {
                            tracing::error!("leader lease taken by another replica; stepping down");
                            lost.cancel();
                            return;
                        }
                        Ok(Err(e)) => tracing::warn!(error = %chain(&e), "lease renewal failed"),
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

#[cfg(test)]
mod tests {
    #[test]
    fn handover_requests_name_the_asker_and_its_count() {
        assert_eq!(
            super::parse_request("host-a_1234 2"),
            Some(("host-a_1234", 2))
        );
        assert_eq!(super::parse_request("host a 0"), Some(("host a", 0)));
        assert_eq!(super::parse_request("host-a"), None);
        assert_eq!(super::parse_request("host-a x"), None);
    }
}

//! What a listener lets in before anyone has proved who they are: a cap on its open
//! connections (handshaking or served), and a bounded set of **unproven** connections
//! (handshaking, or past TLS but not yet authenticated) with a share per source address
//! and per source prefix (/24 for IPv4, /64 for IPv6). A source or prefix over its
//! share is closed at once. When the unproven set is full, or the listener at its
//! connection cap, an unproven connection that is only holding its place is evicted to
//! make room: one that has sent nothing (at once), one whose handshake has run for
//! [`HANDSHAKE_GRACE`], one past TLS that has asked for nothing for [`CONNECTED_GRACE`],
//! one whose request the server is checking (a token waiting for its review) for
//! [`SERVING_GRACE`]; the oldest such of the prefix holding the most. With nothing to evict, the
//! listener waits, and new clients wait in the kernel's backlog holding no descriptor
//! of ours. So a flood of idle sockets from many sources never queues a real client
//! behind it, and a reconnect storm of real clients, all busy handshaking, is not
//! thrashed by evictions.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// How long a handshake that has started may hold its place before a newcomer may
/// evict it (a real one takes a few round trips).
pub const HANDSHAKE_GRACE: Duration = Duration::from_secs(3);
/// How long a connection past TLS that has asked for nothing may hold its place before
/// a newcomer may evict it (a real agent asks at once).
pub const CONNECTED_GRACE: Duration = Duration::from_secs(1);
/// How long a connection whose request the server is checking (a token waiting for
/// its review) may hold its place before a newcomer may evict it: a reconnect storm's
/// reviews queue behind the review rate, but no request keeps a place for good.
pub const SERVING_GRACE: Duration = Duration::from_secs(10);

/// Where an unproven connection is; see [`Pending::set_stage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Stage {
    /// Accepted; the peer has sent nothing. Evictable at once: a grace here would let a
    /// flood of idle sockets slow the accept loop until the kernel's queue fills and
    /// drops real clients' SYNs. (A real client's first segment is usually there when
    /// its connection is accepted, and the listener looks before it files it here.)
    Silent = 0,
    /// The peer has started its handshake. Evictable after [`HANDSHAKE_GRACE`].
    Handshaking = 1,
    /// Past TLS, waiting for the peer's request. Evictable after [`CONNECTED_GRACE`].
    Connected = 2,
    /// The server is working on the peer's request (reviewing its token). Evictable
    /// after [`SERVING_GRACE`].
    Serving = 3,
}

/// A stage and since when, shared between a connection's code and the set.
#[derive(Debug, Default)]
struct StageCell {
    stage: AtomicU8,
    /// Milliseconds since [`epoch`] when the stage was entered.
    since: AtomicU64,
}

/// The process's clock origin for [`StageCell::since`] (tokio's clock, which tests can
/// pause and advance).
fn epoch() -> tokio::time::Instant {
    static EPOCH: OnceLock<tokio::time::Instant> = OnceLock::new();
    *EPOCH.get_or_init(tokio::time::Instant::now)
}

fn now_ms() -> u64 {
    epoch().elapsed().as_millis() as u64
}

impl StageCell {
    /// Moves to `stage` from now; staying in the stage it is in keeps its time (a
    /// second request does not renew the first one's grace).
    fn set(&self, stage: Stage) {
        if self.stage.swap(stage as u8, Ordering::Relaxed) != stage as u8 {
            self.since.store(now_ms(), Ordering::Relaxed);
        }
    }

    /// May a newcomer evict this connection at `now` (ms)?
    fn evictable(&self, now: u64) -> bool {
        let held = now.saturating_sub(self.since.load(Ordering::Relaxed));
        match self.stage.load(Ordering::Relaxed) {
            0 => true,
            1 => held >= HANDSHAKE_GRACE.as_millis() as u64,
            2 => held >= CONNECTED_GRACE.as_millis() as u64,
            _ => held >= SERVING_GRACE.as_millis() as u64,
        }
    }
}

/// The caps; 0 means no cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Open connections, handshaking or served.
    pub max_connections: usize,
    /// Unproven connections (TLS handshakes in progress, or connections not yet
    /// authenticated); at the cap the oldest of the busiest prefix is evicted.
    pub max_handshakes: usize,
    /// Unproven connections from one source address.
    pub max_handshakes_per_source: usize,
    /// Unproven connections from one source prefix (/24, /64).
    pub max_handshakes_per_prefix: usize,
}

impl AdmissionLimits {
    /// No caps at all (a listener only the process itself reaches).
    pub const NONE: AdmissionLimits = AdmissionLimits {
        max_connections: 0,
        max_handshakes: 0,
        max_handshakes_per_source: 0,
        max_handshakes_per_prefix: 0,
    };

    /// The defaults for an open-file limit of `nofile`: connections up to three
    /// quarters of it (the rest stays for tunnels, the frontend, files and the
    /// apiserver client), 1,024 unproven connections, 128 per source address (a NAT
    /// gateway in front of many nodes included) and 512 per prefix.
    pub fn for_open_files(nofile: u64) -> Self {
        AdmissionLimits {
            max_connections: (nofile.saturating_mul(3) / 4).max(64) as usize,
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            max_handshakes_per_source: DEFAULT_MAX_HANDSHAKES_PER_SOURCE,
            max_handshakes_per_prefix: DEFAULT_MAX_HANDSHAKES_PER_PREFIX,
        }
    }

    /// The caps of a small HTTP listener (health, admin): probes and scrapes hold a
    /// few connections each, so a flood gets few descriptors and a new probe evicts it.
    pub const SIDE: AdmissionLimits = AdmissionLimits {
        max_connections: 256,
        max_handshakes: 128,
        max_handshakes_per_source: 16,
        max_handshakes_per_prefix: 64,
    };
}

/// Unproven connections at once, per listener, by default.
pub const DEFAULT_MAX_HANDSHAKES: usize = 1024;
/// Unproven connections from one address at once, per listener, by default.
pub const DEFAULT_MAX_HANDSHAKES_PER_SOURCE: usize = 128;
/// Unproven connections from one /24 (IPv4) or /64 (IPv6) at once, per listener, by
/// default.
pub const DEFAULT_MAX_HANDSHAKES_PER_PREFIX: usize = 512;

/// Why a connection was closed unserved (the counter label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its source address already had its share.
    PerSource,
    /// Its source prefix already had its share.
    PerPrefix,
    /// It was unproven and the oldest of the busiest prefix when the set was full.
    Evicted,
    /// Its TLS handshake failed, timed out, or never started.
    Handshake,
}

impl Refusal {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::PerSource => "per_source",
            Refusal::PerPrefix => "per_prefix",
            Refusal::Evicted => "evicted",
            Refusal::Handshake => "handshake",
        }
    }
}

/// Called for every refused connection (a metric counter, for instance).
pub type OnRefusal = Arc<dyn Fn(Refusal) + Send + Sync>;

/// A source's prefix: /24 of an IPv4 address, /64 of an IPv6 one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Prefix {
    V4([u8; 3]),
    V6([u8; 8]),
}

impl Prefix {
    fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(v4) => {
                let o = v4.octets();
                Prefix::V4([o[0], o[1], o[2]])
            }
            IpAddr::V6(v6) => {
                let mut p = [0u8; 8];
                p.copy_from_slice(&v6.octets()[..8]);
                Prefix::V6(p)
            }
        }
    }
}

/// One unproven connection in the set.
struct Entry {
    id: u64,
    source: IpAddr,
    evict: CancellationToken,
    stage: Arc<StageCell>,
}

/// The unproven set: every entry by prefix, oldest first.
#[derive(Default)]
struct Unproven {
    total: usize,
    next_id: u64,
    sources: HashMap<IpAddr, usize>,
    prefixes: HashMap<Prefix, VecDeque<Entry>>,
}

impl Unproven {
    /// Takes the entry `id` of `prefix` out, if it is still in; true if it was.
    fn remove(&mut self, prefix: Prefix, id: u64) -> bool {
        let Some(queue) = self.prefixes.get_mut(&prefix) else {
            return false;
        };
        let Some(at) = queue.iter().position(|e| e.id == id) else {
            return false;
        };
        let entry = queue.remove(at).expect("found");
        if queue.is_empty() {
            self.prefixes.remove(&prefix);
        }
        self.forget(entry.source);
        true
    }

    fn forget(&mut self, source: IpAddr) {
        self.total -= 1;
        if let Some(n) = self.sources.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                self.sources.remove(&source);
            }
        }
    }

    /// Evicts, of the connections a newcomer may evict now, the oldest of the prefix
    /// holding the most; false when there is none.
    fn evict_one(&mut self) -> bool {
        let now = now_ms();
        let victim = self
            .prefixes
            .iter()
            .filter_map(|(p, q)| {
                let at = q.iter().position(|e| e.stage.evictable(now))?;
                Some((q.len(), *p, at))
            })
            .max_by_key(|(len, _, _)| *len);
        let Some((_, prefix, at)) = victim else {
            return false;
        };
        let queue = self.prefixes.get_mut(&prefix).expect("found");
        let entry = queue.remove(at).expect("found");
        if queue.is_empty() {
            self.prefixes.remove(&prefix);
        }
        self.forget(entry.source);
        entry.evict.cancel();
        true
    }
}

/// One listener's admission state.
pub struct Admission {
    connections: Option<Arc<Semaphore>>,
    limits: AdmissionLimits,
    unproven: Arc<Mutex<Unproven>>,
    /// Woken when an unproven connection leaves the set or moves on.
    changed: Arc<Notify>,
    on_refusal: OnRefusal,
}

/// A connection's place under the connection cap; released when dropped.
pub struct ConnectionSlot(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

/// A connection's place in the unproven set, until it is dropped (the connection proved
/// itself, or closed). [`Pending::evicted`] resolves when the set needs the room.
pub struct Pending {
    at: Option<Place>,
    evict: CancellationToken,
    stage: Arc<StageCell>,
}

impl Pending {
    /// Resolves when this connection was evicted: close it.
    pub fn evicted(&self) -> WaitForCancellationFutureOwned {
        self.evict.clone().cancelled_owned()
    }

    /// Was it evicted?
    pub fn is_evicted(&self) -> bool {
        self.evict.is_cancelled()
    }

    /// Moves the connection to `stage` (from now), which decides when a newcomer may
    /// evict it.
    pub fn set_stage(&self, stage: Stage) {
        self.stage.set(stage);
        if let Some((.., changed)) = &self.at {
            changed.notify_waiters();
        }
    }

    /// A handle the connection's later code can move the stage with.
    pub fn stages(&self) -> Stages {
        Stages(self.stage.clone())
    }
}

/// Where a [`Pending`] is in its set: its prefix, its id, the set, and the set's
/// change signal.
type Place = (Prefix, u64, Arc<Mutex<Unproven>>, Arc<Notify>);

/// Moves an unproven connection's stage from code that does not hold its [`Pending`].
#[derive(Clone, Debug, Default)]
pub struct Stages(Arc<StageCell>);

impl Stages {
    /// See [`Pending::set_stage`].
    pub fn set(&self, stage: Stage) {
        self.0.set(stage);
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some((prefix, id, set, changed)) = self.at.take() {
            set.lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(prefix, id);
            changed.notify_waiters();
        }
    }
}

fn semaphore(n: usize) -> Option<Arc<Semaphore>> {
    (n > 0).then(|| Arc::new(Semaphore::new(n)))
}

impl Admission {
    /// A listener's admission under `limits`; `on_refusal` hears each refusal.
    pub fn new(limits: AdmissionLimits, on_refusal: OnRefusal) -> Self {
        Admission {
            connections: semaphore(limits.max_connections),
            limits,
            unproven: Arc::default(),
            changed: Arc::default(),
            on_refusal,
        }
    }

    /// Waits for room for one more connection (call before `accept`, so that a full
    /// listener leaves new clients in the kernel's backlog). At the cap, the oldest
    /// unproven connection of the busiest prefix is evicted to make the room: only
    /// connections whose peers proved who they are can hold the listener full.
    pub async fn connection_slot(&self) -> ConnectionSlot {
        let Some(s) = &self.connections else {
            return ConnectionSlot(None);
        };
        loop {
            if let Ok(permit) = s.clone().try_acquire_owned() {
                return ConnectionSlot(Some(permit));
            }
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            let evicted = self
                .unproven
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .evict_one();
            if evicted {
                (self.on_refusal)(Refusal::Evicted);
            }
            tokio::select! {
                permit = s.clone().acquire_owned() => return ConnectionSlot(permit.ok()),
                _ = tokio::time::timeout(Duration::from_millis(100), changed) => {}
            }
        }
    }

    /// Puts a new connection from `source` in the unproven set: `Err` (counted) when
    /// its address or prefix already holds its share (close it). When the set is full,
    /// a connection a newcomer may evict makes room; with none, this waits until one
    /// may be or leaves.
    pub async fn admit(&self, source: IpAddr) -> Result<Pending, Refusal> {
        let l = &self.limits;
        if l.max_handshakes == 0
            && l.max_handshakes_per_source == 0
            && l.max_handshakes_per_prefix == 0
        {
            return Ok(Pending {
                at: None,
                evict: CancellationToken::new(),
                stage: Arc::default(),
            });
        }
        let source = canonical(source);
        loop {
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            match self.try_admit(source) {
                Ok(Some(pending)) => return Ok(pending),
                Err(why) => {
                    (self.on_refusal)(why);
                    return Err(why);
                }
                // Full, and nothing to evict yet: wait for a leave, a stage change, or
                // for time to make a place evictable.
                Ok(None) => {
                    let _ = tokio::time::timeout(Duration::from_millis(100), changed).await;
                }
            }
        }
    }

    /// One try of [`Admission::admit`]: `Ok(None)` when the set is full with nothing
    /// to evict.
    fn try_admit(&self, source: IpAddr) -> Result<Option<Pending>, Refusal> {
        let l = &self.limits;
        let prefix = Prefix::of(source);
        let mut set = self.unproven.lock().unwrap_or_else(|e| e.into_inner());
        if l.max_handshakes_per_source > 0
            && set.sources.get(&source).copied().unwrap_or(0) >= l.max_handshakes_per_source
        {
            return Err(Refusal::PerSource);
        }
        if l.max_handshakes_per_prefix > 0
            && set.prefixes.get(&prefix).map_or(0, VecDeque::len) >= l.max_handshakes_per_prefix
        {
            return Err(Refusal::PerPrefix);
        }
        if l.max_handshakes > 0 && set.total >= l.max_handshakes {
            if !set.evict_one() {
                return Ok(None);
            }
            (self.on_refusal)(Refusal::Evicted);
        }
        let (id, evict, stage) = (
            set.next_id,
            CancellationToken::new(),
            Arc::<StageCell>::default(),
        );
        stage.since.store(now_ms(), Ordering::Relaxed);
        set.next_id += 1;
        set.total += 1;
        *set.sources.entry(source).or_default() += 1;
        set.prefixes.entry(prefix).or_default().push_back(Entry {
            id,
            source,
            evict: evict.clone(),
            stage: stage.clone(),
        });
        Ok(Some(Pending {
            at: Some((prefix, id, self.unproven.clone(), self.changed.clone())),
            evict,
            stage,
        }))
    }

    /// Counts a connection closed for `why` by the listener's own code (a failed
    /// handshake, say).
    pub fn count(&self, why: Refusal) {
        (self.on_refusal)(why);
    }

    /// How many connections are unproven now.
    pub fn unproven(&self) -> usize {
        self.unproven
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .total
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is (a dual-stack listener).
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counting(limits: AdmissionLimits) -> (Admission, Arc<Mutex<Vec<Refusal>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let adm = Admission::new(limits, Arc::new(move |r| s.lock().unwrap().push(r)));
        (adm, seen)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[tokio::test]
    async fn a_source_and_a_prefix_get_their_share_and_no_more() {
        let (adm, seen) = counting(AdmissionLimits {
            max_connections: 0,
            max_handshakes: 0,
            max_handshakes_per_source: 2,
            max_handshakes_per_prefix: 3,
        });
        let s1 = adm.admit(ip("127.0.0.2")).await.unwrap();
        let _s2 = adm.admit(ip("127.0.0.2")).await.unwrap();
        assert_eq!(
            adm.admit(ip("127.0.0.2")).await.err(),
            Some(Refusal::PerSource)
        );
        // The mapped form is the same source.
        assert_eq!(
            adm.admit(ip("::ffff:127.0.0.2")).await.err(),
            Some(Refusal::PerSource)
        );
        let _s3 = adm.admit(ip("127.0.0.3")).await.unwrap();
        assert_eq!(
            adm.admit(ip("127.0.0.4")).await.err(),
            Some(Refusal::PerPrefix)
        );
        assert!(adm.admit(ip("127.0.1.4")).await.is_ok(), "another prefix");
        // One /64 is one prefix.
        let _v6 = adm.admit(ip("2001:db8::1")).await.unwrap();
        let _v6b = adm.admit(ip("2001:db8::2")).await.unwrap();
        let _v6c = adm.admit(ip("2001:db8::3")).await.unwrap();
        assert_eq!(
            adm.admit(ip("2001:db8::4")).await.err(),
            Some(Refusal::PerPrefix)
        );
        assert!(adm.admit(ip("2001:db8:0:1::4")).await.is_ok());
        assert_eq!(seen.lock().unwrap().len(), 4);
        drop(s1);
        assert!(adm.admit(ip("127.0.0.2")).await.is_ok(), "room again");
    }

    #[tokio::test]
    async fn a_full_set_evicts_the_oldest_of_the_busiest_prefix() {
        let (adm, seen) = counting(AdmissionLimits {
            max_connections: 0,
            max_handshakes: 4,
            max_handshakes_per_source: 0,
            max_handshakes_per_prefix: 0,
        });
        // A flood from one prefix, and one client from another.
        let mut flood = Vec::new();
        for i in 0..3 {
            flood.push(adm.admit(ip(&format!("10.0.0.{i}"))).await.unwrap());
        }
        let client = adm.admit(ip("192.0.2.7")).await.unwrap();
        // The set is full: the next arrival evicts the flood's oldest, not the client.
        let next = adm.admit(ip("10.0.0.9")).await.unwrap();
        assert!(flood[0].is_evicted() && !flood[1].is_evicted());
        assert!(!client.is_evicted());
        flood[0].evicted().await;
        assert_eq!(adm.unproven(), 4);
        // Dropping an evicted connection frees nothing twice.
        drop(flood);
        assert_eq!(adm.unproven(), 2);
        drop((client, next));
        assert_eq!(adm.unproven(), 0);
        assert_eq!(*seen.lock().unwrap(), vec![Refusal::Evicted]);
    }

    #[tokio::test]
    async fn at_the_connection_cap_the_next_waits_for_a_slot() {
        let adm = Admission::new(
            AdmissionLimits {
                max_connections: 1,
                ..AdmissionLimits::NONE
            },
            Arc::new(|_| {}),
        );
        let first = adm.connection_slot().await;
        use futures::FutureExt;
        assert!(
            adm.connection_slot().now_or_never().is_none(),
            "no room while the first is open"
        );
        drop(first);
        let _second = adm.connection_slot().await;
    }

    #[tokio::test]
    async fn at_the_connection_cap_an_unproven_connection_makes_room() {
        let (adm, seen) = counting(AdmissionLimits {
            max_connections: 2,
            max_handshakes: 100,
            ..AdmissionLimits::NONE
        });
        let proven = adm.connection_slot().await;
        let slot = adm.connection_slot().await;
        let unproven = adm.admit(ip("10.0.0.1")).await.unwrap();
        // The holder of `slot` drops it when evicted, as a connection task does.
        let holder = tokio::spawn(async move {
            unproven.evicted().await;
            drop(slot);
        });
        let third = tokio::time::timeout(std::time::Duration::from_secs(5), adm.connection_slot())
            .await
            .expect("room made by evicting the unproven connection");
        holder.await.unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![Refusal::Evicted]);
        drop((proven, third));
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_is_evicted_only_once_it_is_only_holding_its_place() {
        let (adm, _) = counting(AdmissionLimits {
            max_handshakes: 2,
            ..AdmissionLimits::NONE
        });
        let serving = adm.admit(ip("10.0.0.1")).await.unwrap();
        serving.set_stage(Stage::Serving);
        let handshaking = adm.admit(ip("10.0.0.2")).await.unwrap();
        handshaking.set_stage(Stage::Handshaking);
        // Full, and neither may be evicted yet: the newcomer waits.
        let newcomer = adm.admit(ip("192.0.2.1"));
        let mut newcomer = std::pin::pin!(newcomer);
        assert!(futures::poll!(newcomer.as_mut()).is_pending());
        tokio::time::advance(HANDSHAKE_GRACE - Duration::from_millis(200)).await;
        assert!(futures::poll!(newcomer.as_mut()).is_pending());
        // Past the grace the handshake may be evicted; the request under review not yet.
        let admitted = tokio::time::timeout(Duration::from_secs(1), newcomer).await;
        let admitted = admitted.unwrap().unwrap();
        assert!(handshaking.is_evicted() && !serving.is_evicted());
        // A request may hold its place for SERVING_GRACE, no longer (the newcomer's own
        // request, younger, may not be evicted yet).
        admitted.set_stage(Stage::Serving);
        tokio::time::advance(SERVING_GRACE - Duration::from_secs(2)).await;
        let later = tokio::time::timeout(Duration::from_secs(1), adm.admit(ip("192.0.2.2"))).await;
        assert!(later.is_ok_and(|a| a.is_ok()));
        assert!(serving.is_evicted() && !admitted.is_evicted());
    }

    #[test]
    fn defaults_leave_a_quarter_of_the_descriptors() {
        let l = AdmissionLimits::for_open_files(20_000);
        assert_eq!(l.max_connections, 15_000);
        assert_eq!(AdmissionLimits::for_open_files(10).max_connections, 64);
    }
}

//! Pool ownership and serving. Each load-balancer pool has a Lease of its own,
//! `<--leader-elect-resource-name>-lb-<pool>` (4 s / 2 s / 500 ms by default); the
//! replica holding it adds and announces the pool's addresses and serves every Service
//! whose status shows one of them, from its own watches of nodes, Services and
//! EndpointSlices (kept warm on standbys, so a takeover starts serving at once). The
//! service controller, on the controllers' leader, only assigns the addresses. The
//! pools' leases are balanced over the replicas ([`crate::leader`]), so the pools
//! spread: a replica holding fewer takes a free one first and asks a holder of at least
//! two more for one.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tether_core::error::chain;

use k8s_openapi::api::core::v1::{Node, Service};
use kube::api::Api;
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::balancer::TunnelLoadBalancers;
use super::record::Known;
use crate::cloud::{Replica, ServiceInfo};
use crate::endpoints::EndpointsCache;
use crate::leader::{LeaderElection, Leadership};
use crate::translate::{backends, backends_for, is_ours, service_info};
use crate::workqueue::{Outcome, WorkQueue};

/// How long a status the allocation record does not back is held back before it is
/// taken for forged: the leader writes the record before the status, but this
/// replica's watches may bring the status first.
const CONFIRM: Duration = Duration::from_secs(2);

/// How often the pool list is read again (pools come and go with the cloud config).
const POOL_CHECK: Duration = Duration::from_secs(1);

/// How long a holder letting go of a pool on purpose waits for a moment when no
/// connection is open through it (a long download is cut after this).
const POOL_QUIET: Duration = Duration::from_secs(2);

/// A refresh must leave this much before the renew deadline.
const REFRESH_MARGIN: Duration = Duration::from_millis(250);

/// Serves the pools this replica holds until the replica's `drain`; then lets go of
/// each (its addresses first, then its lease, handed to a standby) before returning.
/// The replica's `lease` names the pools' leases (`-<pool>` is added); without one
/// (`--leader-elect=false`) this replica serves every pool.
pub async fn run(lbs: Arc<TunnelLoadBalancers>, cfg: Replica) {
    let (client, drain) = (cfg.client.clone(), cfg.drain.clone());
    let hard_stop = CancellationToken::new();
    let _hard_stop = hard_stop.clone().drop_guard();
    let queue = WorkQueue::new("lb-serve", lbs.metrics());
    let node_events = WorkQueue::new("lb-serve-nodes", lbs.metrics());
    let watches = Watches::start(&client, &queue, &node_events, &hard_stop, &drain).await;
    let Some(Watches {
        nodes,
        services,
        endpoints,
    }) = watches
    else {
        return;
    };
    let Some(record) = follow_record(&client, &lbs, &hard_stop, &drain).await else {
        return;
    };
    let events = events(&client, &cfg, &nodes, &lbs);
    let server = Arc::new(Server {
        lbs: lbs.clone(),
        nodes,
        services,
        endpoints,
        queue: queue.clone(),
        class: cfg.load_balancer_class.clone(),
        served: Mutex::new(HashMap::new()),
        record,
        unbacked: Mutex::new(HashMap::new()),
        events,
    });
    spawn_record_watch(&server, &hard_stop);
    spawn_node_set_watch(&server, node_events, &hard_stop);
    spawn_resync(&server, &hard_stop, cfg.resync);
    let workers = {
        let (server, hard_stop, n) = (server.clone(), hard_stop.clone(), cfg.workers.max(1));
        tokio::spawn(queue.clone().work(n, hard_stop, move |key| {
            let server = server.clone();
            async move {
                server
                    .sync(&key)
                    .instrument(tracing::debug_span!("serve_service", service = %key))
                    .await
            }
        }))
    };
    hold_pools(&client, &server, cfg.lease.as_ref(), &drain).await;
    hard_stop.cancel();
    queue.shut_down();
    let _ = workers.await;
}

/// This replica's own warm watches of nodes, Services and EndpointSlices.
struct Watches {
    nodes: Store<Node>,
    services: Store<Service>,
    endpoints: EndpointsCache,
}

impl Watches {
    /// Starts the watches (until `hard_stop`), feeding node changes to `node_events` and
    /// Service and endpoint changes to `queue`, and waits until they are synced; `None`
    /// on `drain` first or when they cannot sync.
    async fn start(
        client: &kube::Client,
        queue: &Arc<WorkQueue>,
        node_events: &Arc<WorkQueue>,
        hard_stop: &CancellationToken,
        drain: &CancellationToken,
    ) -> Option<Watches> {
        let nodes = crate::informer::spawn(
            "nodes",
            Api::<Node>::all(client.clone()),
            vec![node_events.clone()],
            hard_stop.clone(),
        );
        let services = crate::informer::spawn(
            "services",
            Api::<Service>::all(client.clone()),
            vec![queue.clone()],
            hard_stop.clone(),
        );
        let endpoints = tokio::select! {
            e = EndpointsCache::spawn(client.clone(), queue.clone(), hard_stop.clone()) => e,
            _ = drain.cancelled() => None,
        };
        let endpoints = endpoints?;
        let ready = async {
            nodes
                .wait_until_ready()
                .await
                .map_err(|e| chain(&e).to_string())?;
            services
                .wait_until_ready()
                .await
                .map_err(|e| chain(&e).to_string())?;
            endpoints.wait_until_ready().await
        };
        tokio::select! {
            r = ready => if let Err(e) = r {
                tracing::error!(error = %e, "load-balancer caches did not sync");
                return None;
            },
            _ = drain.cancelled() => return None,
        }
        Some(Watches {
            nodes,
            services,
            endpoints,
        })
    }
}

/// What the serving loop publishes its events with (as this replica).
fn events(
    client: &kube::Client,
    cfg: &Replica,
    nodes: &Store<Node>,
    lbs: &TunnelLoadBalancers,
) -> crate::controllers::Context {
    crate::controllers::Context {
        client: client.clone(),
        identity: cfg.identity.clone(),
        nodes: nodes.clone(),
        recorder: Default::default(),
        metrics: lbs.metrics().clone(),
    }
}

/// Follows the allocation record (when the balancers keep one) and waits until it is
/// read; `None` on `drain` first.
async fn follow_record(
    client: &kube::Client,
    lbs: &TunnelLoadBalancers,
    hard_stop: &CancellationToken,
    drain: &CancellationToken,
) -> Option<Option<watch::Receiver<Known>>> {
    let Some(at) = lbs.allocations().record_at() else {
        return Some(None);
    };
    let mut rx = super::record::follow(client.clone(), at, hard_stop.clone());
    tokio::select! {
        r = rx.wait_for(|k| !matches!(k, Known::Unsynced)) => r.ok()?,
        _ = drain.cancelled() => return None,
    };
    Some(Some(rx))
}

/// Spawns the task that queues every Service when the allocation record changes.
fn spawn_record_watch(server: &Arc<Server>, hard_stop: &CancellationToken) {
    let Some(mut rx) = server.record.clone() else {
        return;
    };
    let (server, hard_stop) = (server.clone(), hard_stop.clone());
    tokio::spawn(
        async move {
            loop {
                tokio::select! {
                    r = rx.changed() => if r.is_err() { return },
                    _ = hard_stop.cancelled() => return,
                }
                server.queue_all();
            }
        }
        .instrument(tracing::info_span!("lb_serve_record")),
    );
}

/// Spawns the task that queues every Service when the node set changes (until `hard_stop`
/// shuts `node_events` down).
fn spawn_node_set_watch(
    server: &Arc<Server>,
    node_events: Arc<WorkQueue>,
    hard_stop: &CancellationToken,
) {
    let (n, hard_stop) = (node_events.clone(), hard_stop.clone());
    tokio::spawn(async move {
        hard_stop.cancelled().await;
        n.shut_down();
    });
    let server = server.clone();
    tokio::spawn(
        async move {
            let mut last = backends(&server.nodes);
            while let Some(key) = node_events.next().await {
                node_events.done(key, Outcome::Done);
                let now = backends(&server.nodes);
                if now != last {
                    last = now;
                    server.queue_all();
                }
            }
        }
        .instrument(tracing::info_span!("lb_serve_nodes")),
    );
}

/// Spawns the drift repair: every Service queued again every `period`, until `hard_stop`.
fn spawn_resync(server: &Arc<Server>, hard_stop: &CancellationToken, period: Duration) {
    let (server, hard_stop) = (server.clone(), hard_stop.clone());
    tokio::spawn(
        async move {
            let mut tick = crate::workqueue::Ticker::new(period);
            tick.next(&hard_stop).await;
            while tick.next(&hard_stop).await {
                server.queue_all();
            }
        }
        .instrument(tracing::info_span!("lb_serve_resync")),
    );
}

/// Runs one term per pool, following the cloud config (a pool added gets a term, a
/// pool removed lets go), until `drain`; then waits for every pool to let go, each
/// handing its lease to a standby.
async fn hold_pools(
    client: &kube::Client,
    server: &Arc<Server>,
    lease: Option<&LeaderElection>,
    drain: &CancellationToken,
) {
    let held = lease.and_then(|l| l.balance.clone()).unwrap_or_default();
    let mut terms: HashMap<String, (CancellationToken, tokio::task::JoinHandle<()>)> =
        HashMap::new();
    // Terms of removed pools, letting go.
    let mut ending: Vec<tokio::task::JoinHandle<()>> = Vec::new();
    loop {
        let names = server.lbs.allocations().pool_names();
        for name in &names {
            if terms.contains_key(name) {
                continue;
            }
            let pool_drain = drain.child_token();
            let lease = lease.cloned().map(|mut l| {
                l.name = format!("{}-{name}", l.name);
                l.balance = Some(held.clone());
                l
            });
            let task = tokio::spawn(
                term(
                    client.clone(),
                    server.clone(),
                    lease,
                    name.clone(),
                    pool_drain.clone(),
                )
                .instrument(tracing::info_span!("lb_pool", pool = %name)),
            );
            terms.insert(name.clone(), (pool_drain, task));
        }
        let gone: Vec<String> = terms
            .keys()
            .filter(|n| !names.contains(n))
            .cloned()
            .collect();
        for name in gone {
            if let Some((pool_drain, task)) = terms.remove(&name) {
                tracing::info!(pool = %name, "pool removed from the cloud config; letting it go");
                pool_drain.cancel();
                ending.push(task);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(POOL_CHECK) => {}
            _ = drain.cancelled() => break,
        }
    }
    // Every pool lets go at once, each handing its lease to a standby.
    for task in terms.into_values().map(|(_, t)| t).chain(ending) {
        let _ = task.await;
    }
}

/// One pool's terms: stand by (while the interface is usable), take the pool's lease,
/// serve its addresses until `drain`, a lost lease, an unusable interface or a
/// handover; let go of the addresses, and only then release the lease.
async fn term(
    client: kube::Client,
    server: Arc<Server>,
    lease: Option<LeaderElection>,
    pool: String,
    drain: CancellationToken,
) {
    let lbs = server.lbs.clone();
    let Some(le) = lease else {
        lbs.resume_pool(&pool).await;
        server.queue_all();
        drain.cancelled().await;
        lbs.release_pool(&pool).await;
        return;
    };
    let held = le.balance.clone().unwrap_or_default();
    let holding = lbs.metrics().leader.with_label_values(&[le.name.as_str()]);
    holding.set(0);
    loop {
        if !stand_by(&lbs, &le, &drain).await {
            return;
        }
        let Some(leadership) = crate::leader::lead(client.clone(), le.clone(), drain.clone()).await
        else {
            return;
        };
        held.held.fetch_add(1, Ordering::SeqCst);
        holding.set(1);
        let release = serve_term(&server, &pool, &le, &leadership, &drain).await;
        // The addresses go (serves in flight finish first and none adds one back)
        // before the lease is released.
        lbs.release_pool(&pool).await;
        holding.set(0);
        // A granted handover took its count off already.
        if !leadership.handover.is_cancelled() {
            let _ = held
                .held
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        }
        if release {
            leadership.release().await;
        }
        if drain.is_cancelled() {
            return;
        }
    }
}

/// Waits until the interface is usable, to stand for the pool's lease only then
/// (saying why not when that changes); false when `drain` comes first.
async fn stand_by(
    lbs: &TunnelLoadBalancers,
    le: &LeaderElection,
    drain: &CancellationToken,
) -> bool {
    let mut said = None;
    loop {
        match lbs.ready().await {
            Ok(()) => return true,
            Err(why) => {
                if said.as_ref() != Some(&why) {
                    tracing::warn!(reason = %why, "not standing for the pool's lease");
                    said = Some(why);
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(le.retry_period) => {}
            _ = drain.cancelled() => return false,
        }
    }
}

/// Serves `pool` under `leadership` until `drain`, a lost lease, a handover or an
/// unusable interface; whether the lease is to be released after.
async fn serve_term(
    server: &Server,
    pool: &str,
    le: &LeaderElection,
    leadership: &Leadership,
    drain: &CancellationToken,
) -> bool {
    let lbs = &server.lbs;
    // The addresses' kernel lifetime: what is left of the lease after the renew
    // deadline, so that a holder that hangs loses them before a standby can hold
    // the lease; refreshed every retry period while we hold it.
    let lifetime = le
        .lease_duration
        .saturating_sub(le.renew_deadline)
        .max(Duration::from_secs(1));
    lbs.resume_pool(pool).await;
    let _ = lbs.refresh_pool(pool, lifetime).await;
    server.queue_all();
    let unusable = async {
        loop {
            tokio::time::sleep(le.retry_period).await;
            if let Err(why) = lbs.ready().await {
                return why;
            }
            // The addresses may outlive a refresh by `lifetime`: only while that
            // still ends before the lease could run out elsewhere (the last
            // renewal's start plus the lease duration).
            if leadership.since_renewal() + REFRESH_MARGIN >= le.renew_deadline {
                return "the pool's lease was not renewed in time".to_string();
            }
            if let Err(why) = lbs.refresh_pool(pool, lifetime).await {
                return why;
            }
        }
    };
    let mut unusable = std::pin::pin!(unusable);
    tokio::select! {
        _ = drain.cancelled() => {}
        _ = leadership.lost.cancelled() => return false,
        _ = leadership.handover.cancelled() => {}
        why = &mut unusable => {
            tracing::warn!(reason = %why, "giving up the pool's lease");
            return true;
        }
    }
    // Let go on purpose (the drain, a handover): between two requests, so that none is
    // cut halfway (a client whose SYN comes as the address moves sends it again a
    // second later, to the standby). Held and refreshed meanwhile.
    tokio::select! {
        quiet = lbs.until_pool_quiet(pool, POOL_QUIET) => {
            tracing::info!(quiet, "letting go of the pool");
            true
        }
        _ = leadership.lost.cancelled() => false,
        why = &mut unusable => {
            tracing::warn!(reason = %why, "giving up the pool's lease");
            true
        }
    }
}

/// Serves each Service on the addresses of the pools held here.
struct Server {
    lbs: Arc<TunnelLoadBalancers>,
    nodes: Store<Node>,
    services: Store<Service>,
    endpoints: EndpointsCache,
    queue: Arc<WorkQueue>,
    class: Option<String>,
    /// What was served, by Service key (to stop serving one that is gone).
    served: Mutex<HashMap<String, ServiceInfo>>,
    /// The allocation record, when one is kept.
    record: Option<watch::Receiver<Known>>,
    /// Services whose status showed addresses the record does not give them, by UID:
    /// since when, and those addresses.
    unbacked: Mutex<HashMap<String, (Instant, Vec<IpAddr>)>>,
    /// For the Warning event about such a status.
    events: crate::controllers::Context,
}

impl Server {
    fn served(&self) -> std::sync::MutexGuard<'_, HashMap<String, ServiceInfo>> {
        self.served.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn unbacked(&self) -> std::sync::MutexGuard<'_, HashMap<String, (Instant, Vec<IpAddr>)>> {
        self.unbacked.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What of `info` (its status: `status`) the allocation record lets this replica
    /// serve: the addresses and TCP ports it records for the Service, and when to look
    /// again. An address the record does not give the Service is not served; it is
    /// remembered, and [`CONFIRM`] later (the leader writes the record before the
    /// status, but this replica's watches may bring the status first), if the record
    /// still does not give it, a Warning event says that someone other than the CCM
    /// wrote that status (the leader will have written the Service's own back by then).
    async fn admitted(
        &self,
        mut info: ServiceInfo,
        status: Vec<IpAddr>,
    ) -> (ServiceInfo, Vec<IpAddr>, Option<Duration>) {
        let Some(record) = &self.record else {
            return (info, status, None);
        };
        let known = record.borrow().clone();
        let admitted = super::record::admit(&known, &info.uid, &status);
        if let Some(ports) = &admitted.ports {
            info.ports
                .retain(|p| p.protocol != "TCP" || ports.contains(&p.port));
        }
        if matches!(known, Known::Unreadable) {
            return (info, admitted.addresses, None);
        }
        let (since, shown) = {
            let mut unbacked = self.unbacked();
            if !admitted.refused.is_empty() {
                // Entries of Services deleted within the wait go with age.
                unbacked.retain(|_, (since, _)| since.elapsed() < CONFIRM * 10);
                let (_, shown) = unbacked
                    .entry(info.uid.clone())
                    .or_insert_with(|| (Instant::now(), Vec::new()));
                for ip in &admitted.refused {
                    if !shown.contains(ip) {
                        shown.push(*ip);
                    }
                }
            }
            let Some((since, shown)) = unbacked.remove(&info.uid) else {
                return (info, admitted.addresses, None);
            };
            if since.elapsed() < CONFIRM {
                let after = CONFIRM - since.elapsed();
                unbacked.insert(info.uid.clone(), (since, shown));
                return (info, admitted.addresses, Some(after));
            }
            (since, shown)
        };
        let forged = super::record::admit(&known, &info.uid, &shown).refused;
        if !forged.is_empty() {
            self.say_unallocated(&info, &forged, since).await;
        }
        (info, admitted.addresses, None)
    }

    /// Warns (log and event) that `info`'s status showed `forged`, which the allocation
    /// record does not give it, `since` then.
    async fn say_unallocated(&self, info: &ServiceInfo, forged: &[IpAddr], since: Instant) {
        let shown = forged
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let service = format!("{}/{}", info.namespace, info.name);
        tracing::warn!(%service, addresses = %shown, "a Service's status showed load-balancer addresses the allocation record does not give it: not served there");
        let target = crate::controllers::Target::service(
            Some(info.namespace.clone()),
            info.name.clone(),
            Some(info.uid.clone()),
        );
        let record = self
            .lbs
            .allocations()
            .record_at()
            .map(|r| format!("{}/{}", r.namespace, r.name))
            .unwrap_or_default();
        let note = format!(
            "status.loadBalancer showed {shown} ({:.0} s ago), which the CCM did not allocate to this Service (its allocation record, ConfigMap {record}): not served there. Someone other than the CCM wrote that status.",
            since.elapsed().as_secs_f64()
        );
        self.events
            .event(&target, true, super::record::UNALLOCATED, "Serve", note)
            .await;
    }

    /// Queues every LoadBalancer Service (a pool was taken, the node set changed).
    fn queue_all(&self) {
        for svc in self.services.state() {
            if is_ours(&svc, self.class.as_deref()) {
                self.queue.add(&crate::informer::key(svc.as_ref()));
            }
        }
        for key in self.served().keys() {
            self.queue.add(key);
        }
    }

    async fn sync(&self, key: &str) -> Outcome {
        let (ns, name) = key.split_once('/').unwrap_or(("default", key));
        let svc = self.services.get(&ObjectRef::new(name).within(ns));
        let wanted = svc.as_ref().filter(|s| {
            is_ours(s, self.class.as_deref()) && s.metadata.deletion_timestamp.is_none()
        });
        let Some(svc) = wanted else {
            if let Some(svc) = &svc {
                self.unbacked()
                    .remove(svc.metadata.uid.as_deref().unwrap_or_default());
            }
            let gone = self.served().remove(key);
            if let Some(info) = gone {
                self.unbacked().remove(&info.uid);
                self.lbs.unserve(&info).await;
            }
            return Outcome::Done;
        };
        let info = service_info(svc, &self.endpoints);
        // Made again under the same name: the old one's balancer goes first.
        let old = self
            .served()
            .get(key)
            .filter(|o| o.uid != info.uid)
            .cloned();
        if let Some(old) = old {
            self.served().remove(key);
            self.lbs.unserve(&old).await;
        }
        let status: Vec<IpAddr> = self.lbs.allocations().published(&info);
        let (info, addresses, recheck) = self.admitted(info, status).await;
        let nodes = backends_for(&self.nodes, &self.endpoints, svc);
        match self.lbs.serve(&info, &nodes, &addresses).await {
            Ok(()) => {
                self.served().insert(key.to_string(), info);
                if let Some(after) = recheck {
                    // Not a retry: a retry's wait holds even when the record arrives
                    // meanwhile, and the Service must be served as soon as it does.
                    let (queue, key) = (self.queue.clone(), key.to_string());
                    tokio::spawn(async move {
                        tokio::time::sleep(after).await;
                        queue.add(&key);
                    });
                }
                Outcome::Done
            }
            Err(e) => {
                tracing::warn!(service = %key, error = %chain(&e), "cannot serve the load balancer; retrying");
                Outcome::Retry(None)
            }
        }
    }
}

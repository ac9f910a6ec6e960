//! The load balancers' data plane, the `tether` provider's, which every replica runs:
//! the replica holding a pool's Lease (see [`super::pools`] and [`super::announce`])
//! serves the Services whose addresses are in that pool (as [`super::allocation`]
//! gave them). For each address and TCP port the CCM listens (`port`: admission, the
//! next backend, the PROXY header, the splice), and forwards every connection through
//! the Tether server's gRPC frontend to a backend node's NodePort, or with
//! `allocateLoadBalancerNodePorts: false` to a ready endpoint's pod IP and targetPort.
//! So Services in NAT-ed clusters are reachable with no cloud at all and no L2
//! adjacency to the nodes. Konnectivity dials TCP only: other ports are left out (the
//! service controller says so in an event). A changed Service rebinds only the
//! listeners that changed; connections on the others carry on.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use tether_core::error::chain;

use tether_client::Client;
use tokio::net::TcpListener;

use super::addresses::Pools;
use super::allocation::Allocations;
use super::announce::Announcer;
use super::port::{label, Listener, PortTarget, Shared};
use crate::cloud::{Backend, CloudError, ServiceInfo, ServicePort};

/// Where the balancers get their addresses and how they reach the nodes.
#[derive(Debug, Clone)]
pub struct TunnelLbConfig {
    /// `--lb-bind-address`: without pools, every Service listens here (its ingress IP).
    pub bind: Option<IpAddr>,
    /// The Tether server's gRPC frontend socket (`--tunnel-uds`).
    pub tunnel_uds: PathBuf,
    /// `--lb-max-connections`: open connections over every Service at once (each
    /// Service also has its own limit, `tether.dev/lb-max-connections`).
    pub max_connections: usize,
    /// The controller manager's metrics (the balancers' series).
    pub metrics: crate::metrics::Metrics,
    /// Where the allocation record lives (`None`: no record; allocations are read back
    /// from the Services' status, and every status is served).
    pub record: Option<super::record::RecordRef>,
}

/// Default of [`TunnelLbConfig::max_connections`]. With a client that stops reading, a
/// connection holds at most about 896 KiB: 128 KiB read from the client, a 128 KiB
/// chunk being written to it, 384 KiB received and unread (the tunnel client's
/// read-ahead and one more packet) and 256 KiB its stream window lets the server send:
/// 1024 of them fit the 1 GiB memory limit in deploy/tether-ccm.yaml.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// How long a pool let go waits for the connections it cut to end before its
/// addresses go.
const CUT_CLOSE: std::time::Duration = std::time::Duration::from_millis(500);

/// Waits, at most `limit`, until no connection is open through `services` (polled
/// every 10 ms); true when none is.
async fn until_none_open(services: &[Shared], limit: std::time::Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if services.iter().all(|s| s.open() == 0) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// How long connecting to the Tether server's socket may take.
const TUNNEL_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

struct Balancer {
    /// The addresses served here, each with the pool it was served under (what is let
    /// go with that pool, whatever the cloud config says of the pool now).
    addresses: Vec<(IpAddr, String)>,
    /// Listeners by (address, port).
    listeners: HashMap<SocketAddr, Listener>,
    shared: Shared,
}

/// What [`TunnelLoadBalancers::release_pool`] took out of the map for one pool.
struct Unserved {
    /// The addresses served under the pool.
    recorded: std::collections::HashSet<IpAddr>,
    /// Services left with no listener (their tunnel connections go).
    idle: Vec<String>,
    /// The pool's listeners, stopped, open until the addresses are gone.
    closing: Vec<Listener>,
}

/// A Service's entry taken out to rework while its listeners are bound.
struct Claim {
    shared: Shared,
    /// Its listeners before.
    keep: HashMap<SocketAddr, Listener>,
    /// Its addresses before.
    before: Vec<(IpAddr, String)>,
}

/// The balancers' tunnel windows. The frontend socket is local (microseconds away), so
/// 256 KiB in flight per connection moves gigabytes a second; and it takes 64 readers
/// that stop reading before their Service's 16 MiB connection window is full and its
/// other connections stall too (other Services have connections of their own). It is
/// also what one Service's stalled readers can hold in the CCM: 16 MiB at most. The
/// other way, the server's frontend window (1 MiB per stream, 16 MiB per connection)
/// takes 16 uploads to backends that stopped reading before the Service stalls.
const LB_WINDOWS: tether_client::Windows = tether_client::Windows {
    stream: 256 << 10,
    connection: 16 << 20,
};

/// The balancers, by Service UID.
pub struct TunnelLoadBalancers {
    tunnel_uds: PathBuf,
    /// One tunnel connection (HTTP/2) per Service, by UID: readers that stop on one
    /// Service pin at most that connection's window, never another Service's traffic.
    clients: tokio::sync::Mutex<HashMap<String, Client>>,
    /// Who holds which address (the service controller's side, on the leader); here
    /// for the pools and the record.
    allocations: Arc<Allocations>,
    announcer: Option<Announcer>,
    balancers: Mutex<HashMap<String, Balancer>>,
    /// Connections open over every Service, and `--lb-max-connections`.
    open: Arc<AtomicUsize>,
    max_connections: usize,
    /// Services with a connection open.
    busy: Arc<AtomicUsize>,
    /// The controller manager's metrics.
    metrics: crate::metrics::Metrics,
    /// The pools this replica serves now (their leases held).
    serving: tokio::sync::RwLock<std::collections::HashSet<String>>,
}

impl std::fmt::Debug for TunnelLoadBalancers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelLoadBalancers")
            .field("tunnel_uds", &self.tunnel_uds)
            .field("allocations", &self.allocations)
            .finish_non_exhaustive()
    }
}

impl TunnelLoadBalancers {
    /// Balancers with addresses from `pools`, else `cfg.bind` (the tunnel is connected
    /// on first use).
    pub fn new(cfg: TunnelLbConfig, pools: Option<Pools>) -> Result<Self, String> {
        let interface = pools.as_ref().and_then(|p| p.interface.clone());
        let allocations = Allocations::new(pools, cfg.bind, cfg.metrics.clone(), cfg.record)?;
        let announcer = match interface {
            Some(i) => Some(Announcer::new(&i)?),
            None => None,
        };
        Ok(TunnelLoadBalancers {
            tunnel_uds: cfg.tunnel_uds,
            clients: tokio::sync::Mutex::new(HashMap::new()),
            allocations: Arc::new(allocations),
            announcer,
            balancers: Mutex::new(HashMap::new()),
            open: Arc::new(AtomicUsize::new(0)),
            max_connections: cfg.max_connections,
            busy: Arc::new(AtomicUsize::new(0)),
            serving: Default::default(),
            metrics: cfg.metrics,
        })
    }

    /// The allocation side: the service controller's load balancers (the provider's
    /// [`LoadBalancers`](crate::cloud::LoadBalancers)).
    pub fn allocations(&self) -> &Arc<Allocations> {
        &self.allocations
    }

    /// The controller manager's metrics these balancers count in.
    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.metrics
    }

    /// Whether the addresses are held and announced here (`loadBalancer.interface`).
    pub fn announces(&self) -> bool {
        self.announcer.is_some()
    }

    /// The tunnel connection of Service `uid`, made on first use. Each Service has its
    /// own, with [`LB_WINDOWS`]: HTTP/2 flow control is per stream and per connection,
    /// and with the default windows four stalled downloads (1 MiB each) fill a 4 MiB
    /// connection window and stop every other stream on it, other Services' included.
    async fn client(&self, uid: &str) -> Result<Client, CloudError> {
        if let Some(c) = self.clients.lock().await.get(uid) {
            return Ok(c.clone());
        }
        let connect = Client::uds_with_windows(&self.tunnel_uds, LB_WINDOWS);
        let client = match tokio::time::timeout(TUNNEL_CONNECT_TIMEOUT, connect).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                return Err(CloudError::Provider(format!(
                    "cannot reach the Tether server at {}: {}",
                    self.tunnel_uds.display(),
                    chain(&e)
                )))
            }
            Err(_) => {
                return Err(CloudError::Provider(format!(
                    "the Tether server at {} did not answer within {TUNNEL_CONNECT_TIMEOUT:?}",
                    self.tunnel_uds.display()
                )))
            }
        };
        // (Not connected under the lock: one slow connection holds up no other.)
        Ok(self
            .clients
            .lock()
            .await
            .entry(uid.to_string())
            .or_insert(client)
            .clone())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Balancer>> {
        self.balancers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holds (adds and announces) each of `mine`, in order; the first failure.
    async fn hold_all(&self, mine: &[(IpAddr, String)]) -> Result<(), CloudError> {
        if let Some(a) = &self.announcer {
            for (ip, pool) in mine {
                a.hold(*ip, pool).await?;
            }
        }
        Ok(())
    }

    /// Lets go of addresses no Service served here has any more (logged: the next
    /// sync retries).
    async fn let_go(&self, freed: Vec<IpAddr>) {
        let freed: Vec<IpAddr> = {
            let all = self.lock();
            freed
                .into_iter()
                .filter(|ip| {
                    !all.values()
                        .any(|b| b.addresses.iter().any(|(a, _)| a == ip))
                })
                .collect()
        };
        if let Some(a) = &self.announcer {
            for ip in freed {
                if let Err(e) = a.release(ip).await {
                    tracing::warn!(%ip, error = %chain(&e), "cannot remove a load-balancer address");
                }
            }
        }
    }
}

/// Drops a deleted Service's per-Service series, so that a cluster whose Services come
/// and go does not grow its scrape forever.
fn forget_series(m: &crate::metrics::Metrics, service: &str) {
    let _ = m.lb_active.remove_label_values(&[service]);
    let _ = m.lb_backends.remove_label_values(&[service]);
    for result in [
        "accepted",
        "refused_source_range",
        "refused_limit",
        "refused_global_limit",
        "no_backend",
    ] {
        let _ = m.lb_connections.remove_label_values(&[service, result]);
    }
    for direction in ["to_backend", "to_client"] {
        let _ = m.lb_bytes.remove_label_values(&[service, direction]);
    }
}

/// The serving side: each replica serves the addresses of the pools whose leases it
/// holds, for every Service whose status shows one of them.
impl TunnelLoadBalancers {
    /// Whether this replica can hold addresses now: its interface exists, is up and has
    /// carrier. One that cannot does not stand for the pools' leases, and gives them up
    /// when this starts failing.
    pub async fn ready(&self) -> Result<(), String> {
        match &self.announcer {
            Some(a) => a.ready().await,
            None => Ok(()),
        }
    }

    /// A new term as `pool`'s holder: its addresses are served from now on.
    pub async fn resume_pool(&self, pool: &str) {
        if let Some(a) = &self.announcer {
            a.resume(pool).await;
        }
        self.serving.write().await.insert(pool.to_string());
    }

    /// `pool`'s holder, every retry period: its addresses stay valid for `lifetime`
    /// more (their kernel lifetime), so that a holder that hangs while alive lets go
    /// by itself. An error: this replica must let go.
    pub async fn refresh_pool(
        &self,
        pool: &str,
        lifetime: std::time::Duration,
    ) -> Result<(), String> {
        match &self.announcer {
            Some(a) => a
                .refresh(pool, lifetime)
                .await
                .map_err(|e| chain(&e).to_string()),
            None => Ok(()),
        }
    }

    /// The Services served on `pool`'s addresses here (their shared state).
    fn served_on(&self, pool: &str) -> Vec<Shared> {
        self.lock()
            .values()
            .filter(|b| b.addresses.iter().any(|(_, p)| p == pool))
            .map(|b| b.shared.clone())
            .collect()
    }

    /// Waits, at most `limit`, for a moment when no connection is open through
    /// `pool`'s addresses (polled every 10 ms): a holder letting go of a pool on
    /// purpose (its drain, a handover) does it between two requests, so that none is
    /// cut halfway. A Service served on other pools too counts them in. True when
    /// quiet.
    pub async fn until_pool_quiet(&self, pool: &str, limit: std::time::Duration) -> bool {
        until_none_open(&self.served_on(pool), limit).await
    }

    /// Lets go of `pool`: its listeners stop (with their connections) and its
    /// addresses go, and none is served again until [`Self::resume_pool`]. Serves in
    /// flight finish first, and later ones skip the pool, so none puts one back. The
    /// connections cut end (their clients told) before the addresses go, for at most
    /// [`CUT_CLOSE`].
    pub async fn release_pool(&self, pool: &str) {
        let mut serving = self.serving.write().await;
        serving.remove(pool);
        let services = self.served_on(pool);
        let Unserved {
            recorded,
            idle,
            closing,
        } = self.unserve_pool(pool);
        let in_pool = {
            let pools = self.allocations.allocator().pools().clone();
            let name = pool.to_string();
            move |ip: IpAddr| recorded.contains(&ip) || pools.pool_of(ip) == Some(name.as_str())
        };
        // Tunnel connections close once their listeners' connections drop them.
        {
            let mut clients = self.clients.lock().await;
            for uid in &idle {
                clients.remove(uid);
            }
        }
        // No serve puts the pool's addresses back from here on (the pool is not served
        // any more): the other pools' serves go on meanwhile.
        drop(serving);
        // A connection's reset sent once its address is gone would never reach its
        // client, which would wait for an answer until it gave up.
        until_none_open(&services, CUT_CLOSE).await;
        if let Some(a) = &self.announcer {
            match a.release_pool(pool, &in_pool).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    pool,
                    addresses = n,
                    interface = a.interface(),
                    "load-balancer addresses let go"
                ),
                Err(e) => {
                    tracing::warn!(pool, error = %chain(&e), "cannot remove load-balancer addresses")
                }
            }
        }
        drop(closing);
    }

    /// Takes `pool`'s addresses and listeners out of the map: the listeners closed
    /// quietly and stopped, but kept open (in [`Unserved::closing`]) until their
    /// addresses are gone, so that meanwhile a SYN is dropped (and sent again, to the
    /// next holder), never reset.
    fn unserve_pool(&self, pool: &str) -> Unserved {
        let mut out = Unserved {
            recorded: Default::default(),
            idle: Vec::new(),
            closing: Vec::new(),
        };
        for (uid, b) in self.lock().iter_mut() {
            let gone: Vec<IpAddr> = b
                .addresses
                .iter()
                .filter(|(_, p)| p == pool)
                .map(|(ip, _)| *ip)
                .collect();
            let (going, kept) = std::mem::take(&mut b.listeners)
                .into_iter()
                .partition(|(addr, _)| gone.contains(&addr.ip()));
            b.listeners = kept;
            for (_, l) in going {
                let quiet = l.close_quietly();
                l.stop();
                if quiet {
                    out.closing.push(l);
                }
            }
            b.addresses.retain(|(_, p)| p != pool);
            if b.listeners.is_empty() {
                out.idle.push(uid.clone());
            }
            out.recorded.extend(gone);
        }
        out
    }

    /// Serves `svc` over `nodes` on those of `addresses` (its status) whose pools this
    /// replica holds, and on no other: listeners as its TCP ports ask, the addresses
    /// held and announced. Listeners kept pick up a changed target in place.
    pub async fn serve(
        &self,
        svc: &ServiceInfo,
        nodes: &[Backend],
        addresses: &[IpAddr],
    ) -> Result<(), CloudError> {
        if self
            .held_of(addresses, &*self.serving.read().await)
            .is_empty()
        {
            self.unserve(svc).await;
            return Ok(());
        }
        let tcp = tcp_ports(svc)?;
        // The tunnel connection before the pools are fenced: a Tether server slow to
        // answer must not hold up a pool's release.
        let client = self.client(&svc.uid).await?;
        let serving = self.serving.read().await;
        let mine = self.held_of(addresses, &serving);
        if mine.is_empty() {
            drop(serving);
            self.unserve(svc).await;
            return Ok(());
        }
        let before = self.take_up(svc, nodes, &client, &tcp, &mine).await?;
        drop(serving);
        // Addresses this Service moved off, if no other Service served here has them.
        let gone: Vec<IpAddr> = before
            .into_iter()
            .map(|(ip, _)| ip)
            .filter(|ip| !mine.iter().any(|(m, _)| m == ip))
            .collect();
        self.let_go(gone).await;
        Ok(())
    }

    /// Serves `svc` on `mine` (addresses with their pools): claims them, holds them and
    /// binds the listeners its `tcp` ports ask for. Returns the addresses it was served
    /// on before; on failure, what was serving before serves on.
    async fn take_up(
        &self,
        svc: &ServiceInfo,
        nodes: &[Backend],
        client: &Client,
        tcp: &[&ServicePort],
        mine: &[(IpAddr, String)],
    ) -> Result<Vec<(IpAddr, String)>, CloudError> {
        let mut claim = self.claim(svc, nodes, mine);
        let wanted: Vec<(SocketAddr, PortTarget)> = mine
            .iter()
            .flat_map(|(ip, _)| {
                tcp.iter()
                    .map(move |p| (SocketAddr::new(*ip, p.port), PortTarget::of(svc, p)))
            })
            .collect();
        // The new listeners before the addresses (they bind with IP_FREEBIND): an
        // address that is there answers, never resets a SYN for want of a listener (a
        // new holder's first requests as a pool moves). What was serving changes only
        // once every address is held.
        let ready = match self
            .bind_new(svc, client, &claim.shared, &claim.keep, &wanted)
            .await
        {
            Ok(fresh) => match self.hold_all(mine).await {
                Ok(()) => Ok(fresh),
                Err(e) => {
                    fresh.iter().for_each(|(_, l)| l.stop());
                    Err(e)
                }
            },
            Err(e) => Err(e),
        };
        let fresh = match ready {
            Ok(fresh) => fresh,
            Err(e) => return Err(self.roll_back(svc, claim, mine, e).await),
        };
        Self::commit(svc, &claim.shared, &mut claim.keep, fresh, &wanted);
        self.lock().insert(
            svc.uid.clone(),
            Balancer {
                addresses: mine.to_vec(),
                listeners: claim.keep,
                shared: claim.shared,
            },
        );
        Ok(claim.before)
    }

    /// After a failed [`Self::take_up`]: what was serving before serves on (its
    /// listeners and addresses back in the map), and the addresses this try added go
    /// again unless another Service has them; returns `e`.
    async fn roll_back(
        &self,
        svc: &ServiceInfo,
        claim: Claim,
        mine: &[(IpAddr, String)],
        e: CloudError,
    ) -> CloudError {
        let before = claim.before;
        let added: Vec<IpAddr> = mine
            .iter()
            .filter(|m| !before.contains(m))
            .map(|(ip, _)| *ip)
            .collect();
        if let Some(b) = self.lock().get_mut(&svc.uid) {
            b.listeners = claim.keep;
            b.addresses = before;
        }
        self.let_go(added).await;
        e
    }

    /// Those of `addresses` whose pools are in `serving`, with their pools.
    fn held_of(
        &self,
        addresses: &[IpAddr],
        serving: &std::collections::HashSet<String>,
    ) -> Vec<(IpAddr, String)> {
        addresses
            .iter()
            .filter_map(|ip| self.allocations.pool_of(*ip).map(|p| (*ip, p)))
            .filter(|(_, p)| serving.contains(p))
            .collect()
    }

    /// Claims `mine` for `svc` in the map while its listeners are bound, and takes
    /// its listeners out to rework: the entry stays, claiming old and new addresses,
    /// so a Service sharing an address that lets go meanwhile sees the claim and
    /// leaves the address.
    fn claim(&self, svc: &ServiceInfo, nodes: &[Backend], mine: &[(IpAddr, String)]) -> Claim {
        let mut all = self.lock();
        if let Some(b) = all.get_mut(&svc.uid) {
            b.shared.update(svc, nodes);
            let before = b.addresses.clone();
            for m in mine {
                if !b.addresses.contains(m) {
                    b.addresses.push(m.clone());
                }
            }
            return Claim {
                shared: b.shared.clone(),
                keep: std::mem::take(&mut b.listeners),
                before,
            };
        }
        let shared = Shared::new(
            &self.metrics,
            svc,
            nodes,
            self.open.clone(),
            self.max_connections,
            self.busy.clone(),
        );
        all.insert(
            svc.uid.clone(),
            Balancer {
                addresses: mine.to_vec(),
                listeners: HashMap::new(),
                shared: shared.clone(),
            },
        );
        Claim {
            shared,
            keep: HashMap::new(),
            before: Vec::new(),
        }
    }

    /// Binds and starts the listeners `wanted` asks for that `listeners` has not; on a
    /// failed bind those bound already stop, and nothing else changed.
    async fn bind_new(
        &self,
        svc: &ServiceInfo,
        client: &Client,
        shared: &Shared,
        listeners: &HashMap<SocketAddr, Listener>,
        wanted: &[(SocketAddr, PortTarget)],
    ) -> Result<Vec<(SocketAddr, Listener)>, CloudError> {
        let mut fresh: Vec<(SocketAddr, Listener)> = Vec::new();
        for (addr, target) in wanted.iter().filter(|(a, _)| !listeners.contains_key(a)) {
            let bound = match &self.announcer {
                Some(a) => a.listen(*addr).await,
                None => TcpListener::bind(addr).await,
            };
            let listener = match bound {
                Ok(l) => l,
                Err(e) => {
                    fresh.iter().for_each(|(_, l)| l.stop());
                    return Err(CloudError::Provider(format!(
                        "cannot listen on {addr} for {}: {}",
                        label(svc),
                        chain(&e)
                    )));
                }
            };
            let span = tracing::info_span!("load_balancer", service = %label(svc), %addr);
            let l = Listener::start(
                listener,
                client.clone(),
                shared.clone(),
                target.clone(),
                span,
            );
            fresh.push((*addr, l));
        }
        Ok(fresh)
    }

    /// Makes `listeners` the `wanted` ones once all is in place: those kept pick up a
    /// new target in place, `fresh` ones join, those no longer wanted stop (with their
    /// connections).
    fn commit(
        svc: &ServiceInfo,
        shared: &Shared,
        listeners: &mut HashMap<SocketAddr, Listener>,
        fresh: Vec<(SocketAddr, Listener)>,
        wanted: &[(SocketAddr, PortTarget)],
    ) {
        for (addr, target) in wanted {
            if let Some(l) = listeners.get(addr) {
                l.retarget(target);
            }
        }
        listeners.retain(|addr, l| {
            let wanted = wanted.iter().any(|(a, _)| a == addr);
            if !wanted {
                l.stop();
            }
            wanted
        });
        if !fresh.is_empty() {
            let added: Vec<SocketAddr> = fresh.iter().map(|(a, _)| *a).collect();
            tracing::info!(service = %label(svc), listeners = ?added, nodes = shared.node_count(), "load balancer listening");
        }
        listeners.extend(fresh);
    }

    /// Stops serving `svc` here: its listeners stop (with their connections), its
    /// series go, and its addresses, unless another Service served here has them.
    pub async fn unserve(&self, svc: &ServiceInfo) {
        self.clients.lock().await.remove(&svc.uid);
        let removed = self.lock().remove(&svc.uid);
        let Some(b) = removed else { return };
        for l in b.listeners.into_values() {
            l.stop();
        }
        tracing::info!(service = %label(svc), "load balancer no longer served here");
        forget_series(&self.metrics, &label(svc));
        self.let_go(b.addresses.into_iter().map(|(ip, _)| ip).collect())
            .await;
    }
}

/// The TCP ports of `svc` (the only ones served); an error while a NodePort Service
/// lacks a nodePort for one.
fn tcp_ports(svc: &ServiceInfo) -> Result<Vec<&ServicePort>, CloudError> {
    let tcp: Vec<&ServicePort> = svc.ports.iter().filter(|p| p.protocol == "TCP").collect();
    if svc.node_ports {
        if let Some(p) = tcp.iter().find(|p| p.node_port == 0) {
            return Err(CloudError::Provider(format!(
                "port {} has no nodePort yet",
                p.port
            )));
        }
    }
    Ok(tcp)
}

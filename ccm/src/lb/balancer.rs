//! Load balancers over the tunnel, the `tether` provider's LoadBalancers: each
//! LoadBalancer Service gets its own addresses from the `loadBalancer:` pools (see
//! [`super::addresses`]; without pools, every Service shares `--lb-bind-address`
//! and colliding ports are refused), held by the replica holding each pool's Lease
//! (see [`super::pools`] and [`super::announce`]). For each address and TCP port the CCM listens, and forwards
//! every connection through the Tether server's gRPC frontend to a backend node's
//! NodePort (round-robin, the next node when a dial fails), or with
//! `allocateLoadBalancerNodePorts: false` to a ready endpoint's pod IP and targetPort.
//! So Services in NAT-ed clusters are reachable with no cloud at all and no L2
//! adjacency to the nodes. Konnectivity dials TCP only: other ports are left out (the
//! service controller says so in an event). A changed Service rebinds only the
//! listeners that changed; connections on the others carry on. An optional PROXY
//! protocol header tells backends the client's address.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use tether_core::error::chain;

use async_trait::async_trait;
use tether_client::Client;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::addresses::{Allocator, Family, Pools, Refusal, Request};
use super::announce::Announcer;
use crate::cloud::{
    Backend, CloudError, LoadBalancerStatus, LoadBalancers, ProxyProtocol, ServiceInfo, ServicePort,
};

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
}

/// Default of [`TunnelLbConfig::max_connections`]. With a client that stops reading, a
/// connection holds at most about 896 KiB: 128 KiB read from the client, a 128 KiB
/// chunk being written to it, 384 KiB received and unread (the tunnel client's
/// read-ahead and one more packet) and 256 KiB its stream window lets the server send:
/// 1024 of them fit the 1 GiB memory limit in deploy/tether-ccm.yaml.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// How long connecting to the Tether server's socket may take.
const TUNNEL_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The implicit sharing key of Services sharing `--lb-bind-address`.
const BIND_ADDRESS_SHARING: &str = "--lb-bind-address";
/// The pool `--lb-bind-address` makes (its Lease: `<lease>-lb-bind-address`).
const BIND_ADDRESS_POOL: &str = "bind-address";

/// Where one port's connections go (changed in place).
#[derive(Debug, Clone, PartialEq, Eq)]
enum PortTarget {
    /// The backend nodes' NodePort.
    NodePort(u16),
    /// Ready endpoints (pod IP, targetPort).
    Endpoints(Vec<SocketAddr>),
}

impl PortTarget {
    fn of(svc: &ServiceInfo, port: &ServicePort) -> PortTarget {
        if svc.node_ports {
            PortTarget::NodePort(port.node_port)
        } else {
            PortTarget::Endpoints(port.endpoints.clone())
        }
    }
}

/// One listener: where it forwards (changed in place) and its stop token.
struct Listener {
    target: Arc<RwLock<PortTarget>>,
    stop: CancellationToken,
}

/// Who may connect and for how long, from the Service (changed in place on updates):
/// everyone, or clients inside the ranges (none when every range the Service gave was
/// invalid); at most `max_connections` at once; closed after `idle_timeout` idle.
#[derive(Debug, Clone)]
struct Policy {
    restricted: bool,
    ranges: Vec<tether_core::identifiers::Cidr>,
    max_connections: usize,
    idle_timeout: std::time::Duration,
    proxy_protocol: Option<ProxyProtocol>,
}

impl Policy {
    fn of(svc: &ServiceInfo) -> Self {
        Policy {
            restricted: !svc.source_ranges.is_empty() || !svc.invalid_source_ranges.is_empty(),
            ranges: svc.source_ranges.clone(),
            max_connections: svc.max_connections,
            idle_timeout: svc.idle_timeout,
            proxy_protocol: svc.proxy_protocol,
        }
    }

    fn admits(&self, ip: IpAddr) -> bool {
        !self.restricted
            || self
                .ranges
                .iter()
                .any(|r| r.contains(super::proxy_protocol::unmapped(ip)))
    }
}

/// What every listener of one Service shares (changed in place on updates).
#[derive(Clone)]
struct Shared {
    nodes: Arc<RwLock<Vec<Backend>>>,
    policy: Arc<RwLock<Policy>>,
    /// Connections open now, every port (`tether_ccm_lb_active_connections{service}`).
    active: prometheus::IntGauge,
    /// Connections open now over every Service, and their cap.
    all: Arc<AtomicUsize>,
    max_all: usize,
    /// Services with a connection open now (for the fair share).
    busy: Arc<AtomicUsize>,
    /// This Service's open connections (what its limit, its share and `busy` count).
    mine: Arc<AtomicUsize>,
    /// Its counters, looked up once rather than on every connection.
    counters: Arc<Counters>,
}

/// One Service's series of `tether_ccm_lb_connections_total` (by result) and
/// `tether_ccm_lb_bytes_total` (by direction).
struct Counters {
    accepted: prometheus::IntCounter,
    refused_source_range: prometheus::IntCounter,
    refused_limit: prometheus::IntCounter,
    refused_global_limit: prometheus::IntCounter,
    no_backend: prometheus::IntCounter,
    to_backend: prometheus::IntCounter,
    to_client: prometheus::IntCounter,
}

impl Counters {
    fn of(service: &str) -> Counters {
        let m = crate::metrics::get();
        let c = |result: &str| m.lb_connections.with_label_values(&[service, result]);
        let b = |direction: &str| m.lb_bytes.with_label_values(&[service, direction]);
        Counters {
            accepted: c("accepted"),
            refused_source_range: c("refused_source_range"),
            refused_limit: c("refused_limit"),
            refused_global_limit: c("refused_global_limit"),
            no_backend: c("no_backend"),
            to_backend: b("to_backend"),
            to_client: b("to_client"),
        }
    }
}

struct Balancer {
    /// The addresses served here, each with the pool it was served under (what is let
    /// go with that pool, whatever the cloud config says of the pool now).
    addresses: Vec<(IpAddr, String)>,
    /// Listeners by (address, port).
    listeners: HashMap<SocketAddr, Listener>,
    shared: Shared,
}

/// The balancers' tunnel windows. The frontend socket is local (microseconds away), so
/// 256 KiB in flight per connection moves gigabytes a second; and it takes 64 readers
/// that stop reading before their Service's 16 MiB connection window is full and its
/// other connections stall too (other Services have connections of their own). It is
/// also what one Service's stalled readers can hold in the CCM: 16 MiB at most.
const LB_WINDOWS: tether_client::Windows = tether_client::Windows {
    stream: 256 << 10,
    connection: 16 << 20,
};

/// Reads the pools as they are now (the provider's configuration, re-read when it
/// changes); `None` when they cannot be read.
pub type PoolSource = Arc<dyn Fn() -> Option<Pools> + Send + Sync>;

/// The balancers, by Service UID.
pub struct TunnelLoadBalancers {
    tunnel_uds: PathBuf,
    /// One tunnel connection (HTTP/2) per Service, by UID: readers that stop on one
    /// Service pin at most that connection's window, never another Service's traffic.
    clients: tokio::sync::Mutex<HashMap<String, Client>>,
    allocator: Mutex<Allocator>,
    /// Without pools: the one address every Service shares.
    bind: Option<IpAddr>,
    announcer: Option<Announcer>,
    balancers: Mutex<HashMap<String, Balancer>>,
    /// Connections open over every Service, and `--lb-max-connections`.
    open: Arc<AtomicUsize>,
    max_connections: usize,
    /// Services with a connection open.
    busy: Arc<AtomicUsize>,
    /// Where changed pools are read from (the cloud config), if they may change.
    pool_source: Option<PoolSource>,
    /// The pools this replica serves now (their leases held).
    serving: tokio::sync::RwLock<std::collections::HashSet<String>>,
}

impl std::fmt::Debug for TunnelLoadBalancers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TunnelLoadBalancers")
            .field("tunnel_uds", &self.tunnel_uds)
            .field("bind", &self.bind)
            .finish_non_exhaustive()
    }
}

impl TunnelLoadBalancers {
    /// Balancers with addresses from `pools`, else `cfg.bind` (the tunnel is connected
    /// on first use).
    pub fn new(cfg: TunnelLbConfig, pools: Option<Pools>) -> Result<Self, String> {
        let (pools, bind) = match (pools, cfg.bind) {
            (Some(_), Some(bind)) => {
                return Err(format!(
                    "--lb-bind-address {bind} and loadBalancer pools in the cloud config: addresses come from the pools; drop --lb-bind-address"
                ))
            }
            (Some(p), None) => (p, None),
            (None, Some(bind)) => {
                let single = super::addresses::LoadBalancerConfig {
                    interface: None,
                    pools: vec![super::addresses::PoolConfig {
                        name: BIND_ADDRESS_POOL.into(),
                        addresses: vec![bind.to_string()],
                        namespaces: Vec::new(),
                    }],
                    reserved_ports: None,
                    ingress_hostname_suffix: None,
                };
                (Pools::new(&single)?, Some(bind))
            }
            (None, None) => {
                return Err(
                    "load balancers need addresses: a loadBalancer section with pools in the cloud config (or --lb-bind-address)"
                        .into(),
                )
            }
        };
        let announcer = match &pools.interface {
            Some(i) => {
                refuse_host_addresses(&pools)?;
                Some(Announcer::new(i)?)
            }
            None => None,
        };
        Ok(TunnelLoadBalancers {
            tunnel_uds: cfg.tunnel_uds,
            clients: tokio::sync::Mutex::new(HashMap::new()),
            allocator: Mutex::new(Allocator::new(pools)),
            bind,
            announcer,
            balancers: Mutex::new(HashMap::new()),
            open: Arc::new(AtomicUsize::new(0)),
            max_connections: cfg.max_connections,
            busy: Arc::new(AtomicUsize::new(0)),
            pool_source: None,
            serving: Default::default(),
        })
    }

    /// Takes the pools from `source` as they change (the cloud config's
    /// `loadBalancer:` section, re-read when the file changes): addresses added become
    /// available at the next sync or resync, Services on removed ones move at theirs.
    pub fn reloading_pools(mut self, source: PoolSource) -> Self {
        self.pool_source = Some(source);
        self
    }

    /// Adopts changed pools, if the cloud config changed them. The interface is fixed
    /// at start-up (a different one is logged and needs a restart).
    fn refresh_pools(&self) {
        let Some(new) = self.pool_source.as_ref().and_then(|read| read()) else {
            return;
        };
        let mut allocator = self.allocator();
        if allocator.pools() == &new {
            return;
        }
        if new.interface != allocator.pools().interface {
            tracing::warn!(was = ?allocator.pools().interface, now = ?new.interface, "loadBalancer.interface changed: restart the CCM to move the addresses; the pools' other changes apply now");
        }
        let interface = allocator.pools().interface.clone();
        let pools = super::addresses::Pools { interface, ..new };
        if self.announcer.is_some() {
            if let Err(e) = refuse_host_addresses(&pools) {
                tracing::error!(error = %e, "changed load-balancer pools not taken");
                return;
            }
        }
        tracing::info!(pools = pools.pools.len(), "load-balancer pools reloaded");
        allocator.set_pools(pools);
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

    fn allocator(&self) -> std::sync::MutexGuard<'_, Allocator> {
        self.allocator.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes each pool's addresses in use and in all (pools gone lose their series).
    fn publish_usage(&self) {
        let m = crate::metrics::get();
        m.lb_addresses_in_use.reset();
        m.lb_addresses_total.reset();
        for (pool, used, total) in self.allocator().usage() {
            m.lb_addresses_in_use
                .with_label_values(&[pool.as_str()])
                .set(used as i64);
            m.lb_addresses_total
                .with_label_values(&[pool.as_str()])
                .set(total.min(i64::MAX as u64) as i64);
        }
    }

    /// What `svc` asks of the allocator; an unparsable requested address is refused.
    fn request(&self, svc: &ServiceInfo) -> Result<Request, Refusal> {
        let mut requested = Vec::new();
        for r in &svc.requested_ips {
            match r.parse::<IpAddr>() {
                Ok(ip) => requested.push(ip),
                Err(_) => {
                    return Err(Refusal {
                        reason: super::addresses::reasons::INVALID,
                        message: format!(
                            "requested load-balancer address {r:?} is not an IP address"
                        ),
                    })
                }
            }
        }
        let families: Vec<Family> = match self.bind {
            // The one shared address decides.
            Some(bind) => vec![Family::of(bind)],
            None => svc
                .families
                .iter()
                .filter_map(|f| match f.as_str() {
                    "IPv4" => Some(Family::V4),
                    "IPv6" => Some(Family::V6),
                    _ => None,
                })
                .collect(),
        };
        Ok(Request {
            uid: svc.uid.clone(),
            service: label(svc),
            namespace: svc.namespace.clone(),
            families,
            require_all: svc.require_dual_stack,
            requested,
            current: self.published(svc),
            sharing_key: match self.bind {
                Some(_) => Some(BIND_ADDRESS_SHARING.into()),
                None => svc.sharing_key.clone(),
            },
            // One --lb-bind-address is every Service's, whatever its namespace.
            sharing_namespaces: match self.bind {
                Some(_) => vec!["*".into()],
                None => svc.sharing_namespaces.clone(),
            },
            ports: svc
                .ports
                .iter()
                .filter(|p| p.protocol == "TCP")
                .map(|p| (p.protocol.clone(), p.port))
                .collect(),
        })
    }

    /// The ingress: the addresses, or their hostnames with
    /// `loadBalancer.ingressHostnameSuffix`.
    fn status(&self, addresses: &[IpAddr]) -> LoadBalancerStatus {
        let suffix = self.allocator().pools().ingress_hostname_suffix.clone();
        match suffix {
            Some(suffix) => LoadBalancerStatus {
                ips: Vec::new(),
                hostnames: addresses
                    .iter()
                    .map(|ip| super::addresses::ingress_hostname(*ip, &suffix))
                    .collect(),
                proxy: true,
            },
            None => LoadBalancerStatus {
                ips: addresses.iter().map(ToString::to_string).collect(),
                hostnames: Vec::new(),
                // Traffic must reach this proxy, never be short-cut by kube-proxy.
                proxy: true,
            },
        }
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
fn forget_series(service: &str) {
    let m = crate::metrics::get();
    let _ = m.lb_active.remove_label_values(&[service]);
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

fn label(svc: &ServiceInfo) -> String {
    format!("{}/{}", svc.namespace, svc.name)
}

/// The allocation side, for the service controller (which runs on the controllers'
/// leader): addresses are assigned and published in the Services' status; whoever
/// holds each pool's lease serves them from there ([`TunnelLoadBalancers::serve`]).
#[async_trait]
impl LoadBalancers for TunnelLoadBalancers {
    async fn get(
        &self,
        _cluster: &str,
        svc: &ServiceInfo,
    ) -> Result<Option<LoadBalancerStatus>, CloudError> {
        let held = self.allocator().holding(&svc.uid).to_vec();
        Ok((!held.is_empty()).then(|| self.status(&held)))
    }

    async fn restore(&self, _cluster: &str, services: &[ServiceInfo]) {
        // (request() reads the allocator's pools: the requests first, then the lock.)
        let requests: Vec<(&ServiceInfo, Request)> = services
            .iter()
            .filter_map(|svc| self.request(svc).ok().map(|r| (svc, r)))
            .collect();
        let mut allocator = self.allocator();
        for (svc, req) in requests {
            let kept = allocator.restore(&req);
            if !kept.is_empty() {
                tracing::info!(service = %label(svc), addresses = ?kept, "load-balancer addresses read back");
            }
        }
    }

    async fn release_all(&self, _cluster: &str) {
        // The next leader reads the allocations back from the Services' status.
        self.allocator().clear();
    }

    async fn ensure(
        &self,
        _cluster: &str,
        svc: &ServiceInfo,
        _nodes: &[Backend],
    ) -> Result<LoadBalancerStatus, CloudError> {
        let tcp: Vec<&ServicePort> = svc.ports.iter().filter(|p| p.protocol == "TCP").collect();
        if tcp.is_empty() {
            // Nothing to serve: no address (it would be a pool address for nothing)
            // and no ingress a client would take for a working balancer.
            return Err(CloudError::Refused {
                reason: crate::translate::UNSUPPORTED_PROTOCOL.into(),
                message: format!(
                    "no TCP port, so no load balancer: the tether load balancer forwards TCP only (Konnectivity dials TCP); port(s) {} not served",
                    svc.ports
                        .iter()
                        .map(|p| format!("{}/{}", p.port, p.protocol))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
        self.refresh_pools();
        let reserved: Vec<u16> = {
            let allocator = self.allocator();
            let r = &allocator.pools().reserved_ports;
            tcp.iter()
                .map(|p| p.port)
                .filter(|p| r.contains(p))
                .collect()
        };
        if !reserved.is_empty() {
            return Err(CloudError::Refused {
                reason: super::addresses::reasons::RESERVED_PORT.into(),
                message: format!(
                    "port(s) {reserved:?} are reserved for the control plane (loadBalancer.reservedPorts in the cloud config)"
                ),
            });
        }
        let req = self.request(svc).map_err(refused)?;
        let addresses = self.allocator().assign(&req).map_err(refused)?;
        self.publish_usage();
        Ok(self.status(&addresses))
    }

    async fn update(
        &self,
        _cluster: &str,
        _svc: &ServiceInfo,
        _nodes: &[Backend],
    ) -> Result<(), CloudError> {
        // The pool holders read the node set themselves.
        Ok(())
    }

    async fn delete(&self, _cluster: &str, svc: &ServiceInfo) -> Result<(), CloudError> {
        self.allocator().release(&svc.uid);
        self.publish_usage();
        Ok(())
    }
}

/// The serving side: each replica serves the addresses of the pools whose leases it
/// holds, for every Service whose status shows one of them.
impl TunnelLoadBalancers {
    /// The pools' names (the cloud config re-read first), in the order written.
    pub fn pool_names(&self) -> Vec<String> {
        self.refresh_pools();
        self.allocator()
            .pools()
            .pools
            .iter()
            .map(|p| p.name.clone())
            .collect()
    }

    /// The name of the pool holding `ip`.
    fn pool_of(&self, ip: IpAddr) -> Option<String> {
        self.allocator().pools().pool_of(ip).map(str::to_string)
    }

    /// The addresses a Service's status shows (IPs, or names under
    /// `loadBalancer.ingressHostnameSuffix`).
    pub fn published(&self, svc: &ServiceInfo) -> Vec<IpAddr> {
        let suffix = self.allocator().pools().ingress_hostname_suffix.clone();
        svc.current_ips
            .iter()
            .filter_map(|ip| {
                ip.parse().ok().or_else(|| {
                    suffix
                        .as_deref()
                        .and_then(|s| super::addresses::address_of_hostname(ip, s))
                })
            })
            .collect()
    }

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

    /// Lets go of `pool`: its listeners stop (with their connections) and its
    /// addresses go, and none is served again until [`Self::resume_pool`]. Serves in
    /// flight finish first, so none puts one back.
    pub async fn release_pool(&self, pool: &str) {
        let mut serving = self.serving.write().await;
        serving.remove(pool);
        // What was served under the pool, and what the cloud config puts in it now.
        let mut recorded: std::collections::HashSet<IpAddr> = Default::default();
        let mut idle = Vec::new();
        for (uid, b) in self.lock().iter_mut() {
            let gone: Vec<IpAddr> = b
                .addresses
                .iter()
                .filter(|(_, p)| p == pool)
                .map(|(ip, _)| *ip)
                .collect();
            b.listeners.retain(|addr, l| {
                let keep = !gone.contains(&addr.ip());
                if !keep {
                    l.stop.cancel();
                }
                keep
            });
            b.addresses.retain(|(_, p)| p != pool);
            if b.listeners.is_empty() {
                idle.push(uid.clone());
            }
            recorded.extend(gone);
        }
        let in_pool = {
            let pools = self.allocator().pools().clone();
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
        drop(serving);
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
        let pools_of = |serving: &std::collections::HashSet<String>| -> Vec<(IpAddr, String)> {
            addresses
                .iter()
                .filter_map(|ip| self.pool_of(*ip).map(|p| (*ip, p)))
                .filter(|(_, p)| serving.contains(p))
                .collect()
        };
        if pools_of(&*self.serving.read().await).is_empty() {
            self.unserve(svc).await;
            return Ok(());
        }
        let tcp: Vec<&ServicePort> = svc.ports.iter().filter(|p| p.protocol == "TCP").collect();
        if svc.node_ports {
            if let Some(p) = tcp.iter().find(|p| p.node_port == 0) {
                return Err(CloudError::Provider(format!(
                    "port {} has no nodePort yet",
                    p.port
                )));
            }
        }
        // The tunnel connection before the pools are fenced: a Tether server slow to
        // answer must not hold up a pool's release.
        let client = self.client(&svc.uid).await?;
        let serving = self.serving.read().await;
        let mine = pools_of(&serving);
        if mine.is_empty() {
            drop(serving);
            self.unserve(svc).await;
            return Ok(());
        }
        let addresses: Vec<IpAddr> = mine.iter().map(|(ip, _)| *ip).collect();
        // The entry stays in the map, claiming old and new addresses, while listeners
        // are bound: a Service sharing an address that lets go meanwhile sees the claim
        // and leaves the address.
        let (shared, mut keep, before) = {
            let mut all = self.lock();
            match all.get_mut(&svc.uid) {
                Some(b) => {
                    *b.shared.nodes.write().unwrap_or_else(|e| e.into_inner()) = nodes.to_vec();
                    *b.shared.policy.write().unwrap_or_else(|e| e.into_inner()) = Policy::of(svc);
                    let before = b.addresses.clone();
                    for m in &mine {
                        if !b.addresses.contains(m) {
                            b.addresses.push(m.clone());
                        }
                    }
                    (b.shared.clone(), std::mem::take(&mut b.listeners), before)
                }
                None => (
                    Shared {
                        nodes: Arc::new(RwLock::new(nodes.to_vec())),
                        policy: Arc::new(RwLock::new(Policy::of(svc))),
                        active: crate::metrics::get()
                            .lb_active
                            .with_label_values(&[label(svc).as_str()]),
                        all: self.open.clone(),
                        max_all: self.max_connections,
                        busy: self.busy.clone(),
                        mine: Arc::new(AtomicUsize::new(0)),
                        counters: Arc::new(Counters::of(&label(svc))),
                    },
                    HashMap::new(),
                    Vec::new(),
                ),
            }
        };
        let exists = self.lock().contains_key(&svc.uid);
        if !exists {
            self.lock().insert(
                svc.uid.clone(),
                Balancer {
                    addresses: mine.clone(),
                    listeners: HashMap::new(),
                    shared: shared.clone(),
                },
            );
        }
        let restore = |keep: HashMap<SocketAddr, Listener>, before: Vec<(IpAddr, String)>| {
            if let Some(b) = self.lock().get_mut(&svc.uid) {
                b.listeners = keep;
                b.addresses = before;
            }
        };
        if let Some(a) = &self.announcer {
            for (ip, pool) in &mine {
                if let Err(e) = a.hold(*ip, pool).await {
                    restore(keep, before);
                    return Err(e);
                }
            }
        }
        let wanted: Vec<(SocketAddr, PortTarget)> = addresses
            .iter()
            .flat_map(|ip| {
                tcp.iter()
                    .map(move |p| (SocketAddr::new(*ip, p.port), PortTarget::of(svc, p)))
            })
            .collect();
        // Listeners kept pick up a new target in place.
        for (addr, target) in &wanted {
            if let Some(l) = keep.get(addr) {
                *l.target.write().unwrap_or_else(|e| e.into_inner()) = target.clone();
            }
        }
        // New listeners are bound before any old one stops, so a failed bind leaves
        // what was serving before serving (and the new ones are retried).
        let mut fresh: Vec<(SocketAddr, Listener)> = Vec::new();
        for (addr, target) in wanted.iter().filter(|(a, _)| !keep.contains_key(a)) {
            let bound = match &self.announcer {
                Some(a) => a.listen(*addr).await,
                None => TcpListener::bind(addr).await,
            };
            let listener = match bound {
                Ok(l) => l,
                Err(e) => {
                    for (_, l) in fresh {
                        l.stop.cancel();
                    }
                    restore(keep, before);
                    return Err(CloudError::Provider(format!(
                        "cannot listen on {addr} for {}: {e}",
                        label(svc)
                    )));
                }
            };
            let stop = CancellationToken::new();
            let target = Arc::new(RwLock::new(target.clone()));
            let span = tracing::info_span!("load_balancer", service = %label(svc), %addr);
            tokio::spawn(
                serve(
                    listener,
                    client.clone(),
                    shared.clone(),
                    target.clone(),
                    stop.clone(),
                )
                .instrument(span),
            );
            fresh.push((*addr, Listener { target, stop }));
        }
        // Listeners no longer wanted stop (with their connections).
        keep.retain(|addr, l| {
            let wanted = wanted.iter().any(|(a, _)| a == addr);
            if !wanted {
                l.stop.cancel();
            }
            wanted
        });
        if !fresh.is_empty() {
            let added: Vec<SocketAddr> = fresh.iter().map(|(a, _)| *a).collect();
            tracing::info!(service = %label(svc), listeners = ?added, nodes = nodes.len(), "load balancer listening");
        }
        keep.extend(fresh);
        self.lock().insert(
            svc.uid.clone(),
            Balancer {
                addresses: mine,
                listeners: keep,
                shared,
            },
        );
        drop(serving);
        // Addresses this Service moved off, if no other Service served here has them.
        let gone: Vec<IpAddr> = before
            .into_iter()
            .map(|(ip, _)| ip)
            .filter(|ip| !addresses.contains(ip))
            .collect();
        self.let_go(gone).await;
        Ok(())
    }

    /// Stops serving `svc` here: its listeners stop (with their connections), its
    /// series go, and its addresses, unless another Service served here has them.
    pub async fn unserve(&self, svc: &ServiceInfo) {
        self.clients.lock().await.remove(&svc.uid);
        let removed = self.lock().remove(&svc.uid);
        let Some(b) = removed else { return };
        for l in b.listeners.into_values() {
            l.stop.cancel();
        }
        tracing::info!(service = %label(svc), "load balancer no longer served here");
        forget_series(&label(svc));
        self.let_go(b.addresses.into_iter().map(|(ip, _)| ip).collect())
            .await;
    }
}

/// Refuses pools holding an address of this host: announced from the load-balancer
/// namespace, it would take the host's own address away from it on the LAN.
fn refuse_host_addresses(pools: &Pools) -> Result<(), String> {
    let host = super::netns::host_addresses()
        .map_err(|e| format!("cannot list this host's addresses: {e}"))?;
    for (interface, ip) in host {
        if let Some(pool) = pools.pools.iter().find(|p| p.contains(ip)) {
            return Err(format!(
                "loadBalancer pool {:?} holds {ip}, an address of this host (interface {interface}): announcing it would take it from the host; take it out of the pool",
                pool.name
            ));
        }
    }
    Ok(())
}

fn refused(r: Refusal) -> CloudError {
    CloudError::Refused {
        reason: r.reason.into(),
        message: r.message,
    }
}

/// One listener's accept loop and what each of its connections needs.
#[derive(Clone)]
struct PortServer {
    client: Client,
    shared: Shared,
    target: Arc<RwLock<PortTarget>>,
    /// Where the next connection starts in the backend list (round-robin).
    next: Arc<AtomicUsize>,
    stop: CancellationToken,
}

/// Accepts until `stop`; a client outside the Service's source ranges, or over its
/// connection limit, is closed at once; each other connection goes to the next backend
/// that answers.
async fn serve(
    listener: TcpListener,
    client: Client,
    shared: Shared,
    target: Arc<RwLock<PortTarget>>,
    stop: CancellationToken,
) {
    let port = PortServer {
        client,
        shared,
        target,
        next: Arc::new(AtomicUsize::new(0)),
        stop,
    };
    loop {
        let (conn, peer) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors, most likely: let some close.
                    tracing::warn!(error = %chain(&e), "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = port.stop.cancelled() => return,
        };
        let policy = port
            .shared
            .policy
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(open) = port.admit(peer, &policy) else {
            continue;
        };
        let candidates = port.candidates();
        tokio::spawn(
            port.clone()
                .forward(conn, peer, policy, candidates, open)
                .instrument(tracing::debug_span!("lb_conn", %peer)),
        );
    }
}

impl PortServer {
    fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// The source-range and connection-limit checks; a guard counting the connection
    /// as open when it is admitted.
    fn admit(&self, peer: SocketAddr, policy: &Policy) -> Option<OpenGuard> {
        if !policy.admits(peer.ip()) {
            self.counters().refused_source_range.inc();
            tracing::debug!(%peer, "client outside loadBalancerSourceRanges refused");
            return None;
        }
        let (max, mine) = (
            self.shared.max_all,
            self.shared.mine.load(Ordering::Acquire),
        );
        if mine >= policy.max_connections {
            self.counters().refused_limit.inc();
            tracing::debug!(%peer, max = policy.max_connections, "connection limit reached; refused");
            return None;
        }
        let before = self.shared.all.fetch_add(1, Ordering::AcqRel);
        // The last quarter of the cap goes only to Services under their fair share
        // (the cap over the Services holding connections, and one more): a busy Service
        // cannot take every connection, and a new one always gets some.
        let congested = before * 4 >= max * 3;
        let others = self.shared.busy.load(Ordering::Acquire) + usize::from(mine == 0);
        let share = max / (others + 1);
        if before >= max || (congested && mine >= share) {
            self.shared.all.fetch_sub(1, Ordering::AcqRel);
            self.counters().refused_global_limit.inc();
            tracing::debug!(%peer, max, open = before, share, "--lb-max-connections (or this Service's share of it) reached; refused");
            return None;
        }
        self.counters().accepted.inc();
        Some(OpenGuard::new(&self.shared))
    }

    /// The backends now, by name: the nodes' NodePort, or the ready endpoints.
    fn candidates(&self) -> Vec<(String, SocketAddr)> {
        match &*self.target.read().unwrap_or_else(|e| e.into_inner()) {
            PortTarget::NodePort(port) => self
                .shared
                .nodes
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .filter_map(|n| {
                    let ip = n.address.parse().ok()?;
                    Some((n.name.clone(), SocketAddr::new(ip, *port)))
                })
                .collect(),
            PortTarget::Endpoints(eps) => eps.iter().map(|e| (e.to_string(), *e)).collect(),
        }
    }

    /// Dials the backends through the tunnel in turn, from the next in round-robin
    /// order, and splices `conn` to the first that answers.
    async fn forward(
        self,
        conn: tokio::net::TcpStream,
        peer: SocketAddr,
        policy: Policy,
        candidates: Vec<(String, SocketAddr)>,
        open: OpenGuard,
    ) {
        if candidates.is_empty() {
            self.counters().no_backend.inc();
            tracing::info!("no ready backend to forward to; connection closed");
            return;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        for i in 0..candidates.len() {
            let (name, target) = &candidates[(start + i) % candidates.len()];
            match self.client.dial(&target.to_string()).await {
                Ok(upstream) => {
                    self.splice(conn, upstream, peer, &policy, name).await;
                    drop(open);
                    return;
                }
                Err(e) => {
                    tracing::warn!(backend = %name, %target, error = %chain(&e), "dial through the tunnel failed; trying the next backend");
                }
            }
        }
        self.counters().no_backend.inc();
        tracing::warn!("no backend answered; connection closed");
    }

    /// Sends the PROXY header when configured, then copies both ways until either side
    /// closes, the connection idles out, or the listener stops.
    async fn splice(
        &self,
        mut conn: tokio::net::TcpStream,
        mut upstream: tether_client::TunnelConn,
        peer: SocketAddr,
        policy: &Policy,
        name: &str,
    ) {
        if let (Some(version), Ok(local)) = (policy.proxy_protocol, conn.local_addr()) {
            let header = super::proxy_protocol::header(version, peer, local);
            if let Err(e) = upstream.write_all(&header).await {
                tracing::debug!(error = %chain(&e), backend = %name, "cannot send the PROXY header");
                return;
            }
        }
        let last = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let epoch = tokio::time::Instant::now();
        let mut splice = Splice::new(&mut conn, &mut upstream, last.clone(), epoch);
        tokio::select! {
            r = &mut splice => {
                if let Err(e) = r {
                    tracing::debug!(error = %chain(&e), backend = %name, "forwarded connection ended with an error");
                }
            },
            _ = idle(last, epoch, policy.idle_timeout) => {
                tracing::debug!(timeout = ?policy.idle_timeout, "idle connection closed");
            }
            _ = self.stop.cancelled() => {}
        }
        // Counted however the connection ended (idle timeout, listener stopped).
        self.counters().to_backend.inc_by(splice.up);
        self.counters().to_client.inc_by(splice.down);
    }
}

/// Counts a connection among a Service's open ones until dropped.
/// (The global count was taken by the caller.)
struct OpenGuard {
    open: prometheus::IntGauge,
    all: Arc<AtomicUsize>,
    busy: Arc<AtomicUsize>,
    mine: Arc<AtomicUsize>,
}

impl OpenGuard {
    fn new(shared: &Shared) -> Self {
        shared.active.inc();
        if shared.mine.fetch_add(1, Ordering::AcqRel) == 0 {
            shared.busy.fetch_add(1, Ordering::AcqRel);
        }
        OpenGuard {
            open: shared.active.clone(),
            all: shared.all.clone(),
            busy: shared.busy.clone(),
            mine: shared.mine.clone(),
        }
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.open.dec();
        if self.mine.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.busy.fetch_sub(1, Ordering::AcqRel);
        }
        self.all.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Copies both ways between a client connection and its tunnel connection until both
/// directions have ended, noting (in ms since `epoch`) when bytes last moved. Lean on
/// purpose: what arrives through the tunnel is written to the client as it came (no
/// copy through a buffer of ours), and the client's bytes are read up to
/// [`READ_CHUNK`](tether_core::pump::READ_CHUNK) at a time, one tunnel frame each, in a
/// buffer that starts small (an idle connection holds 16 KiB) and grows while reads
/// fill it.
struct Splice<'a> {
    conn: &'a mut tokio::net::TcpStream,
    tunnel: &'a mut tether_client::TunnelConn,
    last: Arc<std::sync::atomic::AtomicU64>,
    epoch: tokio::time::Instant,
    /// Client to backend: the buffer, how much of it is filled and how much was sent.
    up_buf: Vec<u8>,
    up_filled: usize,
    up_sent: usize,
    up_done: bool,
    /// Backend to client: the chunk being written.
    down_chunk: Option<bytes::Bytes>,
    down_done: bool,
    /// Bytes moved each way.
    up: u64,
    down: u64,
}

/// The client's bytes per read at first; reads that fill it double it, up to
/// `READ_CHUNK`.
const UP_FIRST: usize = 16 * 1024;

impl<'a> Splice<'a> {
    fn new(
        conn: &'a mut tokio::net::TcpStream,
        tunnel: &'a mut tether_client::TunnelConn,
        last: Arc<std::sync::atomic::AtomicU64>,
        epoch: tokio::time::Instant,
    ) -> Self {
        Splice {
            conn,
            tunnel,
            last,
            epoch,
            up_buf: vec![0u8; UP_FIRST],
            up_filled: 0,
            up_sent: 0,
            up_done: false,
            down_chunk: None,
            down_done: false,
            up: 0,
            down: 0,
        }
    }

    fn moved(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.last.store(ms, Ordering::Relaxed);
    }

    /// Client to backend, as far as it can go now; Ready once the client's end of
    /// stream has been passed on.
    fn poll_up(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        use tokio::io::{AsyncRead, AsyncWrite};
        loop {
            if self.up_sent < self.up_filled {
                let buf = &self.up_buf[self.up_sent..self.up_filled];
                let n =
                    std::task::ready!(std::pin::Pin::new(&mut *self.tunnel).poll_write(cx, buf))?;
                self.up_sent += n;
                self.up += n as u64;
                continue;
            }
            let mut rb = tokio::io::ReadBuf::new(&mut self.up_buf);
            std::task::ready!(std::pin::Pin::new(&mut *self.conn).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            if n == self.up_buf.len() && n < tether_core::pump::READ_CHUNK {
                let grown = (n * 2).min(tether_core::pump::READ_CHUNK);
                self.up_buf.resize(grown, 0);
            }
            if n == 0 {
                std::task::ready!(std::pin::Pin::new(&mut *self.tunnel).poll_shutdown(cx))?;
                return Poll::Ready(Ok(()));
            }
            self.moved();
            (self.up_filled, self.up_sent) = (n, 0);
        }
    }

    /// Backend to client, likewise.
    fn poll_down(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        use tokio::io::AsyncWrite;
        loop {
            if let Some(chunk) = &mut self.down_chunk {
                let n =
                    std::task::ready!(std::pin::Pin::new(&mut *self.conn).poll_write(cx, chunk))?;
                if n == 0 {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                }
                self.down += n as u64;
                let _ = chunk.split_to(n);
                if chunk.is_empty() {
                    self.down_chunk = None;
                }
                continue;
            }
            match std::task::ready!(self.tunnel.poll_chunk(cx))? {
                Some(chunk) => {
                    self.moved();
                    self.down_chunk = Some(chunk);
                }
                None => {
                    std::task::ready!(std::pin::Pin::new(&mut *self.conn).poll_shutdown(cx))?;
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
}

impl std::future::Future for Splice<'_> {
    type Output = std::io::Result<()>;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let this = &mut *self;
        if !this.up_done {
            match this.poll_up(cx) {
                Poll::Ready(Ok(())) => this.up_done = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
        }
        if !this.down_done {
            match this.poll_down(cx) {
                Poll::Ready(Ok(())) => this.down_done = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
        }
        // The backend's end closes the whole connection (Konnectivity has no
        // half-close: nothing more the client sends could reach it).
        if this.down_done {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }
}

/// Resolves once no byte was read either way for `timeout`.
async fn idle(
    last: Arc<std::sync::atomic::AtomicU64>,
    epoch: tokio::time::Instant,
    timeout: std::time::Duration,
) {
    loop {
        let at = epoch + std::time::Duration::from_millis(last.load(Ordering::Relaxed)) + timeout;
        if tokio::time::Instant::now() >= at {
            return;
        }
        tokio::time::sleep_until(at).await;
    }
}

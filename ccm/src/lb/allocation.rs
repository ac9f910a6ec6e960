//! The allocation side of the `tether` provider's load balancers, which the service
//! controller drives on the controllers' leader: which Service gets which address (the
//! allocator over the pools, re-read as the cloud config changes, or the one
//! `--lb-bind-address`), its status, and the allocation record it is kept in before
//! the status is published and read back from at a takeover. The data plane, on every
//! replica, is [`super::balancer`].

use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock};
use tether_core::error::chain;

use async_trait::async_trait;

use super::addresses::{Allocator, Family, Pools, Refusal, Request};
use super::port::label;
use super::record::{RecordRef, Writer};
use crate::cloud::{
    Backend, CloudError, LoadBalancerStatus, LoadBalancers, ServiceInfo, ServicePort,
};

/// The implicit sharing key of Services sharing `--lb-bind-address`.
const BIND_ADDRESS_SHARING: &str = "--lb-bind-address";
/// The pool `--lb-bind-address` makes (its Lease: `<lease>-lb-bind-address`).
const BIND_ADDRESS_POOL: &str = "bind-address";

/// Reads the pools as they are now (the provider's configuration, re-read when it
/// changes); `None` when they cannot be read.
pub type PoolSource = Arc<dyn Fn() -> Option<Pools> + Send + Sync>;

/// Who holds which load-balancer address, for the service controller.
pub struct Allocations {
    allocator: Mutex<Allocator>,
    /// Without pools: the one address every Service shares.
    bind: Option<IpAddr>,
    /// Where changed pools are read from (the cloud config), if they may change.
    pool_source: OnceLock<PoolSource>,
    /// Whether the addresses are announced here (reloaded pools must not hold this
    /// host's addresses then).
    announces: bool,
    /// The controller manager's metrics (addresses in use).
    metrics: crate::metrics::Metrics,
    /// Where the allocation record lives, if it is kept.
    record_at: Option<RecordRef>,
    /// Its writer, once the manager gives a client ([`Self::keep_record`]); without
    /// one, allocations are read back from the Services' status.
    record: OnceLock<Writer>,
}

impl std::fmt::Debug for Allocations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocations")
            .field("bind", &self.bind)
            .field("record_at", &self.record_at)
            .finish_non_exhaustive()
    }
}

impl Allocations {
    /// Allocations from `pools`, else the one address `bind`.
    pub fn new(
        pools: Option<Pools>,
        bind: Option<IpAddr>,
        metrics: crate::metrics::Metrics,
        record_at: Option<RecordRef>,
    ) -> Result<Self, String> {
        let (pools, bind) = match (pools, bind) {
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
        if pools.interface.is_some() {
            refuse_host_addresses(&pools)?;
        }
        Ok(Allocations {
            announces: pools.interface.is_some(),
            allocator: Mutex::new(Allocator::new(pools)),
            bind,
            pool_source: OnceLock::new(),
            metrics,
            record_at,
            record: OnceLock::new(),
        })
    }

    /// Keeps the allocation record (when configured) through `client` from now on:
    /// every assignment is in it before its status can be published, and a new leader
    /// reads allocations back from it, not from the Services' status (which anyone
    /// allowed `services/status` can write). Called once, before the controllers start.
    pub fn keep_record(&self, client: &kube::Client) {
        if let Some(at) = &self.record_at {
            let _ = self
                .record
                .set(super::record::Writer::new(client.clone(), at));
        }
    }

    /// Where the allocation record lives, when one is kept: pool holders follow it.
    pub fn record_at(&self) -> Option<&super::record::RecordRef> {
        self.record_at.as_ref()
    }

    /// Writes what the allocator holds to the record (when there is one).
    async fn persist(&self) -> Result<(), CloudError> {
        let Some(writer) = self.record.get() else {
            return Ok(());
        };
        let wanted = self.allocator().generation();
        writer
            .write(wanted, || self.allocator().snapshot())
            .await
            .map_err(|e| CloudError::Provider(chain(&e).to_string()))
    }

    /// The allocations a new leader starts from: the record's; `None` when there is no
    /// record (or none yet: a leader of an earlier version kept none), or when this
    /// replica may not read it (its RBAC not yet updated, said loudly), and then the
    /// Services' status is read instead. Any other failure (the API server away, a
    /// record someone broke) is retried until it reads: statuses anyone can write are
    /// never laundered into the record for want of patience.
    async fn recorded(&self) -> Option<super::record::Allocations> {
        let writer = self.record.get()?;
        let mut wait = std::time::Duration::from_millis(200);
        loop {
            match writer.read().await {
                Ok(read) => return read,
                Err(e) if e.forbidden() => {
                    tracing::error!(error = %chain(&e), "may not read the load-balancer allocation record (apply deploy/tether-ccm.yaml's Role): reading the allocations back from the Services' status instead, which anyone allowed services/status can write");
                    return None;
                }
                Err(e) => {
                    tracing::warn!(error = %chain(&e), "cannot read the load-balancer allocation record; retrying before any Service is synced");
                }
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(std::time::Duration::from_secs(5));
        }
    }

    /// Takes the pools from `source` as they change (the cloud config's
    /// `loadBalancer:` section, re-read when the file changes): addresses added become
    /// available at the next sync or resync, Services on removed ones move at theirs.
    pub fn reloading_pools(&self, source: PoolSource) {
        let _ = self.pool_source.set(source);
    }

    /// Adopts changed pools, if the cloud config changed them. The interface is fixed
    /// at start-up (a different one is logged and needs a restart).
    fn refresh_pools(&self) {
        let Some(new) = self.pool_source.get().and_then(|read| read()) else {
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
        if self.announces {
            if let Err(e) = refuse_host_addresses(&pools) {
                tracing::error!(error = %e, "changed load-balancer pools not taken");
                return;
            }
        }
        tracing::info!(pools = pools.pools.len(), "load-balancer pools reloaded");
        allocator.set_pools(pools);
    }

    pub(super) fn allocator(&self) -> std::sync::MutexGuard<'_, Allocator> {
        self.allocator.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes each pool's addresses in use and in all (pools gone lose their series).
    fn publish_usage(&self) {
        let m = &self.metrics;
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
            // With a record, a Service keeps what the allocator holds for it (read
            // back from the record), whatever its status claims.
            current: match self.record.get() {
                Some(_) => Vec::new(),
                None => self.published(svc),
            },
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
    pub(super) fn status(&self, addresses: &[IpAddr]) -> LoadBalancerStatus {
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
    pub fn pool_of(&self, ip: IpAddr) -> Option<String> {
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
}

/// The allocation side, for the service controller (which runs on the controllers'
/// leader): addresses are assigned and published in the Services' status; whoever
/// holds each pool's lease serves them from there
/// ([`super::balancer::TunnelLoadBalancers::serve`]), as far as the record agrees.
#[async_trait]
impl LoadBalancers for Allocations {
    async fn get(
        &self,
        _cluster: &str,
        svc: &ServiceInfo,
    ) -> Result<Option<LoadBalancerStatus>, CloudError> {
        let held = self.allocator().holding(&svc.uid).to_vec();
        Ok((!held.is_empty()).then(|| self.status(&held)))
    }

    async fn restore(&self, _cluster: &str, services: &[ServiceInfo]) {
        let recorded = self.recorded().await;
        // (request() and published() read the allocator's pools: the requests first,
        // then the lock.)
        let requests: Vec<(&ServiceInfo, Request)> = services
            .iter()
            .filter_map(|svc| {
                let mut req = self.request(svc).ok()?;
                // With a record, what it says (addresses and the ports accepted with
                // them), never what a status claims or a refused change asks: a Service
                // refused a port keeps no claim to it across a restart.
                match recorded.as_ref().map(|r| r.services.get(&svc.uid)) {
                    Some(Some(a)) => {
                        req.current = a.addresses.clone();
                        req.ports = a.ports.iter().map(|p| ("TCP".to_string(), *p)).collect();
                    }
                    Some(None) => req.current = Vec::new(),
                    None => req.current = self.published(svc),
                }
                Some((svc, req))
            })
            .collect();
        {
            let mut allocator = self.allocator();
            for (svc, req) in requests {
                let kept = allocator.restore(&req);
                if !kept.is_empty() {
                    tracing::info!(service = %label(svc), addresses = ?kept, "load-balancer addresses read back");
                }
            }
        }
        if recorded.is_none() && self.record.get().is_some() {
            // The first leader with a record (an upgrade): it starts from the statuses.
            match self.persist().await {
                Ok(()) => tracing::info!(
                    "load-balancer allocation record written from the Services' status"
                ),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot write the load-balancer allocation record; the next assignment tries again")
                }
            }
        }
    }

    async fn release_all(&self, _cluster: &str) {
        // The next leader reads the allocations back from the record.
        self.allocator().clear();
        if let Some(writer) = self.record.get() {
            writer.forget().await;
        }
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
        // In the record before the status: holders serve only what it says.
        self.persist().await?;
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
        // A deleted Service's stale entry harms nobody (UIDs never recur) and goes at
        // the next write: its finalizer must not wait on the record.
        if let Err(e) = self.persist().await {
            tracing::warn!(service = %label(svc), error = %e, "load-balancer allocation record not updated for a deleted Service; the next write drops it");
        }
        Ok(())
    }
}

/// Refuses pools holding an address of this host: announced from the load-balancer
/// namespace, it would take the host's own address away from it on the LAN.
pub(super) fn refuse_host_addresses(pools: &Pools) -> Result<(), String> {
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

//! Tether's cloud-controller-manager: the node, node-lifecycle, route and service
//! controllers of upstream's cloud-provider, on kube-rs, behind the provider traits in
//! [`cloud`]. One shared watch per resource feeds every controller ([`informer`]);
//! controllers work off keyed queues with per-key backoff ([`workqueue`]); only the
//! replica holding the leader Lease runs them ([`leader`]).

pub mod cloud;
pub mod controllers;
pub mod credentials;
pub mod endpoints;
pub mod informer;
pub mod lb;
pub mod leader;
pub mod metrics;
pub mod netlink;
pub mod provider;
pub mod serving;
pub mod workqueue;

use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::cloud::Provider;
use crate::controllers::{node::NodeController, node_lifecycle::NodeLifecycleController, Context};
use crate::workqueue::WorkQueue;

/// The controllers `--controllers` can name: (canonical name, alias). The canonical
/// names are upstream's (k8s.io/cloud-provider `names`), the aliases its older short
/// names; both are accepted wherever a name is.
pub const CONTROLLERS: [(&str, &str); 5] = [
    ("cloud-node-controller", "cloud-node"),
    ("cloud-node-lifecycle-controller", "cloud-node-lifecycle"),
    ("node-route-controller", "route"),
    ("service-lb-controller", "service"),
    (
        controllers::csr_approver::NAME,
        controllers::csr_approver::NAME,
    ),
];

/// Upstream controllers this build does not have: naming them off (`-name`) is accepted
/// so that upstream command lines start; turning one on is refused with the reason.
pub const UNSUPPORTED: [(&str, &str); 1] = [(
    "node-ipam-controller",
    "node IPAM is kube-controller-manager's (its --allocate-node-cidrs)",
)];

/// Which controllers run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enabled {
    /// `cloud-node-controller`.
    pub node: bool,
    /// `cloud-node-lifecycle-controller`.
    pub node_lifecycle: bool,
    /// `node-route-controller`.
    pub route: bool,
    /// `service-lb-controller`.
    pub service: bool,
    /// `kubelet-serving-csr-approver`.
    pub csr_approver: bool,
}

impl Enabled {
    /// Parses `--controllers` with upstream's rules: `*` turns on every controller not
    /// named otherwise, `name` turns one on, `-name` off, and for each controller the
    /// first entry naming it (by canonical name or alias) wins.
    pub fn parse(list: &[String]) -> Result<Self, String> {
        // (on, name) per entry; `*` stays as a name of its own.
        let items: Vec<(bool, &str)> = list
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .map(|s| match s.strip_prefix('-') {
                Some(name) => (false, name),
                None => (true, s),
            })
            .collect();
        for &(on, name) in &items {
            if let Some((_, why)) = UNSUPPORTED.iter().find(|(n, _)| *n == name) {
                if on {
                    return Err(format!(
                        "--controllers: {name} is not in this build: {why}; leave it off (-{name})"
                    ));
                }
                continue;
            }
            let known = CONTROLLERS.iter().any(|(c, a)| name == *c || name == *a);
            if !(known || (on && name == "*")) {
                return Err(format!(
                    "--controllers: unknown controller {name:?} (known: {}; or * for all)",
                    CONTROLLERS
                        .iter()
                        .map(|(c, a)| if c == a {
                            c.to_string()
                        } else {
                            format!("{c} ({a})")
                        })
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        let star = items.contains(&(true, "*"));
        // The first entry naming the controller wins; otherwise `*` decides.
        let is_on = |index: usize| {
            let (canonical, alias) = CONTROLLERS[index];
            items
                .iter()
                .find(|(_, name)| *name == canonical || *name == alias)
                .map_or(star, |&(on, _)| on)
        };
        Ok(Enabled {
            node: is_on(0),
            node_lifecycle: is_on(1),
            route: is_on(2),
            service: is_on(3),
            csr_approver: is_on(4),
        })
    }
}

/// Settings of the controller manager.
#[derive(Debug, Clone)]
pub struct CcmConfig {
    /// `--cluster-name`.
    pub cluster_name: String,
    /// Controllers to run.
    pub enabled: Enabled,
    /// `--node-monitor-period` (5 s).
    pub node_monitor_period: Duration,
    /// `--node-status-update-frequency` (5 min).
    pub node_status_update_frequency: Duration,
    /// `--load-balancer-class`.
    pub load_balancer_class: Option<String>,
    /// How often every load balancer is ensured again (drift repair).
    pub lb_resync_period: Duration,
    /// `--concurrent-service-syncs` (1).
    pub concurrent_service_syncs: usize,
    /// `--concurrent-node-syncs` (1).
    pub concurrent_node_syncs: usize,
    /// `--cluster-cidr` (comma-separated, one per family); the route controller runs
    /// only when it is set and `--configure-cloud-routes` is true.
    pub cluster_cidrs: Vec<tether_core::identifiers::Cidr>,
    /// `--configure-cloud-routes` (true).
    pub configure_cloud_routes: bool,
    /// `--route-reconciliation-period` (10 s).
    pub route_reconciliation_period: Duration,
    /// Leader election; `None` with `--leader-elect=false`.
    pub leader_election: Option<leader::LeaderElection>,
    /// The load-balancer pools' leases (shorter than the controllers'; `name` is their
    /// prefix, `-<pool>` is added): each pool's holder holds and serves its addresses.
    /// `None` with `--leader-elect=false`.
    pub load_balancer_lease: Option<leader::LeaderElection>,
    /// Reported as the event source.
    pub identity: String,
    /// The load balancers' data plane (the `tether` provider's), which every replica
    /// runs beside the controllers, serving the pools whose leases it holds.
    pub load_balancer_server: Option<Arc<lb::balancer::TunnelLoadBalancers>>,
}

/// Why the controller manager stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CcmError {
    /// Leadership was lost; upstream exits so that it restarts clean.
    #[error("leader election lost")]
    LeadershipLost,
    /// The node cache never synced.
    #[error("node watch never synced: {0}")]
    CacheSync(String),
}

/// Runs the controllers (once leader, if electing) until `shutdown`. `health` gets a
/// `leader-election` check and one check per running controller.
pub async fn run(
    clients: impl Into<credentials::Clients>,
    provider: Arc<dyn Provider>,
    config: CcmConfig,
    health: serving::Health,
    shutdown: CancellationToken,
) -> Result<(), CcmError> {
    let clients: credentials::Clients = clients.into();
    let client = clients.root.clone();
    let routes = match (
        config.enabled.route,
        provider.routes(),
        config.configure_cloud_routes,
        config.cluster_cidrs.is_empty(),
    ) {
        (false, ..) => None,
        (true, None, ..) => {
            tracing::info!(
                provider = provider.name(),
                "route controller not started: the provider has no routes configured"
            );
            None
        }
        (true, Some(_), false, _) => {
            tracing::info!("route controller not started: --configure-cloud-routes=false");
            None
        }
        (true, Some(_), true, true) => {
            tracing::info!("route controller not started: --cluster-cidr is not set");
            None
        }
        (true, Some(r), true, false) => Some(r),
    };
    let leader_metric = crate::metrics::get().leader.with_label_values(&[config
        .leader_election
        .as_ref()
        .map(|le| le.name.as_str())
        .unwrap_or("cloud-controller-manager")]);
    leader_metric.set(0);
    // The load balancers' data plane runs on every replica, beside the controllers:
    // each serves the pools whose leases it holds.
    let lb_shutdown = shutdown.child_token();
    // An early return lets go of the pools too (in the background).
    let _lb_stop = lb_shutdown.clone().drop_guard();
    let load_balancers = match (config.load_balancer_server.clone(), config.enabled.service) {
        (Some(lbs), true) => {
            // Its health check fails once it has ended before shutdown (say, its
            // caches never synced): this replica then serves no pool.
            let serving = Arc::new(std::sync::atomic::AtomicBool::new(true));
            let flag = serving.clone();
            let stopping = lb_shutdown.clone();
            health.add("load-balancers", move || {
                if flag.load(std::sync::atomic::Ordering::Relaxed) || stopping.is_cancelled() {
                    Ok(())
                } else {
                    Err("the load balancers' data plane stopped".into())
                }
            });
            let run = lb::pools::run(
                clients.root.clone(),
                lbs,
                lb::pools::ServingConfig {
                    lease: config.load_balancer_lease.clone(),
                    load_balancer_class: config.load_balancer_class.clone(),
                    resync: config.lb_resync_period,
                    workers: config.concurrent_service_syncs,
                },
                lb_shutdown.clone(),
            );
            let exit = ExitFlag(serving);
            Some(tokio::spawn(
                async move {
                    run.await;
                    drop(exit);
                }
                .instrument(tracing::info_span!("load_balancers")),
            ))
        }
        _ => None,
    };
    if config.enabled.service && provider.load_balancers().is_none() {
        tracing::warn!(provider = provider.name(), "service controller disabled: the provider has no load balancers (tether: set --tunnel-uds, and loadBalancer pools in the cloud config or --lb-bind-address)");
    }
    let (lost, leadership) = match &config.leader_election {
        Some(le) => {
            // Routes a former leader on this host left behind (it crashed, or lost
            // its lease) go before we stand by: only the leader's host routes.
            if let Some(r) = &routes {
                controllers::route::remove_ours(
                    r.as_ref(),
                    &config.cluster_name,
                    &config.cluster_cidrs,
                )
                .instrument(tracing::info_span!("route_cleanup"))
                .await;
            }
            match leader::lead(client.clone(), le.clone(), shutdown.clone()).await {
                Some(l) => (l.lost.clone(), Some(l)),
                None => {
                    if let Some(lb) = load_balancers {
                        let _ = lb.await;
                    }
                    return Ok(());
                }
            }
        }
        None => (CancellationToken::new(), None),
    };
    leader_metric.set(1);
    {
        let lost = lost.clone();
        health.add("leader-election", move || {
            if lost.is_cancelled() {
                Err("leader lease lost".into())
            } else {
                Ok(())
            }
        });
    }
    let mut tasks = tokio::task::JoinSet::new();
    // Each controller task has a health check that fails once the task has ended.
    let mut spawn =
        |name: &str, run: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>| {
            let flag = Arc::new(std::sync::atomic::AtomicBool::new(true));
            let f = flag.clone();
            health.add(&format!("controller-{name}"), move || {
                if f.load(std::sync::atomic::Ordering::Relaxed) {
                    Ok(())
                } else {
                    Err("controller stopped".into())
                }
            });
            let exit = ExitFlag(flag);
            tasks.spawn(async move {
                run.await;
                drop(exit);
            });
        };
    let stop = CancellationToken::new();
    let _stop_on_exit = stop.clone().drop_guard();

    let node_queue = WorkQueue::new("node");
    let lb_node_events = WorkQueue::new("lb-nodes");
    let mut node_queues = Vec::new();
    if config.enabled.node {
        node_queues.push(node_queue.clone());
    }
    let load_balancer_api = provider.load_balancers().filter(|_| config.enabled.service);
    if load_balancer_api.is_some() {
        node_queues.push(lb_node_events.clone());
    }
    let nodes = informer::spawn(
        "nodes",
        Api::<Node>::all(client.clone()),
        node_queues,
        stop.clone(),
    );
    tokio::select! {
        r = nodes.wait_until_ready() => r.map_err(|e| CcmError::CacheSync(chain(&e).to_string()))?,
        _ = shutdown.cancelled() => return Ok(()),
    }
    let ctx = Context {
        client: client.clone(),
        identity: config.identity.clone(),
        nodes,
        recorder: Default::default(),
    };
    // Each controller acts (and records events) as its own identity.
    let ctx_for = |service_account: &str| Context {
        client: clients.controller(service_account),
        ..ctx.clone()
    };
    let instances = provider.instances();
    match (&instances, config.enabled.node) {
        (Some(i), true) => {
            let c = NodeController::new(
                ctx_for(credentials::NODE),
                i.clone(),
                node_queue,
                config.node_status_update_frequency,
                config.concurrent_node_syncs,
            );
            spawn("cloud-node", Box::pin(c.run(stop.clone())));
        }
        (None, true) => tracing::warn!(
            provider = provider.name(),
            "cloud-node controller disabled: the provider has no instances interface"
        ),
        _ => {}
    }
    match (&instances, config.enabled.node_lifecycle) {
        (Some(i), true) => {
            let c = NodeLifecycleController::new(
                ctx_for(credentials::NODE),
                i.clone(),
                config.node_monitor_period,
            );
            spawn("cloud-node-lifecycle", Box::pin(c.run(stop.clone())));
        }
        (None, true) => tracing::warn!(
            provider = provider.name(),
            "cloud-node-lifecycle controller disabled: the provider has no instances interface"
        ),
        _ => {}
    }
    if let Some(routes) = routes {
        let c = controllers::route::RouteController::new(
            ctx_for(credentials::ROUTE),
            routes,
            config.cluster_name.clone(),
            config.cluster_cidrs.clone(),
            config.route_reconciliation_period,
        );
        spawn("route", Box::pin(c.run(stop.clone())));
    }
    match (&instances, config.enabled.csr_approver) {
        (Some(i), true) => {
            use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
            let queue = WorkQueue::new("csr-approver");
            let csrs = informer::spawn(
                "certificatesigningrequests",
                Api::<CertificateSigningRequest>::all(client.clone()),
                vec![queue.clone()],
                stop.clone(),
            );
            tokio::select! {
                r = csrs.wait_until_ready() => r.map_err(|e| CcmError::CacheSync(e.to_string()))?,
                _ = shutdown.cancelled() => return Ok(()),
            }
            let c = controllers::csr_approver::CsrApprover::new(
                ctx_for(credentials::CSR_APPROVER),
                i.clone(),
                csrs,
                queue,
            );
            spawn(
                controllers::csr_approver::NAME,
                Box::pin(c.run(stop.clone())),
            );
        }
        (None, true) => tracing::warn!(
            provider = provider.name(),
            "kubelet-serving CSR approver disabled: the provider has no instances interface"
        ),
        _ => {}
    }
    if let Some(lbs) = load_balancer_api {
        // Assigns the addresses and publishes them in the Services' status; the pools'
        // holders serve them.
        let queue = WorkQueue::new("service");
        let services = informer::spawn(
            "services",
            Api::<k8s_openapi::api::core::v1::Service>::all(client.clone()),
            vec![queue.clone()],
            stop.clone(),
        );
        let endpoints = tokio::select! {
            e = endpoints::EndpointsCache::spawn(client.clone(), queue.clone(), stop.clone()) => e,
            _ = shutdown.cancelled() => None,
        };
        let Some(endpoints) = endpoints else {
            return Ok(());
        };
        tokio::select! {
            r = async {
                services.wait_until_ready().await.map_err(|e| chain(&e).to_string())?;
                endpoints.wait_until_ready().await
            } => r.map_err(CcmError::CacheSync)?,
            _ = shutdown.cancelled() => return Ok(()),
        }
        let c = controllers::service::ServiceController::new(
            ctx_for(credentials::SERVICE),
            lbs,
            services,
            endpoints,
            queue,
            lb_node_events,
            controllers::service::ServiceConfig {
                cluster_name: config.cluster_name.clone(),
                load_balancer_class: config.load_balancer_class.clone(),
                resync: config.lb_resync_period,
                workers: config.concurrent_service_syncs,
            },
        );
        spawn("service", Box::pin(c.run(stop.clone())));
    }
    tracing::info!(cluster = %config.cluster_name, enabled = ?config.enabled, "controllers started");
    let result = tokio::select! {
        _ = shutdown.cancelled() => Ok(()),
        _ = lost.cancelled() => Err(CcmError::LeadershipLost),
    };
    // Controllers clean up what only the leader may hold (the route controller its
    // host's routes) before we go.
    stop.cancel();
    leader_metric.set(0);
    let drained = tokio::time::timeout(STOP_TIMEOUT, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(timeout = ?STOP_TIMEOUT, "controllers did not stop in time");
    }
    // Only now, with the leader's addresses and routes gone, the lease: a standby
    // takes over at its next retry, and never while we still hold them.
    if let (Ok(()), Some(l)) = (&result, leadership) {
        l.release().await;
    }
    // The pools are let go of (each lease handed to a standby) whether we stop or
    // lost the controllers' lease.
    lb_shutdown.cancel();
    if let Some(lb) = load_balancers {
        let _ = lb.await;
    }
    result
}

/// How long controllers get to stop (and clean up) at shutdown or step-down.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Marks a controller dead (its health check fails) when dropped.
struct ExitFlag(Arc<std::sync::atomic::AtomicBool>);

impl Drop for ExitFlag {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controllers_flag_follows_upstream_syntax() {
        let p = |s: &[&str]| Enabled::parse(&s.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let all = p(&["*"]).unwrap();
        // Upstream's canonical names, aliases, and the first match winning.
        let upstream = p(&["*", "-node-route-controller", "-service-lb-controller"]).unwrap();
        assert!(upstream.node && upstream.node_lifecycle && !upstream.route && !upstream.service);
        assert!(!p(&["-cloud-node", "cloud-node-controller"]).unwrap().node);
        assert!(p(&["cloud-node-controller", "-cloud-node"]).unwrap().node);
        assert_eq!(
            p(&["cloud-node-controller", "cloud-node-lifecycle-controller"]).unwrap(),
            p(&["cloud-node", "cloud-node-lifecycle"]).unwrap()
        );
        assert!(all.node && all.node_lifecycle && all.route && all.service && all.csr_approver);
        assert!(
            !p(&["*", "-kubelet-serving-csr-approver"])
                .unwrap()
                .csr_approver
        );
        let no_route = p(&["*", "-route"]).unwrap();
        assert!(no_route.node && !no_route.route);
        let only = p(&["cloud-node"]).unwrap();
        assert!(only.node && !only.service);
        assert!(p(&["cloud-nodes"])
            .unwrap_err()
            .contains("unknown controller"));
        assert!(p(&["*", "-node-ipam-controller"]).unwrap().node);
        assert!(p(&["*", "node-ipam-controller"])
            .unwrap_err()
            .contains("kube-controller-manager"));
    }
}

//! Tether's cloud-controller-manager: the node, node-lifecycle, route and service
//! controllers of upstream's cloud-provider, on kube-rs, behind the provider traits in
//! [`cloud`]. One shared watch per resource feeds every controller ([`informer`]);
//! controllers work off keyed queues with per-key backoff ([`workqueue`]); only the
//! replica holding the leader Lease runs them ([`leader`]).

pub mod cloud;
pub mod controllers;
pub mod informer;
pub mod leader;
pub mod serving;
pub mod workqueue;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use tokio_util::sync::CancellationToken;

use crate::cloud::Provider;
use crate::controllers::{node::NodeController, node_lifecycle::NodeLifecycleController, Context};
use crate::workqueue::WorkQueue;

/// The controllers `--controllers` can name.
pub const CONTROLLERS: [&str; 5] = [
    "cloud-node",
    "cloud-node-lifecycle",
    "route",
    "service",
    controllers::csr_approver::NAME,
];

/// Which controllers run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enabled {
    /// `cloud-node`.
    pub node: bool,
    /// `cloud-node-lifecycle`.
    pub node_lifecycle: bool,
    /// `route`.
    pub route: bool,
    /// `service`.
    pub service: bool,
    /// `kubelet-serving-csr-approver`.
    pub csr_approver: bool,
}

impl Enabled {
    /// Parses `--controllers` (`*`, names, `-name` to disable; upstream's syntax).
    pub fn parse(list: &[String]) -> Result<Self, String> {
        let mut star = false;
        let mut on = std::collections::BTreeSet::new();
        let mut off = std::collections::BTreeSet::new();
        for item in list.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
            if item == "*" {
                star = true;
                continue;
            }
            let (set, name) = match item.strip_prefix('-') {
                Some(n) => (&mut off, n),
                None => (&mut on, item),
            };
            if !CONTROLLERS.contains(&name) {
                return Err(format!(
                    "--controllers: unknown controller {name:?} (known: {})",
                    CONTROLLERS.join(", ")
                ));
            }
            set.insert(name.to_string());
        }
        let is_on = |n: &str| !off.contains(n) && (star || on.contains(n));
        Ok(Enabled {
            node: is_on("cloud-node"),
            node_lifecycle: is_on("cloud-node-lifecycle"),
            route: is_on("route"),
            service: is_on("service"),
            csr_approver: is_on(controllers::csr_approver::NAME),
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
    /// `--cluster-cidr` (comma-separated, one per family); the route controller runs
    /// only when it is set and `--configure-cloud-routes` is true.
    pub cluster_cidrs: Vec<tether_core::identifiers::Cidr>,
    /// `--configure-cloud-routes` (true).
    pub configure_cloud_routes: bool,
    /// `--route-reconciliation-period` (10 s).
    pub route_reconciliation_period: Duration,
    /// Leader election; `None` with `--leader-elect=false`.
    pub leader_election: Option<leader::LeaderElection>,
    /// Reported as the event source.
    pub identity: String,
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
    client: kube::Client,
    provider: Arc<dyn Provider>,
    config: CcmConfig,
    health: serving::Health,
    shutdown: CancellationToken,
) -> Result<(), CcmError> {
    let lost = match &config.leader_election {
        Some(le) => match leader::lead(client.clone(), le.clone(), shutdown.clone()).await {
            Some(lost) => lost,
            None => return Ok(()),
        },
        None => CancellationToken::new(),
    };
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
    let lbs = provider.load_balancers();
    let run_service = match (&lbs, config.enabled.service) {
        (Some(_), true) => true,
        (None, true) => {
            tracing::warn!(provider = provider.name(), "service controller disabled: the provider has no load balancers (tether: set --lb-bind-address and --tunnel-uds)");
            false
        }
        _ => false,
    };
    let mut node_queues = Vec::new();
    if config.enabled.node {
        node_queues.push(node_queue.clone());
    }
    if run_service {
        node_queues.push(lb_node_events.clone());
    }
    let nodes = informer::spawn(
        "nodes",
        Api::<Node>::all(client.clone()),
        node_queues,
        stop.clone(),
    );
    tokio::select! {
        r = nodes.wait_until_ready() => r.map_err(|e| CcmError::CacheSync(e.to_string()))?,
        _ = shutdown.cancelled() => return Ok(()),
    }
    let ctx = Context {
        client: client.clone(),
        identity: config.identity.clone(),
        nodes,
    };
    let instances = provider.instances();
    match (&instances, config.enabled.node) {
        (Some(i), true) => {
            let c = NodeController::new(
                ctx.clone(),
                i.clone(),
                node_queue,
                config.node_status_update_frequency,
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
            let c =
                NodeLifecycleController::new(ctx.clone(), i.clone(), config.node_monitor_period);
            spawn("cloud-node-lifecycle", Box::pin(c.run(stop.clone())));
        }
        (None, true) => tracing::warn!(
            provider = provider.name(),
            "cloud-node-lifecycle controller disabled: the provider has no instances interface"
        ),
        _ => {}
    }
    if config.enabled.route {
        match (
            provider.routes(),
            config.configure_cloud_routes,
            config.cluster_cidrs.is_empty(),
        ) {
            (_, false, _) => {
                tracing::info!("route controller not started: --configure-cloud-routes=false")
            }
            (_, true, true) => {
                tracing::info!("route controller not started: --cluster-cidr is not set")
            }
            (None, true, false) => tracing::warn!(
                provider = provider.name(),
                "route controller not started: the provider has no routes interface"
            ),
            (Some(routes), true, false) => {
                let c = controllers::route::RouteController::new(
                    ctx.clone(),
                    routes,
                    config.cluster_name.clone(),
                    config.cluster_cidrs.clone(),
                    config.route_reconciliation_period,
                );
                spawn("route", Box::pin(c.run(stop.clone())));
            }
        }
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
            let c =
                controllers::csr_approver::CsrApprover::new(ctx.clone(), i.clone(), csrs, queue);
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
    if let (Some(lbs), true) = (lbs, run_service) {
        let queue = WorkQueue::new("service");
        let services = informer::spawn(
            "services",
            Api::<k8s_openapi::api::core::v1::Service>::all(client.clone()),
            vec![queue.clone()],
            stop.clone(),
        );
        tokio::select! {
            r = services.wait_until_ready() => r.map_err(|e| CcmError::CacheSync(e.to_string()))?,
            _ = shutdown.cancelled() => return Ok(()),
        }
        let c = controllers::service::ServiceController::new(
            ctx.clone(),
            lbs,
            services,
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
    tokio::select! {
        _ = shutdown.cancelled() => {
            stop.cancel();
            while tasks.join_next().await.is_some() {}
            Ok(())
        }
        _ = lost.cancelled() => {
            stop.cancel();
            Err(CcmError::LeadershipLost)
        }
    }
}

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
    }
}

//! The controller manager's life: start the load balancers' data plane (every
//! replica), elect, spawn the controllers once leader, wait for the drain (SIGTERM) or
//! a lost lease, then stop in order (controllers, the leader lease, the pools).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;
use k8s_openapi::api::core::v1::{Node, Service};
use kube::Api;
use tether_core::error::chain;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::cloud::{Provider, Routes};
use crate::controllers::{self, node::NodeController, node_lifecycle::NodeLifecycleController};
use crate::controllers::{csr_approver::CsrApprover, Context};
use crate::workqueue::WorkQueue;
use crate::{credentials, endpoints, informer, leader, serving, CcmConfig, CcmError};

/// How long controllers get to stop (and clean up) at the drain or step-down.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs the controllers (once leader, if electing) until `drain`. `health` gets a
/// `leader-election` check and one check per running controller.
pub async fn run(
    clients: impl Into<credentials::Clients>,
    provider: Arc<dyn Provider>,
    config: CcmConfig,
    health: serving::Health,
    drain: CancellationToken,
) -> Result<(), CcmError> {
    let clients: credentials::Clients = clients.into();
    let routes = routes_to_run(provider.as_ref(), &config);
    let leader_metric = config.metrics.leader.with_label_values(&[config
        .leader_election
        .as_ref()
        .map(|le| le.name.as_str())
        .unwrap_or("cloud-controller-manager")]);
    leader_metric.set(0);
    let data_plane = DataPlane::start(provider.as_ref(), &clients, &config, &health, &drain);
    if config.enabled.service && provider.load_balancers().is_none() {
        tracing::warn!(provider = provider.name(), "service controller disabled: the provider has no load balancers (tether: set --tunnel-uds, and loadBalancer pools in the cloud config or --lb-bind-address)");
    }
    let Some((lost, leadership)) = elect(&clients, &config, routes.as_deref(), &drain).await else {
        data_plane.drain().await;
        return Ok(());
    };
    leader_metric.set(1);
    let lease = lost.clone();
    health.add("leader-election", move || match lease.is_cancelled() {
        true => Err("leader lease lost".into()),
        false => Ok(()),
    });
    let mut running = Controllers::new(health);
    let result = lead(
        &mut running,
        &clients,
        &provider,
        &config,
        routes,
        &drain,
        &lost,
    )
    .await;
    // Controllers clean up what only the leader may hold (the route controller its
    // host's routes) before we go.
    running.stop().await;
    leader_metric.set(0);
    // Only now, with the leader's addresses and routes gone, the lease: a standby
    // takes over at its next retry, and never while we still hold them.
    if let (Ok(()), Some(l)) = (&result, leadership) {
        l.release().await;
    }
    // The pools are let go of (each lease handed to a standby) whether we drain or
    // lost the controllers' lease.
    data_plane.drain().await;
    result
}

/// Starts the controllers and runs them until `drain` (`Ok`) or until the lease is
/// lost.
async fn lead(
    running: &mut Controllers,
    clients: &credentials::Clients,
    provider: &Arc<dyn Provider>,
    config: &CcmConfig,
    routes: Option<Arc<dyn Routes>>,
    drain: &CancellationToken,
    lost: &CancellationToken,
) -> Result<(), CcmError> {
    if !running
        .start(clients, provider, config, routes, drain)
        .await?
    {
        return Ok(());
    }
    tracing::info!(cluster = %config.cluster_name, enabled = ?config.enabled, "controllers started");
    tokio::select! {
        _ = drain.cancelled() => Ok(()),
        _ = lost.cancelled() => Err(CcmError::LeadershipLost),
    }
}

/// The route controller's provider, when it is on, the provider has routes, and
/// `--configure-cloud-routes` and `--cluster-cidr` allow it; logs why not otherwise.
fn routes_to_run(provider: &dyn Provider, config: &CcmConfig) -> Option<Arc<dyn Routes>> {
    if !config.enabled.route {
        return None;
    }
    let Some(routes) = provider.routes() else {
        tracing::info!(
            provider = provider.name(),
            "route controller not started: the provider has no routes configured"
        );
        return None;
    };
    if !config.configure_cloud_routes {
        tracing::info!("route controller not started: --configure-cloud-routes=false");
        return None;
    }
    if config.cluster_cidrs.is_empty() {
        tracing::info!("route controller not started: --cluster-cidr is not set");
        return None;
    }
    Some(routes)
}

/// Waits for the leader lease (at once without election). `None`: `drain` came first.
/// Routes a former leader on this host left behind (it crashed, or lost its lease) go
/// before we stand by: only the leader's host routes.
async fn elect(
    clients: &credentials::Clients,
    config: &CcmConfig,
    routes: Option<&dyn Routes>,
    drain: &CancellationToken,
) -> Option<(CancellationToken, Option<leader::Leadership>)> {
    let Some(le) = &config.leader_election else {
        return Some((CancellationToken::new(), None));
    };
    if let Some(r) = routes {
        controllers::route::remove_ours(r, &config.cluster_name, &config.cluster_cidrs)
            .instrument(tracing::info_span!("route_cleanup"))
            .await;
    }
    let l = leader::lead(clients.root.clone(), le.clone(), drain.clone()).await?;
    Some((l.lost.clone(), Some(l)))
}

/// What the provider runs on every replica beside the controllers
/// ([`Provider::initialize`]; the `tether` provider's load balancers, each replica
/// serving the pools whose leases it holds).
struct DataPlane {
    drain: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl DataPlane {
    fn start(
        provider: &dyn Provider,
        clients: &credentials::Clients,
        config: &CcmConfig,
        health: &serving::Health,
        drain: &CancellationToken,
    ) -> Self {
        let drain = drain.child_token();
        let replica = crate::cloud::Replica {
            client: clients.root.clone(),
            lease: config.load_balancer_lease.clone(),
            load_balancer_class: config.load_balancer_class.clone(),
            resync: config.lb_resync_period,
            workers: config.concurrent_service_syncs,
            identity: config.identity.clone(),
            drain: drain.clone(),
        };
        // What the provider runs on every replica is its load balancers: only with the
        // service controller on.
        let run = config
            .enabled
            .service
            .then(|| provider.initialize(replica))
            .flatten();
        let Some(run) = run else {
            return DataPlane { drain, task: None };
        };
        // Its health check fails once it has ended before the drain (say, its caches
        // never synced): this replica then serves no pool.
        let exit = ExitFlag::default();
        let (serving, draining) = (exit.0.clone(), drain.clone());
        health.add("load-balancers", move || {
            if serving.load(Ordering::Relaxed) || draining.is_cancelled() {
                Ok(())
            } else {
                Err("the load balancers' data plane stopped".into())
            }
        });
        let task = tokio::spawn(
            async move {
                run.await;
                drop(exit);
            }
            .instrument(tracing::info_span!("load_balancers")),
        );
        DataPlane {
            drain,
            task: Some(task),
        }
    }

    /// Lets go of the pools and waits until they are let go.
    async fn drain(mut self) {
        self.drain.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for DataPlane {
    /// An early return lets go of the pools too (in the background).
    fn drop(&mut self) {
        self.drain.cancel();
    }
}

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

/// The running controllers: each a task with a health check that fails once it ended.
struct Controllers {
    health: serving::Health,
    tasks: JoinSet<()>,
    hard_stop: CancellationToken,
}

impl Controllers {
    fn new(health: serving::Health) -> Self {
        Controllers {
            health,
            tasks: JoinSet::new(),
            hard_stop: CancellationToken::new(),
        }
    }

    fn spawn(&mut self, name: &str, run: Task) {
        let exit = ExitFlag::default();
        let running = exit.0.clone();
        self.health.add(&format!("controller-{name}"), move || {
            if running.load(Ordering::Relaxed) {
                Ok(())
            } else {
                Err("controller stopped".into())
            }
        });
        self.tasks.spawn(async move {
            run.await;
            drop(exit);
        });
    }

    /// Starts every enabled controller the provider supports. `Ok(false)`: `drain`
    /// came while a cache synced.
    async fn start(
        &mut self,
        clients: &credentials::Clients,
        provider: &Arc<dyn Provider>,
        config: &CcmConfig,
        routes: Option<Arc<dyn Routes>>,
        drain: &CancellationToken,
    ) -> Result<bool, CcmError> {
        let client = clients.root.clone();
        let node_queue = WorkQueue::new("node", &config.metrics);
        let lb_node_events = WorkQueue::new("lb-nodes", &config.metrics);
        let load_balancers = provider.load_balancers().filter(|_| config.enabled.service);
        let mut node_queues = Vec::new();
        if config.enabled.node {
            node_queues.push(node_queue.clone());
        }
        if load_balancers.is_some() {
            node_queues.push(lb_node_events.clone());
        }
        let Some(nodes) = self.watch_nodes(&client, node_queues, drain).await? else {
            return Ok(false);
        };
        let ctx = Context {
            client: client.clone(),
            identity: config.identity.clone(),
            nodes,
            recorder: Default::default(),
            metrics: config.metrics.clone(),
        };
        // Each controller acts (and records events) as its own identity.
        let ctx_for = |service_account: &str| Context {
            client: clients.controller(service_account),
            ..ctx.clone()
        };
        self.start_node_controllers(provider, config, node_queue, &ctx_for);
        if let Some(routes) = routes {
            self.start_route(ctx_for(credentials::ROUTE), routes, config);
        }
        // The watches run as the controller manager, as the node watch does; each
        // controller acts as its own identity.
        let ctx = ctx_for(credentials::CSR_APPROVER);
        if !self
            .start_csr_approver(&client, provider, config, ctx, drain)
            .await?
        {
            return Ok(false);
        }
        match load_balancers {
            Some(lbs) => {
                let ctx = ctx_for(credentials::SERVICE);
                self.start_service(&client, ctx, lbs, config, lb_node_events, drain)
                    .await
            }
            None => Ok(true),
        }
    }

    /// The shared node cache, feeding `queues`, once synced. `None`: `drain` came
    /// first.
    async fn watch_nodes(
        &self,
        client: &kube::Client,
        queues: Vec<Arc<WorkQueue>>,
        drain: &CancellationToken,
    ) -> Result<Option<kube::runtime::reflector::Store<Node>>, CcmError> {
        let nodes = informer::spawn(
            "nodes",
            Api::<Node>::all(client.clone()),
            queues,
            self.hard_stop.clone(),
        );
        tokio::select! {
            r = nodes.wait_until_ready() => r.map_err(|e| CcmError::CacheSync(chain(&e).to_string()))?,
            _ = drain.cancelled() => return Ok(None),
        }
        Ok(Some(nodes))
    }

    /// The route controller over `routes`.
    fn start_route(&mut self, ctx: Context, routes: Arc<dyn Routes>, config: &CcmConfig) {
        let c = controllers::route::RouteController::new(
            ctx,
            routes,
            config.cluster_name.clone(),
            config.cluster_cidrs.clone(),
            config.route_reconciliation_period,
        );
        self.spawn("route", Box::pin(c.run(self.hard_stop.clone())));
    }

    /// The cloud-node and cloud-node-lifecycle controllers, which need instances.
    fn start_node_controllers(
        &mut self,
        provider: &Arc<dyn Provider>,
        config: &CcmConfig,
        queue: Arc<WorkQueue>,
        ctx_for: &dyn Fn(&str) -> Context,
    ) {
        let instances = provider.instances();
        let missing = |what: &str| {
            tracing::warn!(
                provider = provider.name(),
                "{what} disabled: the provider has no instances interface"
            )
        };
        match (&instances, config.enabled.node) {
            (Some(i), true) => {
                let c = NodeController::new(
                    ctx_for(credentials::NODE),
                    i.clone(),
                    queue,
                    config.node_status_update_frequency,
                    config.concurrent_node_syncs,
                );
                self.spawn("cloud-node", Box::pin(c.run(self.hard_stop.clone())));
            }
            (None, true) => missing("cloud-node controller"),
            _ => {}
        }
        match (&instances, config.enabled.node_lifecycle) {
            (Some(i), true) => {
                let c = NodeLifecycleController::new(
                    ctx_for(credentials::NODE),
                    i.clone(),
                    config.node_monitor_period,
                );
                self.spawn(
                    "cloud-node-lifecycle",
                    Box::pin(c.run(self.hard_stop.clone())),
                );
            }
            (None, true) => missing("cloud-node-lifecycle controller"),
            _ => {}
        }
    }

    /// The kubelet-serving CSR approver, once its CSR cache synced. `Ok(false)`:
    /// `drain` came first.
    async fn start_csr_approver(
        &mut self,
        client: &kube::Client,
        provider: &Arc<dyn Provider>,
        config: &CcmConfig,
        ctx: Context,
        drain: &CancellationToken,
    ) -> Result<bool, CcmError> {
        if !config.enabled.csr_approver {
            return Ok(true);
        }
        let Some(instances) = provider.instances() else {
            tracing::warn!(
                provider = provider.name(),
                "kubelet-serving CSR approver disabled: the provider has no instances interface"
            );
            return Ok(true);
        };
        let queue = WorkQueue::new("csr-approver", &config.metrics);
        let csrs = informer::spawn(
            "certificatesigningrequests",
            Api::<CertificateSigningRequest>::all(client.clone()),
            vec![queue.clone()],
            self.hard_stop.clone(),
        );
        tokio::select! {
            r = csrs.wait_until_ready() => r.map_err(|e| CcmError::CacheSync(chain(&e).to_string()))?,
            _ = drain.cancelled() => return Ok(false),
        }
        let c = CsrApprover::new(ctx, instances, csrs, queue);
        self.spawn(
            controllers::csr_approver::NAME,
            Box::pin(c.run(self.hard_stop.clone())),
        );
        Ok(true)
    }

    /// The service controller, once its Service and endpoint caches synced: it
    /// assigns the addresses and publishes them in the Services' status; the pools'
    /// holders serve them. `Ok(false)`: `drain` came first.
    async fn start_service(
        &mut self,
        client: &kube::Client,
        ctx: Context,
        lbs: Arc<dyn crate::cloud::LoadBalancers>,
        config: &CcmConfig,
        node_events: Arc<WorkQueue>,
        drain: &CancellationToken,
    ) -> Result<bool, CcmError> {
        let queue = WorkQueue::new("service", &config.metrics);
        let services = informer::spawn(
            "services",
            Api::<Service>::all(client.clone()),
            vec![queue.clone()],
            self.hard_stop.clone(),
        );
        let endpoints = tokio::select! {
            e = endpoints::EndpointsCache::spawn(client.clone(), queue.clone(), self.hard_stop.clone()) => e,
            _ = drain.cancelled() => None,
        };
        let Some(endpoints) = endpoints else {
            return Ok(false);
        };
        tokio::select! {
            r = async {
                services.wait_until_ready().await.map_err(|e| chain(&e).to_string())?;
                endpoints.wait_until_ready().await
            } => r.map_err(CcmError::CacheSync)?,
            _ = drain.cancelled() => return Ok(false),
        }
        let c = controllers::service::ServiceController::new(
            ctx,
            lbs,
            services,
            endpoints,
            queue,
            node_events,
            controllers::service::ServiceConfig {
                cluster_name: config.cluster_name.clone(),
                load_balancer_class: config.load_balancer_class.clone(),
                resync: config.lb_resync_period,
                workers: config.concurrent_service_syncs,
            },
        );
        self.spawn("service", Box::pin(c.run(self.hard_stop.clone())));
        Ok(true)
    }

    /// Stops every controller and waits (at most [`STOP_TIMEOUT`]) for them to clean
    /// up.
    async fn stop(mut self) {
        self.hard_stop.cancel();
        let drained = tokio::time::timeout(STOP_TIMEOUT, async {
            while self.tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(timeout = ?STOP_TIMEOUT, "controllers did not stop in time");
        }
    }
}

impl Drop for Controllers {
    fn drop(&mut self) {
        self.hard_stop.cancel();
    }
}

/// Marks a task dead (its health check fails) when dropped.
struct ExitFlag(Arc<AtomicBool>);

impl Default for ExitFlag {
    fn default() -> Self {
        ExitFlag(Arc::new(AtomicBool::new(true)))
    }
}

impl Drop for ExitFlag {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Relaxed);
    }
}

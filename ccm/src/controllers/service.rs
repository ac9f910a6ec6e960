//! The service controller: every Service of type LoadBalancer without a
//! `loadBalancerClass` (or with `--load-balancer-class`) gets the finalizer
//! `service.kubernetes.io/load-balancer-cleanup`, a load balancer from the provider over
//! the eligible nodes, and `status.loadBalancer.ingress`, with events at each step. When
//! the Service is deleted or stops being a LoadBalancer, the balancer is deleted, the
//! status cleared and the finalizer removed. A change in the eligible node set updates
//! every balancer. Failures are retried per Service with backoff (5 s doubling to
//! 300 s), and every `--lb-resync-period` all balancers are ensured again (drift repair,
//! which upstream lacks).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tether_core::error::chain;

use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::ResourceExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{Context, SyncError, Target};
use crate::cloud::{Backend, CloudError, LoadBalancerStatus, LoadBalancers, ServiceInfo};
use crate::endpoints::EndpointsCache;
use crate::translate::{
    backends, backends_for, is_ours, service_info, service_warnings, without_endpoints,
};
use crate::workqueue::{Outcome, WorkQueue};

/// Our finalizer on Services with a balancer.
pub const FINALIZER: &str = "service.kubernetes.io/load-balancer-cleanup";

/// Settings of the service controller.
#[derive(Debug, Clone)]
pub struct ServiceConfig {
    /// `--cluster-name`, passed to the provider.
    pub cluster_name: String,
    /// `--load-balancer-class`: Services with this class are ours too.
    pub load_balancer_class: Option<String>,
    /// How often every balancer is ensured again.
    pub resync: Duration,
    /// Services synced at once (`--concurrent-service-syncs`).
    pub workers: usize,
}

/// The service controller.
pub struct ServiceController {
    ctx: Context,
    lbs: Arc<dyn LoadBalancers>,
    services: Store<Service>,
    endpoints: EndpointsCache,
    queue: Arc<WorkQueue>,
    node_events: Arc<WorkQueue>,
    cfg: ServiceConfig,
    /// Balancers we ensured, by Service key, with the nodes they were given (to clean
    /// up one whose Service vanished, and to call `update` when only nodes changed).
    applied: Mutex<HashMap<String, (ServiceInfo, Vec<Backend>)>>,
    /// Services the provider refused as written (event sent), by key: not asked again
    /// until the Service changes or a balancer goes away (freeing what it held).
    refused: Mutex<HashMap<String, ServiceInfo>>,
    /// The refusal last said (reason, message) per Service: a retry after another
    /// balancer went away that ends in the same refusal says nothing new.
    said: Mutex<HashMap<String, (String, String)>>,
    /// Whether the apiserver keeps `ipMode`.
    ip_mode: IpModeSupport,
}

/// Whether the apiserver keeps `status.loadBalancer.ingress[].ipMode` (Kubernetes 1.30+,
/// or 1.29 with its feature gate), learnt from its answer to the first write of it:
/// until it is known to drop the field, a stored status without `ipMode: Proxy` is a
/// change to write (a Service addressed before an upgrade to 1.30 gets it then).
#[derive(Default)]
pub(crate) struct IpModeSupport(std::sync::atomic::AtomicU8);

impl IpModeSupport {
    const DROPPED: u8 = 2;
    const KEPT: u8 = 1;

    fn dropped(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed) == Self::DROPPED
    }

    /// Learns from what the apiserver stored after a write of `wanted`.
    fn learn(&self, wanted: &serde_json::Value, stored: &serde_json::Value) {
        use std::sync::atomic::Ordering;
        if without_ip_mode(wanted) == *wanted {
            return;
        }
        if stored == wanted {
            self.0.store(Self::KEPT, Ordering::Relaxed);
        } else if without_ip_mode(stored) == without_ip_mode(wanted)
            && self.0.swap(Self::DROPPED, Ordering::Relaxed) != Self::DROPPED
        {
            tracing::warn!("the apiserver drops status.loadBalancer.ingress[].ipMode (Kubernetes before 1.30): kube-proxy captures the load balancers' addresses on every node it runs on; keep it off the hosts that hold them (docs/ccm.md#before-kubernetes-130)");
        }
    }

    /// Must `current` be replaced by `wanted`?
    fn differs(&self, current: &serde_json::Value, wanted: &serde_json::Value) -> bool {
        current != wanted
            && !(self.dropped() && without_ip_mode(current) == without_ip_mode(wanted))
    }
}

impl ServiceController {
    /// A controller over `services` (fed into `queue`, as are `endpoints`' changes, for
    /// `externalTrafficPolicy: Local`); `node_events` receives node keys from the node
    /// watch.
    pub fn new(
        ctx: Context,
        lbs: Arc<dyn LoadBalancers>,
        services: Store<Service>,
        endpoints: EndpointsCache,
        queue: Arc<WorkQueue>,
        node_events: Arc<WorkQueue>,
        cfg: ServiceConfig,
    ) -> Self {
        ServiceController {
            ctx,
            lbs,
            services,
            endpoints,
            queue,
            node_events,
            cfg,
            applied: Mutex::new(HashMap::new()),
            refused: Mutex::new(HashMap::new()),
            said: Mutex::new(HashMap::new()),
            ip_mode: IpModeSupport::default(),
        }
    }

    fn ours(&self, svc: &Service) -> bool {
        is_ours(svc, self.cfg.load_balancer_class.as_deref())
    }

    fn queue_all_balancers(&self) {
        for svc in self.services.state() {
            if self.ours(&svc) || has_finalizer(&svc) {
                self.queue.add(&crate::informer::key(svc.as_ref()));
            }
        }
    }

    /// Runs until `hard_stop`, then lets the provider release what only the leader
    /// holds.
    pub async fn run(self, hard_stop: CancellationToken) {
        let this = Arc::new(self);
        this.restore_held().await;
        this.spawn_node_set_watch();
        this.spawn_resync(hard_stop.clone());
        {
            let (n, hard_stop) = (this.node_events.clone(), hard_stop.clone());
            tokio::spawn(async move {
                hard_stop.cancelled().await;
                n.shut_down();
            });
        }
        // `--concurrent-service-syncs` workers.
        let (queue, workers) = (this.queue.clone(), this.cfg.workers);
        let last = this.clone();
        queue
            .work(workers, hard_stop, move |key| {
                let this = this.clone();
                async move {
                    let result = this
                        .sync(&key)
                        .instrument(tracing::debug_span!("sync_service", service = %key))
                        .await;
                    super::outcome_of(result, "service", &key)
                }
            })
            .await;
        last.lbs.release_all(&last.cfg.cluster_name).await;
    }

    /// Tells the provider what the Services' status shows they hold, so that it stays
    /// theirs whatever order they sync in.
    async fn restore_held(&self) {
        let held: Vec<ServiceInfo> = self
            .services
            .state()
            .iter()
            // Every one of ours, with an ingress or not: a provider that keeps its own
            // record (the tether provider) restores by UID, so a status cleared while
            // no leader ran costs a Service nothing.
            .filter(|s| self.ours(s))
            .map(|s| service_info(s, &self.endpoints))
            .collect();
        self.lbs.restore(&self.cfg.cluster_name, &held).await;
    }

    /// Spawns the task that queues every balancer when the node set changes.
    fn spawn_node_set_watch(self: &Arc<Self>) {
        let this = self.clone();
        tokio::spawn(
            async move {
                let mut last = this.backends();
                while let Some(key) = this.node_events.next().await {
                    this.node_events.done(key, Outcome::Done);
                    let now = this.backends();
                    if now != last {
                        tracing::info!(
                            nodes = now.len(),
                            "load balancer node set changed; updating balancers"
                        );
                        last = now;
                        this.queue_all_balancers();
                    }
                }
            }
            .instrument(tracing::info_span!("lb_node_set")),
        );
    }

    /// Spawns the drift repair: every resync period, every balancer (refused ones
    /// included) is queued again, until `hard_stop`.
    fn spawn_resync(self: &Arc<Self>, hard_stop: CancellationToken) {
        let this = self.clone();
        tokio::spawn(
            async move {
                let mut tick = super::Ticker::new(this.cfg.resync);
                tick.next(&hard_stop).await;
                while tick.next(&hard_stop).await {
                    // Refused Services too: what they wanted may be free now
                    // (pools grew, a Service changed); the same refusal is not
                    // said again.
                    this.retry_refused();
                    this.queue_all_balancers();
                }
            }
            .instrument(tracing::info_span!("lb_resync")),
        );
    }

    /// Nodes eligible as backends.
    pub fn backends(&self) -> Vec<Backend> {
        backends(&self.ctx.nodes)
    }

    /// The backends of `svc`.
    pub fn backends_for(&self, svc: &Service) -> Vec<Backend> {
        backends_for(&self.ctx.nodes, &self.endpoints, svc)
    }

    /// Brings the balancer of Service `key` (`namespace/name`) in line.
    pub async fn sync(&self, key: &str) -> Result<(), SyncError> {
        let (ns, name) = key.split_once('/').unwrap_or(("default", key));
        let svc = self.services.get(&ObjectRef::new(name).within(ns));
        let Some(svc) = svc else {
            // Gone (without our finalizer, e.g. deleted with --cascade=orphan of
            // finalizers): drop any balancer we made for it.
            self.refused().remove(key);
            self.said().remove(key);
            let info = self.applied().remove(key);
            if let Some((info, _)) = info {
                self.lbs.delete(&self.cfg.cluster_name, &info).await?;
                self.retry_refused();
            }
            return Ok(());
        };
        let wants = self.ours(&svc) && svc.metadata.deletion_timestamp.is_none();
        if wants {
            self.ensure(key, &svc).await
        } else if has_finalizer(&svc) || self.applied().contains_key(key) {
            self.cleanup(key, &svc).await
        } else {
            Ok(())
        }
    }

    fn applied(&self) -> std::sync::MutexGuard<'_, HashMap<String, (ServiceInfo, Vec<Backend>)>> {
        self.applied.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn refused(&self) -> std::sync::MutexGuard<'_, HashMap<String, ServiceInfo>> {
        self.refused.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn said(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, String)>> {
        self.said.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A balancer went away or moved, or it is time to resync: what was refused for want
    /// of addresses or ports may fit now.
    fn retry_refused(&self) {
        for key in std::mem::take(&mut *self.refused()).into_keys() {
            self.queue.add(&key);
        }
    }

    /// Gives `svc` its finalizer, its balancer and its ingress, with events; a Service
    /// refused as written is not asked for again until it changes.
    async fn ensure(&self, key: &str, svc: &Service) -> Result<(), SyncError> {
        let api: Api<Service> = Api::namespaced(
            self.ctx.client.clone(),
            &svc.namespace().unwrap_or_default(),
        );
        let target = target(svc);
        if !has_finalizer(svc) {
            let mut finalizers = svc.finalizers().to_vec();
            finalizers.push(FINALIZER.into());
            set_finalizers(&api, svc, &finalizers).await?;
        }
        let info = service_info(svc, &self.endpoints);
        // A refusal is about the Service as written (addresses, ports, annotations),
        // never its endpoints: pods coming and going must not say it again.
        if self.refused().get(key) == Some(&without_endpoints(&info)) {
            // Said once already; nothing changed since.
            return Ok(());
        }
        self.refused().remove(key);
        let nodes = self.backends_for(svc);
        let before = self.applied().get(key).cloned();
        // Same Service, new node set: just point the balancer at the new nodes.
        if let Some((applied, old_nodes)) = &before {
            if *applied == info && *old_nodes != nodes && has_ingress(svc) {
                return self.update_nodes(key, &target, info, nodes).await;
            }
        }
        let first = before.is_none();
        self.say_ensuring(&target, svc, &info, first).await;
        let ensured = self.ensure_balancer(key, &target, &info, &nodes, before.as_ref());
        let Some(status) = ensured.await? else {
            return Ok(());
        };
        set_ingress(&api, svc, &status, &self.ip_mode).await?;
        self.applied()
            .insert(key.to_string(), (info, nodes.clone()));
        if first {
            tracing::info!(service = %key, ingress = ?status.ips, nodes = nodes.len(), "load balancer ensured");
            self.ctx
                .event(
                    &target,
                    false,
                    "EnsuredLoadBalancer",
                    "EnsureLoadBalancer",
                    "Ensured load balancer".into(),
                )
                .await;
        }
        Ok(())
    }

    /// Events before ensuring: what in `svc` cannot be served as written, and, for a
    /// `first` ensure, that its balancer is being ensured.
    async fn say_ensuring(&self, target: &Target, svc: &Service, info: &ServiceInfo, first: bool) {
        for (reason, note) in service_warnings(svc, info) {
            self.ctx
                .event(target, true, reason, "EnsureLoadBalancer", note)
                .await;
        }
        if first {
            self.ctx
                .event(
                    target,
                    false,
                    "EnsuringLoadBalancer",
                    "EnsureLoadBalancer",
                    "Ensuring load balancer".into(),
                )
                .await;
        }
    }

    /// Points the balancer of an unchanged Service at a new node set, with an event.
    async fn update_nodes(
        &self,
        key: &str,
        target: &Target,
        info: ServiceInfo,
        nodes: Vec<Backend>,
    ) -> Result<(), SyncError> {
        self.ctx.metrics.lb_syncs.inc();
        let started = std::time::Instant::now();
        let updated = self.lbs.update(&self.cfg.cluster_name, &info, &nodes).await;
        self.ctx
            .metrics
            .lb_nodesync_latency
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = updated {
            self.ctx
                .event(
                    target,
                    true,
                    "SyncLoadBalancerFailed",
                    "UpdateLoadBalancer",
                    format!("Error updating load balancer with new hosts: {}", chain(&e)),
                )
                .await;
            return Err(e.into());
        }
        self.applied()
            .insert(key.to_string(), (info, nodes.clone()));
        self.ctx
            .event(
                target,
                false,
                "UpdatedLoadBalancer",
                "UpdateLoadBalancer",
                format!(
                    "Updated load balancer with new hosts ({} nodes)",
                    nodes.len()
                ),
            )
            .await;
        Ok(())
    }

    /// Asks the provider for the balancer of `info` over `nodes`: its status, or `None`
    /// when it is refused as written (said once in an event, and remembered).
    async fn ensure_balancer(
        &self,
        key: &str,
        target: &Target,
        info: &ServiceInfo,
        nodes: &[Backend],
        before: Option<&(ServiceInfo, Vec<Backend>)>,
    ) -> Result<Option<LoadBalancerStatus>, SyncError> {
        self.ctx.metrics.lb_syncs.inc();
        match self.lbs.ensure(&self.cfg.cluster_name, info, nodes).await {
            Ok(s) => {
                self.said().remove(key);
                // A changed Service may have moved off an address (or port) that a
                // refused one was waiting for.
                if before.is_some_and(|(applied, _)| applied != info) {
                    self.retry_refused();
                }
                Ok(Some(s))
            }
            Err(CloudError::Refused { reason, message }) => {
                let said = (reason.to_string(), message.clone());
                if self.said().get(key) != Some(&said) {
                    tracing::info!(service = %key, %reason, %message, "load balancer refused as written");
                    self.ctx
                        .event(target, true, &reason, "EnsureLoadBalancer", message)
                        .await;
                    self.said().insert(key.to_string(), said);
                }
                self.refused()
                    .insert(key.to_string(), without_endpoints(info));
                Ok(None)
            }
            Err(e) => {
                self.ctx
                    .event(
                        target,
                        true,
                        "SyncLoadBalancerFailed",
                        "EnsureLoadBalancer",
                        format!("Error syncing load balancer: {}", chain(&e)),
                    )
                    .await;
                Err(e.into())
            }
        }
    }

    /// Deletes `svc`'s balancer, clears its ingress and takes our finalizer off, with
    /// events.
    async fn cleanup(&self, key: &str, svc: &Service) -> Result<(), SyncError> {
        let api: Api<Service> = Api::namespaced(
            self.ctx.client.clone(),
            &svc.namespace().unwrap_or_default(),
        );
        let target = target(svc);
        self.ctx
            .event(
                &target,
                false,
                "DeletingLoadBalancer",
                "DeleteLoadBalancer",
                "Deleting load balancer".into(),
            )
            .await;
        self.delete_balancer(key, svc, &target).await?;
        release_service(&api, svc).await?;
        tracing::info!(service = %key, "load balancer deleted");
        self.ctx
            .event(
                &target,
                false,
                "DeletedLoadBalancer",
                "DeleteLoadBalancer",
                "Deleted load balancer".into(),
            )
            .await;
        Ok(())
    }

    /// Has the provider delete the balancer of Service `key` (an event says why it
    /// could not) and forgets it; what was refused may fit now.
    async fn delete_balancer(
        &self,
        key: &str,
        svc: &Service,
        target: &Target,
    ) -> Result<(), SyncError> {
        let info = self
            .applied()
            .get(key)
            .map(|(info, _)| info.clone())
            .unwrap_or_else(|| service_info(svc, &self.endpoints));
        self.refused().remove(key);
        self.said().remove(key);
        if let Err(e) = self.lbs.delete(&self.cfg.cluster_name, &info).await {
            self.ctx
                .event(
                    target,
                    true,
                    "SyncLoadBalancerFailed",
                    "DeleteLoadBalancer",
                    format!("Error deleting load balancer: {}", chain(&e)),
                )
                .await;
            return Err(e.into());
        }
        self.applied().remove(key);
        self.retry_refused();
        Ok(())
    }
}

/// After its balancer is gone: clears `svc`'s ingress (unless it is being deleted) and
/// takes our finalizer off (a Service already gone needs none taken off).
async fn release_service(api: &Api<Service>, svc: &Service) -> Result<(), kube::Error> {
    if has_ingress(svc) && svc.metadata.deletion_timestamp.is_none() {
        api.patch_status(
            &svc.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "loadBalancer": { "ingress": null } } })),
        )
        .await?;
    }
    if has_finalizer(svc) {
        let finalizers: Vec<String> = svc
            .finalizers()
            .iter()
            .filter(|f| *f != FINALIZER)
            .cloned()
            .collect();
        match set_finalizers(api, svc, &finalizers).await {
            // Already gone: nothing to finalize.
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            other => other?,
        }
    }
    Ok(())
}

/// Sets `svc`'s finalizers, failing with a conflict if it changed since we read it.
async fn set_finalizers(
    api: &Api<Service>,
    svc: &Service,
    finalizers: &[String],
) -> Result<(), kube::Error> {
    // Through services/status, as upstream: the finalizer is metadata, which the status
    // subresource writes too, and it is all the service controller's role may patch.
    api.patch_status(
        &svc.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({
            "metadata": {
                "finalizers": finalizers,
                "resourceVersion": svc.resource_version(),
            }
        })),
    )
    .await
    .map(drop)
}

/// Writes `status` as `svc`'s ingress, unless its status shows it already.
async fn set_ingress(
    api: &Api<Service>,
    svc: &Service,
    status: &LoadBalancerStatus,
    ip_mode: &IpModeSupport,
) -> Result<(), kube::Error> {
    let wanted = ingress_json(status);
    let current = stored_ingress(svc);
    if ip_mode.differs(&current, &wanted) {
        let patched = api
            .patch_status(
                &svc.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": { "loadBalancer": { "ingress": wanted } } })),
            )
            .await?;
        ip_mode.learn(&wanted, &stored_ingress(&patched));
    }
    Ok(())
}

/// `svc`'s ingress as stored, in the form [`ingress_json`] writes.
fn stored_ingress(svc: &Service) -> serde_json::Value {
    svc.status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|l| l.ingress.as_ref())
        .map(|i| serde_json::to_value(i).unwrap_or_default())
        .unwrap_or(json!([]))
}

fn has_ingress(svc: &Service) -> bool {
    svc.status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|l| l.ingress.as_ref())
        .is_some_and(|i| !i.is_empty())
}

fn has_finalizer(svc: &Service) -> bool {
    svc.finalizers().iter().any(|f| f == FINALIZER)
}

fn target(svc: &Service) -> Target {
    Target::service(svc.namespace(), svc.name_any(), svc.uid())
}

fn without_ip_mode(ingress: &serde_json::Value) -> serde_json::Value {
    let mut v = ingress.clone();
    if let Some(list) = v.as_array_mut() {
        for i in list {
            if let Some(o) = i.as_object_mut() {
                o.remove("ipMode");
            }
        }
    }
    v
}

fn ingress_json(status: &LoadBalancerStatus) -> serde_json::Value {
    let mut out: Vec<serde_json::Value> = status
        .ips
        .iter()
        .map(|ip| match status.proxy {
            true => json!({ "ip": ip, "ipMode": "Proxy" }),
            false => json!({ "ip": ip }),
        })
        .collect();
    out.extend(status.hostnames.iter().map(|h| json!({ "hostname": h })));
    json!(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_proxy_balancer_says_ip_mode_proxy_and_an_old_apiserver_dropping_it_is_no_change() {
        let status = LoadBalancerStatus {
            ips: vec!["192.0.2.1".into()],
            hostnames: vec![],
            proxy: true,
        };
        let wanted = ingress_json(&status);
        assert_eq!(wanted, json!([{ "ip": "192.0.2.1", "ipMode": "Proxy" }]));
        let stored_by_1_20 = json!([{ "ip": "192.0.2.1" }]);
        assert_eq!(without_ip_mode(&stored_by_1_20), without_ip_mode(&wanted));
    }

    #[test]
    fn a_status_without_ip_mode_is_written_until_the_apiserver_is_known_to_drop_it() {
        let wanted = json!([{ "ip": "192.0.2.1", "ipMode": "Proxy" }]);
        let addressed_before_1_30 = json!([{ "ip": "192.0.2.1" }]);
        // An upgraded cluster (1.30+) keeps what it is given: the old status is a change.
        let kept = IpModeSupport::default();
        assert!(kept.differs(&addressed_before_1_30, &wanted));
        kept.learn(&wanted, &wanted);
        assert!(kept.differs(&addressed_before_1_30, &wanted));
        assert!(!kept.differs(&wanted, &wanted));
        // An apiserver that drops the field (1.20 here): written once, then no change.
        let dropping = IpModeSupport::default();
        assert!(dropping.differs(&addressed_before_1_30, &wanted));
        dropping.learn(&wanted, &addressed_before_1_30);
        assert!(!dropping.differs(&addressed_before_1_30, &wanted));
        // A real change is still a change.
        assert!(dropping.differs(&json!([{ "ip": "192.0.2.9" }]), &wanted));
    }
}

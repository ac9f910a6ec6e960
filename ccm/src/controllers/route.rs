//! The route controller: every `--route-reconciliation-period` each node podCIDR inside
//! `--cluster-cidr` gets one route via the node's InternalIP (of the same family), and
//! routes of ours inside `--cluster-cidr` that no node needs any more are deleted. A
//! node whose routes all exist gets `NetworkUnavailable` False/RouteCreated; a route
//! that cannot be made gives a Warning event (aggregated), and sets True/NoRouteCreated
//! only on a node whose condition this controller set before: a condition someone
//! else owns (or none) is never turned into "network unavailable" by us, since that
//! keeps every pod off the node. Patched on `nodes/status` only when it changes. When
//! the controller stops (its hard stop, at the drain or when the replica loses its
//! lease) it removes its routes: they are the leader's alone.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;
use tether_core::identifiers::Cidr;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{Context, SyncError};
use crate::cloud::{Route, Routes};

/// The node condition this controller owns.
pub const NETWORK_UNAVAILABLE: &str = "NetworkUnavailable";
/// Reasons this controller writes on [`NETWORK_UNAVAILABLE`].
pub const OUR_REASONS: [&str; 2] = ["RouteCreated", "NoRouteCreated"];

/// Deletes every route `routes` lists inside `cluster_cidrs` (a leader stepping down,
/// or a replica cleaning up after a former leader on its host). Errors are logged.
pub async fn remove_ours(routes: &dyn Routes, cluster: &str, cluster_cidrs: &[Cidr]) {
    let listed = match routes.list(cluster).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %chain(&e), "cannot list routes to remove them");
            return;
        }
    };
    for r in listed
        .into_iter()
        .filter(|r| inside(cluster_cidrs, &r.cidr))
    {
        match routes.delete(cluster, &r).await {
            Ok(()) => tracing::info!(cidr = %r.cidr, via = %r.via, "route removed: not the leader"),
            Err(e) => {
                tracing::warn!(cidr = %r.cidr, via = %r.via, error = %chain(&e), "cannot remove route")
            }
        }
    }
}

/// The route controller.
pub struct RouteController {
    ctx: Context,
    routes: Arc<dyn Routes>,
    cluster_name: String,
    cluster_cidrs: Vec<Cidr>,
    period: Duration,
}

/// What one node needs: its routes, or why it cannot have them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wanted {
    /// Routes the node needs.
    pub routes: Vec<Route>,
    /// Pod CIDRs that cannot be routed (no InternalIP of their family).
    pub unroutable: Vec<String>,
}

/// The routes `nodes` need: for each node (not being deleted) with pod CIDRs inside
/// `cluster_cidrs`, one route per CIDR via its first InternalIP of the same family.
/// Nodes with no pod CIDR inside the cluster CIDRs are left out.
pub fn wanted(nodes: &[Arc<Node>], cluster_cidrs: &[Cidr]) -> BTreeMap<String, Wanted> {
    let mut out = BTreeMap::new();
    for node in nodes {
        if node.metadata.deletion_timestamp.is_some() {
            continue;
        }
        let spec = node.spec.as_ref();
        let mut pod_cidrs: Vec<String> = spec.and_then(|s| s.pod_cidrs.clone()).unwrap_or_default();
        if pod_cidrs.is_empty() {
            pod_cidrs.extend(spec.and_then(|s| s.pod_cidr.clone()));
        }
        let internal: Vec<IpAddr> = node
            .status
            .as_ref()
            .and_then(|s| s.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == "InternalIP")
            .filter_map(|a| a.address.parse().ok())
            .collect();
        let mut w = Wanted {
            routes: Vec::new(),
            unroutable: Vec::new(),
        };
        for text in pod_cidrs {
            let Ok(cidr) = text.parse::<Cidr>() else {
                continue;
            };
            if !cluster_cidrs.iter().any(|c| c.covers(&cidr)) {
                continue;
            }
            let v4 = cidr.network().is_ipv4();
            match internal.iter().find(|ip| ip.is_ipv4() == v4) {
                Some(via) => w.routes.push(Route {
                    node: node.name_any(),
                    via: via.to_string(),
                    cidr: cidr.normalized().to_string(),
                }),
                None => w.unroutable.push(cidr.normalized().to_string()),
            }
        }
        if !w.routes.is_empty() || !w.unroutable.is_empty() {
            out.insert(node.name_any(), w);
        }
    }
    out
}

impl RouteController {
    /// A controller for `cluster_cidrs`, reconciling every `period`.
    pub fn new(
        ctx: Context,
        routes: Arc<dyn Routes>,
        cluster_name: String,
        cluster_cidrs: Vec<Cidr>,
        period: Duration,
    ) -> Self {
        RouteController {
            ctx,
            routes,
            cluster_name,
            cluster_cidrs,
            period,
        }
    }

    /// Runs until `hard_stop`: once at once, then every period; then removes its routes.
    pub async fn run(self, hard_stop: CancellationToken) {
        let mut tick = super::Ticker::new(self.period);
        while tick.next(&hard_stop).await {
            self.ctx.metrics.route_syncs.inc();
            if let Err(e) = self
                .reconcile()
                .instrument(tracing::debug_span!("reconcile_routes"))
                .await
            {
                tracing::warn!(error = %chain(&e), "route reconciliation failed; next period retries");
            }
        }
        remove_ours(
            self.routes.as_ref(),
            &self.cluster_name,
            &self.cluster_cidrs,
        )
        .instrument(tracing::info_span!("route_cleanup"))
        .await;
    }

    /// One pass: create what is missing, delete what is stale, update conditions.
    pub async fn reconcile(&self) -> Result<(), SyncError> {
        let nodes = self.ctx.nodes.state();
        let wanted = wanted(&nodes, &self.cluster_cidrs);
        let existing: BTreeSet<(String, String)> = self
            .routes
            .list(&self.cluster_name)
            .await?
            .into_iter()
            .filter(|r| inside(&self.cluster_cidrs, &r.cidr))
            .map(|r| (r.cidr, r.via))
            .collect();
        let needed: BTreeSet<(String, String)> = wanted
            .values()
            .flat_map(|w| &w.routes)
            .map(|r| (r.cidr.clone(), r.via.clone()))
            .collect();
        self.delete_stale(&existing, &needed).await;
        for node in nodes.iter() {
            let name = node.name_any();
            let Some(w) = wanted.get(&name) else { continue };
            let ok = self.create_missing(node, w, &existing).await;
            if let Err(e) = self.set_condition(node, ok).await {
                tracing::warn!(node = %name, error = %chain(&e), "cannot update NetworkUnavailable");
            }
        }
        Ok(())
    }

    /// Deletes the `existing` routes no longer `needed` (errors are logged).
    async fn delete_stale(
        &self,
        existing: &BTreeSet<(String, String)>,
        needed: &BTreeSet<(String, String)>,
    ) {
        // Stale routes. One whose CIDR is still needed with another next hop (the
        // node's address changed, or the CIDR moved to another node) is left for the
        // create below, which replaces it in place: the CIDR is never unrouted.
        let needed_cidrs: BTreeSet<&String> = needed.iter().map(|(c, _)| c).collect();
        for (cidr, via) in existing
            .difference(needed)
            .filter(|(c, _)| !needed_cidrs.contains(c))
        {
            let stale = Route {
                node: String::new(),
                via: via.clone(),
                cidr: cidr.clone(),
            };
            match self.routes.delete(&self.cluster_name, &stale).await {
                Ok(()) => tracing::info!(%cidr, %via, "stale route deleted"),
                Err(e) => {
                    tracing::warn!(%cidr, %via, error = %chain(&e), "cannot delete stale route")
                }
            }
        }
    }

    /// Creates the routes `node` needs that are not among `existing`, with a Warning
    /// event for each that cannot be made; whether all of them are there now.
    async fn create_missing(
        &self,
        node: &Node,
        w: &Wanted,
        existing: &BTreeSet<(String, String)>,
    ) -> bool {
        let name = node.name_any();
        let mut ok = w.unroutable.is_empty();
        if !w.unroutable.is_empty() {
            let note = format!(
                "Could not create routes for pod CIDR(s) {} of node {name}: the node has no InternalIP of that family",
                w.unroutable.join(", ")
            );
            tracing::warn!(node = %name, "{note}");
            self.ctx
                .node_event(node, true, "FailedToCreateRoute", "CreateRoute", note)
                .await;
        }
        for route in &w.routes {
            if existing.contains(&(route.cidr.clone(), route.via.clone())) {
                continue;
            }
            match self.routes.create(&self.cluster_name, route).await {
                Ok(()) => {
                    tracing::info!(node = %name, cidr = %route.cidr, via = %route.via, "route created")
                }
                Err(e) => {
                    ok = false;
                    let note = format!(
                        "Could not create route {} via {} for node {name}: {}",
                        route.cidr,
                        route.via,
                        chain(&e)
                    );
                    tracing::warn!(node = %name, "{note}");
                    self.ctx
                        .node_event(node, true, "FailedToCreateRoute", "CreateRoute", note)
                        .await;
                }
            }
        }
        ok
    }

    /// NetworkUnavailable False/RouteCreated, or True/NoRouteCreated when the condition
    /// is already ours; patched only when its status changes.
    async fn set_condition(&self, node: &Node, routes_created: bool) -> Result<(), SyncError> {
        let want = if routes_created { "False" } else { "True" };
        if super::condition_status(node, NETWORK_UNAVAILABLE) == Some(want) {
            return Ok(());
        }
        if !routes_created && !condition_is_ours(node) {
            return Ok(());
        }
        let (reason, message) = if routes_created {
            ("RouteCreated", "RouteController created a route")
        } else {
            ("NoRouteCreated", "RouteController failed to create a route")
        };
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let api: Api<Node> = Api::all(self.ctx.client.clone());
        api.patch_status(
            &node.name_any(),
            &PatchParams::default(),
            &Patch::Strategic(json!({
                "status": { "conditions": [{
                    "type": NETWORK_UNAVAILABLE,
                    "status": want,
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": now,
                    "lastHeartbeatTime": now,
                }]}
            })),
        )
        .await?;
        Ok(())
    }
}

/// Did this controller write `node`'s NetworkUnavailable condition?
fn condition_is_ours(node: &Node) -> bool {
    super::condition(node, NETWORK_UNAVAILABLE)
        .and_then(|c| c.reason.as_deref())
        .is_some_and(|r| OUR_REASONS.contains(&r))
}

/// Is route destination `cidr` inside one of `cluster_cidrs` (only those are ours to
/// delete)?
fn inside(cluster_cidrs: &[Cidr], cidr: &str) -> bool {
    cidr.parse::<Cidr>()
        .is_ok_and(|c| cluster_cidrs.iter().any(|cc| cc.covers(&c)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeAddress, NodeSpec, NodeStatus};

    fn node(name: &str, cidrs: &[&str], ips: &[&str]) -> Arc<Node> {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n.spec = Some(NodeSpec {
            pod_cidrs: Some(cidrs.iter().map(|s| s.to_string()).collect()),
            ..Default::default()
        });
        n.status = Some(NodeStatus {
            addresses: Some(
                ips.iter()
                    .map(|ip| NodeAddress {
                        type_: "InternalIP".into(),
                        address: ip.to_string(),
                    })
                    .collect(),
            ),
            ..Default::default()
        });
        Arc::new(n)
    }

    #[test]
    fn one_route_per_pod_cidr_inside_the_cluster_cidrs_via_the_same_family() {
        let cluster: Vec<Cidr> = ["10.244.0.0/16", "fd00:10::/56"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let nodes = vec![
            node(
                "dual",
                &["10.244.1.0/24", "fd00:10:0:1::/64"],
                &["fd00::1", "192.168.0.1"],
            ),
            node(
                "v4only",
                &["10.244.2.9/24", "fd00:10:0:2::/64"],
                &["192.168.0.2"],
            ),
            node("outside", &["10.99.0.0/24"], &["192.168.0.3"]),
            node("none", &[], &["192.168.0.4"]),
        ];
        let w = wanted(&nodes, &cluster);
        assert_eq!(
            w["dual"].routes,
            vec![
                Route {
                    node: "dual".into(),
                    via: "192.168.0.1".into(),
                    cidr: "10.244.1.0/24".into()
                },
                Route {
                    node: "dual".into(),
                    via: "fd00::1".into(),
                    cidr: "fd00:10:0:1::/64".into()
                },
            ]
        );
        assert_eq!(w["v4only"].routes[0].cidr, "10.244.2.0/24");
        assert_eq!(w["v4only"].unroutable, vec!["fd00:10:0:2::/64"]);
        assert!(!w.contains_key("outside") && !w.contains_key("none"));
    }
}

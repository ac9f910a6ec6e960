//! The node controller: a node tainted `node.cloudprovider.kubernetes.io/uninitialized`
//! gets its provider ID, addresses, topology and instance-type labels (and their beta
//! twins) from the provider, then the taint is removed and an event says so. Every
//! `--node-status-update-frequency` the addresses and the provider's own labels of all
//! nodes are synced again. The kubelet's `provided-node-ip` (one address, or two for
//! dual stack) goes first and must be the provider's; the kubelet's `Hostname` address
//! is kept when the provider reports none.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector::ObjectRef;
use kube::ResourceExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{has_taint, node_info, taints, Context, SyncError, TAINT_UNINITIALIZED};
use crate::cloud::{Address, CloudError, InstanceMetadata, Instances};
use crate::workqueue::WorkQueue;

/// Kubelet's annotation naming the address(es) the operator chose for the node
/// (`--node-ip`; two, comma-separated, for dual stack from kubelet 1.29).
pub const PROVIDED_NODE_IP: &str = "alpha.kubernetes.io/provided-node-ip";

/// The reason of the event about a node claimed only by unverified identifiers.
pub const UNVERIFIED_REASON: &str = "UnverifiedAgentIdentity";

/// The reason of the event about a node nobody gives an address.
pub const NO_ADDRESSES_REASON: &str = "NodeAddressesUnknown";

/// Labels set from the provider's answer: (GA, beta) pairs.
pub const ZONE_LABELS: [&str; 2] = [
    "topology.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/zone",
];
/// Region labels.
pub const REGION_LABELS: [&str; 2] = [
    "topology.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/region",
];
/// Instance-type labels.
pub const INSTANCE_TYPE_LABELS: [&str; 2] = [
    "node.kubernetes.io/instance-type",
    "beta.kubernetes.io/instance-type",
];

/// The node controller.
pub struct NodeController {
    ctx: Context,
    instances: Arc<dyn Instances>,
    queue: Arc<WorkQueue>,
    status_period: Duration,
    workers: usize,
}

impl NodeController {
    /// A controller working off `queue` (fed by the node informer) with `workers`
    /// workers (`--concurrent-node-syncs`).
    pub fn new(
        ctx: Context,
        instances: Arc<dyn Instances>,
        queue: Arc<WorkQueue>,
        status_period: Duration,
        workers: usize,
    ) -> Self {
        NodeController {
            ctx,
            instances,
            queue,
            status_period,
            workers,
        }
    }

    /// Runs until `hard_stop`.
    pub async fn run(self, hard_stop: CancellationToken) {
        let this = Arc::new(self);
        // Periodic address sync of initialised nodes. (Node updates do not trigger it:
        // kubelets update their nodes constantly, and each sync is a provider call.)
        let periodic = {
            let this = this.clone();
            let hard_stop = hard_stop.clone();
            async move {
                let mut tick = super::Ticker::new(this.status_period);
                // The first tick is at once; initialisation covers new nodes.
                tick.next(&hard_stop).await;
                while tick.next(&hard_stop).await {
                    for node in this.ctx.nodes.state() {
                        if has_taint(&node, TAINT_UNINITIALIZED)
                            || node.metadata.deletion_timestamp.is_some()
                        {
                            continue;
                        }
                        if let Err(e) = this.sync_addresses(&node).await {
                            tracing::warn!(node = %node.name_any(), error = %chain(&e), "address sync failed; next period retries");
                        }
                    }
                }
            }
        };
        tokio::spawn(periodic.instrument(tracing::info_span!("node_status_sync")));
        let queue = this.queue.clone();
        let workers = this.workers;
        queue
            .work(workers, hard_stop, move |name| {
                let this = this.clone();
                async move {
                    let result = this
                        .sync(&name)
                        .instrument(tracing::debug_span!("sync_node", node = %name))
                        .await;
                    super::outcome_of(result, "node", &name)
                }
            })
            .await;
    }

    /// Initialises the node if it is still tainted uninitialized.
    pub async fn sync(&self, name: &str) -> Result<(), SyncError> {
        let Some(node) = self.ctx.nodes.get(&ObjectRef::new(name)) else {
            return Ok(());
        };
        if node.metadata.deletion_timestamp.is_some() || !has_taint(&node, TAINT_UNINITIALIZED) {
            return Ok(());
        }
        self.initialize(&node).await
    }

    /// Initialises `node`: its addresses first, then its labels and provider ID with
    /// the uninitialized taint removed.
    async fn initialize(&self, node: &Node) -> Result<(), SyncError> {
        let name = node.name_any();
        let meta = self.initial_metadata(node).await?;
        let addresses = ordered_addresses(node, &meta.addresses).map_err(SyncError::Invalid)?;
        if !has_ip(&addresses) && !has_ip(&current_addresses(node)) {
            return Err(self.no_addresses(node).await);
        }
        let api: Api<Node> = Api::all(self.ctx.client.clone());
        // Addresses first: once the taint is gone the node is schedulable and must be
        // reachable.
        let patched;
        let node = if addresses.is_empty() {
            node
        } else {
            patched = api
                .patch_status(
                    &name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "status": { "addresses": address_json(&addresses) } })),
                )
                .await?;
            // `node` came from the cache, which can lag our own last initialisation
            // (an event for its status patch queues the node again before the taint's
            // removal is seen): the patch answers with the node as it is now.
            if !has_taint(&patched, TAINT_UNINITIALIZED) {
                return Ok(());
            }
            &patched
        };
        untaint(&api, node, &meta).await?;
        self.ctx
            .metrics
            .node_inits
            .with_label_values(&["initialized"])
            .inc();
        tracing::info!(node = %name, provider_id = %meta.provider_id, zone = %meta.zone, region = %meta.region, "node initialized");
        self.ctx
            .node_event(
                node,
                false,
                "Synced",
                "InitializeNode",
                "Node synced successfully".into(),
            )
            .await;
        Ok(())
    }

    /// A node nobody gives an address (its kubelet reports none, as 1.29+ kubelets with
    /// `--cloud-provider=external` and no `--node-ip` do; the provider knows none):
    /// counted, logged and a Warning event naming the fixes; retried every 30 s (an
    /// inventory entry added meanwhile then initialises it). It
    /// stays tainted, since a node without an address cannot be reached.
    async fn no_addresses(&self, node: &Node) -> SyncError {
        let name = node.name_any();
        self.count_failed();
        self.ctx
            .metrics
            .node_init_failures
            .with_label_values(&["no_addresses"])
            .inc();
        let why = format!("node {name} has no address: its kubelet reports none (Kubernetes 1.29+ with --cloud-provider=external and no --node-ip) and the cloud provider knows none. Give the kubelet --node-ip (kubeletExtraArgs node-ip), or list the node with its addresses in the CCM inventory; it stays uninitialized until then");
        tracing::warn!(node = %name, "{why}");
        self.ctx
            .node_event(
                node,
                true,
                NO_ADDRESSES_REASON,
                "InitializeNode",
                why.clone(),
            )
            .await;
        SyncError::Cloud(CloudError::RetryAfter {
            after: Duration::from_secs(30),
            reason: why,
        })
    }

    /// Counts one failed initialisation (`node_controller_node_initializations_total`).
    fn count_failed(&self) {
        self.ctx
            .metrics
            .node_inits
            .with_label_values(&["failed"])
            .inc();
    }

    /// The provider's metadata of `node` to initialise it with; a node the provider
    /// cannot vouch for or does not know is counted as failed and gets a Warning event.
    async fn initial_metadata(&self, node: &Node) -> Result<InstanceMetadata, SyncError> {
        let name = node.name_any();
        match self.instances.metadata(&node_info(node)).await {
            Ok(m) => Ok(m),
            Err(CloudError::Unverified(why)) => {
                self.count_failed();
                self.ctx
                    .node_event(node, true, UNVERIFIED_REASON, "InitializeNode", why.clone())
                    .await;
                Err(CloudError::Unverified(why).into())
            }
            Err(CloudError::InstanceNotFound) => {
                self.count_failed();
                self.ctx
                    .node_event(
                        node,
                        true,
                        "InstanceNotFound",
                        "InitializeNode",
                        format!(
                            "the cloud provider does not know node {name}; it stays uninitialized"
                        ),
                    )
                    .await;
                Err(CloudError::InstanceNotFound.into())
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn sync_addresses(&self, node: &Node) -> Result<(), SyncError> {
        let meta = match self.instances.metadata(&node_info(node)).await {
            Ok(m) => m,
            // Gone from the provider: the lifecycle controller deals with it.
            Err(
                CloudError::InstanceNotFound
                | CloudError::NotImplemented
                | CloudError::Unverified(_),
            ) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let api: Api<Node> = Api::all(self.ctx.client.clone());
        let have = node.metadata.labels.clone().unwrap_or_default();
        let changed: BTreeMap<&String, &String> = meta
            .extra_labels
            .iter()
            .filter(|(k, v)| have.get(*k) != Some(*v))
            .collect();
        if !changed.is_empty() {
            api.patch(
                &node.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({ "metadata": { "labels": changed } })),
            )
            .await?;
            tracing::info!(node = %node.name_any(), labels = ?changed, "node labels updated from the provider");
        }
        if meta.addresses.is_empty() {
            return Ok(());
        }
        let wanted = ordered_addresses(node, &meta.addresses).map_err(SyncError::Invalid)?;
        if current_addresses(node) == wanted {
            return Ok(());
        }
        api.patch_status(
            &node.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "addresses": address_json(&wanted) } })),
        )
        .await?;
        tracing::info!(node = %node.name_any(), addresses = ?wanted, "node addresses updated");
        Ok(())
    }
}

/// Removes the uninitialized taint from `node` and sets its labels from `meta` (and
/// its provider ID, unless it has one), in one patch conditional on its
/// resourceVersion.
async fn untaint(api: &Api<Node>, node: &Node, meta: &InstanceMetadata) -> Result<(), SyncError> {
    let remaining: Vec<_> = taints(node)
        .iter()
        .filter(|t| t.key != TAINT_UNINITIALIZED)
        .collect();
    let mut spec = json!({ "taints": remaining });
    let has_id = node
        .spec
        .as_ref()
        .and_then(|s| s.provider_id.as_deref())
        .is_some_and(|p| !p.is_empty());
    if !has_id && !meta.provider_id.is_empty() {
        spec["providerID"] = json!(meta.provider_id);
    }
    // The resourceVersion makes this a compare-and-swap: a taint added by someone
    // else meanwhile is not overwritten (we get a conflict and retry).
    api.patch(
        &node.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({
            "metadata": {
                "labels": labels(meta),
                "resourceVersion": node.resource_version(),
            },
            "spec": spec,
        })),
    )
    .await?;
    Ok(())
}

fn current_addresses(node: &Node) -> Vec<Address> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .map(|a| {
            a.iter()
                .map(|a| Address {
                    kind: a.type_.clone(),
                    address: a.address.clone(),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The provider's addresses, with the kubelet's `provided-node-ip` address(es) first,
/// in its order. Each must be one the provider knows (else the node is misconfigured:
/// error); as upstream, another address of the same type and family as a provided one
/// is left out. When the provider reports no `Hostname`, the kubelet's is kept.
pub fn ordered_addresses(node: &Node, cloud: &[Address]) -> Result<Vec<Address>, String> {
    let provided: Vec<&str> = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(PROVIDED_NODE_IP))
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|ip| !ip.is_empty())
                .collect()
        })
        .unwrap_or_default();
    let same_ip =
        |a: &str, b: &str| match (a.parse::<std::net::IpAddr>(), b.parse::<std::net::IpAddr>()) {
            (Ok(x), Ok(y)) => x == y,
            _ => a == b,
        };
    let family = |a: &str| a.parse::<std::net::IpAddr>().ok().map(|ip| ip.is_ipv4());
    let mut out: Vec<Address> = Vec::with_capacity(cloud.len() + 1);
    let mut claimed: Vec<(String, Option<bool>)> = Vec::new();
    for ip in &provided {
        let first: Vec<&Address> = cloud.iter().filter(|a| same_ip(&a.address, ip)).collect();
        if first.is_empty() {
            return Err(format!(
                "node {}: {PROVIDED_NODE_IP}={ip} is not one of the provider's addresses {:?}",
                node.name_any(),
                cloud.iter().map(|a| &a.address).collect::<Vec<_>>()
            ));
        }
        for a in first {
            claimed.push((a.kind.clone(), family(&a.address)));
            if !out.contains(a) {
                out.push(a.clone());
            }
        }
    }
    for a in cloud {
        let shadowed = claimed
            .iter()
            .any(|(kind, fam)| *kind == a.kind && fam.is_some() && *fam == family(&a.address));
        if !shadowed && !out.contains(a) {
            out.push(a.clone());
        }
    }
    if !cloud.iter().any(|a| a.kind == "Hostname") {
        for a in current_addresses(node) {
            if a.kind == "Hostname" && !out.contains(&a) {
                out.push(a);
            }
        }
    }
    Ok(out)
}

/// Does `addresses` hold an IP address (not only host names)?
fn has_ip(addresses: &[Address]) -> bool {
    addresses
        .iter()
        .any(|a| a.address.parse::<std::net::IpAddr>().is_ok())
}

fn address_json(addresses: &[Address]) -> serde_json::Value {
    json!(addresses
        .iter()
        .map(|a| json!({ "type": a.kind, "address": a.address }))
        .collect::<Vec<_>>())
}

/// The labels a node gets from `meta` (empty values are left out).
pub fn labels(meta: &InstanceMetadata) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (keys, value) in [
        (ZONE_LABELS, &meta.zone),
        (REGION_LABELS, &meta.region),
        (INSTANCE_TYPE_LABELS, &meta.instance_type),
    ] {
        if !value.is_empty() {
            for k in keys {
                out.insert(k.to_string(), value.clone());
            }
        }
    }
    for (k, v) in &meta.extra_labels {
        out.insert(k.clone(), v.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(kind: &str, a: &str) -> Address {
        Address {
            kind: kind.into(),
            address: a.into(),
        }
    }

    #[test]
    fn provided_node_ip_goes_first_and_must_be_known() {
        let cloud = [
            addr("ExternalIP", "1.2.3.4"),
            addr("InternalIP", "10.0.0.1"),
        ];
        let mut node = Node::default();
        node.metadata.name = Some("n".into());
        assert_eq!(ordered_addresses(&node, &cloud).unwrap(), cloud.to_vec());
        node.metadata.annotations = Some(
            [(PROVIDED_NODE_IP.to_string(), "10.0.0.1".to_string())]
                .into_iter()
                .collect(),
        );
        assert_eq!(
            ordered_addresses(&node, &cloud).unwrap(),
            vec![cloud[1].clone(), cloud[0].clone()]
        );
        node.metadata.annotations = Some(
            [(PROVIDED_NODE_IP.to_string(), "10.9.9.9".to_string())]
                .into_iter()
                .collect(),
        );
        assert!(ordered_addresses(&node, &cloud)
            .unwrap_err()
            .contains("10.9.9.9"));
    }

    #[test]
    fn dual_stack_provided_ips_go_first_and_the_kubelets_hostname_stays() {
        let cloud = [
            addr("InternalIP", "10.0.0.9"),
            addr("InternalIP", "10.0.0.1"),
            addr("InternalIP", "fd00::1"),
            addr("ExternalIP", "1.2.3.4"),
        ];
        let mut node = Node::default();
        node.metadata.name = Some("n".into());
        node.metadata.annotations = Some(
            [(
                PROVIDED_NODE_IP.to_string(),
                "fd00:0::1,10.0.0.1".to_string(),
            )]
            .into_iter()
            .collect(),
        );
        node.status = Some(k8s_openapi::api::core::v1::NodeStatus {
            addresses: Some(vec![k8s_openapi::api::core::v1::NodeAddress {
                type_: "Hostname".into(),
                address: "n".into(),
            }]),
            ..Default::default()
        });
        assert_eq!(
            ordered_addresses(&node, &cloud).unwrap(),
            vec![
                addr("InternalIP", "fd00::1"),
                addr("InternalIP", "10.0.0.1"),
                addr("ExternalIP", "1.2.3.4"),
                addr("Hostname", "n"),
            ]
        );
        // A provider Hostname wins over the kubelet's.
        let mut with_host = cloud.to_vec();
        with_host.push(addr("Hostname", "n.example"));
        let out = ordered_addresses(&node, &with_host).unwrap();
        assert!(
            out.contains(&addr("Hostname", "n.example")) && !out.contains(&addr("Hostname", "n"))
        );
    }

    #[test]
    fn labels_include_beta_twins_and_skip_empty_values() {
        let meta = InstanceMetadata {
            zone: "z".into(),
            instance_type: "t".into(),
            ..Default::default()
        };
        let l = labels(&meta);
        assert_eq!(l["topology.kubernetes.io/zone"], "z");
        assert_eq!(l["failure-domain.beta.kubernetes.io/zone"], "z");
        assert_eq!(l["beta.kubernetes.io/instance-type"], "t");
        assert!(!l.contains_key("topology.kubernetes.io/region"));
    }
}

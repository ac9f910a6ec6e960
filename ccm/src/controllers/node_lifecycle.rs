//! The node-lifecycle controller: every `--node-monitor-period` each node that is not
//! Ready (including one with no Ready condition yet, as upstream) is checked with the
//! provider. A machine the provider no longer knows has its Node deleted, but only
//! if this CCM initialised it (its providerID is one the provider owns): any other
//! node is kept and a Warning event (aggregated) says why. Whether "no longer knows"
//! is ever answered for a node that is merely unreachable is the provider's deletion
//! policy (the `tether` provider: never, unless opted in). A shut-down machine gets the
//! taint `node.cloudprovider.kubernetes.io/shutdown:NoSchedule`, removed again once the
//! node is Ready.

use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use k8s_openapi::api::core::v1::{Node, Taint};
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use kube::ResourceExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{has_taint, node_info, ready_status, taints, Context, SyncError, TAINT_SHUTDOWN};
use crate::cloud::{CloudError, Instances, NodeInfo};

/// The reason of the event about a node kept although the provider does not know it.
pub const DELETION_WITHHELD: &str = "DeletionWithheld";

/// The node-lifecycle controller.
pub struct NodeLifecycleController {
    ctx: Context,
    instances: Arc<dyn Instances>,
    period: Duration,
}

impl NodeLifecycleController {
    /// A controller checking every `period`.
    pub fn new(ctx: Context, instances: Arc<dyn Instances>, period: Duration) -> Self {
        NodeLifecycleController {
            ctx,
            instances,
            period,
        }
    }

    /// Runs until `hard_stop`.
    pub async fn run(self, hard_stop: CancellationToken) {
        let mut tick = super::Ticker::new(self.period);
        while tick.next(&hard_stop).await {
            for node in self.ctx.nodes.state() {
                let name = node.name_any();
                if let Err(e) = self
                    .check(&node)
                    .instrument(tracing::debug_span!("check_node", node = %name))
                    .await
                {
                    tracing::warn!(node = %name, error = %chain(&e), "node lifecycle check failed; next period retries");
                }
            }
        }
    }

    /// One node: shutdown taint on or off, or deletion.
    pub async fn check(&self, node: &Node) -> Result<(), SyncError> {
        if node.metadata.deletion_timestamp.is_some() {
            return Ok(());
        }
        let name = node.name_any();
        let info = node_info(node);
        if ready_status(node) == Some("True") {
            if has_taint(node, TAINT_SHUTDOWN) {
                self.set_shutdown_taint(node, false).await?;
                tracing::info!(node = %name, "node is Ready again; shutdown taint removed");
            }
            return Ok(());
        }
        // Not Ready (or no Ready condition yet, which upstream treats as Unknown).
        if self.instances.exists(&info).await? {
            match self.instances.shutdown(&info).await {
                Ok(true) if !has_taint(node, TAINT_SHUTDOWN) => {
                    self.set_shutdown_taint(node, true).await?;
                    tracing::info!(node = %name, "machine is shut down; node tainted");
                }
                Ok(_) | Err(CloudError::InstanceNotFound | CloudError::NotImplemented) => {}
                Err(e) => return Err(e.into()),
            }
            return Ok(());
        }
        self.remove_gone(node, &info).await
    }

    /// A node whose machine the provider no longer knows: deleted if this CCM
    /// initialised it, else kept with a Warning event.
    async fn remove_gone(&self, node: &Node, info: &NodeInfo) -> Result<(), SyncError> {
        let name = node.name_any();
        let owned = info
            .provider_id
            .as_deref()
            .is_some_and(|p| self.instances.owns(p));
        let metrics = &self.ctx.metrics;
        if !owned {
            metrics
                .deletions_withheld
                .with_label_values(&["uninitialized"])
                .inc();
            tracing::warn!(node = %name, provider_id = ?info.provider_id, "node is not Ready and unknown to the cloud provider, but not ours to delete");
            self.ctx
                .node_event(
                    node,
                    true,
                    DELETION_WITHHELD,
                    "DeleteNode",
                    format!("Node {name} is not Ready and the cloud provider does not know it, but this cloud-controller-manager never initialised it (no providerID of this provider): it is not deleted; delete it yourself if its machine is gone"),
                )
                .await;
            return Ok(());
        }
        metrics
            .node_deletions
            .with_label_values(&["instance-gone"])
            .inc();
        tracing::info!(node = %name, "machine no longer exists in the cloud provider; deleting the node");
        self.ctx
            .node_event(
                node,
                false,
                "DeletingNode",
                "DeleteNode",
                format!("Deleting node {name} because it does not exist in the cloud provider"),
            )
            .await;
        let api: Api<Node> = Api::all(self.ctx.client.clone());
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn set_shutdown_taint(&self, node: &Node, on: bool) -> Result<(), SyncError> {
        let mut list: Vec<Taint> = taints(node)
            .iter()
            .filter(|t| t.key != TAINT_SHUTDOWN)
            .cloned()
            .collect();
        if on {
            list.push(Taint {
                key: TAINT_SHUTDOWN.into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            });
        }
        let api: Api<Node> = Api::all(self.ctx.client.clone());
        api.patch(
            &node.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": { "resourceVersion": node.resource_version() },
                "spec": { "taints": list },
            })),
        )
        .await?;
        Ok(())
    }
}

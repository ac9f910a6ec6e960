//! The cluster's pod networks by node (`spec.podCIDRs` of every Node, watched with
//! `--watch-node-pod-cidrs`), so that `destCIDR` sends a dial to a pod IP to the agent
//! on that pod's node even when pod networks are not routed between nodes.

use std::net::IpAddr;
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use tether_core::identifiers::Cidr;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// `--watch-node-pod-cidrs`: where to watch Nodes from.
#[derive(Debug, Clone, Default)]
pub struct WatchConfig {
    /// `--kubeconfig`; `None` = in-cluster configuration.
    pub kubeconfig: Option<std::path::PathBuf>,
}

/// Pod networks and the node each belongs to; empty until the first list arrives (and
/// always when the server does not watch Nodes).
#[derive(Default)]
pub struct PodNetworks {
    table: RwLock<Vec<(Cidr, String)>>,
    /// Set for good when the watch starts.
    watched: std::sync::atomic::AtomicBool,
}

impl PodNetworks {
    /// The node whose pod network holds `host` (an IP literal), most specific first.
    pub fn node_of(&self, host: &str) -> Option<String> {
        let ip: IpAddr = host.parse().ok()?;
        let table = self.table.read().unwrap_or_else(|e| e.into_inner());
        table
            .iter()
            .filter(|(net, _)| net.contains(ip))
            .max_by_key(|(net, _)| net.prefix())
            .map(|(_, node)| node.clone())
    }

    /// Replaces the table with the pod networks of `nodes`; unparsable CIDRs are skipped.
    pub fn set<'a>(&self, nodes: impl IntoIterator<Item = &'a Node>) {
        let mut table = Vec::new();
        for node in nodes {
            let Some(spec) = &node.spec else { continue };
            let mut cidrs = spec.pod_cidrs.clone().unwrap_or_default();
            if cidrs.is_empty() {
                cidrs.extend(spec.pod_cidr.clone());
            }
            for c in cidrs {
                match c.parse::<Cidr>() {
                    Ok(net) => table.push((net.normalized(), node.name_any())),
                    Err(e) => {
                        tracing::warn!(node = %node.name_any(), cidr = %c, error = %e, "ignoring a pod CIDR")
                    }
                }
            }
        }
        *self.table.write().unwrap_or_else(|e| e.into_inner()) = table;
    }

    /// Does the server watch Nodes (so any agent may be picked for a pod IP)?
    pub fn is_watched(&self) -> bool {
        self.watched.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many pod networks are known.
    pub fn len(&self) -> usize {
        self.table.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// True when no pod network is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Keeps `networks` in step with the cluster's Nodes until `shutdown`; watch errors
/// are retried with backoff (meanwhile the last table stays in use).
pub fn spawn(
    client: kube::Client,
    networks: Arc<PodNetworks>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    networks
        .watched
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let (store, writer) = reflector::store::<Node>();
    let stream = reflector::reflector(
        writer,
        watcher(Api::<Node>::all(client), watcher::Config::default()).default_backoff(),
    );
    tokio::spawn(
        async move {
            let mut stream = std::pin::pin!(stream);
            let mut ready = false;
            loop {
                let event = tokio::select! {
                    e = stream.next() => e,
                    _ = shutdown.cancelled() => return,
                };
                match event {
                    Some(Ok(watcher::Event::InitApply(_) | watcher::Event::Init)) => {}
                    Some(Ok(_)) => {
                        let nodes = store.state();
                        networks.set(nodes.iter().map(|n| n.as_ref()));
                        if !ready {
                            ready = true;
                            tracing::info!(
                                nodes = nodes.len(),
                                networks = networks.len(),
                                "pod networks of the nodes known"
                            );
                        }
                    }
                    Some(Err(e)) => tracing::warn!(error = %e, "watching nodes failed; retrying (the server needs list and watch on nodes)"),
                    None => return,
                }
            }
        }
        .instrument(tracing::info_span!("pod_networks")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, cidrs: &[&str]) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"podCIDR": cidrs.first(), "podCIDRs": cidrs},
        }))
        .unwrap()
    }

    #[test]
    fn a_pod_ip_names_its_node() {
        let nets = PodNetworks::default();
        assert_eq!(nets.node_of("10.244.1.7"), None);
        nets.set(&[
            node("a", &["10.244.1.0/24", "fd00:1::/64"]),
            node("b", &["10.244.2.0/24"]),
            node("c", &[]),
            node("bad", &["nonsense"]),
        ]);
        assert_eq!(nets.len(), 3);
        assert_eq!(nets.node_of("10.244.1.7").as_deref(), Some("a"));
        assert_eq!(nets.node_of("fd00:1::9").as_deref(), Some("a"));
        assert_eq!(nets.node_of("10.244.2.200").as_deref(), Some("b"));
        assert_eq!(nets.node_of("10.244.3.1"), None);
        assert_eq!(nets.node_of("node-a"), None);
        nets.set(&[node("b", &["10.244.2.0/24"])]);
        assert_eq!(nets.node_of("10.244.1.7"), None);
    }
}

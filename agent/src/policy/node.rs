//! The agent's own Node object, read for the dial policy: its addresses, its kubelet's
//! port and its pod ranges. Read at start, every [`EVERY`], and again (at most every
//! [`AGAIN`]) when a dial would be refused, since a 1.29+ node gets its addresses and a
//! new node its pod range only after the agent has started.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use tether_core::error::chain;
use tether_core::identifiers::Cidr;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{DialPolicy, NodeFacts};

/// How often the Node is read.
const EVERY: Duration = Duration::from_secs(30);
/// The shortest time between two reads a refused dial asks for.
const AGAIN: Duration = Duration::from_secs(1);
/// The longest a read may take.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads this agent's Node into the policy.
#[derive(Clone)]
pub struct NodeWatch {
    api: Api<Node>,
    name: String,
    policy: std::sync::Weak<DialPolicy>,
    /// When the Node was last read (or tried); held while reading, so that reads
    /// asked for at once make one call.
    last: Arc<Mutex<Option<Instant>>>,
}

impl NodeWatch {
    /// Starts reading node `name` into `policy` until `hard_stop`.
    pub fn spawn(
        client: kube::Client,
        name: String,
        policy: &Arc<DialPolicy>,
        hard_stop: CancellationToken,
    ) {
        let watch = NodeWatch {
            api: Api::all(client),
            name: name.clone(),
            policy: Arc::downgrade(policy),
            last: Arc::default(),
        };
        policy.set_watch(watch.clone());
        let span = tracing::info_span!("dial_policy_node", node = %name);
        tokio::spawn(
            async move {
                let mut warned = false;
                loop {
                    let ok = watch.read(&mut warned).await;
                    let pause = if ok { EVERY } else { EVERY.min(AGAIN * 5) };
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = hard_stop.cancelled() => return,
                    }
                }
            }
            .instrument(span),
        );
    }

    /// Reads the Node again unless it was read within [`AGAIN`]; whether the facts
    /// changed.
    /// The read starts after this call did (so it sees what changed before the dial),
    /// and at most every [`AGAIN`]: a dial that comes sooner waits for its turn (and
    /// shares the read with the dials that wait with it).
    pub async fn refresh(&self) -> bool {
        let asked = Instant::now();
        let Some(policy) = self.policy.upgrade() else {
            return false;
        };
        let before = policy.facts();
        let mut last = self.last.lock().await;
        match *last {
            // Another dial's read started after this one asked: it is fresh enough.
            Some(t) if t >= asked => {}
            Some(t) if t.elapsed() < AGAIN => {
                tokio::time::sleep_until((t + AGAIN).into()).await;
                self.read_locked(&mut last, &mut true).await;
            }
            _ => {
                self.read_locked(&mut last, &mut true).await;
            }
        }
        *policy.facts() != *before
    }

    /// One read; `warned` keeps a failure to one warning until a read succeeds.
    async fn read(&self, warned: &mut bool) -> bool {
        let mut last = self.last.lock().await;
        self.read_locked(&mut last, warned).await
    }

    async fn read_locked(&self, last: &mut Option<Instant>, warned: &mut bool) -> bool {
        *last = Some(Instant::now());
        let Some(policy) = self.policy.upgrade() else {
            return false;
        };
        let got = tokio::time::timeout(READ_TIMEOUT, self.api.get(&self.name)).await;
        match got {
            Ok(Ok(node)) => {
                let facts = facts_of(&node);
                if facts != *policy.facts() {
                    tracing::info!(
                        addresses = ?facts.addrs,
                        kubelet_port = facts.kubelet_port.unwrap_or(super::KUBELET_PORT),
                        pod_cidrs = ?facts.pod_cidrs.iter().map(Cidr::to_string).collect::<Vec<_>>(),
                        "dial policy: read the node"
                    );
                    policy.set_facts(facts);
                }
                *warned = false;
                true
            }
            failed => {
                if !*warned {
                    let error = match failed {
                        Ok(Err(e)) => chain(&e).to_string(),
                        _ => format!("no answer within {READ_TIMEOUT:?}"),
                    };
                    tracing::warn!(
                        %error,
                        "dial policy: cannot read this node's Node object (needs get on nodes, deploy/rbac.yaml); \
                         until it is read, dials to its pods and to addresses not in --node-ip are refused"
                    );
                    *warned = true;
                }
                false
            }
        }
    }
}

/// The policy's facts from a Node object.
pub fn facts_of(node: &Node) -> NodeFacts {
    let status = node.status.as_ref();
    let addrs: Vec<IpAddr> = status
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| a.address.parse::<IpAddr>().ok())
        .map(super::rules::canonical)
        .collect();
    let kubelet_port = status
        .and_then(|s| s.daemon_endpoints.as_ref())
        .and_then(|d| d.kubelet_endpoint.as_ref())
        .and_then(|k| u16::try_from(k.port).ok())
        .filter(|p| *p > 0);
    let spec = node.spec.as_ref();
    let mut ranges: Vec<&String> = spec
        .and_then(|s| s.pod_cidrs.as_ref())
        .into_iter()
        .flatten()
        .collect();
    if ranges.is_empty() {
        ranges.extend(spec.and_then(|s| s.pod_cidr.as_ref()));
    }
    let pod_cidrs = ranges
        .into_iter()
        .filter_map(|r| r.parse::<Cidr>().ok())
        .map(|c| c.normalized())
        .filter(|c| match unlikely_pod_range(c, &addrs) {
            None => true,
            Some(why) => {
                tracing::warn!(pod_cidr = %c, "dial policy: the Node's pod range is ignored: {why}");
                false
            }
        })
        .collect();
    NodeFacts {
        addrs,
        kubelet_port,
        pod_cidrs,
    }
}

/// Why a Node's pod range cannot be one node's pods (whoever may write the Node could
/// otherwise open the node's whole network): wider than a /16 (IPv4) or /48 (IPv6),
/// holding the node's own addresses, or in a reserved range.
fn unlikely_pod_range(c: &Cidr, node: &[IpAddr]) -> Option<&'static str> {
    let widest = if c.network().is_ipv4() { 16 } else { 48 };
    if c.prefix() < widest {
        return Some("wider than one node's pods can be (/16 for IPv4, /48 for IPv6)");
    }
    if node.iter().any(|ip| c.contains(*ip)) {
        return Some("it holds the node's own addresses");
    }
    if super::rules::special(c.network()).is_some() {
        return Some("it is in a reserved range (loopback, link-local, multicast)");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_addresses_kubelet_port_and_pod_ranges_from_a_node() {
        let node: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1"},
            "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:244:1::/64"]},
            "status": {
                "addresses": [
                    {"type": "InternalIP", "address": "192.168.1.10"},
                    {"type": "InternalIP", "address": "fd00::10"},
                    {"type": "ExternalIP", "address": "203.0.113.10"},
                    {"type": "Hostname", "address": "n1"}
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 10251}}
            }
        }))
        .unwrap();
        let f = facts_of(&node);
        let ips: Vec<String> = f.addrs.iter().map(ToString::to_string).collect();
        assert_eq!(ips, ["192.168.1.10", "fd00::10", "203.0.113.10"]);
        assert_eq!(f.kubelet_port, Some(10251));
        let cidrs: Vec<String> = f.pod_cidrs.iter().map(ToString::to_string).collect();
        assert_eq!(cidrs, ["10.244.1.0/24", "fd00:244:1::/64"]);
        // A node with no addresses yet (1.29+, external cloud provider) and podCIDR only.
        let bare: Node = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n2"}, "spec": {"podCIDR": "10.244.2.0/24"}
        }))
        .unwrap();
        let f = facts_of(&bare);
        assert!(f.addrs.is_empty() && f.kubelet_port.is_none());
        assert_eq!(f.pod_cidrs[0].to_string(), "10.244.2.0/24");
        // Ranges no node's pods have are ignored, whoever wrote them.
        for bad in [
            "0.0.0.0/0",
            "10.0.0.0/8",
            "192.168.1.0/24",
            "127.0.0.0/24",
            "::/0",
        ] {
            let node: Node = serde_json::from_value(serde_json::json!({
                "metadata": {"name": "n3"},
                "spec": {"podCIDRs": [bad]},
                "status": {"addresses": [{"type": "InternalIP", "address": "192.168.1.10"}]}
            }))
            .unwrap();
            assert!(facts_of(&node).pod_cidrs.is_empty(), "{bad}");
        }
    }
}

//! Which node owns a dial host. The cluster's Node objects, watched from the API, vouch
//! for each node's names (its own, and its `Hostname`/`InternalDNS`/`ExternalDNS`
//! entries), addresses (`status.addresses`) and pod networks (`spec.podCIDRs`); per-node
//! agent certificates vouch for the names and IP addresses they carry, remembered after
//! the agent disconnects. Agents authenticated by a pod-bound token prove only their
//! node's name; the Node object says which addresses and networks that node really has.
//! A host that one node owns is that node's agent's to dial, whatever the strategies
//! say; a host two nodes claim is neither's.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use tether_core::error::chain;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, ResourceExt};
use tether_core::host::DialHost;
use tether_core::identifiers::Cidr;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// Where to watch Nodes from.
#[derive(Debug, Clone, Default)]
pub struct WatchConfig {
    /// `--kubeconfig`; `None` = in-cluster configuration.
    pub kubeconfig: Option<std::path::PathBuf>,
    /// `--watch-node-pod-cidrs`: route dials to pod IPs by the pod's node.
    pub route_pod_ips: bool,
}

/// One node's facts.
#[derive(Debug, Default)]
struct NodeFacts {
    addresses: Vec<IpAddr>,
    pod_cidrs: Vec<Cidr>,
}

#[derive(Debug, Default)]
struct Table {
    /// Pod networks and their node, for routing pod IPs.
    networks: Vec<(Cidr, String)>,
    by_name: HashMap<String, NodeFacts>,
    /// Every address any Node lists, with how many Nodes list it: a kubelet writes its
    /// own Node's addresses, so an address two Nodes list vouches for neither.
    addresses: HashMap<IpAddr, usize>,
    /// Every address any Node lists, with the Nodes listing it.
    address_owners: HashMap<IpAddr, Vec<String>>,
    /// Every name of a node (lower case): its own and the host names its Node lists,
    /// with the Nodes it names.
    names: HashMap<String, Vec<String>>,
}

/// Who owns a dial host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    /// No node: any agent the strategies pick may take it.
    Nobody,
    /// This node (its name as the Node or certificate spells it, lower case): only its
    /// agent may take it.
    Node(String),
    /// Several nodes claim it (one of them may be lying): nobody may take it.
    Contested(Vec<String>),
}

/// What per-node agent certificates vouched for, remembered after their agents go (until
/// the certificate expires).
#[derive(Debug, Default)]
struct Certified {
    /// Node -> what its latest certificate carried.
    by_node: HashMap<String, Vouched>,
    /// Name -> the nodes whose certificates carry it.
    names: HashMap<String, Vec<String>>,
    /// Address -> the nodes whose certificates carry it.
    addresses: HashMap<IpAddr, Vec<String>>,
}

/// Takes `node` off the lists of `keys` in `index`, dropping lists left empty.
fn unlist<K: std::hash::Hash + Eq>(index: &mut HashMap<K, Vec<String>>, keys: &[K], node: &str) {
    for k in keys {
        if let Some(v) = index.get_mut(k) {
            v.retain(|x| x != node);
            if v.is_empty() {
                index.remove(k);
            }
        }
    }
}

/// One node's latest certificate: its names, addresses and validity (Unix seconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vouched {
    /// Host names (lower case).
    pub names: Vec<String>,
    /// IP SANs.
    pub ips: Vec<IpAddr>,
    /// notBefore.
    pub not_before: i64,
    /// notAfter.
    pub not_after: i64,
}

impl Certified {
    /// Of the nodes in `candidates` whose certificates are valid at `now`, those whose
    /// certificate was issued last (several when issued in the same second).
    fn latest<'a>(&'a self, candidates: Option<&'a Vec<String>>, now: i64) -> Vec<&'a str> {
        let valid = candidates
            .into_iter()
            .flatten()
            .filter_map(|n| Some((n.as_str(), self.by_node.get(n)?)))
            .filter(|(_, v)| v.not_before <= now && now < v.not_after);
        let mut best: Vec<&str> = Vec::new();
        let mut when = i64::MIN;
        for (n, v) in valid {
            if v.not_before > when {
                (best, when) = (vec![n], v.not_before);
            } else if v.not_before == when {
                best.push(n);
            }
        }
        best
    }

    fn forget(&mut self, node: &str) {
        let Some(old) = self.by_node.remove(node) else {
            return;
        };
        unlist(&mut self.names, &old.names, node);
        unlist(&mut self.addresses, &old.ips, node);
    }
}

/// Most nodes whose certificates are remembered (a bound on what certificates can make
/// the server keep).
const CERTIFIED_NODES: usize = 100_000;

impl Table {
    /// Is `net` inside a pod network of a node other than `node`, or overlapping one?
    fn contested(&self, node: &str, net: &Cidr) -> bool {
        self.networks
            .iter()
            .any(|(c, n)| n != node && (c.covers(net) || net.covers(c)))
    }
}

/// The Nodes' addresses and pod networks; empty until the first list arrives (and
/// always when the server does not watch Nodes).
#[derive(Default)]
pub struct NodeInventory {
    table: RwLock<Table>,
    certified: RwLock<Certified>,
    /// Set for good when the watch starts.
    watched: AtomicBool,
    /// Pod IPs are routed to their node's agent (`--watch-node-pod-cidrs`).
    route_pod_ips: AtomicBool,
    /// Set once the first list has arrived.
    synced: AtomicBool,
    /// Set when the apiserver refuses the watch (401, 403): Node objects will never
    /// vouch, and routing goes on as without a watch rather than not at all.
    refused: AtomicBool,
}

impl NodeInventory {
    /// The node whose pod network holds `host` (an IP literal); `None` unless pod IPs
    /// are routed by node, or when the networks holding it belong to several nodes (a
    /// node cannot take another's pods by listing a narrower network).
    pub fn node_of(&self, host: &str) -> Option<String> {
        if !self.routes_pod_ips() {
            return None;
        }
        let ip: IpAddr = host.parse().ok()?;
        let table = self.table.read().unwrap_or_else(|e| e.into_inner());
        let mut owners = table
            .networks
            .iter()
            .filter(|(net, _)| net.contains(ip))
            .map(|(_, node)| node);
        let first = owners.next()?;
        owners.all(|n| n == first).then(|| first.clone())
    }

    /// Is `ip` one of Node `node`'s addresses, and no other Node's?
    pub fn has_address(&self, node: &str, ip: IpAddr) -> bool {
        let table = self.table.read().unwrap_or_else(|e| e.into_inner());
        table
            .by_name
            .get(node)
            .is_some_and(|f| f.addresses.contains(&ip))
            && table.addresses.get(&ip) == Some(&1)
    }

    /// Is `net` inside one of Node `node`'s pod networks, and clear of every other
    /// Node's?
    pub fn has_network(&self, node: &str, net: &Cidr) -> bool {
        let table = self.table.read().unwrap_or_else(|e| e.into_inner());
        table
            .by_name
            .get(node)
            .is_some_and(|f| f.pod_cidrs.iter().any(|c| c.covers(net)))
            && !table.contested(node, net)
    }

    /// Is `host` a node's name, one of its addresses, or inside a pod network? Such a
    /// dial belongs to one node's agent: it never falls back to any agent.
    pub fn knows(&self, host: &DialHost) -> bool {
        self.owner(host) != Owner::Nobody
    }

    /// Who owns `host`: the nodes whose Node objects name it, list it as an address or
    /// hold it in a pod network, and the nodes whose certificates carried it. One node
    /// owns it; two or more contest it.
    pub fn owner(&self, host: &DialHost) -> Owner {
        let mut owners: Vec<String> = Vec::new();
        let mut add = |n: &str| {
            if !owners.iter().any(|o| o.eq_ignore_ascii_case(n)) {
                owners.push(n.to_ascii_lowercase());
            }
        };
        let now = tether_certs::inspect::now();
        {
            let table = self.table.read().unwrap_or_else(|e| e.into_inner());
            let certified = self.certified.read().unwrap_or_else(|e| e.into_inner());
            match host {
                DialHost::Ip(ip) => {
                    table
                        .address_owners
                        .get(ip)
                        .into_iter()
                        .flatten()
                        .for_each(|n| add(n));
                    table
                        .networks
                        .iter()
                        .filter(|(net, _)| net.contains(*ip))
                        .for_each(|(_, n)| add(n));
                    certified
                        .latest(certified.addresses.get(ip), now)
                        .into_iter()
                        .for_each(&mut add);
                }
                DialHost::Name(name) => {
                    table
                        .names
                        .get(name)
                        .into_iter()
                        .flatten()
                        .for_each(|n| add(n));
                    certified
                        .latest(certified.names.get(name), now)
                        .into_iter()
                        .for_each(&mut add);
                }
            }
        }
        match owners.len() {
            0 => Owner::Nobody,
            1 => Owner::Node(owners.remove(0)),
            _ => Owner::Contested(owners),
        }
    }

    /// Remembers what a per-node certificate of `node` vouched for: its names and IP
    /// addresses, until it expires. The certificate a node presents replaces what its
    /// earlier ones said. When two nodes' certificates carry the same name or address,
    /// the one issued last (by notBefore) owns it, whichever connected last: an older
    /// certificate, replayed or left from before an address was reused, takes nothing
    /// from a newer one; two issued in the same second contest it.
    pub fn certify(&self, node: &str, vouched: Vouched) {
        let node = node.to_ascii_lowercase();
        let mut c = self.certified.write().unwrap_or_else(|e| e.into_inner());
        if c.by_node.get(&node) == Some(&vouched) {
            return;
        }
        if !c.by_node.contains_key(&node) && c.by_node.len() >= CERTIFIED_NODES {
            let now = tether_certs::inspect::now();
            let expired: Vec<String> = c
                .by_node
                .iter()
                .filter(|(_, v)| v.not_after <= now)
                .map(|(n, _)| n.clone())
                .collect();
            for n in expired {
                c.forget(&n);
            }
            if c.by_node.len() >= CERTIFIED_NODES {
                tracing::warn!(%node, "too many nodes' certificates to remember; this node's names and addresses are not pinned to it");
                return;
            }
        }
        c.forget(&node);
        for n in &vouched.names {
            let others = c.names.entry(n.clone()).or_default();
            if !others.is_empty() {
                tracing::warn!(name = %n, nodes = ?others, %node, "node certificates of several nodes carry one name; the one issued last owns it");
            }
            others.push(node.clone());
        }
        for ip in &vouched.ips {
            let others = c.addresses.entry(*ip).or_default();
            if !others.is_empty() {
                tracing::warn!(address = %ip, nodes = ?others, %node, "node certificates of several nodes carry one address; the one issued last owns it");
            }
            others.push(node.clone());
        }
        c.by_node.insert(node, vouched);
    }

    /// The addresses node `node` owns (see [`NodeInventory::owner`]): its Node object's
    /// and its certificate's that no other node claims.
    pub fn owned_addresses(&self, node: &str) -> Vec<IpAddr> {
        let mut all = self.addresses(node);
        {
            let c = self.certified.read().unwrap_or_else(|e| e.into_inner());
            if let Some(v) = c.by_node.get(&node.to_ascii_lowercase()) {
                all.extend(v.ips.iter().copied());
            }
        }
        all.sort();
        all.dedup();
        all.retain(|ip| self.owner(&DialHost::Ip(*ip)) == Owner::Node(node.to_ascii_lowercase()));
        all
    }

    /// Node `node`'s addresses (empty when unknown).
    pub fn addresses(&self, node: &str) -> Vec<IpAddr> {
        let table = self.table.read().unwrap_or_else(|e| e.into_inner());
        table
            .by_name
            .get(node)
            .map(|f| f.addresses.clone())
            .unwrap_or_default()
    }

    /// Replaces the table with what `nodes` say; unparsable values are skipped.
    pub fn set<'a>(&self, nodes: impl IntoIterator<Item = &'a Node>) {
        let mut table = Table::default();
        for node in nodes {
            let name = node.name_any();
            let (facts, names) = facts_of(node, &name);
            for net in &facts.pod_cidrs {
                table.networks.push((*net, name.clone()));
            }
            for ip in &facts.addresses {
                *table.addresses.entry(*ip).or_default() += 1;
                table
                    .address_owners
                    .entry(*ip)
                    .or_default()
                    .push(name.clone());
            }
            for n in names {
                table.names.entry(n).or_default().push(name.clone());
            }
            table.by_name.insert(name, facts);
        }
        let shared: Vec<IpAddr> = table
            .addresses
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(ip, _)| *ip)
            .collect();
        let mut old = self.table.write().unwrap_or_else(|e| e.into_inner());
        let was = old.addresses.values().filter(|n| **n > 1).count();
        if shared.len() != was && !shared.is_empty() {
            tracing::warn!(addresses = ?shared, "several Nodes list the same address: it verifies no agent (a node may be claiming another's address)");
        }
        *old = table;
        drop(old);
        self.synced.store(true, Ordering::Relaxed);
    }

    /// Routes pod IPs to their node's agent from now on (`--watch-node-pod-cidrs`).
    pub fn route_pod_ips(&self) {
        self.route_pod_ips.store(true, Ordering::Relaxed);
    }

    /// Are pod IPs routed by node?
    pub fn routes_pod_ips(&self) -> bool {
        self.route_pod_ips.load(Ordering::Relaxed)
    }

    /// Does the server watch Nodes?
    pub fn is_watched(&self) -> bool {
        self.watched.load(Ordering::Relaxed)
    }

    /// Has the first list of Nodes arrived?
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Relaxed)
    }

    /// Watching Nodes, but not knowing them yet: none listed so far, and not refused
    /// for good (then routing goes on without them, as with no watch).
    pub fn is_blind(&self) -> bool {
        self.is_watched() && !self.is_synced() && !self.refused.load(Ordering::Relaxed)
    }

    /// How many pod networks are known.
    pub fn networks(&self) -> usize {
        let table = self.table.read().unwrap_or_else(|e| e.into_inner());
        table.networks.len()
    }
}

/// One Node's facts (pod networks, addresses) and the names it answers to: its own,
/// and those of its `Hostname`, `InternalDNS` and `ExternalDNS` entries whose first
/// label is its name (kube-apiserver dials the Hostname first by default), lower case.
fn facts_of(node: &Node, name: &str) -> (NodeFacts, Vec<String>) {
    let mut facts = NodeFacts::default();
    if let Some(spec) = &node.spec {
        let mut cidrs = spec.pod_cidrs.clone().unwrap_or_default();
        if cidrs.is_empty() {
            cidrs.extend(spec.pod_cidr.clone());
        }
        for c in cidrs {
            match c.parse::<Cidr>() {
                Ok(net) => facts.pod_cidrs.push(net.normalized()),
                Err(e) => {
                    tracing::warn!(node = %name, cidr = %c, error = %e, "ignoring a pod CIDR")
                }
            }
        }
    }
    let own = name.to_ascii_lowercase();
    let mut names = vec![own.clone()];
    let addresses = node.status.as_ref().and_then(|s| s.addresses.as_ref());
    for a in addresses.into_iter().flatten() {
        match a.address.parse::<IpAddr>() {
            Ok(ip) if !facts.addresses.contains(&ip) => facts.addresses.push(ip),
            Ok(_) => {}
            // A host name counts only when it is the node's name or starts with it
            // (`node-a.lan`): a kubelet writes its own Node's status, and could
            // otherwise claim any name, a webhook Service's say, and take every dial to
            // it.
            Err(_) => match DialHost::parse(&a.address) {
                Ok(DialHost::Name(n))
                    if n.split('.').next() == Some(own.as_str()) && !names.contains(&n) =>
                {
                    names.push(n)
                }
                _ => {}
            },
        }
    }
    (facts, names)
}

/// Is this the apiserver refusing the watch (401, 403), as opposed to failing it?
fn refused(e: &watcher::Error) -> bool {
    let code = match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => s.code,
        watcher::Error::WatchError(s) => s.code,
        _ => 0,
    };
    matches!(code, 401 | 403)
}

/// Keeps `inventory` in step with the cluster's Nodes until `hard_stop`; watch errors
/// are retried with backoff (meanwhile the last table stays in use).
pub fn spawn(
    client: kube::Client,
    inventory: Arc<NodeInventory>,
    hard_stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    inventory.watched.store(true, Ordering::Relaxed);
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
                    _ = hard_stop.cancelled() => return,
                };
                match event {
                    Some(Ok(watcher::Event::InitApply(_) | watcher::Event::Init)) => {}
                    Some(Ok(_)) => {
                        let nodes = store.state();
                        inventory.set(nodes.iter().map(|n| n.as_ref()));
                        if !ready {
                            ready = true;
                            tracing::info!(
                                nodes = nodes.len(),
                                pod_networks = inventory.networks(),
                                "the nodes' addresses and pod networks are known"
                            );
                        }
                    }
                    Some(Err(e)) if refused(&e) => {
                        if !inventory.refused.swap(true, Ordering::Relaxed) {
                            tracing::error!(error = %chain(&e), "the apiserver refuses this server list and watch on nodes: Node objects pin no node's addresses, so a dial to one may go to any agent that --proxy-strategies' default allows, and token-authenticated agents' addresses stay unverified. Grant them (deploy/rbac.yaml, system:konnectivity-server:nodes)");
                        }
                    }
                    Some(Err(e)) => tracing::warn!(error = %chain(&e), "watching nodes failed; retrying (until the first list, no dial goes to just any agent)"),
                    None => return,
                }
            }
        }
        .instrument(tracing::info_span!("nodes")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, cidrs: &[&str], addrs: &[&str]) -> Node {
        let addresses: Vec<_> = addrs
            .iter()
            .map(|a| serde_json::json!({"type": "InternalIP", "address": a}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name},
            "spec": {"podCIDR": cidrs.first(), "podCIDRs": cidrs},
            "status": {"addresses": addresses},
        }))
        .unwrap()
    }

    #[test]
    fn a_pod_ip_names_its_node() {
        let nets = NodeInventory::default();
        nets.route_pod_ips();
        assert_eq!(nets.node_of("10.244.1.7"), None);
        nets.set(&[
            node("a", &["10.244.1.0/24", "fd00:1::/64"], &[]),
            node("b", &["10.244.2.0/24"], &[]),
            node("c", &[], &[]),
            node("bad", &["nonsense"], &[]),
        ]);
        assert_eq!(nets.networks(), 3);
        assert_eq!(nets.node_of("10.244.1.7").as_deref(), Some("a"));
        assert_eq!(nets.node_of("fd00:1::9").as_deref(), Some("a"));
        assert_eq!(nets.node_of("10.244.2.200").as_deref(), Some("b"));
        assert_eq!(nets.node_of("10.244.3.1"), None);
        assert_eq!(nets.node_of("node-a"), None);
        nets.set(&[node("b", &["10.244.2.0/24"], &[])]);
        assert_eq!(nets.node_of("10.244.1.7"), None);
    }

    #[test]
    fn a_node_vouches_for_its_own_addresses_and_networks_only() {
        let nodes = NodeInventory::default();
        nodes.set(&[
            node(
                "a",
                &["10.244.1.0/24"],
                &["192.0.2.1", "a.example", "2001:db8::1", "webhook.ns.svc"],
            ),
            node("b", &["10.244.2.0/24"], &["192.0.2.2"]),
        ]);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(nodes.has_address("a", ip("192.0.2.1")));
        assert!(nodes.has_address("a", ip("2001:db8::1")));
        assert!(!nodes.has_address("a", ip("192.0.2.2")));
        assert!(!nodes.has_address("z", ip("192.0.2.1")));
        let net = |s: &str| s.parse::<Cidr>().unwrap();
        assert!(nodes.has_network("a", &net("10.244.1.0/25")));
        assert!(!nodes.has_network("a", &net("10.244.0.0/16")));
        assert!(!nodes.has_network("a", &net("10.244.2.0/24")));
        // Without --watch-node-pod-cidrs pod IPs are not routed by node.
        assert_eq!(nodes.node_of("10.244.1.7"), None);
        let h = |s: &str| DialHost::parse(s).unwrap();
        assert!(
            nodes.knows(&h("192.0.2.2")) && nodes.knows(&h("A")) && nodes.knows(&h("10.244.2.9"))
        );
        assert!(!nodes.knows(&h("192.0.2.9")) && !nodes.knows(&h("c")));
        // A Hostname entry names its node when it starts with the node's name; any
        // other name a kubelet lists (a webhook Service's, say) is not its to take.
        assert_eq!(nodes.owner(&h("a.example.")), Owner::Node("a".into()));
        assert_eq!(nodes.owner(&h("webhook.ns.svc")), Owner::Nobody);
        assert_eq!(nodes.owner(&h("10.244.2.9")), Owner::Node("b".into()));
    }

    #[test]
    fn what_two_nodes_list_vouches_for_neither() {
        let nodes = NodeInventory::default();
        nodes.route_pod_ips();
        // b's kubelet (compromised) lists a's address and a narrower slice of a's pods.
        nodes.set(&[
            node("a", &["10.244.1.0/24"], &["192.0.2.1"]),
            node(
                "b",
                &["10.244.2.0/24", "10.244.1.128/25"],
                &["192.0.2.2", "192.0.2.1"],
            ),
        ]);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(!nodes.has_address("a", ip("192.0.2.1")));
        assert!(!nodes.has_address("b", ip("192.0.2.1")));
        assert!(nodes.has_address("b", ip("192.0.2.2")));
        let net = |s: &str| s.parse::<Cidr>().unwrap();
        assert!(!nodes.has_network("b", &net("10.244.1.128/25")));
        assert!(!nodes.has_network("a", &net("10.244.1.0/24")));
        assert_eq!(nodes.node_of("10.244.1.200"), None);
        assert_eq!(nodes.node_of("10.244.2.9").as_deref(), Some("b"));
        assert!(
            matches!(
                nodes.owner(&DialHost::parse("192.0.2.1").unwrap()),
                Owner::Contested(_)
            ),
            "still a node's: no fallback to any agent"
        );
    }

    #[test]
    fn certificates_pin_names_and_addresses_after_their_agent_goes() {
        let nodes = NodeInventory::default();
        let h = |s: &str| DialHost::parse(s).unwrap();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let now = tether_certs::inspect::now();
        let cert = |names: &[&str], ips: &[&str], issued: i64| Vouched {
            names: names.iter().map(|n| n.to_string()).collect(),
            ips: ips.iter().map(|i| ip(i)).collect(),
            not_before: now - issued,
            not_after: now + 3600,
        };
        nodes.certify("Node-B", cert(&["node-b", "b.lan"], &["127.0.0.2"], 100));
        assert_eq!(nodes.owner(&h("127.0.0.2")), Owner::Node("node-b".into()));
        assert_eq!(nodes.owner(&h("B.LAN.")), Owner::Node("node-b".into()));
        assert_eq!(nodes.owner(&h("127.0.0.9")), Owner::Nobody);
        // An older certificate of another node carrying the address (replayed, or left
        // from before the address was reused) takes nothing, though it connected last.
        nodes.certify("node-a", cert(&["node-a"], &["127.0.0.2"], 5000));
        assert_eq!(nodes.owner(&h("127.0.0.2")), Owner::Node("node-b".into()));
        // A newer one does: the CA issued it last.
        nodes.certify("node-c", cert(&["node-c"], &["127.0.0.2"], 10));
        assert_eq!(nodes.owner(&h("127.0.0.2")), Owner::Node("node-c".into()));
        // A newer certificate of the node replaces what the older one said.
        nodes.certify("node-b", cert(&["node-b"], &["127.0.0.3"], 1));
        assert_eq!(nodes.owner(&h("b.lan")), Owner::Nobody);
        // An expired certificate vouches for nothing.
        nodes.certify(
            "node-d",
            Vouched {
                not_after: now - 1,
                ..cert(&["node-d"], &["127.0.0.4"], 100)
            },
        );
        assert_eq!(nodes.owner(&h("127.0.0.4")), Owner::Nobody);
        // A Node object listing the address for another node contests it.
        nodes.set(&[node("c", &[], &["127.0.0.3"])]);
        assert!(matches!(nodes.owner(&h("127.0.0.3")), Owner::Contested(_)));
    }
}

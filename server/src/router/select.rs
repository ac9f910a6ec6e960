//! Which agent stream takes a dial: `--proxy-strategies`, each agent's eligibility
//! under them, and the registry of connected agent streams they choose from.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, RwLock};

use rand::seq::IndexedRandom;
use tether_core::host::DialHost;
use tether_core::identifiers::Cidr;

use super::state::AgentStream;
use crate::nodes::{NodeInventory, Owner};

/// How to pick an agent for a dial; several are tried in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Any agent, at random.
    Default,
    /// An agent whose host/ipv4/ipv6 identifier equals the dial host.
    DestHost,
    /// An agent that advertised `default-route=true`.
    DefaultRoute,
    /// An agent that advertised a `cidr` containing the dial host, or the agent on the
    /// node whose pod network holds it (with `--watch-node-pod-cidrs`); Tether only.
    DestCidr,
}

impl Strategy {
    /// The flag spelling, also the `proxy_strategy` metric label.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Default => "default",
            Strategy::DestHost => "destHost",
            Strategy::DefaultRoute => "defaultRoute",
            Strategy::DestCidr => "destCIDR",
        }
    }
}

impl std::str::FromStr for Strategy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "default" => Ok(Strategy::Default),
            "destHost" => Ok(Strategy::DestHost),
            "defaultRoute" => Ok(Strategy::DefaultRoute),
            "destCIDR" => Ok(Strategy::DestCidr),
            other => Err(format!(
                "unknown proxy strategy {other:?} (use default, destHost, defaultRoute or destCIDR)"
            )),
        }
    }
}

/// Parses a comma-separated `--proxy-strategies` value.
pub fn parse_strategies(s: &str) -> Result<Vec<Strategy>, String> {
    let list: Vec<Strategy> = s
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    if list.is_empty() {
        return Err("--proxy-strategies is empty (use e.g. default or destHost,default)".into());
    }
    Ok(list)
}

// === eligibility ===

impl AgentStream {
    /// What its streams are grouped, chosen and capped by: who it proved to be (a
    /// token's node, a per-node certificate), else its agent ID. The two never meet:
    /// an agent that proved nothing and claims node-b's ID is not in node-b's group.
    pub fn group(&self) -> String {
        match &self.verified.principal {
            Some(node) => format!("node/{node}"),
            None => format!("id/{}", self.agent_id),
        }
    }

    /// Did the server verify that this agent reaches `host` (a name or an address, as
    /// [`DialHost`] spells it)? Names and certificate addresses were checked at
    /// admission; a node's Node object vouches for the addresses it lists now.
    pub fn vouched_host(&self, host: &str, nodes: &NodeInventory) -> bool {
        match host.parse::<IpAddr>() {
            Ok(ip) => {
                self.verified.ips.contains(&ip)
                    || self
                        .verified
                        .node
                        .as_deref()
                        .is_some_and(|n| nodes.has_address(n, ip))
            }
            Err(_) => self
                .verified
                .hosts
                .iter()
                .any(|h| h.eq_ignore_ascii_case(host)),
        }
    }

    /// Is `host` (canonical) the node this agent was verified to run on (its pod-bound
    /// token's, or its kubelet certificate's), by name or by an address that node's
    /// Node object lists now? Then the agent reaches it whether or not it claimed it:
    /// upstream's own manifests (the Kubernetes docs' DaemonSet) claim no identifiers,
    /// and a dial to a node's address must still go to that node's agent.
    pub fn on_verified_node(&self, host: &str, nodes: &NodeInventory) -> bool {
        let Some(node) = self.verified.node.as_deref() else {
            return false;
        };
        match host.parse::<IpAddr>() {
            Ok(ip) => nodes.has_address(node, ip),
            Err(_) => node.eq_ignore_ascii_case(host),
        }
    }

    /// Did the server verify the agent's network `net` (inside its token's node's pod
    /// networks)?
    pub fn vouched_network(&self, net: &Cidr, nodes: &NodeInventory) -> bool {
        self.verified
            .node
            .as_deref()
            .is_some_and(|n| nodes.has_network(n, net))
    }

    /// Is this agent the one on `node`? Only its verified names count, unless claims are
    /// trusted (then, for an agent the server verified nothing of, its ID and `host=`
    /// identifiers, as upstream trusts them).
    pub fn runs_on(&self, node: &str, trust_claims: bool) -> bool {
        let v = &self.verified;
        if !v.by.is_empty() || !trust_claims {
            return v
                .node
                .as_deref()
                .is_some_and(|n| n.eq_ignore_ascii_case(node))
                || v.hosts.iter().any(|h| h.eq_ignore_ascii_case(node));
        }
        self.agent_id.eq_ignore_ascii_case(node)
            || self
                .identifiers
                .hosts
                .iter()
                .any(|h| h.eq_ignore_ascii_case(node))
    }

    /// Could `strategy` ever pick this agent? (`ready_backends{proxy_strategy}`; decided
    /// from what is fixed for the stream's life, so adding and removing it count alike.)
    pub(crate) fn counts_for(&self, strategy: Strategy, pod_ips: bool, trust_claims: bool) -> bool {
        let ids = &self.identifiers;
        let v = &self.verified;
        match strategy {
            Strategy::Default => true,
            Strategy::DestHost if trust_claims => !ids.hosts.is_empty() || !ids.ips.is_empty(),
            Strategy::DestHost => {
                ids.hosts
                    .iter()
                    .any(|h| v.hosts.iter().any(|n| n.eq_ignore_ascii_case(h)))
                    || ids.ips.iter().any(|ip| v.ips.contains(ip))
                    || v.node.is_some()
            }
            Strategy::DefaultRoute => ids.default_route && trust_claims,
            Strategy::DestCidr => {
                pod_ips || (!ids.cidrs.is_empty() && (trust_claims || v.node.is_some()))
            }
        }
    }

    /// `host` is canonical ([`DialHost`]); `pod_node`: the node whose pod network
    /// holds it, if known. An identifier routes only where the server verified it,
    /// unless claims are trusted.
    fn eligible(
        &self,
        strategy: Strategy,
        host: &str,
        pod_node: Option<&str>,
        reg: &Registry,
    ) -> bool {
        let trust = reg.trust_claims;
        match strategy {
            Strategy::Default => true,
            Strategy::DestHost => {
                (self.identifiers.matches_host(host)
                    && (trust || self.vouched_host(host, &reg.nodes)))
                    || self.on_verified_node(host, &reg.nodes)
            }
            Strategy::DefaultRoute => self.identifiers.default_route && trust,
            Strategy::DestCidr => {
                let by_claim = host.parse::<IpAddr>().is_ok_and(|ip| {
                    self.identifiers
                        .cidrs
                        .iter()
                        .any(|c| c.contains(ip) && (trust || self.vouched_network(c, &reg.nodes)))
                });
                by_claim || pod_node.is_some_and(|n| self.runs_on(n, trust))
            }
        }
    }
}

/// Why an agent stream was not registered.
#[derive(Debug, thiserror::Error)]
#[error("{count} streams already open for {what} {key:?} (the most --max-agent-streams allows)")]
pub struct TooManyStreams {
    /// `agent ID` or `verified identity`.
    pub what: &'static str,
    /// The agent ID or verified identity.
    pub key: String,
    /// How many it holds.
    pub count: usize,
}

/// The streams of one group (one agent, or one verified identity).
struct Group {
    key: String,
    streams: Vec<Arc<AgentStream>>,
}

/// The registry's tables.
#[derive(Default)]
struct Groups {
    list: Vec<Group>,
    /// Group key -> its place in `list`.
    index: HashMap<String, usize>,
    streams: usize,
}

/// Every connected agent stream, grouped by agent (or verified identity) so that a dial
/// picks an agent first and one of its streams second: an agent that opens many streams
/// gets no larger share of the dials.
pub struct Registry {
    groups: RwLock<Groups>,
    /// The Nodes' addresses and pod networks (empty unless the server watches Nodes).
    nodes: Arc<NodeInventory>,
    /// `--unsafe-trust-agent-identifiers`: route by what agents claim.
    trust_claims: bool,
    /// Most streams per group (0 = no cap).
    max_streams: usize,
    /// Woken whenever a stream is added (dials waiting for an agent look again).
    added: tokio::sync::Notify,
}

impl Default for Registry {
    fn default() -> Self {
        Registry::new(false, 0)
    }
}

impl Registry {
    /// An empty registry; `trust_claims` routes by unverified identifiers,
    /// `max_streams` caps streams per agent ID and per identity (0 = no cap).
    pub fn new(trust_claims: bool, max_streams: usize) -> Self {
        Registry {
            groups: RwLock::new(Groups::default()),
            nodes: Arc::default(),
            trust_claims,
            max_streams,
            added: tokio::sync::Notify::new(),
        }
    }

    /// The Nodes' addresses and pod networks.
    pub fn nodes(&self) -> &Arc<NodeInventory> {
        &self.nodes
    }

    /// Are unverified identifiers routed by?
    pub fn trusts_claims(&self) -> bool {
        self.trust_claims
    }

    /// Registers `agent` unless its group (its verified identity, else its agent ID)
    /// already holds the most streams allowed; the number of streams after. A claimed
    /// ID counts only where nothing was verified, so no one fills another node's share
    /// by claiming its ID.
    pub(crate) fn add(&self, agent: Arc<AgentStream>) -> Result<usize, TooManyStreams> {
        let key = agent.group();
        let mut g = self.groups.write().unwrap_or_else(|e| e.into_inner());
        if self.max_streams > 0 {
            let in_group = g
                .index
                .get(&key)
                .map(|&i| g.list[i].streams.len())
                .unwrap_or(0);
            if in_group >= self.max_streams {
                return Err(TooManyStreams {
                    what: if agent.verified.principal.is_some() {
                        "verified identity"
                    } else {
                        "agent ID"
                    },
                    key: key.clone(),
                    count: in_group,
                });
            }
        }
        g.streams += 1;
        match g.index.get(&key).copied() {
            Some(i) => g.list[i].streams.push(agent),
            None => {
                let at = g.list.len();
                g.list.push(Group {
                    key: key.clone(),
                    streams: vec![agent],
                });
                g.index.insert(key, at);
            }
        }
        let streams = g.streams;
        drop(g);
        self.added.notify_waiters();
        Ok(streams)
    }

    /// Resolves when the next stream is added (from the moment it is called, even
    /// before it is polled).
    pub(crate) fn arrived(&self) -> tokio::sync::futures::Notified<'_> {
        self.added.notified()
    }

    /// Removes `agent`; false when it was not registered.
    pub(crate) fn remove(&self, agent: &AgentStream) -> bool {
        let key = agent.group();
        let mut guard = self.groups.write().unwrap_or_else(|e| e.into_inner());
        let g = &mut *guard;
        let Some(&at) = g.index.get(&key) else {
            return false;
        };
        let streams = &mut g.list[at].streams;
        let before = streams.len();
        streams.retain(|b| b.key != agent.key);
        if streams.len() == before {
            return false;
        }
        if streams.is_empty() {
            g.index.remove(&key);
            g.list.swap_remove(at);
            if let Some(moved) = g.list.get(at) {
                g.index.insert(moved.key.clone(), at);
            }
        }
        g.streams -= 1;
        true
    }

    /// Number of connected agent streams.
    pub fn len(&self) -> usize {
        self.groups
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .streams
    }

    /// Every connected agent stream, group by group.
    pub fn snapshot(&self) -> Vec<Arc<AgentStream>> {
        let g = self.groups.read().unwrap_or_else(|e| e.into_inner());
        g.list
            .iter()
            .flat_map(|grp| grp.streams.iter().cloned())
            .collect()
    }

    /// The connected agents as JSON for the admin endpoint's `/agents`: one entry per
    /// agent ID with its identifiers, what the server verified (`verifiedHosts`;
    /// `verifiedIps`, every address that routes to it, claimed or not; `verifiedBy`,
    /// `verifiedNode`; from its first stream), whether it drains, its stream count and
    /// what carries its streams (`transports`: `h2`, `websocket`).
    pub fn agents_json(&self) -> String {
        serde_json::json!({ "agents": self.agents() }).to_string()
    }

    /// The connected agents, one entry an agent ID, as `/agents` lists them.
    pub fn agents(&self) -> Vec<serde_json::Value> {
        let mut by_id: std::collections::BTreeMap<String, serde_json::Value> = Default::default();
        for b in self.snapshot() {
            let entry = by_id.entry(b.agent_id.clone()).or_insert_with(|| {
                // What routes to it: its certificate's addresses, and those its node
                // owns (its Node object's, its certificate's), claimed or not.
                let mut ips = b.verified.ips.clone();
                if let Some(node) = &b.verified.node {
                    for ip in self.nodes.owned_addresses(node) {
                        if !ips.contains(&ip) {
                            ips.push(ip);
                        }
                    }
                }
                serde_json::json!({
                    "id": b.agent_id,
                    "hosts": b.identifiers.hosts,
                    "ips": b.identifiers.ips.iter().map(|ip| ip.to_string()).collect::<Vec<_>>(),
                    "verifiedHosts": b.verified.hosts,
                    "verifiedIps": ips.iter().map(|ip| ip.to_string()).collect::<Vec<_>>(),
                    "verifiedBy": b.verified.by,
                    "verifiedNode": b.verified.node,
                    "draining": true,
                    "streams": 0,
                    "transports": [],
                })
            });
            entry["streams"] = (entry["streams"].as_u64().unwrap_or(0) + 1).into();
            if let Some(t) = entry["transports"].as_array_mut() {
                if !t.iter().any(|x| x == b.transport) {
                    t.push(b.transport.into());
                }
            }
            if !b.is_draining() {
                entry["draining"] = false.into();
            }
        }
        by_id.into_values().collect()
    }

    /// True when no agent is connected.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Picks an agent stream for `address`, or says why none may take it.
    ///
    /// Unless claims are trusted, a host one node owns (its name, an address or pod
    /// network its Node object lists, a name or address its certificate carried; see
    /// [`NodeInventory::owner`]) goes only to the agent verified as that node, whatever
    /// the strategies: never to just any agent (`default`, `defaultRoute`), which may be
    /// the attacker. With that agent absent, or with the host contested, the dial fails.
    /// Any other host: the first strategy with a candidate wins; among its candidates
    /// an agent (group) is chosen at random, then one of its eligible streams,
    /// preferring agents and streams that are not draining.
    ///
    /// With the agent comes the name of what chose it: a strategy's, or `node` for a
    /// host one node owns.
    pub fn route(
        &self,
        strategies: &[Strategy],
        address: &str,
    ) -> Result<(Arc<AgentStream>, &'static str), NoRoute> {
        let (host, _) = DialHost::parse_address(address).map_err(NoRoute::Host)?;
        let g = self.groups.read().unwrap_or_else(|e| e.into_inner());
        let mut rng = rand::rng();
        if !self.trust_claims {
            match self.nodes.owner(&host) {
                Owner::Node(node) => {
                    let on_node = |b: &&Arc<AgentStream>| {
                        b.verified
                            .node
                            .as_deref()
                            .is_some_and(|n| n.eq_ignore_ascii_case(&node))
                    };
                    return pick_group(&g.list, on_node, &mut rng)
                        .map(|b| (b, "node"))
                        .ok_or(NoRoute::NodeAgent(node));
                }
                Owner::Contested(nodes) => return Err(NoRoute::Contested(nodes)),
                Owner::Nobody => {}
            }
        }
        // Watching Nodes but not yet (or no longer able to) read them: a node's hosts
        // are unknown, so no dial may go to just any agent.
        let blind = !self.trust_claims && self.nodes.is_blind();
        let host = host.to_string();
        let pod_node = if strategies.contains(&Strategy::DestCidr) {
            self.nodes.node_of(&host)
        } else {
            None
        };
        for &strategy in strategies {
            if blind && matches!(strategy, Strategy::Default | Strategy::DefaultRoute) {
                continue;
            }
            if strategy == Strategy::Default {
                if let Some(b) = any_active(&g.list, &mut rng) {
                    return Ok((b, strategy.name()));
                }
            }
            let eligible =
                |b: &&Arc<AgentStream>| b.eligible(strategy, &host, pod_node.as_deref(), self);
            if let Some(b) = pick_group(&g.list, eligible, &mut rng) {
                return Ok((b, strategy.name()));
            }
        }
        Err(match blind {
            true => NoRoute::NodesUnknown,
            false => NoRoute::NoAgent,
        })
    }

    /// [`Registry::route`]'s agent, if any (the tests' shorthand).
    #[cfg(test)]
    pub fn select(&self, strategies: &[Strategy], address: &str) -> Option<Arc<AgentStream>> {
        self.route(strategies, address).ok().map(|(b, _)| b)
    }
}

/// Why no agent takes a dial (the caller gets upstream's "No agent available"; the log
/// says which of these).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoRoute {
    /// No agent the strategies allow is connected.
    #[error("no agent the proxy strategies allow is connected")]
    NoAgent,
    /// The host is a node's, and no agent verified as that node is connected.
    #[error("the host is node {0}'s, and no agent verified as {0} is connected")]
    NodeAgent(String),
    /// Several nodes claim the host.
    #[error("the host is claimed by several nodes ({}), so by none", .0.join(", "))]
    Contested(Vec<String>),
    /// The server watches Nodes and has not read them (yet, or it is refused): which
    /// node owns the host is unknown, so it goes to no agent `default` would pick.
    #[error("the server has not read the Node objects yet (it needs list and watch on nodes): no dial goes to just any agent until it has")]
    NodesUnknown,
    /// The host cannot be routed safely.
    #[error(transparent)]
    Host(tether_core::host::HostError),
}

/// For `default`, any agent: a few random probes find a group with a stream that is
/// not draining without looking at thousands.
fn any_active(groups: &[Group], rng: &mut impl rand::Rng) -> Option<Arc<AgentStream>> {
    for _ in 0..4 {
        let group = groups.choose(rng)?;
        let mut pick = Pick::default();
        for b in group.streams.iter().filter(|b| !b.is_draining()) {
            pick.offer(b, rng);
        }
        if let Some(b) = pick.chosen {
            return Some(Arc::clone(b));
        }
    }
    None
}

/// One pass, no allocation: a uniform pick among the groups with an `eligible` stream
/// that is not draining (then among all with an eligible stream), and within the
/// chosen group a uniform pick among those streams.
fn pick_group(
    groups: &[Group],
    eligible: impl Fn(&&Arc<AgentStream>) -> bool,
    rng: &mut impl rand::Rng,
) -> Option<Arc<AgentStream>> {
    let (mut active, mut any) = (Pick::default(), Pick::default());
    for group in groups {
        let (mut g_active, mut g_any) = (Pick::default(), Pick::default());
        for b in group.streams.iter().filter(&eligible) {
            g_any.offer(b, rng);
            if !b.is_draining() {
                g_active.offer(b, rng);
            }
        }
        if let Some(b) = g_active.chosen {
            active.offer(b, rng);
        }
        if let Some(b) = g_any.chosen {
            any.offer(b, rng);
        }
    }
    active.chosen.or(any.chosen).map(Arc::clone)
}

/// Reservoir sampling of one: after `n` offers each was chosen with probability 1/n.
#[derive(Default)]
struct Pick<'a> {
    seen: u32,
    chosen: Option<&'a Arc<AgentStream>>,
}

impl<'a> Pick<'a> {
    fn offer(&mut self, b: &'a Arc<AgentStream>, rng: &mut impl rand::Rng) {
        self.seen += 1;
        if rng.random_range(0..self.seen) == 0 {
            self.chosen = Some(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::state::Verified;
    use tether_core::identifiers::AgentIdentifiers;
    use tokio::sync::mpsc;

    fn verified_agent(id: &str, ids: &str, verified: Verified) -> Arc<AgentStream> {
        let (tx, _rx) = mpsc::channel(1);
        let (ctl, _ctl_rx) = tether_core::queue::queue();
        Arc::new(AgentStream::new(
            id.into(),
            AgentIdentifiers::parse(ids, true).unwrap(),
            verified,
            tx,
            ctl,
            None,
        ))
    }

    fn agent(id: &str, ids: &str) -> Arc<AgentStream> {
        verified_agent(id, ids, Verified::default())
    }

    /// Claims are routed by only with `--unsafe-trust-agent-identifiers`.
    fn trusting() -> Registry {
        Registry::new(true, 0)
    }

    fn node(name: &str, cidr: &str, addr: &str) -> k8s_openapi::api::core::v1::Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name}, "spec": {"podCIDRs": [cidr]},
            "status": {"addresses": [{"type": "InternalIP", "address": addr}]},
        }))
        .unwrap()
    }

    #[test]
    fn strategies_in_order() {
        let reg = trusting();
        reg.add(agent("a", "host=node-a&ipv4=10.0.0.1")).unwrap();
        reg.add(agent("b", "ipv4=10.0.0.2&cidr=192.168.5.0/24"))
            .unwrap();
        reg.add(agent("c", "default-route=true")).unwrap();
        let pick = |s: &str, addr: &str| {
            reg.select(&parse_strategies(s).unwrap(), addr)
                .map(|b| b.agent_id.clone())
        };
        assert_eq!(pick("destHost", "10.0.0.2:10250").as_deref(), Some("b"));
        assert_eq!(pick("destHost", "node-a:10250").as_deref(), Some("a"));
        assert_eq!(pick("destHost", "10.9.9.9:1"), None);
        assert_eq!(pick("destCIDR", "192.168.5.7:80").as_deref(), Some("b"));
        assert_eq!(
            pick("destHost,defaultRoute", "10.9.9.9:1").as_deref(),
            Some("c")
        );
        assert!(pick("destHost,default", "10.9.9.9:1").is_some());
        assert!(parse_strategies("destHost,bogus").is_err());
    }

    #[test]
    fn by_default_only_verified_identifiers_route() {
        let reg = Registry::default();
        // Claims nodeB's name and address, proved neither.
        reg.add(agent(
            "node-a",
            "host=node-b&ipv4=10.0.0.2&cidr=10.244.2.0/24&default-route=true",
        ))
        .unwrap();
        // A certificate naming node-b and 10.0.0.2.
        let cert = Verified {
            by: "certificate",
            hosts: vec!["node-b".into()],
            ips: vec!["10.0.0.2".parse().unwrap()],
            node: None,
            principal: Some("node-b".into()),
        };
        reg.add(verified_agent("node-b", "host=node-b&ipv4=10.0.0.2", cert))
            .unwrap();
        // A token bound to node-c, whose Node object lists 10.0.0.3 and 10.244.3.0/24.
        let token = Verified {
            by: "serviceaccount-token",
            hosts: vec!["node-c".into()],
            ips: vec![],
            node: Some("node-c".into()),
            principal: Some("node-c".into()),
        };
        reg.add(verified_agent(
            "node-c",
            "host=node-c&ipv4=10.0.0.3&ipv4=10.0.0.9&cidr=10.244.3.0/24&cidr=10.244.0.0/16",
            token,
        ))
        .unwrap();
        reg.nodes()
            .set(&[node("node-c", "10.244.3.0/24", "10.0.0.3")]);
        let pick = |s: &str, addr: &str| {
            reg.select(&parse_strategies(s).unwrap(), addr)
                .map(|b| b.agent_id.clone())
        };
        for _ in 0..50 {
            assert_eq!(
                pick("destHost", "10.0.0.2:10250").as_deref(),
                Some("node-b")
            );
            assert_eq!(pick("destHost", "node-b:10250").as_deref(), Some("node-b"));
            assert_eq!(
                pick("destHost", "10.0.0.3:10250").as_deref(),
                Some("node-c")
            );
            assert_eq!(pick("destCIDR", "10.244.3.9:80").as_deref(), Some("node-c"));
        }
        // Claimed, not vouched for by the Node object.
        assert_eq!(pick("destHost", "10.0.0.9:10250"), None);
        assert_eq!(pick("destCIDR", "10.244.2.9:80"), None);
        assert_eq!(pick("defaultRoute", "10.9.9.9:1"), None);
        // Spelled otherwise, the same hosts.
        assert_eq!(
            pick("destHost", "[::ffff:10.0.0.2]:10250").as_deref(),
            Some("node-b")
        );
        assert_eq!(pick("destHost", "node-b.:10250").as_deref(), Some("node-b"));
        // A dial to a Node's address goes to that node's agent or nowhere: never to
        // just any agent, which may be the attacker.
        reg.nodes().set(&[
            node("node-c", "10.244.3.0/24", "10.0.0.3"),
            node("node-d", "10.244.4.0/24", "10.0.0.4"),
        ]);
        assert_eq!(pick("destHost,default", "10.0.0.4:10250"), None);
        assert_eq!(pick("destHost,default", "node-d:10250"), None);
        assert_eq!(pick("destCIDR,default", "10.244.4.5:80"), None);
        assert!(pick("destHost,default", "10.9.9.9:1").is_some());
        // The same claims route once the operator trusts them.
        let reg = trusting();
        reg.add(agent("node-a", "host=node-b")).unwrap();
        assert!(reg.select(&[Strategy::DestHost], "node-b:1").is_some());
    }

    #[test]
    fn a_pod_ip_goes_to_the_agent_on_its_node() {
        let reg = trusting();
        reg.nodes().route_pod_ips();
        reg.nodes().set(&[
            node("n1", "10.244.1.0/24", "192.0.2.1"),
            node("n2", "10.244.2.0/24", "192.0.2.2"),
        ]);
        reg.add(agent("n1", "")).unwrap();
        reg.add(agent("x", "host=n2")).unwrap();
        // Verified as n3 by its token: its own claims no longer count.
        let claims_n1 = verified_agent(
            "n1",
            "",
            Verified {
                by: "serviceaccount-token",
                hosts: vec!["n3".into()],
                ips: vec![],
                node: Some("n3".into()),
                principal: Some("n3".into()),
            },
        );
        reg.add(claims_n1).unwrap();
        let s = parse_strategies("destCIDR").unwrap();
        for _ in 0..20 {
            let b = reg.select(&s, "10.244.1.9:8080").unwrap();
            assert!(b.agent_id == "n1" && b.verified.by.is_empty());
            assert_eq!(reg.select(&s, "10.244.2.9:80").unwrap().agent_id, "x");
        }
        assert!(reg.select(&s, "10.244.3.9:80").is_none());
        // Without destCIDR the pod networks change nothing.
        assert!(reg
            .select(&parse_strategies("destHost").unwrap(), "10.244.1.9:80")
            .is_none());
    }

    #[test]
    fn an_agent_that_claims_nothing_reaches_its_verified_node() {
        let reg = Registry::default();
        reg.nodes().set(&[
            node("n1", "10.244.1.0/24", "192.0.2.1"),
            node("n2", "10.244.2.0/24", "192.0.2.2"),
        ]);
        let token = |node: &str| Verified {
            by: "serviceaccount-token",
            hosts: vec![],
            ips: vec![],
            node: Some(node.into()),
            principal: Some(node.into()),
        };
        // The Kubernetes docs' agents: random IDs, no identifiers.
        reg.add(verified_agent("3f2a", "", token("n1"))).unwrap();
        reg.add(verified_agent("9c1b", "", token("n2"))).unwrap();
        let s = parse_strategies("destHost,destCIDR,default").unwrap();
        for _ in 0..20 {
            assert_eq!(reg.select(&s, "192.0.2.1:10250").unwrap().agent_id, "3f2a");
            assert_eq!(reg.select(&s, "192.0.2.2:10250").unwrap().agent_id, "9c1b");
            assert_eq!(reg.select(&s, "n2:10250").unwrap().agent_id, "9c1b");
        }
        // An unverified agent claiming n1's address still gets none of its dials.
        reg.add(agent("impostor", "ipv4=192.0.2.1&host=n1"))
            .unwrap();
        for _ in 0..20 {
            assert_eq!(reg.select(&s, "192.0.2.1:10250").unwrap().agent_id, "3f2a");
        }
    }

    #[test]
    fn draining_agents_are_last_choice() {
        let reg = Registry::default();
        let a = agent("a", "");
        let b = agent("b", "");
        reg.add(a.clone()).unwrap();
        reg.add(b.clone()).unwrap();
        a.set_draining();
        for _ in 0..50 {
            assert_eq!(
                reg.select(&[Strategy::Default], "x:1").unwrap().agent_id,
                "b"
            );
        }
        b.set_draining();
        assert!(reg.select(&[Strategy::Default], "x:1").is_some());
    }

    #[test]
    fn the_one_agent_not_draining_is_found_among_many_and_picks_are_uniform() {
        let reg = Registry::default();
        for i in 0..200 {
            let a = agent(&format!("d{i}"), "");
            a.set_draining();
            reg.add(a).unwrap();
        }
        reg.add(agent("live", "")).unwrap();
        for _ in 0..50 {
            let picked = reg.select(&[Strategy::Default], "x:1").unwrap();
            assert_eq!(picked.agent_id, "live");
        }
        let reg = trusting();
        for i in 0..4 {
            reg.add(agent(&format!("a{i}"), "host=h")).unwrap();
        }
        for strategy in [Strategy::Default, Strategy::DestHost] {
            let mut counts = std::collections::HashMap::new();
            for _ in 0..4000 {
                let b = reg.select(&[strategy], "h:1").unwrap();
                *counts.entry(b.agent_id.clone()).or_insert(0) += 1;
            }
            assert_eq!(counts.len(), 4);
            assert!(
                counts.values().all(|&n| (800..1200).contains(&n)),
                "{strategy:?}: {counts:?}"
            );
        }
    }

    #[test]
    fn an_agent_with_many_streams_gets_one_agents_share() {
        let reg = trusting();
        for _ in 0..99 {
            reg.add(agent("greedy", "host=h")).unwrap();
        }
        reg.add(agent("fair", "host=h")).unwrap();
        for strategy in [Strategy::Default, Strategy::DestHost] {
            let fair = (0..4000)
                .filter(|_| reg.select(&[strategy], "h:1").unwrap().agent_id == "fair")
                .count();
            assert!((1800..2200).contains(&fair), "{strategy:?}: {fair} of 4000");
        }
        // Streams that claim other IDs under one verified identity are one agent.
        let reg = Registry::default();
        let under = |id: &str| {
            verified_agent(
                id,
                "",
                Verified {
                    by: "serviceaccount-token",
                    hosts: vec![],
                    ips: vec![],
                    node: Some("node-a".into()),
                    principal: Some("node-a".into()),
                },
            )
        };
        for i in 0..50 {
            reg.add(under(&format!("fake-{i}"))).unwrap();
        }
        reg.add(agent("node-b", "")).unwrap();
        let b = (0..4000)
            .filter(|_| reg.select(&[Strategy::Default], "x:1").unwrap().agent_id == "node-b")
            .count();
        assert!((1800..2200).contains(&b), "{b} of 4000");
    }

    #[test]
    fn streams_are_capped_per_verified_identity_else_per_agent_id() {
        let reg = Registry::new(false, 3);
        for _ in 0..3 {
            reg.add(agent("a", "")).unwrap();
        }
        let refused = reg.add(agent("a", "")).unwrap_err();
        assert_eq!((refused.what, refused.count), ("agent ID", 3));
        let node_a = |id: &str| {
            verified_agent(
                id,
                "",
                Verified {
                    by: "certificate",
                    principal: Some("node-a".into()),
                    ..Verified::default()
                },
            )
        };
        for i in 0..3 {
            reg.add(node_a(&format!("x{i}"))).unwrap();
        }
        let refused = reg.add(node_a("x9")).unwrap_err();
        assert_eq!(
            (refused.what, refused.key.as_str()),
            ("verified identity", "node/node-a")
        );
        // An agent that proved nothing and claims the node's name as its ID is not in
        // that node's group: it cannot use up the node's share.
        reg.add(agent("node-a", "")).unwrap();
        // Removing a stream makes room again; the registry's tables stay consistent.
        let one = reg
            .snapshot()
            .into_iter()
            .find(|b| b.agent_id == "x1")
            .unwrap();
        assert!(reg.remove(&one));
        assert!(!reg.remove(&one));
        reg.add(node_a("x9")).unwrap();
        assert_eq!(reg.len(), 7);
        for b in reg.snapshot() {
            assert!(reg.remove(&b));
        }
        assert!(reg.is_empty());
    }
}

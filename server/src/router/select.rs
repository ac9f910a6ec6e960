//! Which agent stream takes a dial: `--proxy-strategies`, each agent's eligibility
//! under them, and the registry of connected agent streams they choose from.

use std::sync::{Arc, RwLock};

use rand::seq::IndexedRandom;
use tether_core::identifiers::dial_host;

use super::state::AgentStream;
use crate::pod_networks::PodNetworks;

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
    /// Is this agent the one on `node`? Where the server verified the agent, only its
    /// verified names count; otherwise (no agent authentication) its ID and `host=`
    /// identifiers, the trust `destHost` gives them.
    pub fn runs_on(&self, node: &str) -> bool {
        if !self.verified.by.is_empty() {
            return self.verified.hosts.iter().any(|h| h == node);
        }
        self.agent_id == node || self.identifiers.hosts.iter().any(|h| h == node)
    }

    /// Could `strategy` ever pick this agent? (`ready_backends{proxy_strategy}`;
    /// `pod_networks`: pod IPs are routed by node.)
    pub(crate) fn counts_for(&self, strategy: Strategy, pod_networks: bool) -> bool {
        let ids = &self.identifiers;
        match strategy {
            Strategy::Default => true,
            Strategy::DestHost => !ids.hosts.is_empty() || !ids.ips.is_empty(),
            Strategy::DefaultRoute => ids.default_route,
            Strategy::DestCidr => !ids.cidrs.is_empty() || pod_networks,
        }
    }

    /// `pod_node`: the node whose pod network holds the dial host, if known.
    fn eligible(&self, strategy: Strategy, host: &str, pod_node: Option<&str>) -> bool {
        match strategy {
            Strategy::Default => true,
            Strategy::DestHost => self.identifiers.matches_host(host),
            Strategy::DefaultRoute => self.identifiers.default_route,
            Strategy::DestCidr => {
                self.identifiers.matches_cidr(host) || pod_node.is_some_and(|n| self.runs_on(n))
            }
        }
    }
}

/// Every connected agent stream.
#[derive(Default)]
pub struct Registry {
    agents: RwLock<Vec<Arc<AgentStream>>>,
    /// The nodes' pod networks, for `destCIDR` (empty unless the server watches Nodes).
    pod_networks: Arc<PodNetworks>,
}

impl Registry {
    /// The nodes' pod networks `destCIDR` consults.
    pub fn pod_networks(&self) -> &Arc<PodNetworks> {
        &self.pod_networks
    }

    pub(crate) fn add(&self, agent: Arc<AgentStream>) -> usize {
        let mut list = self.agents.write().unwrap_or_else(|e| e.into_inner());
        list.push(agent);
        list.len()
    }

    /// Removes `agent`; false when it was not registered.
    pub(crate) fn remove(&self, agent: &AgentStream) -> bool {
        let mut list = self.agents.write().unwrap_or_else(|e| e.into_inner());
        let before = list.len();
        list.retain(|b| b.key != agent.key);
        before != list.len()
    }

    /// Number of connected agent streams.
    pub fn len(&self) -> usize {
        self.agents.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Every connected agent stream, in connection order.
    pub fn snapshot(&self) -> Vec<Arc<AgentStream>> {
        self.agents
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The connected agents as JSON for the admin endpoint's `/agents`: one entry per
    /// agent ID with its identifiers, which of them the server verified
    /// (`verifiedHosts`, `verifiedIps`, `verifiedBy`; from its first stream), whether it
    /// drains, and its stream count.
    pub fn agents_json(&self) -> String {
        let mut by_id: std::collections::BTreeMap<String, serde_json::Value> = Default::default();
        for b in self.snapshot() {
            let entry = by_id.entry(b.agent_id.clone()).or_insert_with(|| {
                serde_json::json!({
                    "id": b.agent_id,
                    "hosts": b.identifiers.hosts,
                    "ips": b.identifiers.ips.iter().map(|ip| ip.to_string()).collect::<Vec<_>>(),
                    "verifiedHosts": b.verified.hosts,
                    "verifiedIps": b.verified.ips.iter().map(|ip| ip.to_string()).collect::<Vec<_>>(),
                    "verifiedBy": b.verified.by,
                    "draining": true,
                    "streams": 0,
                })
            });
            entry["streams"] = (entry["streams"].as_u64().unwrap_or(0) + 1).into();
            if !b.is_draining() {
                entry["draining"] = false.into();
            }
        }
        serde_json::json!({ "agents": by_id.into_values().collect::<Vec<_>>() }).to_string()
    }

    /// True when no agent is connected.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Picks an agent for `address`: the first strategy with a candidate wins; among its
    /// candidates one is chosen at random, preferring agents that are not draining.
    pub fn select(&self, strategies: &[Strategy], address: &str) -> Option<Arc<AgentStream>> {
        let host = dial_host(address);
        let pod_node = if strategies.contains(&Strategy::DestCidr) && !self.pod_networks.is_empty()
        {
            self.pod_networks.node_of(host)
        } else {
            None
        };
        let list = self.agents.read().unwrap_or_else(|e| e.into_inner());
        let mut rng = rand::rng();
        for &strategy in strategies {
            if strategy == Strategy::Default {
                // Any agent: a few random probes find one that is not draining without
                // looking at thousands.
                for _ in 0..4 {
                    match list.choose(&mut rng) {
                        Some(b) if !b.is_draining() => return Some(Arc::clone(b)),
                        Some(_) => {}
                        None => return None,
                    }
                }
            }
            // One pass, no allocation: a uniform pick among the eligible agents that
            // are not draining, and among all eligible ones for when every one is.
            let (mut active, mut any) = (Pick::default(), Pick::default());
            for b in list
                .iter()
                .filter(|b| b.eligible(strategy, host, pod_node.as_deref()))
            {
                any.offer(b, &mut rng);
                if !b.is_draining() {
                    active.offer(b, &mut rng);
                }
            }
            if let Some(b) = active.chosen.or(any.chosen) {
                return Some(Arc::clone(b));
            }
        }
        None
    }
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

    fn agent(id: &str, ids: &str) -> Arc<AgentStream> {
        let (tx, _rx) = mpsc::channel(1);
        let (ctl, _ctl_rx) = tether_core::queue::queue();
        Arc::new(AgentStream::new(
            id.into(),
            AgentIdentifiers::parse(ids, true).unwrap(),
            Verified::default(),
            tx,
            ctl,
            None,
        ))
    }

    #[test]
    fn strategies_in_order() {
        let reg = Registry::default();
        reg.add(agent("a", "host=node-a&ipv4=10.0.0.1"));
        reg.add(agent("b", "ipv4=10.0.0.2&cidr=192.168.5.0/24"));
        reg.add(agent("c", "default-route=true"));
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
    fn a_pod_ip_goes_to_the_agent_on_its_node() {
        let reg = Registry::default();
        let node = |name: &str, cidr: &str| -> k8s_openapi::api::core::v1::Node {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name}, "spec": {"podCIDRs": [cidr]}
            }))
            .unwrap()
        };
        reg.pod_networks()
            .set(&[node("n1", "10.244.1.0/24"), node("n2", "10.244.2.0/24")]);
        reg.add(agent("n1", ""));
        reg.add(agent("x", "host=n2"));
        // Verified as n2 by its token: its own claims no longer count.
        let (tx, _rx) = mpsc::channel(1);
        let (ctl, _ctl_rx) = tether_core::queue::queue();
        let claims_n1 = Arc::new(AgentStream::new(
            "n1".into(),
            AgentIdentifiers::default(),
            Verified {
                by: "serviceaccount-token",
                hosts: vec!["n3".into()],
                ips: vec![],
            },
            tx,
            ctl,
            None,
        ));
        reg.add(claims_n1);
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
    fn draining_agents_are_last_choice() {
        let reg = Registry::default();
        let a = agent("a", "");
        let b = agent("b", "");
        reg.add(a.clone());
        reg.add(b.clone());
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
            reg.add(a);
        }
        reg.add(agent("live", ""));
        for _ in 0..50 {
            let picked = reg.select(&[Strategy::Default], "x:1").unwrap();
            assert_eq!(picked.agent_id, "live");
        }
        let reg = Registry::default();
        for i in 0..4 {
            reg.add(agent(&format!("a{i}"), "host=h"));
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
}

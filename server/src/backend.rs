//! Agent streams ("backends") as the server sees them, the registry of connected ones,
//! and backend selection by `--proxy-strategies`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use rand::seq::IndexedRandom;
use tether_core::identifiers::{dial_host, AgentIdentifiers};
use tether_proto::Packet;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::pod_networks::PodNetworks;
use crate::tunnel::{Conn, Frontend};

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

/// A dial sent to an agent and not yet answered.
pub(crate) struct PendingDial {
    pub frontend: Arc<Frontend>,
    pub started: Instant,
    /// The request, to send it to another agent if this one goes away unanswered.
    pub request: tether_proto::DialRequest,
    /// How often it was already re-dispatched.
    pub attempts: u8,
}

#[derive(Default)]
pub(crate) struct BackendState {
    /// By DialRequest.random.
    pub pending: HashMap<i64, PendingDial>,
    /// By connectID.
    pub conns: HashMap<i64, Arc<Conn>>,
}

/// One agent stream.
pub struct Backend {
    /// Unique per stream in this process (an agent may hold several).
    pub(crate) key: u64,
    /// The agent's `agentid`.
    pub agent_id: String,
    /// What the agent said it can reach.
    pub identifiers: AgentIdentifiers,
    /// Which of its names and addresses the server checked.
    pub verified: Verified,
    /// Packets to the agent.
    pub(crate) tx: mpsc::Sender<Packet>,
    /// WINDOW_UPDATEs to the agent: never blocked behind DATA, merged into its stream.
    pub(crate) ctl: mpsc::UnboundedSender<Packet>,
    /// The agent's per-connection receive window when it does credit flow control
    /// (negotiated with `tether-flow-window`); `None` for an upstream agent.
    pub(crate) peer_window: Option<u32>,
    pub(crate) draining: AtomicBool,
    pub(crate) state: Mutex<BackendState>,
    /// Cancelled when the stream is gone.
    pub(crate) closed: CancellationToken,
}

/// The agent ID, `host=` and IP identifiers the server verified, and how.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verified {
    /// `certificate` (`--require-agent-identity-match`) or `serviceaccount-token` (a
    /// token bound to a Pod on that node); empty when nothing was verified.
    pub by: &'static str,
    /// Verified names (the agent ID and hosts).
    pub hosts: Vec<String>,
    /// Verified addresses.
    pub ips: Vec<std::net::IpAddr>,
}

static NEXT_BACKEND: AtomicU64 = AtomicU64::new(1);

impl Backend {
    pub(crate) fn new(
        agent_id: String,
        identifiers: AgentIdentifiers,
        verified: Verified,
        tx: mpsc::Sender<Packet>,
        ctl: mpsc::UnboundedSender<Packet>,
        peer_window: Option<u32>,
    ) -> Self {
        Backend {
            key: NEXT_BACKEND.fetch_add(1, Ordering::Relaxed),
            agent_id,
            identifiers,
            verified,
            tx,
            ctl,
            peer_window,
            draining: AtomicBool::new(false),
            state: Mutex::new(BackendState::default()),
            closed: CancellationToken::new(),
        }
    }

    /// Has the agent sent DRAIN?
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub(crate) fn state(&self) -> std::sync::MutexGuard<'_, BackendState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

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
    backends: RwLock<Vec<Arc<Backend>>>,
    /// The nodes' pod networks, for `destCIDR` (empty unless the server watches Nodes).
    pod_networks: Arc<PodNetworks>,
}

impl Registry {
    /// The nodes' pod networks `destCIDR` consults.
    pub fn pod_networks(&self) -> &Arc<PodNetworks> {
        &self.pod_networks
    }

    pub(crate) fn add(&self, backend: Arc<Backend>) -> usize {
        let mut list = self.backends.write().unwrap_or_else(|e| e.into_inner());
        list.push(backend);
        list.len()
    }

    /// Removes `backend`; false when it was not registered.
    pub(crate) fn remove(&self, backend: &Backend) -> bool {
        let mut list = self.backends.write().unwrap_or_else(|e| e.into_inner());
        let before = list.len();
        list.retain(|b| b.key != backend.key);
        before != list.len()
    }

    /// Number of connected agent streams.
    pub fn len(&self) -> usize {
        self.backends
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Every connected agent stream, in connection order.
    pub fn snapshot(&self) -> Vec<Arc<Backend>> {
        self.backends
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
    pub fn select(&self, strategies: &[Strategy], address: &str) -> Option<Arc<Backend>> {
        let host = dial_host(address);
        let pod_node = if strategies.contains(&Strategy::DestCidr) && !self.pod_networks.is_empty()
        {
            self.pod_networks.node_of(host)
        } else {
            None
        };
        let list = self.backends.read().unwrap_or_else(|e| e.into_inner());
        for &strategy in strategies {
            let candidates: Vec<&Arc<Backend>> = list
                .iter()
                .filter(|b| b.eligible(strategy, host, pod_node.as_deref()))
                .collect();
            if candidates.is_empty() {
                continue;
            }
            let active: Vec<&Arc<Backend>> = candidates
                .iter()
                .copied()
                .filter(|b| !b.is_draining())
                .collect();
            let pool = if active.is_empty() {
                &candidates
            } else {
                &active
            };
            return pool.choose(&mut rand::rng()).map(|b| Arc::clone(b));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(id: &str, ids: &str) -> Arc<Backend> {
        let (tx, _rx) = mpsc::channel(1);
        let (ctl, _ctl_rx) = mpsc::unbounded_channel();
        Arc::new(Backend::new(
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
        reg.add(backend("a", "host=node-a&ipv4=10.0.0.1"));
        reg.add(backend("b", "ipv4=10.0.0.2&cidr=192.168.5.0/24"));
        reg.add(backend("c", "default-route=true"));
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
        reg.add(backend("n1", ""));
        reg.add(backend("x", "host=n2"));
        // Verified as n2 by its token: its own claims no longer count.
        let (tx, _rx) = mpsc::channel(1);
        let (ctl, _ctl_rx) = mpsc::unbounded_channel();
        let claims_n1 = Arc::new(Backend::new(
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
        let a = backend("a", "");
        let b = backend("b", "");
        reg.add(a.clone());
        reg.add(b.clone());
        a.draining.store(true, Ordering::Relaxed);
        for _ in 0..50 {
            assert_eq!(
                reg.select(&[Strategy::Default], "x:1").unwrap().agent_id,
                "b"
            );
        }
        b.draining.store(true, Ordering::Relaxed);
        assert!(reg.select(&[Strategy::Default], "x:1").is_some());
    }
}

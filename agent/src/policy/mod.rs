//! The agent's dial policy: which targets a server may have this agent open. By
//! default (`--dial-policy=node`) only what the control plane needs from a node: its
//! kubelet on the node's own addresses, pods in the node's pod ranges, the cluster's
//! Service range, and what `--dial-allow` adds; `any` dials whatever a server asks, as
//! upstream's agent does. Names are resolved here and judged by the addresses they
//! resolve to, so a name cannot take a dial where its address could not go.

mod node;
pub mod rules;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use tether_core::host::DialHost;
use tether_core::identifiers::Cidr;
use tokio::net::TcpStream;

pub use node::NodeWatch;
pub use rules::{Allow, RuleError, Target};

/// How long a dial about to be refused waits for the Node to be read again.
const REFRESH_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The kubelet's port when the Node object does not say (`--port`'s default).
pub const KUBELET_PORT: u16 = 10250;

/// The start of every refusal's text (with its colon): the server's audit recognises it.
pub use tether_core::host::POLICY_REFUSAL as REFUSED_PREFIX;

/// `--dial-policy` and what it needs, validated.
#[derive(Debug, Clone, Default)]
pub struct PolicyConfig {
    /// `--dial-policy=any`: no checks.
    pub any: bool,
    /// `--node-name`: whose Node object gives the node's addresses, kubelet port and
    /// pod ranges.
    pub node_name: Option<String>,
    /// `--node-ip`: the node's addresses known without the API (the downward API's
    /// `status.hostIP`).
    pub node_ips: Vec<IpAddr>,
    /// `--service-cidr`: the cluster's Service ranges.
    pub service_cidrs: Vec<Cidr>,
    /// `--dial-allow`.
    pub allow: Vec<Allow>,
    /// `--service-node-port-range`: the NodePorts, allowed on the node's addresses (the
    /// CCM's load balancers dial them); `None` allows none.
    pub node_ports: Option<std::ops::RangeInclusive<u16>>,
    /// Kubeconfig for reading the Node (`None` = in-cluster).
    pub kubeconfig: Option<PathBuf>,
}

/// What the Node object says about this node; empty until read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// status.addresses that are addresses (InternalIP, ExternalIP).
    pub addrs: Vec<IpAddr>,
    /// status.daemonEndpoints.kubeletEndpoint.Port.
    pub kubelet_port: Option<u16>,
    /// spec.podCIDRs (else spec.podCIDR).
    pub pod_cidrs: Vec<Cidr>,
}

/// The policy every session of the agent asks.
pub struct DialPolicy {
    config: PolicyConfig,
    facts: RwLock<Arc<NodeFacts>>,
    /// Reads the Node again when a dial would be refused (its addresses or pod ranges
    /// may have changed since the last read); set once the watch runs.
    node: std::sync::OnceLock<NodeWatch>,
    /// Refusals are logged at most 5 a second (a server decides how many there are).
    pub(crate) refusal_log: tether_core::ratelimit::LogLimit,
}

/// Why a dial did not connect.
#[derive(Debug, thiserror::Error)]
pub enum DialFailure {
    /// The policy refused it; the text says what and how to allow it.
    #[error("{0}")]
    Refused(Refusal),
    /// The resolver or the connect failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl DialPolicy {
    /// A policy from validated settings.
    pub fn new(config: PolicyConfig) -> Arc<Self> {
        Arc::new(DialPolicy {
            config,
            facts: RwLock::new(Arc::default()),
            node: std::sync::OnceLock::new(),
            refusal_log: tether_core::ratelimit::LogLimit::new(5.0, 20),
        })
    }

    /// The settings.
    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    /// What the Node last said.
    pub fn facts(&self) -> Arc<NodeFacts> {
        self.facts.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn set_facts(&self, facts: NodeFacts) {
        *self.facts.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(facts);
    }

    pub(crate) fn set_watch(&self, watch: NodeWatch) {
        let _ = self.node.set(watch);
    }

    /// One line for the start-up log: what is allowed.
    pub fn describe(&self) -> String {
        let c = &self.config;
        if c.any {
            return "any target".into();
        }
        let mut parts = vec![match &c.node_name {
            Some(n) => format!("node {n}'s kubelet and pod ranges (from its Node object)"),
            None => "no Node object (--node-name unset): no pod range".into(),
        }];
        if !c.node_ips.is_empty() {
            let ips: Vec<String> = c.node_ips.iter().map(IpAddr::to_string).collect();
            parts.push(format!("the kubelet on {}", ips.join(", ")));
        }
        if let Some(r) = &c.node_ports {
            parts.push(format!(
                "NodePorts {}-{} on the node's addresses",
                r.start(),
                r.end()
            ));
        }
        match c.service_cidrs.is_empty() {
            true => parts.push("no Service range (--service-cidr unset)".into()),
            false => {
                let s: Vec<String> = c.service_cidrs.iter().map(Cidr::to_string).collect();
                parts.push(format!("Services in {}", s.join(", ")));
            }
        }
        if !c.allow.is_empty() {
            let a: Vec<String> = c.allow.iter().map(Allow::to_string).collect();
            parts.push(format!("--dial-allow {}", a.join(",")));
        }
        parts.join("; ")
    }

    /// Opens a TCP connection to `address` (`host:port`) if the policy allows it, to
    /// exactly the addresses it judged (never resolving again): those a name resolves
    /// to that the policy allows, in turn. A name a `--dial-allow` name rule names is
    /// resolved as written (absolute: no search domain can stand in for it).
    pub async fn connect(&self, address: &str) -> Result<TcpStream, DialFailure> {
        if self.config.any {
            return Ok(TcpStream::connect(address).await?);
        }
        let (host, port) = DialHost::parse_address(address).map_err(|e| {
            let text = format!("{REFUSED_PREFIX} {e}");
            DialFailure::Refused(Refusal {
                answer: clip(&text),
                detail: clip(&text),
            })
        })?;
        // A name rule covers the name as DNS has it (absolute); a name that does not
        // resolve so (a search domain, /etc/hosts) is judged by its addresses instead.
        let absolute = match &host {
            DialHost::Name(n) if self.name_rule(n, port) => {
                tokio::net::lookup_host((format!("{n}."), port)).await.ok()
            }
            _ => None,
        };
        let named = absolute.is_some();
        let resolved: Vec<SocketAddr> = match (&host, absolute) {
            (_, Some(found)) => found.collect(),
            (DialHost::Ip(ip), None) => vec![SocketAddr::new(*ip, port)],
            (DialHost::Name(name), None) => tokio::net::lookup_host((name.as_str(), port))
                .await?
                .collect(),
        };
        let mut allowed = self.allowed(&resolved, named);
        if allowed.is_empty() {
            // The Node may have new addresses or pod ranges: read it once more, within
            // a bound that leaves the dial time to be refused as such.
            if let Some(node) = self.node.get() {
                if matches!(
                    tokio::time::timeout(REFRESH_WAIT, node.refresh()).await,
                    Ok(true)
                ) {
                    allowed = self.allowed(&resolved, named);
                }
            }
        }
        if allowed.is_empty() {
            return Err(DialFailure::Refused(self.refusal(&host, port, &resolved)));
        }
        let mut last = None;
        for addr in allowed {
            match TcpStream::connect(addr).await {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.expect("one address was tried").into())
    }

    /// Does a `--dial-allow` name rule allow `name` at `port`?
    fn name_rule(&self, name: &str, port: u16) -> bool {
        self.config.allow.iter().any(|rule| {
            rule.covers_port(port)
                && matches!(&rule.target, Target::Name(p) if rules::name_matches(p, name))
        })
    }

    /// The resolved addresses the policy allows; `named`: a name rule allowed the name,
    /// so every address it resolves to but the special ones.
    pub fn allowed(&self, resolved: &[SocketAddr], named: bool) -> Vec<SocketAddr> {
        let facts = self.facts();
        resolved
            .iter()
            .filter(|a| {
                let ip = rules::canonical(a.ip());
                match rules::special(ip) {
                    // Loopback, unspecified, link-local, multicast: only a rule that
                    // names that range itself (`127.0.0.0/8`) reaches them.
                    Some(range) => self.net_rule(ip, a.port(), |n| range.covers(n)),
                    None => named || self.allows(&facts, ip, a.port()),
                }
            })
            .copied()
            .collect()
    }

    /// Does a `--dial-allow` network rule that passes `fits` allow `ip:port`?
    fn net_rule(&self, ip: IpAddr, port: u16, fits: impl Fn(&Cidr) -> bool) -> bool {
        self.config.allow.iter().any(|rule| {
            rule.covers_port(port)
                && match &rule.target {
                    Target::Net(n) => n.contains(ip) && fits(n),
                    _ => false,
                }
        })
    }

    fn allows(&self, facts: &NodeFacts, ip: IpAddr, port: u16) -> bool {
        let c = &self.config;
        let own = c.node_ips.contains(&ip) || facts.addrs.contains(&ip);
        let kubelet = facts.kubelet_port.unwrap_or(KUBELET_PORT);
        let node_port = c.node_ports.as_ref().is_some_and(|r| r.contains(&port));
        if own && (port == kubelet || node_port) {
            return true;
        }
        if facts.pod_cidrs.iter().any(|n| n.contains(ip))
            || c.service_cidrs.iter().any(|n| n.contains(ip))
        {
            return true;
        }
        let node_rule = c
            .allow
            .iter()
            .any(|rule| own && rule.target == Target::Node && rule.covers_port(port));
        node_rule || self.net_rule(ip, port, |_| true)
    }

    /// The refusal: what was asked and how to allow it (to the server), and what a
    /// name resolved to (for the agent's log only: the server learns no address of the
    /// node's network from a refusal).
    fn refusal(&self, host: &DialHost, port: u16, resolved: &[SocketAddr]) -> Refusal {
        let unread = match &self.config.node_name {
            Some(n) if *self.facts() == NodeFacts::default() => format!(
                " (node {n}'s Node object could not be read yet: the agent needs get on nodes)"
            ),
            _ => String::new(),
        };
        let (what, detail) = match host {
            DialHost::Ip(ip) => {
                let a = SocketAddr::new(*ip, port).to_string();
                (a.clone(), a)
            }
            DialHost::Name(n) => {
                let ips: Vec<String> = resolved.iter().map(|a| a.ip().to_string()).collect();
                (
                    format!("{n}:{port} (as it resolves on the node)"),
                    format!("{n}:{port} (resolved to {})", ips.join(", ")),
                )
            }
        };
        let text = |what: &str| {
            clip(&format!(
                "{REFUSED_PREFIX} {what} is not this node's kubelet, a pod on this node or a \
                 Service{unread}; allow it with the agent's --dial-allow"
            ))
        };
        Refusal {
            answer: text(&what),
            detail: text(&detail),
        }
    }
}

/// A refusal's text, at most 1 KiB (a server chose what it echoes).
fn clip(text: &str) -> String {
    tether_core::ratelimit::clipped(text, 1024).to_string()
}

/// What a refused dial tells the server, and what the agent logs.
#[derive(Debug)]
pub struct Refusal {
    /// The DIAL_RSP error.
    pub answer: String,
    /// The log line (with what a name resolved to).
    pub detail: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.answer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str]) -> Arc<DialPolicy> {
        let p = DialPolicy::new(PolicyConfig {
            node_name: Some("n1".into()),
            node_ips: vec!["192.168.1.10".parse().unwrap()],
            service_cidrs: vec!["10.96.0.0/12".parse().unwrap()],
            allow: allow.iter().map(|a| Allow::parse(a).unwrap()).collect(),
            node_ports: Some(30000..=32767),
            ..Default::default()
        });
        p.set_facts(NodeFacts {
            addrs: vec!["192.168.1.10".parse().unwrap(), "fd00::10".parse().unwrap()],
            kubelet_port: Some(10250),
            pod_cidrs: vec!["10.244.1.0/24".parse().unwrap()],
        });
        p
    }

    /// As `connect` judges it, a name resolving to 203.0.113.9.
    fn allowed(p: &DialPolicy, address: &str) -> bool {
        let (host, port) = DialHost::parse_address(address).unwrap();
        let named = matches!(&host, DialHost::Name(n) if p.name_rule(n, port));
        let ip = host.ip().unwrap_or("203.0.113.9".parse().unwrap());
        !p.allowed(&[SocketAddr::new(ip, port)], named).is_empty()
    }

    #[test]
    fn the_default_allows_what_the_control_plane_needs_and_nothing_else() {
        let p = policy(&[]);
        for yes in [
            "192.168.1.10:10250",
            "[fd00::10]:10250",
            "[::ffff:192.168.1.10]:10250",
            "10.244.1.7:8080",
            "10.96.0.10:53",
            "10.100.3.4:443",
            "192.168.1.10:30080", // a NodePort, for the CCM's load balancers
        ] {
            assert!(allowed(&p, yes), "{yes} should be allowed");
        }
        for no in [
            "192.168.1.10:22",    // the node, not its kubelet
            "192.168.1.11:30080", // another node's NodePort
            "192.168.1.11:10250", // another node's kubelet
            "10.244.2.7:8080",    // a pod on another node
            "192.168.1.1:80",     // the LAN's router
            "127.0.0.1:10250",    // the agent's own loopback
            "10.112.0.1:443",     // past the Service range
        ] {
            assert!(!allowed(&p, no), "{no} should be refused");
        }
    }

    #[test]
    fn allow_rules_widen_it_by_network_port_node_and_name() {
        let p = policy(&["192.168.1.0/24:9100", "node:4443", "*.printers.lan:631"]);
        assert!(allowed(&p, "192.168.1.50:9100"));
        assert!(!allowed(&p, "192.168.1.50:9101"));
        assert!(allowed(&p, "192.168.1.10:4443"));
        assert!(allowed(&p, "[fd00::10]:4443"));
        assert!(!allowed(&p, "192.168.1.11:4443"));
        assert!(allowed(&p, "hp.printers.lan:631"));
        assert!(!allowed(&p, "hp.printers.lan:22"));
    }

    #[test]
    fn a_name_is_judged_by_what_it_resolves_to() {
        let p = policy(&[]);
        let service: SocketAddr = "10.96.5.5:443".parse().unwrap();
        let lan: SocketAddr = "192.168.1.1:443".parse().unwrap();
        assert_eq!(p.allowed(&[lan, service], false), vec![service]);
        assert!(p.allowed(&[lan], false).is_empty());
    }

    #[test]
    fn special_addresses_need_a_rule_that_names_their_range() {
        // A name rule, or a rule as wide as the whole space, never reaches loopback,
        // unspecified, link-local (the metadata server) or multicast addresses.
        let p = policy(&["0.0.0.0/0:80", "[::/0]:80", "*.lan:80"]);
        for no in [
            "127.0.0.1:80",
            "0.0.0.0:80",
            "169.254.169.254:80",
            "[::1]:80",
            "[::]:80",
            "[fe80::1]:80",
            "224.0.0.1:80",
            "[::ffff:127.0.0.1]:80",
        ] {
            assert!(!allowed(&p, no), "{no} should be refused");
        }
        assert!(allowed(&p, "192.168.7.7:80"));
        let special: SocketAddr = "169.254.169.254:80".parse().unwrap();
        assert!(p.allowed(&[special], true).is_empty(), "a name rule");
        // A rule inside the special range reaches it.
        let p = policy(&["127.0.0.0/8", "169.254.169.254:80"]);
        assert!(allowed(&p, "127.0.0.1:80") && allowed(&p, "169.254.169.254:80"));
        assert!(!allowed(&p, "169.254.169.253:80"));
    }

    #[tokio::test]
    async fn a_refusal_says_what_was_asked_and_how_to_allow_it() {
        let p = policy(&[]);
        let e = p.connect("192.168.1.1:22").await.unwrap_err().to_string();
        assert!(e.starts_with(REFUSED_PREFIX), "{e}");
        assert!(
            e.contains("192.168.1.1:22") && e.contains("--dial-allow"),
            "{e}"
        );
        let e = p.connect("10.0.0.1").await.unwrap_err().to_string();
        assert!(
            e.starts_with(REFUSED_PREFIX) && e.contains("host:port"),
            "{e}"
        );
    }
}

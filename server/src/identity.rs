//! What an agent proved, set against what it claims. An agent claims an ID and
//! identifiers (`host=`, `ipv4=`, `ipv6=`, `cidr=`, `default-route=`); the server routes
//! by the ones it verified: names and IP SANs of the agent's client certificate, or the
//! node a pod-bound ServiceAccount token runs on (whose Node object then vouches for
//! addresses and pod networks, looked up when a dial is routed). What it could not
//! verify is reported, so that the operator sees a node claiming what it is not.

use std::net::IpAddr;

use tether_certs::inspect::CertInfo;
use tether_core::identifiers::{AgentIdentifiers, Cidr};

use crate::nodes::NodeInventory;
use crate::router::Verified;

/// Subject O of the certificates `tether certs agent` writes: one node each.
pub const AGENT_GROUP: &str = tether_certs::AGENT_ORGANIZATION;
/// Subject O of kubelet client certificates (CN `system:node:<name>`): one node each.
const NODES_GROUP: &str = "system:nodes";

/// The claims the server could not verify.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Unverified {
    /// The agent ID itself.
    pub agent_id: bool,
    /// `host=` values.
    pub hosts: Vec<String>,
    /// `ipv4=`/`ipv6=` values.
    pub ips: Vec<IpAddr>,
    /// `cidr=` values.
    pub cidrs: Vec<Cidr>,
    /// `default-route=true`.
    pub default_route: bool,
}

impl Unverified {
    /// Nothing unverified?
    pub fn is_empty(&self) -> bool {
        !self.agent_id
            && self.hosts.is_empty()
            && self.ips.is_empty()
            && self.cidrs.is_empty()
            && !self.default_route
    }

    /// Every claim of `ids` (and the ID): what an unauthenticated agent says.
    fn all(ids: &AgentIdentifiers) -> Self {
        Unverified {
            agent_id: true,
            hosts: ids.hosts.clone(),
            ips: ids.ips.clone(),
            cidrs: ids.cidrs.clone(),
            default_route: ids.default_route,
        }
    }

    /// `(kind, count)` for the `unverified_identifiers_total{kind}` counter.
    pub fn counts(&self) -> [(&'static str, usize); 5] {
        [
            ("agent_id", usize::from(self.agent_id)),
            ("host", self.hosts.len()),
            ("ip", self.ips.len()),
            ("cidr", self.cidrs.len()),
            ("default_route", usize::from(self.default_route)),
        ]
    }
}

impl std::fmt::Display for Unverified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if self.agent_id {
            parts.push("agentid".into());
        }
        parts.extend(self.hosts.iter().map(|h| format!("host={h}")));
        parts.extend(self.ips.iter().map(|ip| format!("ip={ip}")));
        parts.extend(self.cidrs.iter().map(|c| format!("cidr={c}")));
        if self.default_route {
            parts.push("default-route=true".into());
        }
        f.write_str(&parts.join(" "))
    }
}

/// The agent ID and `host=` names, each once (case-insensitively).
fn claimed_names<'a>(agent_id: &'a str, ids: &'a AgentIdentifiers) -> Vec<&'a str> {
    let mut names: Vec<&str> = Vec::new();
    for n in std::iter::once(agent_id).chain(ids.hosts.iter().map(String::as_str)) {
        if !names.iter().any(|m| m.eq_ignore_ascii_case(n)) {
            names.push(n);
        }
    }
    names
}

/// The node a certificate stands for, when it stands for one: a `tether certs agent`
/// certificate (O=system:konnectivity-agents, CN=node) or a kubelet client certificate
/// (O=system:nodes, CN=system:node:NAME). A certificate shared by a fleet names none.
pub fn certificate_node(cert: &CertInfo) -> Option<String> {
    let cn = cert.common_name.as_deref()?;
    if cert.organizations.iter().any(|o| o == AGENT_GROUP) && !cn.is_empty() {
        return Some(cn.to_ascii_lowercase());
    }
    if cert.organizations.iter().any(|o| o == NODES_GROUP) {
        return cn
            .strip_prefix("system:node:")
            .filter(|n| !n.is_empty())
            .map(str::to_ascii_lowercase);
    }
    None
}

/// What a per-node certificate pins to its node whether or not the agent claims it: the
/// node, its names (the node's, the CN and DNS SANs that are host names), its IP SANs
/// and its validity. `None` for a certificate that names no node.
pub fn pinned_by_certificate(cert: &CertInfo) -> Option<(String, crate::nodes::Vouched)> {
    let node = certificate_node(cert)?;
    let mut names = vec![node.clone()];
    for n in cert.common_name.iter().chain(cert.dns_sans.iter()) {
        if let Ok(tether_core::host::DialHost::Name(n)) = tether_core::host::DialHost::parse(n) {
            if !names.contains(&n) {
                names.push(n);
            }
        }
    }
    let vouched = crate::nodes::Vouched {
        names,
        ips: cert.ip_sans.clone(),
        not_before: cert.not_before,
        not_after: cert.not_after,
    };
    Some((node, vouched))
}

/// What a client certificate proves: the claimed names that are its CN, a DNS SAN or
/// (kubelet certificates) its node, and the claimed addresses that are IP SANs. A
/// per-node certificate also lets that node's Node object vouch for addresses and pod
/// networks, as a token's node does (when the server watches Nodes). `default-route`
/// cannot be bound to a certificate.
pub fn from_certificate(
    cert: &CertInfo,
    agent_id: &str,
    ids: &AgentIdentifiers,
    nodes: &NodeInventory,
) -> (Verified, Unverified) {
    let node = certificate_node(cert);
    let names: Vec<&str> = cert
        .common_name
        .iter()
        .chain(cert.dns_sans.iter())
        .chain(node.iter())
        .map(String::as_str)
        .collect();
    let in_cert = |n: &str| names.iter().any(|c| c.eq_ignore_ascii_case(n));
    let mut verified = Verified {
        by: "certificate",
        principal: node.clone(),
        node: node.clone(),
        ..Verified::default()
    };
    let by_node = |c: &Cidr| node.as_deref().is_some_and(|n| nodes.has_network(n, c));
    let mut unverified = Unverified {
        agent_id: !in_cert(agent_id),
        cidrs: ids.cidrs.iter().filter(|c| !by_node(c)).copied().collect(),
        default_route: ids.default_route,
        ..Unverified::default()
    };
    for n in claimed_names(agent_id, ids) {
        if in_cert(n) {
            verified.hosts.push(n.to_string());
        }
    }
    unverified.hosts = ids.hosts.iter().filter(|h| !in_cert(h)).cloned().collect();
    for ip in &ids.ips {
        if cert.ip_sans.contains(ip) {
            verified.ips.push(*ip);
        } else if !node.as_deref().is_some_and(|n| nodes.has_address(n, *ip)) {
            unverified.ips.push(*ip);
        }
    }
    (verified, unverified)
}

/// What a token proves: with `node` (the Pod it is bound to runs there) the claimed
/// names equal to the node's, and, through the node's Node object, its addresses and
/// pod networks (checked here for the report; routing looks again at each dial).
pub fn from_token(
    node: Option<&str>,
    agent_id: &str,
    ids: &AgentIdentifiers,
    nodes: &NodeInventory,
) -> (Verified, Unverified) {
    let Some(node) = node else {
        return (Verified::default(), Unverified::all(ids));
    };
    let verified = Verified {
        by: "serviceaccount-token",
        hosts: claimed_names(agent_id, ids)
            .into_iter()
            .filter(|n| n.eq_ignore_ascii_case(node))
            .map(str::to_string)
            .collect(),
        ips: Vec::new(),
        node: Some(node.to_string()),
        principal: Some(node.to_ascii_lowercase()),
    };
    let known = nodes.is_synced();
    let unverified = Unverified {
        agent_id: !agent_id.eq_ignore_ascii_case(node),
        hosts: ids
            .hosts
            .iter()
            .filter(|h| !h.eq_ignore_ascii_case(node))
            .cloned()
            .collect(),
        ips: ids
            .ips
            .iter()
            .filter(|ip| known && !nodes.has_address(node, **ip))
            .copied()
            .collect(),
        cidrs: ids
            .cidrs
            .iter()
            .filter(|c| known && !nodes.has_network(node, c))
            .copied()
            .collect(),
        default_route: ids.default_route,
    };
    (verified, unverified)
}

/// An agent no one authenticated (`--unsafe-allow-unauthenticated-agents`): nothing.
pub fn unauthenticated(ids: &AgentIdentifiers) -> (Verified, Unverified) {
    (Verified::default(), Unverified::all(ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert(cn: &str, orgs: &[&str], dns: &[&str], ips: &[&str]) -> CertInfo {
        CertInfo {
            subject: format!("CN={cn}"),
            common_name: Some(cn.into()),
            organizations: orgs.iter().map(|s| s.to_string()).collect(),
            issuer: String::new(),
            dns_sans: dns.iter().map(|s| s.to_string()).collect(),
            ip_sans: ips.iter().map(|s| s.parse().unwrap()).collect(),
            key_usage: vec![],
            ext_key_usage: vec![],
            not_before: 0,
            not_after: 0,
            is_ca: false,
            public_key_der: vec![],
            der: vec![],
        }
    }

    fn ids(q: &str) -> AgentIdentifiers {
        AgentIdentifiers::parse(q, true).unwrap()
    }

    #[test]
    fn a_certificate_vouches_for_its_own_names_and_addresses_only() {
        let none = NodeInventory::default();
        let node_a = cert("node-a", &[AGENT_GROUP], &["node-a"], &["10.0.0.1"]);
        let (v, u) = from_certificate(
            &node_a,
            "node-a",
            &ids("host=node-a&host=node-b&ipv4=10.0.0.1&ipv4=10.0.0.2&cidr=10.9.0.0/16"),
            &none,
        );
        assert_eq!(v.by, "certificate");
        assert_eq!(v.hosts, vec!["node-a".to_string()]);
        assert_eq!(v.ips, vec!["10.0.0.1".parse::<IpAddr>().unwrap()]);
        assert_eq!(v.principal.as_deref(), Some("node-a"));
        assert!(!u.agent_id);
        assert_eq!(u.to_string(), "host=node-b ip=10.0.0.2 cidr=10.9.0.0/16");
        // nodeA's certificate claiming to be nodeB: nothing of nodeB is verified, and
        // its streams still count as nodeA's.
        let (v, u) = from_certificate(&node_a, "node-b", &ids("host=node-b&ipv4=10.0.0.2"), &none);
        assert!(v.hosts.is_empty() && v.ips.is_empty());
        assert_eq!(v.principal.as_deref(), Some("node-a"));
        assert!(u.agent_id && !u.is_empty());
        // A kubelet client certificate names its node by CN.
        let kubelet = cert("system:node:Edge-1", &["system:nodes"], &[], &[]);
        let (v, _) = from_certificate(&kubelet, "edge-1", &ids("host=edge-1"), &none);
        assert_eq!(v.hosts, vec!["edge-1".to_string()]);
        assert_eq!(v.principal.as_deref(), Some("edge-1"));
        // A fleet's shared certificate names no node: no principal.
        let shared = cert("konnectivity-agent", &[], &[], &[]);
        let (v, u) = from_certificate(&shared, "edge-1", &ids("host=edge-1"), &none);
        assert!(v.principal.is_none() && v.hosts.is_empty());
        assert_eq!(u.to_string(), "agentid host=edge-1");
    }

    #[test]
    fn a_token_vouches_for_its_node_and_what_the_node_object_lists() {
        let nodes = NodeInventory::default();
        nodes.set(&[serde_json::from_value(serde_json::json!({
            "metadata": {"name": "edge-1"},
            "spec": {"podCIDRs": ["10.244.1.0/24"]},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.1"}]},
        }))
        .unwrap()]);
        let claims = ids("host=edge-1&host=edge-2&ipv4=192.0.2.1&ipv4=192.0.2.2&cidr=10.244.1.0/24&cidr=10.244.2.0/24&default-route=true");
        let (v, u) = from_token(Some("edge-1"), "edge-1", &claims, &nodes);
        assert_eq!(v.hosts, vec!["edge-1".to_string()]);
        assert_eq!(v.node.as_deref(), Some("edge-1"));
        assert_eq!(
            u.to_string(),
            "host=edge-2 ip=192.0.2.2 cidr=10.244.2.0/24 default-route=true"
        );
        let (v, u) = from_token(None, "edge-1", &claims, &nodes);
        assert_eq!(v, Verified::default());
        assert!(u.agent_id);
    }
}

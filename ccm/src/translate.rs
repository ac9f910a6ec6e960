//! What the Kubernetes objects the controllers read mean to the provider: a Node's
//! taints and conditions and whether it may serve as a backend, and a Service's
//! [`ServiceInfo`] from its spec, its annotations and its ready endpoints, with what in
//! it cannot be served as written. The service controller and the load balancers'
//! serving side read Services through here.

use k8s_openapi::api::core::v1::{Node, Service, ServiceSpec, Taint};
use kube::runtime::reflector::Store;
use kube::ResourceExt;

use crate::cloud::{annotations, Backend, ProxyProtocol, ServiceInfo, ServicePort};
use crate::endpoints::{EndpointsCache, Ready};

/// Does `node` carry the taint `key`?
pub fn has_taint(node: &Node, key: &str) -> bool {
    taints(node).iter().any(|t| t.key == key)
}

/// `node`'s taints.
pub fn taints(node: &Node) -> &[Taint] {
    node.spec
        .as_ref()
        .and_then(|s| s.taints.as_deref())
        .unwrap_or_default()
}

/// The provider's view of `node`.
pub fn node_info(node: &Node) -> crate::cloud::NodeInfo {
    crate::cloud::NodeInfo {
        name: kube::ResourceExt::name_any(node),
        provider_id: node
            .spec
            .as_ref()
            .and_then(|s| s.provider_id.clone())
            .filter(|p| !p.is_empty()),
        labels: node.metadata.labels.clone().unwrap_or_default(),
    }
}

/// The status of `node`'s Ready condition ("True", "False", "Unknown"), if reported.
pub fn ready_status(node: &Node) -> Option<&str> {
    condition_status(node, "Ready")
}

/// The status of `node`'s condition `kind`, if reported.
pub fn condition_status<'a>(node: &'a Node, kind: &str) -> Option<&'a str> {
    condition(node, kind).map(|c| c.status.as_str())
}

/// `node`'s condition `kind`, if reported.
pub fn condition<'a>(
    node: &'a Node,
    kind: &str,
) -> Option<&'a k8s_openapi::api::core::v1::NodeCondition> {
    node.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == kind)
}

/// The reason of the event about ports of a protocol other than TCP.
pub const UNSUPPORTED_PROTOCOL: &str = "UnsupportedProtocol";

/// Nodes with this label are never backends.
pub const EXCLUDE_LABEL: &str = "node.kubernetes.io/exclude-from-external-load-balancers";

/// Nodes the cluster autoscaler is removing are never backends.
pub const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Is `svc` a LoadBalancer Service of ours: without a `loadBalancerClass`, or with
/// `class` (`--load-balancer-class`)?
pub fn is_ours(svc: &Service, class: Option<&str>) -> bool {
    let Some(spec) = &svc.spec else { return false };
    if spec.type_.as_deref() != Some("LoadBalancer") {
        return false;
    }
    match &spec.load_balancer_class {
        None => true,
        Some(c) => class == Some(c.as_str()),
    }
}

/// Nodes eligible as backends: Ready, not excluded, not being deleted, with an
/// InternalIP; sorted by name.
pub fn backends(nodes: &Store<Node>) -> Vec<Backend> {
    let mut out: Vec<Backend> = nodes.state().iter().filter_map(|n| eligible(n)).collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// The backends of `svc`: every eligible node with an InternalIP of the Service's
/// family (dialled at that address), or with `externalTrafficPolicy: Local` only those
/// with a ready endpoint of the Service (a node without one would drop the traffic).
pub fn backends_for(
    nodes: &Store<Node>,
    endpoints: &EndpointsCache,
    svc: &Service,
) -> Vec<Backend> {
    let family = family_of(svc);
    let all: Vec<Backend> = backends(nodes)
        .into_iter()
        .filter_map(|b| for_family(b, family))
        .collect();
    let local = svc
        .spec
        .as_ref()
        .and_then(|s| s.external_traffic_policy.as_deref())
        == Some("Local");
    if !local {
        return all;
    }
    let ready = endpoints.ready(&svc.namespace().unwrap_or_default(), &svc.name_any());
    all.into_iter()
        .filter(|b| ready.nodes.contains(&b.name))
        .collect()
}

/// `info` with no endpoints: what a refusal is about.
pub(crate) fn without_endpoints(info: &ServiceInfo) -> ServiceInfo {
    let mut info = info.clone();
    for port in &mut info.ports {
        port.endpoints.clear();
    }
    info
}

/// The provider's view of `svc`, with the ready endpoints of each port.
pub fn service_info(svc: &Service, endpoints: &EndpointsCache) -> ServiceInfo {
    info_of(
        svc,
        &endpoints.ready(&svc.namespace().unwrap_or_default(), &svc.name_any()),
    )
}

pub(crate) fn info_of(svc: &Service, ready: &Ready) -> ServiceInfo {
    let spec = svc.spec.clone().unwrap_or_default();
    let (source_ranges, invalid_source_ranges) = source_ranges_of(svc, &spec);
    let (max_connections, idle_timeout, proxy_protocol, _) = limits(svc);
    ServiceInfo {
        namespace: svc.namespace().unwrap_or_default(),
        name: svc.name_any(),
        uid: svc.uid().unwrap_or_default(),
        ports: ports_of(&spec, ready),
        source_ranges,
        invalid_source_ranges,
        max_connections,
        idle_timeout,
        families: families_of(&spec),
        require_dual_stack: spec.ip_family_policy.as_deref() == Some("RequireDualStack"),
        requested_ips: requested_ips_of(svc, &spec),
        current_ips: current_ips_of(svc),
        sharing_key: svc
            .annotations()
            .get(annotations::SHARING_KEY)
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty()),
        sharing_namespaces: list_annotation(svc, annotations::SHARING_CROSS_NAMESPACE),
        proxy_protocol,
        node_ports: spec.allocate_load_balancer_node_ports != Some(false),
    }
}

/// The Service's ports, each with its ready endpoints.
fn ports_of(spec: &ServiceSpec, ready: &Ready) -> Vec<ServicePort> {
    spec.ports
        .iter()
        .flatten()
        .map(|p| {
            let name = p.name.clone().unwrap_or_default();
            ServicePort {
                protocol: p.protocol.clone().unwrap_or_else(|| "TCP".into()),
                port: u16::try_from(p.port).unwrap_or(0),
                node_port: p.node_port.and_then(|n| u16::try_from(n).ok()).unwrap_or(0),
                endpoints: ready.ports.get(&name).cloned().unwrap_or_default(),
                name,
            }
        })
        .collect()
}

/// `loadBalancerSourceRanges`, else the annotation: the CIDRs, and what is not one.
fn source_ranges_of(
    svc: &Service,
    spec: &ServiceSpec,
) -> (Vec<tether_core::identifiers::Cidr>, Vec<String>) {
    let spec_ranges: Vec<String> = spec.load_balancer_source_ranges.clone().unwrap_or_default();
    let ranges: Vec<String> = if spec_ranges.is_empty() {
        list_annotation(svc, annotations::SOURCE_RANGES)
    } else {
        spec_ranges
    };
    let mut valid = Vec::new();
    let mut invalid = Vec::new();
    for r in ranges {
        match r.parse::<tether_core::identifiers::Cidr>() {
            Ok(c) => valid.push(c),
            Err(_) => invalid.push(r),
        }
    }
    (valid, invalid)
}

/// `ipFamilies`, or before dual-stack (1.20 without the gate) the cluster IP's family.
fn families_of(spec: &ServiceSpec) -> Vec<String> {
    match &spec.ip_families {
        Some(f) if !f.is_empty() => f.clone(),
        _ => match spec
            .cluster_ip
            .as_deref()
            .map(str::parse::<std::net::IpAddr>)
        {
            Some(Ok(std::net::IpAddr::V6(_))) => vec!["IPv6".into()],
            _ => vec!["IPv4".into()],
        },
    }
}

/// The addresses asked for: the annotation's list, else `loadBalancerIP`.
fn requested_ips_of(svc: &Service, spec: &ServiceSpec) -> Vec<String> {
    match list_annotation(svc, annotations::LOAD_BALANCER_IPS) {
        list if !list.is_empty() => list,
        _ => spec
            .load_balancer_ip
            .clone()
            .filter(|ip| !ip.is_empty())
            .into_iter()
            .collect(),
    }
}

/// The addresses (or host names) the Service's status shows.
fn current_ips_of(svc: &Service) -> Vec<String> {
    svc.status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|l| l.ingress.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|i| i.ip.clone().or_else(|| i.hostname.clone()))
        .collect()
}

/// A comma-separated annotation's entries.
fn list_annotation(svc: &Service, name: &str) -> Vec<String> {
    svc.annotations()
        .get(name)
        .map(|v| {
            v.split(',')
                .map(|r| r.trim().to_string())
                .filter(|r| !r.is_empty())
                .collect()
        })
        .unwrap_or_default()
}

/// The Service's limits and PROXY protocol version from its annotations, the defaults
/// where absent or invalid, and what was invalid.
fn limits(
    svc: &Service,
) -> (
    usize,
    std::time::Duration,
    Option<ProxyProtocol>,
    Vec<String>,
) {
    let a = svc.annotations();
    let mut problems = Vec::new();
    let max = match a.get(annotations::MAX_CONNECTIONS) {
        None => crate::cloud::DEFAULT_MAX_CONNECTIONS,
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => {
                problems.push(format!(
                    "{}={v:?} is not a positive number",
                    annotations::MAX_CONNECTIONS
                ));
                crate::cloud::DEFAULT_MAX_CONNECTIONS
            }
        },
    };
    let idle = match a.get(annotations::IDLE_TIMEOUT) {
        None => crate::cloud::DEFAULT_IDLE_TIMEOUT,
        Some(v) => match tether_ops::duration::parse(v.trim()) {
            Ok(d) if !d.is_zero() => d,
            _ => {
                problems.push(format!(
                    "{}={v:?} is not a positive duration like 10m",
                    annotations::IDLE_TIMEOUT
                ));
                crate::cloud::DEFAULT_IDLE_TIMEOUT
            }
        },
    };
    let proxy = match a
        .get(annotations::PROXY_PROTOCOL)
        .map(|v| v.trim().to_ascii_lowercase())
    {
        None => None,
        Some(v) if v == "v1" => Some(ProxyProtocol::V1),
        Some(v) if v == "v2" => Some(ProxyProtocol::V2),
        Some(v) => {
            problems.push(format!(
                "{}={v:?} is not v1 or v2 (no PROXY header is sent)",
                annotations::PROXY_PROTOCOL
            ));
            None
        }
    };
    (max, idle, proxy, problems)
}

/// The Warning events `svc`'s balancer owes (reason, message): what in the Service
/// cannot be served as written.
pub(crate) fn service_warnings(svc: &Service, info: &ServiceInfo) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let (_, _, _, bad_limits) = limits(svc);
    if !bad_limits.is_empty() {
        out.push((
            "InvalidAnnotation",
            format!("{}; the defaults apply", bad_limits.join("; ")),
        ));
    }
    if !info.invalid_source_ranges.is_empty() {
        out.push((
            "InvalidSourceRanges",
            format!(
                "source range(s) {} are not CIDRs and admit nobody; fix loadBalancerSourceRanges",
                info.invalid_source_ranges.join(", ")
            ),
        ));
    }
    let unsupported: Vec<String> = info
        .ports
        .iter()
        .filter(|p| p.protocol != "TCP")
        .map(|p| format!("{}/{}", p.port, p.protocol))
        .collect();
    // With no TCP port at all the provider refuses the Service (no address, no
    // ingress) and its refusal is the one event.
    if !unsupported.is_empty() && unsupported.len() < info.ports.len() {
        out.push((
            UNSUPPORTED_PROTOCOL,
            format!(
                "port(s) {} not served: the tether load balancer forwards TCP only (Konnectivity dials TCP); the TCP ports are served",
                unsupported.join(", ")
            ),
        ));
    }
    out
}

/// `node` as a backend, if eligible.
pub fn eligible(node: &Node) -> Option<Backend> {
    if node.metadata.deletion_timestamp.is_some()
        || node.labels().contains_key(EXCLUDE_LABEL)
        || taints(node).iter().any(|t| t.key == TO_BE_DELETED_TAINT)
        || ready_status(node) != Some("True")
    {
        return None;
    }
    let addresses: Vec<String> = node
        .status
        .as_ref()?
        .addresses
        .as_ref()?
        .iter()
        .filter(|a| a.type_ == "InternalIP")
        .map(|a| a.address.clone())
        .collect();
    Some(Backend {
        name: node.name_any(),
        address: addresses.first()?.clone(),
        addresses,
    })
}

/// `svc`'s address family: its first `spec.ipFamilies` entry, else its ClusterIP's;
/// `Some(true)` for IPv4, `Some(false)` for IPv6, `None` when it says neither.
fn family_of(svc: &Service) -> Option<bool> {
    let spec = svc.spec.as_ref()?;
    match spec
        .ip_families
        .as_ref()
        .and_then(|f| f.first())
        .map(String::as_str)
    {
        Some("IPv4") => Some(true),
        Some("IPv6") => Some(false),
        _ => spec
            .cluster_ip
            .as_deref()
            .and_then(|ip| ip.parse::<std::net::IpAddr>().ok())
            .map(|ip| ip.is_ipv4()),
    }
}

/// `backend` for a Service of `family`: dialled at its InternalIP of that family; a
/// node without one is no backend of it.
fn for_family(mut backend: Backend, family: Option<bool>) -> Option<Backend> {
    let Some(v4) = family else {
        return Some(backend);
    };
    backend.address = backend
        .addresses
        .iter()
        .find(|a| {
            a.parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_ipv4() == v4)
        })?
        .clone();
    Some(backend)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeAddress, NodeCondition, NodeSpec, NodeStatus};
    use serde_json::json;

    #[test]
    fn what_cannot_be_served_as_written_is_said_and_the_defaults_apply() {
        let mut svc: Service = serde_json::from_value(json!({
            "metadata": {"name": "s", "namespace": "d", "annotations": {
                annotations::MAX_CONNECTIONS: "0", annotations::IDLE_TIMEOUT: "90s"}},
            "spec": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/8", "nope"],
                     "ports": [{"port": 53, "protocol": "UDP"}, {"port": 80, "nodePort": 30080}]}
        }))
        .unwrap();
        let info = info_of(&svc, &Ready::default());
        assert_eq!(
            (info.max_connections, info.idle_timeout),
            (
                crate::cloud::DEFAULT_MAX_CONNECTIONS,
                std::time::Duration::from_secs(90)
            )
        );
        let reasons: Vec<&str> = service_warnings(&svc, &info).iter().map(|w| w.0).collect();
        assert_eq!(
            reasons,
            [
                "InvalidAnnotation",
                "InvalidSourceRanges",
                UNSUPPORTED_PROTOCOL
            ]
        );
        svc.metadata.annotations = None;
        svc.spec.as_mut().unwrap().load_balancer_source_ranges = None;
        svc.spec.as_mut().unwrap().ports.as_mut().unwrap().remove(0);
        let info = info_of(&svc, &Ready::default());
        assert!(service_warnings(&svc, &info).is_empty());
        assert_eq!(info.idle_timeout, crate::cloud::DEFAULT_IDLE_TIMEOUT);
    }

    fn node(name: &str, ready: bool) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some(name.into());
        n.status = Some(NodeStatus {
            addresses: Some(vec![NodeAddress {
                type_: "InternalIP".into(),
                address: "10.0.0.1".into(),
            }]),
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        n
    }

    #[test]
    fn backends_exclude_unready_labelled_and_autoscaler_doomed_nodes() {
        assert!(eligible(&node("a", true)).is_some());
        assert!(eligible(&node("a", false)).is_none());
        let mut excluded = node("a", true);
        excluded.metadata.labels = Some(
            [(EXCLUDE_LABEL.to_string(), String::new())]
                .into_iter()
                .collect(),
        );
        assert!(eligible(&excluded).is_none());
        let mut doomed = node("a", true);
        doomed.spec = Some(NodeSpec {
            taints: Some(vec![Taint {
                key: TO_BE_DELETED_TAINT.into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            }]),
            ..Default::default()
        });
        assert!(eligible(&doomed).is_none());
    }
}

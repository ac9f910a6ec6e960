//! Driving `tether ccm` as a process against a test [`Cluster`]: starting it with
//! short leader-election timings, writing its inventory, registering nodes as a kubelet
//! would, reading nodes, Services and events back, the tunnel its load balancer dials
//! through, and its HTTPS endpoints (`/healthz`, `/metrics` as an authorized scraper).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::kube::{free_port, wait_blocking, Cluster};
use crate::netns::Node;
use crate::process::{socket_path, uds_frontend_args, Proc, START_TIMEOUT};
use crate::{AgentProc, Pki, ServerProc, TempDir};

// === Starting the CCM ===

/// Leader-election timings short enough for a test (upstream: 15s/10s/2s).
pub const LEASE: Duration = Duration::from_secs(4);

/// Starts `bin ccm` (see [`start_ccm_in`]) on the host with no extra flags.
pub fn start_ccm(bin: &Path, cluster: &Cluster, inventory: &Path, name: &str) -> Proc {
    start_ccm_with(bin, cluster, inventory, name, &[])
}

/// Starts `bin ccm` (see [`start_ccm_in`]) on the host with `extra` flags.
pub fn start_ccm_with(
    bin: &Path,
    cluster: &Cluster,
    inventory: &Path,
    name: &str,
    extra: &[String],
) -> Proc {
    start_ccm_in(bin, None, cluster, inventory, name, extra)
}

/// Starts `bin ccm` as process `name`, inside `netns` when given (the namespace must
/// reach the apiserver: see [`Node::reach_host_port`]): the inventory at `inventory`,
/// the CCM's own ServiceAccount ([`Cluster::ccm_kubeconfig`]), [`LEASE`] and a
/// 500 ms node-monitor period, a free `--secure-port` unless `extra` names one, then
/// `extra`. Returns once it logs that it is starting.
pub fn start_ccm_in(
    bin: &Path,
    netns: Option<&Node>,
    cluster: &Cluster,
    inventory: &Path,
    name: &str,
    extra: &[String],
) -> Proc {
    let mut args: Vec<String> = vec![
        "ccm".into(),
        "--log-format=json".into(),
        format!("--cloud-config={}", inventory.display()),
        format!("--kubeconfig={}", cluster.ccm_kubeconfig().display()),
        format!("--leader-elect-lease-duration={}s", LEASE.as_secs()),
        "--leader-elect-renew-deadline=3s".into(),
        "--leader-elect-retry-period=500ms".into(),
        "--node-monitor-period=500ms".into(),
    ];
    if !extra.iter().any(|a| a.starts_with("--secure-port=")) {
        args.push(format!("--secure-port={}", free_port()));
    }
    args.extend(extra.iter().cloned());
    let proc = match netns {
        Some(node) => node.spawn(name, bin.to_str().expect("a UTF-8 binary path"), &args),
        None => Proc::spawn(name, bin, &args),
    };
    proc.wait_event("cloud-controller-manager starting", START_TIMEOUT, |_| true);
    proc
}

// === The inventory ===

/// A temporary directory and the path of `inventory.yaml` in it (not yet written).
pub fn inventory_dir() -> (TempDir, PathBuf) {
    let dir = TempDir::new("tether-ccm");
    let path = dir.path().join("inventory.yaml");
    (dir, path)
}

/// Replaces the inventory at `path` with `yaml`.
pub fn write_inventory(path: &Path, yaml: &str) {
    // Write aside and rename: the controller never reads half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, yaml).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Writes an inventory of `(name, InternalIP, shutdown)` machines.
pub fn write_machines(path: &Path, machines: &[(&str, &str, bool)]) {
    let entries: String = machines
        .iter()
        .map(|(name, ip, shutdown)| machine(name, ip, *shutdown))
        .collect();
    write_inventory(path, &format!("nodes:\n{entries}"));
}

/// One machine of an inventory's `nodes:` list: region eu-west, zone eu-west-1a,
/// instance type bare-metal, InternalIP `ip` (IPv4) and ExternalIP 203.0.113.X, X the
/// last byte of `ip`.
pub fn machine(name: &str, ip: &str, shutdown: bool) -> String {
    format!(
        "- name: {name}\n  region: eu-west\n  zone: eu-west-1a\n  instanceType: bare-metal\n  shutdown: {shutdown}\n  addresses:\n  - {{type: ExternalIP, address: 203.0.113.{}}}\n  - {{type: InternalIP, address: {ip}}}\n",
        &ip[ip.rfind('.').unwrap() + 1..]
    )
}

// === Nodes and events ===

/// Registers a node the way a kubelet with `--cloud-provider=external` does: tainted
/// uninitialized, with its chosen IP in the provided-node-ip annotation.
pub fn add_uninitialized_node(cluster: &Cluster, name: &str, ip: &str) {
    cluster.apply(&format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  annotations:\n    alpha.kubernetes.io/provided-node-ip: \"{ip}\"\nspec:\n  taints:\n  - key: node.cloudprovider.kubernetes.io/uninitialized\n    value: \"true\"\n    effect: NoSchedule\n"
    ));
}

/// A node with `pod_cidr` and InternalIP `ip` (what node-ipam and the kubelet set).
pub fn add_node_with_pod_cidr(cluster: &Cluster, name: &str, ip: &str, pod_cidr: &str) {
    cluster.apply(&format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\nspec:\n  podCIDR: {pod_cidr}\n  podCIDRs: [{pod_cidr}]\n"
    ));
    cluster.patch_node_status(
        name,
        &format!(r#"{{"addresses":[{{"type":"InternalIP","address":"{ip}"}}]}}"#),
    );
}

/// Node `name` as JSON, or None if it does not exist.
pub fn node_json(cluster: &Cluster, name: &str) -> Option<Value> {
    let out = cluster.kubectl(&["get", "node", name, "-o", "json"]);
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).unwrap())
}

/// Waits (30 s at most) until node `name` exists and satisfies `pred`; returns it.
pub fn wait_node(
    cluster: &Cluster,
    name: &str,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    wait_blocking(
        &format!("node {name}: {what}"),
        Duration::from_secs(30),
        || node_json(cluster, name).filter(|n| pred(n)),
    )
}

/// `kubectl args` (which must ask for `-o json`) parsed, or None if kubectl fails or
/// prints no JSON.
pub fn get_json(cluster: &Cluster, args: &[&str]) -> Option<Value> {
    let out = cluster.kubectl(args);
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).ok())
        .flatten()
}

/// Waits for an event with `reason` about object `name` in `default`.
pub fn wait_for_event(cluster: &Cluster, name: &str, reason: &str) {
    wait_blocking(
        &format!("{reason} event about {name}"),
        Duration::from_secs(30),
        || cluster.has_event("default", name, reason).then_some(()),
    );
}

/// The count of the (aggregated) event with `reason` about `name` in `default`.
pub fn event_count(cluster: &Cluster, name: &str, reason: &str) -> u64 {
    let out = cluster.kubectl_ok(&[
        "get",
        "events",
        "-n",
        "default",
        &format!("--field-selector=involvedObject.name={name},reason={reason}"),
        "-o",
        "json",
    ]);
    let v: Value = serde_json::from_str(&out).unwrap();
    v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| e["count"].as_u64().unwrap_or(1))
        .sum()
}

// === LoadBalancer Services ===

/// Creates (or replaces) LoadBalancer Service `ns/name` with one TCP port named `p`
/// (`node_port` when given), `annotations`, and `spec` merged into its spec.
pub fn lb_service(
    cluster: &Cluster,
    ns: &str,
    name: &str,
    port: u16,
    node_port: Option<u16>,
    annotations: Value,
    spec: Value,
) {
    let mut port_spec = serde_json::json!({"name": "p", "port": port});
    if let Some(np) = node_port {
        port_spec["nodePort"] = np.into();
    }
    let mut svc = serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "annotations": annotations},
        "spec": {"type": "LoadBalancer", "ports": [port_spec]},
    });
    for (k, v) in spec.as_object().into_iter().flatten() {
        svc["spec"][k] = v.clone();
    }
    cluster.apply(&svc.to_string());
}

/// The load balancers' allocation record as the CCM wrote it (its JSON; empty when
/// there is none).
pub fn allocation_record(cluster: &Cluster) -> String {
    cluster.kubectl_ok(&[
        "get",
        "configmap",
        "-n",
        "kube-system",
        "cloud-controller-manager-lb-allocations",
        "-o",
        "jsonpath={.data.allocations\\.json}",
    ])
}

/// The ingress IPs of Service `ns/name`.
pub fn ingress_ips(cluster: &Cluster, ns: &str, name: &str) -> Vec<String> {
    let out = cluster.kubectl(&["get", "service", "-n", ns, name, "-o", "json"]);
    if !out.status.success() {
        return Vec::new();
    }
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["status"]["loadBalancer"]["ingress"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["ip"].as_str().map(str::to_string))
        .collect()
}

/// Waits until Service `ns/name` has exactly one ingress IP; returns it.
pub fn wait_ingress(cluster: &Cluster, ns: &str, name: &str) -> String {
    wait_blocking(
        &format!("an ingress IP for {ns}/{name}"),
        Duration::from_secs(30),
        || match ingress_ips(cluster, ns, name).as_slice() {
            [ip] => Some(ip.clone()),
            _ => None,
        },
    )
}

// === The tunnel the load balancer dials through ===

/// A Tether server on the host (gRPC frontend on a socket) and an agent inside `node`.
pub struct Tunnel {
    /// The agent, inside the node's namespace.
    pub agent: AgentProc,
    /// The server, on the host.
    pub server: ServerProc,
    /// The server's gRPC frontend socket (the CCM's `--tunnel-uds`).
    pub socket: PathBuf,
    _pki: Pki,
}

impl Tunnel {
    /// [`Tunnel::start`] for node `name`, its agent claiming the node's address.
    pub fn to_node(bin: &Path, node: &Node, name: &str) -> Tunnel {
        Tunnel::start(bin, node, name, &format!("ipv4={}", node.node_ip))
    }

    /// Starts `bin server` on the host and `bin agent` in `node` as `agent_id` (with the
    /// node's own certificate, bound to its address) claiming `identifiers`.
    pub fn start(bin: &Path, node: &Node, agent_id: &str, identifiers: &str) -> Tunnel {
        let pki = Pki::with_sans(std::slice::from_ref(&node.host_ip));
        let socket = socket_path(pki.dir());
        let mut args = uds_frontend_args(&pki, "grpc", &socket);
        args.push("--agent-bind-address=0.0.0.0".into());
        let server = ServerProc::start(bin, &args);
        let agent = AgentProc::start_in(
            Some(node),
            bin,
            &pki,
            format!("{}:{}", node.host_ip, server.agent.port())
                .parse()
                .unwrap(),
            &[
                // The node's own certificate (named after the agent), bound to its
                // address, so that the server verifies what the agent claims.
                pki.node_cert_args(agent_id, &node.node_ip),
                vec![
                    format!("--agent-id={agent_id}"),
                    format!("--agent-identifiers={identifiers}"),
                ],
            ]
            .concat(),
        );
        Tunnel {
            agent,
            server,
            socket,
            _pki: pki,
        }
    }
}

// === The CCM's HTTPS endpoints ===

/// `curl -k` over HTTPS with an optional bearer token: (status, body).
pub fn https_get(url: &str, token: Option<&str>) -> (u16, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-sk", "--max-time", "5", "-w", "\n%{http_code}"]);
    if let Some(t) = token {
        cmd.args(["-H", &format!("Authorization: Bearer {t}")]);
    }
    let out = cmd.arg(url).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// `/metrics` of the CCM at `url` (`https://127.0.0.1:PORT`), read as an authorized
/// scraper; each of `names` must appear in it.
pub fn scrape(cluster: &Cluster, url: &str, names: &[&str]) -> String {
    let reader = metrics_reader_token(cluster);
    let (code, page) = https_get(&format!("{url}/metrics"), Some(&reader));
    assert_eq!(code, 200, "{page}");
    for name in names {
        assert!(page.contains(name), "{name} missing:\n{page}");
    }
    page
}

/// A token of a new ServiceAccount `kube-system/prometheus` allowed to get /metrics.
pub fn metrics_reader_token(cluster: &Cluster) -> String {
    cluster.apply(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: metrics-reader\nrules:\n- nonResourceURLs: [/metrics]\n  verbs: [get]\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: metrics-reader\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: metrics-reader\nsubjects:\n- kind: ServiceAccount\n  name: prometheus\n  namespace: kube-system\n",
    );
    sa_token(cluster, "prometheus")
}

/// A new ServiceAccount `kube-system/sa` and a token for it.
pub fn sa_token(cluster: &Cluster, sa: &str) -> String {
    cluster.kubectl_ok(&["create", "serviceaccount", sa, "-n", "kube-system"]);
    cluster.service_account_token(sa, None)
}

//! `tether ccm` against a real kube-apiserver + etcd, as real processes: nodes tainted
//! uninitialized are initialised from the inventory (provider ID, addresses, topology
//! labels, taint removed, event); a shut-down machine's node is tainted and untainted
//! again; a node gone from the inventory is deleted; with two replicas only the leader
//! acts and the other takes over when the leader is killed; pod-network routes are
//! programmed in a network namespace's routing table; a node whose agent is connected
//! exists without being in the inventory.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use std::process::Command;

use serde_json::Value;
use tether_testkit::kube::{free_port, wait_blocking, Cluster, Egress};
use tether_testkit::netns::Node;
use tether_testkit::process::{
    socket_path, token_auth_server_args, uds_frontend_args, Proc, START_TIMEOUT,
};
use tether_testkit::{AgentProc, Pki, ServerProc, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

/// Leader-election timings short enough for a test (upstream: 15s/10s/2s).
const LEASE: Duration = Duration::from_secs(4);

fn start_ccm(cluster: &Cluster, inventory: &Path, name: &str) -> Proc {
    start_ccm_with(cluster, inventory, name, &[])
}

fn start_ccm_with(cluster: &Cluster, inventory: &Path, name: &str, extra: &[String]) -> Proc {
    start_ccm_in(None, cluster, inventory, name, extra)
}

/// Starts the CCM, inside `netns` when given (the namespace must reach the apiserver:
/// see `Node::reach_host_port`).
fn start_ccm_in(
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
        Some(node) => node.spawn(name, BIN, &args),
        None => Proc::spawn(name, Path::new(BIN), &args),
    };
    proc.wait_event("cloud-controller-manager starting", START_TIMEOUT, |_| true);
    proc
}

fn write_inventory(path: &Path, yaml: &str) {
    // Write aside and rename: the controller never reads half a file.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, yaml).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Writes an inventory of `(name, InternalIP, shutdown)` machines.
fn write_machines(path: &Path, machines: &[(&str, &str, bool)]) {
    let entries: String = machines
        .iter()
        .map(|(name, ip, shutdown)| machine(name, ip, *shutdown))
        .collect();
    write_inventory(path, &format!("nodes:\n{entries}"));
}

fn machine(name: &str, ip: &str, shutdown: bool) -> String {
    format!(
        "- name: {name}\n  region: eu-west\n  zone: eu-west-1a\n  instanceType: bare-metal\n  shutdown: {shutdown}\n  addresses:\n  - {{type: ExternalIP, address: 203.0.113.{}}}\n  - {{type: InternalIP, address: {ip}}}\n",
        &ip[ip.rfind('.').unwrap() + 1..]
    )
}

/// Registers a node the way a kubelet with `--cloud-provider=external` does: tainted
/// uninitialized, with its chosen IP in the provided-node-ip annotation.
fn add_uninitialized_node(cluster: &Cluster, name: &str, ip: &str) {
    cluster.apply(&format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  annotations:\n    alpha.kubernetes.io/provided-node-ip: \"{ip}\"\nspec:\n  taints:\n  - key: node.cloudprovider.kubernetes.io/uninitialized\n    value: \"true\"\n    effect: NoSchedule\n"
    ));
}

/// Waits for an event with `reason` about object `name` in `default`.
fn wait_for_event(cluster: &Cluster, name: &str, reason: &str) {
    wait_blocking(
        &format!("{reason} event about {name}"),
        Duration::from_secs(30),
        || cluster.has_event("default", name, reason).then_some(()),
    );
}

fn node_json(cluster: &Cluster, name: &str) -> Option<Value> {
    let out = cluster.kubectl(&["get", "node", name, "-o", "json"]);
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).unwrap())
}

fn taint_keys(node: &Value) -> Vec<String> {
    node["spec"]["taints"]
        .as_array()
        .map(|t| {
            t.iter()
                .map(|t| t["key"].as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn wait_node(cluster: &Cluster, name: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    wait_blocking(
        &format!("node {name}: {what}"),
        Duration::from_secs(30),
        || node_json(cluster, name).filter(|n| pred(n)),
    )
}

fn inventory_dir() -> (TempDir, PathBuf) {
    let dir = TempDir::new("tether-ccm");
    let path = dir.path().join("inventory.yaml");
    (dir, path)
}

#[test]
fn nodes_are_initialized_tainted_on_shutdown_and_deleted_when_gone() {
    let cluster = Cluster::start(&Egress::Direct);
    let (_dir, inventory) = inventory_dir();
    write_machines(
        &inventory,
        &[("node-a", "10.0.0.1", false), ("node-b", "10.0.0.2", false)],
    );
    add_uninitialized_node(&cluster, "node-a", "10.0.0.1");
    add_uninitialized_node(&cluster, "node-b", "10.0.0.2");
    add_uninitialized_node(&cluster, "stranger", "10.0.0.9");
    // Ready, so the lifecycle controller leaves it alone (a NotReady node the provider
    // does not know is deleted, as upstream does).
    cluster.set_node_ready("stranger", true);
    let ccm = start_ccm(&cluster, &inventory, "ccm");

    // Initialised: provider ID, labels and their beta twins, addresses with the
    // provided node IP first, taint gone.
    let a = wait_node(&cluster, "node-a", "initialized", |n| {
        !taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into())
    });
    assert_eq!(a["spec"]["providerID"], "tether://node-a");
    let labels = &a["metadata"]["labels"];
    assert_eq!(labels["topology.kubernetes.io/zone"], "eu-west-1a");
    assert_eq!(
        labels["failure-domain.beta.kubernetes.io/zone"],
        "eu-west-1a"
    );
    assert_eq!(labels["topology.kubernetes.io/region"], "eu-west");
    assert_eq!(
        labels["failure-domain.beta.kubernetes.io/region"],
        "eu-west"
    );
    assert_eq!(labels["node.kubernetes.io/instance-type"], "bare-metal");
    assert_eq!(labels["beta.kubernetes.io/instance-type"], "bare-metal");
    let addresses = &a["status"]["addresses"];
    assert_eq!(addresses[0]["address"], "10.0.0.1", "{addresses}");
    assert_eq!(addresses[0]["type"], "InternalIP");
    assert_eq!(addresses[1]["address"], "203.0.113.1");
    wait_for_event(&cluster, "node-a", "Synced");

    // A node the provider does not know stays uninitialized, with a warning event.
    wait_for_event(&cluster, "stranger", "InstanceNotFound");
    let stranger = node_json(&cluster, "stranger").unwrap();
    assert!(
        taint_keys(&stranger).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into())
    );

    // Shut down: NotReady + machine off -> shutdown taint; Ready again -> removed.
    wait_node(&cluster, "node-b", "initialized", |n| {
        n["spec"]["providerID"] == "tether://node-b"
    });
    write_machines(
        &inventory,
        &[("node-a", "10.0.0.1", true), ("node-b", "10.0.0.2", false)],
    );
    cluster.set_node_ready("node-a", false);
    wait_node(&cluster, "node-a", "shutdown taint", |n| {
        taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/shutdown".into())
    });
    cluster.set_node_ready("node-a", true);
    wait_node(&cluster, "node-a", "shutdown taint removed", |n| {
        !taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/shutdown".into())
    });

    // Gone from the inventory and NotReady: the Node is deleted. A Ready node that is
    // gone is left alone (upstream checks only nodes that are not Ready).
    // (NotReady first: once it is gone from the inventory, a NotReady node may be
    // deleted at the next monitor period.)
    cluster.set_node_ready("node-b", false);
    write_machines(&inventory, &[("node-a", "10.0.0.1", false)]);
    wait_blocking("node-b deleted", Duration::from_secs(30), || {
        node_json(&cluster, "node-b").is_none().then_some(())
    });
    assert!(node_json(&cluster, "node-a").is_some());
    assert!(ccm.logged("node initialized"));
}

/// `curl -k` over HTTPS with an optional bearer token: (status, body).
fn https_get(url: &str, token: Option<&str>) -> (u16, String) {
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
fn scrape(cluster: &Cluster, url: &str, names: &[&str]) -> String {
    let reader = metrics_reader_token(cluster);
    let (code, page) = https_get(&format!("{url}/metrics"), Some(&reader));
    assert_eq!(code, 200, "{page}");
    for name in names {
        assert!(page.contains(name), "{name} missing:\n{page}");
    }
    page
}

/// A token of a new ServiceAccount `kube-system/prometheus` allowed to get /metrics.
fn metrics_reader_token(cluster: &Cluster) -> String {
    cluster.apply(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: metrics-reader\nrules:\n- nonResourceURLs: [/metrics]\n  verbs: [get]\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: metrics-reader\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: metrics-reader\nsubjects:\n- kind: ServiceAccount\n  name: prometheus\n  namespace: kube-system\n",
    );
    sa_token(cluster, "prometheus")
}

/// A new ServiceAccount `kube-system/sa` and a token for it.
fn sa_token(cluster: &Cluster, sa: &str) -> String {
    cluster.kubectl_ok(&["create", "serviceaccount", sa, "-n", "kube-system"]);
    cluster.service_account_token(sa, None)
}

#[test]
fn healthz_is_anonymous_and_metrics_need_an_authorized_token() {
    let cluster = Cluster::start(&Egress::Direct);
    let (_dir, inventory) = inventory_dir();
    write_inventory(&inventory, "nodes: []\n");
    let port = free_port();
    let ccm = start_ccm_with(
        &cluster,
        &inventory,
        "ccm",
        &[format!("--secure-port={port}")],
    );
    ccm.wait_event("controllers started", START_TIMEOUT, |_| true);
    let base = format!("https://127.0.0.1:{port}");
    let (code, body) = wait_blocking("healthz", Duration::from_secs(20), || {
        let r = https_get(&format!("{base}/healthz"), None);
        (r.0 == 200).then_some(r)
    });
    assert_eq!((code, body.as_str()), (200, "ok"));

    assert_eq!(https_get(&format!("{base}/metrics"), None).0, 401);
    let nobody = sa_token(&cluster, "nobody");
    assert_eq!(https_get(&format!("{base}/metrics"), Some(&nobody)).0, 403);
    scrape(
        &cluster,
        &base,
        &[
            "rest_client_requests_total{code=\"200\",host=",
            "workqueue_adds_total{name=\"node\"}",
            "leader_election_master_status{name=\"cloud-controller-manager\"} 1",
        ],
    );
}

#[test]
fn only_the_leader_acts_and_a_standby_takes_over_when_it_dies() {
    let cluster = Cluster::start(&Egress::Direct);
    let (_dir, inventory) = inventory_dir();
    write_machines(
        &inventory,
        &[("node-a", "10.0.0.1", false), ("node-b", "10.0.0.2", false)],
    );
    let mut first = start_ccm(&cluster, &inventory, "ccm-1");
    first.wait_event("became leader", START_TIMEOUT, |_| true);
    let second = start_ccm(&cluster, &inventory, "ccm-2");
    second.wait_event("waiting to become leader", START_TIMEOUT, |_| true);

    add_uninitialized_node(&cluster, "node-a", "10.0.0.1");
    wait_node(&cluster, "node-a", "initialized by the leader", |n| {
        n["spec"]["providerID"] == "tether://node-a"
    });
    assert!(first.logged("node initialized"));
    assert!(!second.logged("node initialized"));
    assert!(!second.logged("became leader"));

    // The leader dies without releasing its lease: the standby must take over within
    // the lease duration (plus a retry period and some scheduling slack).
    first.kill();
    let killed = Instant::now();
    second.wait_event("became leader", LEASE * 3, |_| true);
    let took = killed.elapsed();
    eprintln!("standby took over {took:?} after the leader was killed (lease {LEASE:?})");
    assert!(
        took <= LEASE + Duration::from_secs(2),
        "takeover took {took:?}"
    );
    add_uninitialized_node(&cluster, "node-b", "10.0.0.2");
    wait_node(&cluster, "node-b", "initialized by the new leader", |n| {
        n["spec"]["providerID"] == "tether://node-b"
    });

    // SIGTERM (a rolling update): the leader stops its controllers, then releases the
    // lease and waits for kube-apiserver to have it before it exits; the standby takes
    // over at its next retry, well inside the lease duration.
    let mut second = second;
    let identity = second.wait_event("cloud-controller-manager starting", START_TIMEOUT, |_| true)
        ["identity"]
        .as_str()
        .unwrap()
        .to_string();
    let third = start_ccm(&cluster, &inventory, "ccm-3");
    third.wait_event("waiting to become leader", START_TIMEOUT, |_| true);
    second.signal("TERM");
    let termed = Instant::now();
    second
        .wait_exit(Duration::from_secs(30))
        .expect("the leader stops on SIGTERM");
    let holder = cluster.kubectl_ok(&[
        "get",
        "lease",
        "-n",
        "kube-system",
        "cloud-controller-manager",
        "-o",
        "jsonpath={.spec.holderIdentity}",
    ]);
    assert!(
        holder != identity && second.logged("leader lease released"),
        "the lease still names the old leader after it exited: {holder:?}"
    );
    third.wait_event("became leader", LEASE * 3, |_| true);
    let took = termed.elapsed();
    eprintln!("standby took over {took:?} after SIGTERM of the leader (lease {LEASE:?})");
    assert!(took < LEASE, "graceful handover took {took:?}");
}

/// A Tether server on the host (gRPC frontend on a socket) and an agent inside `node`.
struct Tunnel {
    agent: AgentProc,
    server: ServerProc,
    socket: PathBuf,
    _pki: Pki,
}

impl Tunnel {
    fn start(node: &Node, agent_id: &str, identifiers: &str) -> Tunnel {
        let pki = Pki::with_sans(std::slice::from_ref(&node.host_ip));
        let socket = socket_path(pki.dir());
        let mut args = uds_frontend_args(&pki, "grpc", &socket);
        args.push("--agent-bind-address=0.0.0.0".into());
        let server = ServerProc::start(Path::new(BIN), &args);
        let agent = AgentProc::start_in(
            Some(node),
            Path::new(BIN),
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

/// curl `url`, optionally inside a network namespace; the body on success.
fn curl(netns: Option<&str>, url: &str) -> Option<String> {
    curl_within(netns, url, "5")
}

/// Like [`curl`], giving up after `max_time` seconds.
fn curl_within(netns: Option<&str>, url: &str, max_time: &str) -> Option<String> {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "curl"]);
            c
        }
        None => Command::new("curl"),
    };
    let out = cmd
        .args(["-sf", "--max-time", max_time, url])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn a_load_balancer_service_is_reachable_through_the_tunnel() {
    // A node on its own network: its address is reachable only through its agent.
    let node = Node::create();
    let tunnel = Tunnel::start(&node, "node-1", &format!("ipv4={}", node.node_ip));
    let socket = &tunnel.socket;
    // The "NodePort": an HTTP server on the node's private address.
    let _page = node.serve_page(30080, "hello from node-1\n");
    let node_url = format!("http://{}:30080/", node.node_ip);
    wait_blocking("node port serving", Duration::from_secs(20), || {
        curl(Some(&node.ns), &node_url)
    });
    assert!(
        curl(None, &node_url).is_none(),
        "the node must not be reachable directly"
    );

    let cluster = Cluster::start(&Egress::Direct);
    let (_dir, inventory) = inventory_dir();
    write_machines(&inventory, &[("node-1", &node.node_ip, false)]);
    cluster.add_node("node-1", &node.node_ip);
    cluster.set_node_ready("node-1", true);
    let port = free_port();
    cluster.apply(&format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\nspec:\n  type: LoadBalancer\n  ports:\n  - name: http\n    port: {port}\n    nodePort: 30080\n"
    ));
    let secure = free_port();
    let _ccm = start_ccm_with(
        &cluster,
        &inventory,
        "ccm",
        &[
            "--lb-bind-address=127.0.0.1".into(),
            format!("--tunnel-uds={}", socket.display()),
            format!("--secure-port={secure}"),
        ],
    );
    let svc = wait_blocking("ingress IP", Duration::from_secs(30), || {
        let out = cluster.kubectl_ok(&["get", "service", "web", "-o", "json"]);
        let v: Value = serde_json::from_str(&out).unwrap();
        (v["status"]["loadBalancer"]["ingress"][0]["ip"] == "127.0.0.1").then_some(v)
    });
    assert_eq!(
        svc["metadata"]["finalizers"][0],
        "service.kubernetes.io/load-balancer-cleanup"
    );
    let lb_url = format!("http://127.0.0.1:{port}/");
    for _ in 0..5 {
        let body = wait_blocking(
            "page through the load balancer",
            Duration::from_secs(20),
            || curl(None, &lb_url),
        );
        assert_eq!(body, "hello from node-1\n");
    }
    for reason in ["EnsuringLoadBalancer", "EnsuredLoadBalancer"] {
        assert!(
            cluster.has_event("default", "web", reason),
            "no {reason} event"
        );
    }

    // A long-lived connection on one port survives another port being added: only what
    // changed is rebound. (An echo server on the node, port 30081.)
    let _echo = node.spawn(
        "echo",
        "socat",
        &[
            format!("TCP-LISTEN:30081,bind={},fork,reuseaddr", node.node_ip),
            "EXEC:cat".into(),
        ],
    );
    let add_port = |name: &str, port: u16, node_port: u16| {
        cluster.kubectl_ok(&[
            "patch",
            "service",
            "web",
            "--type=json",
            "-p",
            &format!(r#"[{{"op":"add","path":"/spec/ports/-","value":{{"name":"{name}","port":{port},"nodePort":{node_port}}}}}]"#),
        ]);
    };
    let echo_port = free_port();
    add_port("echo", echo_port, 30081);
    let mut held = wait_blocking(
        "echo through the load balancer",
        Duration::from_secs(30),
        || {
            use std::io::{Read, Write};
            let mut c = std::net::TcpStream::connect(("127.0.0.1", echo_port)).ok()?;
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            c.write_all(b"a").ok()?;
            let mut b = [0u8; 1];
            c.read_exact(&mut b).ok()?;
            (&b == b"a").then_some(c)
        },
    );
    let third = free_port();
    add_port("third", third, 30082);
    wait_blocking("the third port listening", Duration::from_secs(30), || {
        std::net::TcpStream::connect(("127.0.0.1", third)).ok()
    });
    {
        use std::io::{Read, Write};
        held.write_all(b"b").expect("the held connection was cut");
        let mut b = [0u8; 1];
        held.read_exact(&mut b)
            .expect("the held connection was cut");
        assert_eq!(&b, b"b");
    }
    assert_eq!(
        wait_blocking("page after the change", Duration::from_secs(20), || curl(
            None, &lb_url
        )),
        "hello from node-1\n"
    );
    // UDP cannot go through Konnectivity: one Warning event, nothing else breaks.
    cluster.apply(&format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: dns\n  namespace: default\nspec:\n  type: LoadBalancer\n  ports:\n  - name: dns\n    protocol: UDP\n    port: {}\n",
        free_port()
    ));
    wait_for_event(&cluster, "dns", "UnsupportedProtocol");
    // With no TCP port it gets no address and no ingress.
    assert!(ingress_ips(&cluster, "default", "dns").is_empty());
    cluster.kubectl_ok(&["delete", "service", "dns"]);

    // Source ranges are enforced at accept, changed in place, and counted.
    let patch_web = |spec: &str| {
        cluster.kubectl_ok(&[
            "patch",
            "service",
            "web",
            "--type=merge",
            "-p",
            &format!(r#"{{"spec":{spec}}}"#),
        ]);
    };
    let ranges = |list: &str| patch_web(&format!(r#"{{"loadBalancerSourceRanges":{list}}}"#));
    ranges(r#"["10.99.0.0/24"]"#);
    wait_blocking(
        "a client outside the ranges refused",
        Duration::from_secs(30),
        || curl(None, &lb_url).is_none().then_some(()),
    );
    ranges(r#"["10.99.0.0/24","127.0.0.0/8"]"#);
    assert_eq!(
        wait_blocking("admitted again", Duration::from_secs(30), || curl(
            None, &lb_url
        )),
        "hello from node-1\n"
    );
    // Limits: one connection at a time, closed after 1 s idle.
    drop(held);
    cluster.kubectl_ok(&[
        "annotate",
        "service",
        "web",
        "tether.dev/lb-max-connections=1",
        "tether.dev/lb-idle-timeout=1s",
    ]);
    let echo = |c: &mut std::net::TcpStream, byte: u8| -> bool {
        use std::io::{Read, Write};
        let mut b = [0u8; 1];
        c.write_all(&[byte]).is_ok() && c.read_exact(&mut b).is_ok() && b[0] == byte
    };
    // A connection admitted before the annotations reached the balancer keeps the old
    // policy (no limit, the default idle timeout), so retry until one connection both
    // holds the only slot and is closed by the 1 s idle timeout: EOF, not a read timeout.
    wait_blocking("the limit applied", Duration::from_secs(60), || {
        use std::io::Read;
        let mut a = std::net::TcpStream::connect(("127.0.0.1", echo_port)).ok()?;
        a.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        if !echo(&mut a, b'c') {
            return None;
        }
        // A second one at once is refused while the first is open.
        let mut b = std::net::TcpStream::connect(("127.0.0.1", echo_port)).ok()?;
        b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        if echo(&mut b, b'd') {
            return None;
        }
        // Idle for 1 s: the balancer closes it (EOF within the read deadline).
        a.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut byte = [0u8; 1];
        matches!(a.read(&mut byte), Ok(0)).then_some(())
    });
    wait_blocking(
        "a new connection after the idle one closed",
        Duration::from_secs(30),
        || {
            let mut c = std::net::TcpStream::connect(("127.0.0.1", echo_port)).ok()?;
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            echo(&mut c, b'e').then_some(())
        },
    );
    let reader = metrics_reader_token(&cluster);
    let metrics_url = format!("https://127.0.0.1:{secure}/metrics");
    let page = https_get(&metrics_url, Some(&reader)).1;
    let value = |needles: &[&str]| -> f64 {
        page.lines()
            .find(|l| needles.iter().all(|n| l.contains(n)))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let web = "service=\"default/web\"";
    assert!(
        value(&[
            "tether_ccm_lb_connections_total{",
            web,
            "refused_source_range"
        ]) >= 1.0,
        "{page}"
    );
    assert!(
        value(&["tether_ccm_lb_connections_total{", web, "\"accepted\""]) >= 6.0,
        "{page}"
    );
    assert!(
        value(&["tether_ccm_lb_bytes_total{", web, "to_client"]) > 0.0,
        "{page}"
    );
    assert!(
        value(&["tether_ccm_lb_connections_total{", web, "refused_limit"]) >= 1.0,
        "{page}"
    );

    // externalTrafficPolicy: Local: only nodes with a ready endpoint are backends.
    patch_web(r#"{"externalTrafficPolicy":"Local"}"#);
    wait_blocking(
        "no node has an endpoint: nothing served",
        Duration::from_secs(30),
        || curl(None, &lb_url).is_none().then_some(()),
    );
    cluster.apply(&endpoint_slice(
        "web",
        "http",
        30080,
        &[(&node.node_ip, "node-1")],
    ));
    assert_eq!(
        wait_blocking(
            "node-1 has a ready endpoint: served",
            Duration::from_secs(30),
            || curl(None, &lb_url)
        ),
        "hello from node-1\n"
    );

    // Deleting the Service removes the listener, then the finalizer (and so the
    // Service).
    cluster.kubectl_ok(&["delete", "service", "web", "--wait=false"]);
    wait_blocking("service gone", Duration::from_secs(30), || {
        (!cluster.kubectl(&["get", "service", "web"]).status.success()).then_some(())
    });
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "listener still open after the Service was deleted"
    );
    // Its per-Service series went with it.
    let page = https_get(&metrics_url, Some(&reader)).1;
    assert!(page.contains("tether_ccm_lb_"), "{page}");
    assert!(
        !page
            .lines()
            .any(|l| l.starts_with("tether_ccm_lb_") && l.contains(web)),
        "series of the deleted Service remain:\n{page}"
    );
    drop(tunnel);
}

/// The NetworkUnavailable condition of `node`: (status, reason).
fn network_unavailable(node: &Value) -> Option<(String, String)> {
    node["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "NetworkUnavailable")
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_string(),
                c["reason"].as_str().unwrap_or_default().to_string(),
            )
        })
}

/// A node with `pod_cidr` and InternalIP `ip` (what node-ipam and the kubelet set).
fn add_node_with_pod_cidr(cluster: &Cluster, name: &str, ip: &str, pod_cidr: &str) {
    cluster.apply(&format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\nspec:\n  podCIDR: {pod_cidr}\n  podCIDRs: [{pod_cidr}]\n"
    ));
    cluster.patch_node_status(
        name,
        &format!(r#"{{"addresses":[{{"type":"InternalIP","address":"{ip}"}}]}}"#),
    );
}

#[test]
fn pod_routes_are_programmed_in_the_hosts_routing_table() {
    // The CCM runs in a namespace of its own (its "host"); 10.233.0.0/24 is a network
    // directly attached there (a veth pair inside the namespace), where the nodes'
    // InternalIPs live.
    let host = Node::router_host();
    // Routes that are not ours to touch: a foreign one in the pod network, one of ours
    // (protocol 84) outside --cluster-cidr; and a stale one of ours that must go.
    host.ip(&[
        "route",
        "add",
        "10.244.200.0/24",
        "via",
        "10.233.0.50",
        "proto",
        "static",
    ]);
    host.ip(&[
        "route",
        "add",
        "10.98.0.0/24",
        "via",
        "10.233.0.51",
        "proto",
        "84",
    ]);
    host.ip(&[
        "route",
        "add",
        "10.244.99.0/24",
        "via",
        "10.233.0.52",
        "proto",
        "84",
    ]);

    let cluster = Cluster::start(&Egress::Direct);
    let relay_dir = TempDir::new("tether-relay");
    let api_port: u16 = cluster.url.rsplit(':').next().unwrap().parse().unwrap();
    let _relays = host.reach_host_port(api_port, relay_dir.path());
    add_node_with_pod_cidr(&cluster, "n1", "10.233.0.2", "10.244.1.0/24");
    add_node_with_pod_cidr(&cluster, "n2", "10.233.0.3", "10.244.2.0/24");
    // Its next hop is not on an attached network: the kernel refuses the route.
    add_node_with_pod_cidr(&cluster, "n3", "10.240.0.9", "10.244.3.0/24");
    // Outside --cluster-cidr: no route, no condition.
    add_node_with_pod_cidr(&cluster, "n4", "10.233.0.5", "10.97.0.0/24");

    let (_dir, inventory) = inventory_dir();
    // Routes are opt-in: the `routes:` section makes this host the pod-network router.
    write_inventory(&inventory, "routes: {}\nnodes: []\n");
    let mut ccm = start_ccm_in(
        Some(&host),
        &cluster,
        &inventory,
        "ccm",
        &[
            "--controllers=route".into(),
            "--leader-elect=false".into(),
            "--secure-port=0".into(),
            "--cluster-cidr=10.244.0.0/16".into(),
            "--route-reconciliation-period=500ms".into(),
        ],
    );
    let ours = || host.ip(&["route", "show", "proto", "84"]);
    let routes = wait_blocking("routes for n1 and n2", Duration::from_secs(30), || {
        let r = ours();
        (r.contains("10.244.1.0/24 via 10.233.0.2")
            && r.contains("10.244.2.0/24 via 10.233.0.3")
            && !r.contains("10.244.99.0/24"))
        .then_some(r)
    });
    assert!(
        routes.contains("10.98.0.0/24"),
        "ours outside --cluster-cidr was deleted:\n{routes}"
    );
    assert!(!routes.contains("10.244.3.0"), "{routes}");
    assert!(!routes.contains("10.97.0.0"), "{routes}");
    assert!(
        host.ip(&["route", "show"])
            .contains("10.244.200.0/24 via 10.233.0.50"),
        "a foreign route was touched"
    );
    for n in ["n1", "n2"] {
        wait_node(&cluster, n, "NetworkUnavailable False/RouteCreated", |v| {
            network_unavailable(v) == Some(("False".into(), "RouteCreated".into()))
        });
    }
    // The kernel refuses n3's route (its next hop is not on a local link): one event,
    // and no NetworkUnavailable=True, which would keep every pod off the node (its
    // condition is not ours to flip).
    wait_for_event(&cluster, "n3", "FailedToCreateRoute");
    let n3 = node_json(&cluster, "n3").unwrap();
    assert!(network_unavailable(&n3).is_none(), "{n3}");
    // Repeats count into the one event instead of making new ones.
    let count = |c: &Cluster| -> (usize, i64) {
        let v: Value = serde_json::from_str(&c.kubectl_ok(&[
            "get",
            "events",
            "-n",
            "default",
            "--field-selector=involvedObject.name=n3,reason=FailedToCreateRoute",
            "-o",
            "json",
        ]))
        .unwrap();
        let items = v["items"].as_array().unwrap().clone();
        let n = items
            .first()
            .map(|e| e["count"].as_i64().unwrap_or(0))
            .unwrap_or(0);
        (items.len(), n)
    };
    wait_blocking("the event's count rises", Duration::from_secs(30), || {
        let (objects, n) = count(&cluster);
        assert_eq!(objects, 1, "one Event object per reason and node");
        (n >= 2).then_some(())
    });
    assert!(network_unavailable(&node_json(&cluster, "n4").unwrap()).is_none());

    // Drift: a route deleted by hand comes back; a node's new address moves its
    // route; a deleted node's route goes.
    host.ip(&["route", "del", "10.244.1.0/24", "proto", "84"]);
    cluster.patch_node_status(
        "n2",
        r#"{"addresses":[{"type":"InternalIP","address":"10.233.0.4"}]}"#,
    );
    cluster.kubectl_ok(&["delete", "node", "n3"]);
    wait_blocking("routes repaired", Duration::from_secs(30), || {
        let r = ours();
        (r.contains("10.244.1.0/24 via 10.233.0.2")
            && r.contains("10.244.2.0/24 via 10.233.0.4")
            && !r.contains("10.233.0.3"))
        .then_some(())
    });
    cluster.kubectl_ok(&["delete", "node", "n1"]);
    wait_blocking("n1's route removed", Duration::from_secs(30), || {
        (!ours().contains("10.244.1.0/24")).then_some(())
    });
    assert!(!ccm.exited(), "the CCM exited:\n{}", ccm.log_text());
    // Stopping: the routes are the leader's alone, and they go with it.
    ccm.signal("TERM");
    ccm.wait_exit(Duration::from_secs(30))
        .expect("the CCM stops");
    let left = ours();
    assert!(
        !left.contains("10.244."),
        "routes left behind after shutdown:\n{left}"
    );
    assert!(
        left.contains("10.98.0.0/24"),
        "ours outside --cluster-cidr: {left}"
    );
}

#[test]
fn a_node_whose_agent_is_connected_exists_without_being_in_the_inventory() {
    let node = Node::create();
    let mut tunnel = Tunnel::start(
        &node,
        "edge-1",
        &format!("host=edge-1&ipv4={}", node.node_ip),
    );
    let server = &tunnel.server;
    let cluster = Cluster::start(&Egress::Direct);
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        // Lab settings: the test server does not verify identifiers, and deletion is
        // opted in with no delay.
        &format!(
            "agents:\n  urls: [http://{}/agents]\n  deleteNodesAfterSeconds: 0\n  trustUnverifiedIdentifiers: true\nnodes: []\n",
            server.admin
        ),
    );
    add_uninitialized_node(&cluster, "edge-1", &node.node_ip);
    let _ccm = start_ccm(&cluster, &inventory, "ccm");
    let n = wait_node(&cluster, "edge-1", "initialized from its agent", |n| {
        !taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into())
    });
    assert_eq!(n["spec"]["providerID"], "tether://edge-1");
    assert_eq!(
        n["status"]["addresses"][0]["address"],
        node.node_ip.as_str()
    );
    assert_eq!(
        n["metadata"]["labels"]["tether.dev/instance-source"],
        "agent"
    );
    // NotReady but its agent is connected: it exists, so it stays. A NotReady node
    // this CCM initialised from the inventory and no longer listed is deleted in the
    // same lifecycle pass, which proves the pass ran.
    cluster.set_node_ready("edge-1", false);
    // (No Ready condition at all counts as not Ready, as upstream; it may be deleted
    // at once, so nothing else is written to it.)
    cluster.apply("apiVersion: v1\nkind: Node\nmetadata:\n  name: ghost\n  labels: {tether.dev/instance-source: inventory}\nspec:\n  providerID: tether://ghost\n");
    // Never initialised by us: never deleted, one Warning event instead.
    cluster.apply("apiVersion: v1\nkind: Node\nmetadata:\n  name: stray\n");
    wait_for_event(&cluster, "stray", "DeletionWithheld");
    assert!(node_json(&cluster, "stray").is_some());
    wait_blocking("ghost deleted", Duration::from_secs(30), || {
        node_json(&cluster, "ghost").is_none().then_some(())
    });
    assert!(
        node_json(&cluster, "edge-1").is_some(),
        "edge-1 was deleted while its agent was connected"
    );
    // Its agent leaves (grace period 0): NotReady and gone, so it is deleted.
    tunnel.agent.proc.kill();
    wait_blocking("edge-1 deleted", Duration::from_secs(30), || {
        node_json(&cluster, "edge-1").is_none().then_some(())
    });
}

/// Waits, without sleeping, until lifecycle passes have run for `long` from now: each
/// round registers a node this CCM initialised from an inventory that no longer lists it
/// (NotReady), which the next pass deletes. (The agent listing is cached for 2 s, so
/// passes past that have seen a fresh one.)
fn prove_lifecycle_passes_for(cluster: &Cluster, long: Duration) {
    let since = Instant::now();
    let mut round = 0;
    while since.elapsed() < long {
        round += 1;
        let ghost = format!("ghost-{round}");
        cluster.apply(&format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {ghost}\n  labels: {{tether.dev/instance-source: inventory}}\nspec:\n  providerID: tether://{ghost}\n"
        ));
        wait_blocking(&format!("{ghost} deleted"), Duration::from_secs(30), || {
            node_json(cluster, &ghost).is_none().then_some(())
        });
    }
    assert!(round >= 2, "the lifecycle passes did not run");
}

fn token_agent(
    pki: &Pki,
    server: &ServerProc,
    dir: &Path,
    id: &str,
    ids: &str,
    token: &str,
) -> AgentProc {
    AgentProc::start_with_token(
        Path::new(BIN),
        pki,
        server.agent,
        dir,
        id,
        token,
        &[format!("--agent-identifiers={ids}")],
    )
}

fn agents_listing(server: &ServerProc) -> Value {
    let out = Command::new("curl")
        .args([
            "-s",
            "--max-time",
            "5",
            &format!("http://{}/agents", server.admin),
        ])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

/// With the shipped token authentication: an agent whose token is bound to a Pod on
/// node edge-1 is vouched for by the server as edge-1, and that node is initialised from
/// it; another agent's bare claim to be edge-2 changes nothing but one event. When
/// edge-1's agent goes away for good, the NotReady node stays (many lifecycle passes
/// later, each proven by a node deleted beside it); only the opt-in policy deletes it.
#[test]
fn only_verified_agents_vouch_for_nodes_and_an_absent_agent_costs_no_node() {
    let cluster = Cluster::start(&Egress::Direct);
    let rbac = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/rbac.yaml");
    cluster.kubectl_ok(&["apply", "-f", rbac.to_str().unwrap()]);
    let pki = Pki::new();
    let server = ServerProc::start(
        Path::new(BIN),
        &token_auth_server_args(&pki, &cluster.files.server_kubeconfig),
    );
    let tokens = TempDir::new("tether-tokens");
    let bound = cluster.pod_bound_agent_token("konnectivity-agent-edge-1", "edge-1");
    let mut verified = token_agent(
        &pki,
        &server,
        tokens.path(),
        "edge-1",
        "host=edge-1&ipv4=127.0.0.1",
        &bound,
    );
    // A valid token of the right ServiceAccount, bound to no pod: admitted, unverified.
    let unbound =
        cluster.service_account_token("konnectivity-agent", Some("system:konnectivity-server"));
    let _claimer = token_agent(
        &pki,
        &server,
        tokens.path(),
        "edge-2",
        "host=edge-2&ipv4=127.0.0.2",
        &unbound,
    );
    let listing = wait_blocking("both agents listed", Duration::from_secs(30), || {
        let v = agents_listing(&server);
        (v["agents"].as_array().map(|a| a.len()) == Some(2)).then_some(v)
    });
    let agent = |id: &str| {
        listing["agents"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["id"] == id)
            .unwrap()
            .clone()
    };
    assert_eq!(
        agent("edge-1")["verifiedBy"],
        "serviceaccount-token",
        "{listing}"
    );
    assert_eq!(
        agent("edge-1")["verifiedHosts"],
        serde_json::json!(["edge-1"]),
        "{listing}"
    );
    assert!(
        agent("edge-1")["verifiedIps"]
            .as_array()
            .unwrap()
            .is_empty(),
        "a token proves no address: {listing}"
    );
    assert_eq!(agent("edge-2")["verifiedBy"], "", "{listing}");
    assert!(
        agent("edge-2")["verifiedHosts"]
            .as_array()
            .unwrap()
            .is_empty(),
        "{listing}"
    );

    let (_dir, inventory) = inventory_dir();
    let agents_only = format!(
        "agents:\n  urls: [http://{}/agents]\nnodes: []\n",
        server.admin
    );
    write_inventory(&inventory, &agents_only);
    add_uninitialized_node(&cluster, "edge-1", "");
    add_uninitialized_node(&cluster, "edge-2", "");
    let mut ccm = start_ccm(&cluster, &inventory, "ccm");
    let n = wait_node(
        &cluster,
        "edge-1",
        "initialised from its verified agent",
        |n| !taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into()),
    );
    assert_eq!(n["spec"]["providerID"], "tether://edge-1");
    assert_eq!(
        n["metadata"]["labels"]["tether.dev/instance-source"],
        "agent"
    );
    wait_for_event(&cluster, "edge-2", "UnverifiedAgentIdentity");
    let edge2 = node_json(&cluster, "edge-2").unwrap();
    assert!(
        taint_keys(&edge2).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into())
            && edge2["spec"]["providerID"].is_null(),
        "an unverified claim initialised edge-2: {edge2}"
    );

    // The WAN link to edge-1 goes: NotReady, its agent gone from every server.
    cluster.set_node_ready("edge-1", false);
    verified.proc.kill();
    wait_blocking("edge-1's agent gone", Duration::from_secs(30), || {
        let v = agents_listing(&server);
        (!v.to_string().contains("\"edge-1\"")).then_some(())
    });
    prove_lifecycle_passes_for(&cluster, Duration::from_secs(6));
    let kept = node_json(&cluster, "edge-1").expect("edge-1 was deleted while its agent was away");
    assert_eq!(kept["spec"]["providerID"], "tether://edge-1");
    assert!(!ccm.exited(), "{}", ccm.log_text());
    drop(ccm);

    // The operator opts in: away longer than 1 s (since this CCM started) and NotReady.
    write_inventory(
        &inventory,
        &format!(
            "agents:\n  urls: [http://{}/agents]\n  deleteNodesAfterSeconds: 1\nnodes: []\n",
            server.admin
        ),
    );
    let _ccm = start_ccm(&cluster, &inventory, "ccm-opt-in");
    wait_blocking(
        "edge-1 deleted under the opt-in policy",
        Duration::from_secs(30),
        || node_json(&cluster, "edge-1").is_none().then_some(()),
    );
    assert!(
        node_json(&cluster, "edge-2").is_some(),
        "edge-2 was never ours to delete"
    );
}

/// A kubelet 1.29+ dual-stack registration (`--node-ip v4,v6` in the provided-node-ip
/// annotation, its Hostname address) under an upstream CCM command line: canonical
/// controller names, --use-service-account-credentials, the delegated-auth kubeconfigs,
/// --concurrent-node-syncs. Then the upstream metrics are scraped.
#[test]
fn an_upstream_command_line_initialises_a_dual_stack_node_and_serves_upstream_metrics() {
    let cluster = Cluster::start(&Egress::Direct);
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        "nodes:\n- name: dual-1\n  zone: z1\n  labels: {example.com/rack: r1}\n  addresses:\n  - {type: InternalIP, address: 10.0.0.5}\n  - {type: InternalIP, address: 10.0.0.99}\n  - {type: InternalIP, address: fd00::5}\n  - {type: ExternalIP, address: 203.0.113.5}\n",
    );
    cluster.apply(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: dual-1\n  annotations:\n    alpha.kubernetes.io/provided-node-ip: \"10.0.0.5,fd00::5\"\nspec:\n  taints:\n  - key: node.cloudprovider.kubernetes.io/uninitialized\n    value: \"true\"\n    effect: NoSchedule\n",
    );
    cluster.patch_node_status(
        "dual-1",
        r#"{"addresses":[{"type":"InternalIP","address":"10.0.0.5"},{"type":"Hostname","address":"dual-1"}]}"#,
    );
    let kubeconfig = cluster.ccm_kubeconfig();
    let port = free_port();
    let upstream: Vec<String> = vec![
        "--controllers=*,-node-route-controller,-service-lb-controller,cloud-node-controller"
            .into(),
        "--use-service-account-credentials=true".into(),
        format!("--authentication-kubeconfig={}", kubeconfig.display()),
        format!("--authorization-kubeconfig={}", kubeconfig.display()),
        "--concurrent-node-syncs=2".into(),
        "--leader-elect-resource-lock=leases".into(),
        "--allocate-node-cidrs=false".into(),
        "--configure-cloud-routes=false".into(),
        "--cloud-provider=tether".into(),
        format!("--secure-port={port}"),
        "--bind-address=127.0.0.1".into(),
        "--v=2".into(),
    ];
    let mut ccm = start_ccm_with(&cluster, &inventory, "ccm", &upstream);
    let n = wait_node(&cluster, "dual-1", "initialised", |n| {
        n["spec"]["providerID"] == "tether://dual-1"
    });
    let addresses: Vec<(String, String)> = n["status"]["addresses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["type"].as_str().unwrap().into(),
                a["address"].as_str().unwrap().into(),
            )
        })
        .collect();
    let pair = |t: &str, a: &str| (t.to_string(), a.to_string());
    assert_eq!(
        addresses,
        vec![
            pair("InternalIP", "10.0.0.5"),
            pair("InternalIP", "fd00::5"),
            pair("ExternalIP", "203.0.113.5"),
            pair("Hostname", "dual-1"),
        ],
        "provided IPs first, the other v4 InternalIP left out as upstream, the kubelet's Hostname kept"
    );
    assert_eq!(n["metadata"]["labels"]["example.com/rack"], "r1");
    // It acted as node-controller, with a token of its own.
    let sa = cluster.kubectl_ok(&[
        "get",
        "serviceaccount",
        "node-controller",
        "-n",
        "kube-system",
        "-o",
        "name",
    ]);
    assert!(sa.contains("node-controller"), "{sa}");
    assert!(
        ccm.logged("controllers use their own ServiceAccount credentials"),
        "{}",
        ccm.log_text()
    );

    scrape(
        &cluster,
        &format!("https://127.0.0.1:{port}"),
        &[
            "workqueue_adds_total{name=\"node\"}",
            "workqueue_depth{name=\"node\"}",
            "workqueue_work_duration_seconds_count{name=\"node\"}",
            "workqueue_queue_duration_seconds_count{name=\"node\"}",
            "leader_election_master_status{name=\"cloud-controller-manager\"} 1",
            "rest_client_requests_total{code=\"201\",host=",
            "rest_client_request_duration_seconds_count{",
            "node_controller_node_initializations_total{result=\"initialized\"} 1",
            "service_controller_loadbalancer_sync_total 0",
            "route_controller_route_sync_total 0",
        ],
    );
    tether_testkit::stop_ccm_and_check_its_tokens_are_gone(&mut ccm);
}

/// Two replicas, each on its own host: routes live only in the leader's table. A leader
/// that steps down (SIGTERM) takes its routes with it and the other host gets them; a
/// leader that crashes (SIGKILL) leaves them, and they are removed when it comes back as
/// a standby.
#[test]
fn routes_follow_the_leader_and_leave_no_stale_entry() {
    let cluster = Cluster::start(&Egress::Direct);
    add_node_with_pod_cidr(&cluster, "n1", "10.233.0.2", "10.244.1.0/24");
    add_node_with_pod_cidr(&cluster, "n2", "10.233.0.3", "10.244.2.0/24");
    let (_dir, inventory) = inventory_dir();
    write_inventory(&inventory, "routes: {}\nnodes: []\n");
    let hosts: Vec<Node> = (0..2).map(|_| Node::router_host()).collect();
    let relay_dirs: Vec<TempDir> = (0..2).map(|_| TempDir::new("tether-relay")).collect();
    let _relays: Vec<_> = hosts
        .iter()
        .zip(&relay_dirs)
        .map(|(h, d)| h.reach_host_port(cluster.port, d.path()))
        .collect();
    let start = |i: usize, name: &str| {
        start_ccm_in(
            Some(&hosts[i]),
            &cluster,
            &inventory,
            name,
            &[
                "--controllers=route".into(),
                "--secure-port=0".into(),
                "--cluster-cidr=10.244.0.0/16".into(),
                "--route-reconciliation-period=500ms".into(),
            ],
        )
    };
    let table = |i: usize| hosts[i].ip(&["route", "show", "proto", "84"]);
    let routed = |i: usize| {
        let t = table(i);
        t.contains("10.244.1.0/24 via 10.233.0.2") && t.contains("10.244.2.0/24 via 10.233.0.3")
    };
    let mut a = start(0, "ccm-a");
    wait_blocking("routes on host A (leader)", Duration::from_secs(30), || {
        routed(0).then_some(())
    });
    let mut b = start(1, "ccm-b");
    b.wait_event("waiting to become leader", START_TIMEOUT, |_| true);
    assert!(
        table(1).trim().is_empty(),
        "a standby made routes: {}",
        table(1)
    );

    // A steps down: its routes go, B's host gets them.
    a.signal("TERM");
    a.wait_exit(Duration::from_secs(30)).expect("A stops");
    assert!(
        table(0).trim().is_empty(),
        "A left routes behind: {}",
        table(0)
    );
    wait_blocking(
        "routes on host B (new leader)",
        Duration::from_secs(30),
        || routed(1).then_some(()),
    );

    // B crashes: nothing can clean its table, until it comes back as a standby.
    let a = start(0, "ccm-a2");
    a.wait_event("waiting to become leader", START_TIMEOUT, |_| true);
    b.kill();
    wait_blocking("routes on host A again", Duration::from_secs(30), || {
        routed(0).then_some(())
    });
    assert!(
        routed(1),
        "the crashed leader's routes are still there (expected)"
    );
    let b = start(1, "ccm-b2");
    b.wait_event("waiting to become leader", START_TIMEOUT, |_| true);
    assert!(
        table(1).trim().is_empty(),
        "the former leader's stale routes survived its restart: {}",
        table(1)
    );
    assert!(routed(0));
    drop(a);
}

/// A real node (containerd, kubelet with --cloud-provider=external, the agent-only
/// binary) known only through its agent is initialised from it; the site then goes dark
/// (its agent gone, the link down so the kubelet cannot report) and the node is marked
/// NotReady: it stays, with its pod, through lifecycle passes well past every grace
/// period; only the operator's opt-in deletes it.
#[test]
fn a_real_node_survives_its_agents_long_absence() {
    if let Err(why) = tether_testkit::node::available() {
        panic!("real nodes unavailable: {why} (run scripts/install-kube.sh)");
    }
    let net = Node::create();
    let pki = Pki::with_sans(std::slice::from_ref(&net.host_ip));
    let frontend = tether_testkit::kube::Frontend::GrpcUds;
    let server = ServerProc::start(Path::new(BIN), &frontend.server_args(&pki));
    let cluster = Cluster::start_with(
        &frontend.egress(&pki, &server),
        &tether_testkit::kube::ClusterOptions {
            reachable_from_nodes: true,
            ..Default::default()
        },
    );
    let opts = tether_testkit::node::NodeOptions {
        external_cloud_provider: true,
        ..Default::default()
    };
    let mut node = tether_testkit::node::RealNode::start_on(net, &cluster, "edge-real", &opts);
    node.start_agent(
        Path::new(env!("CARGO_BIN_EXE_tether-agent")),
        &pki,
        server.agent.port(),
        &[],
    );
    let (_dir, inventory) = inventory_dir();
    // The test server does not verify identifiers (see the verified-agent test for that).
    let lab = format!(
        "agents:\n  urls: [http://{}/agents]\n  trustUnverifiedIdentifiers: true\nnodes: []\n",
        server.admin
    );
    write_inventory(&inventory, &lab);
    let ccm = start_ccm(&cluster, &inventory, "ccm");
    let n = wait_node(&cluster, "edge-real", "initialised from its agent", |n| {
        !taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into())
    });
    assert_eq!(n["spec"]["providerID"], "tether://edge-real");
    assert_eq!(n["status"]["addresses"][0]["address"], node.ip());
    node.run_pod(
        &cluster,
        "survivor",
        "app: survivor",
        &format!("  - name: c\n    image: {}\n    imagePullPolicy: Never\n    command: [sleep, '3600']\n", tether_testkit::node::BUSYBOX_IMAGE),
    );

    // The site goes dark: its agent's stream ends, then the WAN link goes down so that
    // the kubelet cannot report either.
    node.agent.as_mut().unwrap().proc.kill();
    node.net.set_link(false);
    wait_blocking(
        "the agent gone from the server",
        Duration::from_secs(60),
        || {
            (!agents_listing(&server)
                .to_string()
                .contains("\"edge-real\""))
            .then_some(())
        },
    );
    cluster.set_node_ready("edge-real", false);
    prove_lifecycle_passes_for(&cluster, Duration::from_secs(6));
    let kept = node_json(&cluster, "edge-real").expect("the node was deleted during the outage");
    assert_eq!(kept["spec"]["providerID"], "tether://edge-real");
    assert!(
        cluster
            .kubectl(&["get", "pod", "survivor"])
            .status
            .success(),
        "the node's pod is gone"
    );
    drop(ccm);

    // The operator opts in to deleting nodes whose agent is away (here: 1 s).
    write_inventory(
        &inventory,
        &lab.replace("nodes: []", "  deleteNodesAfterSeconds: 1\nnodes: []"),
    );
    let _ccm = start_ccm(&cluster, &inventory, "ccm-opt-in");
    wait_blocking(
        "edge-real deleted under the opt-in policy",
        Duration::from_secs(30),
        || node_json(&cluster, "edge-real").is_none().then_some(()),
    );
    node.net.set_link(true);
}

/// Creates (or replaces) LoadBalancer Service `ns/name` with one TCP port named `p`
/// (`node_port` when given), `annotations`, and `spec` merged into its spec.
fn lb_service(
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

/// An EndpointSlice (v1beta1, as 1.20 serves it) of Service `default/service`: ready
/// endpoints (address, node) on port `port` named `port_name`. The tests' clusters run
/// no kube-controller-manager, so hand-made Endpoints would not be mirrored into one.
fn endpoint_slice(service: &str, port_name: &str, port: u16, endpoints: &[(&str, &str)]) -> String {
    let endpoints: String = endpoints
        .iter()
        .map(|(ip, node)| {
            format!("- addresses: [{ip}]\n  conditions:\n    ready: true\n  topology:\n    kubernetes.io/hostname: {node}\n")
        })
        .collect();
    format!(
        "apiVersion: discovery.k8s.io/v1beta1\nkind: EndpointSlice\nmetadata:\n  name: {service}-1\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {service}\n    endpointslice.kubernetes.io/managed-by: tests\naddressType: IPv4\nendpoints:\n{endpoints}ports:\n- name: {port_name}\n  port: {port}\n  protocol: TCP\n"
    )
}

/// The ingress IPs of Service `ns/name`.
fn ingress_ips(cluster: &Cluster, ns: &str, name: &str) -> Vec<String> {
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
fn wait_ingress(cluster: &Cluster, ns: &str, name: &str) -> String {
    wait_blocking(
        &format!("an ingress IP for {ns}/{name}"),
        Duration::from_secs(30),
        || match ingress_ips(cluster, ns, name).as_slice() {
            [ip] => Some(ip.clone()),
            _ => None,
        },
    )
}

/// The count of the (aggregated) event with `reason` about `name` in `default`.
fn event_count(cluster: &Cluster, name: &str, reason: &str) -> u64 {
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

/// Address pools against the real apiserver: two Services on port 443 get distinct
/// addresses and both serve; `loadBalancerIP` is honoured; an address taken, outside
/// the pools (or in another namespace's pool) or of the wrong family is one Warning
/// event; a sharing key shares an address until ports collide, and across namespaces
/// only when both sides opt in; a namespace's pool
/// serves it first; allocations survive a restart (a Service created meanwhile does
/// not take them); an exhausted pool is an event, and the Service gets the address a
/// deleted one frees; `allocateLoadBalancerNodePorts: false` reaches the pod; a PROXY
/// header carries the client's address.
#[test]
fn services_get_their_own_addresses_from_the_pools() {
    use serde_json::json;
    let node = Node::create();
    let tunnel = Tunnel::start(&node, "node-1", &format!("ipv4={}", node.node_ip));
    let _page_a = node.serve_page(30080, "page a\n");
    let _page_b = node.serve_page(30081, "page b\n");
    let _pod = node.serve_page_at(&node.pod_ip, 8080, "from the pod\n");
    let _echo = node.spawn(
        "echo",
        "socat",
        &[
            format!("TCP-LISTEN:30090,bind={},fork,reuseaddr", node.node_ip),
            "EXEC:cat".into(),
        ],
    );
    wait_blocking("node pages serving", Duration::from_secs(20), || {
        curl(Some(&node.ns), &format!("http://{}:30081/", node.node_ip))
    });

    let cluster = Cluster::start(&Egress::Direct);
    cluster.add_node("node-1", &node.node_ip);
    cluster.set_node_ready("node-1", true);
    cluster.kubectl_ok(&["create", "namespace", "team"]);
    let k = std::process::id() % 250;
    let addr = |n: u8| format!("127.77.{k}.{n}");
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        &format!(
            "nodes:\n{}loadBalancer:\n  pools:\n  - name: general\n    addresses: [{}-{}]\n  - name: team\n    addresses: [{}]\n    namespaces: [team]\n",
            machine("node-1", &node.node_ip, false),
            addr(10),
            addr(17),
            addr(30)
        ),
    );
    let no = json!({});
    lb_service(
        &cluster,
        "default",
        "web-a",
        443,
        Some(30080),
        json!({}),
        json!({}),
    );
    lb_service(
        &cluster,
        "default",
        "web-b",
        443,
        Some(30081),
        json!({}),
        json!({}),
    );
    let secure = free_port();
    let ccm_args = [
        format!("--tunnel-uds={}", tunnel.socket.display()),
        "--lb-resync-period=1s".into(),
        format!("--secure-port={secure}"),
    ];
    let mut ccm = start_ccm_with(&cluster, &inventory, "ccm", &ccm_args);

    // Two Services on 443: their own addresses, both serving.
    let ip_a = wait_ingress(&cluster, "default", "web-a");
    let ip_b = wait_ingress(&cluster, "default", "web-b");
    assert_ne!(ip_a, ip_b);
    for (ip, page) in [(&ip_a, "page a\n"), (&ip_b, "page b\n")] {
        let got = wait_blocking(
            &format!("{page:?} at {ip}:443"),
            Duration::from_secs(20),
            || curl(None, &format!("http://{ip}:443/")),
        );
        assert_eq!(got, page);
    }

    // Asked for: honoured; taken, outside every pool, another namespace's, the wrong
    // family: one event naming why, and no address.
    lb_service(
        &cluster,
        "default",
        "web-c",
        8080,
        None,
        json!({}),
        json!({"loadBalancerIP": addr(17)}),
    );
    assert_eq!(wait_ingress(&cluster, "default", "web-c"), addr(17));
    lb_service(
        &cluster,
        "default",
        "web-d",
        8080,
        None,
        json!({}),
        json!({"loadBalancerIP": ip_a}),
    );
    lb_service(
        &cluster,
        "default",
        "web-e",
        8080,
        None,
        json!({}),
        json!({"loadBalancerIP": "127.99.0.1"}),
    );
    lb_service(
        &cluster,
        "default",
        "web-t",
        8080,
        None,
        json!({}),
        json!({"loadBalancerIP": addr(30)}),
    );
    lb_service(
        &cluster,
        "default",
        "web-f",
        8080,
        None,
        json!({"tether.dev/load-balancer-ips": "fd00::1"}),
        no.clone(),
    );
    for (name, reason) in [
        ("web-d", "AddressInUse"),
        ("web-e", "AddressNotInPool"),
        ("web-t", "AddressNotInPool"),
        ("web-f", "AddressFamilyMismatch"),
    ] {
        wait_for_event(&cluster, name, reason);
        assert!(
            ingress_ips(&cluster, "default", name).is_empty(),
            "{name} got an address"
        );
    }
    for name in ["web-e", "web-t", "web-f"] {
        cluster.kubectl_ok(&["delete", "service", name]);
    }
    // A namespace's own pool first.
    lb_service(&cluster, "team", "t1", 8080, None, json!({}), no.clone());
    assert_eq!(wait_ingress(&cluster, "team", "t1"), addr(30));

    // A sharing key shares an address while the ports differ.
    let key = json!({"tether.dev/lb-sharing-key": "dns"});
    lb_service(
        &cluster,
        "default",
        "s1",
        8053,
        None,
        key.clone(),
        no.clone(),
    );
    let ip_s = wait_ingress(&cluster, "default", "s1");
    lb_service(
        &cluster,
        "default",
        "s2",
        8054,
        None,
        key.clone(),
        no.clone(),
    );
    assert_eq!(wait_ingress(&cluster, "default", "s2"), ip_s);
    lb_service(
        &cluster,
        "default",
        "s3",
        8053,
        None,
        key.clone(),
        json!({"loadBalancerIP": ip_s}),
    );
    wait_for_event(&cluster, "s3", "PortCollision");
    cluster.kubectl_ok(&["delete", "service", "s3"]);

    // The same key in another namespace gets an address of its own, until both sides
    // name each other's namespace.
    lb_service(&cluster, "team", "x1", 8055, None, key.clone(), no.clone());
    let ip_x = wait_ingress(&cluster, "team", "x1");
    assert_ne!(ip_x, ip_s, "shared across namespaces without an opt-in");
    let cross = |ns: &str| json!({"tether.dev/lb-sharing-key": "dns", "tether.dev/lb-sharing-cross-namespace": ns});
    lb_service(
        &cluster,
        "default",
        "s1",
        8053,
        None,
        cross("team"),
        no.clone(),
    );
    lb_service(
        &cluster,
        "default",
        "s2",
        8054,
        None,
        cross("team"),
        no.clone(),
    );
    lb_service(
        &cluster,
        "team",
        "x2",
        8056,
        None,
        cross("default"),
        json!({"loadBalancerIP": ip_s}),
    );
    assert_eq!(wait_ingress(&cluster, "team", "x2"), ip_s);
    cluster.kubectl_ok(&["delete", "service", "-n", "team", "x1", "x2"]);

    // No node ports: straight to the ready endpoint's pod IP and targetPort.
    lb_service(
        &cluster,
        "default",
        "web-p",
        80,
        None,
        no.clone(),
        json!({"allocateLoadBalancerNodePorts": false, "ports": [{"name": "p", "port": 80, "targetPort": 8080}]}),
    );
    let svc_p: Value =
        serde_json::from_str(&cluster.kubectl_ok(&["get", "service", "web-p", "-o", "json"]))
            .unwrap();
    assert!(
        svc_p["spec"]["ports"][0]["nodePort"].is_null(),
        "the apiserver allocated a nodePort: {svc_p}"
    );
    // An EndpointSlice and no Endpoints (as a cluster whose Endpoints stopped at 1,000
    // addresses, or a controller that writes only slices): v1beta1 is what 1.20 serves.
    cluster.apply(&endpoint_slice(
        "web-p",
        "p",
        8080,
        &[(&node.pod_ip, "node-1")],
    ));
    assert!(cluster
        .kubectl(&["get", "endpoints", "web-p"])
        .stderr
        .starts_with(b"Error from server (NotFound)"));
    let ip_p = wait_ingress(&cluster, "default", "web-p");
    assert_eq!(
        wait_blocking(
            "the pod through the balancer",
            Duration::from_secs(30),
            || curl(None, &format!("http://{ip_p}:80/"))
        ),
        "from the pod\n"
    );

    // PROXY protocol v1: the echo backend sends back what it got first.
    lb_service(
        &cluster,
        "default",
        "web-pp",
        7000,
        Some(30090),
        json!({"tether.dev/lb-proxy-protocol": "v1"}),
        no.clone(),
    );
    let ip_pp = wait_ingress(&cluster, "default", "web-pp");
    let (line, client_port) =
        wait_blocking("a PROXY header echoed", Duration::from_secs(30), || {
            use std::io::{BufRead, BufReader};
            let c = std::net::TcpStream::connect((ip_pp.as_str(), 7000)).ok()?;
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let port = c.local_addr().unwrap().port();
            let mut line = String::new();
            BufReader::new(c).read_line(&mut line).ok()?;
            (!line.is_empty()).then_some((line, port))
        });
    assert_eq!(
        line,
        format!("PROXY TCP4 127.0.0.1 {ip_pp} {client_port} 7000\r\n")
    );

    // Said once, though resyncs (every second) came and went meanwhile.
    assert_eq!(event_count(&cluster, "web-d", "AddressInUse"), 1);

    // A restart: allocations read back; a Service created while no CCM ran does not
    // take any of them.
    let before: Vec<(String, String)> = ["web-a", "web-b", "web-c", "s1", "s2", "web-p", "web-pp"]
        .iter()
        .map(|n| (n.to_string(), wait_ingress(&cluster, "default", n)))
        .collect();
    ccm.kill();
    lb_service(
        &cluster,
        "default",
        "web-n",
        8080,
        None,
        no.clone(),
        no.clone(),
    );
    let ccm = start_ccm_with(&cluster, &inventory, "ccm-2", &ccm_args);
    let ip_n = wait_ingress(&cluster, "default", "web-n");
    assert!(
        before.iter().all(|(_, ip)| *ip != ip_n),
        "{ip_n} handed out twice: {before:?}"
    );
    for (name, ip) in &before {
        assert_eq!(&wait_ingress(&cluster, "default", name), ip, "{name} moved");
    }
    assert_eq!(
        wait_blocking("web-a after the restart", Duration::from_secs(20), || curl(
            None,
            &format!("http://{ip_a}:443/")
        )),
        "page a\n"
    );

    // The pool runs out: an event; a deleted Service's address goes to the waiting one.
    lb_service(
        &cluster,
        "default",
        "x1",
        8080,
        None,
        no.clone(),
        no.clone(),
    );
    wait_ingress(&cluster, "default", "x1");
    lb_service(
        &cluster,
        "default",
        "x2",
        8080,
        None,
        no.clone(),
        no.clone(),
    );
    wait_for_event(&cluster, "x2", "NoAddressAvailable");
    cluster.kubectl_ok(&["delete", "service", "web-c"]);
    assert_eq!(wait_ingress(&cluster, "default", "x2"), addr(17));
    // An address freed by a change (not a deletion) goes to the Service refused for
    // it: web-a moves to x2's address once x2 is gone, and web-d, refused since the
    // start for wanting ip_a, gets it.
    cluster.kubectl_ok(&["delete", "service", "x2"]);
    lb_service(
        &cluster,
        "default",
        "web-a",
        443,
        Some(30080),
        no.clone(),
        json!({"loadBalancerIP": addr(17)}),
    );
    assert_eq!(
        wait_blocking("web-a moved", Duration::from_secs(30), || {
            let ips = ingress_ips(&cluster, "default", "web-a");
            (ips == [addr(17)]).then_some(ips)
        }),
        [addr(17)]
    );
    assert_eq!(wait_ingress(&cluster, "default", "web-d"), ip_a);

    // The general pool is full. Pools reload without a restart: one more address in
    // the cloud config, and the waiting Service gets it at the next resync.
    lb_service(
        &cluster,
        "default",
        "x3",
        8080,
        None,
        no.clone(),
        no.clone(),
    );
    wait_for_event(&cluster, "x3", "NoAddressAvailable");
    let url = format!("https://127.0.0.1:{secure}/metrics");
    let reader = metrics_reader_token(&cluster);
    let page = https_get(&url, Some(&reader)).1;
    // (addresses in all, in use) of the general pool.
    let usage = |page: &str| {
        let gauge =
            |name: &str| tether_testkit::metric(page, &format!("{name}{{pool=\"general\"}}"));
        (
            gauge("tether_ccm_lb_addresses_total"),
            gauge("tether_ccm_lb_addresses_in_use"),
        )
    };
    assert_eq!(usage(&page), (Some(8.0), Some(8.0)), "{page}");
    write_inventory(
        &inventory,
        &format!(
            "nodes:\n{}loadBalancer:\n  pools:\n  - name: general\n    addresses: [{}-{}]\n  - name: team\n    addresses: [{}]\n    namespaces: [team]\n",
            machine("node-1", &node.node_ip, false),
            addr(10),
            addr(18),
            addr(30)
        ),
    );
    assert_eq!(wait_ingress(&cluster, "default", "x3"), addr(18));
    let page = https_get(&url, Some(&reader)).1;
    assert_eq!(usage(&page), (Some(9.0), Some(9.0)), "{page}");
    drop(ccm);
    drop(tunnel);
}

/// `allocateLoadBalancerNodePorts: false` with pod networks that are not routed between
/// nodes: the server (`destCIDR` with `--watch-node-pod-cidrs`, RBAC from
/// deploy/rbac.yaml) sends each dial to a pod IP to the agent on that pod's node, so
/// every connection through the balancer reaches its pod, on either node.
#[test]
fn a_pod_ip_is_dialled_by_the_agent_on_its_node() {
    use serde_json::json;
    let nodes = [Node::create(), Node::create()];
    let pki = Pki::with_sans(&[nodes[0].host_ip.clone(), nodes[1].host_ip.clone()]);
    let socket = socket_path(pki.dir());
    let cluster = Cluster::start(&Egress::Direct);
    let rbac = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/rbac.yaml");
    cluster.kubectl_ok(&["apply", "-f", rbac.to_str().unwrap()]);
    let mut args = uds_frontend_args(&pki, "grpc", &socket);
    args.extend([
        "--agent-bind-address=0.0.0.0".into(),
        "--proxy-strategies=destHost,destCIDR".into(),
        "--watch-node-pod-cidrs".into(),
        format!("--kubeconfig={}", cluster.files.server_kubeconfig.display()),
    ]);
    let server = ServerProc::start(Path::new(BIN), &args);
    let mut machines = String::new();
    let mut endpoints = Vec::new();
    let mut _running = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let name = format!("node-{i}");
        // Its own node's certificate: the server routes to the agent it verified.
        _running.push(node_agent(node, &name, &pki, &server));
        let pod_cidr = format!("{}.0/24", &node.pod_ip[..node.pod_ip.rfind('.').unwrap()]);
        add_node_with_pod_cidr(&cluster, &name, &node.node_ip, &pod_cidr);
        cluster.set_node_ready(&name, true);
        machines.push_str(&machine(&name, &node.node_ip, false));
        endpoints.push((node.pod_ip.as_str(), name));
    }
    let _pods: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| n.serve_page_at(&n.pod_ip, 8080, &format!("pod on node-{i}\n")))
        .collect();
    for (i, node) in nodes.iter().enumerate() {
        let url = format!("http://{}:8080/", node.pod_ip);
        wait_blocking("pod serving", Duration::from_secs(20), || {
            curl(Some(&node.ns), &url)
        });
        assert!(
            curl_within(Some(&nodes[1 - i].ns), &url, "2").is_none(),
            "pod networks must not be routed between the nodes"
        );
    }

    let k = std::process::id() % 250;
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        &format!("nodes:\n{machines}loadBalancer:\n  pools:\n  - name: general\n    addresses: [127.78.{k}.10]\n"),
    );
    lb_service(
        &cluster,
        "default",
        "pods",
        80,
        None,
        json!({}),
        json!({"allocateLoadBalancerNodePorts": false, "ports": [{"name": "p", "port": 80, "targetPort": 8080}]}),
    );
    let endpoints: Vec<(&str, &str)> = endpoints.iter().map(|(ip, n)| (*ip, n.as_str())).collect();
    cluster.apply(&endpoint_slice("pods", "p", 8080, &endpoints));
    let _ccm = start_ccm_with(
        &cluster,
        &inventory,
        "ccm",
        &[format!("--tunnel-uds={}", socket.display())],
    );
    let ip = wait_ingress(&cluster, "default", "pods");
    let url = format!("http://{ip}:80/");
    // Both pods answer once the server knows the nodes' pod networks...
    let mut seen = std::collections::BTreeSet::new();
    wait_blocking(
        "both pods through the balancer",
        Duration::from_secs(30),
        || {
            seen.extend(curl(None, &url));
            (seen.len() == 2).then_some(())
        },
    );
    // ...and from then on every connection reaches its pod, whichever node it is on.
    let mut seen = std::collections::BTreeSet::new();
    for n in 0..16 {
        let body = curl(None, &url).unwrap_or_else(|| panic!("connection {n} failed"));
        seen.insert(body);
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        ["pod on node-0\n", "pod on node-1\n"]
    );
    // No dial ever went to the wrong node's agent (the balancer would have hidden it by
    // trying the next endpoint).
    let out = Command::new("curl")
        .args([
            "-s",
            "--max-time",
            "5",
            &format!("http://{}/metrics", server.health),
        ])
        .output()
        .unwrap();
    // (The series appears with the first such failure, as upstream's.)
    assert_eq!(
        tether_testkit::metric(
            &String::from_utf8_lossy(&out.stdout),
            r#"konnectivity_network_proxy_server_dial_failure_count{reason="error_response"}"#
        )
        .unwrap_or(0.0),
        0.0,
        "a pod IP was sent to the wrong agent"
    );
}

/// An agent in `node`, named `name`, with that node's own certificate (bound to its
/// address), connected to `server`.
fn node_agent(node: &Node, name: &str, pki: &Pki, server: &ServerProc) -> AgentProc {
    AgentProc::start_in(
        Some(node),
        Path::new(BIN),
        pki,
        format!("{}:{}", node.host_ip, server.agent.port())
            .parse()
            .unwrap(),
        &pki.node_agent_args(name, &node.node_ip),
    )
}

/// `externalTrafficPolicy: Local` with two nodes, only one of which has an endpoint:
/// every connection goes to that node's NodePort; none reaches the other node (whose
/// NodePort answers differently, and whose agent is connected and verified).
#[test]
fn local_policy_sends_nothing_to_a_node_without_an_endpoint() {
    use serde_json::json;
    let nodes = [Node::create(), Node::create()];
    let pki = Pki::with_sans(&[nodes[0].host_ip.clone(), nodes[1].host_ip.clone()]);
    let socket = socket_path(pki.dir());
    let cluster = Cluster::start(&Egress::Direct);
    let mut args = uds_frontend_args(&pki, "grpc", &socket);
    // Dials go to the agent verified for the node's address (the LB needs destHost:
    // with `default` alone the server picks any agent).
    args.push("--agent-bind-address=0.0.0.0".into());
    args.push("--proxy-strategies=destHost".into());
    let server = ServerProc::start(Path::new(BIN), &args);
    let mut machines = String::new();
    let mut _running = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let name = format!("node-{i}");
        // Its own node's certificate: the server routes to the agent it verified.
        _running.push(node_agent(node, &name, &pki, &server));
        cluster.add_node(&name, &node.node_ip);
        cluster.set_node_ready(&name, true);
        machines.push_str(&machine(&name, &node.node_ip, false));
    }
    let _pages: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| n.serve_page(30082, &format!("node-{i}\n")))
        .collect();
    let k = std::process::id() % 250;
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        &format!("nodes:\n{machines}loadBalancer:\n  pools:\n  - name: general\n    addresses: [127.79.{k}.10]\n"),
    );
    lb_service(
        &cluster,
        "default",
        "local",
        80,
        Some(30082),
        json!({}),
        json!({"externalTrafficPolicy": "Local"}),
    );
    cluster.apply(&endpoint_slice(
        "local",
        "p",
        8080,
        &[(&nodes[0].pod_ip, "node-0")],
    ));
    let ccm = start_ccm_with(
        &cluster,
        &inventory,
        "ccm",
        &[format!("--tunnel-uds={}", socket.display())],
    );
    let ip = wait_ingress(&cluster, "default", "local");
    let url = format!("http://{ip}:80/");

    assert_eq!(
        wait_blocking("the balancer serving", Duration::from_secs(30), || curl(
            None, &url
        )),
        "node-0\n"
    );
    for n in 0..20 {
        assert_eq!(
            curl(None, &url)
                .unwrap_or_else(|| panic!("connection {n} failed:\n{}", ccm.log_text())),
            "node-0\n",
            "connection {n} reached the node without an endpoint"
        );
    }
}

/// One quick try at `url` from inside `netns` (half a second at most).
fn curl_quick(netns: &str, url: &str) -> Option<String> {
    curl_within(Some(netns), url, "0.5")
}

/// Who answers ARP for `vip` on the LAN, asked from `client` (100 ms for answers).
fn arp_answers(client: &Node, vip: &str) -> Vec<String> {
    tether_testkit::arp::who_has(
        &client.ns,
        tether_testkit::netns::Lan::INTERFACE,
        vip.parse().unwrap(),
        Duration::from_millis(100),
    )
}

/// The holder of pool `lan`'s lease, if any.
fn lb_lease_holder(cluster: &Cluster) -> Option<String> {
    pool_lease_holder(cluster, "lan")
}

/// The holder of `pool`'s lease, if any.
fn pool_lease_holder(cluster: &Cluster, pool: &str) -> Option<String> {
    get_json(
        cluster,
        &[
            "-n",
            "kube-system",
            "get",
            "lease",
            &format!("cloud-controller-manager-lb-{pool}"),
            "-o",
            "json",
        ],
    )
    .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string))
    .filter(|h| !h.is_empty())
}

fn get_json(cluster: &Cluster, args: &[&str]) -> Option<Value> {
    let out = cluster.kubectl(args);
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).ok())
        .flatten()
}

/// Two control-plane "hosts" sharing a LAN with a client, the set-up of the failover
/// tests: a node behind the tunnel serving the NodePort, a Service on port 80 and the
/// pool's one address.
struct Failover {
    node: Node,
    tunnel: Tunnel,
    _page: tether_testkit::netns::ServedPage,
    cluster: Cluster,
    lan: tether_testkit::netns::Lan,
    hosts: Vec<Node>,
    client: Node,
    _relays: Vec<[Proc; 2]>,
    _relay_dirs: Vec<TempDir>,
    _dir: TempDir,
    inventory: PathBuf,
    vip: String,
    /// With two pools: the second pool's address (Service `web2`, port 80) and its page.
    vip2: Option<String>,
    _page2: Option<tether_testkit::netns::ServedPage>,
}

impl Failover {
    fn new() -> Failover {
        Failover::with_pools(1)
    }

    /// With `pools` (1 or 2) pools of one address each, a Service on each.
    fn with_pools(pools: usize) -> Failover {
        use tether_testkit::netns::Lan;
        let node = Node::create();
        let tunnel = Tunnel::start(&node, "node-1", &format!("ipv4={}", node.node_ip));
        let page = node.serve_page(30080, "hello over the lan\n");
        let cluster = Cluster::start(&Egress::Direct);
        cluster.add_node("node-1", &node.node_ip);
        cluster.set_node_ready("node-1", true);
        let lan = Lan::create();
        let hosts: Vec<Node> = (0..2).map(|_| Node::create()).collect();
        let client = Node::create();
        for n in hosts.iter().chain([&client]) {
            lan.attach(n);
        }
        let relay_dirs: Vec<TempDir> = (0..2).map(|_| TempDir::new("tether-relay")).collect();
        let relays: Vec<_> = hosts
            .iter()
            .zip(&relay_dirs)
            .map(|(h, d)| h.reach_host_port(cluster.port, d.path()))
            .collect();
        let vip = lan.address(100);
        let vip2 = (pools > 1).then(|| lan.address(101));
        let (dir, inventory) = inventory_dir();
        write_inventory(
            &inventory,
            &format!(
                "nodes:\n{}loadBalancer:\n  interface: {}\n  pools:\n  - name: lan\n    addresses: [{vip}]\n{}",
                machine("node-1", &node.node_ip, false),
                Lan::INTERFACE,
                vip2.as_ref()
                    .map(|v| format!("  - name: lan2\n    addresses: [{v}]\n"))
                    .unwrap_or_default()
            ),
        );
        let page2 = vip2.as_ref().map(|v| {
            lb_service(
                &cluster,
                "default",
                "web2",
                80,
                Some(30081),
                serde_json::json!({}),
                serde_json::json!({"loadBalancerIP": v}),
            );
            node.serve_page(30081, "hello from the second pool\n")
        });
        lb_service(
            &cluster,
            "default",
            "web",
            80,
            Some(30080),
            serde_json::json!({}),
            serde_json::json!({}),
        );
        Failover {
            node,
            tunnel,
            _page: page,
            cluster,
            lan,
            hosts,
            client,
            _relays: relays,
            _relay_dirs: relay_dirs,
            _dir: dir,
            inventory,
            vip,
            vip2,
            _page2: page2,
        }
    }

    /// A replica on host `i`; returns once it stands by for (or holds) the
    /// load-balancer lease.
    fn start(&self, i: usize, name: &str) -> Proc {
        let p = start_ccm_in(
            Some(&self.hosts[i]),
            &self.cluster,
            &self.inventory,
            name,
            &[
                "--secure-port=0".into(),
                format!("--tunnel-uds={}", self.tunnel.socket.display()),
            ],
        );
        p.wait_event("waiting to become leader", START_TIMEOUT, |e| {
            e.to_string().contains("cloud-controller-manager-lb-lan")
        });
        p
    }

    fn url(&self) -> String {
        format!("http://{}/", self.vip)
    }

    /// Probes ARP every 100 ms from `since` until a MAC other than `old` answers alone
    /// (asserting that two never answer at once): returns when `old` first went silent
    /// and when the other first answered.
    fn takeover(&self, old: &str, since: Instant, limit: Duration) -> (Duration, Duration) {
        let mut silent = None;
        loop {
            let answers = arp_answers(&self.client, &self.vip);
            assert!(
                answers.len() <= 1,
                "two hosts answer ARP at once: {answers:?}"
            );
            if silent.is_none() && !answers.iter().any(|a| a == old) {
                silent = Some(since.elapsed());
            }
            if answers.len() == 1 && answers[0] != old {
                return (silent.unwrap_or_default(), since.elapsed());
            }
            assert!(since.elapsed() < limit, "nobody took the address over");
        }
    }

    /// Waits until exactly one MAC answers ARP for the address, and returns it.
    fn wait_single_answer(&self, what: &str) -> String {
        wait_blocking(what, Duration::from_secs(30), || {
            let answers = arp_answers(&self.client, &self.vip);
            (answers.len() == 1).then(|| answers[0].clone())
        })
    }

    /// `n` connections in a row, each with a flushed neighbour cache first: all reach
    /// the page.
    fn hundred_tries(&self, n: usize) {
        for i in 0..n {
            self.client.ip(&[
                "neigh",
                "flush",
                "dev",
                tether_testkit::netns::Lan::INTERFACE,
            ]);
            assert_eq!(
                curl_within(Some(&self.client.ns), &self.url(), "2").as_deref(),
                Some("hello over the lan\n"),
                "try {i} of {n} failed"
            );
        }
    }
}

/// Connects to `url` from `ns` every 100 ms (0.3 s each) until finished: the
/// moments the page did not come back.
struct ConnProber {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(usize, Vec<Duration>)>,
}

impl ConnProber {
    fn start(ns: &str, url: String, page: &'static str) -> ConnProber {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, ns) = (stop.clone(), ns.to_string());
        let thread = std::thread::spawn(move || {
            let start = Instant::now();
            let (mut tries, mut failures) = (0, Vec::new());
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                let at = Instant::now();
                tries += 1;
                if curl_within(Some(&ns), &url, "0.3").as_deref() != Some(page) {
                    failures.push(start.elapsed());
                }
                std::thread::sleep(Duration::from_millis(100).saturating_sub(at.elapsed()));
            }
            (tries, failures)
        });
        ConnProber { stop, thread }
    }

    /// Stops: (tries, failures, the window from the first failure to the last).
    fn finish(self) -> (usize, Vec<Duration>, Duration) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (tries, failures) = self.thread.join().unwrap();
        let window = match (failures.first(), failures.last()) {
            (Some(first), Some(last)) => *last - *first + Duration::from_millis(100),
            _ => Duration::ZERO,
        };
        (tries, failures, window)
    }
}

/// `ip addr show` of the load-balancer device inside process `pid`'s namespace (the
/// one its `tether-lb-netns` thread made).
fn lb_namespace_addresses(pid: u32) -> String {
    let task = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| t.ok())
        .find(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim() == "tether-lb-netns")
        })
        .expect("the namespace thread");
    let out = Command::new("nsenter")
        .arg(format!("--net={}", task.path().join("ns/net").display()))
        .args(["ip", "addr", "show", "dev", "tether-lb"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Crash: SIGKILL the replica holding the address and restart none on its host. Its
/// namespace dies with it, so its host stops answering ARP at once (no stale address);
/// the standby takes the load-balancer lease when it runs out (4 s) and answers. At no
/// moment do both answer. Then a client with a flushed neighbour cache connects 100
/// times out of 100. The host's own interface never carries the address.
#[test]
fn a_crashed_holders_address_moves_within_seconds_and_its_host_goes_silent() {
    let f = Failover::new();
    let mut a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let mac_a = f.wait_single_answer("the first replica answering ARP");
    let _b = f.start(1, "ccm-b");
    assert_eq!(arp_answers(&f.client, &f.vip), std::slice::from_ref(&mac_a));
    for h in &f.hosts {
        assert!(
            !h.ip(&["addr", "show"]).contains(&f.vip),
            "the address is on a host's own interface"
        );
    }
    // It is on the macvlan in the CCM's own namespace (its namespace thread's), alone:
    // no IPv6 address of the device's own either.
    let inside = lb_namespace_addresses(a.pid());
    assert!(inside.contains(&format!("{}/32", f.vip)), "{inside}");
    assert!(!inside.contains("inet6"), "{inside}");
    wait_blocking(
        "the client reaches the Service",
        Duration::from_secs(30),
        || curl_quick(&f.client.ns, &f.url()),
    );

    a.kill();
    let killed = Instant::now();
    let (silent, answered) = f.takeover(&mac_a, killed, Duration::from_secs(30));
    f.hundred_tries(100);
    let served = killed.elapsed();
    eprintln!(
        "crash: the dead host stopped answering ARP {silent:?} after SIGKILL; the standby answered after {answered:?}; 100/100 connections done at {served:?}"
    );
    assert!(
        silent < Duration::from_secs(2),
        "the dead host answered for {silent:?}"
    );
    assert!(
        answered < Duration::from_secs(6),
        "takeover took {answered:?}"
    );
    assert_eq!(
        ingress_ips(&f.cluster, "default", "web"),
        std::slice::from_ref(&f.vip)
    );
    drop(f.node);
}

/// SIGTERM of the holder, the way a rolling update stops it: the addresses go first,
/// then the lease is released, and the process waits until the standby holds it. A
/// client connecting every 100 ms sees under a second of failures.
#[test]
fn a_graceful_handover_costs_under_a_second() {
    let f = Failover::new();
    let mut a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let mac_a = f.wait_single_answer("the first replica answering ARP");
    let _b = f.start(1, "ccm-b");
    let holder_a = lb_lease_holder(&f.cluster).expect("a holder");
    wait_blocking(
        "the client reaches the Service",
        Duration::from_secs(30),
        || curl_quick(&f.client.ns, &f.url()),
    );
    // Connect every 100 ms from before the signal until well after the handover.
    let prober = ConnProber::start(&f.client.ns, f.url(), "hello over the lan\n");
    std::thread::sleep(Duration::from_secs(1));
    a.signal("TERM");
    let exited = a
        .wait_exit(Duration::from_secs(30))
        .expect("the holder exits");
    assert!(exited.success(), "{}", a.log_text());
    let holder = lb_lease_holder(&f.cluster);
    assert!(
        holder.is_some() && holder.as_ref() != Some(&holder_a),
        "the lease had no new holder when the old process exited: {holder:?}"
    );
    let mac_b = f.wait_single_answer("the standby answering ARP");
    assert_ne!(mac_b, mac_a);
    std::thread::sleep(Duration::from_secs(2));
    let (tries, failures, window) = prober.finish();
    eprintln!(
        "graceful handover: {} of {tries} connections failed, over {window:?}",
        failures.len()
    );
    assert!(
        window < Duration::from_secs(1),
        "connections failed for {window:?}: {failures:?}"
    );
    drop(f.node);
}

/// Two pools, two replicas: the pools spread. The first replica takes both; the second,
/// holding none, asks for one and is handed it gracefully (connections to the moved
/// address fail for under a second, the other address's never); after the first
/// replica stops, the second holds both, and a replica started again takes one back.
#[test]
fn pools_spread_over_the_replicas() {
    let f = Failover::with_pools(2);
    let vip2 = f.vip2.clone().unwrap();
    let a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    assert_eq!(wait_ingress(&f.cluster, "default", "web2"), vip2);
    let mac_a = f.wait_single_answer("the first replica answering ARP");
    wait_blocking(
        "the first replica holding both pools",
        Duration::from_secs(30),
        || (arp_answers(&f.client, &vip2) == [mac_a.clone()]).then_some(()),
    );
    let url2 = format!("http://{vip2}/");
    for url in [f.url(), url2.clone()] {
        wait_blocking("the client reaching both", Duration::from_secs(30), || {
            curl_quick(&f.client.ns, &url)
        });
    }
    let probes = [
        ConnProber::start(&f.client.ns, f.url(), "hello over the lan\n"),
        ConnProber::start(&f.client.ns, url2.clone(), "hello from the second pool\n"),
    ];
    let spread = |what: &str| {
        let started = Instant::now();
        let macs = wait_blocking(what, Duration::from_secs(30), || {
            let one = arp_answers(&f.client, &f.vip);
            let two = arp_answers(&f.client, &vip2);
            assert!(
                one.len() <= 1 && two.len() <= 1,
                "two hosts answer at once: {one:?} {two:?}"
            );
            (one.len() == 1 && two.len() == 1 && one != two)
                .then(|| (one[0].clone(), two[0].clone()))
        });
        (macs, started.elapsed())
    };
    let b = f.start(1, "ccm-b");
    let ((one, two), took) = spread("the second replica taking a pool");
    assert!(one == mac_a || two == mac_a);
    let holders: Vec<Option<String>> = ["lan", "lan2"]
        .iter()
        .map(|p| pool_lease_holder(&f.cluster, p))
        .collect();
    assert!(
        holders[0].is_some() && holders[1].is_some() && holders[0] != holders[1],
        "{holders:?}"
    );
    std::thread::sleep(Duration::from_secs(2));
    let results: Vec<_> = probes.into_iter().map(ConnProber::finish).collect();
    let moved = if one == mac_a { 1 } else { 0 };
    eprintln!(
        "spread: pool {} moved {took:?} after the second replica stood by; its connections failed for {:?} ({} of {}), the other pool's {} of {}",
        moved + 1,
        results[moved].2,
        results[moved].1.len(),
        results[moved].0,
        results[1 - moved].1.len(),
        results[1 - moved].0,
    );
    assert!(
        results[moved].2 < Duration::from_secs(1),
        "{:?}",
        results[moved].1
    );
    // (One probe of 0.3 s may time out on a loaded machine; an outage would be many.)
    assert!(
        results[1 - moved].1.len() <= 1,
        "{:?}",
        results[1 - moved].1
    );
    // The first replica stops: the second holds both; one started again takes one back.
    let mut a = a;
    a.signal("TERM");
    a.wait_exit(Duration::from_secs(30))
        .expect("the first replica exits");
    let mac_b = if one == mac_a { two } else { one };
    wait_blocking(
        "the second replica holding both",
        Duration::from_secs(30),
        || {
            (arp_answers(&f.client, &f.vip) == [mac_b.clone()]
                && arp_answers(&f.client, &vip2) == [mac_b.clone()])
            .then_some(())
        },
    );
    let _a2 = f.start(0, "ccm-a2");
    spread("a restarted replica taking a pool back");
    drop(b);
}

/// Host exposure: the addresses live in the CCM's own namespace, so the holder's host
/// daemons are never reachable on them and never blocked by them. A Service on 6443 is
/// refused with an event (and gets no address); a daemon on `0.0.0.0:P` of the holder's
/// host is not reachable on the address, while a Service on the same P is, and the
/// daemon restarts on P while the address is held; a Tether server on the holder's
/// host restarts on 0.0.0.0:8132 while the address is held.
#[test]
fn the_holders_host_daemons_are_neither_exposed_nor_blocked() {
    let f = Failover::new();
    let _a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let host = &f.hosts[0];
    // A Service on the apiserver's port: refused, said in an event, no ingress.
    lb_service(
        &f.cluster,
        "default",
        "api",
        6443,
        Some(30443),
        serde_json::json!({}),
        serde_json::json!({}),
    );
    wait_blocking("a PortReserved event", Duration::from_secs(30), || {
        (event_count(&f.cluster, "api", "PortReserved") > 0).then_some(())
    });
    assert!(ingress_ips(&f.cluster, "default", "api").is_empty());

    // A host daemon on 0.0.0.0:P and a Service on P, side by side.
    let p = 18000 + (std::process::id() % 1000) as u16;
    let daemon = |name: &str| {
        host.spawn(
            name,
            "socat",
            &[
                format!("TCP-LISTEN:{p},fork,reuseaddr"),
                "SYSTEM:echo host daemon".into(),
            ],
        )
    };
    // What a connection from inside the host to its own P gets.
    let local = || {
        let out = Command::new("ip")
            .args(["netns", "exec", &host.ns, "sh", "-c"])
            .arg(format!("socat -T1 - TCP:127.0.0.1:{p} </dev/null"))
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .contains("host daemon")
            .then_some(())
    };
    let mut d = daemon("host-daemon");
    wait_blocking("the host daemon", Duration::from_secs(10), local);
    let vip_p = format!("http://{}:{p}/", f.vip);
    assert!(
        curl_within(Some(&f.client.ns), &vip_p, "1").is_none(),
        "the host daemon answered on the load-balancer address"
    );
    let holder_port = f.cluster.kubectl(&[
        "patch", "service", "web", "--type=json", "-p",
        &format!(r#"[{{"op":"add","path":"/spec/ports/-","value":{{"name":"alt","port":{p},"targetPort":{p},"nodePort":30081}}}}]"#),
    ]);
    assert!(
        holder_port.status.success(),
        "{}",
        String::from_utf8_lossy(&holder_port.stderr)
    );
    let _alt = f.node.serve_page(30081, "the service on P\n");
    assert_eq!(
        wait_blocking("the Service on P", Duration::from_secs(30), || {
            curl_quick(&f.client.ns, &vip_p)
        }),
        "the service on P\n"
    );
    // The daemon restarts on P while the address holds P.
    d.kill();
    let d2 = daemon("host-daemon-again");
    wait_blocking(
        "the host daemon bound to P again",
        Duration::from_secs(10),
        local,
    );
    assert_eq!(
        curl_quick(&f.client.ns, &vip_p).as_deref(),
        Some("the service on P\n")
    );

    // A Tether server on the holder's host, on the agents' port of every address.
    let pki = Pki::with_sans(std::slice::from_ref(&host.link_ip));
    let socket = socket_path(pki.dir());
    let mut args: Vec<String> = vec![
        "server".into(),
        "--log-format=json".into(),
        "--agent-port=8132".into(),
        "--agent-bind-address=0.0.0.0".into(),
        "--health-port=0".into(),
        "--admin-port=0".into(),
    ];
    args.extend(uds_frontend_args(&pki, "grpc", &socket));
    for round in 0..2 {
        let mut server = host.spawn(&format!("host-server-{round}"), BIN, &args);
        server.wait_event("server listening", START_TIMEOUT, |_| true);
        assert!(
            curl_within(Some(&f.client.ns), &format!("http://{}:8132/", f.vip), "1").is_none(),
            "the host's Tether server answered on the load-balancer address"
        );
        server.signal("TERM");
        server
            .wait_exit(Duration::from_secs(30))
            .expect("the server stops");
    }
    drop(d2);
}

/// A holder that hangs while alive (SIGSTOP): its addresses' kernel lifetime (2 s,
/// refreshed while it holds the lease) runs out, so its host goes silent before the
/// standby can take the lease (4 s); never both answer. Woken again (SIGCONT), it finds
/// itself late, lets go and stands by without answering again.
#[test]
fn a_hung_holder_goes_silent_before_the_standby_takes_over() {
    let f = Failover::new();
    let a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let mac_a = f.wait_single_answer("the first replica answering ARP");
    let _b = f.start(1, "ccm-b");
    // Hold the address a few lifetimes first: it is refreshed, not expiring.
    for _ in 0..30 {
        assert_eq!(arp_answers(&f.client, &f.vip), std::slice::from_ref(&mac_a));
    }
    a.signal("STOP");
    let stopped = Instant::now();
    let (silent, answered) = f.takeover(&mac_a, stopped, Duration::from_secs(30));
    eprintln!(
        "hung holder: silent {silent:?} after SIGSTOP (address lifetime); the standby answered from {answered:?}"
    );
    a.signal("CONT");
    // It lets go, or exits: its controllers' lease ran out too, and a leader that loses
    // that lease exits, as upstream's does.
    let mut a = a;
    wait_blocking("the woken replica lets go", Duration::from_secs(30), || {
        (a.exited() || a.logged("stepping down") || a.logged("giving up the pool's lease"))
            .then_some(())
    });
    for _ in 0..20 {
        let answers = arp_answers(&f.client, &f.vip);
        assert_eq!(answers.len(), 1, "after SIGCONT: {answers:?}");
        assert_ne!(answers[0], mac_a, "the woken replica answers again");
    }
    f.hundred_tries(20);
}

/// The holder's interface goes down: it gives up the load-balancer lease at once (not
/// when the lease runs out), and the standby takes the address; brought back up, the
/// first replica stands by and does not answer.
#[test]
fn a_holder_whose_interface_goes_down_gives_up_the_lease() {
    use tether_testkit::netns::Lan;
    let f = Failover::new();
    let a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let mac_a = f.wait_single_answer("the first replica answering ARP");
    let _b = f.start(1, "ccm-b");
    let holder_a = lb_lease_holder(&f.cluster).expect("a holder");
    f.hosts[0].ip(&["link", "set", Lan::INTERFACE, "down"]);
    let down = Instant::now();
    a.wait_event(
        "giving up the pool's lease",
        Duration::from_secs(30),
        |_| true,
    );
    let (_, answered) = f.takeover(&mac_a, down, Duration::from_secs(30));
    let holder = lb_lease_holder(&f.cluster);
    eprintln!("interface down: the standby answered ARP {answered:?} after the holder's interface went down");
    assert!(holder.is_some() && holder != Some(holder_a), "{holder:?}");
    assert!(
        answered < Duration::from_secs(3),
        "the standby took {answered:?}: the lease was not given up"
    );
    f.hosts[0].ip(&["link", "set", Lan::INTERFACE, "up"]);
    for _ in 0..20 {
        let answers = arp_answers(&f.client, &f.vip);
        assert_eq!(answers.len(), 1, "{answers:?}");
        assert_ne!(answers[0], mac_a);
    }
}

/// Partition: cut the holder from the apiserver only (its packets to the apiserver
/// dropped in its namespace). It lets go of the address when it cannot renew (2 s),
/// before the lease can run out for the standby (4 s): at no moment do both hosts
/// answer ARP; the time until only the standby answers is printed.
#[test]
fn a_holder_cut_from_the_apiserver_lets_go_before_the_standby_takes_over() {
    let f = Failover::new();
    let _a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let mac_a = f.wait_single_answer("the first replica answering ARP");
    let _b = f.start(1, "ccm-b");
    f.hosts[0].iptables(&[
        "-A",
        "OUTPUT",
        "-p",
        "tcp",
        "--dport",
        &f.cluster.port.to_string(),
        "-j",
        "DROP",
    ]);
    let cut = Instant::now();
    let (silent, answered) = f.takeover(&mac_a, cut, Duration::from_secs(40));
    eprintln!(
        "partition: the cut-off holder stopped answering ARP {silent:?} after the cut; only the standby answered from {answered:?}"
    );
    f.hundred_tries(20);
    drop(f.lan);
}

/// Reads `bytes` from `addr` and returns the throughput in MiB/s (None if the
/// connection fails or ends early, or it takes over a minute).
fn download_rate(addr: &str, bytes: usize) -> Option<f64> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
    let mut buf = vec![0u8; 256 << 10];
    let (start, mut got) = (Instant::now(), 0usize);
    while got < bytes {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => got += n,
        }
    }
    Some(bytes as f64 / (1 << 20) as f64 / start.elapsed().as_secs_f64())
}

/// A node behind the tunnel with an endless download on two NodePorts, and
/// LoadBalancer Services `a` and `b` on them (on free ports).
struct BulkServices {
    tunnel: Tunnel,
    _zero: Vec<Proc>,
    cluster: Cluster,
    _dir: TempDir,
    inventory: PathBuf,
    ports: (u16, u16),
    _node: Node,
}

impl BulkServices {
    fn new(node_ports: [u16; 2]) -> BulkServices {
        let node = Node::create();
        let tunnel = Tunnel::start(&node, "node-1", &format!("ipv4={}", node.node_ip));
        let zero = node_ports
            .iter()
            .map(|p| {
                node.spawn(
                    &format!("zero-{p}"),
                    "socat",
                    &[
                        format!("TCP-LISTEN:{p},bind={},fork,reuseaddr", node.node_ip),
                        "OPEN:/dev/zero,rdonly".into(),
                    ],
                )
            })
            .collect();
        let cluster = Cluster::start(&Egress::Direct);
        let (dir, inventory) = inventory_dir();
        write_machines(&inventory, &[("node-1", &node.node_ip, false)]);
        cluster.add_node("node-1", &node.node_ip);
        cluster.set_node_ready("node-1", true);
        let ports = (free_port(), free_port());
        for (name, port, node_port) in
            [("a", ports.0, node_ports[0]), ("b", ports.1, node_ports[1])]
        {
            cluster.apply(&format!(
                "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  type: LoadBalancer\n  ports:\n  - name: bulk\n    port: {port}\n    nodePort: {node_port}\n"
            ));
        }
        BulkServices {
            tunnel,
            _zero: zero,
            cluster,
            _dir: dir,
            inventory,
            ports,
            _node: node,
        }
    }
}

/// Eight stalled downloads on Service A (clients that stop reading) must not starve
/// Service B: each Service has its own tunnel connection, so A's stalled streams fill
/// only A's HTTP/2 windows. B keeps at least 80% of what it moves alone (the median of
/// three interleaved rounds, each a 64 MiB download alone and one beside).
#[test]
fn stalled_downloads_on_one_service_leave_another_its_throughput() {
    let bulk = BulkServices::new([30090, 30091]);
    let (cluster, inventory, tunnel) = (&bulk.cluster, bulk.inventory.as_path(), &bulk.tunnel);
    let (port_a, port_b) = bulk.ports;
    let _ccm = start_ccm_with(
        cluster,
        inventory,
        "ccm",
        &[
            "--lb-bind-address=127.0.0.1".into(),
            format!("--tunnel-uds={}", tunnel.socket.display()),
        ],
    );
    let (a, b) = (format!("127.0.0.1:{port_a}"), format!("127.0.0.1:{port_b}"));
    for addr in [&a, &b] {
        wait_blocking("the load balancer serving", Duration::from_secs(60), || {
            download_rate(addr, 1 << 20)
        });
    }
    const SIZE: usize = 64 << 20;
    let mut alone = Vec::new();
    let mut stalled_beside = Vec::new();
    for _ in 0..3 {
        alone.push(download_rate(&b, SIZE).expect("B alone"));
        // Eight downloads on A that read their first 64 KiB and then stop reading.
        let stalled: Vec<std::net::TcpStream> = (0..8)
            .map(|_| {
                use std::io::Read;
                let mut s = std::net::TcpStream::connect(&a).unwrap();
                let mut first = vec![0u8; 64 << 10];
                s.read_exact(&mut first).unwrap();
                s
            })
            .collect();
        stalled_beside
            .push(download_rate(&b, SIZE).expect("B beside eight stalled downloads on A"));
        drop(stalled);
    }
    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    // Each round's pair ran back to back, under the same load from whatever else runs
    // on the machine: the median of the rounds' ratios (starvation would be near zero
    // in every round).
    let mut ratios: Vec<f64> = stalled_beside
        .iter()
        .zip(&alone)
        .map(|(beside, alone)| beside / alone)
        .collect();
    ratios.sort_by(f64::total_cmp);
    let ratio = ratios[ratios.len() / 2];
    eprintln!(
        "Service B: {:.0} MiB/s alone, {:.0} MiB/s beside 8 stalled downloads on A (median round {ratio:.2}x; rounds {alone:.0?} / {stalled_beside:.0?})",
        best(&alone),
        best(&stalled_beside)
    );
    // Starvation is near zero; a loaded 2-core machine moves a round's ratio between
    // about 0.7 and 1.1 (a CI run's rounds: 0.80, 0.71, 1.07). The figure itself is
    // tether-bench's to track, not this test's.
    assert!(ratio >= 0.5, "B kept {ratio:.2}x of its throughput");
}

/// `--lb-max-connections` caps client connections over every Service, and its last
/// quarter goes only to Services under their fair share: with a cap of four, Service A
/// gets three and is refused a fourth (`refused_global_limit`), B still gets one, and
/// then nobody gets more; B serves again once A's close.
#[test]
fn the_global_connection_cap_holds_over_every_service() {
    use std::io::Read;
    let bulk = BulkServices::new([30092, 30093]);
    let (cluster, inventory, tunnel) = (&bulk.cluster, bulk.inventory.as_path(), &bulk.tunnel);
    let (port_a, port_b) = bulk.ports;
    let metrics_port = free_port();
    let _ccm = start_ccm_with(
        cluster,
        inventory,
        "ccm",
        &[
            "--lb-bind-address=127.0.0.1".into(),
            "--lb-max-connections=4".into(),
            format!("--secure-port={metrics_port}"),
            format!("--tunnel-uds={}", tunnel.socket.display()),
        ],
    );
    // A connection that delivers bytes, or None if it is closed at once.
    let open = |port: u16| -> Option<std::net::TcpStream> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        let mut first = [0u8; 1024];
        s.read_exact(&mut first).ok()?;
        Some(s)
    };
    let a1 = wait_blocking("A serving", Duration::from_secs(60), || open(port_a));
    let a2 = open(port_a).expect("a second connection on A");
    let a3 = open(port_a).expect("a third connection on A");
    assert!(
        open(port_a).is_none(),
        "A took the last quarter of the cap beyond its share"
    );
    let b1 = open(port_b).expect("B gets its share while A is busy");
    assert!(open(port_b).is_none(), "a fifth connection over the cap");
    let reader = metrics_reader_token(cluster);
    let page = https_get(
        &format!("https://127.0.0.1:{metrics_port}/metrics"),
        Some(&reader),
    )
    .1;
    assert!(
        page.lines()
            .any(|l| l.starts_with("tether_ccm_lb_connections_total{")
                && l.contains("default/a")
                && l.contains("refused_global_limit")
                && !l.ends_with(" 0")),
        "{page}"
    );
    drop((a1, a2, a3, b1));
    wait_blocking(
        "B serving once the connections closed",
        Duration::from_secs(30),
        || open(port_b),
    );
}

/// Before 1.30 kube-proxy captures an ingress IP; `loadBalancer.ingressHostnameSuffix`
/// publishes `<address>.<suffix>` instead (no IP for kube-proxy to take), the balancer
/// listens on the address, and a restarted CCM reads the address back from the name.
#[test]
fn an_ingress_hostname_suffix_publishes_names_kube_proxy_ignores() {
    let node = Node::create();
    let tunnel = Tunnel::start(&node, "node-1", &format!("ipv4={}", node.node_ip));
    let _page = node.serve_page(30084, "hello by name\n");
    let cluster = Cluster::start(&Egress::Direct);
    cluster.add_node("node-1", &node.node_ip);
    cluster.set_node_ready("node-1", true);
    let k = std::process::id() % 250;
    let vip = format!("127.80.{k}.10");
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        &format!(
            "nodes:\n{}loadBalancer:\n  ingressHostnameSuffix: sslip.io\n  pools:\n  - name: general\n    addresses: [{vip}]\n",
            machine("node-1", &node.node_ip, false)
        ),
    );
    lb_service(
        &cluster,
        "default",
        "named",
        80,
        Some(30084),
        serde_json::json!({}),
        serde_json::json!({}),
    );
    let ingress = || {
        get_json(&cluster, &["get", "service", "named", "-o", "json"])
            .map(|s| s["status"]["loadBalancer"]["ingress"].clone())
            .filter(|i| i.as_array().is_some_and(|a| !a.is_empty()))
    };
    let args = [format!("--tunnel-uds={}", tunnel.socket.display())];
    let ccm = start_ccm_with(&cluster, &inventory, "ccm", &args);
    let first = wait_blocking("a hostname ingress", Duration::from_secs(30), ingress);
    assert_eq!(
        first,
        serde_json::json!([{"hostname": format!("{vip}.sslip.io")}]),
        "a hostname and no IP"
    );
    assert_eq!(
        wait_blocking(
            "the balancer on the address",
            Duration::from_secs(30),
            || { curl(None, &format!("http://{vip}/")) }
        ),
        "hello by name\n"
    );
    drop(ccm);
    let _again = start_ccm_with(&cluster, &inventory, "ccm-again", &args);
    assert_eq!(
        wait_blocking(
            "served again after a restart",
            Duration::from_secs(30),
            || { curl(None, &format!("http://{vip}/")) }
        ),
        "hello by name\n"
    );
    assert_eq!(ingress(), Some(first));
}

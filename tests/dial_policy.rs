//! The agent's dial policy with real processes: a frontend holding a valid credential
//! (stolen, or a compromised server's) asks an agent for targets on loopback standing
//! in for a node's LAN, kubelet, pods and Services. Each rule allows what it names and
//! nothing more; a refusal reaches the caller (curl's CONNECT, kubectl through a real
//! kube-apiserver) with the fix, and is counted and logged by the agent; the Node
//! object gives the kubelet's address and port and the pod range, read again when a
//! dial would be refused; `--dial-policy=any` and an upstream command line dial
//! anything, with an UNSAFE line.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tether_testkit::kube::{Cluster, Frontend};
use tether_testkit::netns::Node;
use tether_testkit::process::tcp_frontend_args;
use tether_testkit::{
    backend, metric, request_head, tls_connect, wait_until, AgentProc, Pki, ServerProc,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_tether");
const REFUSED: &str = "dial refused by the agent's dial policy";

fn bin() -> &'static Path {
    Path::new(BIN)
}

/// CONNECT to `target` through the server's HTTP-CONNECT frontend; on 200, one GET
/// through the tunnel. The status line and what followed (the refusal's text, or the
/// backend's answer).
async fn through(pki: &Pki, server: &ServerProc, target: &str) -> (String, String) {
    let addr: SocketAddr = server.frontend.parse().unwrap();
    let mut s = tls_connect(addr, pki.frontend_http_tls()).await.unwrap();
    let head = request_head(
        &mut s,
        format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    if head.starts_with("HTTP/1.1 200") {
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
    }
    let mut rest = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_string(&mut rest)).await;
    (head.lines().next().unwrap_or_default().to_string(), rest)
}

async fn refusals(agent: &AgentProc) -> f64 {
    metric(&agent.metrics().await, "tether_agent_dial_refusals_total").unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_frontend_reaches_only_what_the_policy_names_never_the_nodes_lan() {
    let pki = Pki::new();
    // The host ends of four veth links stand in for the node's address, a Service, a
    // LAN subnet the operator opened one port of, and the rest of the LAN (loopback is
    // reserved: only a rule naming it reaches it).
    let links: Vec<Node> = (0..4).map(|_| Node::create()).collect();
    let [node_ip, service_ip, opened_ip, lan_ip] = [0, 1, 2, 3].map(|i| links[i].host_ip.clone());
    let node_port = backend::http_on(&node_ip, "hostNetwork pod\n").await;
    let node_other = backend::http_on(&node_ip, "node sshd\n").await;
    let service = backend::http_on(&service_ip, "service\n").await;
    let opened = backend::http_on(&opened_ip, "opened\n").await;
    let lan = backend::http_on(&lan_ip, "the LAN's printer\n").await;
    let loopback = backend::http_on("127.0.0.1", "the node's loopback\n").await;
    // Both ends audited: a refusal is recorded as `policy` with who asked.
    let (server_audit, agent_audit) = (
        pki.dir().join("server-audit.log"),
        pki.dir().join("agent-audit.log"),
    );
    let mut server_args = tcp_frontend_args(&pki, "http-connect");
    server_args.push(format!("--audit-log-path={}", server_audit.display()));
    let server = ServerProc::start(bin(), &server_args);
    let agent = AgentProc::start(
        bin(),
        &pki,
        server.agent,
        &[
            format!("--audit-log-path={}", agent_audit.display()),
            format!("--node-ip={node_ip}"),
            format!("--service-cidr={service_ip}/32"),
            format!("--dial-allow={opened_ip}/32:{}", opened.addr.port()),
            format!("--dial-allow=node:{}", node_port.addr.port()),
            // A name rule never reaches a reserved address, whatever the name is.
            format!("--dial-allow=localhost:{}", loopback.addr.port()),
        ],
    );
    let line = agent
        .proc
        .wait_event("dial policy", Duration::from_secs(10), |_| true);
    let allows = line["allows"].as_str().unwrap_or_default().to_string();
    assert!(
        allows.contains(&format!("{service_ip}/32")) && allows.contains("node:"),
        "{line}"
    );
    server.wait_agents(1).await;

    for (target, body) in [
        (node_port.addr.to_string(), "hostNetwork pod"),
        (service.addr.to_string(), "service"),
        (opened.addr.to_string(), "opened"),
    ] {
        let (status, rest) = through(&pki, &server, &target).await;
        assert!(status.contains("200"), "{target}: {status} {rest}");
        assert!(rest.contains(body), "{target}: {rest}");
    }

    let refused = [
        // The LAN, by address: the stolen credential's pivot.
        lan.addr.to_string(),
        // The node itself, on a port nobody allowed.
        node_other.addr.to_string(),
        // The opened subnet on another port.
        format!("{opened_ip}:{}", lan.addr.port()),
        // The node's loopback, by address and through the name rule's name.
        loopback.addr.to_string(),
        format!("localhost:{}", loopback.addr.port()),
    ];
    for target in &refused {
        let (status, rest) = through(&pki, &server, target).await;
        assert!(!status.contains("200"), "{target} was let through: {rest}");
        assert!(
            rest.contains(REFUSED) && rest.contains("--dial-allow"),
            "{target}: {status} {rest}"
        );
        // The caller learns nothing of what a name resolves to on the node.
        if target.starts_with("localhost") {
            assert!(!rest.contains("127.0.0.1"), "{target}: {rest}");
        }
    }
    for b in [&lan, &node_other, &loopback] {
        assert_eq!(
            b.accepted.load(std::sync::atomic::Ordering::Relaxed),
            0,
            "a refused dial never reaches the target"
        );
    }
    assert_eq!(refusals(&agent).await, refused.len() as f64);
    let logged = agent.proc.log_text();
    assert!(
        logged.matches(REFUSED).count() >= refused.len(),
        "each refusal is logged: {logged}"
    );
    // The agent's log says what the name resolved to.
    assert!(logged.contains("(resolved to 127.0.0.1"), "{logged}");

    // The audit: the server's record names who asked (the frontend's certificate and
    // address) and the agent that refused; the agent's its own refusal.
    let lan_address = lan.addr.to_string();
    let server_record = wait_until(
        "the server's policy record",
        Duration::from_secs(30),
        || {
            let found = records(&server_audit)
                .into_iter()
                .find(|r| r["address"] == lan_address.as_str());
            async move { found }
        },
    )
    .await;
    assert_eq!(server_record["event"], "refused", "{server_record}");
    assert_eq!(server_record["reason"], "policy", "{server_record}");
    assert_eq!(
        server_record["frontend"]["transport"], "tcp",
        "{server_record}"
    );
    assert!(
        server_record["frontend"]["subject"].is_string(),
        "{server_record}"
    );
    assert!(server_record["error"]
        .as_str()
        .unwrap_or_default()
        .starts_with(REFUSED));
    let agent_record = wait_until("the agent's policy record", Duration::from_secs(30), || {
        let found = records(&agent_audit)
            .into_iter()
            .find(|r| r["address"] == lan_address.as_str());
        async move { found }
    })
    .await;
    assert_eq!(agent_record["outcome"], "refused", "{agent_record}");
    assert_eq!(agent_record["random"], server_record["random"]);
}

/// Every line of an audit log (none while it is not there).
fn records(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn any_and_an_upstream_command_line_dial_anything_and_say_it_is_unsafe() {
    let pki = Pki::new();
    let lan_link = Node::create();
    let lan = backend::http_on(&lan_link.host_ip, "the LAN\n").await;
    let server = ServerProc::start(bin(), &tcp_frontend_args(&pki, "http-connect"));
    // `--dial-policy=any`, then nothing about the node at all (upstream's flags).
    // (`--dial-timeout` keeps the test kit from allowing loopback for the agent.)
    for args in [
        vec!["--dial-policy=any".to_string()],
        vec!["--dial-timeout=5s".to_string()],
    ] {
        let agent = AgentProc::start(bin(), &pki, server.agent, &args);
        server.wait_agents(1).await;
        let unsafe_line = agent
            .proc
            .log_text()
            .lines()
            .any(|l| l.contains("UNSAFE") && l.contains("dial"));
        assert!(
            unsafe_line,
            "{args:?}: no UNSAFE line:\n{}",
            agent.proc.log_text()
        );
        let (status, rest) = through(&pki, &server, &lan.addr.to_string()).await;
        assert!(
            status.contains("200") && rest.contains("the LAN"),
            "{args:?}: {status} {rest}"
        );
        drop(agent);
        server.wait_agents(0).await;
    }
}

/// The Node object tells the agent its kubelet's address and port and its pod range;
/// kube-apiserver's node and pod proxies go through the tunnel and show a refusal to
/// kubectl.
#[test]
fn the_node_object_sets_the_kubelet_and_pod_range_and_kubectl_shows_refusals() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let _guard = rt.enter();
    // kube-apiserver proxies to no loopback address: the host ends of two veth links
    // stand in for the node's address and a pod's.
    let (node_link, pod_link) = (Node::create(), Node::create());
    let (node_ip, pod_ip) = (node_link.host_ip.as_str(), pod_link.host_ip.as_str());
    let kubelet = rt.block_on(backend::echo_on(node_ip));
    let sshd = rt.block_on(backend::http_on(node_ip, "sshd\n"));
    let pod = rt.block_on(backend::http_on(pod_ip, "pod\n"));

    let pki = Pki::new();
    let frontend = Frontend::GrpcUds;
    let server = ServerProc::start(bin(), &frontend.server_args(&pki));
    let cluster = Cluster::start(&frontend.egress(&pki, &server));
    // A node that has registered but has no pod range yet.
    cluster.apply(&format!(
        r#"apiVersion: v1
kind: Node
metadata:
  name: edge-1
status:
  addresses:
  - type: InternalIP
    address: {node_ip}
  daemonEndpoints:
    kubeletEndpoint:
      Port: {}
"#,
        kubelet.addr.port()
    ));
    // The server listens on every address; the agent dials it on loopback.
    let agent_port = SocketAddr::from(([127, 0, 0, 1], server.agent.port()));
    let agent = AgentProc::start(
        bin(),
        &pki,
        agent_port,
        &[
            "--node-name=edge-1".into(),
            format!("--kubeconfig={}", cluster.files.admin_kubeconfig.display()),
        ],
    );
    agent
        .proc
        .wait_event("dial policy: read the node", Duration::from_secs(30), |v| {
            v["kubelet_port"] == kubelet.addr.port()
        });
    rt.block_on(server.wait_agents(1));

    // kubectl's nodes proxy: the kubelet's port is allowed (kube-apiserver speaks TLS
    // to a kubelet, which this stand-in does not: the dial reaching it is the point),
    // another port of the node is refused, and kubectl shows why.
    let out = cluster.kubectl(&[
        "get",
        "--raw",
        &format!("/api/v1/nodes/http:edge-1:{}/proxy/", kubelet.addr.port()),
        "--request-timeout=30s",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains(REFUSED), "{stderr}");
    assert_eq!(
        kubelet.accepted.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "{stderr}"
    );
    let out = cluster.kubectl(&[
        "get",
        "--raw",
        &format!("/api/v1/nodes/http:edge-1:{}/proxy/", sshd.addr.port()),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains(REFUSED),
        "{stderr}"
    );
    assert_eq!(sshd.accepted.load(std::sync::atomic::Ordering::Relaxed), 0);

    // The node gets its pod range after the agent read it; a pod in it is reached at
    // once (a refused dial reads the Node again first).
    cluster.kubectl_ok(&[
        "patch",
        "node",
        "edge-1",
        "--type=merge",
        "-p",
        &format!(r#"{{"spec":{{"podCIDR":"{pod_ip}/32","podCIDRs":["{pod_ip}/32"]}}}}"#),
    ]);
    cluster.apply(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: default
spec:
  nodeName: edge-1
  containers:
  - name: web
    image: busybox
"#,
    );
    cluster.kubectl_ok(&[
        "patch",
        "pod",
        "web",
        "--subresource=status",
        "--type=merge",
        "-p",
        &format!(r#"{{"status":{{"podIP":"{pod_ip}","podIPs":[{{"ip":"{pod_ip}"}}]}}}}"#),
    ]);
    let out = cluster.kubectl_ok(&[
        "get",
        "--raw",
        &format!(
            "/api/v1/namespaces/default/pods/http:web:{}/proxy/",
            pod.addr.port()
        ),
    ]);
    assert_eq!(out.trim(), "pod");
    assert_eq!(rt.block_on(refusals(&agent)), 1.0);
}

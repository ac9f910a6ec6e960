//! End to end with a real kube-apiserver 1.20.2 + etcd: the apiserver's egress goes
//! through Tether (GRPC over UDS, HTTPConnect over UDS, HTTPConnect over mTLS TCP) to
//! agents in network namespaces. Each node's kubelet (a stand-in) and pods listen on
//! addresses only reachable inside that node's namespace, so every byte that reaches
//! them went through the tunnel.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use tether_testkit::kube::{Cluster, Egress};
use tether_testkit::netns::Node;
use tether_testkit::process::socket_path;
use tether_testkit::{metric, AgentProc, Pki, Proc, ServerProc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_tether");
/// The node agents are the agent-only binary, as the DaemonSet runs them.
const AGENT_BIN: &str = env!("CARGO_BIN_EXE_tether-agent");

fn bin() -> &'static Path {
    Path::new(BIN)
}

#[derive(Clone, Copy, Debug)]
enum Frontend {
    GrpcUds,
    HttpConnectUds,
    HttpConnectTcp,
}

struct SimNode {
    name: String,
    node: Node,
    _kubelet: Proc,
    agent: AgentProc,
}

struct Env {
    cluster: Cluster,
    server: ServerProc,
    nodes: Vec<SimNode>,
    _pki: Pki,
}

/// Server args for `frontend`, agent port on all interfaces (agents are in namespaces).
fn server_args(pki: &Pki, frontend: Frontend) -> Vec<String> {
    let f = &pki.files;
    let mut args = vec![
        "--agent-bind-address=0.0.0.0".to_string(),
        format!("--cluster-cert={}", f.server_cert.display()),
        format!("--cluster-key={}", f.server_key.display()),
        format!("--cluster-ca-cert={}", f.ca_cert.display()),
    ];
    match frontend {
        Frontend::GrpcUds | Frontend::HttpConnectUds => {
            let mode = if matches!(frontend, Frontend::GrpcUds) {
                "grpc"
            } else {
                "http-connect"
            };
            args.extend([
                format!("--mode={mode}"),
                format!("--uds-name={}", socket_path(pki.dir()).display()),
                "--server-port=0".into(),
            ]);
        }
        Frontend::HttpConnectTcp => args.extend([
            "--mode=http-connect".to_string(),
            "--server-port=0".into(),
            "--server-bind-address=127.0.0.1".into(),
            format!("--server-cert={}", f.server_cert.display()),
            format!("--server-key={}", f.server_key.display()),
            format!("--server-ca-cert={}", f.ca_cert.display()),
        ]),
    }
    args
}

fn egress(pki: &Pki, frontend: Frontend, server: &ServerProc) -> Egress {
    let f = &pki.files;
    match frontend {
        Frontend::GrpcUds => Egress::GrpcUds(socket_path(pki.dir())),
        Frontend::HttpConnectUds => Egress::HttpConnectUds(socket_path(pki.dir())),
        Frontend::HttpConnectTcp => Egress::HttpConnectTcp {
            url: format!("https://{}", server.frontend),
            ca: f.ca_cert.clone(),
            cert: f.frontend_cert.clone(),
            key: f.frontend_key.clone(),
        },
    }
}

/// Starts Tether, a cluster egressing through it, and `n` nodes with an agent each.
fn env(frontend: Frontend, n: usize, extra_server: &[&str]) -> Env {
    let nodes: Vec<Node> = (0..n).map(|_| Node::create()).collect();
    let sans: Vec<String> = nodes.iter().map(|n| n.host_ip.clone()).collect();
    let pki = Pki::with_sans(&sans);
    let mut args = server_args(&pki, frontend);
    args.extend(extra_server.iter().map(|s| s.to_string()));
    let server = ServerProc::start(bin(), &args);
    let cluster = Cluster::start(&egress(&pki, frontend, &server));
    let mut sim = Vec::new();
    for (i, node) in nodes.into_iter().enumerate() {
        let name = format!("node-{i}");
        let kubelet = node.start_kubelet(&name, &pki.files.server_cert, &pki.files.server_key);
        let server_addr = format!("{}:{}", node.host_ip, server.agent.port())
            .parse()
            .unwrap();
        let agent = AgentProc::start_in(
            Some(&node),
            Path::new(AGENT_BIN),
            &pki,
            server_addr,
            &[
                format!("--agent-id={name}"),
                format!("--agent-identifiers=host={name}&ipv4={}", node.node_ip),
                format!("--health-server-host={}", node.link_ip),
            ],
        );
        cluster.add_node(&name, &node.node_ip);
        cluster.add_pod(&format!("pod-{i}"), &name, &node.pod_ip);
        sim.push(SimNode {
            name,
            node,
            _kubelet: kubelet,
            agent,
        });
    }
    Env {
        cluster,
        server,
        nodes: sim,
        _pki: pki,
    }
}

fn follow_logs(cluster: &Cluster, pod: &str, lines: usize) -> Vec<String> {
    let mut child = Command::new("kubectl")
        .arg(format!(
            "--kubeconfig={}",
            cluster.files.admin_kubeconfig.display()
        ))
        .args(["logs", "-f", pod])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let got: Vec<String> = out.lines().take(lines).map(|l| l.unwrap()).collect();
    let _ = child.kill();
    let _ = child.wait();
    got
}

/// An exec- or portforward-style upgraded connection through the apiserver to the
/// kubelet, carrying bytes both ways for a while, then closed cleanly.
async fn upgraded_roundtrips(cluster: &Cluster, path: &str) {
    let f = &cluster.files;
    let tls = tether_core::tls::client_config(
        &f.ca,
        Some((&f.admin_cert, &f.admin_key)),
        &[tether_core::tls::ALPN_HTTP11],
    )
    .unwrap();
    let addr: std::net::SocketAddr = cluster.url.trim_start_matches("https://").parse().unwrap();
    let mut s = tether_testkit::tls_connect(addr, tls).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: Upgrade\r\nUpgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\nContent-Length: 0\r\n\r\n"
    );
    let head = tether_testkit::request_head(&mut s, req.as_bytes())
        .await
        .unwrap();
    assert!(head.starts_with("HTTP/1.1 101"), "{path}: {head}");
    for i in 0..50 {
        let msg = format!("frame {i} through the tunnel;");
        s.write_all(msg.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; msg.len()];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(buf, msg.as_bytes());
    }
    s.shutdown().await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
}

async fn every_path_through_the_tunnel(frontend: Frontend) {
    let e = env(frontend, 1, &[]);
    e.server.wait_agents(1).await;
    let c = &e.cluster;
    let node = &e.nodes[0];

    // The kubelet's address is unreachable from here: only the tunnel gets there.
    let direct = tokio::net::TcpStream::connect(format!("{}:10250", node.node.node_ip)).await;
    assert!(direct.is_err(), "kubelet reachable without the tunnel");

    // kubectl logs.
    let logs = c.kubectl_ok(&["logs", "pod-0"]);
    assert_eq!(
        logs,
        "log line 1 from node-0\nlog line 2 from node-0\nlog line 3 from node-0\n"
    );

    // kubectl logs -f, streaming for a while.
    let lines = follow_logs(c, "pod-0", 40);
    assert_eq!(lines.len(), 40);
    assert_eq!(lines[39], "log line 40 from node-0");

    // nodes/proxy, pods/proxy, services/proxy (the apiserver only proxies to service
    // endpoints that reference a pod with that IP).
    let out = c.kubectl_ok(&["get", "--raw", "/api/v1/nodes/node-0/proxy/healthz"]);
    assert_eq!(out, "kubelet node-0: /healthz\n");
    let out = c.kubectl_ok(&[
        "get",
        "--raw",
        "/api/v1/namespaces/default/pods/pod-0:8080/proxy/hello",
    ]);
    assert_eq!(out, "pod node-0: /hello\n");
    c.apply(&format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: svc-0\n  namespace: default\nspec:\n  ports:\n  - name: http\n    port: 8080\n    targetPort: 8080\n---\napiVersion: v1\nkind: Endpoints\nmetadata:\n  name: svc-0\n  namespace: default\nsubsets:\n- addresses:\n  - ip: {}\n    targetRef:\n      kind: Pod\n      name: pod-0\n      namespace: default\n  ports:\n  - name: http\n    port: 8080\n",
        node.node.pod_ip
    ));
    let out = c.kubectl_ok(&[
        "get",
        "--raw",
        "/api/v1/namespaces/default/services/svc-0:http/proxy/hi",
    ]);
    assert_eq!(out, "pod node-0: /hi\n");

    // exec and port-forward style upgrades.
    upgraded_roundtrips(c, "/api/v1/namespaces/default/pods/pod-0/exec?command=cat&stdin=true&stdout=true&container=app").await;
    upgraded_roundtrips(c, "/api/v1/namespaces/default/pods/pod-0/portforward").await;
    e.nodes[0]
        ._kubelet
        .wait_event("upgrade closed", Duration::from_secs(10), |_| true);

    // Every connection was closed again.
    e.server
        .wait_metric(
            "konnectivity_network_proxy_server_established_connections",
            0.0,
        )
        .await;
    // logs, logs -f, three proxies, exec, port-forward: every one dialled by the agent.
    let page = node.agent.metrics().await;
    assert!(
        metric(
            &page,
            "konnectivity_network_proxy_agent_dial_duration_seconds_count"
        )
        .unwrap()
            >= 7.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpc_over_uds() {
    every_path_through_the_tunnel(Frontend::GrpcUds).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_connect_over_uds() {
    every_path_through_the_tunnel(Frontend::HttpConnectUds).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_connect_over_mtls_tcp() {
    every_path_through_the_tunnel(Frontend::HttpConnectTcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_dest_host_reaches_each_nodes_agent() {
    let e = env(
        Frontend::GrpcUds,
        2,
        &["--proxy-strategies=destHost,default"],
    );
    e.server.wait_agents(2).await;
    for round in 0..5 {
        for (i, n) in e.nodes.iter().enumerate() {
            let logs = e.cluster.kubectl_ok(&["logs", &format!("pod-{i}")]);
            assert!(
                logs.contains(&format!("from {}", n.name)),
                "round {round}: {logs}"
            );
        }
    }
    for n in &e.nodes {
        let page = n.agent.metrics().await;
        assert_eq!(
            metric(
                &page,
                "konnectivity_network_proxy_agent_dial_duration_seconds_count"
            ),
            Some(5.0)
        );
    }
}

//! The compromised node: a hand-written agent holding one node's valid credentials (its
//! certificate from `tether certs agent`, or its pod-bound ServiceAccount token) tries
//! to take another node's traffic, against servers in their default configuration and
//! with the flags of the manifests in deploy/, its streams over HTTP/2, over WebSocket
//! and over QUIC (`--transports`). Each test names the threat it closes
//! (docs/threat-model.md lists them).

use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tether_client::Client;
use tether_proto::{packet::Payload, Packet};
use tether_testkit::backend;
use tether_testkit::kube::{free_udp_port, Cluster, Egress};
use tether_testkit::process::{frontend_cas_command, socket_path, uds_frontend_args};
use tether_testkit::rogue::{
    certified_agent, forged_packets_reach_no_tunnel, manifest_agent_identifiers,
    manifest_server_args, node_cert, ping, wait_verified_ips, Over, Rogue, ROGUE,
};
use tether_testkit::{metric, AgentProc, Pki, ServerProc, TempDir};
use tokio::io::AsyncReadExt;

const BIN: &str = env!("CARGO_BIN_EXE_tether");

/// A server as `tether certs` and the shipped defaults make it: agents by per-node
/// certificates, the gRPC frontend on a socket, the deploy manifest's strategies.
fn certificate_server(pki: &Pki, extra: &[&str]) -> ServerProc {
    let mut args = uds_frontend_args(pki, "grpc", &socket_path(pki.dir()));
    args.push("--proxy-strategies=destHost,destCIDR,default".into());
    args.push(format!("--agent-quic-port={}", free_udp_port()));
    args.extend(extra.iter().map(|s| s.to_string()));
    ServerProc::start(Path::new(BIN), &args)
}

/// Node-b (127.0.0.2): its kubelet (an echo server) and its agent, connected with its
/// own certificate to a [`certificate_server`] with `extra`; and node-a's certificate
/// (127.0.0.3), which the attacker holds.
struct NodeB {
    pki: Pki,
    cert_a: (std::path::PathBuf, std::path::PathBuf),
    kubelet_b: backend::Backend,
    server: ServerProc,
    _agent: AgentProc,
    _certs: TempDir,
}

async fn node_b_beside_an_attacker(extra: &[&str]) -> NodeB {
    let pki = Pki::new();
    let certs = TempDir::new("tether-node-certs");
    let cert_a = node_cert(Path::new(BIN), &pki, certs.path(), "node-a", "127.0.0.3");
    let cert_b = node_cert(Path::new(BIN), &pki, certs.path(), "node-b", "127.0.0.2");
    let kubelet_b = backend::echo_on("127.0.0.2").await;
    let server = certificate_server(&pki, extra);
    let agent = certified_agent(
        Path::new(BIN),
        &pki,
        &server,
        "node-b",
        "127.0.0.2",
        &cert_b,
    );
    server.wait_agents(1).await;
    NodeB {
        pki,
        cert_a,
        kubelet_b,
        server,
        _agent: agent,
        _certs: certs,
    }
}

/// Threats 1 and 4 with certificates: node-a's certificate claiming node-b's name and
/// address on fifty streams gets none of node-b's dials, no more than eight streams,
/// and no more than one agent's share of the dials any agent may take.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_certificate_cannot_take_another_nodes_traffic() {
    certificate_cannot_take(Over::H2).await;
}

/// [`a_node_certificate_cannot_take_another_nodes_traffic`] with the attacker's streams over WebSocket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_certificate_cannot_take_another_nodes_traffic_over_websocket() {
    certificate_cannot_take(Over::WebSocket).await;
}

/// [`a_node_certificate_cannot_take_another_nodes_traffic`] with the attacker's streams over QUIC.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_certificate_cannot_take_another_nodes_traffic_over_quic() {
    certificate_cannot_take(Over::Quic).await;
}

async fn certificate_cannot_take(over: Over) {
    let NodeB {
        pki,
        cert_a,
        kubelet_b,
        server,
        // Bound, not `..`: they live to the end of the test.
        _agent,
        _certs,
    } = node_b_beside_an_attacker(&[]).await;
    let elsewhere = backend::echo().await;

    let rogue = Rogue::connect_over(
        over,
        &pki,
        over.agent_port(&server),
        Some((&cert_a.0, &cert_a.1)),
    )
    .await;
    let (streams, refused) = rogue
        .open_many(50, "node-b", "host=node-b&ipv4=127.0.0.2", None)
        .await;
    assert_eq!(
        streams.len(),
        8,
        "--max-agent-streams' default per verified identity"
    );
    assert!(
        refused.iter().all(|c| *c == tonic::Code::ResourceExhausted),
        "{refused:?}"
    );
    server.wait_agents(9).await;

    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let kubelet = kubelet_b.addr.to_string();
    for _ in 0..20 {
        assert_eq!(
            ping(&client, &kubelet).await,
            b"ping",
            "node-b's dial reached node-b"
        );
    }
    assert_eq!(
        rogue.dials.load(Ordering::SeqCst),
        0,
        "no destHost dial reached the attacker"
    );

    // Dials any agent may take (the `default` strategy): node-a's eight streams are one
    // agent's share, not eight of nine.
    let (mut evil, mut dials) = (0, 0);
    while dials < 40 {
        dials += 1;
        if ping(&client, &elsewhere.addr.to_string()).await == ROGUE {
            evil += 1;
        }
    }
    assert!(evil <= 31, "the attacker took {evil} of 40 default dials");

    let page = server.metrics().await;
    let count = |name: &str| metric(&page, name).unwrap_or(0.0);
    // Over HTTP/2 the streams share a connection and the router refuses them; over
    // WebSocket each is a connection of its own, refused by the identity's cap.
    assert_eq!(
        count(r#"tether_server_agent_streams_refused_total{reason="too_many_streams"}"#)
            + count(r#"tether_server_agent_streams_refused_total{reason="too_many_connections"}"#),
        42.0
    );
    assert!(count(r#"tether_server_unverified_identifiers_total{kind="ip"}"#) >= 8.0);
    assert!(server
        .proc
        .logged("agent claims identifiers the server could not verify"));
    let (_, agents) = tether_testkit::http_get(server.admin, "/agents")
        .await
        .unwrap();
    let agents: serde_json::Value = serde_json::from_str(&agents).unwrap();
    let b = agents["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == "node-b" && a["verifiedBy"] == "certificate")
        .cloned();
    assert!(
        b.is_some_and(|b| b["verifiedIps"] == serde_json::json!(["127.0.0.2"])),
        "{agents}"
    );
    drop(streams);
}

/// The holds: forged DATA, CLOSE_RSP, DIAL_RSP and WINDOW_UPDATE for another agent's
/// connection IDs reach nothing, because tunnels are tracked per agent stream; and
/// `--require-agent-identity-match` refuses the impostor outright.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forged_packets_reach_no_other_agents_tunnels() {
    forged_packets(Over::H2).await;
}

/// [`forged_packets_reach_no_other_agents_tunnels`] with the attacker's streams over WebSocket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forged_packets_reach_no_other_agents_tunnels_over_websocket() {
    forged_packets(Over::WebSocket).await;
}

/// [`forged_packets_reach_no_other_agents_tunnels`] with the attacker's streams over QUIC.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forged_packets_reach_no_other_agents_tunnels_over_quic() {
    forged_packets(Over::Quic).await;
}

async fn forged_packets(over: Over) {
    let NodeB {
        pki,
        cert_a,
        kubelet_b,
        server,
        // Bound, not `..`: they live to the end of the test.
        _agent,
        _certs,
    } = node_b_beside_an_attacker(&["--require-agent-identity-match"]).await;

    let rogue = Rogue::connect_over(
        over,
        &pki,
        over.agent_port(&server),
        Some((&cert_a.0, &cert_a.1)),
    )
    .await;
    let refused = rogue.open("node-b", "host=node-b", None).await.err();
    assert_eq!(
        refused.map(|s| s.code()),
        Some(tonic::Code::PermissionDenied)
    );
    let own = rogue
        .open("node-a", "host=node-a&ipv4=127.0.0.3", None)
        .await
        .unwrap();
    server.wait_agents(2).await;

    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    // The forgeries are all read before a dial's answer on the same stream: the
    // server handled them, and the victim's tunnel still carries exactly its bytes.
    let victim = kubelet_b.addr.to_string();
    forged_packets_reach_no_tunnel(&client, &own, &victim, "127.0.0.3:9", 64).await;
}

/// Threat 6: a dial the agent never answers fails on the gRPC frontend within the
/// documented 30 s backstop, though `--backend-dial-timeout` is not set.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dial_no_agent_answers_fails_on_the_grpc_frontend() {
    unanswered_dial(Over::H2).await;
}

/// [`a_dial_no_agent_answers_fails_on_the_grpc_frontend`] with the attacker's streams over WebSocket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dial_no_agent_answers_fails_on_the_grpc_frontend_over_websocket() {
    unanswered_dial(Over::WebSocket).await;
}

/// [`a_dial_no_agent_answers_fails_on_the_grpc_frontend`] with the attacker's streams over QUIC.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dial_no_agent_answers_fails_on_the_grpc_frontend_over_quic() {
    unanswered_dial(Over::Quic).await;
}

async fn unanswered_dial(over: Over) {
    let pki = Pki::new();
    let certs = TempDir::new("tether-node-certs");
    let cert_a = node_cert(Path::new(BIN), &pki, certs.path(), "node-a", "127.0.0.3");
    let server = certificate_server(&pki, &[]);
    let mut rogue = Rogue::connect_over(
        over,
        &pki,
        over.agent_port(&server),
        Some((&cert_a.0, &cert_a.1)),
    )
    .await;
    rogue.silent = true;
    let _stream = rogue.open("node-a", "", None).await.unwrap();
    server.wait_agents(1).await;
    // A raw Proxy stream (kube-apiserver's own client waits as long as the server).
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let (mut send, mut inbound) = client.open_stream().await.unwrap();
    let started = std::time::Instant::now();
    send.send(Packet::dial_request("tcp", "127.0.0.1:9", 77))
        .await
        .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(90), inbound.message())
        .await
        .expect("the server answered within 90 s")
        .unwrap()
        .expect("a packet");
    let Some(Payload::DialResponse(rsp)) = answer.payload else {
        panic!("expected DIAL_RSP, got {answer:?}");
    };
    assert_eq!(rsp.random, 77);
    assert!(rsp.error.contains("dial timeout"), "{rsp:?}");
    assert!(
        started.elapsed() >= Duration::from_secs(29),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(rogue.dials.load(Ordering::SeqCst), 1);
    let page = server.metrics().await;
    assert_eq!(
        metric(
            &page,
            r#"konnectivity_network_proxy_server_dial_failure_count{reason="backend_dial_timeout"}"#
        ),
        Some(1.0)
    );
}

/// Threat 3: an agent certificate never opens frontend tunnels. A TCP frontend that
/// would trust the agents' CA does not start; with `tether certs`' own frontend CA an
/// agent certificate fails the handshake, and the apiserver's client certificate works.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_certificate_opens_no_frontend_tunnel() {
    let pki = Pki::new();
    let f = &pki.files;
    let shared = frontend_cas_command(Path::new(BIN), &pki, &f.ca_cert, &f.ca_cert)
        .output()
        .unwrap();
    assert_eq!(shared.status.code(), Some(1));
    let err = String::from_utf8_lossy(&shared.stderr);
    assert!(
        err.contains("share the CA") && err.contains("--frontend-client-names"),
        "{err}"
    );

    let server = ServerProc::start(
        Path::new(BIN),
        &tether_testkit::process::tcp_frontend_args(&pki, "http-connect"),
    );
    let _agent = AgentProc::start(Path::new(BIN), &pki, server.agent, &[]);
    server.wait_agents(1).await;
    let target = backend::echo().await;
    let frontend: std::net::SocketAddr = server.frontend.parse().unwrap();
    let connect = format!(
        "CONNECT {} HTTP/1.1\r\nHost: {}\r\n\r\n",
        target.addr, target.addr
    );
    let agent_tls = tether_core::tls::client_config(
        &f.ca_cert,
        Some((&f.agent_cert, &f.agent_key)),
        &[b"http/1.1"],
    )
    .unwrap();
    let with_agent_cert = async {
        let mut tls = tether_testkit::tls_connect(frontend, agent_tls)
            .await
            .ok()?;
        let head = tether_testkit::request_head(&mut tls, connect.as_bytes())
            .await
            .ok()?;
        Some(head)
    };
    let head = with_agent_cert.await;
    assert!(
        head.as_deref()
            .is_none_or(|h| !h.starts_with("HTTP/1.1 200")),
        "an agent certificate opened a tunnel: {head:?}"
    );
    let mut tls = tether_testkit::tls_connect(frontend, pki.frontend_http_tls())
        .await
        .unwrap();
    let head = tether_testkit::request_head(&mut tls, connect.as_bytes())
        .await
        .unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}

/// Threat 5: 20,000 idle connections from one address (four processes, as a flood
/// would come) take neither the descriptors nor the handshake slots a real agent needs:
/// it connects and carries a dial while they are open.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_flood_does_not_lock_agents_out() {
    let pki = Pki::new();
    let args = uds_frontend_args(&pki, "grpc", &socket_path(pki.dir()));
    // Far fewer descriptors than the flood has connections.
    let server = ServerProc::start_with_open_files(Path::new(BIN), &args, (4096, 4096));
    let port = server.agent.port();
    let flood = r#"
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(n):
    s = socket.socket()
    s.bind(("127.0.0.2", 0))
    s.connect(("127.0.0.1", port))
    held.append(s)
print("connected", flush=True)
sys.stdin.read()
"#;
    let mut floods = Vec::new();
    for _ in 0..4 {
        floods.push(
            Command::new("python3")
                .args(["-c", flood, &port.to_string(), "5000"])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
    }
    for child in &mut floods {
        use std::io::BufRead;
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "connected", "the flood could not connect");
    }
    let target = backend::echo().await;
    let _agent = AgentProc::start(Path::new(BIN), &pki, server.agent, &[]);
    server.wait_agents(1).await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    assert_eq!(ping(&client, &target.addr.to_string()).await, b"ping");
    server
        .wait_refused("agent", &["per_source"], 10_000.0, Duration::from_secs(30))
        .await;
    for mut child in floods {
        drop(child.stdin.take());
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Threats 1, 2 and 4 with the shipped token authentication: an agent whose pod-bound
/// token proves node edge-2 claims edge-1's name and address. The server verifies
/// edge-1's real agent by its token and edge-1's Node object, routes every dial for
/// edge-1 to it, and holds the impostor to one node's eight streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_token_cannot_take_another_nodes_traffic() {
    token_cannot_take(Over::H2).await;
}

/// [`a_node_token_cannot_take_another_nodes_traffic`] with the attacker's streams over WebSocket.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_token_cannot_take_another_nodes_traffic_over_websocket() {
    token_cannot_take(Over::WebSocket).await;
}

/// [`a_node_token_cannot_take_another_nodes_traffic`] with the attacker's streams over QUIC.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_token_cannot_take_another_nodes_traffic_over_quic() {
    token_cannot_take(Over::Quic).await;
}

async fn token_cannot_take(over: Over) {
    let cluster = Cluster::start(&Egress::Direct);
    cluster.apply_shipped_rbac();
    for (node, ip) in [("edge-1", "127.0.0.2"), ("edge-2", "127.0.0.3")] {
        cluster.apply(&format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {node}\nspec:\n  podCIDR: 10.244.{n}.0/24\n  podCIDRs: [10.244.{n}.0/24]\n",
            n = &ip[8..]
        ));
        cluster.patch_node_status(
            node,
            &format!(r#"{{"addresses":[{{"type":"InternalIP","address":"{ip}"}}]}}"#),
        );
    }
    let pki = Pki::new();
    let kubelet_1 = backend::echo_on("127.0.0.2").await;
    let mut args = manifest_server_args(&pki, &cluster.files.server_kubeconfig);
    args.push(format!("--agent-quic-port={}", free_udp_port()));
    let server = ServerProc::start(Path::new(BIN), &args);
    let tokens = TempDir::new("tether-tokens");
    let token_1 = cluster.pod_bound_agent_token("konnectivity-agent-edge-1", "edge-1");
    let _edge_1 = AgentProc::start_with_token(
        Path::new(BIN),
        &pki,
        server.agent,
        tokens.path(),
        "edge-1",
        &token_1,
        &[format!(
            "--agent-identifiers={}",
            manifest_agent_identifiers("edge-1", "127.0.0.2")
        )],
    );
    // The server knows edge-1's address from its Node object.
    wait_verified_ips(&server, "edge-1", serde_json::json!(["127.0.0.2"])).await;

    let token_2 = cluster.pod_bound_agent_token("konnectivity-agent-edge-2", "edge-2");
    let rogue = Rogue::connect_over(over, &pki, over.agent_port(&server), None).await;
    let (streams, refused) = rogue
        .open_many(
            50,
            "edge-1",
            "host=edge-1&ipv4=127.0.0.2&cidr=10.244.2.0/24",
            Some(&token_2),
        )
        .await;
    assert_eq!(streams.len(), 8, "{refused:?}");
    server.wait_agents(9).await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    for _ in 0..20 {
        assert_eq!(ping(&client, &kubelet_1.addr.to_string()).await, b"ping");
    }
    assert_eq!(rogue.dials.load(Ordering::SeqCst), 0);
    let page = server.metrics().await;
    assert!(
        metric(
            &page,
            r#"tether_server_unverified_identifiers_total{kind="ip"}"#
        )
        .unwrap_or(0.0)
            >= 8.0
    );

    // edge-2's kubelet (the attacker is root there) lists edge-1's address on its own
    // Node. The address then verifies neither agent, and a dial to it fails rather than
    // fall back to `default`, where the attacker could take it.
    cluster.patch_node_status(
        "edge-2",
        r#"{"addresses":[{"type":"InternalIP","address":"127.0.0.3"},{"type":"InternalIP","address":"127.0.0.2"}]}"#,
    );
    wait_verified_ips(&server, "edge-1", serde_json::json!([])).await;
    let refused = client.dial(&kubelet_1.addr.to_string()).await.err();
    assert!(
        refused
            .as_ref()
            .is_some_and(|e| e.to_string().contains("No agent available")),
        "{refused:?}"
    );
    assert_eq!(rogue.dials.load(Ordering::SeqCst), 0);
    assert!(server.proc.logged("several Nodes list the same address"));

    // Without a token nothing is admitted; and since anyone finishes TLS on a token
    // server's agent port, a connection on which no agent is admitted is closed.
    let anonymous = Rogue::connect_over(over, &pki, over.agent_port(&server), None).await;
    let refused = anonymous.open("edge-1", "host=edge-1", None).await.err();
    assert_eq!(
        refused.map(|s| s.code()),
        Some(tonic::Code::Unauthenticated)
    );
    let tls = tether_core::tls::client_config(&pki.files.ca_cert, None, &[b"h2"]).unwrap();
    let idle = tether_testkit::tls_connect(server.agent, tls)
        .await
        .unwrap();
    let (_send, connection) = h2::client::handshake(idle).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), connection)
        .await
        .expect("a connection with no agent admitted is closed within 30 s")
        .ok();
    if over == Over::Quic {
        use tether_core::quic;
        let at = over.agent_port(&server);
        let tls = tether_core::tls::client_config(&pki.files.ca_cert, None, &[]).unwrap();
        let transport =
            quic::transport_config(Duration::from_secs(5), Duration::from_secs(60), false);
        let config = quic::client_config(&tls, transport).unwrap();
        let endpoint = quic::client_endpoint(at).unwrap();
        let idle = endpoint
            .connect_with(config, at, "127.0.0.1")
            .unwrap()
            .await
            .expect("anyone finishes the QUIC handshake on a token server");
        tokio::time::timeout(Duration::from_secs(30), idle.closed())
            .await
            .expect("a QUIC connection with no agent admitted is closed within 30 s");
    }
    drop(streams);
}

/// Threat 5, the slow kind: a client that never finishes its TLS handshake, or
/// finishes it and never opens an agent stream (any client can, where agents use
/// tokens), is closed within seconds, and holds no slot after.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_connections_are_closed() {
    let pki = Pki::new();
    let server = certificate_server(&pki, &[]);
    let mut silent = tokio::net::TcpStream::connect(server.agent).await.unwrap();
    let f = &pki.files;
    let tls =
        tether_core::tls::client_config(&f.ca_cert, Some((&f.agent_cert, &f.agent_key)), &[b"h2"])
            .unwrap();
    // TLS and HTTP/2 done, and then no agent stream.
    let idle = tether_testkit::tls_connect(server.agent, tls)
        .await
        .unwrap();
    let (_send, connection) = h2::client::handshake(idle).await.unwrap();
    let connection = tokio::spawn(connection);
    let closed = |n: std::io::Result<usize>| matches!(n, Ok(0) | Err(_));
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(30), silent.read(&mut buf));
    assert!(
        closed(read.await.expect("closed within 30 s")),
        "no handshake"
    );
    tokio::time::timeout(Duration::from_secs(30), connection)
        .await
        .expect("a connection with no agent stream is closed within 30 s")
        .unwrap()
        .ok();
    assert_one_unadmitted(&server).await;
}

/// The server counted one connection closed with no agent stream admitted.
async fn assert_one_unadmitted(server: &ServerProc) {
    let page = server.metrics().await;
    assert_eq!(
        metric(
            &page,
            r#"tether_server_connections_refused_total{listener="agent",reason="unadmitted"}"#
        ),
        Some(1.0)
    );
}

/// The same over HTTP/1.1: a client that finishes TLS with ALPN `http/1.1` and sends
/// half an upgrade request (or a request head that never ends) holds its connection no
/// longer than one with no agent stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn half_an_upgrade_request_is_closed() {
    use tokio::io::AsyncWriteExt;
    let pki = Pki::new();
    let server = certificate_server(&pki, &[]);
    let f = &pki.files;
    let tls = tether_core::tls::client_config(
        &f.ca_cert,
        Some((&f.agent_cert, &f.agent_key)),
        &[tether_core::tls::ALPN_HTTP11],
    )
    .unwrap();
    let mut slow = tether_testkit::tls_connect(server.agent, tls)
        .await
        .unwrap();
    slow.write_all(b"GET /AgentService/Connect HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n")
        .await
        .unwrap();
    slow.flush().await.unwrap();
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_secs(30), slow.read(&mut buf));
    let n = read.await.expect("closed within 30 s");
    assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
    assert_one_unadmitted(&server).await;
}

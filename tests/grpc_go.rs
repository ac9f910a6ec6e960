//! The agent link against grpc-go, the gRPC library upstream's proxy-agent and
//! proxy-server are built on: `tether-grpc-go-peer` (our test double, built by
//! `scripts/install-kube.sh` against the grpc-go v1.27.1 that Kubernetes 1.20 vendors)
//! plays an upstream agent to a Tether server and an upstream server to a Tether agent,
//! with upstream's grpc-go options (mutual TLS, keepalive, the server's ping policy).
//! Bulk traffic both ways checks HTTP/2 flow control between the two implementations;
//! the rest checks what an operator mixing images meets: reconnects after a restart,
//! dial errors, a stalled client, DRAIN, and a keepalive shorter than the server's
//! ping policy.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use futures::future::join_all;
use tether_client::Client;
use tether_testkit::backend::{self, bulk_exchange};
use tether_testkit::kube::{free_port, require_grpc_go_peer};
use tether_testkit::process::{socket_path, uds_frontend_args, START_TIMEOUT};
use tether_testkit::{AgentProc, Pki, Proc, ServerProc};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

const BIN: &str = env!("CARGO_BIN_EXE_tether");

/// How long bulk exchanges may take (they need a few seconds at most).
const BULK_DEADLINE: Duration = Duration::from_secs(60);

/// The peer in agent mode against `server`, with the PKI's agent certificate.
fn go_agent(pki: &Pki, server: SocketAddr, args: &[&str]) -> Proc {
    let f = &pki.files;
    let mut all = vec![
        "agent".to_string(),
        format!("--server={server}"),
        format!("--ca={}", f.ca_cert.display()),
        format!("--cert={}", f.agent_cert.display()),
        format!("--key={}", f.agent_key.display()),
    ];
    all.extend(args.iter().map(|a| a.to_string()));
    Proc::spawn("grpc-go-agent", &require_grpc_go_peer(), &all)
}

/// The peer in server mode, forwarding its frontend port to `target`.
struct GoServer {
    proc: Proc,
    agent: SocketAddr,
    frontend: SocketAddr,
}

fn go_server(pki: &Pki, target: SocketAddr, args: &[&str]) -> GoServer {
    let f = &pki.files;
    let mut all = vec![
        "server".to_string(),
        format!("--ca={}", f.ca_cert.display()),
        format!("--cert={}", f.server_cert.display()),
        format!("--key={}", f.server_key.display()),
        format!("--target={target}"),
    ];
    all.extend(args.iter().map(|a| a.to_string()));
    let proc = Proc::spawn("grpc-go-server", &require_grpc_go_peer(), &all);
    let ev = proc.wait_event("listening", START_TIMEOUT, |_| true);
    let addr = |k: &str| ev[k].as_str().unwrap().parse().unwrap();
    GoServer {
        agent: addr("agent"),
        frontend: addr("frontend"),
        proc,
    }
}

/// `n` concurrent bulk exchanges of `size` bytes each way over connections `open`
/// makes; all must finish intact.
async fn bulk_all<C, F, Fut>(n: u64, size: u64, open: F)
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = C>,
{
    let runs = (0..n).map(|i| {
        let conn = open();
        async move { bulk_exchange(conn.await, 10 + i, 20 + i, size, async {}).await }
    });
    let results = tokio::time::timeout(BULK_DEADLINE, join_all(runs))
        .await
        .expect("bulk exchanges finish");
    for r in results {
        r.expect("bulk exchange intact");
    }
}

fn tether_server(pki: &Pki, agent_port: u16) -> ServerProc {
    let mut args = uds_frontend_args(pki, "grpc", &socket_path(pki.dir()));
    args.extend([
        format!("--agent-port={agent_port}"),
        "--stalled-reader-timeout=2s".to_string(),
    ]);
    ServerProc::start(Path::new(BIN), &args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_grpc_go_agent_works_with_a_tether_server() {
    let pki = Pki::new();
    let agent_port = free_port();
    let server = tether_server(&pki, agent_port);
    let agent = go_agent(&pki, server.agent, &["--agent-identifiers=host=node-a"]);
    agent.wait_event("connected", START_TIMEOUT, |_| true);
    server.wait_agents(1).await;
    let ev = server
        .proc
        .wait_event("agent connected", START_TIMEOUT, |_| true);
    assert_eq!(ev["agent_id"], "grpc-go-agent", "{ev}");
    assert_eq!(
        ev["flow_control"], false,
        "grpc-go agents offer no credit: {ev}"
    );
    assert!(
        ev["identifiers"].as_str().unwrap().contains("node-a"),
        "{ev}"
    );

    let bulk = backend::bulk().await;
    let target = bulk.addr.to_string();
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();

    // Flow control between h2 and grpc-go, both ways, several streams at once.
    bulk_all(4, 16 << 20, || async {
        client.dial(&target).await.unwrap()
    })
    .await;

    // A refused dial is an error to that caller only.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let started = Instant::now();
    assert!(client.dial(&closed).await.is_err(), "dial to a closed port");
    assert!(started.elapsed() < Duration::from_secs(10));
    agent.wait_event("dial failed", START_TIMEOUT, |_| true);

    // A client that stops reading is closed after --stalled-reader-timeout (the
    // grpc-go agent cannot be asked to pause one connection); the others keep going.
    let (open_gate, gate) = oneshot::channel::<()>();
    let stalled = {
        let conn = client.dial(&target).await.unwrap();
        tokio::spawn(bulk_exchange(conn, 7, 8, 256 << 20, async {
            let _ = gate.await;
        }))
    };
    bulk_all(4, 8 << 20, || async { client.dial(&target).await.unwrap() }).await;
    server.proc.wait_event(
        "client stopped reading; closing the connection (--stalled-reader-timeout)",
        Duration::from_secs(30),
        |_| true,
    );
    open_gate.send(()).unwrap();
    let result = tokio::time::timeout(BULK_DEADLINE, stalled)
        .await
        .expect("the stalled connection ends")
        .unwrap();
    assert!(
        result.is_err(),
        "a closed connection must not look complete"
    );

    // Every connection closed on both ends: the agent answered each CLOSE_REQ.
    server
        .wait_metric(
            "konnectivity_network_proxy_server_established_connections",
            0.0,
        )
        .await;
    drop(client);

    // The server restarts on the same port: the grpc-go agent comes back and carries
    // traffic again.
    let mut server = server;
    server.proc.kill();
    agent.wait_event("stream ended", START_TIMEOUT, |_| true);
    let server = tether_server(&pki, agent_port);
    server.wait_agents(1).await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    bulk_all(2, 1 << 20, || async { client.dial(&target).await.unwrap() }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tether_agent_works_with_a_grpc_go_server() {
    let pki = Pki::new();
    let bulk = backend::bulk().await;
    let go = go_server(&pki, bulk.addr, &[]);
    let mut agent = AgentProc::start(
        Path::new(BIN),
        &pki,
        go.agent,
        &[
            "--agent-id=node-b".into(),
            "--agent-identifiers=host=node-b&ipv4=10.0.0.2".into(),
        ],
    );
    let ev = go
        .proc
        .wait_event("agent connected", START_TIMEOUT, |_| true);
    assert_eq!(ev["agentID"], "node-b", "{ev}");
    assert_eq!(ev["agentIdentifiers"], "host=node-b&ipv4=10.0.0.2", "{ev}");
    let ev = agent
        .proc
        .wait_event("connected to proxy server", START_TIMEOUT, |_| true);
    assert_eq!(ev["server_id"], "grpc-go-server", "{ev}");
    assert_eq!(ev["server_count"], 1, "{ev}");
    assert_eq!(
        ev["flow_control"], false,
        "grpc-go servers ignore the offer: {ev}"
    );

    let frontend = go.frontend;
    bulk_all(4, 16 << 20, || async move {
        TcpStream::connect(frontend).await.unwrap()
    })
    .await;

    // SIGTERM: DRAIN reaches the grpc-go server; the draining agent stays until a
    // second signal (or --drain-timeout), as upstream's does.
    agent.proc.signal("TERM");
    go.proc.wait_event("agent draining", START_TIMEOUT, |ev| {
        ev["agentID"] == "node-b"
    });
    agent.proc.signal("TERM");
    agent.proc.exits_cleanly(
        Duration::from_secs(20),
        "the agent exits on a second signal",
    );
    assert!(!go.proc.logged("ignored packet"), "{}", go.proc.log_text());
}

/// With `--keepalive-time` shorter than a grpc-go server's ping policy, the server
/// sends GOAWAY ENHANCE_YOUR_CALM (`too_many_pings`). Like a grpc-go client (the
/// upstream agent), the agent doubles its keepalive interval each time until the
/// server is content, instead of being disconnected over and over. The policy here is
/// 1.5 s (upstream's proxy-server enforces 30 s) so the test is short; 1 s pings break
/// it, 2 s pings keep to it with room for a loaded machine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keepalive_shorter_than_a_grpc_go_servers_policy_backs_off() {
    const CALM: &str = "the proxy server closed the connection for pinging too often (GOAWAY ENHANCE_YOUR_CALM); doubling the keepalive interval (--keepalive-time is shorter than the server's ping policy)";
    let pki = Pki::new();
    let bulk = backend::bulk().await;
    let go = go_server(&pki, bulk.addr, &["--min-ping-interval=1500ms"]);
    let agent = AgentProc::start(
        Path::new(BIN),
        &pki,
        go.agent,
        &["--keepalive-time=1s".into()],
    );
    agent
        .proc
        .wait_event(CALM, Duration::from_secs(30), |ev| ev["now"] == "2s");
    tether_testkit::kube::wait_blocking("the second stream", START_TIMEOUT, || {
        (go.proc.count_events("agent connected") >= 2).then_some(())
    });
    // An observation window, not synchronisation: three pings' worth of time in which
    // the server must not object again.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        agent.proc.count_events(CALM),
        1,
        "{}",
        agent.proc.log_text()
    );
    assert_eq!(
        go.proc.count_events("agent disconnected"),
        1,
        "{}",
        go.proc.log_text()
    );
    // And the stream carries traffic.
    let frontend = go.frontend;
    bulk_all(1, 1 << 20, || async move {
        TcpStream::connect(frontend).await.unwrap()
    })
    .await;
}

/// An agent that prefers WebSocket, against a grpc-go server (as upstream's, which
/// speaks only h2): the WebSocket attempt fails at TLS (no shared ALPN protocol) and
/// the agent falls back to h2 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_websocket_first_agent_falls_back_to_h2_with_a_grpc_go_server() {
    let pki = Pki::new();
    let bulk = backend::bulk().await;
    let go = go_server(&pki, bulk.addr, &[]);
    let started = std::time::Instant::now();
    let agent = AgentProc::start(
        Path::new(BIN),
        &pki,
        go.agent,
        &["--transports=websocket,h2".into()],
    );
    let ev = agent
        .proc
        .wait_event("connected to proxy server", START_TIMEOUT, |_| true);
    eprintln!(
        "connected over {} in {:?}",
        ev["transport"],
        started.elapsed()
    );
    assert_eq!(ev["transport"], "h2", "{ev}");
    let fell = agent.proc.wait_event(
        "cannot open a stream over this transport; trying the next",
        START_TIMEOUT,
        |_| true,
    );
    assert_eq!(fell["transport"], "websocket", "{fell}");
    let frontend = go.frontend;
    bulk_all(2, 1 << 20, || async move {
        TcpStream::connect(frontend).await.unwrap()
    })
    .await;
}

//! Failures and lifecycle: agents killed mid-transfer, servers restarted, garbage and
//! foreign certificates on the agent port, draining agents, destHost routing, health,
//! worker threads, running out of file descriptors.

use std::path::Path;
use std::time::{Duration, Instant};

use tether_client::Client;
use tether_testkit::backend::{self, Blackhole};
use tether_testkit::process::{socket_path, uds_frontend_args};
use tether_testkit::{http_get, metric, wait_until, AgentProc, Pki, ServerProc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

fn bin() -> &'static Path {
    Path::new(BIN)
}

fn grpc_server(pki: &Pki, extra: &[&str]) -> ServerProc {
    let mut args = uds_frontend_args(pki, "grpc", &socket_path(pki.dir()));
    args.extend(extra.iter().map(|s| s.to_string()));
    ServerProc::start(bin(), &args)
}

/// Dials a fresh echo backend through the gRPC frontend on the PKI's socket and
/// checks one exchange over the tunnel.
async fn dial_and_echo(pki: &Pki) {
    let echo = backend::echo().await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    backend::echo_tunnels(&client, echo.addr, 1).await;
}

async fn dial_count(agent: &AgentProc) -> f64 {
    metric(
        &agent.metrics().await,
        "konnectivity_network_proxy_agent_dial_duration_seconds_count",
    )
    .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_killed_mid_transfer_closes_connections_and_fails_pending_dial_fast() {
    let pki = Pki::new();
    let server = grpc_server(&pki, &[]);
    let mut agent = AgentProc::start(bin(), &pki, server.agent, &["--dial-timeout=60s".into()]);
    server.wait_agents(1).await;
    let echo = backend::echo().await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();

    let mut conns = backend::echo_tunnels(&client, echo.addr, 3).await;
    // A dial the agent cannot complete: its connect hangs.
    let hole = Blackhole::new();
    let pending_client = client.clone();
    let target = hole.addr.to_string();
    let pending = tokio::spawn(async move {
        let r = pending_client.dial(&target).await;
        (r.map(|_| ()), Instant::now())
    });
    server
        .wait_metric(
            "konnectivity_network_proxy_server_pending_backend_dials",
            1.0,
        )
        .await;
    // Keep bytes flowing on one connection while the agent dies.
    let mut busy = conns.pop().unwrap();
    let writer = tokio::spawn(async move {
        let chunk = vec![7u8; 16 * 1024];
        let mut read = vec![0u8; 16 * 1024];
        loop {
            if busy.write_all(&chunk).await.is_err() {
                return;
            }
            match busy.read(&mut read).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    });

    let killed = Instant::now();
    agent.proc.kill();
    let (result, failed_at) = pending.await.unwrap();
    let err = result.expect_err("pending dial must fail");
    assert!(
        failed_at - killed < Duration::from_secs(1),
        "pending dial failed after {:?}",
        failed_at - killed
    );
    assert!(err.to_string().contains("disconnected"), "{err}");
    for mut c in conns {
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(1), c.read(&mut b)).await;
        assert!(
            matches!(n, Ok(Ok(0)) | Ok(Err(_))),
            "connection not closed: {n:?}"
        );
    }
    tokio::time::timeout(Duration::from_secs(2), writer)
        .await
        .expect("busy connection closed")
        .unwrap();
    let page = server.metrics().await;
    assert_eq!(
        metric(
            &page,
            "konnectivity_network_proxy_server_established_connections"
        ),
        Some(0.0)
    );
    assert_eq!(
        metric(
            &page,
            "konnectivity_network_proxy_server_ready_backend_connections"
        ),
        Some(0.0)
    );
    assert_eq!(
        metric(
            &page,
            "konnectivity_network_proxy_server_dial_failure_count{reason=\"backend_close\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_and_client_reconnect_after_server_restart() {
    let pki = Pki::new();
    let echo = backend::echo().await;
    let mut server = grpc_server(&pki, &[]);
    let agent = AgentProc::start(bin(), &pki, server.agent, &[]);
    server.wait_agents(1).await;
    let roundtrip = |client: Client| {
        let target = echo.addr.to_string();
        async move {
            let mut c = client.dial(&target).await.unwrap();
            c.write_all(b"hi").await.unwrap();
            let mut b = [0u8; 2];
            c.read_exact(&mut b).await.unwrap();
            assert_eq!(&b, b"hi");
        }
    };
    // A client made before the restart is used after it too (as the CCM keeps one).
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    roundtrip(client.clone()).await;

    let agent_port = server.agent.port();
    server.proc.signal("TERM");
    assert!(
        server.proc.wait_exit(Duration::from_secs(10)).is_some(),
        "server did not exit on SIGTERM"
    );
    let agent_ref = &agent;
    wait_until("agent to notice", Duration::from_secs(10), || async move {
        (http_get(agent_ref.health, "/readyz").await.ok()?.0 == 503).then_some(())
    })
    .await;

    let mut server = grpc_server(&pki, &[&format!("--agent-port={agent_port}")]);
    server.wait_agents(1).await;
    roundtrip(client).await;
    assert_eq!(http_get(agent.health, "/readyz").await.unwrap().0, 200);

    // A server that dies (no clean end of the stream) is `Unavailable` on the agent's
    // receiving segment, as grpc-go reports losing the server (upstream's dashboards
    // key on the code); the clean SIGTERM above counted nothing, as upstream's EOF.
    server.proc.kill();
    let unavailable = r#"konnectivity_network_proxy_agent_stream_errors_total{code="Unavailable",packet_type="Unknown",segment="to_agent"}"#;
    wait_until(
        "the agent counts the lost server",
        Duration::from_secs(10),
        || async { (metric(&agent.metrics().await, unavailable)? >= 1.0).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn garbage_and_foreign_certificates_on_the_agent_port() {
    let pki = Pki::new();
    let server = grpc_server(&pki, &[]);

    // Plain garbage: the connection is dropped, the server lives on.
    let mut s = tokio::net::TcpStream::connect(server.agent).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n\x00\x01\x02 not TLS at all")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
        .await
        .expect("server closed it");

    // An agent whose certificate comes from another CA is refused.
    let other = Pki::new();
    let f = &other.files;
    let foreign = AgentProc::start(
        bin(),
        &pki,
        server.agent,
        &[
            format!("--agent-cert={}", f.agent_cert.display()),
            format!("--agent-key={}", f.agent_key.display()),
        ],
    );
    foreign.proc.wait_event(
        "proxy server stream down; reconnecting",
        Duration::from_secs(10),
        |_| true,
    );
    let page = server.metrics().await;
    assert_eq!(
        metric(
            &page,
            "konnectivity_network_proxy_server_ready_backend_connections"
        ),
        Some(0.0)
    );
    assert!(server.proc.logged("TLS handshake failed"));

    // A proper agent still gets in and works.
    let _agent = AgentProc::start(bin(), &pki, server.agent, &[]);
    server.wait_agents(1).await;
    dial_and_echo(&pki).await;
}

/// A server out of file descriptors keeps the agents it has and takes new ones once
/// descriptors are free again: its accept loops back off on EMFILE (connections wait
/// in the kernel's accept queue meanwhile) instead of spinning or giving up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_out_of_descriptors_accepts_again_once_they_are_free() {
    let pki = Pki::new();
    let args = uds_frontend_args(&pki, "grpc", &socket_path(pki.dir()));
    let server = ServerProc::start_with_open_files(bin(), &args, (64, 64));
    let first = AgentProc::start(bin(), &pki, server.agent, &[]);
    server.wait_agents(1).await;

    // Plain TCP connections to the agent port, each holding a descriptor in the server
    // while it waits for a TLS ClientHello, until there are none left.
    let mut held = Vec::new();
    for _ in 0..100 {
        held.push(tokio::net::TcpStream::connect(server.agent).await.unwrap());
    }
    server
        .proc
        .wait_event("accept failed", Duration::from_secs(10), |e| {
            e["error"]
                .as_str()
                .is_some_and(|m| m.contains("os error 24"))
        });
    drop(held);

    // The agent it had is still connected (no second "agent connected"), a new agent
    // gets in, and a dial through the frontend works.
    let _second = AgentProc::start(bin(), &pki, server.agent, &[]);
    server.wait_agents(2).await;
    assert_eq!(server.proc.count_events("agent connected"), 2);
    assert_eq!(first.proc.count_events("connected to proxy server"), 1);
    dial_and_echo(&pki).await;
}

/// An agent that holds no server stream and no connection (its node never reached a
/// server) has nothing to drain: SIGTERM ends it at once, not after --drain-timeout (a
/// DaemonSet pod on such a node would hold up a rollout for the whole drain).
#[test]
fn an_agent_with_nothing_to_drain_exits_at_once() {
    // A port nobody listens on (bound, then closed).
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let nowhere = closed.local_addr().unwrap();
    drop(closed);
    let pki = Pki::new();
    let mut agent = AgentProc::start(bin(), &pki, nowhere, &["--drain-timeout=5m".into()]);
    agent.proc.wait_event(
        "proxy server stream down; reconnecting",
        Duration::from_secs(30),
        |_| true,
    );
    let signalled = Instant::now();
    agent.proc.signal("TERM");
    agent.proc.exits_cleanly(
        Duration::from_secs(30),
        "the agent exits well before its 5 minute drain",
    );
    assert!(agent.proc.logged("nothing to drain"));
    eprintln!("exited {:?} after SIGTERM", signalled.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn draining_agent_is_last_choice_serves_until_its_drain_timeout() {
    let pki = Pki::new();
    let server = grpc_server(&pki, &[]);
    let mut a = AgentProc::start(
        bin(),
        &pki,
        server.agent,
        &["--agent-id=a".into(), "--drain-timeout=10s".into()],
    );
    let b = AgentProc::start(bin(), &pki, server.agent, &["--agent-id=b".into()]);
    server.wait_agents(2).await;
    let echo = backend::echo().await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();

    // Hold a connection through agent a so it stays up while draining.
    let mut held = None;
    for _ in 0..200 {
        let before = dial_count(&a).await;
        let c = client.dial(&echo.addr.to_string()).await.unwrap();
        if dial_count(&a).await > before {
            held = Some(c);
            break;
        }
    }
    let mut held = held.expect("no dial landed on agent a");

    let signalled = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    a.proc.signal("TERM");
    server.proc.wait_event(
        "agent is draining; it is now last choice for new dials",
        Duration::from_secs(10),
        |_| true,
    );
    // It says when its drain ends: the signal plus --drain-timeout.
    let deadline = metric(
        &a.metrics().await,
        "tether_agent_drain_deadline_timestamp_seconds",
    )
    .unwrap();
    assert!(
        (signalled + 9.0..signalled + 12.0).contains(&deadline),
        "drain deadline {deadline}, signalled at {signalled}"
    );
    let (a_before, b_before) = (dial_count(&a).await, dial_count(&b).await);
    for _ in 0..20 {
        let mut c = client.dial(&echo.addr.to_string()).await.unwrap();
        c.write_all(b"z").await.unwrap();
        let mut x = [0u8; 1];
        c.read_exact(&mut x).await.unwrap();
    }
    assert_eq!(
        dial_count(&a).await,
        a_before,
        "a draining agent took new dials"
    );
    assert_eq!(dial_count(&b).await, b_before + 20.0);

    // With b gone the draining agent is the only one: as upstream's, it still serves
    // the dials the server sends it (a rolling update never fails a kubectl command).
    drop(b);
    server.wait_agents(1).await;
    let mut late = client.dial(&echo.addr.to_string()).await.unwrap();
    late.write_all(b"y").await.unwrap();
    let mut y = [0u8; 1];
    late.read_exact(&mut y).await.unwrap();
    assert_eq!(&y, b"y");
    assert_eq!(dial_count(&a).await, a_before + 1.0);
    drop(late);

    // The held connection keeps working. In the drain's last 5 s the agent closes it
    // at its first quiet moment (the target answered last): the client sees it end
    // between two requests, well before the agent's hard stop.
    held.write_all(b"q").await.unwrap();
    let mut x = [0u8; 1];
    held.read_exact(&mut x).await.unwrap();
    let mut again = client.dial(&echo.addr.to_string()).await.unwrap();
    again.write_all(b"w").await.unwrap();
    again.read_exact(&mut x).await.unwrap();
    assert_eq!(&x, b"w");
    drop(again);
    let ended = tokio::time::timeout(Duration::from_secs(20), held.read(&mut x)).await;
    assert!(
        matches!(ended, Ok(Ok(0))),
        "the quiet connection ends: {ended:?}"
    );
    assert!(a
        .proc
        .logged("drain ends soon: closing each connection at its first quiet moment"));
    assert!(
        !a.proc.exited(),
        "the connection ended before the hard stop"
    );
    // Closing it does not end the drain: the agent serves until --drain-timeout, as
    // upstream's until its second signal.
    a.proc.exits_cleanly(
        Duration::from_secs(20),
        "the agent exits at its drain timeout",
    );
    assert!(a.proc.logged("drain timeout: exiting"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dest_host_routes_each_request_to_its_node() {
    let pki = Pki::new();
    let server = grpc_server(&pki, &["--proxy-strategies=destHost,default"]);
    // Each with its own node's certificate: the server routes by verified addresses.
    let node2 = AgentProc::start(
        bin(),
        &pki,
        server.agent,
        &pki.node_agent_args("node-2", "127.0.0.2"),
    );
    let node3 = AgentProc::start(
        bin(),
        &pki,
        server.agent,
        &pki.node_agent_args("node-3", "127.0.0.3"),
    );
    server.wait_agents(2).await;
    let web2 = backend::http_on("127.0.0.2", "node 2\n").await;
    let web3 = backend::http_on("127.0.0.3", "node 3\n").await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    for _ in 0..10 {
        for (web, body) in [(&web2, "node 2\n"), (&web3, "node 3\n")] {
            let mut c = client.dial(&web.addr.to_string()).await.unwrap();
            c.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
            let mut resp = String::new();
            c.read_to_string(&mut resp).await.unwrap();
            assert!(resp.ends_with(body), "{resp}");
        }
    }
    assert_eq!(dial_count(&node2).await, 10.0);
    assert_eq!(dial_count(&node3).await, 10.0);
}

/// The agent runs its tasks on one thread unless told otherwise (`--worker-threads`);
/// the server on one per CPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_threads() {
    const WORKER: &str = "tokio-rt-worker";
    let pki = Pki::new();
    let server = grpc_server(&pki, &["--worker-threads=3"]);
    let one = AgentProc::start(bin(), &pki, server.agent, &[]);
    let two = AgentProc::start(bin(), &pki, server.agent, &["--worker-threads=2".into()]);
    server.wait_agents(2).await;
    // A thread takes its name once it first runs: on a loaded machine that can be
    // after the process reported readiness, so wait for the count (it never exceeds
    // the setting; a wrong setting times out).
    wait_threads(&one.proc, 1).await;
    wait_threads(&two.proc, 2).await;
    wait_threads(&server.proc, 3).await;
    let default = grpc_server(&Pki::new(), &[]);
    let cpus = std::thread::available_parallelism().unwrap().get();
    wait_threads(&default.proc, cpus).await;
    assert_eq!(one.proc.threads_named(WORKER), 1);
}

/// Waits until `p` has `n` runtime worker threads.
async fn wait_threads(p: &tether_testkit::Proc, n: usize) {
    let what = format!("{n} tokio-rt-worker threads in {}", p.pid());
    wait_until(&what, Duration::from_secs(10), || async {
        (p.threads_named("tokio-rt-worker") == n).then_some(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_readiness_and_metrics() {
    let pki = Pki::new();
    let server = grpc_server(&pki, &[]);
    assert_eq!(http_get(server.health, "/healthz").await.unwrap().0, 200);
    assert_eq!(http_get(server.health, "/readyz").await.unwrap().0, 500);
    // Upstream's deprecated alias answers the same.
    assert_eq!(http_get(server.health, "/ready").await.unwrap().0, 500);
    let agent = AgentProc::start(bin(), &pki, server.agent, &[]);
    server.wait_agents(1).await;
    assert_eq!(http_get(server.health, "/readyz").await.unwrap().0, 200);
    assert_eq!(http_get(server.health, "/ready").await.unwrap().0, 200);
    let agent_ref = &agent;
    wait_until("agent ready", Duration::from_secs(10), || async move {
        (http_get(agent_ref.health, "/readyz").await.ok()?.0 == 200).then_some(())
    })
    .await;
    let (code, body) = http_get(agent.health, "/readyz?verbose").await.unwrap();
    assert_eq!(code, 200);
    assert_eq!(http_get(agent.health, "/ready").await.unwrap().0, 200);
    assert!(body.contains("1 proxy server stream"), "{body}");
    let page = server.metrics().await;
    for name in [
        "konnectivity_network_proxy_server_ready_backend_connections",
        "konnectivity_network_proxy_server_established_connections",
        "konnectivity_network_proxy_server_pending_backend_dials",
        "konnectivity_network_proxy_server_dial_duration_seconds",
        "konnectivity_network_proxy_server_grpc_connections",
    ] {
        assert!(page.contains(name), "missing {name}");
    }
    // Before any dial there is no dial failure and no packet: those series appear on
    // first use, as upstream's do.
    for name in [
        "konnectivity_network_proxy_server_dial_failure_count",
        "konnectivity_network_proxy_server_stream_packets_total",
    ] {
        assert!(!page.contains(name), "{name} before any dial:\n{page}");
    }
    let page = agent.metrics().await;
    for name in [
        "konnectivity_network_proxy_agent_open_server_connections 1",
        "konnectivity_network_proxy_agent_known_server_count 1",
        "konnectivity_network_proxy_agent_open_endpoint_connections 0",
    ] {
        assert!(page.contains(name), "missing {name}");
    }
    let (code, _) = http_get(server.admin, "/metrics").await.unwrap();
    assert_eq!(code, 200);
    assert!(server.admin.ip().is_loopback());
}

/// An agent stream that takes one dial and then never reads again, speaking the real
/// agent protocol over mTLS with HTTP/2's default 64 KiB receive window (so the
/// server's sends towards it block soon). The handles keep it connected.
struct StuckAgent {
    out: tokio::sync::mpsc::Sender<tether_proto::Packet>,
    inbound: tonic::Streaming<tether_proto::Packet>,
}

impl StuckAgent {
    async fn connect(pki: &Pki, server: std::net::SocketAddr) -> Self {
        use tether_proto::agent_service_client::AgentServiceClient;
        let f = &pki.files;
        let channel =
            tether_testkit::agent_channel(server, &f.ca_cert, Some((&f.agent_cert, &f.agent_key)))
                .await;
        let (out, rx) = tokio::sync::mpsc::channel(4);
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        request
            .metadata_mut()
            .insert("agentid", "stuck".parse().unwrap());
        let inbound = AgentServiceClient::new(channel)
            .connect(request)
            .await
            .unwrap()
            .into_inner();
        StuckAgent { out, inbound }
    }

    /// Answers the next dial, after which the stream reads nothing more.
    async fn answer_one_dial(&mut self) {
        use tether_proto::{packet::Payload, Packet};
        let first = self.inbound.message().await.unwrap().unwrap();
        let Some(Payload::DialRequest(req)) = first.payload else {
            panic!("expected a DIAL_REQ, got {first:?}");
        };
        self.out
            .send(Packet::dial_response(req.random, 1, ""))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn backend_dial_timeout_bounds_queueing_on_a_stuck_agent_which_is_retired() {
    let pki = Pki::new();
    let server = grpc_server(&pki, &["--backend-dial-timeout=2s", "--xfr-channel-size=1"]);
    let mut agent = StuckAgent::connect(&pki, server.agent).await;
    server.wait_agents(1).await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let first = {
        let client = client.clone();
        tokio::spawn(async move { client.dial("10.255.255.1:80").await })
    };
    agent.answer_one_dial().await;
    let mut conn = first.await.unwrap().expect("the first dial is answered");
    // Fill the agent's stream: its 64 KiB window, the one-packet queue, then a writer
    // the server cannot serve.
    let writer = tokio::spawn(async move {
        let chunk = vec![7u8; 16 * 1024];
        while conn.write_all(&chunk).await.is_ok() {}
    });
    let to_agent = r#"konnectivity_network_proxy_server_stream_packets_total{packet_type="DATA",segment="to_agent"}"#;
    wait_until(
        "DATA towards the stuck agent beyond what its stream can hold",
        Duration::from_secs(20),
        || async {
            (metric(&server.metrics().await, to_agent).unwrap_or(0.0) >= 5.0).then_some(())
        },
    )
    .await;

    // A DIAL_REQ that still finds room is failed after 2 s because the agent does not
    // answer; the first that finds none is failed after 2 s too, and retires the stream.
    // No dial waits for the queue to free.
    let mut dials = 0;
    loop {
        dials += 1;
        assert!(
            dials <= 5,
            "the stuck stream was not retired after {dials} dials"
        );
        let started = Instant::now();
        let dial = tokio::time::timeout(Duration::from_secs(10), client.dial("10.255.255.2:80"))
            .await
            .expect("the dial ends within --backend-dial-timeout, not when the queue frees");
        let err = dial.err().expect("the dial fails").to_string();
        assert!(err.contains("dial timeout"), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        if err.contains("did not accept the dial request") {
            break;
        }
    }
    server
        .wait_metric(
            "konnectivity_network_proxy_server_ready_backend_connections",
            0.0,
        )
        .await;
    let failures = metric(
        &server.metrics().await,
        r#"konnectivity_network_proxy_server_dial_failure_count{reason="backend_dial_timeout"}"#,
    );
    assert_eq!(failures, Some(dials as f64));
    writer.abort();
    drop(agent);
}

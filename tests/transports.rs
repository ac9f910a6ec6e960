//! The agent link's transports with real processes: an agent over WebSocket
//! (`--transports=websocket`) carries tunnels as one over HTTP/2 does (flow control,
//! bulk both ways, many at once) and says so in `/agents` and the metrics; through a
//! TLS-terminating nginx that speaks only HTTP/1.1, an `h2,websocket` agent finds h2
//! refused and falls back to WebSocket within a bound, and keeps it; a server that
//! refuses the agent is not retried over another transport.

use std::path::Path;
use std::time::{Duration, Instant};

use futures::future::join_all;
use tether_client::Client;
use tether_testkit::backend::{self, bulk_exchange, echo_tunnels};
use tether_testkit::nginx::{Nginx, Upstream, CONNECT_WITHIN};
use tether_testkit::process::{socket_path, uds_frontend_args};
use tether_testkit::{metric, AgentProc, Pki, ServerProc};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

fn server(pki: &Pki, extra: &[&str]) -> ServerProc {
    let mut args = uds_frontend_args(pki, "grpc", &socket_path(pki.dir()));
    args.extend(extra.iter().map(|s| s.to_string()));
    ServerProc::start(Path::new(BIN), &args)
}

/// An agent that carries its stream over WebSocket only.
fn ws_agent(pki: &Pki, server: &ServerProc) -> AgentProc {
    AgentProc::start(
        Path::new(BIN),
        pki,
        server.agent,
        &["--transports=websocket".into()],
    )
}

/// `/agents` from the server's admin port.
async fn agents(server: &ServerProc) -> serde_json::Value {
    let url = format!("http://{}/agents", server.admin);
    let out = tokio::process::Command::new("curl")
        .args(["-sf", &url])
        .output()
        .await
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"))
}

/// Four tunnels of 8 MiB each way at once, and a hundred small ones, through `client`.
async fn carries_tunnels(client: &Client) {
    let bulk = backend::bulk().await;
    let target = bulk.addr.to_string();
    let runs = (0..4u64).map(|i| {
        let target = target.clone();
        async move {
            let conn = client.dial(&target).await.unwrap();
            bulk_exchange(conn, 100 + i, 200 + i, 8 << 20, async {}).await
        }
    });
    let results = tokio::time::timeout(Duration::from_secs(120), join_all(runs))
        .await
        .expect("bulk tunnels over the transport stalled");
    for r in results {
        r.expect("bulk tunnel");
    }
    let echo = backend::echo().await;
    let conns = echo_tunnels(client, echo.addr, 100).await;
    assert_eq!(conns.len(), 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_over_websocket_carries_tunnels_and_says_so() {
    let pki = Pki::new();
    let server = server(&pki, &[]);
    let agent = ws_agent(&pki, &server);
    server.wait_agents(1).await;
    let ev = server
        .proc
        .wait_event("agent connected", Duration::from_secs(20), |_| true);
    assert_eq!(ev["transport"], "websocket", "{ev}");
    assert_eq!(ev["flow_control"], true, "flow control negotiated: {ev}");
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    carries_tunnels(&client).await;

    let listing = agents(&server).await;
    assert_eq!(
        listing["agents"][0]["transports"],
        serde_json::json!(["websocket"]),
        "{listing}"
    );
    let page = server.metrics().await;
    let streams = |t: &str| {
        metric(
            &page,
            &format!("tether_server_agent_streams{{transport=\"{t}\"}}"),
        )
    };
    assert_eq!(streams("websocket"), Some(1.0), "{page}");
    assert_eq!(streams("h2"), Some(0.0), "{page}");
    let page = agent.metrics().await;
    assert_eq!(
        metric(
            &page,
            "tether_agent_server_streams{transport=\"websocket\"}"
        ),
        Some(1.0)
    );
}

/// nginx on 127.0.0.1, terminating TLS with the server's own certificate (the agent
/// verifies it as the server's) and presenting the agent certificate to the server.
async fn nginx(pki: &Pki, server: &ServerProc) -> Nginx {
    let f = &pki.files;
    let upstream = Upstream {
        addr: server.agent,
        ca: &f.ca_cert,
        name: "localhost",
        client: Some((&f.agent_cert, &f.agent_key)),
    };
    Nginx::start(
        pki.dir(),
        "127.0.0.1",
        &f.server_cert,
        &f.server_key,
        &upstream,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn through_an_http1_reverse_proxy_h2_falls_back_to_websocket_and_keeps_it() {
    let pki = Pki::new();
    let port = format!("--agent-port={}", tether_testkit::kube::free_port());
    let server = server(&pki, &[&port]);
    let proxy = nginx(&pki, &server).await;
    let started = Instant::now();
    let agent = AgentProc::start(
        Path::new(BIN),
        &pki,
        proxy.addr,
        &["--transports=h2,websocket".into()],
    );
    tokio::time::timeout(CONNECT_WITHIN, server.wait_agents(1))
        .await
        .unwrap_or_else(|_| panic!("no agent through nginx:\n{}", proxy.error_log()));
    let took = started.elapsed();
    eprintln!("an h2,websocket agent connected through nginx in {took:?}");
    let ev = server
        .proc
        .wait_event("agent connected", Duration::from_secs(5), |_| true);
    assert_eq!(ev["transport"], "websocket", "{ev}");
    let fell = agent.proc.wait_event(
        "cannot open a stream over this transport; trying the next",
        Duration::from_secs(5),
        |_| true,
    );
    assert_eq!(fell["transport"], "h2", "{fell}");
    assert_eq!(fell["next"], "websocket", "{fell}");
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    carries_tunnels(&client).await;

    // The stream cut (nginx's connection to the server goes with the server): the agent
    // comes back over WebSocket at once, without trying h2 again.
    let page = agent.metrics().await;
    let fallbacks = metric(
        &page,
        "tether_agent_transport_fallbacks_total{transport=\"h2\"}",
    );
    assert_eq!(fallbacks, Some(1.0), "{page}");
    drop(client);
    drop(server);
    let server = self::server(&pki, &[&port]);
    tokio::time::timeout(CONNECT_WITHIN, server.wait_agents(1))
        .await
        .expect("the agent did not come back through nginx");
    let page = agent.metrics().await;
    assert_eq!(
        metric(
            &page,
            "tether_agent_transport_fallbacks_total{transport=\"h2\"}"
        ),
        fallbacks,
        "the agent tried h2 again after WebSocket worked:\n{page}"
    );
    assert!(proxy
        .access_log()
        .contains("GET /AgentService/Connect HTTP/1.1\" 101"));
}

/// DRAIN both ways over WebSocket: a draining agent's DRAIN reaches the server and the
/// agent leaves cleanly on its second signal (its close frame ends the stream OK); a
/// stopping server's DRAIN reaches the agent, whose tunnel keeps working through the
/// server's drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drain_passes_both_ways_over_websocket() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pki = Pki::new();
    let server = server(&pki, &["--graceful-shutdown-timeout=30s"]);
    let mut agent = ws_agent(&pki, &server);
    server.wait_agents(1).await;
    agent.proc.signal("TERM");
    server.proc.wait_event(
        "agent is draining; it is now last choice for new dials",
        Duration::from_secs(20),
        |_| true,
    );
    agent.proc.signal("TERM");
    agent.proc.exits_cleanly(
        Duration::from_secs(20),
        "the agent exits on a second signal",
    );
    server
        .proc
        .wait_event("agent disconnected", Duration::from_secs(20), |_| true);

    let agent = ws_agent(&pki, &server);
    server.wait_agents(1).await;
    let echo = backend::echo().await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let mut tunnel = client.dial(&echo.addr.to_string()).await.unwrap();
    server.proc.signal("TERM");
    agent.proc.wait_event(
        "the server is stopping (DRAIN): connecting to the other servers; this stream serves its tunnels to the end",
        Duration::from_secs(20),
        |_| true,
    );
    tunnel.write_all(b"still").await.unwrap();
    let mut back = [0u8; 5];
    tunnel.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"still");
}

/// A server with `--agent-websocket=false` offers only h2: an agent that prefers
/// WebSocket falls back to h2 there, and one that knows only WebSocket is kept out.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_without_websocket_takes_only_h2() {
    let pki = Pki::new();
    let server = server(&pki, &["--agent-websocket=false"]);
    let only_ws = AgentProc::start(
        Path::new(BIN),
        &pki,
        server.agent,
        &["--transports=websocket".into(), "--agent-id=only-ws".into()],
    );
    let down = only_ws.proc.wait_event(
        "proxy server stream down; reconnecting",
        Duration::from_secs(20),
        |_| true,
    );
    let error = down["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("takes none of the protocols this transport offers (http/1.1)")
            && error.contains("--transports"),
        "{down}"
    );
    // The server says which flag serves such an agent.
    server.proc.wait_event(
        "TLS handshake failed; connection dropped",
        Duration::from_secs(20),
        |ev| {
            ev["error"]
                .as_str()
                .is_some_and(|e| e.contains("--agent-websocket"))
        },
    );
    let _both = AgentProc::start(
        Path::new(BIN),
        &pki,
        server.agent,
        &["--transports=websocket,h2".into(), "--agent-id=both".into()],
    );
    let ev = server
        .proc
        .wait_event("agent connected", Duration::from_secs(20), |_| true);
    assert_eq!(ev["agent_id"], "both", "{ev}");
    assert_eq!(ev["transport"], "h2", "{ev}");
    assert_eq!(server.proc.count_events("agent connected"), 1);
}

/// New dials stay prompt while the link carries bulk both ways: an agent in a node
/// namespace (a veth link, 1500-byte frames) pumps eight echo tunnels flat out, then
/// drops them mid-flow and pumps eight more, while a new tunnel is dialled and used
/// every 200 ms. (tether-bench --loss once saw such dials stall, over either transport:
/// its pumps left writers running after their readers had gone, and those stalled
/// tunnels filled the client connection's window; see flow_control.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dials_stay_prompt_under_bulk_both_ways_over_websocket() {
    dials_stay_prompt_under_bulk_both_ways("websocket").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dials_stay_prompt_under_bulk_both_ways_over_h2() {
    dials_stay_prompt_under_bulk_both_ways("h2").await;
}

async fn dials_stay_prompt_under_bulk_both_ways(transport: &str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    if !tether_testkit::netns::available() {
        eprintln!("skipped: needs root and iproute2");
        return;
    }
    let node = tether_testkit::netns::Node::create();
    let pki = Pki::with_sans(std::slice::from_ref(&node.host_ip));
    let bind = format!("--agent-bind-address={}", node.host_ip);
    let server = server(&pki, &[&bind]);
    let echo = backend::echo_in(&node.ns, "127.0.0.1".parse().unwrap()).await;
    let _agent = AgentProc::start_in(
        Some(&node),
        Path::new(BIN),
        &pki,
        server.agent,
        &[format!("--transports={transport}")],
    );
    server.wait_agents(1).await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let target = echo.addr.to_string();
    let moved = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let (mut slowest, mut dials) = (Duration::ZERO, 0);
    // Two rounds of eight bulk tunnels, the first dropped mid-flow (their close
    // requests and in-flight data crossing the second's dials).
    for _round in 0..2 {
        let mut pumps = Vec::new();
        for _ in 0..8 {
            let conn = client.dial(&target).await.unwrap();
            pumps.extend(pump(conn, moved.clone()));
        }
        let round = Instant::now();
        while round.elapsed() < Duration::from_secs(6) {
            let took = dial_and_use(&client, &target, transport, dials, &moved).await;
            slowest = slowest.max(took);
            dials += 1;
            // Pacing, not synchronisation.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for p in pumps {
            p.abort();
        }
    }
    let mib = moved.load(Ordering::Relaxed) as f64 / (1 << 20) as f64;
    eprintln!(
        "{transport}: {dials} dials beside 8 bulk tunnels, the slowest (with a round trip) {slowest:?}; bulk {:.0} MiB/s",
        mib / started.elapsed().as_secs_f64()
    );
    assert!(mib > 0.0, "the bulk tunnels moved nothing");
}

/// Writes 64 KiB at a time through `conn` and reads the echo back (counted in
/// `moved`) until aborted: the writer's task and the reader's.
fn pump(
    conn: tether_client::TunnelConn,
    moved: std::sync::Arc<std::sync::atomic::AtomicU64>,
) -> [tokio::task::JoinHandle<()>; 2] {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut r, mut w) = tokio::io::split(conn);
    let writer = tokio::spawn(async move {
        let chunk = vec![1u8; 64 << 10];
        while w.write_all(&chunk).await.is_ok() {}
    });
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n @ 1..) = r.read(&mut buf).await {
            moved.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
        }
    });
    [writer, reader]
}

/// Dials `target`, sends four bytes and reads them back, within 15 s (else panics,
/// naming dial `n` over `transport`); how long that took.
async fn dial_and_use(
    client: &Client,
    target: &str,
    transport: &str,
    n: usize,
    moved: &std::sync::atomic::AtomicU64,
) -> Duration {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let at = Instant::now();
    let used = tokio::time::timeout(Duration::from_secs(15), async {
        let mut conn = client.dial(target).await?;
        conn.write_all(b"ping").await?;
        let mut back = [0u8; 4];
        conn.read_exact(&mut back).await?;
        anyhow::Ok(back)
    })
    .await;
    let took = at.elapsed();
    match used {
        Ok(Ok(back)) => assert_eq!(&back, b"ping"),
        Ok(Err(e)) => panic!("dial {n} over {transport} failed after {took:?}: {e:#}"),
        Err(_) => panic!(
            "dial {n} over {transport} and its first round trip took over 15 s; the bulk had moved {} MiB",
            moved.load(std::sync::atomic::Ordering::Relaxed) >> 20
        ),
    }
    took
}

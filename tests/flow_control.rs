//! Per-connection flow control on the agent link, with real server and agent
//! processes: between Tether peers a stalled reader (client or target) stalls only its
//! own connection and loses nothing; with flow control off on either side (what an
//! upstream peer does) the stalled connection is closed after `--stalled-reader-timeout`
//! instead of holding up every other connection for good.

use std::path::Path;
use std::time::Duration;

use futures::future::join_all;
use tether_client::Client;
use tether_testkit::backend::{self, bulk_exchange};
use tether_testkit::process::{socket_path, uds_frontend_args};
use tether_testkit::{AgentProc, Pki, ServerProc};
use tokio::io::AsyncWriteExt;
use tokio::sync::oneshot;

const BIN: &str = env!("CARGO_BIN_EXE_tether");

/// How long the busy connections may take (they need well under a second).
const BUSY_DEADLINE: Duration = Duration::from_secs(60);

struct Setup {
    pki: Pki,
    server: ServerProc,
    agent: AgentProc,
}

async fn setup(server_args: &[&str], agent_args: &[&str]) -> Setup {
    let pki = Pki::new();
    let mut args = uds_frontend_args(&pki, "grpc", &socket_path(pki.dir()));
    args.extend(server_args.iter().map(|s| s.to_string()));
    let server = ServerProc::start(Path::new(BIN), &args);
    let agent_args: Vec<String> = agent_args.iter().map(|s| s.to_string()).collect();
    let agent = AgentProc::start(Path::new(BIN), &pki, server.agent, &agent_args);
    server.wait_agents(1).await;
    Setup { pki, server, agent }
}

/// Four bulk exchanges of 8 MiB each way, which must all finish in time.
async fn busy_connections(client: &Client, target: &str) {
    let runs = (0..4u64).map(|i| async move {
        let conn = client.dial(target).await.unwrap();
        bulk_exchange(conn, 100 + i, 200 + i, 8 << 20, async {}).await
    });
    let results = tokio::time::timeout(BUSY_DEADLINE, join_all(runs))
        .await
        .expect("busy connections stalled behind the stalled one");
    for r in results {
        r.expect("busy connection");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tether_peers_a_stalled_reader_stalls_only_itself() {
    stalled_reader_stalls_only_itself(&[]).await;
}

/// The same with the agent's stream over WebSocket: the credit is the same packets'.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_websocket_a_stalled_reader_stalls_only_itself() {
    stalled_reader_stalls_only_itself(&["--transports=websocket"]).await;
}

async fn stalled_reader_stalls_only_itself(agent_args: &[&str]) {
    // A stall timeout far beyond the test: only flow control can keep others moving.
    let mut agent = vec!["--stalled-reader-timeout=1h"];
    agent.extend(agent_args);
    let s = setup(&["--stalled-reader-timeout=1h"], &agent).await;
    let ev = s
        .server
        .proc
        .wait_event("agent connected", Duration::from_secs(5), |_| true);
    assert_eq!(ev["flow_control"], true, "flow control negotiated: {ev}");
    let bulk = backend::bulk().await;
    let sink = backend::sink().await;
    let client = Client::uds(socket_path(s.pki.dir())).await.unwrap();
    let target = bulk.addr.to_string();

    // Download stall: the client asks for 32 MiB and does not read.
    let (open_gate, gate) = oneshot::channel::<()>();
    let stalled = {
        let conn = client.dial(&target).await.unwrap();
        tokio::spawn(bulk_exchange(conn, 7, 8, 32 << 20, async {
            let _ = gate.await;
        }))
    };
    // Upload stall: the target never reads what we keep writing.
    let mut blocked = client.dial(&sink.addr.to_string()).await.unwrap();
    let writer = tokio::spawn(async move {
        let buf = vec![0x5au8; 64 << 10];
        loop {
            if blocked.write_all(&buf).await.is_err() {
                return;
            }
        }
    });

    busy_connections(&client, &target).await;

    // The stalled download resumes and gets every byte intact.
    open_gate.send(()).unwrap();
    tokio::time::timeout(BUSY_DEADLINE, stalled)
        .await
        .expect("stalled connection resumes")
        .unwrap()
        .expect("stalled connection's data intact");
    assert!(
        !writer.is_finished(),
        "the upload to the non-reading target is held, not failed"
    );
    writer.abort();
    assert!(!s.server.proc.logged("closing the connection"));
    assert!(!s.agent.proc.logged("closing the connection"));
}

/// Many stalled tunnels on one client connection, each way: eight uploads to a target
/// that never reads and eight downloads the client never reads. Each fills its own
/// HTTP/2 stream window (1 MiB), the server's on the uploads and the client's on the
/// downloads; the connections' windows (16 MiB) leave room beside them, so new dials
/// and busy tunnels on the same connection go on. With 4 MiB connection windows four
/// such tunnels stopped every dial on the connection (found with tether-bench --loss,
/// whose pumps left writers running after their readers had gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_stalled_tunnels_leave_their_connection_moving() {
    let s = setup(
        &["--stalled-reader-timeout=1h"],
        &["--stalled-reader-timeout=1h"],
    )
    .await;
    let bulk = backend::bulk().await;
    let sink = backend::sink().await;
    let client = Client::uds(socket_path(s.pki.dir())).await.unwrap();
    let target = bulk.addr.to_string();
    let mut stalled = Vec::new();
    let written = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    for i in 0..8u64 {
        // Asks for 32 MiB and never reads it.
        let conn = client.dial(&target).await.unwrap();
        stalled.push(tokio::spawn(bulk_exchange(
            conn,
            10 + i,
            20 + i,
            32 << 20,
            std::future::pending(),
        )));
        let mut blocked = client.dial(&sink.addr.to_string()).await.unwrap();
        let written = written.clone();
        stalled.push(tokio::spawn(async move {
            let buf = vec![0x5au8; 64 << 10];
            while blocked.write_all(&buf).await.is_ok() {
                written.fetch_add(buf.len() as u64, std::sync::atomic::Ordering::Relaxed);
            }
            Ok(())
        }));
    }
    // Until the stalled tunnels hold more than 4 MiB each way in the connection's
    // windows: past what the agent and the target queue, 2 MiB per tunnel.
    let from_agent = r#"tether_server_tunnel_bytes_total{direction="from_agent"}"#;
    tether_testkit::wait_until(
        "the stalled tunnels filling their windows",
        Duration::from_secs(60),
        || async {
            let page = s.server.metrics().await;
            let down = page
                .lines()
                .find_map(|l| l.strip_prefix(from_agent)?.trim().parse::<f64>().ok())
                .unwrap_or(0.0);
            let up = written.load(std::sync::atomic::Ordering::Relaxed);
            (down >= (16 << 20) as f64 && up >= 16 << 20).then_some(())
        },
    )
    .await;
    busy_connections(&client, &target).await;
    let echo = backend::echo().await;
    let conns = backend::echo_tunnels(&client, echo.addr, 20).await;
    assert_eq!(conns.len(), 20);
    for t in stalled {
        assert!(!t.is_finished(), "a stalled tunnel is held, not failed");
        t.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_flow_control_the_server_closes_a_stalled_client_connection() {
    // The server behaves like upstream (no credit); the agent falls back too.
    let s = setup(
        &["--flow-control=false", "--stalled-reader-timeout=2s"],
        &[],
    )
    .await;
    let ev = s
        .server
        .proc
        .wait_event("agent connected", Duration::from_secs(5), |_| true);
    assert_eq!(ev["flow_control"], false, "{ev}");
    let bulk = backend::bulk().await;
    let client = Client::uds(socket_path(s.pki.dir())).await.unwrap();
    let target = bulk.addr.to_string();

    let (open_gate, gate) = oneshot::channel::<()>();
    let stalled = {
        let conn = client.dial(&target).await.unwrap();
        tokio::spawn(bulk_exchange(conn, 7, 8, 256 << 20, async {
            let _ = gate.await;
        }))
    };
    // Held up at most for the stall timeout, then the stalled one is closed.
    busy_connections(&client, &target).await;
    s.server.proc.wait_event(
        "client stopped reading; closing the connection (--stalled-reader-timeout)",
        Duration::from_secs(30),
        |_| true,
    );
    // The agent's stream waited on the stalled client meanwhile: upstream's full
    // receive channel of an agent stream (`Connect`).
    let page = s.server.metrics().await;
    assert!(
        page.contains(
            r#"konnectivity_network_proxy_server_full_receive_channels{service_method="Connect"}"#
        ),
        "{page}"
    );
    open_gate.send(()).unwrap();
    let result = tokio::time::timeout(BUSY_DEADLINE, stalled)
        .await
        .expect("stalled connection ends")
        .unwrap();
    assert!(
        result.is_err(),
        "a closed connection must not look complete"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_flow_control_the_agent_closes_a_stalled_target_connection() {
    // The agent behaves like upstream (no credit offered).
    let s = setup(
        &[],
        &["--flow-control=false", "--stalled-reader-timeout=2s"],
    )
    .await;
    let ev = s
        .server
        .proc
        .wait_event("agent connected", Duration::from_secs(5), |_| true);
    assert_eq!(ev["flow_control"], false, "{ev}");
    let bulk = backend::bulk().await;
    let sink = backend::sink().await;
    let client = Client::uds(socket_path(s.pki.dir())).await.unwrap();

    let mut blocked = client.dial(&sink.addr.to_string()).await.unwrap();
    let writer = tokio::spawn(async move {
        let buf = vec![0x5au8; 64 << 10];
        while blocked.write_all(&buf).await.is_ok() {}
    });
    busy_connections(&client, &bulk.addr.to_string()).await;
    s.agent.proc.wait_event(
        "target stopped reading; closing the connection (--stalled-reader-timeout)",
        Duration::from_secs(30),
        |_| true,
    );
    // The client learns its connection is gone: its writes fail.
    tokio::time::timeout(BUSY_DEADLINE, writer)
        .await
        .expect("writes to the closed connection fail")
        .unwrap();
}

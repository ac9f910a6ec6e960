//! The agent link over QUIC with real processes: an agent over QUIC
//! (`--transports=quic`, a server with `--agent-quic-port`) carries tunnels, each on a
//! QUIC stream of its own, and says so in `/agents` and the metrics; DRAIN passes both
//! ways; a small tunnel keeps answering while the link drops packets under bulk
//! tunnels; with UDP dropped a `quic,h2` agent falls back to h2 within a stated bound;
//! a client without an agent certificate gets no tunnel; and replayed Initial packets
//! from strangers' addresses get a Retry each, never more bytes than they sent.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use tether_client::Client;
use tether_core::quic::{self, quinn};
use tether_testkit::backend::{self, bulk_exchange, echo_tunnels};
use tether_testkit::kube::free_udp_port;
use tether_testkit::process::{socket_path, uds_frontend_args};
use tether_testkit::{metric, AgentProc, Pki, ServerProc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

/// How long a `quic,h2` agent may take to fall back to h2 when UDP is dropped: the
/// QUIC handshake's bound (5 s), then TCP, TLS and the Connect call.
const FALLBACK_WITHIN: Duration = Duration::from_secs(15);

/// A server taking agents over QUIC on `port` too, with `extra` flags.
fn server(pki: &Pki, port: u16, extra: &[&str]) -> ServerProc {
    let mut args = uds_frontend_args(pki, "grpc", &socket_path(pki.dir()));
    args.push(format!("--agent-quic-port={port}"));
    args.extend(extra.iter().map(|s| s.to_string()));
    ServerProc::start(Path::new(BIN), &args)
}

/// An agent over `transports` to `server`, whose QUIC port is `port`.
fn agent(pki: &Pki, server: &ServerProc, port: u16, transports: &str) -> AgentProc {
    AgentProc::start(
        Path::new(BIN),
        pki,
        server.agent,
        &[
            format!("--transports={transports}"),
            format!("--proxy-server-quic-port={port}"),
        ],
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

/// An iptables rule on this host, deleted again when dropped.
struct Rule(Vec<String>);

impl Rule {
    fn add(chain: &str, spec: &[&str]) -> Rule {
        let spec: Vec<String> = std::iter::once(chain.to_string())
            .chain(spec.iter().map(|s| s.to_string()))
            .collect();
        let out = Command::new("iptables")
            .arg("-I")
            .args(&spec)
            .output()
            .expect("iptables");
        assert!(out.status.success(), "iptables -I {spec:?}: {out:?}");
        Rule(spec)
    }
}

impl Drop for Rule {
    fn drop(&mut self) {
        let _ = Command::new("iptables").arg("-D").args(&self.0).output();
    }
}

/// Drops a share `p` (0..1) of the UDP datagrams to and from `port` on loopback.
fn lossy(port: u16, p: f64) -> [Rule; 2] {
    let p = format!("{p}");
    let port = port.to_string();
    let spec = |dir: &'static str| -> Vec<&str> {
        vec![
            "-i",
            "lo",
            "-p",
            "udp",
            dir,
            &port,
            "-m",
            "statistic",
            "--mode",
            "random",
            "--probability",
            &p,
            "-j",
            "DROP",
        ]
    };
    [
        Rule::add("INPUT", &spec("--dport")),
        Rule::add("INPUT", &spec("--sport")),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_over_quic_carries_tunnels_and_says_so() {
    let pki = Pki::new();
    let port = free_udp_port();
    let server = server(&pki, port, &[]);
    let agent = agent(&pki, &server, port, "quic");
    server.wait_agents(1).await;
    let ev = server
        .proc
        .wait_event("agent connected", Duration::from_secs(20), |_| true);
    assert_eq!(ev["transport"], "quic", "{ev}");
    assert_eq!(ev["flow_control"], true, "flow control negotiated: {ev}");
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let bulk = backend::bulk().await;
    let runs = (0..4u64).map(|i| {
        let (client, target) = (&client, bulk.addr.to_string());
        async move {
            let conn = client.dial(&target).await.unwrap();
            bulk_exchange(conn, 100 + i, 200 + i, 8 << 20, async {}).await
        }
    });
    let results = tokio::time::timeout(Duration::from_secs(120), join_all(runs))
        .await
        .expect("bulk tunnels over QUIC stalled");
    for r in results {
        r.expect("bulk tunnel");
    }
    let echo = backend::echo().await;
    assert_eq!(echo_tunnels(&client, echo.addr, 100).await.len(), 100);

    let listing = agents(&server).await;
    assert_eq!(
        listing["agents"][0]["transports"],
        serde_json::json!(["quic"]),
        "{listing}"
    );
    let (_, status) = tether_testkit::http_get(server.admin, "/status")
        .await
        .unwrap();
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(
        status["agentTransports"],
        serde_json::json!(["h2", "websocket", "quic"]),
        "{status}"
    );
    assert_eq!(status["agentQuic"], format!("127.0.0.1:{port}"), "{status}");
    let page = server.metrics().await;
    let streams = |t: &str| {
        metric(
            &page,
            &format!("tether_server_agent_streams{{transport=\"{t}\"}}"),
        )
    };
    assert_eq!(streams("quic"), Some(1.0), "{page}");
    assert_eq!(streams("h2"), Some(0.0), "{page}");
    let page = agent.metrics().await;
    assert_eq!(
        metric(&page, "tether_agent_server_streams{transport=\"quic\"}"),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drain_passes_both_ways_over_quic() {
    let pki = Pki::new();
    let port = free_udp_port();
    let server = server(&pki, port, &["--graceful-shutdown-timeout=30s"]);
    let mut first = agent(&pki, &server, port, "quic");
    server.wait_agents(1).await;
    first.proc.signal("TERM");
    server.proc.wait_event(
        "agent is draining; it is now last choice for new dials",
        Duration::from_secs(20),
        |_| true,
    );
    first.proc.signal("TERM");
    first.proc.exits_cleanly(
        Duration::from_secs(20),
        "the agent exits on a second signal",
    );
    server
        .proc
        .wait_event("agent disconnected", Duration::from_secs(20), |_| true);

    let second = agent(&pki, &server, port, "quic");
    server.wait_agents(1).await;
    let echo = backend::echo().await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let mut tunnel = client.dial(&echo.addr.to_string()).await.unwrap();
    server.proc.signal("TERM");
    second.proc.wait_event(
        "the server is stopping (DRAIN): connecting to the other servers; this stream serves its tunnels to the end",
        Duration::from_secs(20),
        |_| true,
    );
    tunnel.write_all(b"still").await.unwrap();
    let mut back = [0u8; 5];
    tunnel.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"still");
}

/// With 3% of the link's datagrams dropped both ways, a small request/response tunnel
/// keeps answering, every time, while four bulk tunnels move 4 MiB each way beside it:
/// a loss stalls only the stream it hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_small_tunnel_keeps_answering_while_the_link_drops_packets_under_bulk() {
    let pki = Pki::new();
    let port = free_udp_port();
    let server = server(&pki, port, &[]);
    let _agent = agent(&pki, &server, port, "quic");
    server.wait_agents(1).await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let bulk = backend::bulk().await;
    let echo = backend::echo().await;
    let _loss = lossy(port, 0.03);
    let bulk_done = tokio::spawn({
        let client = Client::uds(socket_path(pki.dir())).await.unwrap();
        let target = bulk.addr.to_string();
        async move {
            let runs = (0..4u64).map(|i| {
                let (client, target) = (&client, target.clone());
                async move {
                    let conn = client.dial(&target).await.unwrap();
                    bulk_exchange(conn, 300 + i, 400 + i, 4 << 20, async {}).await
                }
            });
            join_all(runs).await
        }
    });
    let mut small = client.dial(&echo.addr.to_string()).await.unwrap();
    let mut slowest = Duration::ZERO;
    for i in 0..100u8 {
        let sent = Instant::now();
        small.write_all(&[i; 64]).await.unwrap();
        let mut back = [0u8; 64];
        tokio::time::timeout(Duration::from_secs(10), small.read_exact(&mut back))
            .await
            .unwrap_or_else(|_| panic!("round trip {i} unanswered within 10 s"))
            .unwrap();
        assert_eq!(back, [i; 64]);
        slowest = slowest.max(sent.elapsed());
    }
    let results = tokio::time::timeout(Duration::from_secs(240), bulk_done)
        .await
        .expect("bulk tunnels finished under loss")
        .unwrap();
    for r in results {
        r.expect("bulk tunnel under loss");
    }
    eprintln!("slowest of 100 small round trips under 3% loss: {slowest:?}");
}

/// With UDP to the server dropped (a firewall that passes only TCP), a `quic,h2` agent
/// connects over h2 within [`FALLBACK_WITHIN`], counts the fallback, and tries h2 first
/// when it reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_udp_dropped_a_quic_agent_falls_back_to_h2_within_the_bound() {
    let pki = Pki::new();
    let port = free_udp_port();
    let server = server(&pki, port, &[]);
    let _blocked = Rule::add(
        "INPUT",
        &[
            "-i",
            "lo",
            "-p",
            "udp",
            "--dport",
            &port.to_string(),
            "-j",
            "DROP",
        ],
    );
    let began = Instant::now();
    let agent = agent(&pki, &server, port, "quic,h2");
    let ev = server
        .proc
        .wait_event("agent connected", Duration::from_secs(60), |_| true);
    let took = began.elapsed();
    assert_eq!(ev["transport"], "h2", "{ev}");
    assert!(
        took < FALLBACK_WITHIN,
        "fell back to h2 after {took:?}, over {FALLBACK_WITHIN:?}"
    );
    let page = agent.metrics().await;
    assert_eq!(
        metric(
            &page,
            "tether_agent_transport_fallbacks_total{transport=\"quic\"}"
        ),
        Some(1.0),
        "{page}"
    );
    eprintln!("fell back from QUIC to h2 in {took:?}");
}

/// A QUIC client with no agent certificate, or one from another CA, gets no connection:
/// the handshake fails, and no agent appears.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quic_client_without_an_agent_certificate_gets_no_tunnel() {
    let pki = Pki::new();
    let stranger = Pki::new();
    let port = free_udp_port();
    let server = server(&pki, port, &[]);
    let remote = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let f = &pki.files;
    let other = &stranger.files;
    for identity in [
        None,
        Some((other.agent_cert.as_path(), other.agent_key.as_path())),
    ] {
        let tls = tether_core::tls::client_config(&f.ca_cert, identity, &[]).unwrap();
        let transport =
            quic::transport_config(Duration::from_secs(10), Duration::from_secs(30), false);
        let config = quic::client_config(&tls, transport).unwrap();
        let endpoint = quic::client_endpoint(remote).unwrap();
        let attempt = async {
            let conn = endpoint.connect_with(config, remote, "localhost")?.await?;
            // TLS 1.3: the server judges the client's certificate after the client
            // thinks the handshake done; a refused one sees its connection closed.
            let (mut send, mut recv) = conn.open_bi().await?;
            send.write_all(b"CONNECT /AgentService/Connect HTTP/1.1\r\nagentid: intruder\r\n\r\n")
                .await?;
            quic::read_answer(&mut recv).await?;
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
        };
        let result = tokio::time::timeout(Duration::from_secs(20), attempt)
            .await
            .expect("the server answers or closes within 20 s");
        assert!(result.is_err(), "a client with {identity:?} was admitted");
    }
    let listing = agents(&server).await;
    assert_eq!(listing["agents"], serde_json::json!([]), "{listing}");
}

/// Initial packets, fifty distinct ones, each sent four times from an address that
/// never asked for them (as a spoofer sends them, naming a victim as the source), get
/// Retries, smaller than what came in: no amplification, and no connection state for
/// any of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replayed_initials_from_strangers_get_no_amplification() {
    let pki = Pki::new();
    let port = free_udp_port();
    let server = server(&pki, port, &[]);
    let initials = initials(&pki, 50).await;
    assert!(
        initials.iter().all(|i| i.len() >= 1200),
        "an Initial pads to 1200 bytes"
    );
    let target = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut victims = Vec::new();
    for i in 0..50u8 {
        let sock = tokio::net::UdpSocket::bind((std::net::Ipv4Addr::new(127, 0, 1, 10 + i), 0))
            .await
            .unwrap();
        victims.push(Arc::new(sock));
    }
    let mut sent = 0usize;
    for (v, initial) in victims.iter().zip(&initials) {
        for _ in 0..4 {
            sent += v.send_to(initial, target).await.unwrap();
        }
    }
    // What the server sends the victims, until none has heard anything for a second.
    let received = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let listeners = victims.iter().map(|v| {
        let (v, received, answered) = (v.clone(), received.clone(), answered.clone());
        async move {
            let mut buf = [0u8; 2048];
            let mut heard = false;
            while let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_secs(1), v.recv(&mut buf)).await
            {
                received.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                heard = true;
            }
            if heard {
                answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    join_all(listeners).await;
    let received = received.load(std::sync::atomic::Ordering::Relaxed);
    let answered = answered.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!("replayed Initials: {sent} bytes in, {received} bytes out, {answered} of 50 sources answered");
    assert!(answered > 0, "the server answered no Initial at all");
    // QUIC allows a server 3x what an unvalidated address sent; a Retry is far less.
    assert!(
        received <= sent,
        "{received} bytes out for {sent} in: the server amplified"
    );
    let listing = agents(&server).await;
    assert_eq!(listing["agents"], serde_json::json!([]), "{listing}");
}

/// `n` real clients' first datagrams to a QUIC server (each an Initial with a
/// connection ID of its own, a ClientHello inside), caught on a UDP socket posing as
/// the server.
async fn initials(pki: &Pki, n: usize) -> Vec<Vec<u8>> {
    let catcher = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let at = catcher.local_addr().unwrap();
    let f = &pki.files;
    let tls = tether_core::tls::client_config(
        &f.ca_cert,
        Some((f.agent_cert.as_path(), f.agent_key.as_path())),
        &[],
    )
    .unwrap();
    let mut caught = Vec::new();
    let mut pending: Vec<quinn::Connecting> = Vec::new();
    let endpoint = quic::client_endpoint(at).unwrap();
    for _ in 0..n {
        let transport =
            quic::transport_config(Duration::from_secs(10), Duration::from_secs(30), false);
        let config = quic::client_config(&tls, transport).unwrap();
        pending.push(endpoint.connect_with(config, at, "localhost").unwrap());
        // The first datagram of this attempt (a retransmission of an earlier one
        // would repeat its connection ID: skipped).
        loop {
            let mut buf = vec![0u8; 2048];
            let (len, _) =
                tokio::time::timeout(Duration::from_secs(10), catcher.recv_from(&mut buf))
                    .await
                    .expect("the client's Initial")
                    .unwrap();
            buf.truncate(len);
            let dcid = &buf[6..6 + buf[5] as usize];
            if !caught
                .iter()
                .any(|c: &Vec<u8>| &c[6..6 + c[5] as usize] == dcid)
            {
                caught.push(buf);
                break;
            }
        }
    }
    caught
}

/// Connection migration: the agent's node changes its address mid-transfer (its old
/// address removed, a new one routed), and over QUIC a tunnel carrying 48 MiB each way
/// finishes intact on the same connection: no reconnect, no error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tunnel_survives_the_agents_address_changing() {
    let Some(moved) = move_mid_transfer("quic").await else {
        return;
    };
    let carried = moved.outcome.expect("the tunnel carried every byte");
    assert_eq!(carried, TOTAL);
    assert_eq!(moved.connects, 1, "the agent never reconnected");
    eprintln!(
        "quic: moved the agent's address {} MiB into a {} MiB transfer; it finished {:.1?} later",
        moved.at >> 20,
        TOTAL >> 20,
        moved.after
    );
}

/// The same move under an agent over h2: the TCP connection dies with its address, and
/// the tunnel with it; the agent reconnects from the new address.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_h2_the_same_move_ends_the_tunnel() {
    let Some(moved) = move_mid_transfer("h2").await else {
        return;
    };
    let error = moved
        .outcome
        .expect_err("an h2 tunnel does not survive its address");
    eprintln!(
        "h2: moved the agent's address {} MiB into a {} MiB transfer; the tunnel failed {:.1?} later ({error}); the agent connected {} times",
        moved.at >> 20,
        TOTAL >> 20,
        moved.after,
        moved.connects
    );
}

/// What a tunnel's transfer did across the agent's move.
struct Moved {
    /// Bytes back when the address moved.
    at: u64,
    /// The transfer's end: every byte back, or why not.
    outcome: std::io::Result<u64>,
    /// From the move to that end.
    after: Duration,
    /// Streams the agent opened in all.
    connects: usize,
}

/// Bytes each way through the tunnel in [`move_mid_transfer`].
const TOTAL: u64 = 48 << 20;

/// An agent in a node namespace over `transports`, a tunnel to an echo server on the
/// node moving [`TOTAL`] bytes each way, and a quarter of the way through, the node's
/// address changed: a new one routed by the host and the source of what the node
/// sends the server, the old one gone. `None` without network namespaces.
async fn move_mid_transfer(transports: &str) -> Option<Moved> {
    use std::sync::atomic::{AtomicU64, Ordering};
    if !tether_testkit::netns::available() {
        eprintln!("skipped: needs root and iproute2");
        return None;
    }
    let node = tether_testkit::netns::Node::create();
    let pki = Pki::with_sans(std::slice::from_ref(&node.host_ip));
    let port = free_udp_port();
    let bind = format!("--agent-bind-address={}", node.host_ip);
    let server = server(&pki, port, &[&bind]);
    let agent = AgentProc::start_in(
        Some(&node),
        Path::new(BIN),
        &pki,
        server.agent,
        &[
            format!("--transports={transports}"),
            format!("--proxy-server-quic-port={port}"),
            format!("--health-server-host={}", node.link_ip),
        ],
    );
    server.wait_agents(1).await;
    let echo = backend::echo_in(&node.ns, node.node_ip.parse().unwrap()).await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let tunnel = client.dial(&echo.addr.to_string()).await.unwrap();
    let back = Arc::new(AtomicU64::new(0));
    let (mut r, mut w) = tokio::io::split(tunnel);
    let _writer = tokio::spawn(async move {
        let chunk: Vec<u8> = (0..64 * 1024u32).map(|i| (i % 251) as u8).collect();
        for _ in 0..TOTAL / chunk.len() as u64 {
            w.write_all(&chunk).await?;
        }
        Ok::<_, std::io::Error>(w)
    });
    let reader = tokio::spawn({
        let back = back.clone();
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            let mut at = 0u64;
            while at < TOTAL {
                let n = r.read(&mut buf).await?;
                if n == 0 {
                    return Err(std::io::Error::other(format!(
                        "tunnel ended after {at} bytes"
                    )));
                }
                for (k, b) in buf[..n].iter().enumerate() {
                    let want = ((at + k as u64) % (64 * 1024) % 251) as u8;
                    if *b != want {
                        return Err(std::io::Error::other(format!(
                            "byte {} differs",
                            at + k as u64
                        )));
                    }
                }
                at += n as u64;
                back.store(at, Ordering::Relaxed);
            }
            Ok(at)
        }
    });
    tether_testkit::wait_until("a quarter of the transfer", Duration::from_secs(60), || {
        let at = back.load(Ordering::Relaxed);
        async move { (at >= TOTAL / 4).then_some(()) }
    })
    .await;
    let new_ip = format!("10.232.{}.9", node.index);
    let out = Command::new("ip")
        .args([
            "route",
            "replace",
            &format!("{new_ip}/32"),
            "dev",
            node.host_interface(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let nif = node.node_interface();
    node.ip(&["addr", "add", &format!("{new_ip}/32"), "dev", nif]);
    let host = format!("{}/32", node.host_ip);
    node.ip(&["route", "replace", &host, "dev", nif, "src", &new_ip]);
    node.ip(&["addr", "del", &format!("{}/30", node.link_ip), "dev", nif]);
    let moved = Instant::now();
    let at = back.load(Ordering::Relaxed);
    let outcome = tokio::time::timeout(Duration::from_secs(150), reader)
        .await
        .map_err(|_| std::io::Error::other("no byte for 150 s"))
        .and_then(|r| r.unwrap());
    let after = moved.elapsed();
    Some(Moved {
        at,
        outcome,
        after,
        connects: agent.proc.count_events("connected to proxy server"),
    })
}

/// A successor on the same host (`--reuse-port`, the same agent and QUIC ports) starts
/// while its predecessor holds the QUIC port, which is never shared (the kernel would
/// hand the predecessor's datagrams to it): the predecessor's QUIC tunnel carries on
/// meanwhile, and once the predecessor has gone the successor takes the port, and a
/// QUIC agent connects to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_successor_takes_the_quic_port_once_its_predecessor_lets_go() {
    let pki = Pki::new();
    let port = free_udp_port();
    let agent_port = tether_testkit::kube::free_port();
    let shared = [
        format!("--agent-port={agent_port}"),
        format!("--agent-quic-port={port}"),
        "--reuse-port".to_string(),
        "--graceful-shutdown-timeout=5s".to_string(),
    ];
    let start = |socket: &Path| {
        let mut args = uds_frontend_args(&pki, "grpc", socket);
        args.extend(shared.iter().cloned());
        ServerProc::start(Path::new(BIN), &args)
    };
    let blue_socket = pki.dir().join("blue.sock");
    let mut blue = start(&blue_socket);
    let _agent = agent(&pki, &blue, port, "quic");
    blue.wait_agents(1).await;
    let echo = backend::echo().await;
    let client = Client::uds(&blue_socket).await.unwrap();
    let mut tunnel = client.dial(&echo.addr.to_string()).await.unwrap();

    let green = start(&pki.dir().join("green.sock"));
    green.proc.wait_event(
        "the QUIC port is held by another process (the server this one succeeds, sharing the agent port with --reuse-port); agents reach this server over h2 or WebSocket until it lets go",
        Duration::from_secs(20),
        |_| true,
    );
    tunnel.write_all(b"still").await.unwrap();
    let mut back = [0u8; 5];
    tunnel.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"still", "the predecessor's QUIC tunnel carries on");
    drop(tunnel);
    drop(client);

    blue.proc.signal("TERM");
    blue.proc
        .exits_cleanly(Duration::from_secs(60), "the predecessor stops");
    green
        .proc
        .wait_event("QUIC port bound", Duration::from_secs(30), |_| true);
    let _late = agent(&pki, &green, port, "quic");
    let ev = green
        .proc
        .wait_event("agent connected", Duration::from_secs(60), |ev| {
            ev["transport"] == "quic"
        });
    assert_eq!(ev["transport"], "quic", "{ev}");
}

/// A QUIC port another process holds fails the start-up (without `--reuse-port`) with
/// one line naming the flag.
#[test]
fn a_busy_quic_port_fails_the_start_with_one_line() {
    let pki = Pki::new();
    let held = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let mut args = vec!["server".to_string()];
    args.extend(uds_frontend_args(&pki, "grpc", &socket_path(pki.dir())));
    args.extend([
        "--agent-port=0".to_string(),
        "--health-port=0".to_string(),
        "--admin-port=0".to_string(),
        "--agent-bind-address=127.0.0.1".to_string(),
        format!("--agent-quic-port={port}"),
    ]);
    let line = tether_testkit::process::start_up_error(Path::new(BIN), &args);
    assert!(
        line.contains("--agent-quic-port") && line.contains(&format!("127.0.0.1:{port}")),
        "{line}"
    );
}

/// A server killed and started again on the same ports (the kubelet restarting a
/// crashed static pod) answers its predecessor's agents with a stateless reset they
/// accept, since both sign them with a key derived from the agent key: the agent
/// reconnects at once, well within the 30 s a silent connection takes to die.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_crash_a_restarted_server_sends_its_agents_back_at_once() {
    let pki = Pki::new();
    let port = free_udp_port();
    let agent_port = tether_testkit::kube::free_port();
    let pinned = format!("--agent-port={agent_port}");
    let mut first = server(&pki, port, &[&pinned]);
    let agent = agent(&pki, &first, port, "quic");
    first.wait_agents(1).await;
    first.proc.kill();
    let killed = Instant::now();
    let second = server(&pki, port, &[&pinned, "--delete-existing-uds-file"]);
    second.wait_agents(1).await;
    let back = killed.elapsed();
    assert!(
        back < Duration::from_secs(20),
        "the agent came back after {back:?}: it waited for the idle timeout"
    );
    assert_eq!(agent.proc.count_events("connected to proxy server"), 2);
    eprintln!("a QUIC agent was back {back:?} after its server was killed and restarted");
}

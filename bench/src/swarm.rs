//! Many agents and many tunnels on one server (`--agents N`, `--tunnels M`): swarm
//! processes (this binary with `--swarm-to`) hold N agent streams with distinct ids
//! and identifiers, each its own mutual-TLS connection speaking the agent protocol
//! (test doubles for nodes: a DIAL_REQ is answered at once, with no target connection),
//! and reconnect with the agent's backoff and jitter. Measured on the server: memory
//! per idle agent stream, idle CPU, dial latency with N agents beside one, the
//! reconnect storm after a SIGKILL and restart, and memory per idle tunnel.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rand::Rng;
use serde_json::{json, Value};
use tether_core::grpc::Messages;
use tether_proto::packet::Payload;
use tether_proto::{header, Packet};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::args::Args;
use crate::procinfo::{cpu_seconds, status_mib};
use crate::procs::{agent_args, free_port, spawn_tether, Proc, Tether};
use crate::report;
use crate::stats::p50_p99;

/// What one swarm process reports each second.
#[derive(Default)]
struct Counters {
    /// Streams up now.
    up: AtomicI64,
    /// Streams established, ever.
    connects: AtomicU64,
    /// Dials that failed (TCP, TLS, HTTP/2, or the server refused the stream).
    failures: AtomicU64,
    /// Of those, refusals by a server that answered (gRPC status).
    refused: AtomicU64,
    /// Streams that have sent a burst (one full HTTP/2 frame of DATA) at least once.
    burst_streams: AtomicU64,
}

/// A dial to this address is answered with one [`BURST`]-byte DATA packet, as a real
/// agent reading a busy target sends: the server's per-agent read buffers grow to a
/// full frame.
const BURST_ADDRESS: &str = "10.255.0.2:80";
/// One HTTP/2 frame's worth of payload (what a real agent reads from a target at once).
const BURST: usize = tether_core::pump::READ_CHUNK;

/// (child) Holds `count` agent streams to `server`, ids from `first`; prints its
/// counters as a JSON line every second; exits when stdin closes.
pub async fn run_swarm(
    server: SocketAddr,
    pki: PathBuf,
    first: usize,
    count: usize,
    over: Over,
) -> anyhow::Result<()> {
    let alpn = match over {
        Over::WebSocket => tether_core::tls::ALPN_HTTP11,
        Over::H2 | Over::Quic => tether_core::tls::ALPN_H2,
    };
    let tls = tether_core::tls::client_config(
        &pki.join("ca.crt"),
        Some((&pki.join("fleet-agent.crt"), &pki.join("fleet-agent.key"))),
        &[alpn],
    )?;
    // Over QUIC the swarm's agents share one UDP socket, each its own connection.
    let endpoint = match over {
        Over::Quic => Some(tether_core::quic::client_endpoint(server)?),
        _ => None,
    };
    let counters = Arc::new(Counters::default());
    for id in first..first + count {
        let how = Dialer {
            server,
            tls: tls.clone(),
            endpoint: endpoint.clone(),
            over,
        };
        tokio::spawn(fake_agent(id, how, counters.clone()));
    }
    tokio::spawn(async {
        // The parent closes stdin (or dies): stop.
        let mut buf = [0u8; 1];
        let _ = tokio::io::stdin().read(&mut buf).await;
        std::process::exit(0);
    });
    let mut out = tokio::io::stdout();
    loop {
        let line = json!({
            "up": counters.up.load(Ordering::Relaxed),
            "connects": counters.connects.load(Ordering::Relaxed),
            "failures": counters.failures.load(Ordering::Relaxed),
            "refused": counters.refused.load(Ordering::Relaxed),
            "burst_streams": counters.burst_streams.load(Ordering::Relaxed),
        });
        out.write_all(format!("{line}\n").as_bytes()).await?;
        out.flush().await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// One node's agent: connect, answer dials, and reconnect as the agent does (1 s,
/// x1.5 up to 10 s, 10% jitter).
async fn fake_agent(id: usize, how: Dialer, c: Arc<Counters>) {
    let mut delay = Duration::from_secs(1);
    let (server, tls) = (how.server, &how.tls);
    loop {
        let held = match (how.over, &how.endpoint) {
            (Over::WebSocket, _) => hold_ws_stream(id, server, tls.clone(), &c).await,
            (Over::Quic, Some(endpoint)) => hold_quic_stream(id, server, endpoint, tls, &c).await,
            _ => hold_stream(id, server, tls.clone(), &c).await,
        };
        match held {
            Ok(()) => delay = Duration::from_secs(1),
            Err(refused) => {
                c.failures.fetch_add(1, Ordering::Relaxed);
                if refused {
                    c.refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let jitter = 1.0 + rand::rng().random_range(0.0..0.1);
        tokio::time::sleep(delay.mul_f64(jitter)).await;
        delay = delay.mul_f64(1.5).min(Duration::from_secs(10));
    }
}

/// One stream, until it ends (Ok) or cannot be opened (Err: whether a server refused).
/// A bare HTTP/2 connection driven inside this task, as an agent with one runtime
/// thread spends its time: a dial costs the swarm one task's wake-up, not the four of a
/// tonic channel (its request queue, hyper's connection and body pipe tasks, and this
/// one), each touching another cold agent's memory.
async fn hold_stream(
    id: usize,
    server: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    c: &Counters,
) -> Result<(), bool> {
    use tether_core::grpc::client;
    let io = swarm_tls(server, tls).await?;
    let (mut send, mut conn) = client::handshake(io, client::Windows::AGENT_LINK)
        .await
        .map_err(|_| false)?;
    let request = client::request(
        &server.to_string(),
        "/AgentService/Connect",
        swarm_headers(id),
    );
    let (mut out, response) = client::open(&mut send, request, None).map_err(|_| false)?;
    let response = tokio::select! {
        r = response => r.map_err(|_| true)?,
        _ = &mut conn => return Err(false),
    };
    if client::check_response(&response).is_err() {
        return Err(true);
    }
    c.connects.fetch_add(1, Ordering::Relaxed);
    c.up.fetch_add(1, Ordering::Relaxed);
    let mut body = response.into_body();
    let mut messages = Messages::default();
    let mut next_id = 1i64;
    let mut bursted = false;
    'stream: loop {
        loop {
            let p = match messages.next_packet() {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(_) => break 'stream,
            };
            for a in answers(p, &mut next_id, &mut bursted, c) {
                out.send_now(&a);
            }
        }
        tokio::select! {
            d = body.data() => match d {
                Some(Ok(chunk)) => {
                    let _ = body.flow_control().release_capacity(chunk.len());
                    messages.push(chunk);
                }
                _ => break,
            },
            _ = &mut conn => break,
        }
    }
    c.up.fetch_sub(1, Ordering::Relaxed);
    Ok(())
}

/// A swarm agent's answers to `p`: a dial answered at once (with a burst of DATA for
/// [`BURST_ADDRESS`]), a close confirmed.
fn answers(p: Packet, next_id: &mut i64, bursted: &mut bool, c: &Counters) -> Vec<Packet> {
    match p.payload {
        Some(Payload::DialRequest(d)) => {
            *next_id += 1;
            let mut out = vec![Packet::dial_response(d.random, *next_id, "")];
            if d.address == BURST_ADDRESS {
                if !std::mem::replace(bursted, true) {
                    c.burst_streams.fetch_add(1, Ordering::Relaxed);
                }
                out.push(Packet::data(*next_id, vec![7u8; BURST]));
            }
            out
        }
        Some(Payload::CloseRequest(r)) => vec![Packet::close_response(r.connect_id, "")],
        _ => Vec::new(),
    }
}

/// A swarm agent's TLS connection to `server` (Err(false): it failed, no server
/// refused).
async fn swarm_tls(
    server: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
) -> Result<tether_core::transport::ClientTls, bool> {
    let name = tether_core::tls::server_name("127.0.0.1").map_err(|_| false)?;
    tether_core::transport::connect_tls(&server.to_string(), name, tls)
        .await
        .map_err(|_| false)
}

/// The agent's metadata for swarm agent `id`.
fn swarm_headers(id: usize) -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    let value = |v: String| http::HeaderValue::try_from(v).expect("ASCII id");
    headers.insert(header::AGENT_ID, value(format!("swarm-{id}")));
    headers.insert(header::AGENT_IDENTIFIERS, value(format!("host=swarm-{id}")));
    headers
}

/// [`hold_stream`] over WebSocket (`--websocket`): the upgrade, then a packet per
/// message, answered as the HTTP/2 swarm answers.
async fn hold_ws_stream(
    id: usize,
    server: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    c: &Counters,
) -> Result<(), bool> {
    use futures::{SinkExt, StreamExt};
    use tether_core::ws;
    let io = swarm_tls(server, tls).await?;
    let authority = server.to_string();
    let (mut socket, _) = ws::client(io, &authority, "/AgentService/Connect", swarm_headers(id))
        .await
        .map_err(|e| matches!(e, ws::UpgradeError::Refused { .. }))?;
    c.connects.fetch_add(1, Ordering::Relaxed);
    c.up.fetch_add(1, Ordering::Relaxed);
    let mut next_id = 1i64;
    let mut bursted = false;
    while let Some(Ok(m)) = socket.next().await {
        let ws::Message::Binary(data) = m else {
            continue;
        };
        let Ok(p) = ws::decode(&data) else { break };
        let answers = answers(p, &mut next_id, &mut bursted, c);
        for m in answers.iter().flat_map(ws::encode) {
            if socket.feed(m).await.is_err() {
                break;
            }
        }
        if !answers.is_empty() && socket.flush().await.is_err() {
            break;
        }
    }
    c.up.fetch_sub(1, Ordering::Relaxed);
    Ok(())
}

/// What carries a swarm's agent streams (`--websocket` or `--quic` with `--agents`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    H2,
    WebSocket,
    Quic,
}

impl Over {
    /// The transport the flags name (h2 unless one is given).
    pub fn of(websocket: bool, quic: bool) -> Over {
        match (websocket, quic) {
            (_, true) => Over::Quic,
            (true, false) => Over::WebSocket,
            _ => Over::H2,
        }
    }

    /// The flag a swarm process is started with.
    fn flag(self) -> Option<&'static str> {
        match self {
            Over::H2 => None,
            Over::WebSocket => Some("--websocket"),
            Over::Quic => Some("--quic"),
        }
    }
}

/// How a swarm agent reaches the server.
struct Dialer {
    server: SocketAddr,
    tls: Arc<rustls::ClientConfig>,
    /// Over QUIC: the swarm's one UDP endpoint.
    endpoint: Option<tether_core::quic::quinn::Endpoint>,
    over: Over,
}

/// [`hold_stream`] over QUIC (`--quic`): a connection on the swarm's endpoint, the
/// control stream's head, then each tunnel on the stream the server opens for it,
/// answered as the HTTP/2 swarm answers.
async fn hold_quic_stream(
    id: usize,
    server: SocketAddr,
    endpoint: &tether_core::quic::quinn::Endpoint,
    tls: &rustls::ClientConfig,
    c: &Counters,
) -> Result<(), bool> {
    use tether_core::quic;
    let transport = quic::transport_config(Duration::from_secs(10), Duration::from_secs(30), false);
    let config = quic::client_config(tls, transport).map_err(|_| false)?;
    let conn = endpoint
        .connect_with(config, server, "127.0.0.1")
        .map_err(|_| false)?
        .await
        .map_err(|_| false)?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|_| false)?;
    let head = quic::request_head(
        &server.to_string(),
        "/AgentService/Connect",
        &swarm_headers(id),
    );
    send.write_all(&head).await.map_err(|_| false)?;
    let (_, rest) = quic::read_answer(&mut recv)
        .await
        .map_err(|e| matches!(e, quic::AnswerError::Refused { .. }))?;
    let reader = quic::PacketReader::new(recv, rest);
    let (mux, mut inbound) = quic::Mux::start(conn, send, reader, tracing::Span::none());
    c.connects.fetch_add(1, Ordering::Relaxed);
    c.up.fetch_add(1, Ordering::Relaxed);
    let mut next_id = 1i64;
    let mut bursted = false;
    while let Some(Ok(p)) = inbound.recv().await {
        for a in answers(p, &mut next_id, &mut bursted, c) {
            mux.send(&a).await;
        }
    }
    c.up.fetch_sub(1, Ordering::Relaxed);
    Ok(())
}

/// What this run's swarms speak (`--websocket`, `--quic` with `--agents`).
static OVER: std::sync::Mutex<Over> = std::sync::Mutex::new(Over::H2);

/// A swarm process and its latest counters.
struct Swarm {
    proc: Proc,
    latest: Arc<Mutex<Value>>,
}

fn start_swarm(
    server: SocketAddr,
    pki: &Path,
    first: usize,
    count: usize,
) -> anyhow::Result<Swarm> {
    let mut child = Command::new(std::env::current_exe()?)
        .args([
            format!("--swarm-to={server}"),
            format!("--swarm-pki={}", pki.display()),
            format!("--swarm-first={first}"),
            format!("--swarm-count={count}"),
        ])
        .args(OVER.lock().unwrap_or_else(|e| e.into_inner()).flag())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let stdout = child.stdout.take().context("swarm stdout")?;
    let latest = Arc::new(Mutex::new(json!({})));
    let l = latest.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                *l.lock().unwrap() = v;
            }
        }
    });
    Ok(Swarm {
        proc: Proc(child),
        latest,
    })
}

fn swarm_total(swarms: &[Swarm], key: &str) -> u64 {
    swarms
        .iter()
        .map(|s| s.latest.lock().unwrap()[key].as_u64().unwrap_or(0))
        .sum()
}

/// The server under test: gRPC frontend on a Unix socket, agents on a fixed port (so a
/// restarted server is found where the old one was).
struct Server {
    proc: Proc,
    health: SocketAddr,
}

fn start_server(
    t: &Tether,
    pki: &tether_certs::DevPki,
    socket: &Path,
    agent_port: u16,
    quic: bool,
) -> anyhow::Result<Server> {
    let mut args = t.server_args(pki, "grpc", socket, agent_port);
    if quic {
        args.push(format!("--agent-quic-port={agent_port}"));
    }
    let (proc, ev) = spawn_tether(&t.bin, &args)?;
    Ok(Server {
        proc,
        health: ev["health"].as_str().unwrap_or_default().parse()?,
    })
}

/// The server's heap in use and free (MiB), from its `tether_heap_*` gauges (one
/// scrape, so both come from the same moment).
async fn heap_mib(health: SocketAddr) -> (f64, f64) {
    let page = metrics_page(health).await;
    let mib = |name: &str| page_gauge(&page, name) / (1 << 20) as f64;
    (
        mib("tether_heap_inuse_bytes"),
        mib("tether_heap_free_bytes"),
    )
}

/// A server gauge from `/metrics`.
async fn gauge(health: SocketAddr, name: &str) -> f64 {
    page_gauge(&metrics_page(health).await, name)
}

/// The server's `/metrics` page; empty when it cannot be read.
async fn metrics_page(health: SocketAddr) -> String {
    let mut page = String::new();
    if let Ok(mut s) = tokio::net::TcpStream::connect(health).await {
        let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await;
        let _ = s.read_to_string(&mut page).await;
    }
    page
}

/// The first sample of `name` (any labels) on a metrics page; NaN when absent.
fn page_gauge(page: &str, name: &str) -> f64 {
    page.lines()
        .find_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            (k == name || k.starts_with(&format!("{name}{{")))
                .then(|| v.trim().parse::<f64>().ok())?
        })
        .unwrap_or(f64::NAN)
}

const AGENTS_GAUGE: &str = "konnectivity_network_proxy_server_ready_backend_connections";
const TUNNELS_GAUGE: &str = "konnectivity_network_proxy_server_established_connections";

/// Waits until the server holds `n` agent streams; how long it took, and the highest
/// server RSS (MiB) seen meanwhile.
async fn wait_agents(server: &Server, n: f64, limit: Duration) -> anyhow::Result<(Duration, f64)> {
    let started = Instant::now();
    let mut peak = 0f64;
    loop {
        peak = peak.max(status_mib(server.proc.0.id(), "VmRSS"));
        if gauge(server.health, AGENTS_GAUGE).await >= n {
            return Ok((started.elapsed(), peak));
        }
        if started.elapsed() > limit {
            bail!(
                "only {} of {n} agents connected after {limit:?}",
                gauge(server.health, AGENTS_GAUGE).await
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Server RSS once it has stopped falling: not lower for 3 s running, longer than the
/// server's trimmer waits between looks (2 s; it gives freed memory back at the first
/// look that finds the process idle, so one unchanged second proved nothing and once
/// read 412 MiB where the server settled at 389).
async fn settled_rss(pid: u32) -> f64 {
    const STEADY_READS: u32 = 3;
    let mut low = f64::MAX;
    let mut steady = 0;
    for _ in 0..30 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = status_mib(pid, "VmRSS");
        if now < low {
            low = now;
            steady = 0;
        } else {
            steady += 1;
            if steady == STEADY_READS {
                break;
            }
        }
    }
    low
}

/// One dial (us) through the gRPC frontend to whichever agent the server picks.
async fn timed_dial(client: &tether_client::Client) -> anyhow::Result<f64> {
    let t = Instant::now();
    let conn = client.dial("10.255.0.1:80").await?;
    let us = t.elapsed().as_secs_f64() * 1e6;
    drop(conn);
    Ok(us)
}

/// Dial latency (us), p50 and p99, over `n` dials.
async fn dial_latency(client: &tether_client::Client, n: usize) -> anyhow::Result<(f64, f64)> {
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        samples.push(timed_dial(client).await?);
    }
    Ok(p50_p99(samples))
}

/// Dial latency (us) through two servers' gRPC frontends, alternating dial by dial
/// (`n` each), so the machine's drift and its hiccups hit both alike: p50 and p99
/// through `a`, then through `b`.
async fn dial_latency_interleaved(
    a: &tether_client::Client,
    b: &tether_client::Client,
    n: usize,
) -> anyhow::Result<((f64, f64), (f64, f64))> {
    let mut samples = [Vec::with_capacity(n), Vec::with_capacity(n)];
    for i in 0..n {
        // Which goes first alternates too.
        for side in [i % 2, 1 - i % 2] {
            samples[side].push(timed_dial([a, b][side]).await?);
        }
    }
    let [sa, sb] = samples;
    Ok((p50_p99(sa), p50_p99(sb)))
}

/// `n` tunnels to [`BURST_ADDRESS`], 16 at a time, each read to its end and closed.
async fn burst(client: &tether_client::Client, n: usize) -> anyhow::Result<()> {
    let next = AtomicU64::new(0);
    let one = || async {
        let mut buf = vec![0u8; BURST];
        while next.fetch_add(1, Ordering::Relaxed) < n as u64 {
            let mut conn = client.dial(BURST_ADDRESS).await?;
            conn.read_exact(&mut buf).await?;
        }
        anyhow::Ok(())
    };
    futures::future::try_join_all((0..16).map(|_| one())).await?;
    Ok(())
}

/// A swarm counter once the swarms' once-a-second reports have stopped changing it.
async fn settled_total(swarms: &[Swarm], key: &str) -> u64 {
    let mut last = swarm_total(swarms, key);
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let now = swarm_total(swarms, key);
        if now == last {
            break;
        }
        last = now;
    }
    last
}

/// A process's CPU as a share of one core over `window`, from each thread's run time
/// in nanoseconds (`/proc/PID/task/TID/schedstat`): `utime` and `stime` count whole
/// 10 ms clock ticks, and an idle agent uses a few ticks' worth in 30 s. Threads are
/// read every 250 ms, so one that exits in the window (a blocking-pool thread) loses
/// at most its last 250 ms; one that starts counts from zero.
async fn idle_cpu(pid: u32, window: Duration) -> f64 {
    let read = || -> HashMap<u64, u64> {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return HashMap::new();
        };
        tasks
            .filter_map(|t| {
                let t = t.ok()?;
                let tid = t.file_name().to_str()?.parse().ok()?;
                let stat = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
                Some((tid, stat.split_whitespace().next()?.parse().ok()?))
            })
            .collect()
    };
    let start = read();
    let mut last = start.clone();
    let deadline = Instant::now() + window;
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250).min(deadline - Instant::now())).await;
        last.extend(read());
    }
    let ns: u64 = last
        .iter()
        .map(|(tid, &end)| end.saturating_sub(start.get(tid).copied().unwrap_or(0)))
        .sum();
    ns as f64 / 1e9 / window.as_secs_f64()
}

/// `--agents` and `--tunnels`: the runs `args` ask for; prints their figures and
/// writes them to `--json`.
pub async fn run(args: &Args, t: &Tether) -> anyhow::Result<()> {
    let mut out = serde_json::Map::new();
    if let Some(n) = args.agents {
        let over = Over::of(args.websocket, args.quic);
        let v = many_agents(t, n, args.agent_procs, over).await?;
        out.insert("many_agents".into(), v);
    }
    if let Some(m) = args.tunnels {
        let v = many_tunnels(t, m, args.tunnel_agents).await?;
        out.insert("many_tunnels".into(), v);
    }
    report::print_and_write_json(&args.json, &Value::Object(out))
}

/// A throwaway PKI, plus one agent certificate the swarm's agents share (a fleet's, CN
/// `system:konnectivity-agent`, naming no node): each swarm agent is then an agent of
/// its own ID, as thousands of nodes with their own credentials are to the server.
/// (`DevPki`'s own agent certificate is one node's: thousands of agents sharing it
/// would be one node's eight streams.)
fn swarm_pki(dir: &std::path::Path) -> anyhow::Result<tether_certs::DevPki> {
    let pki = tether_certs::DevPki::generate(dir)?;
    let ca = tether_certs::Ca::load(&pki.ca_cert, &pki.ca_key)?;
    let fleet = ca.issue(&tether_certs::LeafSpec {
        common_name: "system:konnectivity-agent".into(),
        client: true,
        ..Default::default()
    })?;
    tether_certs::write_pair(dir, "fleet-agent", &fleet)?;
    Ok(pki)
}

/// The `--agents` run: one agent, then N, then a reconnect storm.
pub async fn many_agents(
    t: &Tether,
    agents: usize,
    procs: usize,
    over: Over,
) -> anyhow::Result<Value> {
    *OVER.lock().unwrap_or_else(|e| e.into_inner()) = over;
    let dir = std::env::temp_dir().join(format!("tether-swarm-{}", std::process::id()));
    let pki = swarm_pki(&dir.join("pki"))?;
    let socket = dir.join("grpc.sock");
    // Over QUIC the agents dial the same number over UDP.
    let port = tether_testkit::kube::free_udp_port();
    let agent_addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let mut server = start_server(t, &pki, &socket, port, over == Over::Quic)?;
    let base_rss = settled_rss(server.proc.0.id()).await;

    let mut swarms = vec![start_swarm(agent_addr, &pki.dir, 0, 1)?];
    wait_agents(&server, 1.0, Duration::from_secs(30)).await?;
    let client = tether_client::Client::uds(&socket).await?;
    let one = dial_latency(&client, 2000).await?;
    let one_rss = settled_rss(server.proc.0.id()).await;
    eprintln!(
        "1 agent: dial p50 {:.0} us, p99 {:.0} us; server RSS {one_rss:.1} MiB",
        one.0, one.1
    );

    let rest = agents.saturating_sub(1);
    let per = rest.div_ceil(procs.max(1));
    let started = Instant::now();
    for first in (1..agents).step_by(per.max(1)) {
        swarms.push(start_swarm(
            agent_addr,
            &pki.dir,
            first,
            per.min(agents - first),
        )?);
    }
    let (connected, _) = wait_agents(&server, agents as f64, Duration::from_secs(600)).await?;
    let connect_all = started.elapsed().max(connected);
    let rss = settled_rss(server.proc.0.id()).await;
    let per_agent_kib = (rss - one_rss) * 1024.0 / rest.max(1) as f64;
    eprintln!("{agents} agents connected in {connect_all:.1?}; server RSS {rss:.1} MiB ({per_agent_kib:.1} KiB per agent stream)");

    // Idle: the server with N agents, and one real agent among them.
    let (real, _) = spawn_tether(&t.agent_bin, &agent_args(&pki, port))?;
    wait_agents(&server, (agents + 1) as f64, Duration::from_secs(60)).await?;
    // The agent's start-up tail (its first heap trim once idle) is not idle CPU: the
    // window opens after 5 s without traffic, as the route table's "idle" figures do.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let window = Duration::from_secs(30);
    let agent_cpu = tokio::spawn({
        let pid = real.0.id();
        async move { idle_cpu(pid, window).await }
    });
    let server_cpu = idle_cpu(server.proc.0.id(), window).await;
    let agent_cpu = agent_cpu.await?;
    eprintln!(
        "idle over {window:?}: server {:.2}% of a core, a real agent {:.3}%",
        server_cpu * 100.0,
        agent_cpu * 100.0
    );
    drop(real);

    let many = dial_latency(&client, 2000).await?;
    eprintln!(
        "{agents} agents: dial p50 {:.0} us, p99 {:.0} us",
        many.0, many.1
    );
    // The same beside a second server with one agent, alternating dial by dial: the
    // figures compared are taken in the same seconds.
    let (beside, beside_ratio, cpu_per_dial) = {
        let socket = dir.join("grpc-one.sock");
        let port = tether_testkit::kube::free_udp_port();
        let one_server = start_server(t, &pki, &socket, port, over == Over::Quic)?;
        let one_swarm = start_swarm(([127, 0, 0, 1], port).into(), &pki.dir, 0, 1)?;
        wait_agents(&one_server, 1.0, Duration::from_secs(30)).await?;
        let one_client = tether_client::Client::uds(&socket).await?;
        // Warm both (the first dials open the frontend connection's streams).
        dial_latency_interleaved(&client, &one_client, 200).await?;
        // CPU per dial on each side, to tell where the cold agents' extra latency goes:
        // the servers, and the swarm processes answering.
        // Server and swarms with N agents, then with one.
        let groups: [Vec<u32>; 4] = [
            vec![server.proc.0.id()],
            swarms.iter().map(|s| s.proc.0.id()).collect(),
            vec![one_server.proc.0.id()],
            vec![one_swarm.proc.0.id()],
        ];
        let cpu = |pids: &[u32]| pids.iter().map(|p| cpu_seconds(*p)).sum::<f64>();
        let before = groups.each_ref().map(|g| cpu(g));
        const DIALS: usize = 4000;
        let (n, one) = dial_latency_interleaved(&client, &one_client, DIALS).await?;
        let cpu_per_dial: [f64; 4] =
            std::array::from_fn(|i| (cpu(&groups[i]) - before[i]) * 1e6 / DIALS as f64);
        let ratio = n.1 / one.1;
        eprintln!(
            "interleaved with a one-agent server: dial p50/p99 {:.0} / {:.0} us with {agents} agents, {:.0} / {:.0} us with 1 (p99 {ratio:.2}x); CPU per dial, server / agents: {:.0} / {:.0} us with {agents}, {:.0} / {:.0} us with 1",
            n.0, n.1, one.0, one.1, cpu_per_dial[0], cpu_per_dial[1], cpu_per_dial[2], cpu_per_dial[3]
        );
        ((n, one), ratio, cpu_per_dial)
    };

    // A burst: one frame of DATA from most agents (three dials per agent, each to the
    // agent the server picks), then what the server holds once idle again.
    let before_burst = settled_rss(server.proc.0.id()).await;
    burst(&client, agents * 3).await?;
    let reached = settled_total(&swarms, "burst_streams").await;
    let after_burst = settled_rss(server.proc.0.id()).await;
    let burst_kib = (after_burst - before_burst) * 1024.0 / reached.max(1) as f64;
    eprintln!(
        "burst: {reached} agents sent a {} KiB frame; server RSS {before_burst:.1} -> {after_burst:.1} MiB once idle ({burst_kib:.1} KiB per agent)",
        BURST >> 10
    );

    // The storm: SIGKILL, restart where it was, every agent comes back with backoff.
    let failures_before = swarm_total(&swarms, "failures");
    let refused_before = swarm_total(&swarms, "refused");
    drop(server);
    let restarted = Instant::now();
    server = start_server(t, &pki, &socket, port, over == Over::Quic)?;
    let (storm, storm_peak) = wait_agents(&server, agents as f64, Duration::from_secs(600)).await?;
    let storm = restarted.elapsed().max(storm);
    let after_rss = settled_rss(server.proc.0.id()).await;
    let failed = swarm_total(&swarms, "failures") - failures_before;
    let refused = swarm_total(&swarms, "refused") - refused_before;
    eprintln!(
        "reconnect storm: {agents} agents back in {storm:.1?}; server RSS peak {storm_peak:.1} MiB, settled {after_rss:.1} MiB; {failed} failed dials ({refused} refused by the server)"
    );
    drop(swarms);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(json!({
        "agents": agents,
        "server_rss_mib": {"no_agents": base_rss, "one_agent": one_rss, "all_agents": rss},
        "server_kib_per_agent_stream": per_agent_kib,
        "connect_all_s": connect_all.as_secs_f64(),
        "idle_cpu_share": {"server": server_cpu, "real_agent": agent_cpu},
        "burst": {"agents": reached, "rss_before_mib": before_burst, "rss_after_mib": after_burst, "kib_per_agent": burst_kib},
        "dial_us": {"one_agent": {"p50": one.0, "p99": one.1}, "all_agents": {"p50": many.0, "p99": many.1}},
        "dial_us_interleaved": {
            "all_agents": {"p50": beside.0 .0, "p99": beside.0 .1},
            "one_agent_server": {"p50": beside.1 .0, "p99": beside.1 .1},
            "p99_ratio": beside_ratio,
            "cpu_us_per_dial": {
                "all_agents": {"server": cpu_per_dial[0], "agents": cpu_per_dial[1]},
                "one_agent_server": {"server": cpu_per_dial[2], "agents": cpu_per_dial[3]},
            },
        },
        "reconnect_storm": {"seconds": storm.as_secs_f64(), "peak_rss_mib": storm_peak, "settled_rss_mib": after_rss, "failed_dials": failed, "refused": refused},
    }))
}

/// The `--tunnels` run: M idle tunnels over `agents` fake agents, then all closed.
pub async fn many_tunnels(t: &Tether, tunnels: usize, agents: usize) -> anyhow::Result<Value> {
    let dir = std::env::temp_dir().join(format!("tether-tunnels-{}", std::process::id()));
    let pki = swarm_pki(&dir.join("pki"))?;
    let socket = dir.join("grpc.sock");
    let port = free_port();
    let server = start_server(t, &pki, &socket, port, false)?;
    let swarm = start_swarm(([127, 0, 0, 1], port).into(), &pki.dir, 0, agents)?;
    wait_agents(&server, agents as f64, Duration::from_secs(120)).await?;
    let pid = server.proc.0.id();
    // Warm: one round of dials, closed, so the baseline holds what any traffic leaves.
    let clients = [
        tether_client::Client::uds(&socket).await?,
        tether_client::Client::uds(&socket).await?,
    ];
    dial_latency(&clients[0], 200).await?;
    let base = settled_rss(pid).await;
    let heap_base = heap_mib(server.health).await;
    let mut held = Vec::with_capacity(tunnels);
    while held.len() < tunnels {
        let batch = futures::future::join_all((0..500.min(tunnels - held.len())).map(|i| {
            // One HTTP/2 connection carries at most 65,536 streams.
            let client = &clients[(held.len() + i) % clients.len()];
            client.dial("10.255.0.1:80")
        }))
        .await;
        for c in batch {
            held.push(c?);
        }
    }
    let open = gauge(server.health, TUNNELS_GAUGE).await;
    let full = settled_rss(pid).await;
    let heap_full = heap_mib(server.health).await;
    let per_tunnel_kib = (full - base) * 1024.0 / tunnels as f64;
    eprintln!("{tunnels} idle tunnels over {agents} agents ({open} established): server RSS {base:.1} -> {full:.1} MiB, {per_tunnel_kib:.2} KiB per tunnel");
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(120);
    while gauge(server.health, TUNNELS_GAUGE).await > 0.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = settled_rss(pid).await;
    let heap_after = heap_mib(server.health).await;
    eprintln!("all closed: server RSS {after:.1} MiB (baseline {base:.1})");
    eprintln!(
        "server heap in use / free MiB: baseline {:.1} / {:.1}, held {:.1} / {:.1}, all closed {:.1} / {:.1}",
        heap_base.0, heap_base.1, heap_full.0, heap_full.1, heap_after.0, heap_after.1
    );
    // The client's HTTP/2 connections go too: what they held on the server goes with
    // them (h2 keeps a connection's stream store at its peak size).
    drop(clients);
    let disconnected = settled_rss(pid).await;
    let heap_disconnected = heap_mib(server.health).await;
    eprintln!(
        "client connections closed: server RSS {disconnected:.1} MiB, heap in use / free {:.1} / {:.1} MiB",
        heap_disconnected.0, heap_disconnected.1
    );
    drop(swarm);
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(json!({
        "tunnels": tunnels,
        "agents": agents,
        "server_rss_mib": {"baseline": base, "held": full, "after_close": after, "after_disconnect": disconnected},
        "server_kib_per_tunnel": per_tunnel_kib,
        "server_heap_mib": {
            "baseline": {"inuse": heap_base.0, "free": heap_base.1},
            "held": {"inuse": heap_full.0, "free": heap_full.1},
            "after_close": {"inuse": heap_after.0, "free": heap_after.1},
            "after_disconnect": {"inuse": heap_disconnected.0, "free": heap_disconnected.1},
        },
    }))
}

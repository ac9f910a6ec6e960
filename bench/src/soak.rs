//! `--soak`: an unattended churn run. Two servers (`--server-count=2`, one serving the
//! gRPC frontend and one HTTP-CONNECT, both on Unix sockets), real `tether-agent`
//! processes connected to both (a few inside network namespaces, so their link can go
//! down), and callers holding tunnels of mixed traffic to an echo target, while agents
//! are killed (SIGKILL) or drained (SIGTERM) and restarted, servers restarted, and
//! node links cut. A quarter of the run (5 to 30 s) warms up first. Afterwards every
//! gauge must be back at zero, every process back to its file descriptors before any
//! traffic and to its memory after the warm-up, and every caller must have had its
//! bytes, unaltered, or an error, within [`CALLER_BOUND`] per step.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rand::Rng;
use serde_json::{json, Value};
use tether_testkit::netns::Node;
use tether_testkit::{metric, AgentProc, Pki, ServerProc, TempDir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::args::Args;
use crate::procinfo::{stat_fields, status_mib};
use crate::procs::Tether;
use crate::report;
use crate::route::{http_connect, Conn};

/// The longest any one step of a caller (a dial, one echo exchange, the close) may
/// take before it has its bytes or an error: the dead-link timeout that ends streams
/// through a silent agent (30 s, the default of `--dead-link-timeout`), the agent's
/// dial timeout (5 s), and 10 s for a loaded 2-core machine.
pub const CALLER_BOUND: Duration = Duration::from_secs(45);

/// How long the gauges and processes get to settle once the churn stops.
const SETTLE: Duration = Duration::from_secs(120);

/// What the soak run is asked to do.
pub struct Soak {
    /// Churn for this long.
    pub duration: Duration,
    /// Agent processes.
    pub agents: usize,
    /// Callers, each holding one tunnel at a time.
    pub tunnels: usize,
    /// Agents inside network namespaces whose link is cut now and then (0 without
    /// root).
    pub partitions: usize,
    /// Run the servers with `--enable-profiling` and save their heap profiles here at
    /// the end (`go tool pprof -sample_index=inuse_space`).
    pub heap_profiles: Option<PathBuf>,
}

/// What callers saw.
#[derive(Default)]
struct Tally {
    tunnels_ok: AtomicU64,
    exchanges_ok: AtomicU64,
    bytes_echoed: AtomicU64,
    dial_errors: AtomicU64,
    io_errors: AtomicU64,
    /// A step that outlived [`CALLER_BOUND`].
    hung: AtomicU64,
    /// Bytes that came back different.
    corrupt: AtomicU64,
    /// The slowest step that ended in an error.
    slowest_error_ms: AtomicU64,
    /// The slowest step that succeeded.
    slowest_ok_ms: AtomicU64,
    samples: Mutex<Vec<String>>,
}

impl Tally {
    fn error(&self, counter: &AtomicU64, started: Instant, what: String) {
        counter.fetch_add(1, Ordering::Relaxed);
        self.slowest_error_ms
            .fetch_max(started.elapsed().as_millis() as u64, Ordering::Relaxed);
        let mut samples = self.samples.lock().unwrap();
        if samples.len() < 12 && !samples.contains(&what) {
            samples.push(what);
        }
    }
}

/// Which chaos happened how often.
#[derive(Default)]
struct Events {
    agent_kills: AtomicU64,
    agent_drains: AtomicU64,
    server_kills: AtomicU64,
    server_drains: AtomicU64,
    partitions: AtomicU64,
}

/// One server: its flags (the agent port fixed after the first start, so agents find
/// it again) and the running process, if up.
struct ServerSlot {
    args: Vec<String>,
    proc: Option<ServerProc>,
}

/// One agent: how to start it, and the running process, if up.
struct AgentSlot {
    node: Option<usize>,
    args: Vec<String>,
    proc: Option<AgentProc>,
}

struct Cluster {
    bin: PathBuf,
    agent_bin: PathBuf,
    pki: Pki,
    nodes: Vec<Node>,
    servers: Vec<tokio::sync::Mutex<ServerSlot>>,
    agents: Vec<tokio::sync::Mutex<AgentSlot>>,
    /// The frontends' sockets: gRPC, HTTP-CONNECT.
    sockets: [PathBuf; 2],
    /// Where callers dial: an echo server on the same loopback port everywhere.
    target: SocketAddr,
    _echo: (tether_testkit::backend::Backend, Vec<tether_testkit::Proc>),
    _dir: TempDir,
}

impl Cluster {
    fn start_agent(&self, slot: &AgentSlot) -> anyhow::Result<AgentProc> {
        let node = slot.node.map(|i| &self.nodes[i]);
        let (bin, pki, args) = (self.agent_bin.clone(), &self.pki, slot.args.clone());
        // `start_in` wants one server address; the list in the arguments wins.
        let any: SocketAddr = "127.0.0.1:1".parse()?;
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            AgentProc::start_in(node, &bin, pki, any, &args)
        }))
        .map_err(|_| anyhow::anyhow!("agent did not start"))
    }

    fn start_server(&self, slot: &ServerSlot) -> anyhow::Result<ServerProc> {
        let (bin, args) = (self.bin.clone(), slot.args.clone());
        std::panic::catch_unwind(|| ServerProc::start(&bin, &args))
            .map_err(|_| anyhow::anyhow!("server did not start"))
    }

    /// Every server's metrics page (empty while a server is down).
    async fn server_pages(&self) -> Vec<String> {
        let mut pages = Vec::new();
        for s in &self.servers {
            let health = s.lock().await.proc.as_ref().map(|p| p.health);
            pages.push(match health {
                Some(h) => page(h).await,
                None => String::new(),
            });
        }
        pages
    }
}

async fn page(addr: SocketAddr) -> String {
    tether_testkit::http_get(addr, "/metrics")
        .await
        .map(|(_, body)| body)
        .unwrap_or_default()
}

/// Open file descriptors, threads, anonymous resident MiB (heap and stacks: what a leak
/// grows) and all resident MiB (with the program text faulted in as code paths run) of
/// a process.
type Figures = (usize, usize, f64, f64);

/// [`Figures`] of `pid`.
fn figures(pid: u32) -> Figures {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0);
    // num_threads is field 20 of stat(5); the fields here start at field 3.
    let threads = stat_fields(pid)
        .get(17)
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    (
        fds,
        threads,
        status_mib(pid, "RssAnon"),
        status_mib(pid, "VmRSS"),
    )
}

/// `--soak`: the run `args` describe, `secs` long; prints its figures and writes them
/// to `--json`, and fails when a check did.
pub async fn run(args: &Args, t: &Tether, secs: u64) -> anyhow::Result<()> {
    let run = Soak {
        duration: Duration::from_secs(secs),
        agents: args.soak_agents.max(1),
        tunnels: args.soak_tunnels,
        partitions: args.soak_partitions,
        heap_profiles: args.soak_heap_profiles.clone(),
    };
    // Interrupted (Ctrl-C, SIGTERM), the run stops here; the runtime then drops
    // every task and with them the cluster: processes killed, namespaces removed.
    let v = tokio::select! {
        v = soak(t, run) => v?,
        () = tether_ops::shutdown::signal() => bail!("soak: stopped by SIGINT or SIGTERM; no figures"),
    };
    report::print_and_write_json(&args.json, &v)?;
    if v["passed"] != true {
        bail!("soak: a check failed: {}", v["checks"]);
    }
    Ok(())
}

/// Runs the soak and returns its figures; `Err` when the run could not be set up, and
/// `passed: false` in the figures when a check failed.
pub async fn soak(t: &Tether, soak: Soak) -> anyhow::Result<Value> {
    let cluster = Arc::new(set_up(t, &soak).await?);
    eprintln!(
        "soak: 2 servers, {} agents ({} in namespaces), {} callers, {:?}",
        soak.agents,
        cluster.nodes.len(),
        soak.tunnels,
        soak.duration
    );
    wait_connected(&cluster, soak.agents, SETTLE).await?;
    let fresh = snapshot(&cluster).await;
    let tally = Arc::new(Tally::default());
    let events = Arc::new(Events::default());

    // The warm-up: the same churn, shorter, so the memory baseline holds what the
    // allocator keeps once it has seen this load (its heap at the peak working set,
    // code paths faulted in), and the check below finds growth, not first use.
    let warm_up = (soak.duration / 4).clamp(Duration::from_secs(5), Duration::from_secs(30));
    eprintln!("soak: warming up for {warm_up:?}");
    churn(&cluster, &soak, &tally, &events, warm_up).await?;
    wait_connected(&cluster, soak.agents, SETTLE).await?;
    let _ = wait_drained(&cluster, SETTLE).await;
    settle_memory(&cluster).await;
    let baseline = snapshot(&cluster).await;

    eprintln!("soak: churning for {:?}", soak.duration);
    churn(&cluster, &soak, &tally, &events, soak.duration).await?;
    let connected = wait_connected(&cluster, soak.agents, SETTLE).await;
    let drained = wait_drained(&cluster, SETTLE).await;
    settle_memory(&cluster).await;
    let after = snapshot(&cluster).await;
    if let Some(dir) = &soak.heap_profiles {
        save_heap_profiles(&cluster, dir).await?;
    }
    let mut out = verdict(
        &soak, &tally, &events, &fresh, &baseline, &after, connected, drained,
    );
    out["agents_in_namespaces"] = json!(cluster.nodes.len());
    Ok(out)
}

/// Callers hold tunnels and the chaos steps kill, drain and cut processes for
/// `duration`; then every caller and step finishes, and every link, server and agent
/// is brought back.
async fn churn(
    cluster: &Arc<Cluster>,
    soak: &Soak,
    tally: &Arc<Tally>,
    events: &Arc<Events>,
    duration: Duration,
) -> anyhow::Result<()> {
    let stop = Arc::new(AtomicBool::new(false));
    let target = cluster.target;
    let callers: Vec<_> = (0..soak.tunnels)
        .map(|_| {
            let (cluster, tally, stop) = (cluster.clone(), tally.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    caller(&cluster, target, &tally).await;
                }
            })
        })
        .collect();
    let started = Instant::now();
    let mut chaos_tasks = Vec::new();
    let mut next_report = Instant::now() + Duration::from_secs(30);
    while started.elapsed() < duration {
        let pause = rand::rng().random_range(1000..4000);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let (cluster, events) = (cluster.clone(), events.clone());
        chaos_tasks.push(tokio::spawn(async move {
            if let Err(e) = chaos(&cluster, &events).await {
                eprintln!("soak: chaos step failed: {e:#}");
            }
        }));
        chaos_tasks.retain(|t| !t.is_finished());
        if Instant::now() >= next_report {
            next_report += Duration::from_secs(30);
            eprintln!(
                "soak: {:>4}s tunnels ok {} dial errors {} i/o errors {} hung {} corrupt {}",
                started.elapsed().as_secs(),
                tally.tunnels_ok.load(Ordering::Relaxed),
                tally.dial_errors.load(Ordering::Relaxed),
                tally.io_errors.load(Ordering::Relaxed),
                tally.hung.load(Ordering::Relaxed),
                tally.corrupt.load(Ordering::Relaxed),
            );
        }
    }
    eprintln!("soak: churn over; waiting for callers and restarts to finish");
    stop.store(true, Ordering::Relaxed);
    for t in chaos_tasks {
        let _ = t.await;
    }
    for c in callers {
        let _ = c.await;
    }
    // Everything comes back: links up, every process running.
    for n in &cluster.nodes {
        n.set_link(true);
    }
    for s in &cluster.servers {
        let mut s = s.lock().await;
        if s.proc.is_none() {
            let p = tokio::task::block_in_place(|| cluster.start_server(&s))?;
            s.proc = Some(p);
        }
    }
    for a in &cluster.agents {
        let mut a = a.lock().await;
        if a.proc.is_none() {
            let p = tokio::task::block_in_place(|| cluster.start_agent(&a))?;
            a.proc = Some(p);
        }
    }
    Ok(())
}

async fn set_up(t: &Tether, soak: &Soak) -> anyhow::Result<Cluster> {
    let partitions = if tether_testkit::netns::available() {
        soak.partitions.min(soak.agents)
    } else {
        if soak.partitions > 0 {
            eprintln!("soak: not root or no iproute2: no network namespaces, no partitions");
        }
        0
    };
    let nodes: Vec<Node> = (0..partitions).map(|_| Node::create()).collect();
    // The target is local to every agent, as a kubelet is to its node's agent: an echo
    // server on the same loopback port of the host and of every namespace, so a cut
    // link stops the agent link and nothing else.
    let echo = tether_testkit::backend::echo_on("127.0.0.1").await;
    let mut echoes = Vec::new();
    for n in &nodes {
        let me = std::env::current_exe()?.display().to_string();
        let p = n.spawn("echo", &me, &["--echo-at".into(), echo.addr.to_string()]);
        p.wait_event("echo ready", tether_testkit::process::START_TIMEOUT, |_| {
            true
        });
        echoes.push(p);
    }
    let sans: Vec<String> = nodes.iter().map(|n| n.host_ip.clone()).collect();
    let pki = Pki::with_sans(&sans);
    let dir = TempDir::new("tether-soak");
    let sockets = [
        dir.path().join("grpc.sock"),
        dir.path().join("connect.sock"),
    ];
    let bind = if nodes.is_empty() {
        "127.0.0.1"
    } else {
        "0.0.0.0"
    };
    let mut servers = Vec::new();
    let mut ports = Vec::new();
    for (i, (mode, socket)) in ["grpc", "http-connect"].iter().zip(&sockets).enumerate() {
        let mut args = tether_testkit::process::uds_frontend_args(&pki, mode, socket);
        args.extend([
            format!("--server-id=soak-server-{i}"),
            "--server-count=2".into(),
            format!("--agent-bind-address={bind}"),
        ]);
        if soak.heap_profiles.is_some() {
            args.push("--enable-profiling".into());
        }
        args.extend(t.server_extra.iter().cloned());
        let mut slot = ServerSlot { args, proc: None };
        let p = tokio::task::block_in_place(|| ServerProc::start(&t.bin, &slot.args));
        ports.push(p.agent.port());
        slot.args.push(format!("--agent-port={}", p.agent.port()));
        slot.proc = Some(p);
        servers.push(tokio::sync::Mutex::new(slot));
    }
    let mut cluster = Cluster {
        bin: t.bin.clone(),
        agent_bin: t.agent_bin.clone(),
        pki,
        nodes,
        servers,
        agents: Vec::new(),
        sockets,
        target: echo.addr,
        _echo: (echo, echoes),
        _dir: dir,
    };
    for i in 0..soak.agents {
        let node = (i < partitions).then_some(i);
        let host = node.map_or("127.0.0.1".into(), |k| cluster.nodes[k].host_ip.clone());
        let mut args = vec![
            format!("--agent-id=soak-agent-{i}"),
            format!(
                "--proxy-server-host={host}:{},{host}:{}",
                ports[0], ports[1]
            ),
            // A drained agent serves until its drain timeout (as upstream's until its
            // second signal); 5 s keeps the churn's rhythm.
            "--drain-timeout=5s".into(),
        ];
        if let Some(k) = node {
            args.push(format!("--health-server-host={}", cluster.nodes[k].link_ip));
        }
        let mut slot = AgentSlot {
            node,
            args,
            proc: None,
        };
        slot.proc = Some(tokio::task::block_in_place(|| cluster.start_agent(&slot))?);
        cluster.agents.push(tokio::sync::Mutex::new(slot));
    }
    Ok(cluster)
}

/// Waits until every agent holds a stream to both servers.
async fn wait_connected(cluster: &Cluster, agents: usize, within: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let pages = cluster.server_pages().await;
        let counts: Vec<f64> = pages
            .iter()
            .map(|p| {
                metric(
                    p,
                    "konnectivity_network_proxy_server_ready_backend_connections",
                )
                .unwrap_or(0.0)
            })
            .collect();
        if counts.iter().all(|c| *c == agents as f64) {
            return Ok(());
        }
        if Instant::now() > deadline {
            anyhow::bail!("agents connected per server after {within:?}: {counts:?} of {agents}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The gauges that must be zero once no caller holds a tunnel: per server, per agent.
const SERVER_GAUGES: [&str; 4] = [
    "konnectivity_network_proxy_server_established_connections",
    "konnectivity_network_proxy_server_pending_backend_dials",
    "konnectivity_network_proxy_server_http_connections",
    "konnectivity_network_proxy_server_grpc_connections{service_method=\"Proxy\"}",
];
const AGENT_GAUGE: &str = "konnectivity_network_proxy_agent_open_endpoint_connections";

/// Waits until every tunnel gauge is zero; returns what they were at the end.
async fn wait_drained(cluster: &Cluster, within: Duration) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let mut nonzero = Vec::new();
        for (i, page) in cluster.server_pages().await.iter().enumerate() {
            for name in SERVER_GAUGES {
                let v = metric(page, name).unwrap_or(0.0);
                if v != 0.0 {
                    nonzero.push(json!({"server": i, "gauge": name, "value": v}));
                }
            }
        }
        for (i, a) in cluster.agents.iter().enumerate() {
            let health = a.lock().await.proc.as_ref().map(|p| p.health);
            let Some(health) = health else { continue };
            let v = metric(&page(health).await, AGENT_GAUGE).unwrap_or(f64::NAN);
            if v != 0.0 {
                nonzero.push(json!({"agent": i, "gauge": AGENT_GAUGE, "value": v}));
            }
        }
        if nonzero.is_empty() || Instant::now() > deadline {
            return Value::Array(nonzero);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Lets every process go idle long enough to hand free memory back (two trim
/// intervals), then waits until the servers' anonymous RSS (what the check compares)
/// stops falling (15 s at most).
async fn settle_memory(cluster: &Cluster) {
    tokio::time::sleep(Duration::from_secs(5)).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last = f64::MAX;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let mut now = 0.0;
        for s in &cluster.servers {
            if let Some(p) = &s.lock().await.proc {
                now += status_mib(p.proc.pid(), "RssAnon");
            }
        }
        if now >= last || Instant::now() > deadline {
            return;
        }
        last = now;
    }
}

/// Saves each server's heap profile as `DIR/server-N.pb.gz`.
async fn save_heap_profiles(cluster: &Cluster, dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (i, s) in cluster.servers.iter().enumerate() {
        let Some(admin) = s.lock().await.proc.as_ref().map(|p| p.admin) else {
            continue;
        };
        let file = dir.join(format!("server-{i}.pb.gz"));
        let ok = std::process::Command::new("curl")
            .args(["-sf", "-o"])
            .arg(&file)
            .arg(format!("http://{admin}/debug/pprof/heap"))
            .status()?
            .success();
        anyhow::ensure!(ok, "could not fetch the heap profile of server {i}");
        eprintln!("soak: heap profile of server {i} in {}", file.display());
    }
    Ok(())
}

/// File descriptors, threads and RSS of each server and agent.
struct Snapshot {
    servers: Vec<Figures>,
    agents: Vec<Figures>,
}

async fn snapshot(cluster: &Cluster) -> Snapshot {
    let mut servers = Vec::new();
    for s in &cluster.servers {
        let pid = s.lock().await.proc.as_ref().map(|p| p.proc.pid());
        servers.push(pid.map_or((0, 0, 0.0, 0.0), figures));
    }
    let mut agents = Vec::new();
    for a in &cluster.agents {
        let pid = a.lock().await.proc.as_ref().map(|p| p.proc.pid());
        agents.push(pid.map_or((0, 0, 0.0, 0.0), figures));
    }
    Snapshot { servers, agents }
}

/// One caller: a tunnel through either frontend, 1 to 8 echo exchanges of mixed sizes
/// with pauses between, then close. Every step ends within [`CALLER_BOUND`].
async fn caller(cluster: &Cluster, target: SocketAddr, tally: &Tally) {
    let grpc = rand::rng().random_bool(0.5);
    let frontend = if grpc { "grpc" } else { "http-connect" };
    let started = Instant::now();
    let dial = async {
        if grpc {
            let client = tether_client::Client::uds(&cluster.sockets[0]).await?;
            let conn = client.dial(&target.to_string()).await?;
            // The tunnel keeps the HTTP/2 connection; the client handle may go.
            Ok::<Conn, anyhow::Error>(Box::pin(conn))
        } else {
            http_connect(&cluster.sockets[1], target).await
        }
    };
    let mut conn = match tokio::time::timeout(CALLER_BOUND, dial).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            return tally.error(
                &tally.dial_errors,
                started,
                format!("{frontend} dial: {e:#}"),
            )
        }
        Err(_) => {
            return tally.error(&tally.hung, started, format!("{frontend} dial: hung"));
        }
    };
    tally
        .slowest_ok_ms
        .fetch_max(started.elapsed().as_millis() as u64, Ordering::Relaxed);
    let exchanges = rand::rng().random_range(1..=8);
    for _ in 0..exchanges {
        let (size, pause) = {
            let mut rng = rand::rng();
            let size = match rng.random_range(0..100) {
                0 => 1 << 20,
                1..=9 => rng.random_range(16_384..131_072),
                _ => rng.random_range(1..4096),
            };
            (size, rng.random_range(0..1500))
        };
        let mut sent = vec![0u8; size];
        rand::rng().fill(&mut sent[..]);
        let started = Instant::now();
        let exchange = async {
            let (mut r, mut w) = tokio::io::split(&mut conn);
            let mut got = vec![0u8; size];
            tokio::try_join!(w.write_all(&sent), r.read_exact(&mut got))?;
            Ok::<_, std::io::Error>(got)
        };
        match tokio::time::timeout(CALLER_BOUND, exchange).await {
            Ok(Ok(got)) if got == sent => {
                tally.exchanges_ok.fetch_add(1, Ordering::Relaxed);
                tally.bytes_echoed.fetch_add(size as u64, Ordering::Relaxed);
                tally
                    .slowest_ok_ms
                    .fetch_max(started.elapsed().as_millis() as u64, Ordering::Relaxed);
            }
            Ok(Ok(_)) => {
                return tally.error(
                    &tally.corrupt,
                    started,
                    format!("{frontend}: {size} bytes came back altered"),
                )
            }
            Ok(Err(e)) => {
                return tally.error(&tally.io_errors, started, format!("{frontend}: {e}"))
            }
            Err(_) => {
                return tally.error(
                    &tally.hung,
                    started,
                    format!("{frontend}: {size}-byte exchange hung"),
                )
            }
        }
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    let started = Instant::now();
    match tokio::time::timeout(CALLER_BOUND, conn.shutdown()).await {
        Ok(_) => {
            tally.tunnels_ok.fetch_add(1, Ordering::Relaxed);
        }
        Err(_) => tally.error(&tally.hung, started, format!("{frontend}: close hung")),
    }
}

/// One chaos event, chosen at random; an agent or server already being restarted is
/// left alone, and at most one server is down at a time.
async fn chaos(cluster: &Cluster, events: &Events) -> anyhow::Result<()> {
    let (pick, agent, server) = {
        let mut rng = rand::rng();
        (
            rng.random_range(0..100),
            rng.random_range(0..cluster.agents.len()),
            rng.random_range(0..cluster.servers.len()),
        )
    };
    match pick {
        0..=59 => {
            let Ok(mut slot) = cluster.agents[agent].try_lock() else {
                return Ok(());
            };
            let Some(mut p) = slot.proc.take() else {
                return Ok(());
            };
            let counter = if pick < 40 {
                &events.agent_kills
            } else {
                &events.agent_drains
            };
            counter.fetch_add(1, Ordering::Relaxed);
            stop_process(&mut p.proc, pick < 40, "agent")?;
            slot.proc = Some(tokio::task::block_in_place(|| cluster.start_agent(&slot))?);
        }
        60..=79 => {
            // At most one server down: the other is busy if it is being restarted.
            let mut others = Vec::new();
            for (i, s) in cluster.servers.iter().enumerate() {
                if i != server {
                    match s.try_lock() {
                        Ok(g) => others.push(g),
                        Err(_) => return Ok(()),
                    }
                }
            }
            let Ok(mut slot) = cluster.servers[server].try_lock() else {
                return Ok(());
            };
            let Some(mut p) = slot.proc.take() else {
                return Ok(());
            };
            let counter = if pick < 70 {
                &events.server_kills
            } else {
                &events.server_drains
            };
            counter.fetch_add(1, Ordering::Relaxed);
            stop_process(&mut p.proc, pick < 70, "server")?;
            slot.proc = Some(tokio::task::block_in_place(|| cluster.start_server(&slot))?);
            drop(others);
        }
        _ => {
            let Some(k) = (!cluster.nodes.is_empty())
                .then(|| rand::rng().random_range(0..cluster.nodes.len()))
            else {
                return Ok(());
            };
            // The agent's slot stands for its node: no restart while it is cut off.
            let Ok(_slot) = cluster.agents[k].try_lock() else {
                return Ok(());
            };
            events.partitions.fetch_add(1, Ordering::Relaxed);
            let cut = Duration::from_secs(rand::rng().random_range(5..45));
            cluster.nodes[k].set_link(false);
            tokio::time::sleep(cut).await;
            cluster.nodes[k].set_link(true);
        }
    }
    Ok(())
}

/// Stops `p`: SIGKILL (`kill`), or SIGTERM and wait for its exit (an agent's at its
/// --drain-timeout, 5 s here; a server's when its tunnels end or at its graceful
/// shutdown timeout).
fn stop_process(p: &mut tether_testkit::Proc, kill: bool, what: &str) -> anyhow::Result<()> {
    if kill {
        p.kill();
        return Ok(());
    }
    p.signal("TERM");
    tokio::task::block_in_place(|| p.wait_exit(Duration::from_secs(40)))
        .with_context(|| format!("{what} did not exit within its drain timeout"))?;
    Ok(())
}

/// Memory is back to baseline when the anonymous resident memory is within a quarter
/// (plus 4 MiB: glibc keeps some free heap in each thread's arena) of what the process
/// held after the warm-up. Against a fresh process this would count the allocator's
/// heap at the peak working set (each hole between live objects keeps a page), which a
/// longer run does not grow: that is first use, not a leak. Program text is left out:
/// the churn runs code (handshake failures, restarts, drains) a fresh process has not
/// faulted in yet, and those pages are the binary's, shared and reclaimable, not memory
/// the process holds.
fn back_to_baseline(before: f64, after: f64) -> bool {
    after <= before * 1.25 + 4.0
}

/// `fresh` is before any traffic (descriptors are compared with it), `before` after the
/// warm-up (memory is compared with it).
#[allow(clippy::too_many_arguments)]
fn verdict(
    soak: &Soak,
    tally: &Tally,
    events: &Events,
    fresh: &Snapshot,
    before: &Snapshot,
    after: &Snapshot,
    connected: anyhow::Result<()>,
    gauges_left: Value,
) -> Value {
    let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let sum = |v: &[Figures]| {
        v.iter()
            .fold((0, 0, 0.0, 0.0), |(f, t, a, r), (f2, t2, a2, r2)| {
                (f + f2, t + t2, a + a2, r + r2)
            })
    };
    let fds_leaked = |before: &[Figures], after: &[Figures]| {
        before
            .iter()
            .zip(after)
            .map(|(b, a)| (a.0 as i64 - b.0 as i64).max(0))
            .sum::<i64>()
    };
    let server_fds_leaked = fds_leaked(&fresh.servers, &after.servers);
    let agent_fds_leaked = fds_leaked(&fresh.agents, &after.agents);
    let server_memory_back = before
        .servers
        .iter()
        .zip(&after.servers)
        .all(|(b, a)| back_to_baseline(b.2, a.2));
    let (af, ab, aa) = (sum(&fresh.agents), sum(&before.agents), sum(&after.agents));
    let checks = json!({
        "no caller hung past the bound": n(&tally.hung) == 0,
        "no bytes altered": n(&tally.corrupt) == 0,
        "every agent reconnected to both servers": connected.is_ok(),
        "gauges back to zero": gauges_left.as_array().is_some_and(|g| g.is_empty()),
        "no leaked file descriptor": server_fds_leaked == 0 && agent_fds_leaked == 0,
        "server memory back to baseline": server_memory_back,
        "agent memory back to baseline": back_to_baseline(ab.2, aa.2),
        "traffic flowed": n(&tally.tunnels_ok) > 0,
    });
    let passed = checks
        .as_object()
        .is_some_and(|c| c.values().all(|v| v == true));
    let per = |v: &[Figures]| -> Value {
        v.iter()
            .map(|(f, t, a, r)| json!({"fds": f, "threads": t, "anon_rss_mib": (a * 10.0).round() / 10.0, "rss_mib": (r * 10.0).round() / 10.0}))
            .collect()
    };
    json!({
        "passed": passed,
        "checks": checks,
        "duration_s": soak.duration.as_secs(),
        "agents": soak.agents,
        "callers": soak.tunnels,
        "caller_bound_s": CALLER_BOUND.as_secs(),
        "callers_saw": {
            "tunnels_ok": n(&tally.tunnels_ok),
            "exchanges_ok": n(&tally.exchanges_ok),
            "mib_echoed": n(&tally.bytes_echoed) as f64 / 1048576.0,
            "dial_errors": n(&tally.dial_errors),
            "io_errors": n(&tally.io_errors),
            "hung": n(&tally.hung),
            "corrupt": n(&tally.corrupt),
            "slowest_error_s": n(&tally.slowest_error_ms) as f64 / 1000.0,
            "slowest_ok_step_s": n(&tally.slowest_ok_ms) as f64 / 1000.0,
            "error_samples": tally.samples.lock().unwrap().clone(),
        },
        "chaos": {
            "agent_kills": n(&events.agent_kills),
            "agent_drains": n(&events.agent_drains),
            "server_kills": n(&events.server_kills),
            "server_drains": n(&events.server_drains),
            "partitions": n(&events.partitions),
        },
        "reconnected": connected.err().map(|e| e.to_string()),
        "gauges_not_zero": gauges_left,
        "servers_fresh": per(&fresh.servers),
        "servers_before": per(&before.servers),
        "servers_after": per(&after.servers),
        "agents_fresh": {"fds": af.0, "threads": af.1, "anon_rss_mib": af.2, "rss_mib": af.3},
        "agents_before": {"fds": ab.0, "threads": ab.1, "anon_rss_mib": ab.2, "rss_mib": ab.3},
        "agents_after": {"fds": aa.0, "threads": aa.1, "anon_rss_mib": aa.2, "rss_mib": aa.3},
        "fds_leaked": {"servers": server_fds_leaked, "agents": agent_fds_leaked},
    })
}

/// `--echo-at`: an echo server for the agents of one node's namespace.
pub async fn echo_at(at: SocketAddr) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(at).await?;
    eprintln!(
        "{}",
        json!({"message": "echo ready", "addr": at.to_string()})
    );
    loop {
        let (s, _) = listener.accept().await?;
        tokio::spawn(async move {
            let (mut r, mut w) = s.into_split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
        });
    }
}

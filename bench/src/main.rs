//! `tether-bench`: starts a Tether server and agent (mutual TLS on the agent link, real
//! processes) and a backend on loopback, then measures, through each frontend (gRPC
//! over UDS with the Rust client, HTTP-CONNECT over UDS), a direct connection and an
//! OpenSSH `ssh -L` forward: throughput, round-trip latency, new-connection latency,
//! dial rate, and the server's and agent's resident memory holding idle tunnels. A
//! fifth column, two plain TCP relays in a chain (no TLS, no framing, one thread each),
//! is the floor: what any proxy with a server and an agent between client and target
//! could reach on this machine. A sixth, `tether ccm` LoadBalancer, is one Service's
//! balancer (the CCM's own code, in a process of its own) in front of the gRPC route:
//! client -> balancer -> server -> agent -> backend, beside the server alone.
//! Rounds are interleaved and medians reported; every figure is also a ratio to direct.

mod soak;
mod swarm;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use serde_json::{json, Value};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Benchmark Tether against a direct connection and ssh -L.
#[derive(Parser, Debug)]
struct Args {
    /// Bytes per single-connection transfer, in MiB.
    #[arg(long, default_value_t = 512)]
    size_mib: u64,
    /// Interleaved rounds (medians are reported).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Idle tunnels held for the memory figures (also measured at 1,000).
    #[arg(long, default_value_t = 10_000)]
    idle_conns: usize,
    /// Write the figures as JSON here.
    #[arg(long, default_value = "bench-results.json")]
    json: PathBuf,
    /// The tether binary, which runs the servers (default: next to this one).
    #[arg(long)]
    tether: Option<PathBuf>,
    /// The agent binary the DaemonSet runs (default: `tether-agent` next to the tether
    /// binary).
    #[arg(long)]
    tether_agent: Option<PathBuf>,
    /// One more flag for every `tether server` this run starts (repeatable; the route
    /// table's, `--agents`', `--tunnels`' and `--soak`'s), e.g.
    /// `--server-arg=--worker-threads=1`.
    #[arg(long, allow_hyphen_values = true)]
    server_arg: Vec<String>,
    /// Skip the ssh -L comparison.
    #[arg(long)]
    no_ssh: bool,
    /// Only these measurements (comma-separated: download, upload, parallel, rtt,
    /// newconn, newconn-spaced, dialrate, fairness); all by default.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Skip the two-relay floor.
    #[arg(long)]
    no_relay: bool,
    /// Skip the gRPC route (e.g. to count the server's system calls for one route).
    #[arg(long)]
    no_grpc: bool,
    /// Skip the HTTP-CONNECT route.
    #[arg(long)]
    no_http_connect: bool,
    /// Skip the CCM load-balancer route.
    #[arg(long)]
    no_lb: bool,
    /// (internal) Run as one CCM load balancer forwarding to this NodePort target
    /// through `--lb-tunnel-uds`: print the listening port, then serve.
    #[arg(long, hide = true)]
    lb_to: Option<SocketAddr>,
    /// (internal) The gRPC frontend socket for `--lb-to`.
    #[arg(long, hide = true)]
    lb_tunnel_uds: Option<PathBuf>,
    /// (internal) Run as a plain TCP relay to this address: print the listening port,
    /// then forward every connection.
    #[arg(long, hide = true)]
    relay_to: Option<SocketAddr>,
    /// Many agents instead of the route table: this many agent streams (swarm
    /// processes speaking the agent protocol) on one server: memory per stream, idle
    /// CPU, dial latency beside one agent, and the reconnect storm after a restart.
    #[arg(long)]
    agents: Option<usize>,
    /// Swarm processes sharing `--agents`.
    #[arg(long, default_value_t = 4)]
    agent_procs: usize,
    /// Many tunnels instead of the route table: this many idle tunnels over
    /// `--tunnel-agents` agents: server memory per tunnel, and after they close.
    #[arg(long)]
    tunnels: Option<usize>,
    /// Agents carrying `--tunnels`.
    #[arg(long, default_value_t = 100)]
    tunnel_agents: usize,
    /// A soak run instead of the route table: churn for this many seconds (180 if
    /// given without a value) with agents and servers killed and restarted and node
    /// links cut, then check that everything came back and nothing leaked. Exits
    /// non-zero when a check fails.
    #[arg(long, num_args = 0..=1, default_missing_value = "180")]
    soak: Option<u64>,
    /// Agent processes in the soak run.
    #[arg(long, default_value_t = 100)]
    soak_agents: usize,
    /// Callers in the soak run, each holding one tunnel at a time.
    #[arg(long, default_value_t = 1000)]
    soak_tunnels: usize,
    /// Soak agents inside network namespaces whose link is cut now and then (needs
    /// root and iproute2).
    #[arg(long, default_value_t = 4)]
    soak_partitions: usize,
    /// Run the soak's servers with `--enable-profiling` and save their heap profiles
    /// in this directory at the end.
    #[arg(long)]
    soak_heap_profiles: Option<PathBuf>,
    /// (internal) Run as an echo server on this address (inside a soak node's
    /// namespace): log `echo ready` as JSON, then echo every connection.
    #[arg(long, hide = true)]
    echo_at: Option<SocketAddr>,
    /// (internal) Run as a swarm of agents connecting to this server address.
    #[arg(long, hide = true)]
    swarm_to: Option<SocketAddr>,
    /// (internal) The swarm's PKI directory.
    #[arg(long, hide = true)]
    swarm_pki: Option<PathBuf>,
    /// (internal) The swarm's first agent number.
    #[arg(long, hide = true, default_value_t = 0)]
    swarm_first: usize,
    /// (internal) How many agents the swarm holds.
    #[arg(long, hide = true, default_value_t = 0)]
    swarm_count: usize,
}

trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}
type Conn = Pin<Box<dyn Io>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Direct,
    GrpcUds,
    HttpConnectUds,
    Ssh,
    Relay,
    /// The tunnel with one plain relay behind it: the LB route's floor (as many TCP
    /// connections, the cheapest possible hop in place of the balancer).
    GrpcRelay,
    LoadBalancer,
}

impl Route {
    fn name(self) -> &'static str {
        match self {
            Route::Direct => "direct",
            Route::GrpcUds => "tether grpc/uds",
            Route::HttpConnectUds => "tether http-connect/uds",
            Route::Ssh => "ssh -L",
            Route::Relay => "2 plain relays (floor)",
            Route::GrpcRelay => "grpc/uds + 1 relay",
            Route::LoadBalancer => "ccm LB + grpc/uds",
        }
    }
}

/// A child process killed on drop.
struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

struct Env {
    backend: SocketAddr,
    connect_socket: PathBuf,
    client: tether_client::Client,
    ssh_port: Option<u16>,
    relay_port: Option<u16>,
    lb_port: Option<u16>,
    /// One plain relay in front of the backend (the LB route's floor).
    backend_relay_port: Option<u16>,
    grpc_server_pid: u32,
    grpc_agent_pid: u32,
    grpc_health: SocketAddr,
    /// The processes carrying each route's bytes (server and agent; ssh and sshd).
    carriers: Vec<(Route, Vec<u32>)>,
    _procs: Vec<Proc>,
}

/// `/proc/PID/stat` fields after the command name (which may hold spaces).
fn stat_fields(pid: u32) -> Vec<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// User plus system CPU seconds of `pid` (clock ticks are 1/100 s on Linux).
fn cpu_seconds(pid: u32) -> f64 {
    let f = stat_fields(pid);
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields 14 and 15 of stat(5), counted from the state field (3).
    (ticks(11) + ticks(12)) / 100.0
}

/// `pids` and every process below them.
fn with_descendants(pids: &[u32]) -> Vec<u32> {
    let mut all = pids.to_vec();
    let procs: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(|pid| Some((pid, stat_fields(pid).get(1)?.parse().ok()?)))
                .collect()
        })
        .unwrap_or_default();
    let mut i = 0;
    while i < all.len() {
        let parent = all[i];
        all.extend(
            procs
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    all
}

impl Env {
    /// Whether `route`'s bytes go through the benched agent.
    fn carries_agent(&self, route: Route) -> bool {
        self.carriers
            .iter()
            .any(|(r, p)| *r == route && p.contains(&self.grpc_agent_pid))
    }

    /// CPU time (seconds) the processes carrying `route` have used so far, their
    /// children included (sshd forks one per session).
    fn carrier_cpu(&self, route: Route) -> f64 {
        let pids = self
            .carriers
            .iter()
            .find(|(r, _)| *r == route)
            .map(|(_, p)| p.clone())
            .unwrap_or_default();
        with_descendants(&pids).into_iter().map(cpu_seconds).sum()
    }

    async fn connect(&self, route: Route, target: SocketAddr) -> anyhow::Result<Conn> {
        Ok(match route {
            Route::Direct => {
                let s = tokio::net::TcpStream::connect(target).await?;
                s.set_nodelay(true)?;
                Box::pin(s)
            }
            Route::GrpcUds => Box::pin(self.client.dial(&target.to_string()).await?),
            Route::GrpcRelay => {
                let port = self.backend_relay_port.context("relay not set up")?;
                Box::pin(self.client.dial(&format!("127.0.0.1:{port}")).await?)
            }
            Route::HttpConnectUds => http_connect(&self.connect_socket, target).await?,
            Route::Ssh | Route::Relay | Route::LoadBalancer => {
                let port = match route {
                    Route::Ssh => self.ssh_port.context("ssh not set up")?,
                    Route::Relay => self.relay_port.context("relays not set up")?,
                    _ => self.lb_port.context("load balancer not set up")?,
                };
                let s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
                s.set_nodelay(true)?;
                Box::pin(s)
            }
        })
    }
}

/// Opens a tunnel to `target` through the HTTP-CONNECT frontend on the Unix socket
/// `socket`, reading the answer buffered as kube-apiserver does (not a byte per read).
async fn http_connect(socket: &Path, target: SocketAddr) -> anyhow::Result<Conn> {
    let mut s = tokio::net::UnixStream::connect(socket).await?;
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await?;
    // The backend never speaks first, so nothing can follow the head yet.
    let mut head = Vec::with_capacity(256);
    let mut b = [0u8; 256];
    let end = loop {
        let n = s.read(&mut b).await?;
        if n == 0 {
            bail!("CONNECT: closed");
        }
        head.extend_from_slice(&b[..n]);
        if head.len() > 4096 {
            bail!("CONNECT: answer head over 4 KiB");
        }
        if let Some(i) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    if !head.starts_with(b"HTTP/1.1 200") {
        bail!("CONNECT: {:?}", String::from_utf8_lossy(&head));
    }
    if end != head.len() {
        bail!(
            "CONNECT: bytes after the answer {:?}",
            String::from_utf8_lossy(&head)
        );
    }
    Ok(Box::pin(s))
}

// === backend ===

/// Bytes the backend has written to 'S' (stalled-reader) connections.
static STALLED_WRITTEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// 'D' n: sends n bytes; 'U' n: reads n bytes, answers one byte; 'S': sends until the
/// connection closes, counting into `STALLED_WRITTEN`; 'E': echoes.
async fn backend() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let _ = s.set_nodelay(true);
            tokio::spawn(async move {
                let mut cmd = [0u8; 1];
                if s.read_exact(&mut cmd).await.is_err() {
                    return;
                }
                match cmd[0] {
                    b'S' => {
                        let buf = vec![0x53u8; 64 * 1024];
                        while let Ok(n) = s.write(&buf).await {
                            if n == 0 {
                                break;
                            }
                            STALLED_WRITTEN
                                .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                    b'D' | b'U' => {
                        let Ok(n) = s.read_u64().await else { return };
                        let mut buf = vec![0x42u8; 256 * 1024];
                        let mut left = n;
                        while left > 0 {
                            let k = left.min(buf.len() as u64) as usize;
                            let r = if cmd[0] == b'D' {
                                s.write_all(&buf[..k]).await.map(|_| k)
                            } else {
                                s.read(&mut buf[..k]).await
                            };
                            match r {
                                Ok(0) | Err(_) => return,
                                Ok(got) => left -= got as u64,
                            }
                        }
                        if cmd[0] == b'U' {
                            let _ = s.write_all(b"k").await;
                        }
                        let _ = s.flush().await;
                        let mut rest = [0u8; 1];
                        let _ = s.read(&mut rest).await;
                    }
                    _ => {
                        let (mut r, mut w) = s.split();
                        let _ = tokio::io::copy(&mut r, &mut w).await;
                    }
                }
            });
        }
    });
    addr
}

// === measurements ===

async fn download(env: &Env, route: Route, n: u64) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut c = env.connect(route, env.backend).await?;
    c.write_all(b"D").await?;
    c.write_u64(n).await?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut left = n;
    while left > 0 {
        let got = c.read(&mut buf).await?;
        if got == 0 {
            bail!("{}: closed with {left} bytes left", route.name());
        }
        left -= got as u64;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

async fn upload(env: &Env, route: Route, n: u64) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut c = env.connect(route, env.backend).await?;
    c.write_all(b"U").await?;
    c.write_u64(n).await?;
    let buf = vec![0x17u8; 256 * 1024];
    let mut left = n;
    while left > 0 {
        let k = left.min(buf.len() as u64) as usize;
        c.write_all(&buf[..k]).await?;
        left -= k as u64;
    }
    let mut ack = [0u8; 1];
    c.read_exact(&mut ack).await?;
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

async fn parallel(env: &Arc<Env>, route: Route, n: u64, conns: usize) -> anyhow::Result<f64> {
    let start = Instant::now();
    let each = n / conns as u64;
    let results = futures::future::join_all((0..conns).map(|_| {
        let env = env.clone();
        async move { download(&env, route, each).await }
    }))
    .await;
    for r in results {
        r?;
    }
    Ok((each * conns as u64) as f64 / start.elapsed().as_secs_f64())
}

/// Fairness: the aggregate download throughput of 8 busy connections beside one whose
/// reader has stopped, as a fraction of the same 8 alone; and how many bytes the
/// stalled connection's target could write before everything in between was full.
async fn fairness(env: &Arc<Env>, route: Route, n: u64) -> anyhow::Result<(f64, f64)> {
    use std::sync::atomic::Ordering;
    let alone = parallel(env, route, n, 8).await?;
    let before = STALLED_WRITTEN.load(Ordering::Relaxed);
    let mut stalled = env.connect(route, env.backend).await?;
    stalled.write_all(b"S").await?;
    // Let the stalled connection fill every buffer on its path first.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = STALLED_WRITTEN.load(Ordering::Relaxed);
        if now == last || Instant::now() > deadline {
            break;
        }
        last = now;
    }
    let beside = parallel(env, route, n, 8).await?;
    let buffered = STALLED_WRITTEN.load(Ordering::Relaxed) - before;
    drop(stalled);
    Ok((beside / alone, buffered as f64 / 1048576.0))
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// The p50 and p99 of `samples`.
fn p50_p99(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    (percentile(&samples, 0.5), percentile(&samples, 0.99))
}

async fn rtt(env: &Env, route: Route, iters: usize) -> anyhow::Result<(f64, f64)> {
    let mut c = env.connect(route, env.backend).await?;
    c.write_all(b"E").await?;
    let msg = [7u8; 64];
    let mut buf = [0u8; 64];
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters + 50 {
        let t = Instant::now();
        c.write_all(&msg).await?;
        c.read_exact(&mut buf).await?;
        if i >= 50 {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(p50_p99(samples))
}

async fn one_new_connection(env: &Env, route: Route) -> anyhow::Result<f64> {
    let t = Instant::now();
    let mut c = env.connect(route, env.backend).await?;
    c.write_all(b"Ex").await?;
    let mut b = [0u8; 1];
    c.read_exact(&mut b).await?;
    drop(c);
    Ok(t.elapsed().as_secs_f64() * 1e6)
}

/// The p50 and p99 of `iters` new connections, one after another or with `gap`
/// between them (by then the last one's close has been carried out everywhere and
/// every process on the path has gone idle, as between an apiserver's occasional
/// `kubectl logs`).
async fn new_connections(
    env: &Env,
    route: Route,
    iters: usize,
    gap: Option<Duration>,
) -> anyhow::Result<(f64, f64)> {
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        samples.push(one_new_connection(env, route).await?);
        if let Some(gap) = gap {
            tokio::time::sleep(gap).await;
        }
    }
    Ok(p50_p99(samples))
}

async fn dial_rate(
    env: &Arc<Env>,
    route: Route,
    clients: usize,
    for_how_long: Duration,
) -> anyhow::Result<f64> {
    let start = Instant::now();
    let results = futures::future::join_all((0..clients).map(|_| {
        let env = env.clone();
        async move {
            let mut n = 0u64;
            while start.elapsed() < for_how_long {
                one_new_connection(&env, route).await?;
                n += 1;
            }
            Ok::<_, anyhow::Error>(n)
        }
    }))
    .await;
    let mut total = 0;
    for r in results {
        total += r?;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

fn mib(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

/// One field of `/proc/PID/status` (kB there), in MiB.
fn status_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

/// Resident memory of server and agent with `tunnels` held: the total (VmRSS) and its
/// anonymous part (heap and stacks; the rest is mapped program text).
fn memory_point(env: &Env, tunnels: Value) -> Value {
    let (s, a) = (env.grpc_server_pid, env.grpc_agent_pid);
    json!({
        "tunnels": tunnels,
        "server_mib": status_mib(s, "VmRSS"),
        "agent_mib": status_mib(a, "VmRSS"),
        "server_anon_mib": status_mib(s, "RssAnon"),
        "agent_anon_mib": status_mib(a, "RssAnon"),
    })
}

async fn established(env: &Env) -> f64 {
    let Ok(mut s) = tokio::net::TcpStream::connect(env.grpc_health).await else {
        return f64::NAN;
    };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await;
    let mut page = String::new();
    let _ = s.read_to_string(&mut page).await;
    page.lines()
        .find_map(|l| l.strip_prefix("konnectivity_network_proxy_server_established_connections "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

async fn settle(env: &Env, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while established(env).await != want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Lets server and agent idle for 5 s (two of their trim intervals), then waits until
/// neither RSS fell during the last second (at most 15 s in all): they give memory
/// back a few seconds after a burst ends.
async fn settle_rss(env: &Env) {
    tokio::time::sleep(Duration::from_secs(4)).await;
    let deadline = Instant::now() + Duration::from_secs(11);
    let mut last = (f64::MAX, f64::MAX);
    loop {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let now = (
            status_mib(env.grpc_server_pid, "VmRSS"),
            status_mib(env.grpc_agent_pid, "VmRSS"),
        );
        if (now.0 >= last.0 && now.1 >= last.1) || Instant::now() > deadline {
            return;
        }
        last = now;
    }
}

/// RSS of server and agent at idle, holding 1,000 and `max` idle tunnels, and after
/// they close; twice, to show whether memory grows across rounds.
async fn memory(env: &Env, max: usize) -> anyhow::Result<Value> {
    let mut rounds = Vec::new();
    for _ in 0..2 {
        // Idle means a few seconds after the last traffic: both processes give free
        // heap back by then.
        settle_rss(env).await;
        let mut held = Vec::with_capacity(max);
        let mut points = vec![memory_point(env, json!(0))];
        for target in [1_000usize.min(max), max] {
            while held.len() < target {
                let batch: Vec<_> = futures::future::join_all(
                    (held.len()..target.min(held.len() + 200)).map(|_| async {
                        let mut c = env.connect(Route::GrpcUds, env.backend).await?;
                        c.write_all(b"E").await?;
                        Ok::<_, anyhow::Error>(c)
                    }),
                )
                .await;
                for c in batch {
                    held.push(c?);
                }
            }
            settle(env, target as f64).await;
            points.push(memory_point(env, json!(target)));
        }
        drop(held);
        settle(env, 0.0).await;
        settle_rss(env).await;
        points.push(memory_point(env, json!("closed")));
        rounds.push(Value::Array(points));
    }
    Ok(Value::Array(rounds))
}

// === set-up ===

fn spawn_tether(bin: &Path, args: &[String]) -> anyhow::Result<(Proc, Value)> {
    let mut child = Command::new(bin)
        .args(args)
        .arg("--log-format=json")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                let _ = tx.send(v);
            }
        }
    });
    let proc = Proc(child);
    loop {
        let v = rx
            .recv_timeout(Duration::from_secs(20))
            .context("tether did not report readiness")?;
        if v["message"] == "server listening" || v["message"] == "agent starting" {
            return Ok((proc, v));
        }
    }
}

fn wait_connected(health: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ok = std::net::TcpStream::connect(health).ok().and_then(|mut s| {
            use std::io::{Read, Write};
            s.write_all(b"GET /readyz HTTP/1.0\r\n\r\n").ok()?;
            let mut r = String::new();
            s.read_to_string(&mut r).ok()?;
            (r.split_whitespace().nth(1) == Some("200")).then_some(())
        });
        if ok.is_some() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("agent did not connect");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The binaries under test, and the flags every server they run is given.
pub(crate) struct Tether {
    /// Runs the servers (`--tether`).
    pub(crate) bin: PathBuf,
    /// The agent the DaemonSet runs (`--tether-agent`).
    pub(crate) agent_bin: PathBuf,
    /// `--server-arg`s.
    pub(crate) server_extra: Vec<String>,
}

/// A server (mode `mode` on `socket`) and an agent connected to it.
fn start_pair(
    t: &Tether,
    pki: &tether_certs::DevPki,
    mode: &str,
    socket: &Path,
) -> anyhow::Result<(Proc, Proc, Value)> {
    let (server, ev) = spawn_tether(&t.bin, &t.server_args(pki, mode, socket, 0))?;
    let agent_addr: SocketAddr = ev["agent"].as_str().unwrap_or_default().parse()?;
    let (agent, _) = spawn_tether(&t.agent_bin, &agent_args(pki, agent_addr.port()))?;
    wait_connected(ev["health"].as_str().unwrap_or_default())?;
    Ok((server, agent, ev))
}

impl Tether {
    /// A server on loopback with `mode`'s frontend on the Unix socket `socket`, agents
    /// on `agent_port` (0: any), health on an ephemeral port.
    fn server_args(
        &self,
        pki: &tether_certs::DevPki,
        mode: &str,
        socket: &Path,
        agent_port: u16,
    ) -> Vec<String> {
        let mut args = vec![
            "server".into(),
            format!("--mode={mode}"),
            format!("--uds-name={}", socket.display()),
            "--server-port=0".into(),
            format!("--agent-port={agent_port}"),
            "--agent-bind-address=127.0.0.1".into(),
            "--health-port=0".into(),
            "--health-bind-address=127.0.0.1".into(),
            "--admin-port=0".into(),
            format!("--cluster-cert={}", pki.server_cert.display()),
            format!("--cluster-key={}", pki.server_key.display()),
            format!("--cluster-ca-cert={}", pki.ca_cert.display()),
            // Every simulated node connects from 127.0.0.1: one source's handshake
            // share would hold back a swarm's reconnect storm, which real nodes spread
            // over their own addresses.
            "--max-handshakes-per-source=0".into(),
        ];
        args.extend(self.server_extra.iter().cloned());
        args
    }
}

/// A real agent connecting to the server on loopback `port`.
fn agent_args(pki: &tether_certs::DevPki, port: u16) -> Vec<String> {
    vec![
        "--proxy-server-host=127.0.0.1".into(),
        format!("--proxy-server-port={port}"),
        format!("--ca-cert={}", pki.ca_cert.display()),
        format!("--agent-cert={}", pki.agent_cert.display()),
        format!("--agent-key={}", pki.agent_key.display()),
        "--health-server-host=127.0.0.1".into(),
        "--health-server-port=0".into(),
        "--admin-server-port=0".into(),
    ]
}

/// sshd on a private loopback port with throwaway keys, and `ssh -L` to `backend`.
fn start_ssh(dir: &Path, backend: SocketAddr) -> anyhow::Result<(u16, Vec<Proc>)> {
    let sshd = ["/usr/sbin/sshd", "/sbin/sshd"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .context("sshd not found: run scripts/install-bench-deps.sh (openssh-server)")?;
    for name in ["host_key", "client_key"] {
        let _ = std::fs::remove_file(dir.join(name));
        let ok = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f"])
            .arg(dir.join(name))
            .status()?
            .success();
        if !ok {
            bail!("ssh-keygen failed");
        }
    }
    std::fs::copy(dir.join("client_key.pub"), dir.join("authorized_keys"))?;
    let port = free_port();
    let config = format!(
        "Port {port}\nListenAddress 127.0.0.1\nHostKey {0}/host_key\nAuthorizedKeysFile {0}/authorized_keys\nPidFile {0}/sshd.pid\nUsePAM no\nStrictModes no\nPermitRootLogin prohibit-password\nPasswordAuthentication no\nAllowTcpForwarding yes\n",
        dir.display()
    );
    std::fs::write(dir.join("sshd_config"), config)?;
    std::fs::create_dir_all("/run/sshd").ok();
    let daemon = Proc(
        Command::new(sshd)
            .args(["-D", "-e", "-f"])
            .arg(dir.join("sshd_config"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    wait_port(port)?;
    let local = free_port();
    let user = std::env::var("USER").unwrap_or_else(|_| "root".into());
    let forward = Proc(
        Command::new("ssh")
            .args([
                "-N",
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "LogLevel=ERROR",
                "-i",
            ])
            .arg(dir.join("client_key"))
            .args([
                "-p",
                &port.to_string(),
                "-L",
                &format!("127.0.0.1:{local}:{backend}"),
                &format!("{user}@127.0.0.1"),
            ])
            .stdin(Stdio::null())
            .spawn()?,
    );
    wait_port(local)?;
    Ok((local, vec![forward, daemon]))
}

/// Two relay processes in a chain to `target`: the first one's port and both processes.
fn start_relays(target: SocketAddr) -> anyhow::Result<(u16, Vec<Proc>)> {
    let mut procs = Vec::new();
    let mut to = target;
    for _ in 0..2 {
        let (port, relay) = spawn_self("relay", &[format!("--relay-to={to}")])?;
        procs.push(relay);
        to = SocketAddr::from(([127, 0, 0, 1], port));
    }
    Ok((to.port(), procs))
}

/// Runs this binary with `args` as a helper (`what`) that prints its listening port
/// first; returns the port.
fn spawn_self(what: &str, args: &[String]) -> anyhow::Result<(u16, Proc)> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    let out = child
        .stdout
        .take()
        .with_context(|| format!("{what} stdout"));
    let proc = Proc(child);
    BufReader::new(out?).read_line(&mut line)?;
    let port: u16 = line
        .trim()
        .parse()
        .with_context(|| format!("the {what} did not report its port"))?;
    Ok((port, proc))
}

/// A plain TCP relay on one thread: 128 KiB reads each way, nothing else.
async fn relay(to: SocketAddr) -> anyhow::Result<()> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("{}", l.local_addr()?.port());
    loop {
        let (mut a, _) = l.accept().await?;
        tokio::spawn(async move {
            let Ok(mut b) = tokio::net::TcpStream::connect(to).await else {
                return;
            };
            let _ = (a.set_nodelay(true), b.set_nodelay(true));
            let _ = tokio::io::copy_bidirectional_with_sizes(&mut a, &mut b, 128 << 10, 128 << 10)
                .await;
        });
    }
}

/// Starts this binary as one CCM load balancer in front of `target` (its "NodePort")
/// over the gRPC frontend at `uds`; returns the Service port.
fn start_load_balancer(target: SocketAddr, uds: &Path) -> anyhow::Result<(u16, Proc)> {
    spawn_self(
        "load balancer",
        &[
            format!("--lb-to={target}"),
            format!("--lb-tunnel-uds={}", uds.display()),
        ],
    )
}

/// The CCM's tunnel load balancer for one Service (port: a free one; one node at
/// `to`'s address with `to`'s port as its NodePort), as `tether ccm` runs it.
async fn load_balancer(to: SocketAddr, uds: PathBuf) -> anyhow::Result<()> {
    use tether_ccm::cloud::{Backend, LoadBalancers, ServiceInfo, ServicePort};
    use tether_ccm::lb::balancer as tunnel_lb;
    let lbs = tunnel_lb::TunnelLoadBalancers::new(
        tunnel_lb::TunnelLbConfig {
            bind: Some(std::net::Ipv4Addr::LOCALHOST.into()),
            tunnel_uds: uds,
            max_connections: tunnel_lb::DEFAULT_MAX_CONNECTIONS,
            metrics: Default::default(),
        },
        None,
    )
    .map_err(anyhow::Error::msg)?;
    let port = free_port();
    let svc = ServiceInfo {
        namespace: "bench".into(),
        name: "lb".into(),
        uid: "bench-lb".into(),
        ports: vec![ServicePort {
            name: "tcp".into(),
            protocol: "TCP".into(),
            port,
            node_port: to.port(),
            endpoints: Vec::new(),
        }],
        max_connections: 1 << 20,
        idle_timeout: tether_ccm::cloud::DEFAULT_IDLE_TIMEOUT,
        families: vec!["IPv4".into()],
        node_ports: true,
        ..Default::default()
    };
    let node = Backend {
        name: "backend".into(),
        address: to.ip().to_string(),
    };
    // Assigned (as the leader's service controller does), then served (as the pool's
    // holder does).
    let status = lbs
        .ensure("bench", &svc, std::slice::from_ref(&node))
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for pool in lbs.pool_names() {
        lbs.resume_pool(&pool).await;
    }
    let addresses: Vec<std::net::IpAddr> =
        status.ips.iter().filter_map(|ip| ip.parse().ok()).collect();
    lbs.serve(&svc, &[node], &addresses)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("{port}");
    std::future::pending::<()>().await;
    Ok(())
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_port(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("nothing listens on port {port}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(to) = args.relay_to {
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(relay(to));
    }
    if let (Some(to), Some(pki)) = (args.swarm_to, &args.swarm_pki) {
        // One runtime thread, as the agent runs by default (`--worker-threads`).
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(swarm::run_swarm(
                to,
                pki.clone(),
                args.swarm_first,
                args.swarm_count,
            ));
    }
    if let Some(at) = args.echo_at {
        return tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(soak::echo_at(at));
    }
    if let (Some(to), Some(uds)) = (args.lb_to, &args.lb_tunnel_uds) {
        tether_ops::memory::tune_allocator();
        return tokio::runtime::Runtime::new()?.block_on(load_balancer(to, uds.clone()));
    }
    // The gRPC client here is the client crate as the CCM runs it: same allocator policy.
    tether_ops::memory::tune_allocator();
    // On a worker, not on this thread: a caller blocked on the runtime from outside is
    // woken through a condition variable after every event its I/O waits on, which no
    // client of a proxy pays (kube-apiserver's goroutines run where its I/O is polled).
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async { tokio::spawn(bench(args)).await? })
}

async fn bench(args: Args) -> anyhow::Result<()> {
    let bin = match &args.tether {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("tether"),
    };
    let agent_bin = match &args.tether_agent {
        Some(p) => p.clone(),
        None => bin.with_file_name("tether-agent"),
    };
    for (path, flag) in [(&bin, "--tether"), (&agent_bin, "--tether-agent")] {
        if !path.exists() {
            bail!(
                "{} not found: build it first (cargo build --release -p tether) or pass {flag}",
                path.display()
            );
        }
    }
    let t = Tether {
        bin,
        agent_bin,
        server_extra: args.server_arg.clone(),
    };
    if let Some(secs) = args.soak {
        let run = soak::Soak {
            duration: Duration::from_secs(secs),
            agents: args.soak_agents.max(1),
            tunnels: args.soak_tunnels,
            partitions: args.soak_partitions,
            heap_profiles: args.soak_heap_profiles.clone(),
        };
        // Interrupted (Ctrl-C, SIGTERM), the run stops here; the runtime then drops
        // every task and with them the cluster: processes killed, namespaces removed.
        let v = tokio::select! {
            v = soak::soak(&t, run) => v?,
            () = tether_ops::shutdown::signal() => bail!("soak: stopped by SIGINT or SIGTERM; no figures"),
        };
        println!("{}", serde_json::to_string_pretty(&v)?);
        std::fs::write(&args.json, serde_json::to_string_pretty(&v)?)?;
        if v["passed"] != true {
            bail!("soak: a check failed: {}", v["checks"]);
        }
        return Ok(());
    }
    if args.agents.is_some() || args.tunnels.is_some() {
        let mut out = serde_json::Map::new();
        if let Some(n) = args.agents {
            let v = swarm::many_agents(&t, n, args.agent_procs).await?;
            out.insert("many_agents".into(), v);
        }
        if let Some(m) = args.tunnels {
            let v = swarm::many_tunnels(&t, m, args.tunnel_agents).await?;
            out.insert("many_tunnels".into(), v);
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&Value::Object(out.clone()))?
        );
        std::fs::write(
            &args.json,
            serde_json::to_string_pretty(&Value::Object(out))?,
        )?;
        return Ok(());
    }
    let dir = std::env::temp_dir().join(format!("tether-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let pki = tether_certs::DevPki::generate(&dir.join("pki"))?;
    let backend = backend().await;
    let grpc_socket = dir.join("grpc.sock");
    let connect_socket = dir.join("connect.sock");
    let (gs, ga, gev) = start_pair(&t, &pki, "grpc", &grpc_socket)?;
    let (cs, ca, _) = start_pair(&t, &pki, "http-connect", &connect_socket)?;
    let mut procs = Vec::new();
    let ssh_port = if args.no_ssh {
        None
    } else {
        let (port, p) = start_ssh(&dir, backend)?;
        procs.extend(p);
        Some(port)
    };
    let (grpc_server_pid, grpc_agent_pid) = (gs.0.id(), ga.0.id());
    let mut carriers = vec![
        (Route::GrpcUds, vec![grpc_server_pid, grpc_agent_pid]),
        (Route::HttpConnectUds, vec![cs.0.id(), ca.0.id()]),
    ];
    if ssh_port.is_some() {
        carriers.push((Route::Ssh, procs.iter().map(|p| p.0.id()).collect()));
    }
    let relay_port = if args.no_relay {
        None
    } else {
        let (port, relays) = start_relays(backend)?;
        carriers.push((Route::Relay, relays.iter().map(|p| p.0.id()).collect()));
        procs.extend(relays);
        Some(port)
    };
    let (lb_port, backend_relay_port) = if args.no_lb {
        (None, None)
    } else {
        let (relay_port, relay) = spawn_self("relay", &[format!("--relay-to={backend}")])?;
        carriers.push((
            Route::GrpcRelay,
            vec![relay.0.id(), grpc_server_pid, grpc_agent_pid],
        ));
        procs.push(relay);
        let (port, lb) = start_load_balancer(backend, &grpc_socket)?;
        // The balancer's own CPU, and the pair it rides on.
        carriers.push((
            Route::LoadBalancer,
            vec![lb.0.id(), grpc_server_pid, grpc_agent_pid],
        ));
        procs.push(lb);
        (Some(port), Some(relay_port))
    };
    procs.extend([gs, ga, cs, ca]);
    let env = Arc::new(Env {
        backend,
        client: tether_client::Client::uds(&grpc_socket).await?,
        connect_socket,
        ssh_port,
        relay_port,
        lb_port,
        backend_relay_port,
        grpc_server_pid,
        grpc_agent_pid,
        grpc_health: gev["health"].as_str().unwrap_or_default().parse()?,
        carriers,
        _procs: procs,
    });
    let mut routes = vec![Route::Direct];
    if !args.no_grpc {
        routes.push(Route::GrpcUds);
    }
    if !args.no_http_connect {
        routes.push(Route::HttpConnectUds);
    }
    if env.ssh_port.is_some() {
        routes.push(Route::Ssh);
    }
    if env.relay_port.is_some() {
        routes.push(Route::Relay);
    }
    if env.lb_port.is_some() {
        routes.push(Route::GrpcRelay);
        routes.push(Route::LoadBalancer);
    }
    let n = args.size_mib << 20;
    let metrics = [
        "download MiB/s",
        "upload MiB/s",
        "16 conns MiB/s",
        "proxy CPU s/GiB",
        "rtt p50 us",
        "rtt p99 us",
        "new conn p50 us",
        "new conn p99 us",
        "new conn 3 ms apart p50 us",
        "new conn 3 ms apart p99 us",
        "dials/s (64 clients)",
        "fairness (8 busy + 1 stalled)",
        "stalled conn buffered MiB",
        "agent CPU s/GiB",
    ];
    let mut samples: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); metrics.len()]; routes.len()];
    for round in 0..args.rounds {
        eprintln!("round {}/{}", round + 1, args.rounds);
        for (ri, &route) in routes.iter().enumerate() {
            let s = &mut samples[ri];
            let on = |m: &str| args.only.is_empty() || args.only.iter().any(|o| o == m);
            let cpu_before = env.carrier_cpu(route);
            let agent_before = cpu_seconds(env.grpc_agent_pid);
            let mut moved = 0;
            if on("download") {
                s[0].push(download(&env, route, n).await? / 1048576.0);
                moved += n;
            }
            if on("upload") {
                s[1].push(upload(&env, route, n).await? / 1048576.0);
                moved += n;
            }
            if on("parallel") {
                s[2].push(parallel(&env, route, n, 16).await? / 1048576.0);
                moved += n;
            }
            if moved > 0 && route != Route::Direct {
                let used = env.carrier_cpu(route) - cpu_before;
                s[3].push(used / (moved as f64 / f64::from(1 << 30)));
                if env.carries_agent(route) {
                    let used = cpu_seconds(env.grpc_agent_pid) - agent_before;
                    s[13].push(used / (moved as f64 / f64::from(1 << 30)));
                }
            }
            if on("rtt") {
                let (p50, p99) = rtt(&env, route, 2000).await?;
                s[4].push(p50);
                s[5].push(p99);
            }
            if on("newconn") {
                let (p50, p99) = new_connections(&env, route, 300, None).await?;
                s[6].push(p50);
                s[7].push(p99);
            }
            if on("newconn-spaced") {
                let gap = Some(Duration::from_millis(3));
                let (p50, p99) = new_connections(&env, route, 300, gap).await?;
                s[8].push(p50);
                s[9].push(p99);
            }
            if on("dialrate") {
                s[10].push(dial_rate(&env, route, 64, Duration::from_secs(2)).await?);
            }
            if on("fairness") {
                let (kept, buffered) = fairness(&env, route, n).await?;
                s[11].push(kept);
                s[12].push(buffered);
            }
        }
    }
    let table: Vec<Vec<f64>> = samples
        .into_iter()
        .map(|m| m.into_iter().map(median).collect())
        .collect();
    println!(
        "\nmedians of {} interleaved rounds, {} MiB transfers; (x) = ratio to direct",
        args.rounds, args.size_mib
    );
    print!("{:<22}", "");
    for r in &routes {
        print!("{:>26}", r.name());
    }
    println!();
    let mut out = serde_json::Map::new();
    for (mi, name) in metrics.iter().enumerate() {
        print!("{name:<22}");
        let direct = table[0][mi];
        let mut row = serde_json::Map::new();
        for (ri, r) in routes.iter().enumerate() {
            let v = table[ri][mi];
            print!("{:>26}", format!("{v:.2} ({:.2}x)", v / direct));
            row.insert(
                r.name().into(),
                json!({"value": v, "ratio_to_direct": v / direct}),
            );
        }
        println!();
        out.insert((*name).into(), Value::Object(row));
    }
    if args.idle_conns == 0 {
        std::fs::write(
            &args.json,
            serde_json::to_string_pretty(&Value::Object(out))?,
        )?;
        return Ok(());
    }
    eprintln!(
        "measuring memory with up to {} idle tunnels",
        args.idle_conns
    );
    let mem = memory(&env, args.idle_conns).await?;
    println!("\nresident memory (MiB), grpc/uds server and agent, two rounds:");
    for round in mem.as_array().unwrap() {
        for p in round.as_array().unwrap() {
            println!(
                "  tunnels {:>8}: server {:>6.1} (heap+stacks {:>5.1})  agent {:>6.1} (heap+stacks {:>5.1})",
                p["tunnels"].to_string(),
                mib(&p["server_mib"]),
                mib(&p["server_anon_mib"]),
                mib(&p["agent_mib"]),
                mib(&p["agent_anon_mib"]),
            );
        }
    }
    out.insert("memory".into(), mem);
    std::fs::write(
        &args.json,
        serde_json::to_string_pretty(&Value::Object(out))?,
    )?;
    println!("\nwrote {}", args.json.display());
    drop(env);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

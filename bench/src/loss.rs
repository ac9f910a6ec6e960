//! `--loss`: one agent in a network namespace whose link to the server drops a share of
//! its packets both ways (iptables' `statistic` match: this kernel has no netem), and
//! through it at once eight bulk tunnels and one small request/response tunnel, for each
//! loss rate and each transport: the small tunnel's round trip (p50, p99) and the bulk
//! tunnels' total throughput. What a lost segment costs the tunnels that share it. The
//! link runs as fast as this machine goes, or at `--loss-link-mbit` (tbf), the way an
//! edge site's uplink limits it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tether_testkit::netns::Node;
use tether_testkit::process::{socket_path, uds_frontend_args, START_TIMEOUT};
use tether_testkit::{AgentProc, Pki, ServerProc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::procs::Tether;
use crate::stats::p50_p99;

/// Bulk tunnels beside the small one.
const BULK: usize = 8;
/// The small tunnel's request and answer.
const SMALL: usize = 64;
/// Between two small requests.
const SMALL_GAP: Duration = Duration::from_millis(10);

/// Every transport of `--loss-transports` at every rate of `--loss` (percent),
/// `--loss-seconds` each, over a link of `--loss-link-mbit` Mbit/s (0: unlimited).
pub(crate) async fn run(t: &Tether, args: &crate::args::Args) -> anyhow::Result<Value> {
    let (rates, seconds, mbit) = (&args.loss, args.loss_seconds, args.loss_link_mbit);
    if !tether_testkit::netns::available() {
        anyhow::bail!("--loss needs root and iproute2 (network namespaces)");
    }
    let mut rows = Vec::new();
    let link = if mbit > 0 {
        format!("{mbit} Mbit/s each way")
    } else {
        "unlimited".to_string()
    };
    println!("\nloss on the agent's link ({link}), both ways; {BULK} bulk tunnels + 1 small request/response tunnel, {seconds} s each");
    println!(
        "{:>10} {:>6} {:>14} {:>14} {:>16}",
        "transport", "loss %", "small p50 ms", "small p99 ms", "bulk MiB/s"
    );
    for transport in args.loss_transports.iter().map(String::as_str) {
        let site = Site::start(t, transport).await?;
        if mbit > 0 {
            site.node.shape(mbit);
        }
        for &rate in rates {
            site.drop_share(rate, true);
            let r = site.measure(Duration::from_secs(seconds)).await;
            site.drop_share(rate, false);
            let r = r?;
            println!(
                "{transport:>10} {rate:>6} {:>14.1} {:>14.1} {:>16.1}",
                r.0, r.1, r.2
            );
            rows.push(json!({"transport": transport, "loss_percent": rate, "link_mbit": mbit, "small_p50_ms": r.0, "small_p99_ms": r.1, "bulk_mib_s": r.2}));
        }
    }
    Ok(json!(rows))
}

/// A server on the host's end of a node's link, the node's agent over `transport`, and
/// an echo server on the node's loopback (where the agent dials, as a kubelet).
struct Site {
    node: Node,
    socket: std::path::PathBuf,
    target: String,
    _server: ServerProc,
    _agent: AgentProc,
    _echo: tether_testkit::Proc,
    _pki: Pki,
}

impl Site {
    async fn start(t: &Tether, transport: &str) -> anyhow::Result<Site> {
        let node = Node::create();
        let pki = Pki::with_sans(std::slice::from_ref(&node.host_ip));
        let socket = socket_path(pki.dir());
        let mut args = uds_frontend_args(&pki, "grpc", &socket);
        args.push(format!("--agent-bind-address={}", node.host_ip));
        let quic_port = tether_testkit::kube::free_udp_port();
        args.push(format!("--agent-quic-port={quic_port}"));
        let server = tokio::task::block_in_place(|| ServerProc::start(&t.bin, &args));
        let port = crate::procs::free_port();
        let target = format!("127.0.0.1:{port}");
        let me = std::env::current_exe()?.display().to_string();
        let echo = node.spawn("echo", &me, &["--echo-at".into(), target.clone()]);
        echo.wait_event("echo ready", START_TIMEOUT, |_| true);
        let agent_args = vec![
            format!("--transports={transport}"),
            format!("--proxy-server-quic-port={quic_port}"),
            format!("--health-server-host={}", node.link_ip),
        ];
        let agent = tokio::task::block_in_place(|| {
            AgentProc::start_in(Some(&node), &t.agent_bin, &pki, server.agent, &agent_args)
        });
        server.wait_agents(1).await;
        Ok(Site {
            node,
            socket,
            target,
            _server: server,
            _agent: agent,
            _echo: echo,
            _pki: pki,
        })
    }

    /// Drops `rate` percent of the packets on the node's link both ways (`on`), or stops.
    fn drop_share(&self, rate: f64, on: bool) {
        if rate <= 0.0 {
            return;
        }
        let p = format!("{:.4}", rate / 100.0);
        let op = if on { "-A" } else { "-D" };
        for (chain, dir) in [("INPUT", "-s"), ("OUTPUT", "-d")] {
            self.node.iptables(&[
                op,
                chain,
                dir,
                &self.node.host_ip,
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                &p,
                "-j",
                "DROP",
            ]);
        }
    }

    /// The small tunnel's p50 and p99 (ms) and the bulk throughput (MiB/s) over `span`.
    async fn measure(&self, span: Duration) -> anyhow::Result<(f64, f64, f64)> {
        let client = tether_client::Client::uds(&self.socket).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let moved = Arc::new(AtomicU64::new(0));
        let mut bulk = Vec::new();
        for _ in 0..BULK {
            let conn = client.dial(&self.target).await?;
            bulk.push(tokio::spawn(pump(conn, stop.clone(), moved.clone())));
        }
        let mut small = client.dial(&self.target).await?;
        let started = Instant::now();
        let mut samples = Vec::new();
        let (req, mut back) = ([5u8; SMALL], [0u8; SMALL]);
        while started.elapsed() < span {
            let sent = Instant::now();
            small.write_all(&req).await?;
            small.read_exact(&mut back).await?;
            samples.push(sent.elapsed().as_secs_f64() * 1e3);
            tokio::time::sleep(SMALL_GAP).await;
        }
        let bytes = moved.load(Ordering::Relaxed);
        let secs = started.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        for b in bulk {
            b.abort();
        }
        let (p50, p99) = p50_p99(samples);
        Ok((p50, p99, bytes as f64 / secs / (1 << 20) as f64))
    }
}

/// Writes 64 KiB at a time and reads the echo back, counting what came back, until
/// `stop`; then the tunnel closes. The writer is this task's (aborting the task ends
/// both halves): a writer left running after its reader went would make the tunnel a
/// stalled reader, and enough of those on the client's one connection hold up every
/// dial on it (the frontend's HTTP/2 connection window).
async fn pump(conn: tether_client::TunnelConn, stop: Arc<AtomicBool>, moved: Arc<AtomicU64>) {
    let (mut r, mut w) = tokio::io::split(conn);
    let writer = async move {
        let chunk = vec![1u8; 64 << 10];
        while w.write_all(&chunk).await.is_ok() {}
    };
    let reader = async move {
        let mut buf = vec![0u8; 64 << 10];
        while !stop.load(Ordering::Relaxed) {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    moved.fetch_add(n as u64, Ordering::Relaxed);
                }
            }
        }
    };
    tokio::select! {
        () = writer => {}
        () = reader => {}
    }
}

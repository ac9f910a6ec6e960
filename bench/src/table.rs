//! The route table (the default mode): sets up every route, measures each in
//! interleaved rounds, prints the medians, then the memory figures.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::args::Args;
use crate::backend::backend;
use crate::latency::{dial_rate, new_connections, rtt};
use crate::lb::start_load_balancer;
use crate::memory::memory;
use crate::procinfo::cpu_seconds;
use crate::procs::{start_pair, start_pair_with, Proc, Tether};
use crate::relay::{start_relay, start_relays};
use crate::report;
use crate::route::{Env, Route};
use crate::ssh::start_ssh;
use crate::stats::median;
use crate::throughput::{download, fairness, parallel, upload};

/// The table's rows, in the order the samples are kept.
const METRICS: [&str; 14] = [
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

/// Samples of one route: one list per entry of `METRICS`.
type Samples = Vec<Vec<f64>>;

/// The whole route table run: set up, measure, print, write `--json`.
pub(crate) async fn run(args: &Args, t: &Tether) -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("tether-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let env = Arc::new(start(args, t, &dir).await?);
    let routes = routes(args, &env);
    let samples = measure(args, &env, &routes).await?;
    let table: Vec<Vec<f64>> = samples
        .into_iter()
        .map(|m| m.into_iter().map(median).collect())
        .collect();
    let mut out = report::print_table(args.rounds, args.size_mib, &routes, &METRICS, &table);
    if args.idle_conns == 0 {
        drop(env);
        // The audit route's logs alone reach 100 MiB in a long run.
        let _ = std::fs::remove_dir_all(&dir);
        return report::write_json(&args.json, &Value::Object(out));
    }
    eprintln!(
        "measuring memory with up to {} idle tunnels",
        args.idle_conns
    );
    let mem = memory(&env, args.idle_conns).await?;
    report::print_memory(&mem);
    out.insert("memory".into(), mem);
    report::write_json(&args.json, &Value::Object(out))?;
    println!("\nwrote {}", args.json.display());
    drop(env);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

// === set-up ===

/// The processes started so far beside the two pairs, and the routes they carry.
struct Started {
    procs: Vec<Proc>,
    carriers: Vec<(Route, Vec<u32>)>,
}

impl Started {
    /// `procs`, started for `route`, whose bytes go through them and the processes `also`.
    fn add(&mut self, route: Route, procs: Vec<Proc>, also: &[u32]) {
        let mut pids: Vec<u32> = procs.iter().map(|p| p.0.id()).collect();
        pids.extend(also);
        self.carriers.push((route, pids));
        self.procs.extend(procs);
    }
}

/// The backend, a gRPC and an HTTP-CONNECT pair (server and agent), and the other
/// routes `args` leave on, with temporary files in `dir`.
async fn start(args: &Args, t: &Tether, dir: &Path) -> anyhow::Result<Env> {
    let pki = tether_certs::DevPki::generate(&dir.join("pki"))?;
    let backend = backend().await;
    let grpc_socket = dir.join("grpc.sock");
    let connect_socket = dir.join("connect.sock");
    let (gs, ga, gev) = start_pair(t, &pki, "grpc", &grpc_socket)?;
    let (cs, ca, _) = start_pair(t, &pki, "http-connect", &connect_socket)?;
    let pair = [gs.0.id(), ga.0.id()];
    let mut s = Started {
        procs: Vec::new(),
        carriers: vec![
            (Route::GrpcUds, pair.to_vec()),
            (Route::HttpConnectUds, vec![cs.0.id(), ca.0.id()]),
        ],
    };
    let audit_socket = dir.join("audit.sock");
    let audit_client = if args.audit {
        let flag = |f: &str| format!("--audit-log-path={}", dir.join(f).display());
        let (server, agent) = (
            vec![flag("server-audit.log")],
            vec![flag("agent-audit.log")],
        );
        let (s_, a_, _) = start_pair_with(t, &pki, "grpc", &audit_socket, &server, &agent)?;
        s.add(Route::GrpcUdsAudit, vec![s_, a_], &[]);
        Some(tether_client::Client::uds(&audit_socket).await?)
    } else {
        None
    };
    let ws_socket = dir.join("websocket.sock");
    let ws_client = if args.websocket {
        let agent = vec!["--transports=websocket".to_string()];
        let (s_, a_, _) = start_pair_with(t, &pki, "grpc", &ws_socket, &[], &agent)?;
        s.add(Route::GrpcUdsWs, vec![s_, a_], &[]);
        Some(tether_client::Client::uds(&ws_socket).await?)
    } else {
        None
    };
    let quic_socket = dir.join("quic.sock");
    let quic_client = if args.quic {
        let port = tether_testkit::kube::free_udp_port();
        let server = vec![format!("--agent-quic-port={port}")];
        let agent = vec![
            "--transports=quic".to_string(),
            format!("--proxy-server-quic-port={port}"),
        ];
        let (s_, a_, _) = start_pair_with(t, &pki, "grpc", &quic_socket, &server, &agent)?;
        s.add(Route::GrpcUdsQuic, vec![s_, a_], &[]);
        Some(tether_client::Client::uds(&quic_socket).await?)
    } else {
        None
    };
    let ssh_port = if args.no_ssh {
        None
    } else {
        let (port, procs) = start_ssh(dir, backend)?;
        s.add(Route::Ssh, procs, &[]);
        Some(port)
    };
    let relay_port = if args.no_relay {
        None
    } else {
        let (port, relays) = start_relays(backend)?;
        s.add(Route::Relay, relays, &[]);
        Some(port)
    };
    let (lb_port, backend_relay_port) = if args.no_lb {
        (None, None)
    } else {
        let (relay_port, relay) = start_relay(backend)?;
        s.add(Route::GrpcRelay, vec![relay], &pair);
        let (port, lb) = start_load_balancer(backend, &grpc_socket)?;
        // The balancer's own CPU, and the pair it rides on.
        s.add(Route::LoadBalancer, vec![lb], &pair);
        (Some(port), Some(relay_port))
    };
    s.procs.extend([gs, ga, cs, ca]);
    Ok(Env {
        backend,
        client: tether_client::Client::uds(&grpc_socket).await?,
        audit_client,
        ws_client,
        quic_client,
        connect_socket,
        ssh_port,
        relay_port,
        lb_port,
        backend_relay_port,
        grpc_server_pid: pair[0],
        grpc_agent_pid: pair[1],
        grpc_health: gev["health"].as_str().unwrap_or_default().parse()?,
        carriers: s.carriers,
        _procs: s.procs,
    })
}

/// The table's columns: direct first (the ratios' base), then every route set up.
fn routes(args: &Args, env: &Env) -> Vec<Route> {
    let mut routes = vec![Route::Direct];
    if !args.no_grpc {
        routes.push(Route::GrpcUds);
    }
    if env.audit_client.is_some() {
        routes.push(Route::GrpcUdsAudit);
    }
    if env.ws_client.is_some() {
        routes.push(Route::GrpcUdsWs);
    }
    if env.quic_client.is_some() {
        routes.push(Route::GrpcUdsQuic);
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
    routes
}

// === measurements ===

/// `--rounds` rounds, each measuring every route in turn: the samples by route.
async fn measure(args: &Args, env: &Arc<Env>, routes: &[Route]) -> anyhow::Result<Vec<Samples>> {
    let mut samples: Vec<Samples> = vec![vec![Vec::new(); METRICS.len()]; routes.len()];
    for round in 0..args.rounds {
        eprintln!("round {}/{}", round + 1, args.rounds);
        for (ri, &route) in routes.iter().enumerate() {
            let s = &mut samples[ri];
            transfers(args, env, route, s).await?;
            latencies(args, env, route, s).await?;
            if args.wants("fairness") {
                let (kept, buffered) = fairness(env, route, args.size_mib << 20).await?;
                s[11].push(kept);
                s[12].push(buffered);
            }
        }
    }
    Ok(samples)
}

/// Download, upload and parallel throughput, and the CPU the route's carriers spent
/// on them.
async fn transfers(
    args: &Args,
    env: &Arc<Env>,
    route: Route,
    s: &mut Samples,
) -> anyhow::Result<()> {
    let n = args.size_mib << 20;
    let cpu_before = env.carrier_cpu(route);
    let agent_before = cpu_seconds(env.grpc_agent_pid);
    let mut moved = 0;
    if args.wants("download") {
        s[0].push(download(env, route, n).await? / 1048576.0);
        moved += n;
    }
    if args.wants("upload") {
        s[1].push(upload(env, route, n).await? / 1048576.0);
        moved += n;
    }
    if args.wants("parallel") {
        s[2].push(parallel(env, route, n, 16).await? / 1048576.0);
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
    Ok(())
}

/// Round trips, new connections (back to back and spaced) and the dial rate.
async fn latencies(
    args: &Args,
    env: &Arc<Env>,
    route: Route,
    s: &mut Samples,
) -> anyhow::Result<()> {
    if args.wants("rtt") {
        let (p50, p99) = rtt(env, route, 2000).await?;
        s[4].push(p50);
        s[5].push(p99);
    }
    if args.wants("newconn") {
        let (p50, p99) = new_connections(env, route, 300, None).await?;
        s[6].push(p50);
        s[7].push(p99);
    }
    if args.wants("newconn-spaced") {
        let gap = Some(Duration::from_millis(3));
        let (p50, p99) = new_connections(env, route, 300, gap).await?;
        s[8].push(p50);
        s[9].push(p99);
    }
    if args.wants("dialrate") {
        s[10].push(dial_rate(env, route, 64, Duration::from_secs(2)).await?);
    }
    Ok(())
}

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

mod args;
mod backend;
mod latency;
mod lb;
mod loss;
mod memory;
mod procinfo;
mod procs;
mod relay;
mod report;
mod route;
mod soak;
mod ssh;
mod stats;
mod swarm;
mod table;
mod throughput;

use std::future::Future;

use clap::Parser;

use crate::args::Args;
use crate::procs::Tether;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // The internal modes: this binary as a helper process of a benchmark.
    if let Some(to) = args.relay_to {
        return on_one_thread(relay::relay(to));
    }
    if let (Some(to), Some(pki)) = (args.swarm_to, &args.swarm_pki) {
        // One runtime thread, as the agent runs by default (`--worker-threads`).
        let swarm = swarm::run_swarm(
            to,
            pki.clone(),
            args.swarm_first,
            args.swarm_count,
            swarm::Over::of(args.websocket, args.quic),
        );
        return on_one_thread(swarm);
    }
    if let Some(at) = args.echo_at {
        return on_one_thread(soak::echo_at(at));
    }
    if let (Some(to), Some(uds)) = (args.lb_to, &args.lb_tunnel_uds) {
        tether_ops::memory::tune_allocator();
        return tokio::runtime::Runtime::new()?.block_on(lb::load_balancer(to, uds.clone()));
    }
    // The gRPC client here is the client crate as the CCM runs it: same allocator policy.
    tether_ops::memory::tune_allocator();
    // On a worker, not on this thread: a caller blocked on the runtime from outside is
    // woken through a condition variable after every event its I/O waits on, which no
    // client of a proxy pays (kube-apiserver's goroutines run where its I/O is polled).
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async { tokio::spawn(bench(args)).await? })
}

/// Runs `f` to completion on a current-thread runtime.
fn on_one_thread(f: impl Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(f)
}

/// The benchmark `args` choose: the soak run, the swarm runs, or the route table.
async fn bench(args: Args) -> anyhow::Result<()> {
    let t = Tether::from_args(&args)?;
    if let Some(secs) = args.soak {
        return soak::run(&args, &t, secs).await;
    }
    if args.agents.is_some() || args.tunnels.is_some() {
        return swarm::run(&args, &t).await;
    }
    if !args.loss.is_empty() {
        let v = loss::run(&t, &args).await?;
        return report::write_json(&args.json, &serde_json::json!({ "loss": v }));
    }
    table::run(&args, &t).await
}

//! The command line: every flag of `tether-bench`, including the internal ones that
//! run this binary as a helper process (relay, load balancer, swarm, echo server).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

/// Benchmark Tether against a direct connection and ssh -L.
#[derive(Parser, Debug)]
pub(crate) struct Args {
    /// Bytes per single-connection transfer, in MiB.
    #[arg(long, default_value_t = 512)]
    pub(crate) size_mib: u64,
    /// Interleaved rounds (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub(crate) rounds: usize,
    /// Idle tunnels held for the memory figures (also measured at 1,000).
    #[arg(long, default_value_t = 10_000)]
    pub(crate) idle_conns: usize,
    /// Write the figures as JSON here.
    #[arg(long, default_value = "bench-results.json")]
    pub(crate) json: PathBuf,
    /// The tether binary, which runs the servers (default: next to this one).
    #[arg(long)]
    pub(crate) tether: Option<PathBuf>,
    /// The agent binary the DaemonSet runs (default: `tether-agent` next to the tether
    /// binary).
    #[arg(long)]
    pub(crate) tether_agent: Option<PathBuf>,
    /// One more flag for every `tether server` this run starts (repeatable; the route
    /// table's, `--agents`', `--tunnels`' and `--soak`'s), e.g.
    /// `--server-arg=--worker-threads=1`.
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) server_arg: Vec<String>,
    /// Skip the ssh -L comparison.
    #[arg(long)]
    pub(crate) no_ssh: bool,
    /// Only these measurements (comma-separated: download, upload, parallel, rtt,
    /// newconn, newconn-spaced, dialrate, fairness); all by default.
    #[arg(long, value_delimiter = ',')]
    pub(crate) only: Vec<String>,
    /// Skip the two-relay floor.
    #[arg(long)]
    pub(crate) no_relay: bool,
    /// Skip the gRPC route (e.g. to count the server's system calls for one route).
    #[arg(long)]
    pub(crate) no_grpc: bool,
    /// Add the gRPC route again with the audit log on at both ends (written to a file
    /// in the run's temporary directory): its CPU per GiB and round trip beside the
    /// route without it.
    #[arg(long)]
    pub(crate) audit: bool,
    /// Add the gRPC route again with the agent's stream over WebSocket
    /// (`--transports=websocket`): its throughput, CPU per GiB and round trip beside
    /// HTTP/2's.
    #[arg(long)]
    pub(crate) websocket: bool,
    /// Add the gRPC route again with the agent's stream over QUIC
    /// (`--transports=quic`): its throughput, CPU per GiB and round trip beside
    /// HTTP/2's.
    #[arg(long)]
    pub(crate) quic: bool,
    /// Loss instead of the route table: these loss rates in percent (e.g. `0,1,3`) on
    /// the link of an agent in a network namespace, each transport in turn: a small
    /// tunnel's round trip beside eight bulk ones, and their throughput.
    #[arg(long, value_delimiter = ',')]
    pub(crate) loss: Vec<f64>,
    /// Seconds measured at each loss rate.
    #[arg(long, default_value_t = 10)]
    pub(crate) loss_seconds: u64,
    /// With `--loss`: limit the agent's link to this many Mbit/s each way (tbf, a 50 ms
    /// queue), as an edge site's uplink is; 0 leaves it as fast as this machine goes.
    #[arg(long, default_value_t = 0)]
    pub(crate) loss_link_mbit: u32,
    /// With `--loss`: the transports measured, in this order.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = ["h2", "websocket", "quic"],
        default_value = "h2,websocket,quic"
    )]
    pub(crate) loss_transports: Vec<String>,
    /// Skip the HTTP-CONNECT route.
    #[arg(long)]
    pub(crate) no_http_connect: bool,
    /// Skip the CCM load-balancer route.
    #[arg(long)]
    pub(crate) no_lb: bool,
    /// (internal) Run as one CCM load balancer forwarding to this NodePort target
    /// through `--lb-tunnel-uds`: print the listening port, then serve.
    #[arg(long, hide = true)]
    pub(crate) lb_to: Option<SocketAddr>,
    /// (internal) The gRPC frontend socket for `--lb-to`.
    #[arg(long, hide = true)]
    pub(crate) lb_tunnel_uds: Option<PathBuf>,
    /// (internal) Run as a plain TCP relay to this address: print the listening port,
    /// then forward every connection.
    #[arg(long, hide = true)]
    pub(crate) relay_to: Option<SocketAddr>,
    /// Many agents instead of the route table: this many agent streams (swarm
    /// processes speaking the agent protocol) on one server: memory per stream, idle
    /// CPU, dial latency beside one agent, and the reconnect storm after a restart.
    #[arg(long)]
    pub(crate) agents: Option<usize>,
    /// Swarm processes sharing `--agents`.
    #[arg(long, default_value_t = 4)]
    pub(crate) agent_procs: usize,
    /// Many tunnels instead of the route table: this many idle tunnels over
    /// `--tunnel-agents` agents: server memory per tunnel, and after they close.
    #[arg(long)]
    pub(crate) tunnels: Option<usize>,
    /// Agents carrying `--tunnels`.
    #[arg(long, default_value_t = 100)]
    pub(crate) tunnel_agents: usize,
    /// A soak run instead of the route table: churn for this many seconds (180 if
    /// given without a value) with agents and servers killed and restarted and node
    /// links cut, then check that everything came back and nothing leaked. Exits
    /// non-zero when a check fails.
    #[arg(long, num_args = 0..=1, default_missing_value = "180")]
    pub(crate) soak: Option<u64>,
    /// Agent processes in the soak run.
    #[arg(long, default_value_t = 100)]
    pub(crate) soak_agents: usize,
    /// Callers in the soak run, each holding one tunnel at a time.
    #[arg(long, default_value_t = 1000)]
    pub(crate) soak_tunnels: usize,
    /// Soak agents inside network namespaces whose link is cut now and then (needs
    /// root and iproute2).
    #[arg(long, default_value_t = 4)]
    pub(crate) soak_partitions: usize,
    /// Run the soak's servers with `--enable-profiling` and save their heap profiles
    /// in this directory at the end.
    #[arg(long)]
    pub(crate) soak_heap_profiles: Option<PathBuf>,
    /// (internal) Run as an echo server on this address (inside a soak node's
    /// namespace): log `echo ready` as JSON, then echo every connection.
    #[arg(long, hide = true)]
    pub(crate) echo_at: Option<SocketAddr>,
    /// (internal) Run as a swarm of agents connecting to this server address.
    #[arg(long, hide = true)]
    pub(crate) swarm_to: Option<SocketAddr>,
    /// (internal) The swarm's PKI directory.
    #[arg(long, hide = true)]
    pub(crate) swarm_pki: Option<PathBuf>,
    /// (internal) The swarm's first agent number.
    #[arg(long, hide = true, default_value_t = 0)]
    pub(crate) swarm_first: usize,
    /// (internal) How many agents the swarm holds.
    #[arg(long, hide = true, default_value_t = 0)]
    pub(crate) swarm_count: usize,
}

impl Args {
    /// Whether `--only` lets measurement `m` run.
    pub(crate) fn wants(&self, m: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| o == m)
    }
}

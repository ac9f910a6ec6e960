//! The `tether` binary: `server`, `agent`, `local` (server + agent + demo backend in one
//! process), `ccm` and `certs`. Flags keep upstream's names and defaults; invoked as
//! `proxy-server` or `proxy-agent` (upstream's program names) it is `tether server` or
//! `tether agent`.

use clap::{Parser, Subcommand};

use tether::cmd;

/// Konnectivity-compatible tunnel for Kubernetes clusters whose nodes sit on private or
/// untrusted networks.
#[derive(Parser, Debug)]
#[command(name = "tether", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the proxy server beside kube-apiserver.
    Server(Box<cmd::server::ServerArgs>),
    /// Run the agent on a node; it dials out to the server.
    Agent(Box<cmd::agent::AgentArgs>),
    /// Run a server, an agent and a demo backend in one process on loopback.
    Local(cmd::local::LocalArgs),
    /// Run the cloud-controller-manager (built-in `tether` provider: an inventory file).
    Ccm(Box<cmd::ccm::CcmArgs>),
    /// Make certificates.
    #[command(subcommand)]
    Certs(cmd::certs::CertsCommand),
}

/// The system allocator, sampled for `/debug/pprof/heap` once `--enable-profiling`
/// turns it on.
#[global_allocator]
static ALLOC: tether_ops::heap_profile::Sampling<std::alloc::System> =
    tether_ops::heap_profile::Sampling(std::alloc::System);

fn main() -> std::process::ExitCode {
    tether_ops::heap_profile::mark_installed();
    let cli: Cli = match cmd::parse_args_from(cmd::upstream_program_args(std::env::args_os())) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let result = match cli.command {
        Command::Server(args) => cmd::server::main(*args),
        Command::Agent(args) => cmd::agent::main(*args),
        Command::Local(args) => cmd::local::main(args),
        Command::Ccm(args) => cmd::ccm::main(*args),
        Command::Certs(c) => cmd::certs::main(c),
    };
    cmd::exit_code(result)
}

//! `tether-agent`: the agent alone, for the per-node DaemonSet. It takes exactly the
//! flags of `tether agent` (upstream `proxy-agent`'s names), and links none of the
//! server, CCM or certificate-making code, so every node maps a smaller program.

use clap::Parser;

/// The Tether agent alone, with the flags of `tether agent`.
#[derive(Parser, Debug)]
#[command(
    name = "tether-agent",
    version,
    about = "Konnectivity agent: dials out to the proxy server and opens the connections it asks for"
)]
struct Cli {
    #[command(flatten)]
    args: tether::cmd::agent::AgentArgs,
}

/// The system allocator, sampled for `/debug/pprof/heap` once `--enable-profiling`
/// turns it on.
#[global_allocator]
static ALLOC: tether_ops::heap_profile::Sampling<std::alloc::System> =
    tether_ops::heap_profile::Sampling(std::alloc::System);

fn main() -> std::process::ExitCode {
    tether_ops::heap_profile::mark_installed();
    let args = tether::cmd::agent_program_args(std::env::args_os());
    match tether::cmd::parse_args_from::<Cli>(args) {
        Ok(cli) => tether::cmd::exit_code(tether::cmd::agent::main(cli.args)),
        Err(code) => code,
    }
}

//! The `tether` binary: `server`, `agent`, `local` (server + agent + demo backend in one
//! process), `ccm`, `certs` and `status`. Flags keep upstream's names and defaults;
//! invoked as `proxy-server` or `proxy-agent` (upstream's program names) it is `tether
//! server` or `tether agent`.

use tether::cli::Cli;
use tether::cmd;

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
    cli.run()
}

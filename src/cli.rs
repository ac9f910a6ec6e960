//! The `tether` command line: its subcommands, as `main` parses them and as the flag
//! reference in `docs/reference/flags.md` is generated from them.

use clap::{Parser, Subcommand};

use crate::cmd;

/// Konnectivity-compatible tunnel for Kubernetes clusters whose nodes sit on private or
/// untrusted networks.
#[derive(Parser, Debug)]
#[command(name = "tether", version, about, propagate_version = true)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// `tether`'s subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
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
    /// Is the tunnel healthy? Reads a server's admin port and prints its id, mode,
    /// agents, certificates and lease view. Tether only.
    ///
    /// Exit status: 0 healthy; 1 trouble found (no agent connected, all agents
    /// draining, a certificate expired or within --warn-days, a lease count that
    /// disagrees with the server count in use), each problem a line on stderr; 2 the
    /// endpoint could not be read (one line saying what to fix).
    Status(cmd::status::StatusArgs),
    /// Roll a component out with no gap in service. Tether only.
    #[command(subcommand)]
    Rollout(cmd::rollout::RolloutCommand),
}

impl Cli {
    /// Runs the chosen subcommand to its end; its outcome is the exit code.
    pub fn run(self) -> std::process::ExitCode {
        let result = match self.command {
            Command::Server(args) => cmd::server::main(*args),
            Command::Agent(args) => cmd::agent::main(*args),
            Command::Local(args) => cmd::local::main(args),
            Command::Ccm(args) => cmd::ccm::main(*args),
            Command::Certs(c) => cmd::certs::main(c),
            Command::Rollout(c) => cmd::rollout::main(c),
            // Its own codes: 1 for trouble found, 2 for an endpoint it cannot read.
            Command::Status(args) => return cmd::status::main(args),
        };
        cmd::exit_code(result)
    }
}

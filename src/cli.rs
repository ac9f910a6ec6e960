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
}

impl Cli {
    /// Runs the chosen subcommand to its end.
    pub fn run(self) -> anyhow::Result<()> {
        match self.command {
            Command::Server(args) => cmd::server::main(*args),
            Command::Agent(args) => cmd::agent::main(*args),
            Command::Local(args) => cmd::local::main(args),
            Command::Ccm(args) => cmd::ccm::main(*args),
            Command::Certs(c) => cmd::certs::main(c),
        }
    }
}

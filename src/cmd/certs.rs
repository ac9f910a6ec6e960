//! `tether certs`: certificate generation.

use std::path::PathBuf;

use clap::Subcommand;

/// Certificate commands.
#[derive(Subcommand, Debug)]
pub enum CertsCommand {
    /// Write a throwaway PKI for one machine (CA, localhost server certificate,
    /// frontend and agent client certificates): for trying Tether, not production.
    Dev {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
    },
}

/// Runs a certs command.
pub fn main(cmd: CertsCommand) -> anyhow::Result<()> {
    match cmd {
        CertsCommand::Dev { out } => {
            let pki = tether_certs::DevPki::generate(&out)?;
            println!("wrote a throwaway PKI to {}:", pki.dir.display());
            for p in [
                &pki.ca_cert,
                &pki.server_cert,
                &pki.server_key,
                &pki.frontend_cert,
                &pki.frontend_key,
                &pki.agent_cert,
                &pki.agent_key,
            ] {
                println!("  {}", p.display());
            }
            Ok(())
        }
    }
}

//! The `ssh -L` comparison: sshd on a private loopback port with throwaway keys, and
//! an OpenSSH forward through it.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{bail, Context};

use crate::procs::{free_port, wait_port, Proc};

/// sshd on a private loopback port with throwaway keys, and `ssh -L` to `backend`.
pub(crate) fn start_ssh(dir: &Path, backend: SocketAddr) -> anyhow::Result<(u16, Vec<Proc>)> {
    let sshd = ["/usr/sbin/sshd", "/sbin/sshd"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .context("sshd not found: run scripts/install-bench-deps.sh (openssh-server)")?;
    make_keys(dir)?;
    let (port, daemon) = start_sshd(sshd, dir)?;
    let (local, forward) = start_forward(dir, port, backend)?;
    Ok((local, vec![forward, daemon]))
}

/// A fresh host key and client key in `dir`, the client's authorized.
fn make_keys(dir: &Path) -> anyhow::Result<()> {
    for name in ["host_key", "client_key"] {
        let _ = std::fs::remove_file(dir.join(name));
        let ok = Command::new("ssh-keygen")
            .args(["-q", "-t", "ed25519", "-N", "", "-f"])
            .arg(dir.join(name))
            .status()?
            .success();
        if !ok {
            bail!("ssh-keygen failed");
        }
    }
    std::fs::copy(dir.join("client_key.pub"), dir.join("authorized_keys"))?;
    Ok(())
}

/// `sshd` configured from `dir`, listening on a free loopback port: the port and the
/// daemon.
fn start_sshd(sshd: &str, dir: &Path) -> anyhow::Result<(u16, Proc)> {
    let port = free_port();
    let config = format!(
        "Port {port}\nListenAddress 127.0.0.1\nHostKey {0}/host_key\nAuthorizedKeysFile {0}/authorized_keys\nPidFile {0}/sshd.pid\nUsePAM no\nStrictModes no\nPermitRootLogin prohibit-password\nPasswordAuthentication no\nAllowTcpForwarding yes\n",
        dir.display()
    );
    std::fs::write(dir.join("sshd_config"), config)?;
    std::fs::create_dir_all("/run/sshd").ok();
    let daemon = Proc(
        Command::new(sshd)
            .args(["-D", "-e", "-f"])
            .arg(dir.join("sshd_config"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    wait_port(port)?;
    Ok((port, daemon))
}

/// `ssh -L` from a free loopback port through the sshd on `port` to `backend`: the
/// local port and the ssh process.
fn start_forward(dir: &Path, port: u16, backend: SocketAddr) -> anyhow::Result<(u16, Proc)> {
    let local = free_port();
    let user = std::env::var("USER").unwrap_or_else(|_| "root".into());
    let forward = Proc(
        Command::new("ssh")
            .args([
                "-N",
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
                "-o",
                "LogLevel=ERROR",
                "-i",
            ])
            .arg(dir.join("client_key"))
            .args([
                "-p",
                &port.to_string(),
                "-L",
                &format!("127.0.0.1:{local}:{backend}"),
                &format!("{user}@127.0.0.1"),
            ])
            .stdin(Stdio::null())
            .spawn()?,
    );
    wait_port(local)?;
    Ok((local, forward))
}

//! The processes a run starts: the tether binaries under test (a server, an agent, a
//! connected pair), this binary again as a helper, and the ports they listen on.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;

use crate::args::Args;

/// A child process killed on drop.
pub(crate) struct Proc(pub(crate) Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The binaries under test, and the flags every server they run is given.
pub(crate) struct Tether {
    /// Runs the servers (`--tether`).
    pub(crate) bin: PathBuf,
    /// The agent the DaemonSet runs (`--tether-agent`).
    pub(crate) agent_bin: PathBuf,
    /// `--server-arg`s.
    pub(crate) server_extra: Vec<String>,
}

impl Tether {
    /// The binaries `args` name (by default `tether` next to this binary and
    /// `tether-agent` next to that), which must exist.
    pub(crate) fn from_args(args: &Args) -> anyhow::Result<Self> {
        let bin = match &args.tether {
            Some(p) => p.clone(),
            None => std::env::current_exe()?.with_file_name("tether"),
        };
        let agent_bin = match &args.tether_agent {
            Some(p) => p.clone(),
            None => bin.with_file_name("tether-agent"),
        };
        for (path, flag) in [(&bin, "--tether"), (&agent_bin, "--tether-agent")] {
            if !path.exists() {
                bail!(
                    "{} not found: build it first (cargo build --release -p tether) or pass {flag}",
                    path.display()
                );
            }
        }
        Ok(Tether {
            bin,
            agent_bin,
            server_extra: args.server_arg.clone(),
        })
    }

    /// A server on loopback with `mode`'s frontend on the Unix socket `socket`, agents
    /// on `agent_port` (0: any), health on an ephemeral port.
    pub(crate) fn server_args(
        &self,
        pki: &tether_certs::DevPki,
        mode: &str,
        socket: &Path,
        agent_port: u16,
    ) -> Vec<String> {
        let mut args = vec![
            "server".into(),
            format!("--mode={mode}"),
            format!("--uds-name={}", socket.display()),
            "--server-port=0".into(),
            format!("--agent-port={agent_port}"),
            "--agent-bind-address=127.0.0.1".into(),
            "--health-port=0".into(),
            "--health-bind-address=127.0.0.1".into(),
            "--admin-port=0".into(),
            format!("--cluster-cert={}", pki.server_cert.display()),
            format!("--cluster-key={}", pki.server_key.display()),
            format!("--cluster-ca-cert={}", pki.ca_cert.display()),
            // Every simulated node connects from 127.0.0.1: one source's (and one
            // prefix's) share of unproven connections would hold back a swarm's
            // reconnect storm, which real nodes spread over their own addresses.
            "--max-handshakes-per-source=0".into(),
            "--max-handshakes-per-prefix=0".into(),
        ];
        args.extend(self.server_extra.iter().cloned());
        args
    }
}

/// Runs `bin` with `args` (and JSON logs) until it logs that it listens or starts;
/// returns the process and that log line.
pub(crate) fn spawn_tether(bin: &Path, args: &[String]) -> anyhow::Result<(Proc, Value)> {
    let mut child = Command::new(bin)
        .args(args)
        .arg("--log-format=json")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                let _ = tx.send(v);
            }
        }
    });
    let proc = Proc(child);
    loop {
        let v = rx
            .recv_timeout(Duration::from_secs(20))
            .context("tether did not report readiness")?;
        if v["message"] == "server listening" || v["message"] == "agent starting" {
            return Ok((proc, v));
        }
    }
}

fn wait_connected(health: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ok = std::net::TcpStream::connect(health).ok().and_then(|mut s| {
            use std::io::{Read, Write};
            s.write_all(b"GET /readyz HTTP/1.0\r\n\r\n").ok()?;
            let mut r = String::new();
            s.read_to_string(&mut r).ok()?;
            (r.split_whitespace().nth(1) == Some("200")).then_some(())
        });
        if ok.is_some() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("agent did not connect");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A server (mode `mode` on `socket`) and an agent connected to it.
pub(crate) fn start_pair(
    t: &Tether,
    pki: &tether_certs::DevPki,
    mode: &str,
    socket: &Path,
) -> anyhow::Result<(Proc, Proc, Value)> {
    start_pair_with(t, pki, mode, socket, &[], &[])
}

/// [`start_pair`] with `server_extra` and `agent_extra` flags (e.g. the audit log).
pub(crate) fn start_pair_with(
    t: &Tether,
    pki: &tether_certs::DevPki,
    mode: &str,
    socket: &Path,
    server_extra: &[String],
    agent_extra: &[String],
) -> anyhow::Result<(Proc, Proc, Value)> {
    let mut args = t.server_args(pki, mode, socket, 0);
    args.extend(server_extra.iter().cloned());
    let (server, ev) = spawn_tether(&t.bin, &args)?;
    let agent_addr: SocketAddr = ev["agent"].as_str().unwrap_or_default().parse()?;
    let mut args = agent_args(pki, agent_addr.port());
    args.extend(agent_extra.iter().cloned());
    let (agent, _) = spawn_tether(&t.agent_bin, &args)?;
    wait_connected(ev["health"].as_str().unwrap_or_default())?;
    Ok((server, agent, ev))
}

/// A real agent connecting to the server on loopback `port`.
pub(crate) fn agent_args(pki: &tether_certs::DevPki, port: u16) -> Vec<String> {
    vec![
        "--proxy-server-host=127.0.0.1".into(),
        format!("--proxy-server-port={port}"),
        format!("--ca-cert={}", pki.ca_cert.display()),
        format!("--agent-cert={}", pki.agent_cert.display()),
        format!("--agent-key={}", pki.agent_key.display()),
        "--health-server-host=127.0.0.1".into(),
        "--health-server-port=0".into(),
        "--admin-server-port=0".into(),
        // The default dial policy, judging every dial, with the bench's loopback
        // backends allowed.
        "--dial-allow=127.0.0.0/8,::1".into(),
    ]
}

/// Runs this binary with `args` as a helper (`what`) that prints its listening port
/// first; returns the port.
pub(crate) fn spawn_self(what: &str, args: &[String]) -> anyhow::Result<(u16, Proc)> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    let out = child
        .stdout
        .take()
        .with_context(|| format!("{what} stdout"));
    let proc = Proc(child);
    BufReader::new(out?).read_line(&mut line)?;
    let port: u16 = line
        .trim()
        .parse()
        .with_context(|| format!("the {what} did not report its port"))?;
    Ok((port, proc))
}

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub(crate) fn wait_port(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!("nothing listens on port {port}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

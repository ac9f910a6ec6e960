//! `tether local`: the embedded default. A server (gRPC frontend on a Unix socket,
//! HTTP-CONNECT frontend on 127.0.0.1 with mutual TLS), one agent and a small demo HTTP
//! backend, all on loopback with a throwaway PKI, until Ctrl-C.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tether_agent::{Agent, AgentConfig, AgentTls};
use tether_certs::DevPki;
use tether_core::tls::TlsFiles;
use tether_server::{FrontendConfig, Listen, Mode, RouterConfig, Server, ServerConfig, Strategy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::LogArgs;

/// `tether local` flags.
#[derive(Args, Debug)]
pub struct LocalArgs {
    /// HTTP-CONNECT (mTLS) frontend port on 127.0.0.1 (0 = any free port).
    #[arg(long, default_value_t = 0)]
    pub http_connect_port: u16,
    /// Directory for the PKI and the socket (default: a fresh temporary directory,
    /// removed on exit).
    ///
    /// A directory given here is kept on exit.

    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// How the agent reaches the server, in order of preference: h2, websocket (as the
    /// agent's --transports).
    #[arg(long, value_delimiter = ',', default_value = "h2")]
    pub transports: Vec<String>,
    #[command(flatten)]
    pub log: LogArgs,
}

/// Runs server + agent + demo backend until Ctrl-C.
pub fn main(args: LocalArgs) -> anyhow::Result<()> {
    args.log.init()?;
    let transports = super::agent::parse_transports(&args.transports)?;
    let (dir, temporary) = match &args.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("tether-local-{}", std::process::id())),
            true,
        ),
    };
    let pki = DevPki::generate(&dir)
        .with_context(|| format!("cannot create the throwaway PKI in {}", dir.display()))?;
    let socket = dir.join("konnectivity-server.socket");
    let result = super::block_on(0, run(args, pki, socket, transports));
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

/// Starts the demo backend, the server and the agent; prints where they listen once the
/// agent is connected; stops them all at Ctrl-C.
async fn run(
    args: LocalArgs,
    pki: DevPki,
    socket: PathBuf,
    transports: Vec<tether_agent::Transport>,
) -> anyhow::Result<()> {
    let hard_stop = CancellationToken::new();
    let demo = tokio::net::TcpListener::bind(loopback(0)).await?;
    let demo_addr = demo.local_addr()?;
    tokio::spawn(
        demo_backend(demo, hard_stop.clone()).instrument(tracing::info_span!("demo_backend")),
    );

    let config = server_config(&args, &pki, &socket);
    let bound = Server::bind(config)
        .await
        .context("server start-up failed")?;
    let addrs = bound.addrs().clone();
    let router = bound.router().clone();
    // The server's drain starts at the hard stop, which ends the agent and its tunnels.
    let server_task = tokio::spawn(bound.run(hard_stop.clone()));

    let mut agent_cfg = agent_config(&pki, addrs.agent.port(), transports)?;
    agent_cfg.quic_port = addrs.agent_quic.map(|a| a.port());
    let agent = Agent::new(agent_cfg)?;
    let agent_drain = CancellationToken::new();
    let agent_task = {
        let (agent, drain, hard_stop) = (agent.clone(), agent_drain.clone(), hard_stop.clone());
        tokio::spawn(async move { agent.run(drain, hard_stop).await })
    };

    wait_for_agent(&router).await?;
    print_ready(&pki, &socket, &addrs, demo_addr);

    tether_ops::shutdown::signal().await;
    agent_drain.cancel();
    hard_stop.cancel();
    let _ = agent_task.await;
    let _ = server_task.await;
    Ok(())
}

/// `port` on 127.0.0.1.
fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// The server's settings: the [`frontends`] and the agent listener on loopback, with the
/// throwaway PKI.
fn server_config(args: &LocalArgs, pki: &DevPki, socket: &Path) -> ServerConfig {
    ServerConfig {
        server_id: "local".into(),
        server_count: 1,
        frontends: frontends(args, pki, socket),
        agent_addr: loopback(0),
        reuse_port: false,
        agent_tls: TlsFiles {
            cert: pki.server_cert.clone(),
            key: pki.server_key.clone(),
            ca: Some(pki.ca_cert.clone()),
            policy: Default::default(),
        },
        agent_keepalive: Duration::from_secs(30),
        frontend_keepalive: Duration::from_secs(3600),
        agent_dead_link: Some(Duration::from_secs(30)),
        health_addr: Some(loopback(0)),
        admin_addr: None,
        admin_tls: None,
        router: RouterConfig {
            strategies: vec![Strategy::Default],
            backend_dial_timeout: Some(Duration::from_secs(10)),
            flow_control: true,
            stall_timeout: tether_core::flow::DEFAULT_STALL_TIMEOUT,
            trust_claims: false,
            max_agent_streams: tether_server::DEFAULT_MAX_AGENT_STREAMS,
            agent_wait: Duration::from_secs(5),
        },
        channel_size: 10,
        graceful_shutdown_timeout: Duration::from_secs(5),
        agent_auth: None,
        require_agent_identity_match: false,
        agent_websocket: true,
        agent_quic_addr: Some(loopback(0)),
        nodes: None,
        admission: tether_core::admission::AdmissionLimits::for_open_files(
            tether_ops::limits::open_file_limit().unwrap_or(1024),
        ),
        profiling: false,
        agents_access: tether_server::AgentsAccess::Anyone,
        audit: None,
        cert_reload_interval: Duration::from_secs(60),
        lease: None,
    }
}

/// The two frontends: gRPC on `socket`, and HTTP-CONNECT with mutual TLS on
/// --http-connect-port (clients signed by the PKI's frontend CA).
fn frontends(args: &LocalArgs, pki: &DevPki, socket: &Path) -> Vec<FrontendConfig> {
    vec![
        FrontendConfig {
            mode: Mode::Grpc,
            listen: Listen::Uds {
                path: socket.to_path_buf(),
                delete_existing: true,
                access: Default::default(),
            },
        },
        FrontendConfig {
            mode: Mode::HttpConnect,
            listen: Listen::Tcp {
                addr: loopback(args.http_connect_port),
                tls: TlsFiles {
                    cert: pki.server_cert.clone(),
                    key: pki.server_key.clone(),
                    ca: Some(pki.frontend_ca_cert.clone()),
                    policy: Default::default(),
                },
                clients: Default::default(),
            },
        },
    ]
}

/// The agent's settings: the server's agent listener at `server_port` on loopback over
/// `transports`, the throwaway PKI, and a policy allowing only this machine's loopback.
fn agent_config(
    pki: &DevPki,
    server_port: u16,
    transports: Vec<tether_agent::Transport>,
) -> anyhow::Result<AgentConfig> {
    Ok(AgentConfig {
        servers: vec![("127.0.0.1".into(), server_port)],
        sync_forever: false,
        lease_count: None,
        count_source: Default::default(),
        tls: AgentTls {
            ca: pki.ca_cert.clone(),
            identity: Some((pki.agent_cert.clone(), pki.agent_key.clone())),
            alpn: vec![tether_core::tls::ALPN_H2.to_vec()],
        },
        cert_reload_interval: Duration::from_secs(60),
        agent_id: tether_certs::DEV_AGENT_NODE.into(),
        // Nothing to route by: the demo's dials go by the `default` strategy.
        identifiers: String::new(),
        token_path: None,
        sync_interval: Duration::from_secs(1),
        sync_interval_cap: Duration::from_secs(10),
        keepalive: Duration::from_secs(30),
        dead_link: Some(Duration::from_secs(30)),
        dial_timeout: Duration::from_secs(5),
        channel_size: 150,
        flow_control: true,
        stall_timeout: tether_core::flow::DEFAULT_STALL_TIMEOUT,
        profiling: false,
        // On loopback, which no egress proxy serves.
        egress: Default::default(),
        // This machine's loopback (the demo backend) and nothing else, as an agent on a
        // node allows its kubelet and pods: a dial elsewhere shows a policy refusal.
        policy: tether_agent::policy::PolicyConfig {
            allow: ["127.0.0.0/8", "::1"]
                .iter()
                .map(|a| tether_agent::policy::Allow::parse(a))
                .collect::<Result<_, _>>()?,
            ..Default::default()
        },
        ready_with_every_server: false,
        transports,
        quic_port: None,
    })
}

/// Waits (up to 10 s) until the agent's stream is registered with the router.
async fn wait_for_agent(router: &tether_server::Router) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while router.registry().is_empty() {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the local agent did not connect within 10s (see the log above)"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Prints where everything listens and how to send traffic through the tunnel.
fn print_ready(
    pki: &DevPki,
    socket: &Path,
    addrs: &tether_server::BoundAddrs,
    demo_addr: SocketAddr,
) {
    let http_connect = &addrs.frontends[1];
    let d = pki.dir.display();
    println!(
        "\
Tether is running: one server and one agent on loopback, throwaway PKI in {d}

  gRPC frontend (what kube-apiserver uses)  unix://{socket}
  HTTP-CONNECT frontend (mutual TLS)        https://{http_connect}
  agent listener (mutual TLS)               {agent}
  health                                    http://{health}/readyz  and  /metrics
  demo backend (reached through the agent)  http://{demo_addr}/

Send traffic through the tunnel:

  curl -p -x https://{http_connect} --proxy-cacert {d}/ca.crt --proxy-cert {d}/frontend-client.crt --proxy-key {d}/frontend-client.key http://{demo_addr}/

Press Ctrl-C to stop.",
        socket = socket.display(),
        agent = addrs.agent,
        health = addrs.health.map(|a| a.to_string()).unwrap_or_default(),
    );
    tracing::info!(http_connect = %http_connect, demo = %demo_addr, "local ready");
}

/// Answers every HTTP request with a short text naming the connection's peer.
async fn demo_backend(listener: tokio::net::TcpListener, hard_stop: CancellationToken) {
    loop {
        let (mut sock, peer) = tokio::select! {
            _ = hard_stop.cancelled() => return,
            a = listener.accept() => match a { Ok(p) => p, Err(_) => continue },
        };
        tokio::spawn(async move {
            let mut buf = Vec::with_capacity(1024);
            let mut chunk = [0u8; 1024];
            while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 64 * 1024 {
                match sock.read(&mut chunk).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            let body = format!("hello from behind the tunnel (the agent connected from {peer})\n");
            let resp = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

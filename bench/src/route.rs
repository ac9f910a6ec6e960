//! The routes under comparison (direct, each Tether frontend, ssh -L, the relay
//! floors, the CCM load balancer), the running set-up they go through, and how a
//! connection is opened along each.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use anyhow::{bail, Context};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::procinfo::{cpu_seconds, with_descendants};
use crate::procs::Proc;

pub(crate) trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}
pub(crate) type Conn = Pin<Box<dyn Io>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    Direct,
    GrpcUds,
    /// The gRPC route with `--audit-log-path` on server and agent.
    GrpcUdsAudit,
    /// The gRPC route with the agent's stream over WebSocket.
    GrpcUdsWs,
    /// The gRPC route with the agent's stream over QUIC.
    GrpcUdsQuic,
    HttpConnectUds,
    Ssh,
    Relay,
    /// The tunnel with one plain relay behind it: the LB route's floor (as many TCP
    /// connections, the cheapest possible hop in place of the balancer).
    GrpcRelay,
    LoadBalancer,
}

impl Route {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Route::Direct => "direct",
            Route::GrpcUds => "tether grpc/uds",
            Route::GrpcUdsAudit => "tether grpc/uds + audit",
            Route::GrpcUdsWs => "tether grpc/uds, agent over websocket",
            Route::GrpcUdsQuic => "tether grpc/uds, agent over quic",
            Route::HttpConnectUds => "tether http-connect/uds",
            Route::Ssh => "ssh -L",
            Route::Relay => "2 plain relays (floor)",
            Route::GrpcRelay => "grpc/uds + 1 relay",
            Route::LoadBalancer => "ccm LB + grpc/uds",
        }
    }
}

/// Everything the routes go through, started and running.
pub(crate) struct Env {
    pub(crate) backend: SocketAddr,
    pub(crate) connect_socket: PathBuf,
    pub(crate) client: tether_client::Client,
    /// The client of the audited gRPC pair (`--audit`).
    pub(crate) audit_client: Option<tether_client::Client>,
    /// The client of the gRPC pair whose agent speaks WebSocket (`--websocket`).
    pub(crate) ws_client: Option<tether_client::Client>,
    /// The client of the gRPC pair whose agent speaks QUIC (`--quic`).
    pub(crate) quic_client: Option<tether_client::Client>,
    pub(crate) ssh_port: Option<u16>,
    pub(crate) relay_port: Option<u16>,
    pub(crate) lb_port: Option<u16>,
    /// One plain relay in front of the backend (the LB route's floor).
    pub(crate) backend_relay_port: Option<u16>,
    pub(crate) grpc_server_pid: u32,
    pub(crate) grpc_agent_pid: u32,
    pub(crate) grpc_health: SocketAddr,
    /// The processes carrying each route's bytes (server and agent; ssh and sshd).
    pub(crate) carriers: Vec<(Route, Vec<u32>)>,
    pub(crate) _procs: Vec<Proc>,
}

impl Env {
    /// Whether `route`'s bytes go through the benched agent.
    pub(crate) fn carries_agent(&self, route: Route) -> bool {
        self.carriers
            .iter()
            .any(|(r, p)| *r == route && p.contains(&self.grpc_agent_pid))
    }

    /// CPU time (seconds) the processes carrying `route` have used so far, their
    /// children included (sshd forks one per session).
    pub(crate) fn carrier_cpu(&self, route: Route) -> f64 {
        let pids = self
            .carriers
            .iter()
            .find(|(r, _)| *r == route)
            .map(|(_, p)| p.clone())
            .unwrap_or_default();
        with_descendants(&pids).into_iter().map(cpu_seconds).sum()
    }

    pub(crate) async fn connect(&self, route: Route, target: SocketAddr) -> anyhow::Result<Conn> {
        Ok(match route {
            Route::Direct => {
                let s = tokio::net::TcpStream::connect(target).await?;
                s.set_nodelay(true)?;
                Box::pin(s)
            }
            Route::GrpcUds => Box::pin(self.client.dial(&target.to_string()).await?),
            Route::GrpcUdsAudit => {
                let client = self
                    .audit_client
                    .as_ref()
                    .context("audit pair not set up")?;
                Box::pin(client.dial(&target.to_string()).await?)
            }
            Route::GrpcUdsWs | Route::GrpcUdsQuic => {
                let client = match route {
                    Route::GrpcUdsWs => self.ws_client.as_ref(),
                    _ => self.quic_client.as_ref(),
                };
                let client = client.context("transport pair not set up")?;
                Box::pin(client.dial(&target.to_string()).await?)
            }
            Route::GrpcRelay => {
                let port = self.backend_relay_port.context("relay not set up")?;
                Box::pin(self.client.dial(&format!("127.0.0.1:{port}")).await?)
            }
            Route::HttpConnectUds => http_connect(&self.connect_socket, target).await?,
            Route::Ssh | Route::Relay | Route::LoadBalancer => {
                let port = match route {
                    Route::Ssh => self.ssh_port.context("ssh not set up")?,
                    Route::Relay => self.relay_port.context("relays not set up")?,
                    _ => self.lb_port.context("load balancer not set up")?,
                };
                let s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
                s.set_nodelay(true)?;
                Box::pin(s)
            }
        })
    }
}

/// Opens a tunnel to `target` through the HTTP-CONNECT frontend on the Unix socket
/// `socket`, reading the answer buffered as kube-apiserver does (not a byte per read).
pub(crate) async fn http_connect(socket: &Path, target: SocketAddr) -> anyhow::Result<Conn> {
    let mut s = tokio::net::UnixStream::connect(socket).await?;
    s.write_all(format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n").as_bytes())
        .await?;
    // The backend never speaks first, so nothing can follow the head yet.
    let mut head = Vec::with_capacity(256);
    let mut b = [0u8; 256];
    let end = loop {
        let n = s.read(&mut b).await?;
        if n == 0 {
            bail!("CONNECT: closed");
        }
        head.extend_from_slice(&b[..n]);
        if head.len() > 4096 {
            bail!("CONNECT: answer head over 4 KiB");
        }
        if let Some(i) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    if !head.starts_with(b"HTTP/1.1 200") {
        bail!("CONNECT: {:?}", String::from_utf8_lossy(&head));
    }
    if end != head.len() {
        bail!(
            "CONNECT: bytes after the answer {:?}",
            String::from_utf8_lossy(&head)
        );
    }
    Ok(Box::pin(s))
}

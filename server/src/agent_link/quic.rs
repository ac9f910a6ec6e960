//! Agent streams over QUIC (`tether_core::quic`), one per connection: the UDP
//! listener's accept loop (a Retry for every source address not yet validated, so the
//! server amplifies nothing; then the agent port's admission caps), the handshake,
//! the control stream's head admitted as a Connect call is (the same metadata, checked
//! the same way), the answer, then the stream carried: a tunnel per QUIC stream, its
//! end a connection close carrying the status.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use futures::StreamExt;
use quinn::VarInt;
use rustls_pki_types::CertificateDer;
use tether_core::admission::{Admission, ConnectionSlot, Pending, Stage};
use tether_core::error::chain;
use tether_core::quic::{self, Inbound, Mux, PacketReader, ReadError};
use tether_core::transport::{ServerConfigSource, TlsConnectInfo};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};
use tracing::Instrument;

use super::{shown, AgentLink, ConnStreams, Opened, PacketStream, CONNECT_PATH};
use crate::metrics::Segment;
use crate::router::{AgentStream, Router};

/// How long a QUIC handshake may take.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// How long a refusal or the close gets to reach the agent.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// How long the answer to an admitted agent may take to be written.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// A silent QUIC connection is dead after this (the agent pings well within it).
pub const IDLE: Duration = Duration::from_secs(30);

/// The UDP agent listener: bound, or waiting for its port.
pub enum QuicPort {
    /// Bound and ready.
    Bound(quinn::Endpoint),
    /// Held by another process (a predecessor on the same host, `--reuse-port`): bound
    /// once that one lets go (with this reset key).
    Busy(SocketAddr, Reset),
}

use tether_core::quic::Reset;

/// The UDP agent listener: binds `addr` with the agent TLS settings `tls` (failing
/// start-up when they allow no TLS 1.3). With `share` (`--reuse-port`) a port another
/// process holds is waited for: QUIC's port is never shared, since the kernel would
/// hand one process's connections' datagrams to the other, which knows nothing of
/// them.
pub fn bind(
    addr: SocketAddr,
    tls: &ServerConfigSource,
    secret: &[u8],
    share: bool,
) -> Result<QuicPort, String> {
    let config = server_config(&tls())?;
    let reset = quic::reset_key(secret);
    match quic::endpoint(addr, Some(config), Some(reset.clone())) {
        Ok(endpoint) => Ok(QuicPort::Bound(endpoint)),
        Err(e) if share && e.kind() == std::io::ErrorKind::AddrInUse => {
            Ok(QuicPort::Busy(addr, reset))
        }
        Err(e) => Err(format!("cannot bind UDP {addr}: {e}")),
    }
}

impl QuicPort {
    /// The address it is (or will be) bound to.
    pub fn addr(&self) -> Option<SocketAddr> {
        match self {
            QuicPort::Bound(e) => e.local_addr().ok(),
            QuicPort::Busy(addr, _) => Some(*addr),
        }
    }

    /// The endpoint, once bound (every [`RETRY_BIND`] while the port is busy); `None` at
    /// `accepting`'s end first.
    async fn endpoint(
        self,
        config: &mut Config,
        accepting: &CancellationToken,
    ) -> Option<quinn::Endpoint> {
        let (addr, reset) = match self {
            QuicPort::Bound(endpoint) => return Some(endpoint),
            QuicPort::Busy(addr, reset) => (addr, reset),
        };
        tracing::info!(%addr, "the QUIC port is held by another process (the server this one succeeds, sharing the agent port with --reuse-port); agents reach this server over h2 or WebSocket until it lets go");
        loop {
            tokio::select! {
                _ = accepting.cancelled() => return None,
                _ = tokio::time::sleep(RETRY_BIND) => {}
            }
            let Some(cfg) = config.current() else {
                continue;
            };
            if let Ok(endpoint) = quic::endpoint(addr, Some((*cfg).clone()), Some(reset.clone())) {
                tracing::info!(%addr, "QUIC port bound");
                return Some(endpoint);
            }
        }
    }
}

/// How often a successor tries the QUIC port its predecessor holds.
const RETRY_BIND: Duration = Duration::from_secs(1);

/// The server sends no keepalive pings: each agent pings (within a third of [`IDLE`]),
/// which keeps both ends and any NAT between them alive, and one that stops is gone
/// after [`IDLE`].
fn server_config(tls: &rustls::ServerConfig) -> Result<quinn::ServerConfig, String> {
    let transport = quic::transport_config(Duration::ZERO, IDLE, true);
    quic::server_config(tls, transport)
}

/// Accepts QUIC connections until `accepting` is cancelled, each served in a task of
/// its own; then waits for those (each ends within [`CLOSE_GRACE`] of the hard stop).
pub(crate) async fn accept_loop(
    link: Arc<AgentLink>,
    port: QuicPort,
    tls: ServerConfigSource,
    admission: Arc<Admission>,
    accepting: CancellationToken,
) {
    let connections = tokio_util::task::TaskTracker::new();
    let mut config = Config::new(tls);
    let Some(endpoint) = port.endpoint(&mut config, &accepting).await else {
        return;
    };
    loop {
        let incoming = tokio::select! {
            _ = accepting.cancelled() => break,
            incoming = endpoint.accept() => match incoming {
                Some(i) => i,
                None => break,
            },
        };
        let admitted = tokio::select! {
            _ = accepting.cancelled() => break,
            admitted = admit(incoming, &admission) => admitted,
        };
        let Some((incoming, slot, pending)) = admitted else {
            continue;
        };
        let peer = incoming.remote_address();
        let Some(cfg) = config.current() else {
            incoming.refuse();
            continue;
        };
        let connecting = match incoming.accept_with(cfg) {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(%peer, error = %chain(&e), "QUIC connection failed at once");
                continue;
            }
        };
        let span = tracing::debug_span!("agent_connection", %peer, transport = "quic");
        let serve = serve_connection(link.clone(), connecting, peer, (slot, pending));
        connections.spawn(serve.instrument(span));
    }
    endpoint.set_server_config(None);
    connections.close();
    connections.wait().await;
    endpoint.close(VarInt::from_u32(quic::CLOSE_OK), b"server stopping");
}

/// A connection attempt's way in: a source not yet validated gets a Retry (a token it
/// must echo), never more bytes than it sent, and costs nothing else (a spoofed source
/// makes the server answer a stranger, but takes no place under the caps); a validated
/// one then waits for a place under the connection cap and takes one among the
/// unproven (refused when its address or prefix has too many).
async fn admit(
    incoming: quinn::Incoming,
    admission: &Admission,
) -> Option<(quinn::Incoming, ConnectionSlot, Pending)> {
    if !incoming.remote_address_validated() {
        if incoming.may_retry() {
            let _ = incoming.retry();
        } else {
            incoming.ignore();
        }
        return None;
    }
    let slot = admission.connection_slot().await;
    let peer = incoming.remote_address();
    let Ok(pending) = admission.admit(peer.ip()).await else {
        tracing::debug!(%peer, "too many unproven connections from this address or prefix; refused");
        incoming.refuse();
        return None;
    };
    pending.set_stage(Stage::Handshaking);
    Some((incoming, slot, pending))
}

/// The QUIC settings of the agent TLS settings now, rebuilt when they are reloaded.
struct Config {
    tls: ServerConfigSource,
    built: Option<(Arc<rustls::ServerConfig>, Arc<quinn::ServerConfig>)>,
}

impl Config {
    fn new(tls: ServerConfigSource) -> Self {
        Config { tls, built: None }
    }

    fn current(&mut self) -> Option<Arc<quinn::ServerConfig>> {
        let tls = (self.tls)();
        if let Some((from, built)) = &self.built {
            if Arc::ptr_eq(from, &tls) {
                return Some(built.clone());
            }
        }
        match server_config(&tls) {
            Ok(cfg) => {
                let cfg = Arc::new(cfg);
                self.built = Some((tls, cfg.clone()));
                Some(cfg)
            }
            Err(e) => {
                tracing::warn!(error = %e, "the reloaded agent TLS settings cannot serve QUIC; refused");
                None
            }
        }
    }
}

/// One QUIC connection under the agent connection's watch.
async fn serve_connection(
    link: Arc<AgentLink>,
    connecting: quinn::Connecting,
    peer: SocketAddr,
    (_slot, pending): (ConnectionSlot, Pending),
) {
    let streams = Arc::new(ConnStreams {
        stages: Some(pending.stages()),
        ..ConnStreams::default()
    });
    let serve = carry_connection(link.clone(), connecting, peer, streams.clone());
    link.watched(peer, &streams, Some(pending), serve).await;
}

/// The handshake, the control stream's head, the admission, then the stream carried.
async fn carry_connection(
    link: Arc<AgentLink>,
    connecting: quinn::Connecting,
    peer: SocketAddr,
    streams: Arc<ConnStreams>,
) {
    let Some((conn, info)) = handshake(connecting, peer).await else {
        return;
    };
    streams.stage(Stage::Connected);
    let Ok((mut send, mut recv)) = conn.accept_bi().await else {
        return;
    };
    let head = match tether_core::ws::read_head(&mut recv, BytesMut::new()).await {
        Ok(head) => head,
        Err(e) => {
            refused!(link, %peer, error = %chain(&e), "unreadable agent request over QUIC; closed");
            return refuse(
                &conn,
                &mut send,
                &streams,
                Status::invalid_argument(e.to_string()),
            )
            .await;
        }
    };
    if head.method != "CONNECT" || head.path != CONNECT_PATH {
        let path = tether_core::ratelimit::clipped(&head.path, 128);
        refused!(link, %peer, %path, "agent request over QUIC is no Connect call; refused");
        let status = Status::unimplemented(format!("agents connect to {CONNECT_PATH}"));
        return refuse(&conn, &mut send, &streams, status).await;
    }
    let tether_core::ws::Head { headers, rest, .. } = head;
    let opened = Box::pin(link.admit_and_open(headers, &info, &streams, "quic"));
    let opened = match opened.await {
        Ok(o) => o,
        Err(status) => return refuse(&conn, &mut send, &streams, status).await,
    };
    quic::admitted(&conn);
    let answer = quic::accepted(&link.answer(opened.peer_window));
    let answered = tokio::time::timeout(ANSWER_WITHIN, send.write_all(&answer)).await;
    if !matches!(answered, Ok(Ok(()))) {
        link.router.remove_agent(&opened.agent);
        return;
    }
    let span = opened.span.clone();
    let reader = PacketReader::new(recv, rest.as_ref().into());
    let (mux, inbound) = Mux::start(conn, send, reader, span.clone());
    let gauge = link
        .router
        .metrics
        .agent_streams
        .with_label_values(&["quic"]);
    gauge.inc();
    carry(&link, opened, &mux, inbound).instrument(span).await;
    gauge.dec();
}

/// The QUIC handshake, within [`HANDSHAKE`]: the connection, and who the peer is (its
/// address and certificate chain, as a TLS connection's).
async fn handshake(
    connecting: quinn::Connecting,
    peer: SocketAddr,
) -> Option<(quinn::Connection, TlsConnectInfo)> {
    let conn = match tokio::time::timeout(HANDSHAKE, connecting).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            tracing::debug!(%peer, error = %chain(&e), "QUIC handshake failed");
            return None;
        }
        Err(_) => {
            tracing::debug!(%peer, "QUIC handshake timed out");
            return None;
        }
    };
    let peer_certs = conn
        .peer_identity()
        .and_then(|id| id.downcast::<Vec<CertificateDer<'static>>>().ok())
        .map(|certs| Arc::new(*certs));
    let info = TlsConnectInfo {
        remote_addr: peer,
        peer_certs,
    };
    Some((conn, info))
}

/// Answers a refused head on the control stream and closes the connection with the
/// status; while unproven the connection may be evicted at once.
async fn refuse(
    conn: &quinn::Connection,
    send: &mut quinn::SendStream,
    streams: &ConnStreams,
    status: Status,
) {
    streams.stage(Stage::Silent);
    let answer = tether_core::ws::refused_with(status.code() as i32, status.message());
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        let _ = send.write_all(&answer).await;
        let _ = send.finish();
        let _ = send.stopped().await;
    })
    .await;
    quic::close(conn, status.code() as i32, status.message());
}

/// Carries an opened stream both ways until it ends, the connection fails, or the
/// agent's token no longer passes; then closes the connection with the status.
async fn carry(link: &AgentLink, opened: Opened, mux: &Arc<Mux>, inbound: Inbound) {
    let Opened {
        agent,
        packets,
        token,
        live: _live,
        ..
    } = opened;
    let status = {
        let both = std::pin::pin!(both_ways(link, &agent, mux, inbound, packets));
        let revoked = std::pin::pin!(link.revocation(token));
        tokio::select! {
            status = both => status,
            why = revoked => link.revoked(&why),
        }
    };
    link.router.remove_agent(&agent);
    mux.close(status.code() as i32, status.message());
    let _ = tokio::time::timeout(CLOSE_GRACE, mux.connection().closed()).await;
    tracing::info!("agent disconnected");
}

/// Both halves until both are done, as the HTTP/2 stream's.
async fn both_ways(
    link: &AgentLink,
    agent: &Arc<AgentStream>,
    mux: &Arc<Mux>,
    inbound: Inbound,
    packets: PacketStream,
) -> Status {
    let router = &link.router;
    let inbound = async {
        let failed = read(router, agent, inbound, link.hard_stop.clone(), mux).await;
        router.remove_agent(agent);
        failed
    };
    super::both_halves(inbound, write(router, mux, packets)).await
}

/// Feeds what the agent sends, off every stream, into the router until the control
/// stream ends, the connection fails, the stream is retired, or the hard stop; the
/// status to close with when the agent broke the protocol.
async fn read(
    router: &Arc<Router>,
    agent: &Arc<AgentStream>,
    mut inbound: Inbound,
    hard_stop: CancellationToken,
    mux: &Mux,
) -> Option<Status> {
    let message = loop {
        let next = tokio::select! {
            next = inbound.recv() => next,
            _ = hard_stop.cancelled() => return None,
            _ = agent.closed.cancelled() => return None,
            e = mux.connection().closed() => {
                tracing::debug!(error = %chain(&e), "agent QUIC connection ended");
                return None;
            }
        };
        match next {
            Some(Ok(packet)) => Box::pin(router.on_agent_packet(agent, packet)).await,
            Some(Err(ReadError::Malformed(m))) => break m,
            Some(Err(ReadError::Io(_))) | None => return None,
        }
    };
    let status = Status::internal(message);
    router
        .metrics
        .stream_error(Segment::FromAgent, status.code());
    tracing::info!(error = %status.message(), agent_id = %shown(&agent.agent_id), "agent stream failed");
    Some(status)
}

/// Sends the packets for the agent, each on its tunnel's stream, until they end (true)
/// or the connection is gone.
async fn write(router: &Router, mux: &Arc<Mux>, mut packets: PacketStream) -> bool {
    while let Some(packet) = packets.next().await {
        if !mux.send(&packet).await {
            router
                .metrics
                .send_error(Segment::ToAgent, Code::Unavailable, packet.r#type);
            return false;
        }
    }
    true
}

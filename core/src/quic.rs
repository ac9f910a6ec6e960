//! The agent link over QUIC (quinn with rustls), Tether's own transport beside gRPC on
//! HTTP/2: the ALPN and the endpoint settings both ends use, the opening exchange on
//! the control stream (the agent's metadata as an HTTP/1.1-style head, the server's
//! answer), packets as gRPC messages on streams, and [`Mux`], which gives every tunnel
//! a stream of its own so that a loss on one stalls no other.
//!
//! Streams: the agent opens one bidirectional stream, the control stream (its head,
//! the answer, then every packet that belongs to no tunnel: DRAIN). The server opens
//! one bidirectional stream per DIAL_REQ; the dial's answer, its data both ways,
//! WINDOW_UPDATE and the close all travel on it, in order, and it ends with the
//! tunnel. A packet for a tunnel whose stream is gone travels on the control stream,
//! so nothing is lost for want of a stream.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use futures::FutureExt;
use prost::Message;
use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::{RecvStream, SendStream, VarInt};
use tether_proto::packet::Payload;
use tether_proto::Packet;
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

pub use quinn;

/// The ALPN protocol of Tether's agent link over QUIC.
pub const ALPN_QUIC: &[u8] = b"tether/1";

/// A stream's receive window: what one tunnel may have in flight towards its reader.
/// Above the credit window (`core::flow`), so that flow control, not QUIC, paces a
/// tunnel.
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;

/// The connection's receive window (all tunnels of an agent).
const CONN_WINDOW: u32 = 32 * 1024 * 1024;

/// What quinn holds of a connection's sent data until the peer acknowledges it (and
/// buffers for streams the peer gives no credit): a 100 ms path at 160 MiB/s.
const SEND_WINDOW: u32 = 16 * 1024 * 1024;

/// What a client the server has not admitted may have buffered at the server.
const UNPROVEN_WINDOW: u32 = 64 * 1024;

/// The server's side once a connection's agent is admitted: its full receive window.
pub fn admitted(conn: &quinn::Connection) {
    conn.set_receive_window(VarInt::from_u32(CONN_WINDOW));
}

/// Tunnel streams an agent lets the server have open at once, those still closing
/// included: well above [`MAX_TUNNEL_STREAMS`], for the streams that linger after
/// their tunnel. Not more: quinn keeps state for every stream the peer may open from
/// the start, and 16,384 cost each agent connection a megabyte. When the agent gives
/// no credit, dials go on the control stream (`Mux::route`).
pub const MAX_TUNNELS: u32 = 1024;

/// Each end's UDP socket buffers: a burst of datagrams waits there while the endpoint's
/// task is busy (the kernel's default, 208 KiB, is a few milliseconds of a fast link;
/// a restarted server's reconnect storm is thousands of Initials at once, and each
/// one dropped costs its agent a retransmission timeout of a second or more).
const SOCKET_BUFFER: usize = 16 << 20;

/// Connection attempts quinn holds for the accept loop; more are refused.
const MAX_INCOMING: usize = 4096;

/// How long a Retry token stays good: a client answers a Retry within a round trip.
const RETRY_TOKEN_LIFETIME: Duration = Duration::from_secs(15);

/// The largest packet a stream may carry: well above the largest DATA packet a
/// Tether peer sends (`core::pump::READ_CHUNK`), and what one stream's reader may
/// hold while a packet comes in.
pub const MAX_PACKET: usize = 160 << 10;

/// Most bytes of an opening head or answer.
const MAX_HEAD: usize = 16 * 1024;

/// Application close codes: the connection ended on purpose (the status in the
/// reason), or a peer broke the protocol.
pub const CLOSE_OK: u32 = 0;
/// A refusal or an error status (its gRPC code and message in the reason).
pub const CLOSE_STATUS: u32 = 1;

/// The transport settings: `keepalive` between pings (none if zero), and the idle
/// timeout after which a silent connection is dead. `server` opens the tunnels'
/// streams; the agent opens the control stream only.
pub fn transport_config(
    keepalive: Duration,
    idle: Duration,
    server: bool,
) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    // The server lets an unproven client buffer little ([`admitted`] opens the window).
    let window = if server { UNPROVEN_WINDOW } else { CONN_WINDOW };
    t.stream_receive_window(VarInt::from_u32(STREAM_WINDOW))
        .receive_window(VarInt::from_u32(window))
        .datagram_receive_buffer_size(None)
        .send_window(u64::from(SEND_WINDOW))
        .max_concurrent_uni_streams(VarInt::from_u32(0))
        .max_concurrent_bidi_streams(VarInt::from_u32(if server { 1 } else { MAX_TUNNELS }))
        .keep_alive_interval((!keepalive.is_zero()).then_some(keepalive))
        .max_idle_timeout(idle.try_into().ok())
        // BBR paces by the path's measured rate instead of halving at each loss: a
        // lossy edge link (the case for QUIC) keeps its throughput.
        .congestion_controller_factory(Arc::new(quinn::congestion::BbrConfig::default()));
    t
}

/// The server's QUIC settings from its agent TLS configuration: the same certificate
/// and client verification, ALPN `tether/1`, address validation by Retry tokens.
/// An error when the TLS settings leave no TLS 1.3 (QUIC has no other).
pub fn server_config(
    tls: &rustls::ServerConfig,
    transport: quinn::TransportConfig,
) -> Result<quinn::ServerConfig, String> {
    let mut tls = tls.clone();
    tls.alpn_protocols = vec![ALPN_QUIC.to_vec()];
    tls.max_early_data_size = 0;
    let crypto = QuicServerConfig::try_from(tls).map_err(|e| {
        format!("QUIC needs TLS 1.3 with TLS_AES_128_GCM_SHA256, which the TLS settings leave out ({e}); allow TLS 1.3 (--tls-min-version, --cipher-suites) or leave QUIC off")
    })?;
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    cfg.transport_config(Arc::new(transport))
        .retry_token_lifetime(RETRY_TOKEN_LIFETIME)
        .migration(true)
        // Connection attempts waiting for the accept loop, and what they may buffer.
        .max_incoming(MAX_INCOMING)
        .incoming_buffer_size(16 << 10)
        .incoming_buffer_size_total(16 << 20);
    Ok(cfg)
}

/// The agent's QUIC settings from its TLS client configuration.
pub fn client_config(
    tls: &rustls::ClientConfig,
    transport: quinn::TransportConfig,
) -> Result<quinn::ClientConfig, String> {
    let mut tls = tls.clone();
    tls.alpn_protocols = vec![ALPN_QUIC.to_vec()];
    tls.enable_early_data = false;
    let crypto = QuicClientConfig::try_from(tls)
        .map_err(|e| format!("QUIC needs TLS 1.3 with TLS_AES_128_GCM_SHA256 ({e})"))?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(Arc::new(transport));
    Ok(cfg)
}

/// A UDP socket for an agent's endpoint, of `remote`'s family, on any address: the
/// kernel picks the source address for each datagram, so that when the node's address
/// changes the connection moves with it (QUIC's migration).
pub fn client_endpoint(remote: SocketAddr) -> io::Result<quinn::Endpoint> {
    let any: SocketAddr = if remote.is_ipv4() {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    endpoint(any, None, None)
}

/// The key a server signs its stateless resets with, derived from `secret` (its
/// private key file's bytes): a restarted server, which knows nothing of its
/// predecessor's connections, then answers their agents' next datagram with a reset
/// they accept, and they reconnect at once instead of after the idle timeout.
pub fn reset_key(secret: &[u8]) -> Reset {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(b"tether quic stateless reset\0");
    ctx.update(secret);
    let digest = ctx.finish();
    let (key, cids) = digest.as_ref().split_at(24);
    let cids = u64::from_le_bytes(cids.try_into().expect("8 bytes"));
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key);
    (Arc::new(key), cids)
}

/// The key a server signs stateless resets with, and the one its connection IDs are
/// made (and recognised) with.
pub type Reset = (Arc<dyn quinn::crypto::HmacKey>, u64);

/// An endpoint on a UDP socket bound to `addr` (a server's when `server` is given,
/// signing stateless resets with `reset`, see [`reset_key`]), with [`SOCKET_BUFFER`]s
/// as far as the kernel allows.
pub fn endpoint(
    addr: SocketAddr,
    server: Option<quinn::ServerConfig>,
    reset: Option<Reset>,
) -> io::Result<quinn::Endpoint> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    size_buffers(&socket);
    socket.bind(&addr.into())?;
    let runtime = Arc::new(quinn::TokioRuntime);
    let mut config = match reset {
        Some((key, cids)) => {
            let mut config = quinn::EndpointConfig::new(key);
            // Connection IDs a successor recognises as this key's (quinn drops, with
            // no reset, a datagram whose ID its generator did not make).
            config.cid_generator(move || {
                Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cids))
            });
            config
        }
        None => quinn::EndpointConfig::default(),
    };
    // A restarted server resets up to a thousand stale connections a second (quinn's
    // default, 50, would take a 10,000-agent fleet minutes); a reset is never larger
    // than the datagram that caused it.
    config.min_reset_interval(Duration::from_millis(1));
    quinn::Endpoint::new(config, server, socket.into(), runtime)
}

/// Gives `socket` [`SOCKET_BUFFER`]s: past net.core.[rw]mem_max where the process may
/// (CAP_NET_ADMIN), else as far as those allow (the shipped static pod drops every
/// capability: docs/operating.md says to raise them on the server's host).
#[allow(unsafe_code)]
fn size_buffers(socket: &socket2::Socket) {
    use std::os::fd::AsRawFd;
    let bytes = SOCKET_BUFFER as libc::c_int;
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        for option in [force, plain] {
            // SAFETY: a valid socket, and a c_int of its size for an integer option.
            let set = unsafe {
                libc::setsockopt(
                    socket.as_raw_fd(),
                    libc::SOL_SOCKET,
                    option,
                    std::ptr::from_ref(&bytes).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if set == 0 {
                break;
            }
        }
    }
}

/// The agent's opening head on the control stream: the Connect path and its metadata,
/// in HTTP/1.1's syntax (`tether_core::ws::read_head` reads it).
pub fn request_head(authority: &str, path: &str, headers: &http::HeaderMap) -> Vec<u8> {
    let mut out = format!("CONNECT {path} HTTP/1.1\r\nHost: {authority}\r\n").into_bytes();
    crate::ws::append_headers(&mut out, headers);
    out.extend_from_slice(b"\r\n");
    out
}

/// The server's answer to an admitted head: `200` and its headers.
pub fn accepted(headers: &http::HeaderMap) -> Vec<u8> {
    let mut out = b"HTTP/1.1 200 OK\r\n".to_vec();
    crate::ws::append_headers(&mut out, headers);
    out.extend_from_slice(b"\r\n");
    out
}

/// Why the server's answer on the control stream was not an admission.
#[derive(Debug, thiserror::Error)]
pub enum AnswerError {
    /// The server refused the agent (its gRPC status).
    #[error("refused: {message} (gRPC code {code})")]
    Refused {
        /// The gRPC status code.
        code: i32,
        /// Its message.
        message: String,
    },
    /// The stream failed or ended first.
    #[error("the control stream ended before the server's answer")]
    Io(#[source] io::Error),
    /// Not an answer.
    #[error("malformed answer: {0}")]
    Malformed(String),
}

/// Reads the server's answer from the control stream: its headers when it admitted
/// the agent, and any bytes read past them (the first packets).
pub async fn read_answer(
    recv: &mut RecvStream,
) -> Result<(http::HeaderMap, BytesMut), AnswerError> {
    let mut buf = BytesMut::new();
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let mut slots = [httparse::EMPTY_HEADER; 64];
            let mut res = httparse::Response::new(&mut slots);
            res.parse(&buf[..end + 4])
                .map_err(|e| AnswerError::Malformed(e.to_string()))?;
            let mut headers = http::HeaderMap::new();
            for h in res.headers.iter() {
                let (Ok(name), Ok(value)) = (
                    http::HeaderName::from_bytes(h.name.as_bytes()),
                    http::HeaderValue::from_bytes(h.value),
                ) else {
                    return Err(AnswerError::Malformed(format!("bad header {:?}", h.name)));
                };
                headers.append(name, value);
            }
            if res.code != Some(200) {
                let (code, message) = crate::grpc::status_of(&headers)
                    .unwrap_or((2, format!("HTTP status {}", res.code.unwrap_or(0))));
                return Err(AnswerError::Refused { code, message });
            }
            buf.advance(end + 4);
            return Ok((headers, buf));
        }
        if buf.len() >= MAX_HEAD {
            return Err(AnswerError::Malformed(format!(
                "answer over {MAX_HEAD} bytes"
            )));
        }
        let n = recv.read_buf(&mut buf).await.map_err(AnswerError::Io)?;
        if n == 0 {
            return Err(AnswerError::Io(io::ErrorKind::UnexpectedEof.into()));
        }
    }
}

/// Why a stream's packets could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The stream failed.
    #[error("stream failed")]
    Io(#[from] io::Error),
    /// A message over [`MAX_PACKET`], compressed, or no packet.
    #[error("{0}")]
    Malformed(String),
}

/// Packets read off one stream, each a gRPC message.
pub struct PacketReader {
    recv: RecvStream,
    buf: BytesMut,
}

impl PacketReader {
    /// Reads `recv`, starting with `buf` (bytes read already).
    pub fn new(recv: RecvStream, buf: BytesMut) -> Self {
        PacketReader { recv, buf }
    }

    /// The next packet; `None` once the peer finished the stream between packets.
    pub async fn next(&mut self) -> Result<Option<Packet>, ReadError> {
        loop {
            if self.buf.len() >= crate::grpc::PREFIX {
                if self.buf[0] != 0 {
                    return Err(ReadError::Malformed("compressed message".into()));
                }
                let len = u32::from_be_bytes(self.buf[1..5].try_into().expect("4 bytes")) as usize;
                if len > MAX_PACKET {
                    return Err(ReadError::Malformed(format!(
                        "message of {len} bytes, over {MAX_PACKET}"
                    )));
                }
                if self.buf.len() >= crate::grpc::PREFIX + len {
                    self.buf.advance(crate::grpc::PREFIX);
                    let body = self.buf.split_to(len).freeze();
                    return Packet::decode(body)
                        .map(Some)
                        .map_err(|e| ReadError::Malformed(e.to_string()));
                }
                // Room as the bytes come, not as much as the length claims.
                let missing = crate::grpc::PREFIX + len - self.buf.len();
                self.buf.reserve(missing.min(64 << 10));
            } else {
                self.buf.reserve(16 << 10);
            }
            if self.recv.read_buf(&mut self.buf).await? == 0 {
                if self.buf.is_empty() {
                    return Ok(None);
                }
                return Err(ReadError::Io(io::ErrorKind::UnexpectedEof.into()));
            }
        }
    }

    /// Tells the peer to stop sending on this stream.
    pub fn stop(&mut self) {
        let _ = self.recv.stop(VarInt::from_u32(0));
    }
}

/// What goes on one stream: messages in order, each holding its share of the
/// connection's send budget until quinn has taken it; the stream is finished once
/// every sender is gone.
type Tx = mpsc::UnboundedSender<Piece>;
type WeakTx = mpsc::WeakUnboundedSender<Piece>;
type Piece = (Bytes, Option<OwnedSemaphorePermit>);

/// Bytes a connection may have queued for its streams that quinn has not taken yet:
/// a peer that grants no stream or connection credit holds up its own connection's
/// senders (the router's queue for it, then the frontends), never the server's memory.
pub const SEND_BUDGET: usize = 8 << 20;

/// Tunnel streams the server keeps open on one connection; a dial beyond these
/// travels on the control stream (in order with the rest, as over HTTP/2).
pub const MAX_TUNNEL_STREAMS: usize = 128;

/// How long a tunnel stream is read once this end is done with it (its close sent and
/// acknowledged), for the peer's last packets; then it is stopped, whatever the peer
/// does.
const LINGER: Duration = Duration::from_secs(5);

/// How long the peer may take to acknowledge all of a finished tunnel stream.
const ACK_WITHIN: Duration = Duration::from_secs(30);

/// How long, once the peer has ended the control stream (the agent's half-close after
/// its drain), the tunnel streams still being read get before the link ends: their
/// last packets may be behind the control stream's end.
const CONTROL_GRACE: Duration = Duration::from_secs(2);

/// The stream a tunnel travels on, by the dial's random (until answered) and by its
/// connection ID (once it is); and how many tunnel streams this end opened are open.
#[derive(Default)]
struct Tunnels {
    by_random: HashMap<i64, Tx>,
    by_conn: HashMap<i64, Tx>,
    opened: usize,
}

/// One agent connection's streams: where each packet goes out, and every packet read
/// off any stream handed to one queue (`inbound`), as the transport's reader.
pub struct Mux {
    conn: quinn::Connection,
    /// The control stream's queue, taken when the agent finishes its side.
    control: Mutex<Option<Tx>>,
    tunnels: Mutex<Tunnels>,
    inbound: mpsc::Sender<Result<Packet, ReadError>>,
    budget: Arc<Semaphore>,
    /// Tunnel streams being read.
    reading: tokio::sync::watch::Sender<usize>,
}

/// One tunnel stream's place in [`Mux::reading`] while it is read.
struct Reading(tokio::sync::watch::Sender<usize>);

impl Reading {
    fn count(reading: &tokio::sync::watch::Sender<usize>) -> Reading {
        reading.send_modify(|n| *n += 1);
        Reading(reading.clone())
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

/// The packets read off every stream, in one queue; a stream that broke the protocol
/// puts its error here.
pub type Inbound = mpsc::Receiver<Result<Packet, ReadError>>;

/// Packets queued from every stream's reader before the readers wait.
const INBOUND: usize = 64;

impl Mux {
    /// The mux of `conn` whose control stream is `send`/`reader` (the opening exchange
    /// done): packets read off it and off every tunnel stream arrive in the returned
    /// queue. Its tasks run in `span`.
    pub fn start(
        conn: quinn::Connection,
        send: SendStream,
        reader: PacketReader,
        span: tracing::Span,
    ) -> (Arc<Mux>, Inbound) {
        let (inbound, rx) = mpsc::channel(INBOUND);
        let (control, control_rx) = mpsc::unbounded_channel();
        let control_writer = async move {
            if let Some(mut send) = write_stream(send, control_rx).await {
                let _ = send.finish();
            }
        };
        tokio::spawn(control_writer.instrument(span.clone()));
        let mux = Arc::new(Mux {
            conn,
            control: Mutex::new(Some(control)),
            tunnels: Mutex::default(),
            inbound,
            budget: Arc::new(Semaphore::new(SEND_BUDGET)),
            reading: tokio::sync::watch::Sender::new(0),
        });
        tokio::spawn(
            mux.clone()
                .read_stream(reader, None)
                .instrument(span.clone()),
        );
        if mux.conn.side().is_client() {
            tokio::spawn(mux.clone().accept_tunnels().instrument(span));
        }
        (mux, rx)
    }

    /// The connection.
    pub fn connection(&self) -> &quinn::Connection {
        &self.conn
    }

    /// The connection's send budget, to reserve a packet's [`Mux::cost`] in before
    /// [`Mux::send_reserved`].
    pub fn budget(&self) -> Arc<Semaphore> {
        self.budget.clone()
    }

    /// What `packet` takes of the send budget.
    pub fn cost(packet: &Packet) -> u32 {
        (packet.encoded_len() + crate::grpc::PREFIX).min(SEND_BUDGET) as u32
    }

    fn tunnels(&self) -> std::sync::MutexGuard<'_, Tunnels> {
        self.tunnels.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `packet` once the send budget has room for it. False once the connection
    /// is gone.
    pub async fn send(self: &Arc<Self>, packet: &Packet) -> bool {
        let permit = self
            .budget
            .clone()
            .acquire_many_owned(Self::cost(packet))
            .await
            .ok();
        self.send_reserved(packet, permit)
    }

    /// Sends `packet` on its tunnel's stream (a DIAL_REQ opens one), or on the control
    /// stream, holding `permit` (its cost) until quinn has it. A tunnel whose stream
    /// failed loses the packet (the peer stopped it); false only once the connection is
    /// gone.
    pub fn send_reserved(
        self: &Arc<Self>,
        packet: &Packet,
        permit: Option<OwnedSemaphorePermit>,
    ) -> bool {
        let (head, tail) = crate::grpc::frame_parts(packet);
        if let Some(tx) = self.route(packet) {
            match tail {
                Some(tail) => {
                    let _ = tx.send((head, None));
                    let _ = tx.send((tail, permit));
                }
                None => {
                    let _ = tx.send((head, permit));
                }
            }
        }
        self.conn.close_reason().is_none()
    }

    /// The stream `packet` goes out on, its tables updated for what the packet means.
    fn route(self: &Arc<Self>, packet: &Packet) -> Option<Tx> {
        let mut t = self.tunnels();
        let found = match &packet.payload {
            Some(Payload::DialRequest(d)) if t.opened < MAX_TUNNEL_STREAMS => {
                // A stream if the agent's stream credit allows one now; if not (its
                // streams are still closing), this dial travels on the control stream,
                // as over HTTP/2, instead of waiting for credit.
                match self.conn.open_bi().now_or_never() {
                    Some(Ok(streams)) => {
                        let (tx, rx) = mpsc::unbounded_channel();
                        t.by_random.insert(d.random, tx.clone());
                        t.opened += 1;
                        let weak = tx.downgrade();
                        let tunnel = self.clone().open_tunnel(streams, rx, weak);
                        tokio::spawn(tunnel.in_current_span());
                        Some(tx)
                    }
                    _ => None,
                }
            }
            Some(Payload::DialResponse(d)) => t.by_random.remove(&d.random).inspect(|tx| {
                if d.error.is_empty() {
                    t.by_conn.insert(d.connect_id, tx.clone());
                }
            }),
            Some(Payload::CloseDial(d)) => t.by_random.remove(&d.random),
            Some(Payload::Data(d)) => t.by_conn.get(&d.connect_id).cloned(),
            Some(Payload::WindowUpdate(w)) => t.by_conn.get(&w.connect_id).cloned(),
            Some(Payload::CloseRequest(c)) => t.by_conn.get(&c.connect_id).cloned(),
            Some(Payload::CloseResponse(c)) => t.by_conn.remove(&c.connect_id),
            _ => None,
        };
        drop(t);
        found.or_else(|| {
            self.control
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        })
    }

    /// Notes what a packet read off a tunnel stream means for the tables: a dial's
    /// answer, the tunnel's end. (A dial registers its stream only as the stream's
    /// first packet, in [`Mux::read_tunnel`]: a peer repeating DIAL_REQ grows nothing.)
    fn heard(&self, packet: &Packet) {
        let mut t = self.tunnels();
        match &packet.payload {
            Some(Payload::DialResponse(d)) => {
                if let Some(tx) = t.by_random.remove(&d.random) {
                    if d.error.is_empty() {
                        t.by_conn.insert(d.connect_id, tx);
                    }
                }
            }
            Some(Payload::CloseResponse(c)) => {
                t.by_conn.remove(&c.connect_id);
            }
            _ => {}
        }
    }

    /// Forgets every table entry for the stream whose sender is `own` (its reader
    /// ended): its writer then finishes the stream.
    fn forget(&self, own: &WeakTx) {
        let Some(own) = own.upgrade() else { return };
        let mut t = self.tunnels();
        t.by_random.retain(|_, tx| !tx.same_channel(&own));
        t.by_conn.retain(|_, tx| !tx.same_channel(&own));
    }

    /// The server's side of a DIAL_REQ on its own stream: reads the agent's answers off
    /// it, and writes what is queued for it until the tunnel ends.
    async fn open_tunnel(
        self: Arc<Self>,
        (send, recv): (SendStream, RecvStream),
        rx: mpsc::UnboundedReceiver<Piece>,
        own: WeakTx,
    ) {
        let reader = PacketReader::new(recv, BytesMut::new());
        let done = CancellationToken::new();
        let read = self.clone().read_stream(reader, Some((own, done.clone())));
        tokio::spawn(read.in_current_span());
        let send = write_stream(send, rx).await;
        // The slot goes back as soon as this end is done writing; the stream lingers
        // for the peer's last packets.
        self.tunnels().opened -= 1;
        linger(send, done).await;
    }

    /// The agent's side: accepts the streams the server opens, one per tunnel.
    async fn accept_tunnels(self: Arc<Self>) {
        while let Ok((send, recv)) = self.conn.accept_bi().await {
            let (tx, rx) = mpsc::unbounded_channel();
            let own = tx.downgrade();
            let done = CancellationToken::new();
            // Held until the reader has registered the stream under its dial.
            let reader = PacketReader::new(recv, BytesMut::new());
            let read = self.clone().read_tunnel(reader, (own, done.clone()), tx);
            tokio::spawn(read.in_current_span());
            let write = async move { linger(write_stream(send, rx).await, done).await };
            tokio::spawn(write.in_current_span());
        }
    }

    /// The agent's side of a tunnel stream: its first packet, a DIAL_REQ, registers
    /// the stream under the dial's random (`tx` held until then), then the stream is
    /// read as any other.
    async fn read_tunnel(
        self: Arc<Self>,
        mut reader: PacketReader,
        (own, done): (WeakTx, CancellationToken),
        tx: Tx,
    ) {
        let first = tokio::select! {
            first = reader.next() => first,
            _ = done.cancelled() => return,
        };
        if let Ok(Some(Packet {
            payload: Some(Payload::DialRequest(d)),
            ..
        })) = &first
        {
            self.tunnels().by_random.insert(d.random, tx);
        } else {
            drop(tx);
        }
        match first {
            Ok(Some(p)) => {
                if self.inbound.send(Ok(p)).await.is_err() {
                    return;
                }
            }
            Ok(None) | Err(ReadError::Io(_)) => return self.forget(&own),
            Err(e) => {
                let _ = self.inbound.send(Err(e)).await;
                return self.forget(&own);
            }
        }
        self.read_stream(reader, Some((own, done))).await
    }

    /// Hands what one stream carries to the inbound queue until it ends, or (a tunnel
    /// stream) until `done`; a tunnel stream's entries go with it.
    async fn read_stream(
        self: Arc<Self>,
        mut reader: PacketReader,
        tunnel: Option<(WeakTx, CancellationToken)>,
    ) {
        let done = tunnel.as_ref().map(|(_, d)| d.clone()).unwrap_or_default();
        let _counted = tunnel.as_ref().map(|_| Reading::count(&self.reading));
        let mut finished = false;
        loop {
            let next = tokio::select! {
                next = reader.next() => next,
                _ = done.cancelled() => {
                    reader.stop();
                    break;
                }
            };
            match next {
                Ok(Some(p)) => {
                    if tunnel.is_some() {
                        self.heard(&p);
                    }
                    if self.inbound.send(Ok(p)).await.is_err() {
                        reader.stop();
                        break;
                    }
                }
                Ok(None) => {
                    finished = true;
                    break;
                }
                Err(ReadError::Io(e)) if tunnel.is_some() => {
                    tracing::debug!(error = %e, "a tunnel stream failed");
                    break;
                }
                Err(e) => {
                    let _ = self.inbound.send(Err(e)).await;
                    break;
                }
            }
        }
        match tunnel {
            Some((own, _)) => self.forget(&own),
            // The control stream ended: so does the link, once the tunnel streams still
            // read have ended (their last packets may be behind the control stream's
            // end), for at most CONTROL_GRACE.
            None => {
                if finished {
                    let mut reading = self.reading.subscribe();
                    let idle = reading.wait_for(|n| *n == 0);
                    let _ = tokio::time::timeout(CONTROL_GRACE, idle).await;
                }
                let eof = ReadError::Io(io::ErrorKind::UnexpectedEof.into());
                let _ = self.inbound.send(Err(eof)).await;
            }
        }
    }

    /// Ends the connection with gRPC status `code` and `message`.
    pub fn close(&self, code: i32, message: &str) {
        close(&self.conn, code, message);
    }

    /// Finishes the control stream once what is queued on it is written (the agent's
    /// half-close after its drain); nothing more goes out on it.
    pub fn finish_control(&self) {
        self.control
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }
}

/// Ends `conn` with gRPC status `code` and `message` in its close reason
/// (`"<code> <message>"`, read back by [`status_of_close`]).
pub fn close(conn: &quinn::Connection, code: i32, message: &str) {
    let reason = format!("{code} {}", crate::ratelimit::clipped(message, 512));
    let app = if code == 0 { CLOSE_OK } else { CLOSE_STATUS };
    conn.close(VarInt::from_u32(app), reason.as_bytes());
}

/// The gRPC status in a connection's close reason (`"<code> <message>"`), if it has one.
pub fn status_of_close(e: &quinn::ConnectionError) -> Option<(i32, String)> {
    let quinn::ConnectionError::ApplicationClosed(close) = e else {
        return None;
    };
    let text = String::from_utf8_lossy(&close.reason);
    let (code, message) = text.split_once(' ').unwrap_or((&text, ""));
    Some((code.parse().ok()?, message.to_string()))
}

/// Writes what is queued for one stream, in order, batching what is waiting (each
/// piece's budget given back once quinn has it), until the queue's senders are all
/// gone: the stream, to finish; `None` when a write failed (the peer stopped it).
async fn write_stream(
    mut send: SendStream,
    mut rx: mpsc::UnboundedReceiver<Piece>,
) -> Option<SendStream> {
    let mut batch: Vec<Piece> = Vec::with_capacity(32);
    let mut chunks: Vec<Bytes> = Vec::with_capacity(32);
    while rx.recv_many(&mut batch, 32).await > 0 {
        chunks.extend(batch.iter_mut().map(|(b, _)| std::mem::take(b)));
        if send.write_all_chunks(&mut chunks).await.is_err() {
            return None;
        }
        chunks.clear();
        batch.clear();
    }
    Some(send)
}

/// A tunnel stream this end is done writing: finished, and once the peer has
/// acknowledged all of it (at most [`ACK_WITHIN`]), [`LINGER`] more for the peer's
/// last packets before its reader is stopped (`done`). The reader reads on
/// meanwhile, even when this end's write failed: the peer may still be sending its
/// tunnel's tail and close.
async fn linger(send: Option<SendStream>, done: CancellationToken) {
    if let Some(mut send) = send {
        let _ = send.finish();
        let _ = tokio::time::timeout(ACK_WITHIN, send.stopped()).await;
    }
    tokio::select! {
        _ = tokio::time::sleep(LINGER) => {}
        _ = done.cancelled() => {}
    }
    done.cancel();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_opening_head_reads_back_as_the_websocket_head_does() {
        let mut headers = http::HeaderMap::new();
        headers.insert("agentid", http::HeaderValue::from_static("node-1"));
        headers.insert("authorization", http::HeaderValue::from_static("Bearer t"));
        let head = request_head("10.0.0.1:8091", "/AgentService/Connect", &headers);
        let mut io = std::io::Cursor::new(head);
        let read = crate::ws::read_head(&mut io, BytesMut::new())
            .await
            .unwrap();
        assert_eq!(read.method, "CONNECT");
        assert_eq!(read.path, "/AgentService/Connect");
        assert_eq!(read.headers["agentid"], "node-1");
        assert_eq!(read.headers["authorization"], "Bearer t");
        assert!(read.rest.is_empty());
    }

    /// A server and an agent connected in this process, the agent granting the server
    /// `credit` tunnel streams: the two muxes and what each reads.
    async fn pair(credit: u32) -> ((Arc<Mux>, Inbound), (Arc<Mux>, Inbound)) {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let der = cert.cert.der().clone();
        let key = rustls_pki_types::PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into());
        let tls = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![der.clone()], key)
            .unwrap();
        let transport = transport_config(Duration::ZERO, Duration::from_secs(30), true);
        let cfg = server_config(&tls, transport).unwrap();
        let server = endpoint(([127, 0, 0, 1], 0).into(), Some(cfg), None).unwrap();
        let addr = server.local_addr().unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).unwrap();
        let tls = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut transport = transport_config(Duration::ZERO, Duration::from_secs(30), false);
        transport.max_concurrent_bidi_streams(VarInt::from_u32(credit));
        let cfg = client_config(&tls, transport).unwrap();
        let client = client_endpoint(addr).unwrap();
        let agent = async {
            let conn = client
                .connect_with(cfg, addr, "localhost")
                .unwrap()
                .await
                .unwrap();
            let (mut send, recv) = conn.open_bi().await.unwrap();
            send.write_all(b"hello").await.unwrap();
            Mux::start(
                conn,
                send,
                PacketReader::new(recv, BytesMut::new()),
                tracing::Span::none(),
            )
        };
        let served = async {
            let conn = server.accept().await.unwrap().await.unwrap();
            let (send, mut recv) = conn.accept_bi().await.unwrap();
            let mut hello = [0u8; 5];
            recv.read_exact(&mut hello).await.unwrap();
            Mux::start(
                conn,
                send,
                PacketReader::new(recv, BytesMut::new()),
                tracing::Span::none(),
            )
        };
        let (agent, server) = tokio::join!(agent, served);
        (server, agent)
    }

    /// An agent that gives no more stream credit (its tunnels' streams still open) gets
    /// the next dials on the control stream at once: none waits for credit, none is lost.
    #[tokio::test]
    async fn dials_beyond_the_agents_stream_credit_go_on_the_control_stream() {
        let ((server, _from_agent), (_agent, mut to_agent)) = pair(2).await;
        for random in 1..=6 {
            let dial = Packet::dial_request("tcp", "10.0.0.1:80", random);
            assert!(server.send(&dial).await);
        }
        let mut heard = Vec::new();
        while heard.len() < 6 {
            let next = tokio::time::timeout(Duration::from_secs(5), to_agent.recv()).await;
            match next
                .expect("every dial within 5 s")
                .expect("open")
                .unwrap()
                .payload
            {
                Some(Payload::DialRequest(d)) => heard.push(d.random),
                other => panic!("not a dial: {other:?}"),
            }
        }
        heard.sort_unstable();
        assert_eq!(heard, [1, 2, 3, 4, 5, 6]);
        assert_eq!(
            server.tunnels().opened,
            2,
            "two on streams, the rest on control"
        );
    }

    #[test]
    fn a_close_reason_carries_the_status() {
        let closed = |reason: &'static [u8]| {
            quinn::ConnectionError::ApplicationClosed(quinn::ApplicationClose {
                error_code: VarInt::from_u32(CLOSE_STATUS),
                reason: Bytes::from_static(reason),
            })
        };
        assert_eq!(
            status_of_close(&closed(b"16 token no longer accepted")),
            Some((16, "token no longer accepted".into()))
        );
        assert_eq!(status_of_close(&closed(b"0 ")), Some((0, String::new())));
        assert_eq!(status_of_close(&closed(b"not a status")), None);
        assert_eq!(status_of_close(&quinn::ConnectionError::TimedOut), None);
    }
}

//! One stream to one proxy server, over the transports `--transports` names in turn:
//! gRPC on bare HTTP/2 (the client half the client and the bench share,
//! `tether_core::grpc::client`) or WebSocket (`tether_core::ws`). Establish it (TCP or
//! a tunnel through the egress proxy, TLS, the HTTP/2 handshake or the WebSocket
//! upgrade, the agent's metadata, the server's id and count, the flow-control offer)
//! and serve it until it fails, drains or is hard-stopped. One task serves a stream: it
//! drives the connection, its keepalive pings, the reader (every packet to the
//! dialer's session) and the writer (the session's answers first, then connection
//! traffic as the transport's flow control allows), as the server's `h2serve` does for
//! an agent connection.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::{Sink, Stream};
use h2::client::{Connection, SendRequest};
use h2::{Ping, PingPong, Reason};
use tether_core::grpc::client::{self, FirstFlight, Inbound, StreamError, Windows};
use tether_core::grpc::{frame_parts, Outbound};
use tether_core::transport::{self, TlsOver};
use tether_core::ws::{self, Message, WebSocketStream, WsError};
use tether_proto::{header, link, Packet};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::metadata::{MetadataMap, MetadataValue};
use tracing::Instrument;

use crate::dialer::{Outbox, Session};
use crate::proxy::{Carrier, ProxyError, ProxyUrl};
use crate::{Agent, Transport};

mod quic;

/// The method the agent calls.
const CONNECT_PATH: &str = "/AgentService/Connect";

/// How long a drained agent waits for the server to end a stream it half-closed.
pub(crate) const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// How long opening one stream (TCP, TLS, the server's response headers) may take.
pub(crate) const ESTABLISH_TIMEOUT: Duration = Duration::from_secs(20);

/// How long TCP connect and the TLS handshake may take (through an egress proxy: the
/// TLS handshake, once the tunnel is open within `proxy::PROXY_TIMEOUT`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest a keepalive ping may go unanswered (shorter with a shorter interval).
const PING_TIMEOUT: Duration = Duration::from_secs(20);

/// TLS to the server, over TCP or a tunnel through the egress proxy.
type ServerTls = TlsOver<Carrier>;

/// The agent link's HTTP/2 connection.
type Conn = Connection<FirstFlight<ServerTls>, Bytes>;

/// The agent link's WebSocket.
type Socket = WebSocketStream<ServerTls>;

/// Why one stream to the server ended.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// TCP, TLS or the HTTP/2 handshake failed.
    #[error("cannot connect to proxy server")]
    Connect(#[source] io::Error),
    /// The egress proxy could not be reached or refused the tunnel.
    #[error("cannot open a tunnel to the proxy server through the egress proxy")]
    Proxy(#[source] ProxyError),
    /// The server refused or broke the stream.
    #[error("proxy server stream failed")]
    Stream(#[source] StreamError),
    /// The connection under the stream failed (the server went away, a GOAWAY).
    #[error("proxy server connection failed")]
    Connection(#[source] h2::Error),
    /// The server closed the connection.
    #[error("proxy server closed the connection")]
    Closed,
    /// Writing to the stream failed.
    #[error("cannot write to the proxy server")]
    Write(#[source] io::Error),
    /// The WebSocket under the stream failed.
    #[error("proxy server WebSocket failed")]
    WebSocket(#[source] WsError),
    /// The WebSocket upgrade was answered with an HTTP error (by a proxy on the way:
    /// a Tether server's refusals carry a gRPC status).
    #[error("the WebSocket upgrade was refused")]
    Upgrade(#[source] ws::UpgradeError),
    /// TLS failed because the other end takes none of the protocols offered by ALPN.
    #[error("the proxy server, or a proxy in front of it, takes none of the protocols this transport offers ({offered}): an upstream server, or a Tether server with --agent-websocket=false, takes only h2 (--transports=h2); a reverse proxy that passes only HTTP/1.1 takes only websocket (--transports=websocket, or h2,websocket to try both)")]
    NoProtocol {
        /// What was offered (`h2`, `http/1.1`).
        offered: &'static str,
        /// The TLS error.
        #[source]
        source: io::Error,
    },
    /// A keepalive ping went unanswered.
    #[error("proxy server did not answer a keepalive ping within {0:?}")]
    Keepalive(Duration),
    /// The token file could not be read.
    #[error("cannot read service account token {path}")]
    Token {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The server's response headers were not as the protocol requires.
    #[error("proxy server response: {0}")]
    Protocol(String),
    /// Connecting and reading the response headers took too long.
    #[error("proxy server did not answer within {0:?}")]
    Timeout(Duration),
}

impl LinkError {
    /// The code grpc-go's client gives this failure, for `stream_errors_total`: a
    /// status the server sent keeps its code; a lost server (a broken connection, a
    /// keepalive timeout) is `Unavailable`.
    fn code(&self) -> tonic::Code {
        match self {
            LinkError::Stream(e) => e.code(),
            LinkError::Connection(_)
            | LinkError::Closed
            | LinkError::Write(_)
            | LinkError::WebSocket(_)
            | LinkError::Upgrade(_)
            | LinkError::NoProtocol { .. }
            | LinkError::Keepalive(_)
            | LinkError::Connect(_)
            | LinkError::Proxy(_) => tonic::Code::Unavailable,
            _ => tonic::Code::Internal,
        }
    }

    /// Why opening a stream failed, as `tether_agent_server_connect_failures_total`'s
    /// `reason`.
    pub(crate) fn connect_failure(&self) -> &'static str {
        match self {
            LinkError::Connect(_)
            | LinkError::Connection(_)
            | LinkError::Closed
            | LinkError::NoProtocol { .. } => "connect",
            LinkError::Proxy(_) => "proxy",
            LinkError::Stream(_) | LinkError::Upgrade(_) => "refused",
            LinkError::Timeout(_) => "timeout",
            LinkError::Token { .. } => "token",
            _ => "other",
        }
    }

    /// Whether another transport may do better: not when the server answered and
    /// refused the agent, nor when the agent's own token is unreadable.
    fn falls_back(&self) -> bool {
        !matches!(
            self,
            LinkError::Stream(StreamError::Status { .. }) | LinkError::Token { .. }
        )
    }

    /// A failed WebSocket upgrade: the server's refusal keeps its status.
    fn upgrade(e: ws::UpgradeError) -> LinkError {
        match e {
            ws::UpgradeError::Refused {
                status: Some((code, message)),
                ..
            } => LinkError::Stream(StreamError::Status { code, message }),
            e @ ws::UpgradeError::Refused { status: None, .. } => LinkError::Upgrade(e),
            ws::UpgradeError::Failed(e) => LinkError::Connect(io::Error::other(e)),
        }
    }

    /// The HTTP/2 error code the server closed the connection or stream with.
    fn reason(&self) -> Option<Reason> {
        match self {
            LinkError::Connection(e) | LinkError::Stream(StreamError::Transport(e))
                if e.is_remote() =>
            {
                e.reason()
            }
            _ => None,
        }
    }
}

impl Agent {
    /// TCP to the server at `host:port`, or a tunnel to it through the egress proxy
    /// when one applies, and TLS to the server over it, offering the ALPN `transport`
    /// speaks.
    async fn open(
        &self,
        host: &str,
        port: u16,
        transport: Transport,
    ) -> Result<ServerTls, LinkError> {
        let authority = transport::authority(host, port);
        let name = tether_core::tls::server_name(host)
            .map_err(|e| LinkError::Connect(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
        let dead_link = self.config.dead_link;
        let tls = match transport {
            Transport::H2 | Transport::Quic => self.tls.get(),
            Transport::WebSocket => {
                let mut http1 = (*self.tls.get()).clone();
                http1.alpn_protocols = vec![tether_core::tls::ALPN_HTTP11.to_vec()];
                Arc::new(http1)
            }
        };
        let failed = |e| tls_failed(e, transport);
        let Some(proxy) = self.config.egress.route(host, port) else {
            let connect = async {
                let tcp = transport::connect_tcp(&authority, dead_link)
                    .await
                    .map_err(LinkError::Connect)?;
                transport::tls_over(Carrier::Left(tcp), name, tls)
                    .await
                    .map_err(failed)
            };
            return tokio::time::timeout(CONNECT_TIMEOUT, connect)
                .await
                .map_err(|_| LinkError::Timeout(CONNECT_TIMEOUT))?;
        };
        let proxy_tls = self.proxy_tls.as_ref().map(|t| t.get());
        let tunnel = crate::proxy::tunnel(proxy, &authority, proxy_tls, dead_link)
            .await
            .map_err(LinkError::Proxy)?;
        tokio::time::timeout(CONNECT_TIMEOUT, transport::tls_over(tunnel, name, tls))
            .await
            .map_err(|_| LinkError::Timeout(CONNECT_TIMEOUT))?
            .map_err(failed)
    }

    /// Opens a stream to the server at `host:port` over the first transport that works
    /// (the one that worked last, then the others in `--transports` order), each within
    /// [`ESTABLISH_TIMEOUT`], and reads the server's id and count.
    pub(crate) async fn establish(&self, host: &str, port: u16) -> Result<Established, LinkError> {
        let transports = &self.config.transports;
        let first = self
            .working
            .load(Ordering::Relaxed)
            .min(transports.len() - 1);
        let order = std::iter::once(first).chain((0..transports.len()).filter(|i| *i != first));
        let mut order = order.peekable();
        while let Some(i) = order.next() {
            let transport = transports[i];
            let tried = tokio::time::timeout(
                ESTABLISH_TIMEOUT,
                self.establish_over(transport, host, port),
            )
            .await
            .unwrap_or(Err(LinkError::Timeout(ESTABLISH_TIMEOUT)));
            let e = match tried {
                Ok(est) => {
                    self.working.store(i, Ordering::Relaxed);
                    return Ok(est);
                }
                Err(e) => e,
            };
            let Some(next) = order.peek().map(|n| transports[*n]) else {
                return Err(e);
            };
            if !e.falls_back() {
                return Err(e);
            }
            self.metrics
                .transport_fallbacks
                .with_label_values(&[transport.name()])
                .inc();
            tracing::warn!(%host, port, %transport, %next, error = %tether_core::error::chain(&e), "cannot open a stream over this transport; trying the next");
        }
        unreachable!("--transports is never empty")
    }

    /// Opens a stream to the server at `host:port` over `transport`.
    async fn establish_over(
        &self,
        transport: Transport,
        host: &str,
        port: u16,
    ) -> Result<Established, LinkError> {
        let via = self.config.egress.route(host, port).cloned();
        let (carried, headers) = if transport == Transport::Quic {
            let (link, headers) = self.establish_quic(host, port, self.metadata()?).await?;
            (Carried::Quic(Box::new(link)), headers)
        } else {
            self.establish_tcp(transport, host, port).await?
        };
        let md = MetadataMap::from_headers(headers);
        let md = &md;
        let protocol = |e: link::MetaError| LinkError::Protocol(e.to_string());
        let server_id = link::single(md, header::SERVER_ID)
            .map_err(protocol)?
            .to_string();
        let server_count: i64 = link::single(md, header::SERVER_COUNT)
            .map_err(protocol)?
            .parse()
            .map_err(|_| LinkError::Protocol("servercount is not a number".into()))?;
        self.header_count.store(server_count, Ordering::Relaxed);
        // Credit flow control only when we offered it and the server answered.
        let peer_window = self
            .config
            .flow_control
            .then(|| link::peer_window(md))
            .flatten();
        Ok(Established {
            server_id,
            server_count,
            via,
            keepalive: self.keepalive(),
            peer_window,
            transport,
            carried,
        })
    }

    /// Opens a stream over TCP (HTTP/2 or a WebSocket): the stream, and the headers
    /// the server answered with.
    async fn establish_tcp(
        &self,
        transport: Transport,
        host: &str,
        port: u16,
    ) -> Result<(Carried, http::HeaderMap), LinkError> {
        let authority = transport::authority(host, port);
        let io = self.open(host, port, transport).await?;
        Ok(match transport {
            Transport::H2 => {
                let (h2, headers) = self.establish_h2(io, &authority).await?;
                (Carried::H2(Box::new(h2)), headers)
            }
            Transport::WebSocket => {
                let (socket, headers) = ws::client(io, &authority, CONNECT_PATH, self.metadata()?)
                    .await
                    .map_err(LinkError::upgrade)?;
                (Carried::Ws(Box::new(socket)), headers)
            }
            Transport::Quic => unreachable!("QUIC is not carried over TCP"),
        })
    }

    /// The HTTP/2 handshake and the Connect call on `io`: the stream, and the headers
    /// the server answered with.
    async fn establish_h2(
        &self,
        io: ServerTls,
        authority: &str,
    ) -> Result<(H2Stream, http::HeaderMap), LinkError> {
        let (mut send, mut conn) = client::handshake(io, Windows::AGENT_LINK)
            .await
            .map_err(LinkError::Connect)?;
        let pings = conn.ping_pong().expect("a new connection's pings");
        let request = client::request(authority, CONNECT_PATH, self.metadata()?);
        let (out, response) =
            client::open(&mut send, request, None).map_err(LinkError::Connection)?;
        // The connection moves only while driven: drive it until the headers come.
        let response = tokio::select! {
            r = response => r.map_err(|e| LinkError::Stream(StreamError::Transport(e)))?,
            r = &mut conn => return Err(conn_ended(r)),
        };
        client::check_response(&response).map_err(LinkError::Stream)?;
        let (parts, body) = response.into_parts();
        let h2 = H2Stream {
            conn,
            _send: send,
            pings,
            out,
            inbound: Inbound::open(body),
        };
        Ok((h2, parts.headers))
    }

    /// The Connect request's metadata: the agent's id, identifiers, token,
    /// flow-control offer and the ask to hear DRAIN.
    fn metadata(&self) -> Result<http::HeaderMap, LinkError> {
        let cfg = &self.config;
        let ascii = |what: &str, v: &str| {
            MetadataValue::try_from(v)
                .map_err(|_| LinkError::Protocol(format!("{what} is not valid ASCII")))
        };
        let mut md = MetadataMap::new();
        md.insert(header::AGENT_ID, ascii("agent id", &cfg.agent_id)?);
        if !cfg.identifiers.is_empty() {
            md.insert(
                header::AGENT_IDENTIFIERS,
                ascii("agent identifiers", &cfg.identifiers)?,
            );
        }
        if let Some(path) = &cfg.token_path {
            let token = std::fs::read_to_string(path).map_err(|source| LinkError::Token {
                path: path.clone(),
                source,
            })?;
            let what = format!("token in {}", path.display());
            md.insert(
                header::AUTHORIZATION,
                ascii(&what, &format!("Bearer {}", token.trim()))?,
            );
        }
        if cfg.flow_control {
            link::offer_window(&mut md);
        }
        md.insert(header::DRAIN_NOTICE, MetadataValue::from_static("1"));
        Ok(md.into_headers())
    }

    /// Serves one established stream until it fails (Err), or `hard_stop` (Ok). Once
    /// `drain` is cancelled the stream sends DRAIN and keeps serving; at `hard_stop` a
    /// drained stream half-closes (HTTP/2) or closes (WebSocket), so the server ends its
    /// side. `server_draining` is cancelled when the server says it is stopping (DRAIN).
    pub(crate) async fn serve(
        &self,
        est: Established,
        drain: &CancellationToken,
        hard_stop: &CancellationToken,
        server_draining: CancellationToken,
    ) -> Result<(), LinkError> {
        let Established {
            server_id,
            server_count,
            via,
            keepalive,
            peer_window,
            transport,
            carried,
        } = est;
        let (session, control_rx, data_rx) =
            self.new_session(peer_window, server_draining, &server_id);
        let _close_on_exit = session.closed.clone().drop_guard();
        let _count = Decrement::count(&self.streams, &self.metrics.open_server_connections);
        let _by_transport = Gauged::inc(
            self.metrics
                .server_streams
                .with_label_values(&[transport.name()]),
        );
        let via = via
            .as_ref()
            .map_or_else(|| "direct".to_string(), ProxyUrl::to_string);
        tracing::info!(%server_id, server_count, flow_control = peer_window.is_some(), %via, %transport, "connected to proxy server");
        let stopping = Stopping {
            session: &session,
            drain,
            hard_stop,
            finish: CancellationToken::new(),
            span: tracing::info_span!("server_stream", %server_id, %transport),
        };
        let heard = Heard::default();
        let queues = (session.clone(), control_rx, data_rx);
        let ended = match carried {
            Carried::H2(h2) => drive_h2(*h2, queues, &stopping, keepalive, heard).await,
            Carried::Ws(socket) => drive_ws(*socket, queues, &stopping, keepalive, heard).await,
            Carried::Quic(link) => drive_quic(*link, queues, &stopping, heard).await,
        };
        let Err((e, reason)) = ended else {
            return Ok(());
        };
        Err(self.stream_failed(e, keepalive, reason))
    }

    /// A new stream's session (what the reader hands packets to), and the receiving
    /// ends of its bounded answers and data queues, for the writer.
    fn new_session(
        &self,
        window: Option<u32>,
        draining: CancellationToken,
        server_id: &str,
    ) -> (Arc<Session>, mpsc::Receiver<Packet>, mpsc::Receiver<Packet>) {
        let cfg = &self.config;
        let (control, control_rx) = mpsc::channel(crate::dialer::ANSWERS);
        let (data, data_rx) = mpsc::channel(cfg.channel_size);
        let session = Session::new(
            Outbox { control, data },
            cfg.dial_timeout,
            crate::dialer::Peer { window, draining },
            cfg.stall_timeout,
            self.metrics.clone(),
            self.drain.clone(),
            crate::dialer::Targets {
                policy: self.policy.clone(),
                audited: crate::audit::Audited {
                    log: self.audit.clone(),
                    server_id: server_id.into(),
                },
            },
        );
        (session, control_rx, data_rx)
    }

    /// The HTTP/2 keepalive interval for a new stream.
    fn keepalive(&self) -> Duration {
        Duration::from_millis(self.keepalive_ms.load(Ordering::Relaxed))
    }

    /// Counts a failed stream (upstream's `stream_errors_total` and
    /// `server_connection_failure_count`). A server that closed the connection for
    /// pinging too often (`reason`) gets half as many pings from then on, as grpc-go
    /// clients (the upstream agent) do, so a short `--keepalive-time` against an upstream
    /// server (which allows one ping per 30 s) settles after a few reconnects instead of
    /// flapping.
    fn stream_failed(
        &self,
        e: LinkError,
        keepalive: Duration,
        reason: Option<Reason>,
    ) -> LinkError {
        if reason == Some(Reason::ENHANCE_YOUR_CALM) {
            let was: u64 = keepalive.as_millis().try_into().unwrap_or(u64::MAX);
            let now = was.saturating_mul(2);
            // Streams to several servers may fail together: double once per interval.
            if self
                .keepalive_ms
                .compare_exchange(was, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                tracing::warn!(
                    was = ?Duration::from_millis(was),
                    now = ?Duration::from_millis(now),
                    "the proxy server closed the connection for pinging too often (GOAWAY ENHANCE_YOUR_CALM); doubling the keepalive interval (--keepalive-time is shorter than the server's ping policy)"
                );
            }
        }
        if !matches!(e, LinkError::Protocol(_)) {
            let code = tether_ops::metrics::grpc_code_name(e.code());
            self.metrics
                .stream_errors
                .with_label_values(&["to_agent", code, tether_ops::metrics::NO_PACKET])
                .inc();
            self.metrics
                .server_connection_failures
                .with_label_values(&["from_server"])
                .inc();
        }
        e
    }
}

/// What a stream's reader hands packets to, and what its writer sends.
type Queues = (Arc<Session>, mpsc::Receiver<Packet>, mpsc::Receiver<Packet>);

/// Drives a Connect call on its HTTP/2 connection until the hard stop (Ok) or it fails
/// (with the HTTP/2 code the server ended the connection with, if any).
async fn drive_h2(
    h2: H2Stream,
    (session, control, data): Queues,
    stopping: &Stopping<'_>,
    keepalive: Duration,
    heard: Heard,
) -> Result<(), (LinkError, Option<Reason>)> {
    let H2Stream {
        mut conn,
        _send,
        pings,
        out,
        inbound,
    } = h2;
    let mut driven = Driven {
        conn: &mut conn,
        reader: pin!(read(inbound, session, heard.clone())),
        writer: pin!(write(out, control, data, stopping.finish.clone())),
        pinger: pin!(keep_alive(pings, keepalive, heard)),
    };
    match driven.run(stopping).await {
        Ok(()) => Ok(()),
        Err(e) => {
            let reason = goaway_reason(&e, driven.conn).await;
            Err((e, reason))
        }
    }
}

/// Drives a WebSocket until the hard stop (Ok) or it fails: the reader and the writer
/// each on their half, pings asked of the writer and pongs handed back by the reader.
async fn drive_ws(
    socket: Socket,
    (session, control, data): Queues,
    stopping: &Stopping<'_>,
    keepalive: Duration,
    heard: Heard,
) -> Result<(), (LinkError, Option<Reason>)> {
    let (sink, source) = futures::StreamExt::split(socket);
    let (ask, asked) = mpsc::channel(1);
    let (pong, pongs) = mpsc::channel(1);
    let sink = WsSink::new(sink, asked);
    let mut never = std::future::pending();
    let mut driven = Driven {
        conn: &mut never,
        reader: pin!(read(WsSource { source, pong }, session, heard.clone())),
        writer: pin!(write(sink, control, data, stopping.finish.clone())),
        pinger: pin!(keep_alive(WsPings { ask, pongs }, keepalive, heard)),
    };
    driven.run(stopping).await.map_err(|e| (e, None))
}

/// Drives a QUIC link until the hard stop (Ok) or it fails, then closes its
/// connection; QUIC's own pings and idle timeout keep it alive.
async fn drive_quic(
    link: quic::QuicLink,
    (session, control, data): Queues,
    stopping: &Stopping<'_>,
    heard: Heard,
) -> Result<(), (LinkError, Option<Reason>)> {
    let (source, sink, closer) = link.split();
    let mut never = std::future::pending();
    let mut driven = Driven {
        conn: &mut never,
        reader: pin!(read(source, session, heard)),
        writer: pin!(write(sink, control, data, stopping.finish.clone())),
        pinger: pin!(std::future::pending::<LinkError>()),
    };
    let ended = driven.run(stopping).await.map_err(|e| (e, None));
    closer.close().await;
    ended
}

/// The HTTP/2 error code the server ended the stream's connection with: a stream may
/// fail before its connection reports the GOAWAY that ended it.
async fn goaway_reason(e: &LinkError, conn: &mut Conn) -> Option<Reason> {
    let mut reason = e.reason();
    if reason != Some(Reason::ENHANCE_YOUR_CALM) && !matches!(e, LinkError::Connection(_)) {
        if let Ok(Err(c)) = tokio::time::timeout(Duration::from_millis(100), conn).await {
            if c.is_remote() {
                reason = c.reason().or(reason);
            }
        }
    }
    reason
}

/// A failed TLS handshake over `transport`: one the other end refused for want of a
/// shared ALPN protocol says which transports would do.
fn tls_failed(e: io::Error, transport: Transport) -> LinkError {
    if !tether_core::tls::no_shared_alpn(&e) {
        return LinkError::Connect(e);
    }
    let offered = match transport {
        Transport::H2 => "h2",
        Transport::WebSocket => "http/1.1",
        Transport::Quic => "tether/1",
    };
    LinkError::NoProtocol { offered, source: e }
}

/// Why the connection's driver returned.
fn conn_ended(r: Result<(), h2::Error>) -> LinkError {
    match r {
        Err(e) => LinkError::Connection(e),
        Ok(()) => LinkError::Closed,
    }
}

/// What ends a served stream from the agent's side: the drain (DRAIN sent, serving
/// on), the hard stop (after a drain, the writer finishes the stream), in the stream's
/// span.
struct Stopping<'a> {
    session: &'a Session,
    drain: &'a CancellationToken,
    hard_stop: &'a CancellationToken,
    finish: CancellationToken,
    span: tracing::Span,
}

/// What a served stream's task drives: the connection (HTTP/2's; a WebSocket has none
/// apart from its halves), and beside it the reader, the writer and the pinger (pinned
/// in [`Agent::serve`]).
struct Driven<'a, C, R, W, P> {
    conn: &'a mut C,
    reader: Pin<&'a mut R>,
    writer: Pin<&'a mut W>,
    pinger: Pin<&'a mut P>,
}

impl<C, R, W, P> Driven<'_, C, R, W, P>
where
    C: Future<Output = Result<(), h2::Error>> + Unpin,
    R: Future<Output = LinkError>,
    W: Future<Output = Result<(), LinkError>>,
    P: Future<Output = LinkError>,
{
    /// Drives the stream until it fails (Err) or the hard stop (Ok); a drained stream
    /// is then ended from the agent's side, waiting [`CLOSE_GRACE`] for the server.
    async fn run(&mut self, stop: &Stopping<'_>) -> Result<(), LinkError> {
        let drained = self
            .until_hard_stop(stop.session, stop.drain, stop.hard_stop)
            .instrument(stop.span.clone())
            .await?;
        if drained {
            // Half-close instead of dropping the stream: the writer sends what is
            // queued (DRAIN among it) and then END_STREAM (a close frame), where a
            // reset could discard it. The server then ends its side; a server that
            // does not is left after CLOSE_GRACE.
            stop.session.closed.cancel();
            stop.finish.cancel();
            let _ = tokio::time::timeout(CLOSE_GRACE, self.half_close()).await;
        }
        Ok(())
    }

    /// Drives all four until one ends, which fails the stream (Err), or until `hard_stop`
    /// (Ok: whether the stream drained). At `drain` the session sends DRAIN and the
    /// stream serves on.
    async fn until_hard_stop(
        &mut self,
        session: &Session,
        drain: &CancellationToken,
        hard_stop: &CancellationToken,
    ) -> Result<bool, LinkError> {
        let mut draining = false;
        loop {
            tokio::select! {
                r = &mut *self.conn => return Err(conn_ended(r)),
                e = &mut self.reader => return Err(e),
                r = &mut self.writer => return Err(r.err().unwrap_or_else(|| {
                    LinkError::Protocol("the stream's writer ended".into())
                })),
                e = &mut self.pinger => return Err(e),
                _ = drain.cancelled(), if !draining => {
                    draining = true;
                    tracing::info!("draining: DRAIN sent; dials the server still sends are served");
                    session.drain();
                }
                // Draining, the stream stays and serves (as upstream's agent
                // until its second signal); the hard stop ends it, with a
                // half-close when DRAIN went first (a drain that came with the
                // hard stop sends its DRAIN too).
                _ = hard_stop.cancelled() => {
                    if drain.is_cancelled() && !draining {
                        session.drain();
                    }
                    return Ok(drain.is_cancelled());
                }
            }
        }
    }

    /// After a drained hard stop: drives the writer to the end of the body, then the
    /// reader until the server ends its side (or the connection ends).
    async fn half_close(&mut self) {
        let mut written = false;
        loop {
            tokio::select! {
                _ = &mut *self.conn => return,
                _ = &mut self.writer, if !written => written = true,
                _ = &mut self.reader, if written => return,
            }
        }
    }
}

/// When the stream last heard from the server (a packet read), for the keepalive.
#[derive(Clone)]
struct Heard(Arc<std::sync::Mutex<std::time::Instant>>);

impl Default for Heard {
    fn default() -> Self {
        Heard(Arc::new(std::sync::Mutex::new(std::time::Instant::now())))
    }
}

impl Heard {
    fn now(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = std::time::Instant::now();
    }

    fn last(&self) -> std::time::Instant {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The reading half of a stream, whatever carries it.
trait PacketSource {
    /// The next packet; `None` once the server ended the stream with status OK.
    fn poll_packet(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Packet>, LinkError>>;
}

impl PacketSource for Inbound {
    fn poll_packet(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Packet>, LinkError>> {
        Inbound::poll_packet(self, cx).map(|p| p.transpose().map_err(LinkError::Stream))
    }
}

/// The reading half of a WebSocket: binary messages are packets, pongs go to the
/// pinger, a close frame carries the stream's status.
struct WsSource {
    source: futures::stream::SplitStream<Socket>,
    pong: mpsc::Sender<()>,
}

impl PacketSource for WsSource {
    fn poll_packet(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Packet>, LinkError>> {
        loop {
            let message = match futures::ready!(Pin::new(&mut self.source).poll_next(cx)) {
                Some(Ok(m)) => m,
                Some(Err(e)) => return Poll::Ready(Err(LinkError::WebSocket(e))),
                None => return Poll::Ready(Err(LinkError::Closed)),
            };
            return Poll::Ready(match message {
                Message::Binary(data) => ws::decode(&data)
                    .map(Some)
                    .map_err(|e| LinkError::Stream(StreamError::Message(e))),
                Message::Pong(_) => {
                    let _ = self.pong.try_send(());
                    continue;
                }
                Message::Ping(_) | Message::Frame(_) => continue,
                Message::Text(_) => Err(LinkError::Protocol("text message from the server".into())),
                Message::Close(frame) => match ws::status_of_close(frame.as_ref()) {
                    Some((code, message)) => {
                        Err(LinkError::Stream(StreamError::Status { code, message }))
                    }
                    None => Ok(None),
                },
            });
        }
    }
}

/// Hands every packet from the server to `session`, until the stream fails or ends.
async fn read(mut inbound: impl PacketSource, session: Arc<Session>, heard: Heard) -> LinkError {
    loop {
        match std::future::poll_fn(|cx| inbound.poll_packet(cx)).await {
            Ok(Some(p)) => {
                heard.now();
                session.handle(p).await
            }
            Ok(None) => return LinkError::Protocol("server closed the stream".into()),
            Err(e) => return e,
        }
    }
}

/// The writing half of a stream, whatever carries it.
trait PacketSink {
    /// Sends `packet` once there is room.
    fn poll_send(&mut self, cx: &mut Context<'_>, packet: &Packet) -> Poll<io::Result<()>>;
    /// Nothing more is queued for now: writes out what is buffered.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
    /// Ends the agent's side of the stream.
    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>>;
}

impl PacketSink for Outbound {
    fn poll_send(&mut self, cx: &mut Context<'_>, packet: &Packet) -> Poll<io::Result<()>> {
        self.poll_send_parts(cx, || frame_parts(packet))
    }

    fn poll_idle(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_finish(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.finish();
        Poll::Ready(Ok(()))
    }
}

/// The writing half of a WebSocket: a packet a binary message, a ping when the pinger
/// asks, a close frame at the end.
struct WsSink<S = ServerTls> {
    sink: futures::stream::SplitSink<WebSocketStream<S>, Message>,
    asked: mpsc::Receiver<()>,
    ping_due: bool,
    closing: bool,
    /// The frames of a packet taken already that the sink has not taken yet: they go
    /// before anything else.
    frames: std::collections::VecDeque<Message>,
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> WsSink<S> {
    /// The writing half `sink`, sending a ping whenever `asked`.
    fn new(
        sink: futures::stream::SplitSink<WebSocketStream<S>, Message>,
        asked: mpsc::Receiver<()>,
    ) -> Self {
        WsSink {
            sink,
            asked,
            ping_due: false,
            closing: false,
            frames: Default::default(),
        }
    }

    /// Sends a ping the pinger asked for.
    fn poll_pings(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.ping_due {
            self.ping_due = self.asked.poll_recv(cx).is_ready();
        }
        if self.ping_due {
            futures::ready!(self.start(cx, Message::Ping(Bytes::new())))?;
            self.ping_due = false;
        }
        Poll::Ready(Ok(()))
    }

    /// Starts sending `message` once the sink has room (Pending until then).
    fn start(&mut self, cx: &mut Context<'_>, message: Message) -> Poll<io::Result<()>> {
        let mut sink = Pin::new(&mut self.sink);
        futures::ready!(sink.as_mut().poll_ready(cx)).map_err(io::Error::other)?;
        sink.start_send(message).map_err(io::Error::other)?;
        Poll::Ready(Ok(()))
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> WsSink<S> {
    /// Hands the sink the frames still queued from an earlier packet.
    fn poll_queued(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while let Some(frame) = self.frames.pop_front() {
            let mut sink = Pin::new(&mut self.sink);
            match sink.as_mut().poll_ready(cx) {
                Poll::Ready(Ok(())) => sink.start_send(frame).map_err(io::Error::other)?,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(io::Error::other(e))),
                Poll::Pending => {
                    self.frames.push_front(frame);
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> PacketSink for WsSink<S> {
    /// Takes `packet` once the frames of the one before are all with the sink: it is
    /// encoded then, once, and its own frames go as the sink takes them (on this call or
    /// the next ones). A packet's frames are never interleaved with another's, and the
    /// writer may offer a different packet next (an answer overtaking traffic) without
    /// losing or repeating either.
    fn poll_send(&mut self, cx: &mut Context<'_>, packet: &Packet) -> Poll<io::Result<()>> {
        futures::ready!(self.poll_pings(cx))?;
        futures::ready!(self.poll_queued(cx))?;
        self.frames.extend(ws::encode(packet));
        if let Poll::Ready(Err(e)) = self.poll_queued(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(()))
    }

    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        futures::ready!(self.poll_pings(cx))?;
        futures::ready!(self.poll_queued(cx))?;
        Pin::new(&mut self.sink)
            .poll_flush(cx)
            .map_err(io::Error::other)
    }

    fn poll_finish(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        futures::ready!(self.poll_queued(cx))?;
        if !self.closing {
            futures::ready!(self.start(cx, Message::Close(Some(ws::close_frame(0, "")))))?;
            self.closing = true;
        }
        Pin::new(&mut self.sink)
            .poll_flush(cx)
            .map_err(io::Error::other)
    }
}

/// Writes what the session queues, one packet at a time as the transport allows (over
/// HTTP/2 a large DATA payload as a slice, not copied): an answer before any connection
/// traffic, and after taking a connection packet the answers are looked at again, so a
/// DIAL_RSP queued before its connection's first DATA goes first. Once `finish` is
/// cancelled and nothing more is queued, or every sender is gone, it ends the stream's
/// body.
async fn write(
    mut out: impl PacketSink,
    mut control: mpsc::Receiver<Packet>,
    mut data: mpsc::Receiver<Packet>,
    finish: CancellationToken,
) -> Result<(), LinkError> {
    let mut finishing = pin!(finish.cancelled_owned());
    let mut answer: Option<Packet> = None;
    let mut traffic: Option<Packet> = None;
    let mut answers_open = true;
    let mut ending = false;
    std::future::poll_fn(|cx: &mut Context<'_>| loop {
        if ending {
            return out.poll_finish(cx).map_err(LinkError::Write);
        }
        if answer.is_none() && answers_open {
            match control.poll_recv(cx) {
                Poll::Ready(Some(p)) => answer = Some(p),
                Poll::Ready(None) => answers_open = false,
                Poll::Pending => {}
            }
        }
        if answer.is_none() && traffic.is_none() {
            match data.poll_recv(cx) {
                // Answers again first: one may have been queued just before it.
                Poll::Ready(Some(p)) => {
                    traffic = Some(p);
                    continue;
                }
                Poll::Ready(None) => {
                    ending = true;
                    continue;
                }
                Poll::Pending => {
                    if finishing.as_mut().poll(cx).is_ready() {
                        ending = true;
                        continue;
                    }
                    if let Poll::Ready(Err(e)) = out.poll_idle(cx) {
                        return Poll::Ready(Err(LinkError::Write(e)));
                    }
                    return Poll::Pending;
                }
            }
        }
        let next = if answer.is_some() {
            &mut answer
        } else {
            &mut traffic
        };
        let packet = next.as_ref().expect("one is queued");
        match out.poll_send(cx, packet) {
            Poll::Ready(Ok(())) => *next = None,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(LinkError::Write(e))),
            Poll::Pending => return Poll::Pending,
        }
    })
    .await
}

/// A stream's keepalive pings, whatever carries them.
trait Pings {
    /// Sends a ping.
    fn ping(&mut self) -> Result<(), LinkError>;
    /// The answer to a ping.
    fn poll_pong(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), LinkError>>;
}

impl Pings for PingPong {
    fn ping(&mut self) -> Result<(), LinkError> {
        self.send_ping(Ping::opaque())
            .map_err(LinkError::Connection)
    }

    fn poll_pong(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), LinkError>> {
        PingPong::poll_pong(self, cx)
            .map_ok(drop)
            .map_err(LinkError::Connection)
    }
}

/// A WebSocket's pings: the writer sends them, the reader hands over the pongs.
struct WsPings {
    ask: mpsc::Sender<()>,
    pongs: mpsc::Receiver<()>,
}

impl Pings for WsPings {
    fn ping(&mut self) -> Result<(), LinkError> {
        // A ping still waiting to be written does for this one.
        let _ = self.ask.try_send(());
        Ok(())
    }

    fn poll_pong(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), LinkError>> {
        match self.pongs.poll_recv(cx) {
            Poll::Ready(Some(())) => Poll::Ready(Ok(())),
            Poll::Ready(None) => Poll::Ready(Err(LinkError::Closed)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Pings the server once the stream has heard nothing from it for `every`; fails when
/// a ping goes unanswered for `PING_TIMEOUT` (or `every`, if shorter) with nothing
/// heard meanwhile either. Traffic keeps a busy stream's pings away, as hyper's
/// keepalive does, so a slow link carrying a download is not taken for a dead one.
async fn keep_alive(mut pings: impl Pings, every: Duration, heard: Heard) -> LinkError {
    let timeout = every.min(PING_TIMEOUT);
    loop {
        let quiet = heard.last().elapsed();
        if quiet < every {
            tokio::time::sleep(every - quiet).await;
            continue;
        }
        if let Err(e) = pings.ping() {
            return e;
        }
        let sent = std::time::Instant::now();
        let mut deadline = tokio::time::Instant::now() + timeout;
        loop {
            tokio::select! {
                pong = std::future::poll_fn(|cx| pings.poll_pong(cx)) => match pong {
                    // A pong is hearing from the server: the next ping is an interval
                    // away (grpc-go's policy counts pings closer than its minimum).
                    Ok(()) => {
                        heard.now();
                        break;
                    }
                    Err(e) => return e,
                },
                _ = tokio::time::sleep_until(deadline) => {
                    let last = heard.last();
                    if last <= sent {
                        return LinkError::Keepalive(timeout);
                    }
                    // Something came meanwhile: the link lives; wait on.
                    deadline = tokio::time::Instant::from_std(last) + timeout;
                }
            }
        }
    }
}

/// A stream whose answer (response headers, or the upgrade's) has arrived.
pub(crate) struct Established {
    pub(crate) server_id: String,
    server_count: i64,
    /// The egress proxy the stream goes through (`None`: directly).
    via: Option<ProxyUrl>,
    /// The keepalive interval the stream pings at.
    keepalive: Duration,
    /// The server's per-connection window when it agreed to credit flow control.
    peer_window: Option<u32>,
    /// What carries the stream.
    transport: Transport,
    carried: Carried,
}

/// The stream, as its transport carries it (boxed: a stream waits in a queue of them
/// only briefly, but the two differ much in size).
enum Carried {
    H2(Box<H2Stream>),
    Ws(Box<Socket>),
    Quic(Box<quic::QuicLink>),
}

/// A Connect call on an HTTP/2 connection.
struct H2Stream {
    /// The connection, to be driven while the stream lives.
    conn: Conn,
    /// Keeps the connection open for the stream's life.
    _send: SendRequest<Bytes>,
    pings: PingPong,
    out: Outbound,
    inbound: Inbound,
}

/// A gauge raised while this lives.
struct Gauged(prometheus::IntGauge);

impl Gauged {
    fn inc(gauge: prometheus::IntGauge) -> Self {
        gauge.inc();
        Gauged(gauge)
    }
}

impl Drop for Gauged {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// One open stream, counted in the agent's readiness and its gauge while it lives.
struct Decrement(Arc<AtomicI64>, prometheus::IntGauge);

impl Decrement {
    fn count(streams: &Arc<AtomicI64>, gauge: &prometheus::IntGauge) -> Self {
        streams.fetch_add(1, Ordering::Relaxed);
        gauge.inc();
        Decrement(streams.clone(), gauge.clone())
    }
}

impl Drop for Decrement {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        self.1.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use tether_core::ws::Role;

    /// The writer over a WebSocket whose peer reads late (the sink full in the middle
    /// of a fragmented DATA packet) while an answer is queued: every packet arrives
    /// once, whole, the answer right after the packet it could not cut into.
    #[tokio::test]
    async fn an_answer_queued_mid_packet_is_neither_lost_nor_repeated() {
        let (a, b) = tokio::io::duplex(4 << 10);
        let client = WebSocketStream::from_raw_socket(a, Role::Client, Some(ws::config())).await;
        let mut server =
            WebSocketStream::from_raw_socket(b, Role::Server, Some(ws::config())).await;
        let (sink, _source) = client.split();
        let (_ask, asked) = mpsc::channel(1);
        let sink = WsSink::new(sink, asked);
        let (control, control_rx) = mpsc::channel(4);
        let (data, data_rx) = mpsc::channel(4);
        let finish = CancellationToken::new();
        let writer = tokio::spawn(write(sink, control_rx, data_rx, finish.clone()));
        let big = Packet::data(1, Bytes::from(vec![7u8; 100 << 10]));
        let next = Packet::data(1, Bytes::from_static(b"after"));
        data.send(big.clone()).await.unwrap();
        data.send(next.clone()).await.unwrap();
        // The writer is stuck inside the big packet's frames (4 KiB of pipe): answer now.
        tokio::task::yield_now().await;
        let answer = Packet::dial_response(42, 2, "");
        control.send(answer.clone()).await.unwrap();
        let mut got = Vec::new();
        while got.len() < 3 {
            match tokio::time::timeout(Duration::from_secs(10), server.next()).await {
                Ok(Some(Ok(Message::Binary(m)))) => got.push(ws::decode(&m).unwrap()),
                Ok(Some(Ok(_))) => {}
                other => panic!("after {} packets: {other:?}", got.len()),
            }
        }
        assert_eq!(got[0], big);
        assert!(got[1..] == [answer.clone(), next.clone()] || got[1..] == [next, answer]);
        finish.cancel();
        drop((control, data));
        let _ = writer.await;
    }
}

//! Agent streams over WebSocket (`tether_core::ws`), one per connection: the upgrade
//! request admitted as a Connect call is (its headers are the same metadata, checked the
//! same way), answered with `101` and the server's headers, then carried: each binary
//! message one packet to the router, each packet for the agent one message, pings
//! while the link is quiet, and its end a close frame carrying the status.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures::{SinkExt, StreamExt};
use tether_core::error::chain;
use tether_core::transport::TlsConnectInfo;
use tether_core::ws::{self, Message, WebSocketStream, WsError};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tonic::{Code, Status};
use tracing::Instrument;

use super::{shown, AgentLink, ConnStreams, Opened, PacketStream, CONNECT_PATH};
use crate::metrics::Segment;
use crate::router::{AgentStream, Router};

/// The longest a ping may go unanswered, with nothing else heard meanwhile.
const PING_TIMEOUT: Duration = Duration::from_secs(20);

/// How long the close frame may take to be written.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

type Sink<S> = futures::stream::SplitSink<WebSocketStream<S>, Message>;
type Source<S> = futures::stream::SplitStream<WebSocketStream<S>>;

/// Reads the upgrade request, admits it, answers, and carries the stream until either
/// side ends it, its token no longer passes, or the link goes silent.
pub(super) async fn serve<S>(
    link: Arc<AgentLink>,
    mut io: S,
    first: BytesMut,
    info: Arc<TlsConnectInfo>,
    streams: Arc<ConnStreams>,
    keepalive: Duration,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let peer = info.remote_addr;
    let head = match ws::read_head(&mut io, first).await {
        Ok(head) => head,
        Err(e) => {
            refused!(link, %peer, error = %chain(&e), "unreadable agent request over HTTP/1.1; closed");
            let status = match e {
                ws::HeadError::TooLarge => 431,
                _ => 400,
            };
            return refuse(&mut io, &streams, ws::refused(status, 3, &e.to_string())).await;
        }
    };
    let upgrade = match ws::check_upgrade(&head, CONNECT_PATH) {
        Ok(upgrade) => upgrade,
        Err((http, code, message)) => {
            let path = tether_core::ratelimit::clipped(&head.path, 128);
            refused!(link, %peer, %path, error = %message, "agent request over HTTP/1.1 is no WebSocket upgrade; refused");
            return refuse(&mut io, &streams, ws::refused(http, code, &message)).await;
        }
    };
    // The headers (a bearer token among them) go into the admission, which drops them:
    // the stream's future, which lives for hours, does not keep them.
    let ws::Head { headers, rest, .. } = head;
    let opened = Box::pin(link.admit_and_open(headers, &info, &streams, "websocket"));
    let opened = match opened.await {
        Ok(o) => o,
        Err(status) => {
            let answer = ws::refused_with(status.code() as i32, status.message());
            return refuse(&mut io, &streams, answer).await;
        }
    };
    let answer = ws::accepted(&upgrade, &link.answer(opened.peer_window));
    let span = opened.span.clone();
    if io.write_all(&answer).await.is_err() || io.flush().await.is_err() {
        link.router.remove_agent(&opened.agent);
        return;
    }
    let socket = ws::server(io, rest).await;
    let gauge = link
        .router
        .metrics
        .agent_streams
        .with_label_values(&["websocket"]);
    gauge.inc();
    carry(&link, opened, socket, keepalive)
        .instrument(span)
        .await;
    gauge.dec();
}

/// Answers a refused upgrade and closes; while unproven the connection may be evicted
/// at once.
async fn refuse<S: AsyncWrite + Unpin>(io: &mut S, streams: &ConnStreams, answer: Vec<u8>) {
    streams.stage(tether_core::admission::Stage::Silent);
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        let _ = io.write_all(&answer).await;
        let _ = io.shutdown().await;
    })
    .await;
}

/// Carries an opened stream both ways until it ends, then closes the WebSocket with
/// the status.
async fn carry<S>(link: &AgentLink, opened: Opened, socket: WebSocketStream<S>, keepalive: Duration)
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let Opened {
        agent,
        packets,
        token,
        live: _live,
        ..
    } = opened;
    let (sink, source) = socket.split();
    let sink = tokio::sync::Mutex::new(sink);
    let heard = Heard::default();
    let status = {
        let both = std::pin::pin!(both_ways(
            link, &agent, &sink, source, packets, keepalive, &heard
        ));
        let revoked = std::pin::pin!(link.revocation(token));
        let silent = std::pin::pin!(silence(&heard, keepalive));
        tokio::select! {
            status = both => status,
            why = revoked => link.revoked(&why),
            () = silent => {
                tracing::info!("the agent answered no ping within {PING_TIMEOUT:?}; stream ended");
                Status::unavailable("keepalive ping unanswered")
            }
        }
    };
    link.router.remove_agent(&agent);
    let close = ws::close_frame(status.code() as i32, status.message());
    let mut sink = sink.into_inner();
    let _ = tokio::time::timeout(CLOSE_GRACE, sink.send(Message::Close(Some(close)))).await;
    tracing::info!("agent disconnected");
}

/// Both halves until both are done, as the HTTP/2 stream's: an agent that broke the
/// protocol gets its error at once; otherwise what is queued for it goes out first.
async fn both_ways<S>(
    link: &AgentLink,
    agent: &Arc<AgentStream>,
    sink: &tokio::sync::Mutex<Sink<S>>,
    source: Source<S>,
    packets: PacketStream,
    keepalive: Duration,
    heard: &Heard,
) -> Status
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let router = &link.router;
    let inbound = async {
        let failed = read(router, agent, source, link.hard_stop.clone(), heard).await;
        router.remove_agent(agent);
        failed
    };
    let outbound = write(router, sink, packets, keepalive);
    super::both_halves(inbound, outbound).await
}

/// Feeds what the agent sends into the router until it closes, the link fails, the
/// stream is retired, or the hard stop; the status to close with when the agent broke
/// the protocol.
async fn read<S>(
    router: &Arc<Router>,
    agent: &Arc<AgentStream>,
    mut source: Source<S>,
    hard_stop: tokio_util::sync::CancellationToken,
    heard: &Heard,
) -> Option<Status>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let status = loop {
        let next = tokio::select! {
            next = source.next() => next,
            _ = hard_stop.cancelled() => return None,
            _ = agent.closed.cancelled() => return None,
        };
        heard.now();
        match next {
            Some(Ok(Message::Binary(data))) => match ws::decode(&data) {
                Ok(packet) => {
                    // The socket goes unread while the packet is handed on (a stalled
                    // client without flow control): busy, not silent.
                    heard.busy.store(true, Ordering::Relaxed);
                    Box::pin(router.on_agent_packet(agent, packet)).await;
                    heard.busy.store(false, Ordering::Relaxed);
                    heard.now();
                }
                Err(e) => break Status::internal(e.to_string()),
            },
            Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
            Some(Ok(Message::Text(_))) => {
                break Status::invalid_argument("text message: packets are binary messages")
            }
            // The agent ended its side (a drained agent leaving), or went away.
            Some(Ok(Message::Close(_))) | None => return None,
            Some(Err(WsError::Capacity(e))) => break Status::resource_exhausted(e.to_string()),
            Some(Err(WsError::Protocol(e))) => break Status::internal(e.to_string()),
            Some(Err(e)) => {
                tracing::debug!(error = %chain(&e), "agent WebSocket failed");
                router
                    .metrics
                    .stream_error(Segment::FromAgent, Code::Unavailable);
                return None;
            }
        }
    };
    router
        .metrics
        .stream_error(Segment::FromAgent, status.code());
    tracing::info!(error = %status.message(), code = ?status.code(), agent_id = %shown(&agent.agent_id), "agent stream failed");
    Some(status)
}

/// Writes the packets for the agent, flushing whenever none is waiting, and a ping
/// every `keepalive` (none if zero), until the packets end (true) or the link fails.
async fn write<S>(
    router: &Router,
    sink: &tokio::sync::Mutex<Sink<S>>,
    mut packets: PacketStream,
    keepalive: Duration,
) -> bool
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    use futures::FutureExt;
    let mut sink = sink.lock().await;
    let every = if keepalive.is_zero() {
        Duration::from_secs(86400 * 365)
    } else {
        keepalive
    };
    let mut ping = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        let next = match packets.next().now_or_never() {
            Some(next) => next,
            None => {
                if sink.flush().await.is_err() {
                    return false;
                }
                tokio::select! {
                    next = packets.next() => next,
                    _ = ping.tick() => {
                        if sink.send(Message::Ping(Default::default())).await.is_err() {
                            return false;
                        }
                        continue;
                    }
                }
            }
        };
        let Some(packet) = next else {
            return sink.flush().await.is_ok();
        };
        for message in ws::encode(&packet) {
            if let Err(e) = sink.feed(message).await {
                tracing::debug!(error = %chain(&e), "cannot write to the agent");
                router
                    .metrics
                    .send_error(Segment::ToAgent, Code::Unavailable, packet.r#type);
                return false;
            }
        }
    }
}

/// When the agent was last heard from, and whether the reader is busy handing a
/// packet on.
struct Heard {
    at: Mutex<Instant>,
    busy: AtomicBool,
}

impl Default for Heard {
    fn default() -> Self {
        Heard {
            at: Mutex::new(Instant::now()),
            busy: AtomicBool::new(false),
        }
    }
}

impl Heard {
    fn now(&self) {
        *self.at.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// How long the agent has been silent (never while the reader is busy).
    fn quiet(&self) -> Duration {
        if self.busy.load(Ordering::Relaxed) {
            return Duration::ZERO;
        }
        self.at.lock().unwrap_or_else(|e| e.into_inner()).elapsed()
    }
}

/// Resolves once nothing was heard from the agent for `keepalive` and the ping after
/// it (never with keepalive off).
async fn silence(heard: &Heard, keepalive: Duration) {
    if keepalive.is_zero() {
        return std::future::pending().await;
    }
    let limit = keepalive + PING_TIMEOUT.min(keepalive);
    loop {
        let quiet = heard.quiet();
        if quiet >= limit {
            return;
        }
        tokio::time::sleep(limit - quiet).await;
    }
}

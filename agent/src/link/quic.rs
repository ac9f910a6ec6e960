//! The agent link over QUIC (`tether_core::quic`): the connection to the server's UDP
//! port (mutual TLS 1.3, ALPN `tether/1`), the control stream's head and the server's
//! answer, and the halves the link's task drives: packets off every stream, and each
//! packet onto its tunnel's stream. QUIC keeps the link alive itself (its pings and
//! idle timeout), so this has no pinger.

use std::io;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tether_core::grpc::client::StreamError;
use tether_core::quic::{self, quinn, Mux, PacketReader, ReadError};
use tether_proto::Packet;

use super::{LinkError, PacketSink, PacketSource, CONNECT_PATH};
use crate::Agent;

/// A silent QUIC connection is dead after this; the agent pings well within it.
const IDLE: Duration = Duration::from_secs(30);

/// How long the QUIC handshake may take: a path that drops UDP answers nothing, and the
/// next transport in `--transports` is tried after this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the endpoint gets to tell the server the connection closed.
const CLOSE_GRACE: Duration = Duration::from_millis(200);

/// An open QUIC link: the connection's endpoint and the stream mux, with the packets
/// read off its streams.
pub(super) struct QuicLink {
    endpoint: quinn::Endpoint,
    mux: Arc<Mux>,
    inbound: quic::Inbound,
    /// Closes the connection when the link is dropped unserved (a duplicate stream to
    /// a server already held): the mux's tasks alone would keep it open.
    closing: CloseOnDrop,
}

/// Closes its connection when dropped.
struct CloseOnDrop(quinn::Connection);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close(quinn::VarInt::from_u32(quic::CLOSE_OK), b"");
    }
}

impl Agent {
    /// Connects to the server at `host`'s QUIC port (`--proxy-server-quic-port`, else
    /// `port`), opens the control stream and sends the agent's metadata: the link and
    /// the headers the server answered with.
    pub(super) async fn establish_quic(
        &self,
        host: &str,
        port: u16,
        metadata: http::HeaderMap,
    ) -> Result<(QuicLink, http::HeaderMap), LinkError> {
        if self.config.egress.route(host, port).is_some() {
            return Err(LinkError::Connect(io::Error::other(
                "QUIC cannot pass an HTTP CONNECT egress proxy; list another transport after quic in --transports, or exempt the server in NO_PROXY",
            )));
        }
        let port = self.config.quic_port.unwrap_or(port);
        let authority = tether_core::transport::authority(host, port);
        let connect = self.connect_quic(host, &authority);
        let (endpoint, conn) = tokio::time::timeout(HANDSHAKE_TIMEOUT, connect)
            .await
            .map_err(|_| LinkError::Timeout(HANDSHAKE_TIMEOUT))??;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| closed(&conn, e))?;
        let head = quic::request_head(&authority, CONNECT_PATH, &metadata);
        send.write_all(&head)
            .await
            .map_err(|e| LinkError::Write(io::Error::other(e)))?;
        let (headers, rest) = match quic::read_answer(&mut recv).await {
            Ok(answer) => answer,
            Err(quic::AnswerError::Refused { code, message }) => {
                return Err(LinkError::Stream(StreamError::Status { code, message }))
            }
            Err(e) => {
                if let Some(reason) = conn.close_reason() {
                    return Err(closed(&conn, reason));
                }
                return Err(LinkError::Protocol(e.to_string()));
            }
        };
        let reader = PacketReader::new(recv, rest);
        let closing = CloseOnDrop(conn.clone());
        let (mux, inbound) = Mux::start(conn, send, reader, tracing::Span::current());
        let link = QuicLink {
            endpoint,
            mux,
            inbound,
            closing,
        };
        Ok((link, headers))
    }

    /// A QUIC connection to `host` at `authority` (its address and UDP port), from an
    /// endpoint of its own on any local address.
    async fn connect_quic(
        &self,
        host: &str,
        authority: &str,
    ) -> Result<(quinn::Endpoint, quinn::Connection), LinkError> {
        let remote = tokio::net::lookup_host(authority)
            .await
            .map_err(LinkError::Connect)?
            .next()
            .ok_or_else(|| {
                LinkError::Connect(io::Error::other(format!("{host} has no address")))
            })?;
        let transport = quic::transport_config(self.quic_keepalive(), IDLE, false);
        let config = quic::client_config(&self.tls.get(), transport)
            .map_err(|e| LinkError::Connect(io::Error::other(e)))?;
        let endpoint = quic::client_endpoint(remote).map_err(LinkError::Connect)?;
        let name = host.trim_start_matches('[').trim_end_matches(']');
        let connecting = endpoint
            .connect_with(config, remote, name)
            .map_err(|e| LinkError::Connect(io::Error::other(e)))?;
        let conn = connecting.await.map_err(|e| {
            LinkError::Connect(io::Error::other(tether_core::error::chain(&e).to_string()))
        })?;
        Ok((endpoint, conn))
    }

    /// QUIC's keepalive: `--keepalive-time`, at most a third of the idle timeout.
    fn quic_keepalive(&self) -> Duration {
        let every = self.keepalive();
        if every.is_zero() {
            IDLE / 3
        } else {
            every.min(IDLE / 3)
        }
    }
}

/// A failed connection: the server's status when it closed it with one.
fn closed(conn: &quinn::Connection, e: impl Into<Option<quinn::ConnectionError>>) -> LinkError {
    let e = e.into().or_else(|| conn.close_reason());
    match e.as_ref().and_then(quic::status_of_close) {
        Some((0, _)) | None => LinkError::Connect(io::Error::other(
            e.map(|e| e.to_string())
                .unwrap_or_else(|| "connection closed".into()),
        )),
        Some((code, message)) => LinkError::Stream(StreamError::Status { code, message }),
    }
}

impl QuicLink {
    /// The halves the link's task drives.
    pub(super) fn split(self) -> (QuicSource, QuicSink, Closer) {
        let conn = self.mux.connection().clone();
        let source = QuicSource {
            inbound: self.inbound,
            conn,
        };
        let sink = QuicSink {
            budget: tokio_util::sync::PollSemaphore::new(self.mux.budget()),
            mux: self.mux,
        };
        let closer = Closer {
            endpoint: self.endpoint,
            closing: self.closing,
        };
        (source, sink, closer)
    }
}

/// Closes the connection once the link is done, giving the endpoint a moment to say so.
pub(super) struct Closer {
    endpoint: quinn::Endpoint,
    closing: CloseOnDrop,
}

impl Closer {
    pub(super) async fn close(self) {
        drop(self.closing);
        let _ = tokio::time::timeout(CLOSE_GRACE, self.endpoint.wait_idle()).await;
    }
}

/// Packets off every stream of the link; its end is the connection's, with the status
/// the server closed it with.
pub(super) struct QuicSource {
    inbound: quic::Inbound,
    conn: quinn::Connection,
}

impl PacketSource for QuicSource {
    fn poll_packet(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Packet>, LinkError>> {
        Poll::Ready(match futures::ready!(self.inbound.poll_recv(cx)) {
            Some(Ok(p)) => Ok(Some(p)),
            Some(Err(ReadError::Malformed(m))) => Err(LinkError::Protocol(m)),
            Some(Err(ReadError::Io(_))) | None => match self.conn.close_reason() {
                Some(e) => match quic::status_of_close(&e) {
                    Some((0, _)) => Ok(None),
                    Some((code, message)) => {
                        Err(LinkError::Stream(StreamError::Status { code, message }))
                    }
                    None => Err(LinkError::Connect(io::Error::other(e.to_string()))),
                },
                None => Err(LinkError::Closed),
            },
        })
    }
}

/// Each packet onto its tunnel's stream, once the connection's send budget has room
/// for it; finishing ends the control stream.
pub(super) struct QuicSink {
    mux: Arc<Mux>,
    budget: tokio_util::sync::PollSemaphore,
}

impl PacketSink for QuicSink {
    fn poll_send(&mut self, cx: &mut Context<'_>, packet: &Packet) -> Poll<io::Result<()>> {
        let permit = futures::ready!(self.budget.poll_acquire_many(cx, Mux::cost(packet)));
        Poll::Ready(match self.mux.send_reserved(packet, permit) {
            true => Ok(()),
            false => Err(io::ErrorKind::BrokenPipe.into()),
        })
    }

    fn poll_idle(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_finish(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.mux.finish_control();
        Poll::Ready(Ok(()))
    }
}

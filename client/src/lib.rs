//! A Rust konnectivity client: what kube-apiserver does with a proxy server's gRPC
//! frontend, for the CCM, tests and benchmarks. [`Client::dial`] opens one Proxy stream
//! per connection and returns a [`TunnelConn`] implementing `AsyncRead + AsyncWrite`,
//! read and written directly in the caller's task (no pump task, no extra copy). The
//! streams run on a bare HTTP/2 connection (`grpc`), reconnected when it fails.

mod grpc;
pub use grpc::Windows;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use futures::ready;
use futures::task::AtomicWaker;
use h2::client::SendRequest;
use tether_proto::{packet::Payload, Packet};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::runtime::Handle;
use tracing::Instrument;

use grpc::{Inbound, Outbound, Target};

/// Entry points for the fuzz targets in `tests/fuzz.rs`.
#[doc(hidden)]
pub mod fuzzing {
    pub use tether_core::grpc::{frame, fuzz_messages};
}

/// How long to wait for the server's DIAL_RSP (upstream's client backstop).
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a closing connection waits for CLOSE_RSP.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a dial failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The connection to the proxy server failed.
    #[error("cannot connect to proxy server")]
    Connect(#[from] io::Error),
    /// The Proxy stream failed.
    #[error("proxy stream failed")]
    Stream(#[source] grpc::StreamError),
    /// The server or agent answered the dial with an error.
    #[error("dial {address} failed: {error}")]
    Dial {
        /// The address dialed.
        address: String,
        /// The error text from the server or agent.
        error: String,
    },
    /// No DIAL_RSP within the timeout.
    #[error("dial {0} timed out waiting for the proxy server")]
    Timeout(String),
}

/// A connection to a proxy server's gRPC frontend. Clones share it.
#[derive(Clone)]
pub struct Client {
    shared: Arc<Shared>,
}

struct Shared {
    target: Target,
    windows: grpc::Windows,
    authority: String,
    /// The current HTTP/2 connection and its generation (bumped on each reconnect).
    conn: std::sync::Mutex<(u64, SendRequest<Bytes>)>,
    /// Held while reconnecting, so that one dial reconnects and the others wait for it.
    reconnecting: tokio::sync::Mutex<()>,
}

impl Client {
    /// Connects over the Unix socket at `path` (what kube-apiserver does).
    pub async fn uds(path: impl Into<PathBuf>) -> Result<Self, ClientError> {
        Self::connect(Target::Uds(path.into()), grpc::Windows::default()).await
    }

    /// [`Client::uds`] with other HTTP/2 receive windows: a small stream window and a
    /// large connection window let many readers stall before the connection (and every
    /// stream on it) does.
    pub async fn uds_with_windows(
        path: impl Into<PathBuf>,
        windows: grpc::Windows,
    ) -> Result<Self, ClientError> {
        Self::connect(Target::Uds(path.into()), windows).await
    }

    /// Connects over TCP with mutual TLS (the config must offer ALPN `h2`).
    pub async fn tls(
        host: &str,
        port: u16,
        tls: Arc<rustls::ClientConfig>,
    ) -> Result<Self, ClientError> {
        let (host, port) = (host.to_string(), port);
        Self::connect(Target::Tls { host, port, tls }, grpc::Windows::default()).await
    }

    async fn connect(target: Target, windows: grpc::Windows) -> Result<Self, ClientError> {
        let send = target.connect(windows).await?;
        Ok(Client {
            shared: Arc::new(Shared {
                authority: target.authority(),
                target,
                windows,
                conn: std::sync::Mutex::new((0, send)),
                reconnecting: tokio::sync::Mutex::new(()),
            }),
        })
    }

    /// Opens a Proxy stream with `first` sent along with its headers. A connection
    /// that has failed (the server restarted, say) is replaced once, here.
    async fn open(
        &self,
        first: Option<&Packet>,
    ) -> Result<(Outbound, h2::client::ResponseFuture), ClientError> {
        let current = || self.shared.conn.lock().expect("not poisoned").clone();
        let (generation, send) = current();
        if let Ok(mut send) = send.ready().await {
            if let Ok(stream) = grpc::open(&mut send, &self.shared.authority, first) {
                return Ok(stream);
            }
        }
        let send = {
            let _one_at_a_time = self.shared.reconnecting.lock().await;
            let (now, send) = current();
            if now != generation {
                send // another dial has reconnected meanwhile
            } else {
                tracing::debug!("proxy connection failed; reconnecting");
                let send = self.shared.target.connect(self.shared.windows).await?;
                *self.shared.conn.lock().expect("not poisoned") = (generation + 1, send.clone());
                send
            }
        };
        let mut send = send.ready().await.map_err(grpc::h2_io)?;
        grpc::open(&mut send, &self.shared.authority, first)
            .map_err(|e| ClientError::Connect(grpc::h2_io(e)))
    }

    /// Opens a raw Proxy stream, for speaking the protocol packet by packet.
    pub async fn open_stream(&self) -> Result<(PacketSender, PacketStream), ClientError> {
        let (out, response) = self.open(None).await?;
        let inbound = Inbound::new(response);
        Ok((PacketSender(out), PacketStream(inbound)))
    }

    /// Dials `address` (`host:port`) through the tunnel. The DIAL_REQ leaves with the
    /// stream's headers: the dial costs one round trip to the agent, not two. Opening
    /// the stream (waiting for a free stream slot, or reconnecting) counts towards
    /// [`DIAL_TIMEOUT`] too.
    pub async fn dial(&self, address: &str) -> Result<TunnelConn, ClientError> {
        let random = tether_core::random_id();
        let dial = Packet::dial_request("tcp", address, random);
        let mut opened = Outbound::closed();
        let answer = tokio::time::timeout(DIAL_TIMEOUT, async {
            let (out, response) = self.open(Some(&dial)).await?;
            opened = out;
            let mut inbound = Inbound::new(response);
            loop {
                match inbound.message().await.map_err(ClientError::Stream)? {
                    Some(Packet {
                        payload: Some(Payload::DialResponse(rsp)),
                        ..
                    }) if rsp.random == random => {
                        return Ok::<_, ClientError>((rsp, inbound));
                    }
                    Some(Packet {
                        payload: Some(Payload::CloseDial(c)),
                        ..
                    }) if c.random == random => {
                        return Err(ClientError::Dial {
                            address: address.to_string(),
                            error: "dial cancelled by the proxy".into(),
                        });
                    }
                    Some(_) => continue,
                    None => {
                        return Err(ClientError::Dial {
                            address: address.to_string(),
                            error: "proxy server closed the stream".into(),
                        })
                    }
                }
            }
        })
        .await;
        let mut out = opened;
        let (rsp, inbound) = match answer {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                out.finish();
                return Err(e);
            }
            Err(_) => {
                out.send_now(&Packet::close_dial(random));
                out.finish();
                return Err(ClientError::Timeout(address.to_string()));
            }
        };
        if !rsp.error.is_empty() {
            out.finish();
            return Err(ClientError::Dial {
                address: address.to_string(),
                error: rsp.error,
            });
        }
        let span = tracing::debug_span!("tunnel_conn", %address, connect_id = rsp.connect_id);
        Ok(TunnelConn::new(rsp.connect_id, out, inbound, span))
    }
}

/// The sending half of a raw Proxy stream ([`Client::open_stream`]). Dropping it ends
/// the stream from the client's side.
pub struct PacketSender(Outbound);

impl PacketSender {
    /// Sends `packet`, waiting for HTTP/2 flow control.
    pub async fn send(&mut self, packet: Packet) -> Result<(), ClientError> {
        self.0.send(&packet).await.map_err(ClientError::Connect)
    }

    /// Ends the stream as upstream's konnectivity-client ends each tunnel: without
    /// half-closing it, by cancelling it (RST_STREAM CANCEL, what closing its gRPC
    /// connection amounts to for the stream).
    pub fn cancel(mut self) {
        if let Some(stream) = self.0.stream() {
            stream.send_reset(h2::Reason::CANCEL);
        }
        self.0.take();
    }
}

impl Drop for PacketSender {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// The receiving half of a raw Proxy stream.
pub struct PacketStream(Inbound);

impl PacketStream {
    /// The next packet; `None` once the server ended the stream with status OK.
    pub async fn message(&mut self) -> Result<Option<Packet>, ClientError> {
        self.0.message().await.map_err(ClientError::Stream)
    }
}

/// Received bytes held for the reader; past this the stream is not read further until
/// the caller reads (the HTTP/2 stream window then holds the proxy back).
const READ_AHEAD: usize = 256 * 1024;

/// A connection through the tunnel, read and written in the caller's task: bytes written
/// leave as DATA packets, DATA arriving is what reads return. Shutting it down (or
/// dropping it) closes the connection on the agent with CLOSE_REQ; reads end when the
/// peer's CLOSE_RSP (or CLOSE_REQ) arrives, and writes fail from then on, even if the
/// caller never reads.
pub struct TunnelConn {
    connect_id: i64,
    out: Outbound,
    /// The Proxy stream's packets; `None` once the peer closed or the stream ended.
    inbound: Option<Inbound>,
    /// Received bytes the caller has not read yet (at most about `READ_AHEAD`).
    unread: VecDeque<Bytes>,
    unread_len: usize,
    /// Why the stream failed, for the next read.
    failure: Option<String>,
    close_sent: bool,
    /// Reader and writer may be different tasks (`tokio::io::split`): whichever polls
    /// the stream, a packet arriving wakes both.
    wakers: Arc<BothWakers>,
    span: tracing::Span,
}

#[derive(Default)]
struct BothWakers {
    read: AtomicWaker,
    write: AtomicWaker,
}

impl Wake for BothWakers {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.read.wake();
        self.write.wake();
    }
}

impl TunnelConn {
    fn new(connect_id: i64, out: Outbound, inbound: Inbound, span: tracing::Span) -> Self {
        TunnelConn {
            connect_id,
            out,
            inbound: Some(inbound),
            unread: VecDeque::new(),
            unread_len: 0,
            failure: None,
            close_sent: false,
            wakers: Arc::default(),
            span,
        }
    }

    /// The connectID the agent assigned.
    pub fn connect_id(&self) -> i64 {
        self.connect_id
    }

    /// Takes packets off the stream until `READ_AHEAD` bytes wait unread, the peer
    /// closes, or nothing more has arrived (the next packet then wakes both sides).
    fn pull(&mut self) {
        let waker = Waker::from(self.wakers.clone());
        let mut cx = Context::from_waker(&waker);
        while self.unread_len < READ_AHEAD {
            let Some(inbound) = self.inbound.as_mut() else {
                return;
            };
            let packet = match inbound.poll_packet(&mut cx) {
                Poll::Pending => return,
                Poll::Ready(Some(Ok(p))) => p,
                Poll::Ready(Some(Err(why))) => {
                    self.inbound = None;
                    self.failure = Some(format!(
                        "proxy stream failed: {}",
                        tether_core::error::chain(&why)
                    ));
                    return;
                }
                Poll::Ready(None) => {
                    self.inbound = None;
                    return;
                }
            };
            match packet.payload {
                Some(Payload::Data(d)) if d.error.is_empty() && !d.data.is_empty() => {
                    self.unread_len += d.data.len();
                    self.unread.push_back(d.data);
                }
                Some(Payload::Data(d)) => {
                    self.inbound = None;
                    self.failure = Some(d.error);
                }
                Some(Payload::CloseResponse(c)) => {
                    tracing::debug!(parent: &self.span, error = %c.error, "closed by the proxy");
                    self.inbound = None;
                }
                Some(Payload::CloseRequest(_)) => {
                    tracing::debug!(parent: &self.span, "close requested by the proxy");
                    self.inbound = None;
                }
                _ => {}
            }
        }
    }
}

impl TunnelConn {
    /// The next received chunk whole, as it arrived (no copy into a caller's buffer);
    /// `None` at end of stream. Mixes with `poll_read`: either takes from the front.
    pub fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<Option<Bytes>>> {
        self.wakers.read.register(cx.waker());
        self.pull();
        if let Some(chunk) = self.unread.pop_front() {
            self.unread_len -= chunk.len();
            return Poll::Ready(Ok(Some(chunk)));
        }
        if let Some(why) = self.failure.take() {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionReset, why)));
        }
        if self.inbound.is_none() {
            return Poll::Ready(Ok(None));
        }
        Poll::Pending
    }
}

impl AsyncRead for TunnelConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        this.wakers.read.register(cx.waker());
        this.pull();
        if let Some(front) = this.unread.front_mut() {
            let n = front.len().min(buf.remaining());
            buf.put_slice(&front.split_to(n));
            this.unread_len -= n;
            if front.is_empty() {
                this.unread.pop_front();
            }
            return Poll::Ready(Ok(()));
        }
        if let Some(why) = this.failure.take() {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionReset, why)));
        }
        if this.inbound.is_none() {
            return Poll::Ready(Ok(())); // end of file
        }
        Poll::Pending
    }
}

impl AsyncWrite for TunnelConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        this.wakers.write.register(cx.waker());
        // Notice a close even when nobody reads.
        this.pull();
        if this.close_sent {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "tunnel connection shut down",
            )));
        }
        if this.inbound.is_none() {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "tunnel connection closed by the proxy",
            )));
        }
        // One message per HTTP/2 frame: the server reads it without joining pieces.
        let n = buf.len().min(tether_core::pump::READ_CHUNK);
        let connect_id = this.connect_id;
        ready!(this
            .out
            .poll_send(cx, || grpc::frame_data(connect_id, &buf[..n])))?;
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    /// Sends CLOSE_REQ: the agent closes the target connection. Reads go on until the
    /// proxy's CLOSE_RSP.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if !self.close_sent && self.inbound.is_some() {
            let packet = Packet::close_request(self.connect_id);
            ready!(self.out.poll_send(cx, || grpc::frame(&packet)))?;
            self.close_sent = true;
        }
        Poll::Ready(Ok(()))
    }
}

impl Drop for TunnelConn {
    /// A connection the peer has not closed yet is closed in the background: CLOSE_REQ,
    /// then up to 10 s for the CLOSE_RSP (as upstream's client does) before the stream
    /// ends. Either way the client ends its half of the stream cleanly.
    fn drop(&mut self) {
        let (Some(mut inbound), Ok(rt)) = (self.inbound.take(), Handle::try_current()) else {
            self.out.finish();
            return;
        };
        let mut out = self.out.take();
        let (connect_id, close_sent) = (self.connect_id, self.close_sent);
        rt.spawn(
            async move {
                if !close_sent && out.send(&Packet::close_request(connect_id)).await.is_err() {
                    return;
                }
                let _ = tokio::time::timeout(CLOSE_TIMEOUT, async {
                    while let Ok(Some(p)) = inbound.message().await {
                        if matches!(
                            p.payload,
                            Some(Payload::CloseResponse(_) | Payload::CloseRequest(_))
                        ) {
                            break;
                        }
                    }
                })
                .await;
                out.finish();
            }
            .instrument(self.span.clone()),
        );
    }
}

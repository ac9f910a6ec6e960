//! The client's side of `/ProxyService/Proxy` streams on a bare HTTP/2 connection (the
//! h2 crate, no tonic or hyper between): connecting, opening a stream, and reading its
//! packets and final status (the framing is `tether_core::grpc`). Whoever holds a
//! stream writes and reads it in its own task, so a message costs one hop (to h2's
//! connection task) instead of three (a request queue, hyper's body pipe task, then the
//! connection task).

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tether_core::error::chain;

use bytes::Bytes;
use futures::{ready, Future};
use h2::client::SendRequest;
use tether_core::grpc::{check_status, MessageError, Messages, PROXY_PATH};
pub(crate) use tether_core::grpc::{frame, frame_data, h2_io, Outbound};
use tether_core::transport::{self, H2_CONN_WINDOW, H2_MAX_FRAME, H2_STREAM_WINDOW};
use tether_proto::Packet;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::UnixStream;
use tracing::Instrument;

/// TCP connect plus TLS handshake plus HTTP/2 preface.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The HTTP/2 receive windows a client connection offers.
#[derive(Debug, Clone, Copy)]
pub struct Windows {
    /// Per stream (one tunnelled connection): what may be in flight towards a reader.
    pub stream: u32,
    /// Per connection: shared by every stream on it.
    pub connection: u32,
}

impl Default for Windows {
    fn default() -> Self {
        Windows {
            stream: H2_STREAM_WINDOW,
            connection: H2_CONN_WINDOW,
        }
    }
}

/// Where the proxy server's gRPC frontend listens.
pub(crate) enum Target {
    Uds(PathBuf),
    Tls {
        host: String,
        port: u16,
        tls: Arc<rustls::ClientConfig>,
    },
}

impl Target {
    /// The `:authority` of every request: `localhost` on a Unix socket (a socket path
    /// is not a valid authority), `host:port` over TCP.
    pub(crate) fn authority(&self) -> String {
        match self {
            Target::Uds(_) => "localhost".into(),
            Target::Tls { host, port, .. } => transport::authority(host, *port),
        }
    }

    /// Opens a new HTTP/2 connection; its connection task runs until every handle and
    /// stream on it is gone or the peer goes away.
    pub(crate) async fn connect(&self, windows: Windows) -> io::Result<SendRequest<Bytes>> {
        let connect = async {
            match self {
                Target::Uds(path) => handshake(UnixStream::connect(path).await?, windows).await,
                Target::Tls { host, tls, .. } => {
                    let name = tether_core::tls::server_name(host)
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
                    let authority = self.authority();
                    let tls = transport::connect_tls(&authority, name, tls.clone()).await?;
                    handshake(tls, windows).await
                }
            }
        };
        tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))?
    }
}

async fn handshake<S>(io: S, windows: Windows) -> io::Result<SendRequest<Bytes>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = h2::client::Builder::new()
        .initial_window_size(windows.stream)
        .initial_connection_window_size(windows.connection)
        .max_frame_size(H2_MAX_FRAME)
        .handshake(FirstFlight::new(io))
        .await
        .map_err(h2_io)?;
    tokio::spawn(
        async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %chain(&e), "proxy connection ended");
            }
        }
        .instrument(tracing::debug_span!("proxy_connection")),
    );
    Ok(send)
}

/// A connection that holds what is written before the first flush: h2 writes the
/// connection preface on its own, then SETTINGS and the first request's HEADERS and
/// DATA with a flush. Held, the preface leaves in that same write: one system call and
/// one wake-up of the server instead of two. Everything after passes straight through.
struct FirstFlight<S> {
    io: S,
    held: Option<Vec<u8>>,
}

impl<S> FirstFlight<S> {
    fn new(io: S) -> Self {
        FirstFlight {
            io,
            held: Some(Vec::new()),
        }
    }
}

impl<S: AsyncWrite + Unpin> FirstFlight<S> {
    /// Writes out what is held, then passes writes through.
    fn poll_release(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(held) = &mut self.held {
            while !held.is_empty() {
                let n = ready!(std::pin::Pin::new(&mut self.io).poll_write(cx, held))?;
                if n == 0 {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                held.drain(..n);
            }
            self.held = None;
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FirstFlight<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FirstFlight<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.held {
            Some(held) => {
                held.extend_from_slice(buf);
                Poll::Ready(Ok(buf.len()))
            }
            None => std::pin::Pin::new(&mut self.io).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.held {
            Some(held) => {
                let before = held.len();
                bufs.iter().for_each(|b| held.extend_from_slice(b));
                Poll::Ready(Ok(held.len() - before))
            }
            None => std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        ready!(self.poll_release(cx))?;
        std::pin::Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<()>> {
        ready!(self.poll_release(cx))?;
        std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Opens a Proxy stream on `send`, with `first` in the same write as the headers.
pub(crate) fn open(
    send: &mut SendRequest<Bytes>,
    authority: &str,
    first: Option<&Packet>,
) -> Result<(Outbound, h2::client::ResponseFuture), h2::Error> {
    let request = http::Request::post(format!("http://{authority}{PROXY_PATH}"))
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header(http::header::TE, "trailers")
        .header(http::header::USER_AGENT, "tether-client")
        .body(())
        .expect("static request parts");
    let (response, mut stream) = send.send_request(request, false)?;
    if let Some(packet) = first {
        stream.send_data(frame(packet), false)?;
    }
    Ok((Outbound::new(stream), response))
}

/// The reading half of a Proxy stream: the response headers, packets, then the
/// stream's gRPC status. Nothing waits for the headers before the first read: a server
/// may send them only with its first message (grpc-go's and Tether's do).
pub(crate) struct Inbound {
    body: Body,
    messages: Messages,
    /// The body ended (the status is next).
    ended: bool,
}

enum Body {
    Waiting(h2::client::ResponseFuture),
    Open(h2::RecvStream),
    /// The headers said the stream failed; that was reported.
    Failed,
}

impl Inbound {
    pub(crate) fn new(response: h2::client::ResponseFuture) -> Self {
        Inbound {
            body: Body::Waiting(response),
            messages: Messages::default(),
            ended: false,
        }
    }

    /// Waits for the response headers and checks them: HTTP 200, and no error status
    /// in a trailers-only answer.
    fn poll_body(&mut self, cx: &mut Context<'_>) -> Poll<Result<&mut h2::RecvStream, String>> {
        if let Body::Waiting(response) = &mut self.body {
            let checked = match ready!(std::pin::Pin::new(response).poll(cx)) {
                Err(e) => Err(e.to_string()),
                Ok(r) if r.status() != http::StatusCode::OK => {
                    Err(format!("HTTP status {}", r.status()))
                }
                Ok(r) => check_status(r.headers()).map(|()| r.into_body()),
            };
            match checked {
                Ok(body) => {
                    self.ended = body.is_end_stream();
                    self.body = Body::Open(body);
                }
                Err(e) => {
                    self.body = Body::Failed;
                    return Poll::Ready(Err(e));
                }
            }
        }
        match &mut self.body {
            Body::Open(body) => Poll::Ready(Ok(body)),
            _ => Poll::Ready(Err("proxy stream failed".into())),
        }
    }

    /// The next packet; `None` once the server ended the stream with status OK.
    pub(crate) fn poll_packet(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Packet, String>>> {
        loop {
            if let Some(packet) = self.messages.next_packet().transpose() {
                return Poll::Ready(Some(packet.map_err(|e| match e {
                    MessageError::BadPacket(e) => format!("bad packet from proxy: {e}"),
                    e => e.to_string(),
                })));
            }
            if matches!(self.body, Body::Failed) {
                return Poll::Ready(None);
            }
            if let Err(e) = ready!(self.poll_body(cx)) {
                return Poll::Ready(Some(Err(e)));
            }
            if self.ended {
                if self.messages.mid_message() {
                    self.messages = Messages::default();
                    return Poll::Ready(Some(Err("proxy stream ended inside a message".into())));
                }
                let Body::Open(body) = &mut self.body else {
                    unreachable!("opened above")
                };
                let trailers = ready!(body.poll_trailers(cx)).map_err(|e| chain(&e).to_string());
                return Poll::Ready(match trailers {
                    Ok(Some(t)) => check_status(&t).err().map(Err),
                    Ok(None) => Some(Err("proxy stream ended without a status".into())),
                    Err(e) => Some(Err(e)),
                });
            }
            let Body::Open(body) = &mut self.body else {
                unreachable!("opened above")
            };
            match ready!(body.poll_data(cx)) {
                Some(Ok(chunk)) => {
                    let _ = body.flow_control().release_capacity(chunk.len());
                    self.messages.push(chunk);
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(e.to_string()))),
                None => self.ended = true,
            }
        }
    }

    /// The next packet (see [`Inbound::poll_packet`]).
    pub(crate) async fn message(&mut self) -> Result<Option<Packet>, String> {
        futures::future::poll_fn(|cx| self.poll_packet(cx))
            .await
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    /// Records each write it gets.
    #[derive(Default)]
    struct Writes(Vec<Vec<u8>>);

    impl AsyncWrite for Writes {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.0.push(buf.to_vec());
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: std::pin::Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn what_comes_before_the_first_flush_leaves_in_one_write() {
        let mut io = FirstFlight::new(Writes::default());
        io.write_all(b"PRI * HTTP/2.0").await.unwrap();
        io.write_all(b"SETTINGS").await.unwrap();
        assert!(io.io.0.is_empty());
        io.flush().await.unwrap();
        assert_eq!(io.io.0, vec![b"PRI * HTTP/2.0SETTINGS".to_vec()]);
        io.write_all(b"HEADERS").await.unwrap();
        assert_eq!(io.io.0.len(), 2, "passed through after the first flush");
    }
}

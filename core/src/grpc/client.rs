//! The client half of gRPC on a bare HTTP/2 connection (the h2 crate, no tonic or
//! hyper between), as the Rust client's Proxy streams, the agent's Connect stream and
//! the bench's swarm of agents speak it: the handshake with Tether's windows, a stream
//! opened with its first message in the same write as its headers, and the reading
//! half (response headers, packets, then the gRPC status). Whoever holds a stream
//! reads and writes it in its own task: a message costs one hop (to the connection's
//! driver), not three.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::{ready, Future};
use h2::client::{Connection, ResponseFuture, SendRequest};
use tether_proto::Packet;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::{frame, h2_io, status_of, MessageError, Messages, Outbound};
use crate::transport::{H2_CONN_WINDOW, H2_MAX_FRAME, H2_MUX_CONN_WINDOW, H2_STREAM_WINDOW};

/// The HTTP/2 receive windows a client connection offers.
#[derive(Debug, Clone, Copy)]
pub struct Windows {
    /// Per stream (one tunnelled connection): what may be in flight towards a reader.
    pub stream: u32,
    /// Per connection: shared by every stream on it.
    pub connection: u32,
}

impl Windows {
    /// An agent's link (and the bench's emulated agents): one stream per connection,
    /// its Connect call, so the connection needs no room for other streams; the
    /// server's side of the link offers the same.
    pub const AGENT_LINK: Windows = Windows {
        stream: H2_STREAM_WINDOW,
        connection: H2_CONN_WINDOW,
    };
}

impl Default for Windows {
    fn default() -> Self {
        Windows {
            stream: H2_STREAM_WINDOW,
            connection: H2_MUX_CONN_WINDOW,
        }
    }
}

/// The HTTP/2 handshake on `io` with `windows` and Tether's frame size. The
/// connection must be driven (polled, or spawned) for any stream on it to move.
pub async fn handshake<S>(
    io: S,
    windows: Windows,
) -> io::Result<(SendRequest<Bytes>, Connection<FirstFlight<S>, Bytes>)>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    // As hyper's client sets them: no server push (pushed streams nobody reads
    // would hold the connection window), 16 KiB of headers, 1 MiB buffered to send.
    h2::client::Builder::new()
        .initial_window_size(windows.stream)
        .initial_connection_window_size(windows.connection)
        .max_frame_size(H2_MAX_FRAME)
        .enable_push(false)
        .max_header_list_size(16 << 10)
        .max_send_buffer_size(1 << 20)
        .handshake(FirstFlight::new(io))
        .await
        .map_err(h2_io)
}

/// A gRPC call's request: POST `path` on `authority` with `headers` (metadata) added
/// to gRPC's own.
pub fn request(authority: &str, path: &str, headers: http::HeaderMap) -> http::Request<()> {
    let mut request = http::Request::post(format!("http://{authority}{path}"))
        .header(http::header::CONTENT_TYPE, "application/grpc")
        .header(http::header::TE, "trailers")
        .body(())
        .expect("static request parts");
    request.headers_mut().extend(headers);
    request
}

/// Opens a stream on `send` for `request`, with `first` in the same write as the
/// headers.
pub fn open(
    send: &mut SendRequest<Bytes>,
    request: http::Request<()>,
    first: Option<&Packet>,
) -> Result<(Outbound, ResponseFuture), h2::Error> {
    let (response, mut stream) = send.send_request(request, false)?;
    if let Some(packet) = first {
        stream.send_data(frame(packet), false)?;
    }
    Ok((Outbound::new(stream), response))
}

/// Why the reading half of a stream failed.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The server ended the stream (or refused it) with a gRPC status other than OK.
    #[error("status {code}: {message}")]
    Status {
        /// The gRPC status code.
        code: i32,
        /// Its `grpc-message`.
        message: String,
    },
    /// The response was not HTTP 200.
    #[error("HTTP status {0}")]
    Http(http::StatusCode),
    /// The stream or its connection broke (the server gone, a reset, a GOAWAY).
    #[error("stream broken")]
    Transport(#[source] h2::Error),
    /// A message could not be read.
    #[error("bad message from the server")]
    Message(#[source] MessageError),
    /// The body ended inside a message.
    #[error("stream ended inside a message")]
    Truncated,
    /// The body ended without trailers.
    #[error("stream ended without a status")]
    NoStatus,
}

impl StreamError {
    /// The gRPC code grpc-go's client reports for this failure: the server's status
    /// keeps its code; a broken transport is `Unavailable`, as grpc-go reports losing
    /// the server; the rest is `Internal`.
    pub fn code(&self) -> tonic::Code {
        match self {
            StreamError::Status { code, .. } => tonic::Code::from(*code),
            StreamError::Transport(_) => tonic::Code::Unavailable,
            _ => tonic::Code::Internal,
        }
    }
}

/// The reading half of a stream: the response headers, packets, then the stream's
/// gRPC status. Nothing waits for the headers before the first read: a server may send
/// them only with its first message (grpc-go's and Tether's do).
pub struct Inbound {
    body: Body,
    messages: Messages,
    /// The body ended (the status is next).
    ended: bool,
}

enum Body {
    Waiting(ResponseFuture),
    Open(h2::RecvStream),
    /// The headers said the stream failed; that was reported.
    Failed,
}

impl Inbound {
    /// The reading half of the stream `response` answers.
    pub fn new(response: ResponseFuture) -> Self {
        Inbound {
            body: Body::Waiting(response),
            messages: Messages::default(),
            ended: false,
        }
    }

    /// The reading half of a stream whose response headers were read already.
    pub fn open(body: h2::RecvStream) -> Self {
        Inbound {
            ended: body.is_end_stream(),
            body: Body::Open(body),
            messages: Messages::default(),
        }
    }

    /// Waits for the response headers and checks them (see [`check_response`]).
    fn poll_body(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<&mut h2::RecvStream, StreamError>> {
        if let Body::Waiting(response) = &mut self.body {
            let checked = match ready!(Pin::new(response).poll(cx)) {
                Err(e) => Err(StreamError::Transport(e)),
                Ok(r) => check_response(&r).map(|()| r.into_body()),
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
            _ => Poll::Ready(Err(StreamError::NoStatus)),
        }
    }

    /// The next packet; `None` once the server ended the stream with status OK.
    pub fn poll_packet(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Packet, StreamError>>> {
        loop {
            if let Some(packet) = self.messages.next_packet().transpose() {
                return Poll::Ready(Some(packet.map_err(StreamError::Message)));
            }
            if matches!(self.body, Body::Failed) {
                return Poll::Ready(None);
            }
            if let Err(e) = ready!(self.poll_body(cx)) {
                return Poll::Ready(Some(Err(e)));
            }
            let Body::Open(body) = &mut self.body else {
                unreachable!("opened above")
            };
            if self.ended {
                if self.messages.mid_message() {
                    self.messages = Messages::default();
                    return Poll::Ready(Some(Err(StreamError::Truncated)));
                }
                return Poll::Ready(match ready!(body.poll_trailers(cx)) {
                    Ok(Some(t)) => status_of(&t)
                        .map(|(code, message)| Err(StreamError::Status { code, message })),
                    Ok(None) => Some(Err(StreamError::NoStatus)),
                    Err(e) => Some(Err(StreamError::Transport(e))),
                });
            }
            match ready!(body.poll_data(cx)) {
                Some(Ok(chunk)) => {
                    let _ = body.flow_control().release_capacity(chunk.len());
                    self.messages.push(chunk);
                }
                Some(Err(e)) => return Poll::Ready(Some(Err(StreamError::Transport(e)))),
                None => self.ended = true,
            }
        }
    }

    /// The next packet (see [`Inbound::poll_packet`]).
    pub async fn message(&mut self) -> Result<Option<Packet>, StreamError> {
        futures::future::poll_fn(|cx| self.poll_packet(cx))
            .await
            .transpose()
    }
}

/// Checks a response's head: HTTP 200, and no error status in a trailers-only answer
/// (a refusal comes as headers only, carrying the status).
pub fn check_response<T>(response: &http::Response<T>) -> Result<(), StreamError> {
    if response.status() != http::StatusCode::OK {
        return Err(StreamError::Http(response.status()));
    }
    match status_of(response.headers()) {
        Some((code, message)) => Err(StreamError::Status { code, message }),
        None => Ok(()),
    }
}

/// A connection that holds what is written before the first flush: h2 writes the
/// connection preface on its own, then SETTINGS and the first request's HEADERS and
/// DATA with a flush. Held, the preface leaves in that same write: one system call and
/// one wake-up of the server instead of two. Everything after passes straight through.
pub struct FirstFlight<S> {
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
                let n = ready!(Pin::new(&mut self.io).poll_write(cx, held))?;
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
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FirstFlight<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.held {
            Some(held) => {
                held.extend_from_slice(buf);
                Poll::Ready(Ok(buf.len()))
            }
            None => Pin::new(&mut self.io).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.held {
            Some(held) => {
                let before = held.len();
                bufs.iter().for_each(|b| held.extend_from_slice(b));
                Poll::Ready(Ok(held.len() - before))
            }
            None => Pin::new(&mut self.io).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_release(cx))?;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_release(cx))?;
        Pin::new(&mut self.io).poll_shutdown(cx)
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
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            self.0.push(buf.to_vec());
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
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

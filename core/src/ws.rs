//! The agent link carried over WebSocket (HTTP/1.1 and TLS), for the paths that pass
//! only HTTP/1.1: TLS-terminating reverse proxies, L7 load balancers and firewalls that
//! break HTTP/2. The framing is tokio-tungstenite's; this module owns what Tether puts
//! on it: the upgrade request and its answer (the agent's metadata and the server's
//! answer as the same headers gRPC carries), one agent-protocol packet per binary
//! message, a refusal as an HTTP status with `grpc-status`, and a stream's end as a
//! close frame carrying its gRPC status.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use prost::Message as _;
use tether_proto::Packet;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, WebSocketConfig};

pub use tokio_tungstenite::tungstenite::protocol::Role;
pub use tokio_tungstenite::tungstenite::{Error as WsError, Message};
pub use tokio_tungstenite::WebSocketStream;

use crate::grpc::{percent_encode, status_of, MessageError};
use tether_proto::MAX_MESSAGE;

/// The subprotocol both ends name in `Sec-WebSocket-Protocol`: the agent protocol's
/// packets, one per binary message.
pub const SUBPROTOCOL: &str = "tether.agent.v1";

/// The longest upgrade request head a server reads (the agent's metadata, a bearer
/// token included), as the HTTP/2 link allows for its headers.
pub const MAX_HEAD: usize = 16 << 10;

/// The most headers an upgrade request may carry.
const MAX_HEADERS: usize = 64;

/// Close codes from here up carry a gRPC status code (RFC 6455 leaves 4000-4999 to
/// applications).
const STATUS_CLOSE_BASE: u16 = 4000;

/// The longest close reason a frame carries (its payload is at most 125 bytes).
const MAX_REASON: usize = 123;

/// How much a WebSocket reads at a time. tungstenite keeps a buffer this large for each
/// connection's life (its default, 128 KiB, would be most of an idle agent's cost on
/// the server): 8 KiB makes an idle WebSocket agent cost the server less than an
/// HTTP/2 one (`tether-bench --agents`).
const READ_BUFFER: usize = 8 << 10;

/// Frames are gathered up to this before a write (the writer flushes whenever its
/// queue is empty): below it, every frame became a TLS record and a system call of its
/// own, and 8 KiB cost twice h2's CPU per byte.
const WRITE_BUFFER: usize = 32 << 10;

/// The largest frame either end sends: a packet above this goes as a fragmented
/// message. tungstenite reads a frame whole into its read buffer and keeps that
/// buffer's size (and a frame whole into its write buffer, likewise): with frames this
/// small, an agent that once carried a 128 KiB DATA packet holds 38 KiB on the server
/// for the rest of its stream's life, not 138 KiB.
pub const FRAGMENT: usize = 16 << 10;

/// The largest frame either end reads: a peer's frame header cannot make it reserve
/// more.
const MAX_FRAME: usize = 64 << 10;

/// The framing's limits: a message holds one packet, at most as large as the gRPC
/// link allows one, in frames of at most [`MAX_FRAME`]; what waits to be written is at
/// most a frame more than [`WRITE_BUFFER`].
pub fn config() -> WebSocketConfig {
    WebSocketConfig::default()
        .read_buffer_size(READ_BUFFER)
        .write_buffer_size(WRITE_BUFFER)
        .max_write_buffer_size(WRITE_BUFFER + MAX_FRAME + 64)
        .max_message_size(Some(MAX_MESSAGE))
        .max_frame_size(Some(MAX_FRAME))
}

/// `packet` as a binary message: one frame, or frames of [`FRAGMENT`] bytes when it is
/// larger (in order, the last one final).
pub fn encode(packet: &Packet) -> Vec<Message> {
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Data, OpCode};
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    let data = Bytes::from(packet.encode_to_vec());
    if data.len() <= FRAGMENT {
        return vec![Message::Binary(data)];
    }
    let n = data.len().div_ceil(FRAGMENT);
    (0..n)
        .map(|i| {
            let chunk = data.slice(i * FRAGMENT..((i + 1) * FRAGMENT).min(data.len()));
            let opcode = match i {
                0 => OpCode::Data(Data::Binary),
                _ => OpCode::Data(Data::Continue),
            };
            Message::Frame(Frame::message(chunk, opcode, i + 1 == n))
        })
        .collect()
}

/// The packet a binary message carries.
pub fn decode(data: &[u8]) -> Result<Packet, MessageError> {
    Packet::decode(data).map_err(MessageError::BadPacket)
}

/// The close frame that ends a stream with gRPC status `code` and `message`: a normal
/// close for OK, else code 4000 + the status code with the message as its reason.
pub fn close_frame(code: i32, message: &str) -> CloseFrame {
    if code == 0 {
        return CloseFrame {
            code: CloseCode::Normal,
            reason: "".into(),
        };
    }
    let status = u16::try_from(code).unwrap_or(2).min(999);
    let reason = crate::ratelimit::clipped(message, MAX_REASON);
    CloseFrame {
        code: CloseCode::from(STATUS_CLOSE_BASE + status),
        reason: reason.to_string().into(),
    }
}

/// The gRPC status a close frame says the stream ended with, if not OK: the status
/// a Tether peer put in it, `Unavailable` for a peer going away or any other code.
pub fn status_of_close(frame: Option<&CloseFrame>) -> Option<(i32, String)> {
    let frame = frame?;
    let code = u16::from(frame.code);
    match code {
        1000 => None,
        c if (STATUS_CLOSE_BASE..STATUS_CLOSE_BASE + 1000).contains(&c) => {
            Some((i32::from(c - STATUS_CLOSE_BASE), frame.reason.to_string()))
        }
        c => Some((
            14,
            format!("websocket closed with code {c}: {}", frame.reason),
        )),
    }
}

/// The HTTP status a refusal with gRPC status `code` answers the upgrade with (the
/// status itself goes along in `grpc-status`).
fn http_status(code: i32) -> u16 {
    match code {
        3 | 9 | 11 => 400,
        16 => 401,
        7 => 403,
        5 => 404,
        8 => 429,
        12 => 501,
        14 => 503,
        _ => 500,
    }
}

/// An upgrade request's head, as the server read it.
#[derive(Debug)]
pub struct Head {
    /// The request method.
    pub method: String,
    /// The request target.
    pub path: String,
    /// Its headers (the agent's metadata among them).
    pub headers: http::HeaderMap,
    /// What the client sent after the head (frames it did not wait to send).
    pub rest: Bytes,
}

/// Why a request head could not be read.
#[derive(Debug, thiserror::Error)]
pub enum HeadError {
    /// The connection failed or closed before the head was complete.
    #[error("connection ended before the request head was complete")]
    Io(#[source] io::Error),
    /// Not an HTTP/1.1 request.
    #[error("malformed request head: {0}")]
    Malformed(String),
    /// The head is longer than [`MAX_HEAD`].
    #[error("request head over {MAX_HEAD} bytes")]
    TooLarge,
}

/// Reads a request head from `io`, starting with `buf` (bytes read already): never
/// more than [`MAX_HEAD`] bytes, parsed only once its blank line has come.
pub async fn read_head<S: AsyncRead + Unpin>(
    io: &mut S,
    mut buf: BytesMut,
) -> Result<Head, HeadError> {
    let mut searched: usize = 0;
    loop {
        let from = searched.saturating_sub(3);
        if buf[from..].windows(4).any(|w| w == b"\r\n\r\n") {
            let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut req = httparse::Request::new(&mut slots);
            match req.parse(&buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let head = head_of(&req)?;
                    buf.advance(len);
                    return Ok(Head {
                        rest: buf.freeze(),
                        ..head
                    });
                }
                Ok(httparse::Status::Partial) => {}
                Err(e) => return Err(HeadError::Malformed(e.to_string())),
            }
        }
        searched = buf.len();
        if buf.len() >= MAX_HEAD {
            return Err(HeadError::TooLarge);
        }
        let mut chunk = [0u8; 4096];
        let room = chunk.len().min(MAX_HEAD - buf.len());
        let n = io.read(&mut chunk[..room]).await.map_err(HeadError::Io)?;
        if n == 0 {
            return Err(HeadError::Io(io::ErrorKind::UnexpectedEof.into()));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn head_of(req: &httparse::Request<'_, '_>) -> Result<Head, HeadError> {
    let mut headers = http::HeaderMap::new();
    for h in req.headers.iter() {
        let name = http::HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| HeadError::Malformed(format!("bad header name {:?}", h.name)))?;
        let value = http::HeaderValue::from_bytes(h.value)
            .map_err(|_| HeadError::Malformed(format!("bad value for header {name}")))?;
        headers.append(name, value);
    }
    Ok(Head {
        method: req.method.unwrap_or_default().to_string(),
        path: req.path.unwrap_or_default().to_string(),
        headers,
        rest: Bytes::new(),
    })
}

/// Whether `headers` list `token` in `name` (a comma-separated, case-insensitive list,
/// as `Connection: keep-alive, Upgrade`).
fn lists(headers: &http::HeaderMap, name: http::HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// What the `101` answer to an upgrade request needs of it.
#[derive(Debug)]
pub struct Upgrade {
    /// `Sec-WebSocket-Accept`.
    accept: String,
    /// The client asked for [`SUBPROTOCOL`].
    subprotocol: bool,
}

/// Checks that `head` asks for a WebSocket upgrade of `path`, as an agent does (no
/// `Origin`: that is a browser's); what the answer needs, or the refusal (HTTP status,
/// gRPC status code, message).
pub fn check_upgrade(head: &Head, path: &str) -> Result<Upgrade, (u16, i32, String)> {
    use http::header::{
        CONNECTION, ORIGIN, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_PROTOCOL, SEC_WEBSOCKET_VERSION,
        UPGRADE,
    };
    let h = &head.headers;
    if head.path != path {
        return Err((404, 12, format!("no such path; agents connect to {path}")));
    }
    if head.method != "GET" || !lists(h, UPGRADE, "websocket") || !lists(h, CONNECTION, "upgrade") {
        return Err((
            400,
            3,
            "the agent link over HTTP/1.1 is a WebSocket: GET with Upgrade: websocket".into(),
        ));
    }
    if h.contains_key(ORIGIN) {
        return Err((
            403,
            7,
            "requests from browsers (with Origin) are refused".into(),
        ));
    }
    if h.get(SEC_WEBSOCKET_VERSION).map(|v| v.as_bytes()) != Some(b"13") {
        return Err((426, 3, "WebSocket version 13 is required".into()));
    }
    let Some(key) = h.get(SEC_WEBSOCKET_KEY) else {
        return Err((400, 3, "no Sec-WebSocket-Key".into()));
    };
    Ok(Upgrade {
        accept: derive_accept_key(key.as_bytes()),
        subprotocol: lists(h, SEC_WEBSOCKET_PROTOCOL, SUBPROTOCOL),
    })
}

/// The `101 Switching Protocols` answer to `upgrade`, with `extra` headers (the
/// server's id and count).
pub fn accepted(upgrade: &Upgrade, extra: &http::HeaderMap) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {}\r\n",
        upgrade.accept
    );
    if upgrade.subprotocol {
        out.push_str(&format!("Sec-WebSocket-Protocol: {SUBPROTOCOL}\r\n"));
    }
    let mut out = out.into_bytes();
    append_headers(&mut out, extra);
    out.extend_from_slice(b"\r\n");
    out
}

/// A refusal of the upgrade: HTTP `status` with gRPC status `code` and `message` in
/// `grpc-status` and `grpc-message` (and the message as the body, for people), then
/// the connection closes.
pub fn refused(status: u16, code: i32, message: &str) -> Vec<u8> {
    let reason = http::StatusCode::from_u16(status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or("Error");
    let body = format!("{message}\n");
    format!(
        "HTTP/1.1 {status} {reason}\r\ngrpc-status: {code}\r\ngrpc-message: {}\r\nContent-Type: text/plain\r\nX-Content-Type-Options: nosniff\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        percent_encode(message),
        body.len()
    )
    .into_bytes()
}

/// A refusal with gRPC status `code` and `message`, at the HTTP status that code maps to.
pub fn refused_with(code: i32, message: &str) -> Vec<u8> {
    refused(http_status(code), code, message)
}

/// Appends `headers` to an HTTP/1.1 head, a line each.
pub(crate) fn append_headers(out: &mut Vec<u8>, headers: &http::HeaderMap) {
    for (name, value) in headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

/// The server's WebSocket on `io`, once the 101 is written; `rest` is what the client
/// sent after its request head.
pub async fn server<S>(io: S, rest: Bytes) -> WebSocketStream<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    WebSocketStream::from_partially_read(io, rest.to_vec(), Role::Server, Some(config())).await
}

/// Why an agent's upgrade failed.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    /// The server (or a proxy on the way) answered with something other than 101.
    #[error("HTTP status {http}{}", body.as_deref().map(|b| format!(": {b}")).unwrap_or_default())]
    Refused {
        /// The HTTP status.
        http: u16,
        /// The gRPC status a Tether server put in `grpc-status` and `grpc-message`.
        status: Option<(i32, String)>,
        /// The start of the answer's body, on one line (a proxy's page says why).
        body: Option<String>,
    },
    /// The connection failed, or the answer was not a WebSocket's.
    #[error("WebSocket handshake failed")]
    Failed(#[source] WsError),
}

/// The agent's upgrade on `io` to `authority`'s `path`, with `headers` (its metadata):
/// the WebSocket and the headers the server answered with.
pub async fn client<S>(
    io: S,
    authority: &str,
    path: &str,
    headers: http::HeaderMap,
) -> Result<(WebSocketStream<S>, http::HeaderMap), UpgradeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut request = format!("wss://{authority}{path}")
        .into_client_request()
        .map_err(UpgradeError::Failed)?;
    request.headers_mut().extend(headers);
    request.headers_mut().insert(
        http::header::SEC_WEBSOCKET_PROTOCOL,
        http::HeaderValue::from_static(SUBPROTOCOL),
    );
    match tokio_tungstenite::client_async_with_config(request, io, Some(config())).await {
        Ok((ws, response)) => Ok((ws, response.into_parts().0.headers)),
        Err(WsError::Http(response)) => Err(UpgradeError::Refused {
            http: response.status().as_u16(),
            status: status_of(response.headers()),
            body: response.body().as_deref().and_then(body_line),
        }),
        Err(e) => Err(UpgradeError::Failed(e)),
    }
}

/// What a refusal's body says, on one line: its text without markup, at most 200
/// bytes (a proxy's error page: "400 Bad Request No required SSL certificate was sent").
fn body_line(body: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(body);
    let mut out = String::new();
    let mut in_tag = false;
    for c in text.chars() {
        match c {
            '<' => in_tag = true,
            '>' => {
                in_tag = false;
                out.push(' ');
            }
            _ if in_tag => {}
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    let line = out.split_whitespace().collect::<Vec<_>>().join(" ");
    let line = crate::ratelimit::clipped(&line, 200).to_string();
    (!line.is_empty()).then_some(line)
}

/// Whether a connection's first bytes are HTTP/2's client preface (a client that
/// negotiated no protocol by ALPN, as a reverse proxy's upstream connection may not).
pub fn is_h2_preface(first: &[u8]) -> bool {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let n = first.len().min(PREFACE.len());
    n > 0 && first[..n] == PREFACE[..n]
}

/// A connection whose first bytes were read already: they are read again first.
pub struct Rewound<S> {
    first: Bytes,
    io: S,
}

impl<S> Rewound<S> {
    /// `io`, with `first` read from it before.
    pub fn new(first: Bytes, io: S) -> Self {
        Rewound { first, io }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewound<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.first.is_empty() {
            let n = self.first.len().min(buf.remaining());
            buf.put_slice(&self.first[..n]);
            self.first.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewound<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::{SinkExt, StreamExt};

    #[test]
    fn a_status_survives_the_close_frame() {
        assert_eq!(status_of_close(Some(&close_frame(0, ""))), None);
        let f = close_frame(16, "token no longer accepted");
        assert_eq!(
            status_of_close(Some(&f)),
            Some((16, "token no longer accepted".into()))
        );
        let long = "x".repeat(500);
        assert!(close_frame(13, &long).reason.len() <= MAX_REASON);
        let away = CloseFrame {
            code: CloseCode::Away,
            reason: "bye".into(),
        };
        assert_eq!(status_of_close(Some(&away)).unwrap().0, 14);
    }

    #[test]
    fn a_proxys_error_page_is_one_line() {
        let page = b"<html>\r\n<head><title>400 No required SSL certificate was sent</title></head>\r\n<body>\r\n<center><h1>400 Bad Request</h1></center>\r\n</body></html>";
        assert_eq!(
            body_line(page).as_deref(),
            Some("400 No required SSL certificate was sent 400 Bad Request")
        );
        assert_eq!(body_line(b"  \r\n"), None);
    }

    #[test]
    fn the_h2_preface_is_told_from_an_http1_request() {
        assert!(is_h2_preface(b"PRI * HTTP/2.0\r\n"));
        assert!(is_h2_preface(b"PRI"));
        assert!(!is_h2_preface(b"GET /AgentService/Connect HTTP/1.1\r\n"));
        assert!(!is_h2_preface(b""));
    }

    /// A real tungstenite client against `read_head`, `check_upgrade` and `accepted`:
    /// the metadata arrives, the answer's headers come back, and packets pass both ways.
    #[tokio::test]
    async fn an_upgrade_carries_metadata_and_packets() {
        let (a, mut b) = tokio::io::duplex(64 << 10);
        let server = tokio::spawn(async move {
            let head = read_head(&mut b, BytesMut::new()).await.unwrap();
            let upgrade = check_upgrade(&head, "/AgentService/Connect").unwrap();
            assert_eq!(head.headers["agentid"], "node-1");
            let mut extra = http::HeaderMap::new();
            extra.insert("serverid", "s1".parse().unwrap());
            tokio::io::AsyncWriteExt::write_all(&mut b, &accepted(&upgrade, &extra))
                .await
                .unwrap();
            let mut ws = server(b, head.rest).await;
            for _ in 0..2 {
                let Some(Ok(Message::Binary(m))) = ws.next().await else {
                    panic!("no packet")
                };
                let p = decode(&m).unwrap();
                for m in encode(&p) {
                    ws.send(m).await.unwrap();
                }
            }
            ws.close(Some(close_frame(0, ""))).await.unwrap();
        });
        let mut md = http::HeaderMap::new();
        md.insert("agentid", "node-1".parse().unwrap());
        let (mut ws, answer) = client(a, "server:8091", "/AgentService/Connect", md)
            .await
            .unwrap();
        assert_eq!(answer["serverid"], "s1");
        // A small packet in one frame, a large one in fragments, each back whole.
        for p in [
            Packet::data(7, Bytes::from_static(b"hello")),
            Packet::data(8, Bytes::from(vec![9u8; 100 << 10])),
        ] {
            let messages = encode(&p);
            assert_eq!(messages.len(), p.encoded_len().div_ceil(FRAGMENT));
            for m in messages {
                ws.send(m).await.unwrap();
            }
            let Some(Ok(Message::Binary(m))) = ws.next().await else {
                panic!("no echo")
            };
            assert_eq!(decode(&m).unwrap(), p);
        }
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_refusal_carries_its_grpc_status() {
        let (a, mut b) = tokio::io::duplex(64 << 10);
        tokio::spawn(async move {
            let _ = read_head(&mut b, BytesMut::new()).await.unwrap();
            let out = refused_with(16, "token: not valid");
            tokio::io::AsyncWriteExt::write_all(&mut b, &out)
                .await
                .unwrap();
        });
        let e = client(a, "s:1", "/AgentService/Connect", http::HeaderMap::new())
            .await
            .err()
            .unwrap();
        match e {
            UpgradeError::Refused { http, status, body } => {
                assert_eq!(http, 401);
                assert_eq!(status, Some((16, "token: not valid".into())));
                assert_eq!(body.as_deref(), Some("token: not valid"));
            }
            e => panic!("{e}"),
        }
    }

    /// A head that comes a byte at a time is read whole; one from a browser (with
    /// `Origin`) is refused.
    #[tokio::test]
    async fn a_trickled_head_is_read_and_a_browsers_refused() {
        let head = "GET /AgentService/Connect HTTP/1.1\r\nHost: s\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nOrigin: https://evil.example\r\n\r\nrest";
        let (mut a, mut b) = tokio::io::duplex(1);
        tokio::spawn(async move {
            for byte in head.as_bytes() {
                let _ = tokio::io::AsyncWriteExt::write_all(&mut a, &[*byte]).await;
            }
        });
        let read = read_head(&mut b, BytesMut::new()).await.unwrap();
        assert_eq!(read.path, "/AgentService/Connect");
        let (http, code, _) = check_upgrade(&read, "/AgentService/Connect").unwrap_err();
        assert_eq!((http, code), (403, 7));
    }

    #[tokio::test]
    async fn an_oversized_head_is_refused() {
        let (mut a, mut b) = tokio::io::duplex(64 << 10);
        tokio::spawn(async move {
            let big = format!("GET / HTTP/1.1\r\nx: {}\r\n", "y".repeat(MAX_HEAD));
            let _ = tokio::io::AsyncWriteExt::write_all(&mut a, big.as_bytes()).await;
        });
        let e = read_head(&mut b, BytesMut::new()).await.unwrap_err();
        assert!(matches!(e, HeadError::TooLarge), "{e}");
    }
}

//! `/ProxyService/Proxy` streams on a bare HTTP/2 connection (the h2 crate, no tonic or
//! hyper between): the gRPC message framing, HTTP/2 flow control on sends, and the
//! stream's final status. Whoever holds a stream writes and reads it in its own task,
//! so a message costs one hop (to h2's connection task) instead of three (a request
//! queue, hyper's body pipe task, then the connection task).

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::ready;
use h2::client::SendRequest;
use prost::Message;
use tether_core::transport::{self, H2_CONN_WINDOW, H2_MAX_FRAME, H2_STREAM_WINDOW};
use tether_proto::{Packet, PacketType, MAX_MESSAGE};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::UnixStream;
use tracing::Instrument;

/// The gRPC method every konnectivity client calls.
const PROXY_PATH: &str = "/ProxyService/Proxy";
/// gRPC's message prefix: a compressed flag and a big-endian length.
const PREFIX: usize = 5;
/// TCP connect plus TLS handshake plus HTTP/2 preface.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

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
    pub(crate) async fn connect(&self) -> io::Result<SendRequest<Bytes>> {
        let connect = async {
            match self {
                Target::Uds(path) => handshake(UnixStream::connect(path).await?).await,
                Target::Tls { host, tls, .. } => {
                    let name = tether_core::tls::server_name(host)
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
                    let authority = self.authority();
                    let tls = transport::connect_tls(&authority, name, tls.clone()).await?;
                    handshake(tls).await
                }
            }
        };
        tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))?
    }
}

async fn handshake<S>(io: S) -> io::Result<SendRequest<Bytes>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = h2::client::Builder::new()
        .initial_window_size(H2_STREAM_WINDOW)
        .initial_connection_window_size(H2_CONN_WINDOW)
        .max_frame_size(H2_MAX_FRAME)
        .handshake(io)
        .await
        .map_err(h2_io)?;
    tokio::spawn(
        async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "proxy connection ended");
            }
        }
        .instrument(tracing::debug_span!("proxy_connection")),
    );
    Ok(send)
}

pub(crate) fn h2_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        return e.into_io().expect("is_io");
    }
    io::Error::new(io::ErrorKind::ConnectionReset, e)
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
    Ok((Outbound(Some(stream)), response))
}

/// One packet as a gRPC message.
pub fn frame(packet: &Packet) -> Bytes {
    let len = packet.encoded_len();
    let mut buf = BytesMut::with_capacity(PREFIX + len);
    buf.put_u8(0);
    buf.put_u32(len as u32);
    packet.encode(&mut buf).expect("capacity reserved");
    buf.freeze()
}

/// A DATA packet carrying `data`, as a gRPC message, encoded straight from the slice
/// (what `frame(&Packet::data(connect_id, data))` gives, with one copy less).
pub(crate) fn frame_data(connect_id: i64, data: &[u8]) -> Bytes {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, WireType};
    let ty = PacketType::Data as i32 as u64;
    let id_len = if connect_id != 0 {
        1 + encoded_len_varint(connect_id as u64)
    } else {
        0
    };
    let data_len = if data.is_empty() {
        0
    } else {
        1 + encoded_len_varint(data.len() as u64) + data.len()
    };
    let inner = id_len + data_len;
    let len = 1 + encoded_len_varint(ty) + 1 + encoded_len_varint(inner as u64) + inner;
    let mut buf = BytesMut::with_capacity(PREFIX + len);
    buf.put_u8(0);
    buf.put_u32(len as u32);
    encode_key(1, WireType::Varint, &mut buf);
    encode_varint(ty, &mut buf);
    encode_key(4, WireType::LengthDelimited, &mut buf);
    encode_varint(inner as u64, &mut buf);
    if connect_id != 0 {
        encode_key(1, WireType::Varint, &mut buf);
        encode_varint(connect_id as u64, &mut buf);
    }
    if !data.is_empty() {
        encode_key(3, WireType::LengthDelimited, &mut buf);
        encode_varint(data.len() as u64, &mut buf);
        buf.put_slice(data);
    }
    buf.freeze()
}

/// The writing half of a Proxy stream (`None` once handed to [`Outbound::take`]).
pub(crate) struct Outbound(Option<h2::SendStream<Bytes>>);

impl Outbound {
    /// A half with no stream (writes fail as closed).
    pub(crate) fn closed() -> Outbound {
        Outbound(None)
    }

    /// Moves the stream out, leaving a closed half behind.
    pub(crate) fn take(&mut self) -> Outbound {
        Outbound(self.0.take())
    }

    /// Waits until HTTP/2 flow control has room, then queues `message()` (from
    /// [`frame`]). At most one message waits inside h2 beyond the peer's window, as
    /// with hyper.
    pub(crate) fn poll_send(
        &mut self,
        cx: &mut Context<'_>,
        message: impl FnOnce() -> Bytes,
    ) -> Poll<io::Result<()>> {
        let Some(stream) = self.0.as_mut() else {
            return Poll::Ready(Err(closed()));
        };
        stream.reserve_capacity(1);
        if stream.capacity() == 0 {
            loop {
                match ready!(stream.poll_capacity(cx)) {
                    Some(Ok(0)) => {}
                    Some(Ok(_)) => break,
                    Some(Err(e)) => return Poll::Ready(Err(h2_io(e))),
                    None => return Poll::Ready(Err(closed())),
                }
            }
        } else if let Poll::Ready(reason) = stream.poll_reset(cx) {
            return Poll::Ready(Err(match reason {
                Ok(reason) => h2_io(reason.into()),
                Err(e) => h2_io(e),
            }));
        }
        stream.send_data(message(), false).map_err(h2_io)?;
        Poll::Ready(Ok(()))
    }

    /// Sends `packet` once there is room.
    pub(crate) async fn send(&mut self, packet: &Packet) -> io::Result<()> {
        futures::future::poll_fn(|cx| self.poll_send(cx, || frame(packet))).await
    }

    /// Queues `packet` at once, without waiting for flow control (a small control
    /// packet on the way out).
    pub(crate) fn send_now(&mut self, packet: &Packet) {
        if let Some(stream) = self.0.as_mut() {
            let _ = stream.send_data(frame(packet), false);
        }
    }

    /// Ends the request stream (the client's half-close).
    pub(crate) fn finish(&mut self) {
        if let Some(mut stream) = self.0.take() {
            let _ = stream.send_data(Bytes::new(), true);
        }
    }
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "proxy stream closed")
}

/// The reading half of a Proxy stream: packets, then the stream's gRPC status.
pub(crate) struct Inbound {
    body: h2::RecvStream,
    messages: Messages,
    /// The body ended (the status is next).
    ended: bool,
}

/// Cuts gRPC messages out of DATA frames.
#[derive(Default)]
struct Messages {
    /// The rest of the last DATA frame; whole messages are sliced out of it.
    chunk: Bytes,
    /// A message that spans DATA frames, collected.
    partial: BytesMut,
}

impl Inbound {
    /// Checks the response headers: HTTP 200, and no error status in a trailers-only
    /// answer.
    pub(crate) async fn new(response: h2::client::ResponseFuture) -> Result<Self, String> {
        let response = response.await.map_err(|e| e.to_string())?;
        if response.status() != http::StatusCode::OK {
            return Err(format!("HTTP status {}", response.status()));
        }
        check_status(response.headers())?;
        let body = response.into_body();
        Ok(Inbound {
            ended: body.is_end_stream(),
            body,
            messages: Messages::default(),
        })
    }

    /// The next packet; `None` once the server ended the stream with status OK.
    pub(crate) fn poll_packet(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Packet, String>>> {
        loop {
            if let Some(message) = self.messages.next().transpose() {
                return Poll::Ready(Some(message.and_then(|m| {
                    Packet::decode(m).map_err(|e| format!("bad packet from proxy: {e}"))
                })));
            }
            if self.ended {
                if !self.messages.partial.is_empty() {
                    self.messages.partial.clear();
                    return Poll::Ready(Some(Err("proxy stream ended inside a message".into())));
                }
                let trailers = ready!(self.body.poll_trailers(cx)).map_err(|e| e.to_string());
                return Poll::Ready(match trailers {
                    Ok(Some(t)) => check_status(&t).err().map(Err),
                    Ok(None) => Some(Err("proxy stream ended without a status".into())),
                    Err(e) => Some(Err(e)),
                });
            }
            match ready!(self.body.poll_data(cx)) {
                Some(Ok(chunk)) => {
                    let _ = self.body.flow_control().release_capacity(chunk.len());
                    self.messages.chunk = chunk;
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

impl Messages {
    /// Takes one whole message out of what has arrived, without copying when it lies
    /// within one DATA frame.
    fn next(&mut self) -> Result<Option<Bytes>, String> {
        if self.partial.is_empty() {
            if self.chunk.len() >= PREFIX {
                let len = message_len(&self.chunk[..PREFIX])?;
                if self.chunk.len() >= PREFIX + len {
                    let mut message = self.chunk.split_to(PREFIX + len);
                    message.advance(PREFIX);
                    return Ok(Some(message));
                }
            }
            if self.chunk.is_empty() {
                return Ok(None);
            }
        }
        // A message split across frames: collect it.
        if self.partial.len() < PREFIX {
            let n = (PREFIX - self.partial.len()).min(self.chunk.len());
            self.partial.extend_from_slice(&self.chunk.split_to(n));
            if self.partial.len() < PREFIX {
                return Ok(None);
            }
        }
        let total = PREFIX + message_len(&self.partial[..PREFIX])?;
        self.partial.reserve(total - self.partial.len());
        let n = (total - self.partial.len()).min(self.chunk.len());
        self.partial.extend_from_slice(&self.chunk.split_to(n));
        if self.partial.len() < total {
            return Ok(None);
        }
        let mut message = self.partial.split().freeze();
        message.advance(PREFIX);
        Ok(Some(message))
    }
}

/// Fuzzing entry point: cuts `wire` into `chunk`-byte DATA frames and decodes the
/// packets in them, stopping at the first error.
#[doc(hidden)]
pub fn fuzz_messages(wire: &[u8], chunk: usize) -> Result<Vec<Packet>, String> {
    let mut m = Messages::default();
    let mut packets = Vec::new();
    for piece in wire.chunks(chunk.max(1)) {
        m.chunk = Bytes::copy_from_slice(piece);
        while let Some(message) = m.next()? {
            packets.push(Packet::decode(message).map_err(|e| e.to_string())?);
        }
    }
    Ok(packets)
}

fn message_len(prefix: &[u8]) -> Result<usize, String> {
    if prefix[0] != 0 {
        return Err("compressed message from proxy (no compression was negotiated)".into());
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(format!(
            "message of {len} bytes from proxy exceeds {MAX_MESSAGE}"
        ));
    }
    Ok(len)
}

/// `Err` with the server's message if `headers` carry a gRPC status other than OK.
fn check_status(headers: &http::HeaderMap) -> Result<(), String> {
    let Some(code) = headers.get("grpc-status") else {
        return Ok(());
    };
    if code.as_bytes() == b"0" {
        return Ok(());
    }
    let message = headers
        .get("grpc-message")
        .map(|m| percent_decode(m.as_bytes()))
        .unwrap_or_default();
    Err(format!(
        "status {}: {message}",
        String::from_utf8_lossy(code.as_bytes())
    ))
}

/// gRPC's percent-encoding of `grpc-message`.
fn percent_decode(s: &[u8]) -> String {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            s[i],
            s.get(i + 1).copied().and_then(hex),
            s.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_frames_match_prost() {
        for (id, data) in [
            (1i64, &b"hello"[..]),
            (0, &b""[..]),
            (-5, &[7u8; 300][..]),
            (i64::MAX, &[0u8; 70_000][..]),
        ] {
            let want = frame(&Packet::data(id, Bytes::copy_from_slice(data)));
            assert_eq!(
                frame_data(id, data),
                want,
                "connect_id {id}, {} bytes",
                data.len()
            );
        }
    }

    #[test]
    fn messages_are_cut_out_of_frames_of_any_size() {
        let packets: Vec<Packet> = (0..20)
            .map(|i| Packet::data(i + 1, vec![i as u8; (i as usize) * 37]))
            .collect();
        let wire: Vec<u8> = packets.iter().flat_map(|p| frame(p).to_vec()).collect();
        for size in [1, 2, 4, 5, 6, 7, 64, 1000, wire.len()] {
            let mut got = Vec::new();
            let mut m = Messages::default();
            for piece in wire.chunks(size) {
                m.chunk = Bytes::copy_from_slice(piece);
                while let Some(message) = m.next().unwrap() {
                    got.push(Packet::decode(message).unwrap());
                }
            }
            assert!(m.chunk.is_empty() && m.partial.is_empty(), "size {size}");
            assert_eq!(got, packets, "size {size}");
        }
    }

    #[test]
    fn oversized_and_compressed_messages_are_refused() {
        let mut m = Messages {
            chunk: Bytes::from_static(&[0, 0x7f, 0, 0, 0]),
            ..Default::default()
        };
        assert!(m.next().unwrap_err().contains("exceeds"));
        let mut m = Messages {
            chunk: Bytes::from_static(&[1, 0, 0, 0, 1, 0]),
            ..Default::default()
        };
        assert!(m.next().unwrap_err().contains("compressed"));
    }

    #[test]
    fn grpc_message_is_percent_decoded() {
        assert_eq!(
            percent_decode(b"no agent%3A 100%25 busy%"),
            "no agent: 100% busy%"
        );
    }
}

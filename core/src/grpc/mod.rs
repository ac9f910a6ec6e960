//! gRPC messages on bare HTTP/2 streams (the h2 crate, no tonic or hyper between), as
//! both the Rust client and the server's Proxy frontend speak them: the message framing,
//! cutting messages out of DATA frames, sends that wait for HTTP/2 flow control, and
//! `grpc-message`'s percent-encoding; `client` has the client half of a call (the
//! server half is `tether_server::h2serve`).

pub mod client;
pub mod server;

use crate::error::chain;
use std::io;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::ready;
use prost::Message;
use tether_proto::{Packet, PacketType, MAX_MESSAGE};

/// The gRPC method every konnectivity client calls.
pub const PROXY_PATH: &str = "/ProxyService/Proxy";

/// gRPC's message prefix: a compressed flag and a big-endian length.
pub const PREFIX: usize = 5;

/// An h2 error as an I/O error (the I/O error itself when there is one).
pub fn h2_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        return e.into_io().expect("is_io");
    }
    io::Error::new(io::ErrorKind::ConnectionReset, e)
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
pub fn frame_data(connect_id: i64, data: &[u8]) -> Bytes {
    let mut buf = data_head(connect_id, data.len(), data.len());
    buf.put_slice(data);
    buf.freeze()
}

/// The largest DATA payload whose message fits one HTTP/2 frame of `max_frame` bytes
/// (a message split over frames costs its receiver a copy to join it).
pub const fn one_frame_payload(max_frame: u32) -> usize {
    // Prefix, packet type, Data header, connectID and payload header: at most 26.
    max_frame as usize - 32
}

/// DATA payloads from this size on are handed to HTTP/2 as they are, not copied into
/// the message (h2 writes them from their own buffer with a vectored write).
pub const SHARE_FROM: usize = 1024;

/// `packet` as a gRPC message in one or two parts: a DATA packet of at least
/// [`SHARE_FROM`] bytes is its prefix and fields, then its payload shared, not copied;
/// anything else is [`frame`].
pub fn frame_parts(packet: &Packet) -> (Bytes, Option<Bytes>) {
    match &packet.payload {
        Some(tether_proto::packet::Payload::Data(d))
            if d.data.len() >= SHARE_FROM && d.error.is_empty() =>
        {
            let head = data_head(d.connect_id, d.data.len(), 0);
            (head.freeze(), Some(d.data.clone()))
        }
        _ => (frame(packet), None),
    }
}

/// A DATA message up to its payload: the gRPC prefix, the packet type, the Data
/// field's header, the connectID and the payload's field header (none if `len` is 0),
/// with room for `extra` more bytes.
fn data_head(connect_id: i64, len: usize, extra: usize) -> BytesMut {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, WireType};
    let ty = PacketType::Data as i32 as u64;
    let id_len = if connect_id != 0 {
        1 + encoded_len_varint(connect_id as u64)
    } else {
        0
    };
    let data_len = if len == 0 {
        0
    } else {
        1 + encoded_len_varint(len as u64) + len
    };
    let inner = id_len + data_len;
    let total = 1 + encoded_len_varint(ty) + 1 + encoded_len_varint(inner as u64) + inner;
    let mut buf = BytesMut::with_capacity(PREFIX + total - len + extra);
    buf.put_u8(0);
    buf.put_u32(total as u32);
    encode_key(1, WireType::Varint, &mut buf);
    encode_varint(ty, &mut buf);
    encode_key(4, WireType::LengthDelimited, &mut buf);
    encode_varint(inner as u64, &mut buf);
    if connect_id != 0 {
        encode_key(1, WireType::Varint, &mut buf);
        encode_varint(connect_id as u64, &mut buf);
    }
    if len != 0 {
        encode_key(3, WireType::LengthDelimited, &mut buf);
        encode_varint(len as u64, &mut buf);
    }
    buf
}

/// The writing half of a stream (`None` once handed to [`Outbound::take`]).
pub struct Outbound(Option<h2::SendStream<Bytes>>);

impl Outbound {
    /// The writing half of `stream`.
    pub fn new(stream: h2::SendStream<Bytes>) -> Outbound {
        Outbound(Some(stream))
    }

    /// A half with no stream (writes fail as closed).
    pub fn closed() -> Outbound {
        Outbound(None)
    }

    /// Moves the stream out, leaving a closed half behind.
    pub fn take(&mut self) -> Outbound {
        Outbound(self.0.take())
    }

    /// The stream, unless taken or finished.
    pub fn stream(&mut self) -> Option<&mut h2::SendStream<Bytes>> {
        self.0.as_mut()
    }

    /// Waits until HTTP/2 flow control has room, then queues `message()` (from
    /// [`frame`]). At most one message waits inside h2 beyond the peer's window, as
    /// with hyper.
    pub fn poll_send(
        &mut self,
        cx: &mut Context<'_>,
        message: impl FnOnce() -> Bytes,
    ) -> Poll<io::Result<()>> {
        self.poll_send_parts(cx, || (message(), None))
    }

    /// [`Outbound::poll_send`] for a message in two parts (from [`frame_parts`]).
    pub fn poll_send_parts(
        &mut self,
        cx: &mut Context<'_>,
        message: impl FnOnce() -> (Bytes, Option<Bytes>),
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
        let (head, tail) = message();
        stream.send_data(head, false).map_err(h2_io)?;
        if let Some(tail) = tail {
            stream.send_data(tail, false).map_err(h2_io)?;
        }
        Poll::Ready(Ok(()))
    }

    /// Sends `packet` once there is room (a large DATA payload without copying it).
    pub async fn send(&mut self, packet: &Packet) -> io::Result<()> {
        futures::future::poll_fn(|cx| self.poll_send_parts(cx, || frame_parts(packet))).await
    }

    /// Queues `packet` at once, without waiting for flow control (a small control
    /// packet on the way out).
    pub fn send_now(&mut self, packet: &Packet) {
        if let Some(stream) = self.0.as_mut() {
            let _ = stream.send_data(frame(packet), false);
        }
    }

    /// Ends the stream's body (a client's half-close).
    pub fn finish(&mut self) {
        if let Some(mut stream) = self.0.take() {
            let _ = stream.send_data(Bytes::new(), true);
        }
    }
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "stream closed")
}

/// Cuts gRPC messages out of DATA frames.
#[derive(Default)]
pub struct Messages {
    /// The rest of the last DATA frame; whole messages are sliced out of it.
    chunk: Bytes,
    /// A message that spans DATA frames, collected.
    partial: BytesMut,
}

impl Messages {
    /// Hands over the next DATA frame; call once [`Messages::next_packet`] has given
    /// `None`.
    pub fn push(&mut self, chunk: Bytes) {
        debug_assert!(self.chunk.is_empty());
        self.chunk = chunk;
    }

    /// Part of a message has arrived and the rest not yet.
    pub fn mid_message(&self) -> bool {
        !self.partial.is_empty() || !self.chunk.is_empty()
    }

    /// The next whole message, decoded as a packet. A message within one DATA frame
    /// is decoded from a slice of it; one whose start came in earlier frames is decoded
    /// from those bytes (collected) and a slice of the frame that ends it, so a payload
    /// sent as a frame of its own after its message's head (as [`frame_parts`] and
    /// every h2 sender lay them out) reaches the packet without being copied.
    pub fn next_packet(&mut self) -> Result<Option<Packet>, MessageError> {
        if self.partial.is_empty() {
            if self.chunk.len() >= PREFIX {
                let len = message_len(&self.chunk[..PREFIX])?;
                if self.chunk.len() >= PREFIX + len {
                    let mut message = self.chunk.split_to(PREFIX + len);
                    message.advance(PREFIX);
                    return decode(message).map(Some);
                }
            }
            if self.chunk.is_empty() {
                return Ok(None);
            }
        }
        // A message split across frames.
        if self.partial.len() < PREFIX {
            let n = (PREFIX - self.partial.len()).min(self.chunk.len());
            self.partial.extend_from_slice(&self.chunk.split_to(n));
            if self.partial.len() < PREFIX {
                return Ok(None);
            }
        }
        let total = PREFIX + message_len(&self.partial[..PREFIX])?;
        let missing = total - self.partial.len();
        if self.chunk.len() >= missing {
            // Take the collected start whole: a split would leave its spare capacity
            // behind, held for as long as this stream lives.
            let mut start = std::mem::take(&mut self.partial).freeze();
            start.advance(PREFIX);
            let end = self.chunk.split_to(missing);
            return decode(start.chain(end)).map(Some);
        }
        // Still incomplete: collect this frame too. Room for the whole message is made
        // once a piece of its payload arrives, not for a head on its own, which the
        // next frame usually completes.
        if self.chunk.len() >= SHARE_FROM {
            self.partial.reserve(missing);
        }
        self.partial
            .extend_from_slice(&std::mem::take(&mut self.chunk));
        Ok(None)
    }
}

/// A message's bytes as a packet (a DATA payload that lies in one piece of `message`
/// is shared, not copied).
fn decode(message: impl Buf) -> Result<Packet, MessageError> {
    Packet::decode(message).map_err(MessageError::BadPacket)
}

/// Why the messages on a stream cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum MessageError {
    /// The compressed flag is set; no compression is ever negotiated.
    #[error("compressed message (no compression was negotiated)")]
    Compressed,
    /// The length prefix is over [`MAX_MESSAGE`].
    #[error("message of {0} bytes exceeds {MAX_MESSAGE}")]
    TooLarge(usize),
    /// The message is not a packet.
    #[error("bad packet: {0}")]
    BadPacket(prost::DecodeError),
}

/// Fuzzing entry point: cuts `wire` into `chunk`-byte DATA frames and decodes the
/// packets in them, stopping at the first error.
#[doc(hidden)]
pub fn fuzz_messages(wire: &[u8], chunk: usize) -> Result<Vec<Packet>, String> {
    let mut m = Messages::default();
    let mut packets = Vec::new();
    for piece in wire.chunks(chunk.max(1)) {
        m.push(Bytes::copy_from_slice(piece));
        while let Some(packet) = m.next_packet().map_err(|e| chain(&e).to_string())? {
            packets.push(packet);
        }
    }
    Ok(packets)
}

fn message_len(prefix: &[u8]) -> Result<usize, MessageError> {
    if prefix[0] != 0 {
        return Err(MessageError::Compressed);
    }
    let len = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(MessageError::TooLarge(len));
    }
    Ok(len)
}

/// gRPC's percent-encoding of `grpc-message`: printable ASCII but `%` as is.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if (0x20..0x7f).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The gRPC status `headers` (or trailers) carry, if it is not OK: its code (an
/// unreadable code is `Unknown`, as grpc-go reads it) and its message.
pub fn status_of(headers: &http::HeaderMap) -> Option<(i32, String)> {
    let code = headers.get("grpc-status")?;
    if code.as_bytes() == b"0" {
        return None;
    }
    let message = headers
        .get("grpc-message")
        .map(|m| percent_decode(m.as_bytes()))
        .unwrap_or_default();
    let code = std::str::from_utf8(code.as_bytes())
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(2);
    Some((code, message))
}

/// The reverse of [`percent_encode`], lenient as grpc-go is with a stray `%`.
pub fn percent_decode(s: &[u8]) -> String {
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
    fn parts_join_to_the_message() {
        for len in [0, 5, SHARE_FROM - 1, SHARE_FROM, 70_000] {
            for id in [0i64, 1, -7, i64::MAX] {
                let packet = Packet::data(id, vec![9u8; len]);
                let (head, tail) = frame_parts(&packet);
                assert_eq!(tail.is_some(), len >= SHARE_FROM, "{len}");
                let mut joined = head.to_vec();
                joined.extend_from_slice(&tail.unwrap_or_default());
                assert_eq!(joined, frame(&packet).to_vec(), "len {len}, id {id}");
            }
        }
        let mut with_error = Packet::data(1, vec![0u8; SHARE_FROM]);
        if let Some(tether_proto::packet::Payload::Data(d)) = &mut with_error.payload {
            d.error = "x".into();
        }
        assert!(frame_parts(&with_error).1.is_none());
    }

    #[test]
    fn an_idle_stream_keeps_no_part_of_the_last_frame() {
        // A frame whose buffer is larger than its messages, as h2's read buffer is:
        // once its last message is cut out, nothing refers to it (a stream idles for
        // hours after its last frame).
        let mut wire = BytesMut::from(&frame(&Packet::dial_request("tcp", "10.0.0.1:22", 7))[..]);
        wire.reserve(64 << 10);
        let frame = wire.freeze();
        let mut m = Messages::default();
        m.push(frame.clone());
        assert!(m.next_packet().unwrap().is_some());
        assert!(m.next_packet().unwrap().is_none());
        assert!(frame.is_unique(), "the frame's buffer is still referenced");
    }

    #[test]
    fn the_largest_one_frame_payload_fits_the_frame() {
        for max in [16 << 10, 128 << 10] {
            let n = one_frame_payload(max);
            for id in [1, i64::MAX, i64::MIN, -1] {
                assert!(frame_data(id, &vec![0; n]).len() <= max as usize);
            }
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
                m.push(Bytes::copy_from_slice(piece));
                while let Some(packet) = m.next_packet().unwrap() {
                    got.push(packet);
                }
            }
            assert!(!m.mid_message(), "size {size}");
            assert_eq!(got, packets, "size {size}");
        }
    }

    #[test]
    fn a_payload_sent_as_its_own_frame_is_shared_not_copied() {
        let payload = Bytes::from(vec![5u8; 70_000]);
        let packet = Packet::data(42, payload.clone());
        let (head, tail) = frame_parts(&packet);
        let tail = tail.expect("a large payload goes apart");
        let mut m = Messages::default();
        // The head alone, then the payload; then the head split once more.
        m.push(head.clone());
        assert!(m.next_packet().unwrap().is_none());
        m.push(tail.clone());
        let got = m.next_packet().unwrap().expect("a whole message");
        assert_eq!(got, packet);
        let Some(tether_proto::packet::Payload::Data(d)) = &got.payload else {
            panic!("{got:?}")
        };
        assert_eq!(d.data.as_ptr(), tail.as_ptr(), "the payload was copied");
        assert!(!m.mid_message());
        m.push(head.slice(..3));
        assert!(m.next_packet().unwrap().is_none());
        m.push(head.slice(3..));
        assert!(m.next_packet().unwrap().is_none());
        m.push(tail.clone());
        assert_eq!(m.next_packet().unwrap(), Some(packet.clone()));
        // A payload split by flow control is still whole, and nothing is left over.
        m.push(head);
        assert!(m.next_packet().unwrap().is_none());
        m.push(tail.slice(..1000));
        assert!(m.next_packet().unwrap().is_none());
        m.push(tail.slice(1000..));
        assert_eq!(m.next_packet().unwrap(), Some(packet));
        assert!(!m.mid_message());
        assert_eq!(m.partial.capacity(), 0, "the collected start is handed off");
    }

    #[test]
    fn oversized_and_compressed_messages_are_refused() {
        let mut m = Messages::default();
        m.push(Bytes::from_static(&[0, 0x7f, 0, 0, 0]));
        let e = m.next_packet().unwrap_err();
        assert!(matches!(e, MessageError::TooLarge(_)), "{e}");
        assert!(e.to_string().contains("exceeds"), "{e}");
        let mut m = Messages::default();
        m.push(Bytes::from_static(&[1, 0, 0, 0, 1, 0]));
        let e = m.next_packet().unwrap_err();
        assert!(matches!(e, MessageError::Compressed), "{e}");
        assert!(e.to_string().contains("compressed"), "{e}");
    }

    #[test]
    fn grpc_message_is_percent_encoded_and_decoded() {
        assert_eq!(
            percent_decode(b"no agent%3A 100%25 busy%"),
            "no agent: 100% busy%"
        );
        let s = "dial failed: 100% \"busy\"\n\u{e9}";
        assert_eq!(percent_encode("100% ok"), "100%25 ok");
        assert_eq!(percent_decode(percent_encode(s).as_bytes()), s);
    }
}

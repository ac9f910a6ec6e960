//! Accepts the `:authority` gRPC clients send over Unix sockets. grpc-go as vendored in
//! kube-apiserver (1.20 and others) sends the socket *path* as `:authority`
//! (`/etc/kubernetes/konnectivity-server/konnectivity-server.socket`), which the h2
//! crate refuses as malformed (RST_STREAM PROTOCOL_ERROR). This shim sits under h2 on
//! Unix-socket connections and rewrites, in the client-to-server direction only, every
//! HEADERS block: it decodes it (tracking the client's HPACK state) and re-encodes it
//! statelessly (literals without indexing), replacing an unparseable `:authority` with
//! `localhost`. All other frames, and everything server-to-client, pass through as is (their
//! payloads copied once, from what was read into h2's buffer).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE_LEN: usize = 24;
const FRAME_HEADER: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Largest frame payload we emit (the HTTP/2 default every peer accepts).
const MAX_FRAME: usize = 16_384;
/// How much one socket read may take.
const READ: usize = 128 << 10;
/// Largest header list the HTTP/2 server behind the shim accepts (SETTINGS_MAX_HEADER_LIST_SIZE,
/// counted as RFC 7540 section 6.5.2 does: name + value + 32 per field).
const H2_HEADER_LIST: usize = 16 << 10;
/// Largest header list, decoded, the shim hands on: h2's own limit with room to spare,
/// so that h2 (not the shim) answers a list a little over it, as it would without the
/// shim. A block that decodes to more is a bomb (one table entry referenced by
/// thousands of one-byte indexes): the connection is closed before it is decoded
/// further.
const MAX_DECODED: usize = 4 * H2_HEADER_LIST;
/// Largest header block, encoded, we are willing to collect.
const MAX_BLOCK: usize = MAX_DECODED;
/// Most re-encoded header bytes waiting for h2 to read: past it the shim decodes no
/// further header block until h2 has taken them. One block may decode to
/// [`MAX_DECODED`]; without this bound, thousands of small blocks in one write, each
/// referencing one large table entry, would all be decoded before h2 read any.
const MAX_OUTPUT: usize = MAX_DECODED;
/// The dynamic table size the HTTP/2 server behind the shim advertises (h2 sends no
/// SETTINGS_HEADER_TABLE_SIZE, so the protocol's default holds): a client's table size
/// update above it is a protocol error.
const TABLE_SIZE: usize = 4096;

enum State {
    Preface(usize),
    FrameHeader,
    /// Copying `n` more payload bytes of a frame we do not touch.
    PassThrough(usize),
}

struct Pending {
    stream_id: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
}

impl Pending {
    /// A header block opened by a HEADERS frame: its padding and priority taken off.
    fn open(stream_id: u32, flags: u8, mut payload: BytesMut) -> io::Result<Self> {
        let pad = if flags & FLAG_PADDED != 0 {
            if payload.is_empty() {
                return Err(protocol("bad padding"));
            }
            let p = usize::from(payload[0]);
            payload.advance(1);
            p
        } else {
            0
        };
        let priority = if flags & FLAG_PRIORITY != 0 {
            if payload.len() < 5 {
                return Err(protocol("bad priority"));
            }
            let mut p = [0u8; 5];
            p.copy_from_slice(&payload[..5]);
            payload.advance(5);
            Some(p)
        } else {
            None
        };
        if pad > payload.len() {
            return Err(protocol("bad padding"));
        }
        payload.truncate(payload.len() - pad);
        Ok(Pending {
            stream_id,
            flags,
            priority,
            block: payload.to_vec(),
        })
    }
}

/// An I/O object whose inbound HTTP/2 header blocks get a parseable `:authority`.
pub struct AuthorityFix<S> {
    inner: S,
    state: State,
    input: BytesMut,
    output: BytesMut,
    pending: Option<Pending>,
    decoder: super::hpack::Decoder,
    eof: bool,
}

impl<S> AuthorityFix<S> {
    /// Wraps a server-side connection.
    pub fn new(inner: S) -> Self {
        let decoder = super::hpack::Decoder::new(TABLE_SIZE);
        AuthorityFix {
            inner,
            state: State::Preface(PREFACE_LEN),
            input: BytesMut::new(),
            output: BytesMut::new(),
            pending: None,
            decoder,
            eof: false,
        }
    }

    /// Up to `max` bytes of the frame payload being passed through, taken off `input`
    /// without a copy; `None` when no such bytes are at hand.
    fn pass_through(&mut self, max: usize) -> Option<BytesMut> {
        let State::PassThrough(left) = self.state else {
            return None;
        };
        let n = left.min(self.input.len()).min(max);
        if n == 0 {
            return None;
        }
        self.state = State::PassThrough(left - n);
        Some(self.input.split_to(n))
    }

    /// Moves what can be handled of `input` into `output`, up to a frame payload to
    /// pass through (which [`AuthorityFix::pass_through`] hands out).
    fn process(&mut self) -> io::Result<()> {
        loop {
            match self.state {
                State::Preface(left) => {
                    let n = left.min(self.input.len());
                    self.output.extend_from_slice(&self.input.split_to(n));
                    if left > n {
                        self.state = State::Preface(left - n);
                        return Ok(());
                    }
                    self.state = State::FrameHeader;
                }
                State::PassThrough(0) => self.state = State::FrameHeader,
                // Handed to the reader as they are, by `pass_through`.
                State::PassThrough(_) => return Ok(()),
                State::FrameHeader => {
                    if self.input.len() < FRAME_HEADER {
                        return Ok(());
                    }
                    let h = &self.input[..FRAME_HEADER];
                    let len =
                        (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
                    let ty = h[3];
                    let flags = h[4];
                    let stream_id = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
                    if (ty == TYPE_HEADERS || ty == TYPE_CONTINUATION)
                        && self.output.len() > MAX_OUTPUT
                    {
                        // h2 reads what is decoded first (poll_read hands it out).
                        return Ok(());
                    }
                    if ty != TYPE_HEADERS && ty != TYPE_CONTINUATION {
                        if self.pending.is_some() {
                            return Err(protocol("frame inside a header block"));
                        }
                        self.output
                            .extend_from_slice(&self.input.split_to(FRAME_HEADER));
                        self.state = State::PassThrough(len);
                        continue;
                    }
                    if self.input.len() < FRAME_HEADER + len {
                        if len > MAX_BLOCK {
                            return Err(protocol("header frame too large"));
                        }
                        return Ok(());
                    }
                    self.input.advance(FRAME_HEADER);
                    let payload = self.input.split_to(len);
                    self.header_frame(ty, flags, stream_id, payload)?;
                }
            }
        }
    }

    /// A HEADERS or CONTINUATION frame: collected into the pending block, which is
    /// re-encoded once it ends.
    fn header_frame(
        &mut self,
        ty: u8,
        flags: u8,
        stream_id: u32,
        payload: BytesMut,
    ) -> io::Result<()> {
        if ty == TYPE_HEADERS {
            if self.pending.is_some() {
                return Err(protocol("HEADERS inside a header block"));
            }
            self.pending = Some(Pending::open(stream_id, flags, payload)?);
        } else {
            let pending = self
                .pending
                .as_mut()
                .filter(|p| p.stream_id == stream_id)
                .ok_or_else(|| protocol("unexpected CONTINUATION"))?;
            pending.block.extend_from_slice(&payload);
            pending.flags |= flags & FLAG_END_HEADERS;
            if pending.block.len() > MAX_BLOCK {
                return Err(protocol("header block too large"));
            }
        }
        if self
            .pending
            .as_ref()
            .is_some_and(|p| p.flags & FLAG_END_HEADERS != 0)
        {
            let p = self.pending.take().expect("checked");
            self.emit(p)?;
        }
        Ok(())
    }

    fn emit(&mut self, p: Pending) -> io::Result<()> {
        let mut block = Vec::with_capacity(p.block.len() + 64);
        let mut listed = 0usize;
        self.decoder
            .decode(&p.block, |name, value| {
                listed += name.len() + value.len() + 32;
                if listed > MAX_DECODED {
                    return false;
                }
                let value: &[u8] =
                    if name == b":authority" && http::uri::Authority::try_from(value).is_err() {
                        b"localhost"
                    } else {
                        value
                    };
                super::hpack::encode_literal(&mut block, name, value);
                true
            })
            .map_err(|e| protocol(&format!("HPACK: {e}")))?;
        if listed > MAX_DECODED {
            return Err(protocol(&format!(
                "a header block that decodes to more than {MAX_DECODED} bytes"
            )));
        }
        let mut first = true;
        let mut rest = &block[..];
        loop {
            let prio_len = if first && p.priority.is_some() { 5 } else { 0 };
            let take = rest.len().min(MAX_FRAME - prio_len);
            let (chunk, tail) = rest.split_at(take);
            let mut flags = if tail.is_empty() { FLAG_END_HEADERS } else { 0 };
            let ty = if first {
                TYPE_HEADERS
            } else {
                TYPE_CONTINUATION
            };
            if first {
                flags |= p.flags & FLAG_END_STREAM;
                if p.priority.is_some() {
                    flags |= FLAG_PRIORITY;
                }
            }
            let len = chunk.len() + prio_len;
            self.output.put_u8((len >> 16) as u8);
            self.output.put_u16(len as u16);
            self.output.put_u8(ty);
            self.output.put_u8(flags);
            self.output.put_u32(p.stream_id);
            if let (true, Some(prio)) = (first, p.priority) {
                self.output.extend_from_slice(&prio);
            }
            self.output.extend_from_slice(chunk);
            first = false;
            rest = tail;
            if rest.is_empty() {
                return Ok(());
            }
        }
    }
}

/// Fuzzing entry point: feeds `input` through the rewriter in `chunk`-byte pieces, as
/// reads would deliver it; what it would pass on to the HTTP/2 server, or why it gave up.
#[doc(hidden)]
pub fn fuzz(input: &[u8], chunk: usize) -> io::Result<Vec<u8>> {
    let mut fix = AuthorityFix::new(());
    let mut out = Vec::new();
    for piece in input.chunks(chunk.max(1)) {
        fix.input.extend_from_slice(piece);
        loop {
            fix.process()?;
            out.extend_from_slice(&fix.output.split());
            match fix.pass_through(usize::MAX) {
                Some(bytes) => out.extend_from_slice(&bytes),
                None => break,
            }
        }
    }
    Ok(out)
}

fn protocol(msg: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("HTTP/2 from client: {msg}"),
    )
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            this.process()?;
            if !this.output.is_empty() {
                let n = this.output.len().min(buf.remaining());
                buf.put_slice(&this.output.split_to(n));
                return Poll::Ready(Ok(()));
            }
            // DATA payloads go from what was read straight to h2: one copy, not two.
            if let Some(bytes) = this.pass_through(buf.remaining()) {
                buf.put_slice(&bytes);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            this.input.reserve(READ);
            match tokio_util::io::poll_read_buf(Pin::new(&mut this.inner), cx, &mut this.input) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(0)) => this.eof = true,
                Poll::Ready(Ok(_)) => {}
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S> tonic::transport::server::Connected for AuthorityFix<S>
where
    S: tonic::transport::server::Connected,
{
    type ConnectInfo = S::ConnectInfo;
    fn connect_info(&self) -> S::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn frame(ty: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![
            (payload.len() >> 16) as u8,
            (payload.len() >> 8) as u8,
            payload.len() as u8,
            ty,
            flags,
        ];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    #[tokio::test]
    async fn rewrites_socket_path_authority_and_passes_other_frames() {
        // What grpc-go sends: the socket path as :authority, with HPACK indexing.
        let mut enc = loona_hpack::Encoder::new();
        let h1: Vec<(&[u8], &[u8])> = vec![
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/ProxyService/Proxy"),
            (
                b":authority",
                b"/etc/kubernetes/konnectivity-server/konnectivity-server.socket",
            ),
            (b"content-type", b"application/grpc"),
        ];
        let block1 = enc.encode(h1.iter().copied());
        let block2 = enc.encode(h1.iter().copied()); // second stream: indexed references
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
                                             // First block split across HEADERS + CONTINUATION.
        let (a, b) = block1.split_at(block1.len() / 2);
        input.extend(frame(TYPE_HEADERS, 0, 1, a));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, b));
        input.extend(frame(0x0, 0, 1, b"grpc payload"));
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 3, &block2));

        let (mut client, server) = tokio::io::duplex(1 << 16);
        client.write_all(&input).await.unwrap();
        client.shutdown().await.unwrap();
        let mut fixed = AuthorityFix::new(server);
        let mut out = Vec::new();
        fixed.read_to_end(&mut out).await.unwrap();

        assert_eq!(&out[..24], b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        let mut rest = &out[24..];
        let mut dec = loona_hpack::Decoder::new();
        let mut seen = Vec::new();
        while !rest.is_empty() {
            let len =
                (usize::from(rest[0]) << 16) | (usize::from(rest[1]) << 8) | usize::from(rest[2]);
            let (ty, flags) = (rest[3], rest[4]);
            let payload = &rest[9..9 + len];
            if ty == TYPE_HEADERS {
                assert_ne!(flags & FLAG_END_HEADERS, 0);
                let headers = dec.decode(payload).unwrap();
                let authority = headers.iter().find(|(n, _)| n == b":authority").unwrap();
                assert_eq!(authority.1, b"localhost");
                assert_eq!(headers.len(), 5);
            }
            seen.push((ty, payload.to_vec()));
            rest = &rest[9 + len..];
        }
        let types: Vec<u8> = seen.iter().map(|(t, _)| *t).collect();
        assert_eq!(types, vec![0x4, TYPE_HEADERS, 0x0, TYPE_HEADERS]);
        assert_eq!(seen[2].1, b"grpc payload");
    }

    /// Feeds `blocks` (each one HEADERS frame) through the shim after the preface.
    fn through_shim(blocks: &[Vec<u8>]) -> io::Result<Vec<u8>> {
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        for (i, b) in blocks.iter().enumerate() {
            input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1 + 2 * i as u32, b));
        }
        fuzz(&input, 4096)
    }

    #[test]
    fn many_small_bombs_in_one_write_wait_for_h2_to_read() {
        // One 4,000-byte literal in the table, then thousands of blocks of 15 one-byte
        // references: each under the per-block limit, 2,700 times its size decoded.
        let mut first = vec![0x40, 0x01, b'x', 0x7f, 0xa1, 0x1e];
        first.extend(std::iter::repeat_n(b'v', 4000));
        let mut input = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 1, &first));
        for i in 0..500u32 {
            input.extend(frame(
                TYPE_HEADERS,
                FLAG_END_HEADERS,
                3 + 2 * i,
                &[0xbe; 15],
            ));
        }
        let mut fix = AuthorityFix::new(());
        fix.input.extend_from_slice(&input);
        fix.process().unwrap();
        assert!(
            fix.output.len() <= MAX_OUTPUT + MAX_DECODED + 1024,
            "{} bytes decoded before h2 read any",
            fix.output.len()
        );
        // As h2 reads, the rest is decoded, a bounded amount at a time.
        let mut total = 0;
        loop {
            total += fix.output.split().len();
            fix.process().unwrap();
            if fix.output.is_empty() {
                break;
            }
            assert!(fix.output.len() <= MAX_OUTPUT + MAX_DECODED + 1024);
        }
        assert!(total > 500 * 15 * 4000, "everything was decoded in the end");
    }

    #[test]
    fn a_header_bomb_is_refused_before_it_is_decoded() {
        // One 4,000-byte literal put in the dynamic table, then one-byte references to
        // it: 20 KB on the wire would decode to 80 MB.
        let mut bomb = vec![0x40, 0x01, b'x', 0x7f];
        let mut n = 4000 - 127;
        loop {
            if n < 128 {
                bomb.push(n as u8);
                break;
            }
            bomb.push((n % 128) as u8 | 0x80);
            n /= 128;
        }
        bomb.extend(std::iter::repeat_n(b'v', 4000));
        bomb.extend(std::iter::repeat_n(0xbe, 20_000)); // index 62: that entry
        let refused = through_shim(&[bomb]).unwrap_err();
        assert!(
            refused.to_string().contains("decodes to more than"),
            "{refused}"
        );
        // The table may not grow past what the server advertised.
        let refused = through_shim(&[vec![0x3f, 0xe1, 0xff, 0x03]]).unwrap_err();
        assert!(refused.to_string().contains("table size"), "{refused}");
        // A header list a little over h2's own limit is handed on (h2 answers it).
        let big = loona_hpack::Encoder::new().encode([(&b"x-big"[..], &[b'a'; 20_000][..])]);
        assert!(through_shim(&[big]).is_ok());
    }
}

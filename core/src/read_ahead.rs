//! A read-ahead buffer under TLS: one large socket read serves the many small reads
//! the TLS library makes, and nothing is held while the socket is idle.
//!
//! rustls reads at most 4 KiB per call into its record buffer, so a 16 KiB record took
//! four `recvmsg` calls and a 1 GiB transfer a quarter of a million: on the agent link
//! the system-call overhead cost more CPU than the AES. Under [`ReadAhead`] one call
//! takes up to [`READ_AHEAD`] bytes and rustls copies its 4 KiB pieces out of memory.
//! The buffer is released whenever the socket has nothing more to give, so ten
//! thousand idle agent streams hold no read buffer at all.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, ReadBuf};

/// How much one socket read may take.
pub const READ_AHEAD: usize = 128 << 10;

/// `IO` with reads taken [`READ_AHEAD`] bytes at a time; writes pass straight through.
#[derive(Debug)]
pub struct ReadAhead<IO> {
    io: IO,
    /// Read from the socket, not yet handed out; empty (no allocation) when idle.
    buf: BytesMut,
}

impl<IO> ReadAhead<IO> {
    /// Wraps `io`.
    pub fn new(io: IO) -> Self {
        ReadAhead {
            io,
            buf: BytesMut::new(),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for ReadAhead<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if out.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if this.buf.is_empty() {
            if out.remaining() >= READ_AHEAD {
                // The caller's buffer is as large as ours: no point copying through it.
                return Pin::new(&mut this.io).poll_read(cx, out);
            }
            this.buf.reserve(READ_AHEAD);
            match tokio_util::io::poll_read_buf(Pin::new(&mut this.io), cx, &mut this.buf) {
                Poll::Ready(Ok(n)) if n > 0 => {}
                other => {
                    // Idle, closed or failed: give the memory back.
                    this.buf = BytesMut::new();
                    return other.map_ok(|_| ());
                }
            }
        }
        let n = this.buf.len().min(out.remaining());
        out.put_slice(&this.buf[..n]);
        this.buf.advance(n);
        Poll::Ready(Ok(()))
    }
}

crate::write_through!(ReadAhead, io);

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn small_reads_are_served_from_one_large_read_and_idle_holds_nothing() {
        let (a, mut b) = tokio::io::duplex(1 << 20);
        let mut r = ReadAhead::new(a);
        let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        b.write_all(&data).await.unwrap();
        let mut got = Vec::new();
        let mut piece = [0u8; 4096];
        let n = r.read(&mut piece).await.unwrap();
        got.extend_from_slice(&piece[..n]);
        // One read took a whole read-ahead's worth off the stream.
        assert!(r.buf.len() >= READ_AHEAD - 4096, "{}", r.buf.len());
        while got.len() < data.len() {
            let n = r.read(&mut piece).await.unwrap();
            got.extend_from_slice(&piece[..n]);
        }
        assert_eq!(got, data);
        // Nothing left to read: the buffer is released.
        let pending = futures::poll!(std::pin::pin!(r.read(&mut piece)));
        assert!(pending.is_pending());
        assert_eq!(r.buf.capacity(), 0);
        // Writes pass through, EOF reads as EOF.
        r.write_all(b"pong").await.unwrap();
        let mut pong = [0u8; 4];
        b.read_exact(&mut pong).await.unwrap();
        assert_eq!(&pong, b"pong");
        drop(b);
        assert_eq!(r.read(&mut piece).await.unwrap(), 0);
    }

    #[tokio::test]
    async fn a_large_read_bypasses_the_buffer() {
        let (a, mut b) = tokio::io::duplex(1 << 20);
        let mut r = ReadAhead::new(a);
        b.write_all(&[7u8; 1000]).await.unwrap();
        let mut big = vec![0u8; READ_AHEAD];
        assert_eq!(r.read(&mut big).await.unwrap(), 1000);
        assert_eq!(r.buf.capacity(), 0);
    }
}

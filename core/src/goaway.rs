//! Watching the HTTP/2 frames a server sends for its GOAWAY error code.
//!
//! A grpc-go server (upstream's proxy-server) that finds a client pinging more often
//! than its policy allows sends GOAWAY with ENHANCE_YOUR_CALM and closes the
//! connection at once. h2 then fails the open streams with the connection's I/O error,
//! and tonic drops the connection's own error, so the reason never reaches the agent.
//! [`GoAwayWatch`] follows the frame boundaries of the decrypted byte stream (a length
//! sum per read, no copies) and records the error code of the last GOAWAY, so the
//! agent can back off its pings as grpc-go clients do.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

/// HTTP/2 frame type of GOAWAY.
const GOAWAY: u8 = 0x7;

/// The last GOAWAY error code a connection received, shared with whoever asks why it
/// ended.
#[derive(Debug, Clone)]
pub struct GoAwaySeen(Arc<AtomicU32>);

/// Stored while no GOAWAY has arrived (no HTTP/2 error code is this large).
const NONE: u32 = u32::MAX;

impl Default for GoAwaySeen {
    fn default() -> Self {
        Self::new()
    }
}

impl GoAwaySeen {
    /// Nothing seen yet.
    pub fn new() -> Self {
        GoAwaySeen(Arc::new(AtomicU32::new(NONE)))
    }

    /// The error code of the last GOAWAY received, if any.
    pub fn reason(&self) -> Option<h2::Reason> {
        match self.0.load(Ordering::Relaxed) {
            NONE => None,
            code => Some(code.into()),
        }
    }

    /// True when the last GOAWAY said ENHANCE_YOUR_CALM (grpc-go: `too_many_pings`).
    pub fn told_to_calm_down(&self) -> bool {
        self.reason() == Some(h2::Reason::ENHANCE_YOUR_CALM)
    }
}

/// Where the scanner stands in the frame stream.
#[derive(Debug, Clone, Copy)]
enum Scan {
    /// Reading a 9-byte frame header; `have` bytes of it are in `head`.
    Head { have: usize },
    /// Skipping `left` payload bytes of a frame other than GOAWAY.
    Skip { left: usize },
    /// In a GOAWAY payload: `have` of its first 8 bytes (last stream id, error code) are
    /// in `head`, `left` payload bytes remain.
    GoAway { have: usize, left: usize },
}

/// Follows HTTP/2 frame boundaries in the bytes a peer sends.
#[derive(Debug)]
struct FrameScan {
    state: Scan,
    head: [u8; 9],
}

impl Default for FrameScan {
    fn default() -> Self {
        FrameScan {
            state: Scan::Head { have: 0 },
            head: [0; 9],
        }
    }
}

impl FrameScan {
    /// Consumes `data`; returns the error code of the last GOAWAY it completed.
    fn feed(&mut self, mut data: &[u8]) -> Option<u32> {
        let mut found = None;
        while !data.is_empty() {
            match self.state {
                Scan::Head { have } => {
                    let k = (9 - have).min(data.len());
                    self.head[have..have + k].copy_from_slice(&data[..k]);
                    data = &data[k..];
                    self.state = if have + k < 9 {
                        Scan::Head { have: have + k }
                    } else {
                        let h = &self.head;
                        let left =
                            usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
                        if h[3] == GOAWAY {
                            Scan::GoAway { have: 0, left }
                        } else {
                            Scan::Skip { left }
                        }
                    };
                }
                Scan::Skip { left } => {
                    let k = left.min(data.len());
                    data = &data[k..];
                    self.state = Scan::Skip { left: left - k };
                }
                Scan::GoAway { have, left } => {
                    let k = (8 - have).min(left).min(data.len());
                    self.head[have..have + k].copy_from_slice(&data[..k]);
                    data = &data[k..];
                    let (have, left) = (have + k, left - k);
                    if have == 8 {
                        found = Some(u32::from_be_bytes(self.head[4..8].try_into().unwrap()));
                        self.state = Scan::Skip { left };
                    } else {
                        self.state = Scan::GoAway { have, left };
                    }
                }
            }
            if let Scan::Skip { left: 0 } | Scan::GoAway { left: 0, .. } = self.state {
                self.state = Scan::Head { have: 0 };
            }
        }
        found
    }
}

/// `IO` whose incoming bytes (an HTTP/2 server's frames) are watched for GOAWAY; writes
/// pass straight through.
#[derive(Debug)]
pub struct GoAwayWatch<IO> {
    io: IO,
    scan: FrameScan,
    seen: GoAwaySeen,
}

impl<IO> GoAwayWatch<IO> {
    /// Wraps `io`, recording into `seen`.
    pub fn new(io: IO, seen: GoAwaySeen) -> Self {
        GoAwayWatch {
            io,
            scan: FrameScan::default(),
            seen,
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for GoAwayWatch<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let poll = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Some(code) = this.scan.feed(&buf.filled()[before..]) {
            this.seen.0.store(code, Ordering::Relaxed);
        }
        poll
    }
}

crate::write_through!(GoAwayWatch, io);

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(ty: u8, payload: &[u8]) -> Vec<u8> {
        let n = payload.len();
        let mut f = vec![(n >> 16) as u8, (n >> 8) as u8, n as u8, ty, 0, 0, 0, 0, 0];
        f.extend_from_slice(payload);
        f
    }

    fn goaway(code: u32, debug: &[u8]) -> Vec<u8> {
        let mut p = 5u32.to_be_bytes().to_vec();
        p.extend_from_slice(&code.to_be_bytes());
        p.extend_from_slice(debug);
        frame(GOAWAY, &p)
    }

    /// A server's byte stream: SETTINGS, a large DATA frame, a PING, then GOAWAY.
    fn stream(code: u32) -> Vec<u8> {
        let mut s = frame(0x4, &[0, 3, 0, 0, 0, 100]);
        s.extend(frame(0x0, &[7u8; 70_000]));
        // A DATA payload that looks like a GOAWAY header must not be taken for one.
        s.extend(frame(0x0, &goaway(0x2, b"decoy")));
        s.extend(frame(0x6, &[1; 8]));
        s.extend(goaway(code, b"too_many_pings"));
        s
    }

    #[test]
    fn finds_the_goaway_code_however_reads_cut_the_stream() {
        let s = stream(0xb);
        for cut in [1, 2, 5, 8, 9, 10, 17, 4096, 16_384, s.len()] {
            let mut scan = FrameScan::default();
            let mut last = None;
            for chunk in s.chunks(cut) {
                if let Some(code) = scan.feed(chunk) {
                    last = Some(code);
                }
            }
            assert_eq!(last, Some(0xb), "reads of {cut} bytes");
            assert!(matches!(scan.state, Scan::Head { have: 0 }), "{cut}");
        }
    }

    #[test]
    fn a_stream_without_goaway_reports_nothing() {
        let mut s = frame(0x4, &[]);
        s.extend(frame(0x0, &goaway(0xb, b"inside DATA")));
        s.extend(frame(0x8, &[0, 0, 1, 0]));
        let mut scan = FrameScan::default();
        assert_eq!(scan.feed(&s), None);
    }

    #[tokio::test]
    async fn the_watch_records_what_passes_through() {
        use tokio::io::AsyncReadExt;
        let (mut tx, rx) = tokio::io::duplex(1 << 20);
        let seen = GoAwaySeen::new();
        let mut watch = GoAwayWatch::new(rx, seen.clone());
        let s = stream(0xb);
        let n = s.len();
        tokio::io::AsyncWriteExt::write_all(&mut tx, &s)
            .await
            .unwrap();
        let mut got = vec![0u8; n];
        watch.read_exact(&mut got).await.unwrap();
        assert_eq!(got, s);
        assert_eq!(seen.reason(), Some(h2::Reason::ENHANCE_YOUR_CALM));
    }
}

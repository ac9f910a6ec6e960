//! The byte pump between a socket and a stream of Konnectivity packets: bytes read from
//! the socket leave as DATA packets for one connectID; DATA packets arriving are written
//! to the socket, and a CLOSE_REQ/CLOSE_RSP arriving in the same stream ends it, so data
//! queued before a close is always written first.

use bytes::BytesMut;
use futures::{FutureExt, Stream, StreamExt};
use tether_proto::{packet::Payload, Packet};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::flow::{Credit, Window};

/// How much one socket read may take, and so the largest DATA packet we send: 130,688
/// bytes, two whole TCP segments of a local hop ([`LOCAL_SEGMENTS`]), which is also
/// under what makes the packet's gRPC message fit one HTTP/2 frame of our peers'
/// [`H2_MAX_FRAME`](crate::transport::H2_MAX_FRAME), so the receiver slices it out of
/// the frame instead of joining two pieces (a whole 128 KiB payload made every message
/// span two frames: a 128 KiB copy per packet at each hop). 128 KiB took 21-29% less
/// server+agent CPU per GiB than 32 KiB, and whole segments 10-20% less again
/// (tether-bench).
pub const READ_CHUNK: usize = min(
    crate::grpc::one_frame_payload(crate::transport::H2_MAX_FRAME),
    LOCAL_SEGMENTS,
);

/// Two TCP segments of a local hop (the loopback device's 64 KiB MTU: 65,483 bytes of
/// IPv4 payload with timestamps, 65,464 over IPv6) less what TLS adds to a packet's
/// frame on the agent link (8 records, 22 bytes each) and the frame's own headers: a
/// read this size leaves as two full-sized segments, where 128 KiB left as two and a
/// third of a few hundred bytes, which cost the sender and receiver as much as a full
/// one (the agent's dial to its own node's kubelet, and any link on one machine).
pub const LOCAL_SEGMENTS: usize = 2 * 65_464 - 8 * 22 - 64;

/// `Ord::min` for constants.
const fn min(a: usize, b: usize) -> usize {
    if a < b {
        a
    } else {
        b
    }
}

/// Why a splice ended; the caller decides what to tell the peer.
#[derive(Debug)]
pub enum SpliceEnd {
    /// The local socket reached end of file.
    LocalEof,
    /// Reading or writing the local socket failed.
    LocalError(std::io::Error),
    /// The peer closed the connection (CLOSE_REQ or CLOSE_RSP arrived); its error text,
    /// if any.
    RemoteClosed(Option<String>),
    /// The inbound packet stream ended without a close: the tunnel under us is gone.
    RemoteGone,
    /// The outbound packet channel is closed: nobody will carry our DATA any more.
    SinkGone,
    /// The caller's hard stop came.
    Cancelled,
}

/// Flow control of one spliced connection (see [`crate::flow`]).
#[derive(Clone, Copy, Default)]
pub struct Flow<'a> {
    /// Credit for the DATA we send; `None` sends freely (upstream peer).
    pub send: Option<&'a Credit>,
    /// The receive window of the DATA we write: bytes written are reported to it, and
    /// credit it hands back leaves as WINDOW_UPDATE. `None` when accounted elsewhere.
    pub recv: Option<&'a Window>,
}

/// The read side of a spliced socket.
pub trait Source: Send {
    /// Reads what is available into `buf` (which has room for at least `chunk / 4`
    /// bytes once this returns data); `Ok(0)` at end of file.
    fn read_some(
        &mut self,
        buf: &mut BytesMut,
        chunk: usize,
    ) -> impl std::future::Future<Output = std::io::Result<usize>> + Send;
}

/// Any `AsyncRead`: the buffer is reserved before the read waits.
pub struct Buffered<R>(pub R);

impl<R: AsyncRead + Unpin + Send> Source for Buffered<R> {
    async fn read_some(&mut self, buf: &mut BytesMut, chunk: usize) -> std::io::Result<usize> {
        if buf.capacity() < chunk / 4 {
            buf.reserve(chunk);
        }
        self.0.read_buf(buf).await
    }
}

/// A TCP read half waits for readability with no buffer: an idle connection holds no
/// read buffer at all (thousands of idle tunnels cost kilobytes, not megabytes).
impl Source for tokio::net::tcp::OwnedReadHalf {
    async fn read_some(&mut self, buf: &mut BytesMut, chunk: usize) -> std::io::Result<usize> {
        loop {
            if buf.capacity() >= chunk / 4 {
                match self.try_read_buf(buf) {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    other => return other,
                }
            }
            // Nothing to read now: let the buffer go while we wait.
            *buf = BytesMut::new();
            self.readable().await?;
            buf.reserve(chunk);
        }
    }
}

/// Where a spliced connection's outgoing packets (DATA, WINDOW_UPDATE) go.
pub trait Sink: Sync {
    /// Sends `packet`, waiting for room; false once nobody carries packets any more.
    fn send(&self, packet: Packet) -> impl std::future::Future<Output = bool> + Send;
}

// Sinks return the channel's own send future mapped, never an `async` block or `async
// fn` around it: those keep the inner future twice in every pump's state (two sends
// per pump, about 500 bytes per tunnel, measured with 10,000 tunnels).
impl Sink for mpsc::Sender<Packet> {
    fn send(&self, packet: Packet) -> impl std::future::Future<Output = bool> + Send {
        mpsc::Sender::send(self, packet).map(|r| r.is_ok())
    }
}

/// Pumps bytes both ways between a socket (`rd`, `wr`) and the tunnel until one side
/// ends or `hard_stop`.
pub async fn splice<R, W, In, O>(
    rd: R,
    wr: W,
    inbound: In,
    out: &O,
    connect_id: i64,
    hard_stop: &CancellationToken,
    flow: Flow<'_>,
) -> SpliceEnd
where
    R: Source,
    W: AsyncWrite + Unpin,
    In: Stream<Item = Packet> + Unpin,
    O: Sink,
{
    tokio::select! {
        end = socket_to_tunnel(rd, out, connect_id, flow.send) => end,
        end = tunnel_to_socket(wr, inbound, out, connect_id, flow.recv) => end,
        _ = hard_stop.cancelled() => SpliceEnd::Cancelled,
    }
}

/// Bytes read from the socket leave as DATA (within `credit`, when the peer gives it).
async fn socket_to_tunnel<R: Source, O: Sink>(
    mut rd: R,
    out: &O,
    connect_id: i64,
    credit: Option<&Credit>,
) -> SpliceEnd {
    let mut buf = BytesMut::new();
    loop {
        if let Some(credit) = credit {
            if !credit.ready().await {
                return SpliceEnd::SinkGone;
            }
        }
        match rd.read_some(&mut buf, READ_CHUNK).await {
            Ok(0) => return SpliceEnd::LocalEof,
            Ok(n) => {
                if let Some(credit) = credit {
                    credit.spend(n);
                }
                let chunk = buf.split().freeze();
                if !out.send(Packet::data(connect_id, chunk)).await {
                    return SpliceEnd::SinkGone;
                }
            }
            Err(e) => return SpliceEnd::LocalError(e),
        }
    }
}

/// DATA arriving is written to the socket (and its credit returned through `window`);
/// a close, or the end of the packet stream, shuts the socket's write side.
async fn tunnel_to_socket<W, In, O>(
    mut wr: W,
    mut inbound: In,
    out: &O,
    connect_id: i64,
    window: Option<&Window>,
) -> SpliceEnd
where
    W: AsyncWrite + Unpin,
    In: Stream<Item = Packet> + Unpin,
    O: Sink,
{
    let end = loop {
        let Some(packet) = inbound.next().await else {
            break SpliceEnd::RemoteGone;
        };
        match packet.payload {
            Some(Payload::Data(d)) if !d.error.is_empty() => {
                break SpliceEnd::RemoteClosed(Some(d.error));
            }
            Some(Payload::Data(d)) => {
                if let Err(e) = wr.write_all(&d.data).await {
                    return SpliceEnd::LocalError(e);
                }
                if let Some(bytes) = window.and_then(|w| w.consumed(d.data.len())) {
                    if !out.send(Packet::window_update(connect_id, bytes)).await {
                        return SpliceEnd::SinkGone;
                    }
                }
            }
            Some(Payload::CloseResponse(c)) => {
                break SpliceEnd::RemoteClosed((!c.error.is_empty()).then_some(c.error));
            }
            Some(Payload::CloseRequest(_)) => break SpliceEnd::RemoteClosed(None),
            _ => {}
        }
    };
    let _ = wr.shutdown().await;
    end
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::wrappers::ReceiverStream;

    #[test]
    fn a_full_read_leaves_as_two_whole_local_segments() {
        // IPv6 loopback: 65,536 MTU less IPv6 (40), TCP (20) and timestamps (12).
        let segment = 65_536 - 72;
        for id in [1, i64::MAX, i64::MIN] {
            let message = crate::grpc::frame_data(id, &vec![0; READ_CHUNK]).len();
            assert!(message <= crate::transport::H2_MAX_FRAME as usize);
            // On the agent link: the HTTP/2 frame header, then TLS 1.3 records of at
            // most 16 KiB, each with a 5-byte header, a 16-byte tag and its type byte.
            let plain = 9 + message;
            let tls = plain + plain.div_ceil(16 << 10) * 22;
            assert!(tls <= 2 * segment, "{tls} bytes of TLS for a full read");
        }
        assert!(READ_CHUNK <= 2 * segment);
    }

    #[tokio::test]
    async fn data_then_close_is_written_in_order() {
        let (local, mut remote) = tokio::io::duplex(1 << 16);
        let (in_tx, in_rx) = mpsc::channel(8);
        let (out_tx, mut out_rx) = mpsc::channel(8);
        let hard_stop = CancellationToken::new();
        let task = tokio::spawn(async move {
            let (r, w) = tokio::io::split(local);
            splice(
                Buffered(r),
                w,
                ReceiverStream::new(in_rx),
                &out_tx,
                7,
                &hard_stop,
                Flow::default(),
            )
            .await
        });
        in_tx.send(Packet::data(7, &b"hello "[..])).await.unwrap();
        in_tx.send(Packet::data(7, &b"world"[..])).await.unwrap();
        in_tx.send(Packet::close_response(7, "")).await.unwrap();
        let mut got = Vec::new();
        remote.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"hello world");
        assert!(matches!(task.await.unwrap(), SpliceEnd::RemoteClosed(None)));
        // Nothing was read locally, so no DATA left.
        assert!(out_rx.try_recv().is_err());
    }

    #[tokio::test]
    async fn local_bytes_become_data_and_eof_ends() {
        // A real TCP pair: the read side waits for readiness without a buffer.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut remote = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (local, _) = listener.accept().await.unwrap();
        let (_in_tx, in_rx) = mpsc::channel::<Packet>(8);
        let (out_tx, mut out_rx) = mpsc::channel(8);
        let hard_stop = CancellationToken::new();
        let task = tokio::spawn(async move {
            let (r, w) = local.into_split();
            splice(
                r,
                w,
                ReceiverStream::new(in_rx),
                &out_tx,
                9,
                &hard_stop,
                Flow::default(),
            )
            .await
        });
        remote.write_all(b"abc").await.unwrap();
        remote.shutdown().await.unwrap();
        let p = out_rx.recv().await.unwrap();
        match p.payload {
            Some(Payload::Data(d)) => {
                assert_eq!(d.connect_id, 9);
                assert_eq!(&d.data[..], b"abc");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(task.await.unwrap(), SpliceEnd::LocalEof));
    }
}

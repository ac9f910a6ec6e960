//! The target every route leads to: a loopback server answering one-letter commands
//! (download, upload, stall, echo).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bytes the backend has written to 'S' (stalled-reader) connections.
pub(crate) static STALLED_WRITTEN: AtomicU64 = AtomicU64::new(0);

/// 'D' n: sends n bytes; 'U' n: reads n bytes, answers one byte; 'S': sends until the
/// connection closes, counting into `STALLED_WRITTEN`; 'E': echoes.
pub(crate) async fn backend() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let _ = s.set_nodelay(true);
            tokio::spawn(serve(s));
        }
    });
    addr
}

/// One connection: its first byte says what to do.
async fn serve(mut s: TcpStream) {
    let mut cmd = [0u8; 1];
    if s.read_exact(&mut cmd).await.is_err() {
        return;
    }
    match cmd[0] {
        b'S' => stall(&mut s).await,
        b'D' | b'U' => transfer(&mut s, cmd[0] == b'D').await,
        _ => {
            let (mut r, mut w) = s.split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
        }
    }
}

/// Sends until the connection closes (the reader has stopped reading).
async fn stall(s: &mut TcpStream) {
    let buf = vec![0x53u8; 64 * 1024];
    while let Ok(n) = s.write(&buf).await {
        if n == 0 {
            break;
        }
        STALLED_WRITTEN.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Reads the byte count, then sends (`download`) or reads that many bytes; after an
/// upload answers one byte. Then waits for the caller to close.
async fn transfer(s: &mut TcpStream, download: bool) {
    let Ok(n) = s.read_u64().await else { return };
    let mut buf = vec![0x42u8; 256 * 1024];
    let mut left = n;
    while left > 0 {
        let k = left.min(buf.len() as u64) as usize;
        let r = if download {
            s.write_all(&buf[..k]).await.map(|_| k)
        } else {
            s.read(&mut buf[..k]).await
        };
        match r {
            Ok(0) | Err(_) => return,
            Ok(got) => left -= got as u64,
        }
    }
    if !download {
        let _ = s.write_all(b"k").await;
    }
    let _ = s.flush().await;
    let mut rest = [0u8; 1];
    let _ = s.read(&mut rest).await;
}

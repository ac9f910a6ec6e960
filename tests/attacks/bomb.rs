//! Item 1: an HPACK bomb through the Unix socket. One literal put in the decoder's
//! table, then tens of thousands of one-byte references to it, would decode to hundreds
//! of megabytes; the socket's `:authority` shim stops at four times h2's own header-list
//! limit and closes that one connection.

use std::io::{Read, Write};
use std::time::Duration;

use tether_client::Client;
use tether_testkit::process::socket_path;
use tether_testkit::rogue::ping;
use tether_testkit::{backend, AgentProc, Pki};

use super::{bin, peak_rss, readme_server};

/// An HTTP/2 frame.
fn frame(ty: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len();
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, ty, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// A header block that decodes to `refs` copies of one 4,000-byte field: the literal
/// (incremental indexing, new name `x`), then `refs` one-byte indexes of it.
fn bomb(refs: usize) -> Vec<u8> {
    let mut block = vec![0x40, 0x01, b'x', 0x7f];
    let mut n = 4000 - 127;
    while n >= 128 {
        block.push((n % 128) as u8 | 0x80);
        n /= 128;
    }
    block.push(n as u8);
    block.extend(std::iter::repeat_n(b'v', 4000));
    block.extend(std::iter::repeat_n(0xbe, refs));
    block
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_bomb_costs_the_server_nothing_and_it_serves_on() {
    let pki = Pki::new();
    let server = readme_server(&pki, &[]);
    let _agent = AgentProc::start(bin(), &pki, server.agent, &[]);
    server.wait_agents(1).await;
    let echo = backend::echo().await;
    let before = peak_rss(server.proc.pid());

    // 81 KB on the wire (what aborted the server with a 1.3 GB allocation), sent as
    // HEADERS plus CONTINUATION frames of 16 KiB, as a client must.
    let block = bomb(77_000);
    let mut wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    wire.extend(frame(0x4, 0, 0, &[]));
    let chunks: Vec<&[u8]> = block.chunks(16_384).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        let (ty, flags) = match (i, i + 1 == chunks.len()) {
            (0, true) => (0x1, 0x4),
            (0, false) => (0x1, 0x0),
            (_, true) => (0x9, 0x4),
            (_, false) => (0x9, 0x0),
        };
        wire.extend(frame(ty, flags, 1, chunk));
    }
    let socket = socket_path(pki.dir());
    let closed = tokio::task::spawn_blocking(move || {
        let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        // The server may close before it has read all of it.
        let _ = s.write_all(&wire);
        let mut sink = Vec::new();
        s.read_to_end(&mut sink).is_ok()
    })
    .await
    .unwrap();
    assert!(closed, "the bomb's connection is closed, not left hanging");

    // The same table entry, then 5,000 small blocks of 15 references in one write: each
    // under the per-block limit, 270 MB decoded in all. The shim decodes the next block
    // only once h2 has read the last.
    let mut wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    wire.extend(frame(0x4, 0, 0, &[]));
    wire.extend(frame(0x1, 0x4, 1, &bomb(0)));
    for i in 0..5000u32 {
        wire.extend(frame(0x1, 0x4, 3 + 2 * i, &[0xbe; 15]));
    }
    let socket = socket_path(pki.dir());
    tokio::task::spawn_blocking(move || {
        let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
        // Whatever h2 makes of 5,000 streams, the memory is what counts.
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _ = s.write_all(&wire);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink);
    })
    .await
    .unwrap();

    let after = peak_rss(server.proc.pid());
    assert!(
        after < before + (32 << 20),
        "peak RSS went from {before} to {after} bytes"
    );
    // Every agent stays connected, and the frontend serves the next client.
    server.wait_agents(1).await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    assert_eq!(ping(&client, &echo.addr.to_string()).await, b"ping");
}

//! In-process tests of the client against a scripted Proxy server: bare HTTP/2 on a
//! Unix socket in a fresh directory, answering each stream as its script says.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Buf, Bytes, BytesMut};
use prost::Message;
use tether_proto::packet::Payload;
use tether_proto::Packet;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;

use super::*;

/// How the fake proxy answers a stream.
#[derive(Clone, Copy)]
enum Script {
    /// DIAL_RSP (connectID 7), DATA echoed, CLOSE_REQ answered with CLOSE_RSP.
    Echo,
    /// DIAL_RSP carrying this error.
    DialError(&'static str),
    /// A trailers-only answer with this gRPC status and (encoded) message.
    Status(&'static str, &'static str),
    /// DIAL_RSP, then at once CLOSE_RSP: the agent's target closed.
    CloseAfterDial,
}

const CONNECT_ID: i64 = 7;

/// The packets a fake proxy received, and a wake-up for each.
#[derive(Clone, Default)]
struct Received {
    packets: Arc<Mutex<Vec<Packet>>>,
    arrived: Arc<tokio::sync::Notify>,
}

/// A scripted proxy server; what its streams received, in order.
struct FakeProxy {
    path: PathBuf,
    received: Received,
    task: tokio::task::JoinHandle<()>,
}

impl FakeProxy {
    fn start(dir: &Path, script: Script) -> FakeProxy {
        let path = dir.join("proxy.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let received = Received::default();
        let seen = received.clone();
        // Aborting the task drops the sets: every connection and stream ends with it.
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((sock, _)) = listener.accept().await {
                let seen = seen.clone();
                connections.spawn(async move {
                    let mut streams = tokio::task::JoinSet::new();
                    let mut conn = h2::server::handshake(sock).await.unwrap();
                    while let Some(Ok((request, respond))) = conn.accept().await {
                        streams.spawn(answer(request, respond, script, seen.clone()));
                    }
                });
            }
        });
        FakeProxy {
            path,
            received,
            task,
        }
    }

    fn received(&self) -> Vec<Packet> {
        self.received.packets.lock().unwrap().clone()
    }
}

impl Drop for FakeProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn answer(
    request: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    script: Script,
    seen: Received,
) {
    assert_eq!(request.uri().path(), "/ProxyService/Proxy");
    let mut body = request.into_body();
    let ok = http::Response::builder()
        .header("content-type", "application/grpc")
        .body(())
        .unwrap();
    if let Script::Status(code, message) = script {
        let trailers_only = http::Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", code)
            .header("grpc-message", message)
            .body(())
            .unwrap();
        respond.send_response(trailers_only, true).unwrap();
        return;
    }
    let mut out = respond.send_response(ok, false).unwrap();
    let send = |out: &mut h2::SendStream<Bytes>, p: Packet| {
        out.send_data(grpc::frame(&p), false).unwrap();
    };
    let mut buf = BytesMut::new();
    while let Some(Ok(chunk)) = body.data().await {
        let _ = body.flow_control().release_capacity(chunk.len());
        buf.extend_from_slice(&chunk);
        while buf.len() >= 5 {
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            if buf.len() < 5 + len {
                break;
            }
            buf.advance(5);
            let packet = Packet::decode(buf.split_to(len).freeze()).unwrap();
            seen.packets.lock().unwrap().push(packet.clone());
            seen.arrived.notify_waiters();
            match (packet.payload, script) {
                (Some(Payload::DialRequest(d)), Script::DialError(e)) => {
                    send(&mut out, Packet::dial_response(d.random, 0, e));
                }
                (Some(Payload::DialRequest(d)), _) => {
                    send(&mut out, Packet::dial_response(d.random, CONNECT_ID, ""));
                    if let Script::CloseAfterDial = script {
                        send(&mut out, Packet::close_response(CONNECT_ID, ""));
                    }
                }
                (Some(Payload::Data(d)), Script::Echo) => {
                    send(&mut out, Packet::data(d.connect_id, d.data));
                }
                (Some(Payload::CloseRequest(c)), _) => {
                    send(&mut out, Packet::close_response(c.connect_id, ""));
                }
                _ => {}
            }
        }
    }
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let _ = out.send_trailers(trailers);
}

/// A fresh directory for one test's socket, removed when dropped.
struct Dir(PathBuf);

impl Dir {
    fn new() -> Dir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("tether-client-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits (5 s at most) until the proxy has received a packet matching `want`.
async fn wait_received(proxy: &FakeProxy, want: impl Fn(&Packet) -> bool) {
    tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            let arrived = proxy.received.arrived.notified();
            if proxy.received().iter().any(&want) {
                return;
            }
            arrived.await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("not received; got {:?}", proxy.received()));
}

#[tokio::test]
async fn dial_carries_bytes_both_ways_and_shutdown_closes_on_the_agent() {
    let dir = Dir::new();
    let proxy = FakeProxy::start(&dir.0, Script::Echo);
    let client = Client::uds(&proxy.path).await.unwrap();
    let mut conn = client.dial("10.0.0.1:10250").await.unwrap();
    assert_eq!(conn.connect_id(), CONNECT_ID);
    conn.write_all(b"hello").await.unwrap();
    let mut got = [0u8; 5];
    conn.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"hello");
    conn.shutdown().await.unwrap();
    // Reads end at the proxy's CLOSE_RSP; writes fail from the shutdown on.
    assert_eq!(conn.read(&mut got).await.unwrap(), 0);
    assert!(conn.write_all(b"x").await.is_err());
    let packets = proxy.received();
    match &packets[0].payload {
        Some(Payload::DialRequest(d)) => {
            assert_eq!(
                (d.protocol.as_str(), d.address.as_str()),
                ("tcp", "10.0.0.1:10250")
            )
        }
        other => panic!("first packet {other:?}"),
    }
    assert!(packets.iter().any(|p| matches!(
        &p.payload,
        Some(Payload::CloseRequest(c)) if c.connect_id == CONNECT_ID
    )));
}

#[tokio::test]
async fn a_dial_error_goes_to_that_caller_only() {
    let dir = Dir::new();
    let proxy = FakeProxy::start(&dir.0, Script::DialError("dial tcp 10.0.0.9:1: refused"));
    let client = Client::uds(&proxy.path).await.unwrap();
    for _ in 0..2 {
        match client.dial("10.0.0.9:1").await {
            Err(ClientError::Dial { address, error }) => {
                assert_eq!(address, "10.0.0.9:1");
                assert_eq!(error, "dial tcp 10.0.0.9:1: refused");
            }
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("dial succeeded"),
        }
    }
}

#[tokio::test]
async fn a_grpc_error_status_fails_the_dial_with_its_message() {
    let dir = Dir::new();
    let proxy = FakeProxy::start(&dir.0, Script::Status("14", "no agent%3A node-1"));
    let client = Client::uds(&proxy.path).await.unwrap();
    let err = client.dial("node-1:10250").await.err().expect("refused");
    assert!(
        matches!(&err, ClientError::Stream(m) if m.to_string() == "status 14: no agent: node-1"),
        "{err}"
    );
}

#[tokio::test]
async fn a_close_from_the_proxy_ends_reads_and_fails_writes() {
    let dir = Dir::new();
    let proxy = FakeProxy::start(&dir.0, Script::CloseAfterDial);
    let client = Client::uds(&proxy.path).await.unwrap();
    let mut conn = client.dial("10.0.0.1:80").await.unwrap();
    let mut buf = [0u8; 8];
    assert_eq!(conn.read(&mut buf).await.unwrap(), 0);
    let err = conn.write_all(b"late").await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
}

#[tokio::test]
async fn dropping_a_connection_closes_it_on_the_agent() {
    let dir = Dir::new();
    let proxy = FakeProxy::start(&dir.0, Script::Echo);
    let client = Client::uds(&proxy.path).await.unwrap();
    drop(client.dial("10.0.0.1:80").await.unwrap());
    wait_received(
        &proxy,
        |p| matches!(&p.payload, Some(Payload::CloseRequest(c)) if c.connect_id == CONNECT_ID),
    )
    .await;
}

#[tokio::test]
async fn the_connection_is_replaced_after_the_proxy_restarts() {
    let dir = Dir::new();
    let first = FakeProxy::start(&dir.0, Script::Echo);
    let client = Client::uds(&first.path).await.unwrap();
    drop(client.dial("10.0.0.1:80").await.unwrap());
    // The server goes away with its connections; a new one listens on the same path.
    drop(first);
    let second = FakeProxy::start(&dir.0, Script::Echo);
    // The first dial may find the old connection not yet seen as closed, and fail on it;
    // the next reconnects.
    let mut conn = match client.dial("10.0.0.1:80").await {
        Ok(c) => c,
        Err(ClientError::Connect(_) | ClientError::Stream(_)) => {
            client.dial("10.0.0.1:80").await.unwrap()
        }
        Err(e) => panic!("{e}"),
    };
    conn.write_all(b"again").await.unwrap();
    let mut got = [0u8; 5];
    conn.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"again");
    assert!(!second.received().is_empty());
}

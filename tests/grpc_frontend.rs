//! gRPC frontend over a Unix socket with the Rust konnectivity client: bulk transfer
//! with checksums, many concurrent connections, protocol errors that must not kill the
//! stream, dial errors that reach only their caller.

use std::path::Path;
use std::time::Duration;

use futures::future::join_all;
use tether_client::{Client, ClientError};
use tether_proto::{packet::Payload, Packet};
use tether_testkit::backend;
use tether_testkit::process::{socket_path, uds_frontend_args};
use tether_testkit::{metric, wait_until, AgentProc, Pki, ServerProc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

fn bin() -> &'static Path {
    Path::new(BIN)
}

struct Setup {
    pki: Pki,
    server: ServerProc,
    _agent: AgentProc,
}

async fn setup(extra_server: &[&str]) -> Setup {
    let pki = Pki::new();
    let mut args = uds_frontend_args(&pki, "grpc", &socket_path(pki.dir()));
    args.extend(extra_server.iter().map(|s| s.to_string()));
    let server = ServerProc::start(bin(), &args);
    let agent = AgentProc::start(bin(), &pki, server.agent, &[]);
    server.wait_agents(1).await;
    Setup {
        pki,
        server,
        _agent: agent,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_mib_each_way_with_checksums() {
    let s = setup(&[]).await;
    let bulk = backend::bulk().await;
    let client = Client::uds(socket_path(s.pki.dir())).await.unwrap();
    let conn = client.dial(&bulk.addr.to_string()).await.unwrap();
    backend::bulk_exchange(conn, 0x5eed_0001, 0x5eed_0002, 64 << 20, async {})
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_hundred_concurrent_connections() {
    let s = setup(&["--xfr-channel-size=64"]).await;
    let echo = backend::echo().await;
    let client = Client::uds(socket_path(s.pki.dir())).await.unwrap();
    let target = echo.addr.to_string();
    let conns: Vec<_> = join_all((0..500).map(|_| client.dial(&target)))
        .await
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap();
    let page = s.server.metrics().await;
    assert_eq!(
        metric(
            &page,
            "konnectivity_network_proxy_server_established_connections"
        ),
        Some(500.0)
    );
    let results = join_all(conns.into_iter().enumerate().map(|(i, mut c)| async move {
        let msg = format!("connection {i} says hello");
        c.write_all(msg.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; msg.len()];
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(buf, msg.as_bytes());
        c
    }))
    .await;
    drop(results);
    s.server
        .wait_metric(
            "konnectivity_network_proxy_server_established_connections",
            0.0,
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unknown_connect_id_gets_close_rsp_and_stream_survives() {
    let s = setup(&[]).await;
    let echo = backend::echo().await;
    let client = Client::uds(socket_path(s.pki.dir())).await.unwrap();
    let (mut tx, mut rx) = client.open_stream().await.unwrap();

    tx.send(Packet::data(424242, &b"nobody home"[..]))
        .await
        .unwrap();
    let p = rx.message().await.unwrap().unwrap();
    match p.payload {
        Some(Payload::CloseResponse(c)) => {
            assert_eq!(c.connect_id, 424242);
            assert!(c.error.contains("unknown connectID"), "{}", c.error);
        }
        other => panic!("expected CLOSE_RSP, got {other:?}"),
    }
    tx.send(Packet::close_request(777)).await.unwrap();
    let p = rx.message().await.unwrap().unwrap();
    assert!(
        matches!(p.payload, Some(Payload::CloseResponse(ref c)) if c.connect_id == 777 && !c.error.is_empty())
    );

    // The same stream still dials and carries data.
    tx.send(Packet::dial_request("tcp", &echo.addr.to_string(), 99))
        .await
        .unwrap();
    let p = rx.message().await.unwrap().unwrap();
    let connect_id = match p.payload {
        Some(Payload::DialResponse(r)) => {
            assert_eq!(r.random, 99);
            assert!(r.error.is_empty(), "{}", r.error);
            r.connect_id
        }
        other => panic!("expected DIAL_RSP, got {other:?}"),
    };
    tx.send(Packet::data(connect_id, &b"ping"[..]))
        .await
        .unwrap();
    let p = rx.message().await.unwrap().unwrap();
    match p.payload {
        Some(Payload::Data(d)) => assert_eq!(&d.data[..], b"ping"),
        other => panic!("expected DATA, got {other:?}"),
    }
    tx.send(Packet::close_request(connect_id)).await.unwrap();
    let p = rx.message().await.unwrap().unwrap();
    assert!(
        matches!(p.payload, Some(Payload::CloseResponse(ref c)) if c.connect_id == connect_id && c.error.is_empty())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dial_errors_reach_only_their_caller() {
    let s = setup(&[]).await;
    let echo = backend::echo().await;
    let client = Client::uds(socket_path(s.pki.dir())).await.unwrap();
    let mut ok = client.dial(&echo.addr.to_string()).await.unwrap();

    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let refused = closed.local_addr().unwrap().to_string();
    drop(closed);
    match client.dial(&refused).await {
        Err(ClientError::Dial { error, .. }) => assert!(error.contains("refused"), "{error}"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("dial to a closed port succeeded"),
    }
    // An address that is not host:port: the server refuses it itself (no agent is
    // asked, nothing is looked up) and says why; counted as upstream counts the agent's
    // refusal of it.
    match client.dial("not-an-address").await {
        Err(ClientError::Dial { error, .. }) => assert!(error.contains("host:port"), "{error}"),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("dial to not-an-address succeeded"),
    }

    ok.write_all(b"unaffected").await.unwrap();
    let mut buf = [0u8; 10];
    ok.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"unaffected");
    let page = s.server.metrics().await;
    assert_eq!(
        metric(
            &page,
            "konnectivity_network_proxy_server_dial_failure_count{reason=\"error_response\"}"
        ),
        Some(2.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grpc_over_mtls_tcp() {
    let pki = Pki::new();
    let server = ServerProc::start(
        bin(),
        &tether_testkit::process::tcp_frontend_args(&pki, "grpc"),
    );
    let _agent = AgentProc::start(bin(), &pki, server.agent, &[]);
    server.wait_agents(1).await;
    let echo = backend::echo().await;
    let addr: std::net::SocketAddr = server.frontend.parse().unwrap();
    let client = Client::tls("127.0.0.1", addr.port(), pki.frontend_client_tls())
        .await
        .unwrap();
    let mut c = client.dial(&echo.addr.to_string()).await.unwrap();
    c.write_all(b"over tls").await.unwrap();
    let mut buf = [0u8; 8];
    c.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"over tls");

    // A client with a certificate from another CA never gets a stream.
    let other = Pki::new();
    let foreign = tether_core::tls::client_config(
        &pki.files.ca_cert,
        Some((&other.files.frontend_cert, &other.files.frontend_key)),
        &[tether_core::tls::ALPN_H2],
    )
    .unwrap();
    let refused = match Client::tls("127.0.0.1", addr.port(), foreign).await {
        Err(_) => true,
        Ok(c) => c.dial(&echo.addr.to_string()).await.is_err(),
    };
    assert!(refused, "a foreign client certificate was accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn graceful_shutdown_lets_established_tunnels_finish() {
    let mut s = setup(&["--graceful-shutdown-timeout=20s"]).await;
    let echo = backend::echo().await;
    let socket = socket_path(s.pki.dir());
    let client = Client::uds(&socket).await.unwrap();
    let mut c = client.dial(&echo.addr.to_string()).await.unwrap();
    c.write_all(b"1").await.unwrap();
    let mut b = [0u8; 1];
    c.read_exact(&mut b).await.unwrap();

    s.server.proc.signal("TERM");
    s.server.proc.wait_event(
        "shutting down: no new frontend connections",
        Duration::from_secs(10),
        |_| true,
    );
    // New frontend connections are refused (the socket is gone)...
    let sock = socket.clone();
    wait_until("frontend socket removed", Duration::from_secs(10), || {
        let sock = sock.clone();
        async move { (!sock.exists()).then_some(()) }
    })
    .await;
    assert!(Client::uds(&socket).await.is_err());
    // ...while the established tunnel still carries bytes.
    c.write_all(b"2").await.unwrap();
    c.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"2");
    assert!(s
        .server
        .proc
        .wait_exit(Duration::from_millis(300))
        .is_none());
    // Closing it lets the server finish well before the 20s timeout.
    drop(c);
    let started = std::time::Instant::now();
    s.server
        .proc
        .wait_exit(Duration::from_secs(10))
        .expect("server exits once idle");
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// A tunnel still open when the graceful shutdown runs out is closed by the server
/// (CLOSE_RSP), not cut with the connection: its client reads a clean end of file.
/// kube-apiserver 1.20's client kept a cut tunnel open for ever (`kubectl logs -f` went
/// silent through a server upgrade instead of ending).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tunnel_left_when_the_grace_runs_out_is_closed_cleanly() {
    let mut s = setup(&["--graceful-shutdown-timeout=1s"]).await;
    let echo = backend::echo().await;
    let client = Client::uds(socket_path(s.pki.dir())).await.unwrap();
    let mut c = client.dial(&echo.addr.to_string()).await.unwrap();
    c.write_all(b"1").await.unwrap();
    let mut b = [0u8; 1];
    c.read_exact(&mut b).await.unwrap();

    s.server.proc.signal("TERM");
    let read = tokio::time::timeout(Duration::from_secs(20), c.read(&mut b)).await;
    assert!(matches!(read, Ok(Ok(0))), "{read:?}");
    let said = s.server.proc.wait_event(
        "graceful shutdown timeout reached; closing remaining tunnels",
        Duration::from_secs(10),
        |_| true,
    );
    assert_eq!(said["closed"], 1, "{said}");
    s.server
        .proc
        .wait_exit(Duration::from_secs(10))
        .expect("the server exits");
}

/// A new server started on the old one's socket path (`--delete-existing-uds-file`, as
/// kubeadm's manifest has it) takes new clients; the old one, stopping, leaves the path
/// to it and finishes its own tunnels.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_successor_on_the_socket_path_keeps_it_when_the_old_server_stops() {
    let mut s = setup(&["--graceful-shutdown-timeout=20s"]).await;
    let echo = backend::echo().await;
    let socket = socket_path(s.pki.dir());
    let mut old_tunnel = Client::uds(&socket)
        .await
        .unwrap()
        .dial(&echo.addr.to_string())
        .await
        .unwrap();

    let mut args = uds_frontend_args(&s.pki, "grpc", &socket);
    args.push("--delete-existing-uds-file".into());
    let successor = ServerProc::start(bin(), &args);
    let _agent = AgentProc::start(bin(), &s.pki, successor.agent, &[]);
    successor.wait_agents(1).await;

    s.server.proc.signal("TERM");
    s.server.proc.wait_event(
        "the Unix socket's path now belongs to another server; left in place",
        Duration::from_secs(10),
        |_| true,
    );
    assert!(
        socket.exists(),
        "the old server removed its successor's socket"
    );
    // New clients reach the successor...
    let mut c = Client::uds(&socket)
        .await
        .unwrap()
        .dial(&echo.addr.to_string())
        .await
        .unwrap();
    let mut b = [0u8; 1];
    c.write_all(b"n").await.unwrap();
    c.read_exact(&mut b).await.unwrap();
    // ...while the old server's tunnel still carries bytes until it ends.
    old_tunnel.write_all(b"o").await.unwrap();
    old_tunnel.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"o");
    drop(old_tunnel);
    s.server
        .proc
        .wait_exit(Duration::from_secs(10))
        .expect("the old server exits once idle");
    assert!(socket.exists());
    c.write_all(b"n").await.unwrap();
    c.read_exact(&mut b).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_ends_open_streams_and_the_server_exits_at_once() {
    // The default --graceful-shutdown-timeout is 0: close at once. Open Proxy streams
    // must not hold the gRPC frontend's HTTP/2 connections (and the exit) open.
    let mut s = setup(&[]).await;
    let echo = backend::echo().await;
    let client = Client::uds(socket_path(s.pki.dir())).await.unwrap();
    let conns = backend::echo_tunnels(&client, echo.addr, 20).await;
    s.server.proc.signal("TERM");
    s.server
        .proc
        .wait_event("server stopped", Duration::from_secs(10), |_| true);
    assert!(
        !s.server.proc.logged("listeners still open"),
        "the server waited for open streams: {}",
        s.server.proc.log_text()
    );
    s.server
        .proc
        .wait_exit(Duration::from_secs(10))
        .expect("server exits");
    // Every tunnel ends for its caller: end of file or an error, never a hang.
    for mut c in conns {
        let mut b = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(10), c.read(&mut b)).await;
        assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{read:?}");
    }
}

/// A raw HTTP/2 connection to the frontend's socket, for requests no konnectivity
/// client would make.
async fn raw_h2(sock: &Path) -> h2::client::SendRequest<bytes::Bytes> {
    let io = tokio::net::UnixStream::connect(sock).await.unwrap();
    let (send, conn) = h2::client::handshake(io).await.unwrap();
    tokio::spawn(conn);
    send
}

/// Sends one request with `body` and returns the stream's grpc-status and message
/// (from the trailers, or from a trailers-only answer).
async fn raw_call(
    send: &mut h2::client::SendRequest<bytes::Bytes>,
    path: &str,
    encoding: Option<&str>,
    body: &[u8],
) -> (String, String) {
    let mut request = http::Request::post(format!("http://localhost{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(e) = encoding {
        request = request.header("grpc-encoding", e);
    }
    let mut send = send.clone().ready().await.unwrap();
    let (response, mut stream) = send.send_request(request.body(()).unwrap(), false).unwrap();
    stream
        .send_data(bytes::Bytes::copy_from_slice(body), false)
        .unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    let header = |h: &http::HeaderMap, k: &str| {
        h.get(k)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default()
    };
    if response.headers().contains_key("grpc-status") {
        let h = response.headers();
        return (header(h, "grpc-status"), header(h, "grpc-message"));
    }
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        chunk.unwrap();
    }
    let t = body.trailers().await.unwrap().expect("trailers");
    (header(&t, "grpc-status"), header(&t, "grpc-message"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn protocol_violations_end_only_their_stream_with_a_status() {
    let s = setup(&[]).await;
    let echo = backend::echo().await;
    let sock = socket_path(s.pki.dir());
    let client = Client::uds(&sock).await.unwrap();
    let mut good = client.dial(&echo.addr.to_string()).await.unwrap();
    let mut raw = raw_h2(&sock).await;

    let (code, msg) = raw_call(&mut raw, "/ProxyService/Nope", None, b"").await;
    assert_eq!(code, "12", "{msg}");
    assert!(msg.contains("/ProxyService/Nope"), "{msg}");
    let (code, msg) = raw_call(&mut raw, "/ProxyService/Proxy", Some("gzip"), b"").await;
    assert_eq!(code, "12", "{msg}");
    assert!(msg.contains("gzip"), "{msg}");
    // A message flagged compressed when no compression was negotiated.
    let (code, msg) = raw_call(&mut raw, "/ProxyService/Proxy", None, &[1, 0, 0, 0, 1, 0]).await;
    assert_eq!(code, "13", "{msg}");
    assert!(msg.contains("compress"), "{msg}");
    // A message that is not a Packet.
    let (code, msg) = raw_call(
        &mut raw,
        "/ProxyService/Proxy",
        None,
        &[0, 0, 0, 0, 2, 0xff, 0xff],
    )
    .await;
    assert_eq!(code, "13", "{msg}");
    assert!(msg.contains("bad packet"), "{msg}");
    // More than MAX_MESSAGE announced.
    let (code, msg) = raw_call(&mut raw, "/ProxyService/Proxy", None, &[0, 0x7f, 0, 0, 0]).await;
    assert_eq!(code, "8", "{msg}");

    // The same connection and the tunnel beside it are unharmed.
    let (code, msg) = raw_call(&mut raw, "/ProxyService/Nope", None, b"").await;
    assert_eq!(code, "12", "{msg}");
    good.write_all(b"still here").await.unwrap();
    let mut buf = [0u8; 10];
    good.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"still here");
    let page = s.server.metrics().await;
    let errors: f64 = page
        .lines()
        .filter(|l| l.starts_with("konnectivity_network_proxy_server_stream_errors_total{"))
        .filter(|l| l.contains("from_client"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    assert_eq!(errors, 3.0, "client stream errors counted:\n{page}");
}

/// The socket is created as upstream creates it (umask 0007): mode 0770, so a
/// non-root kube-apiserver in its group can connect; `--uds-socket-mode` overrides it.
#[test]
fn the_socket_is_0770_unless_told_otherwise() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |extra: &[&str]| {
        let pki = Pki::new();
        let socket = socket_path(pki.dir());
        let mut args = uds_frontend_args(&pki, "grpc", &socket);
        args.extend(extra.iter().map(|s| s.to_string()));
        let _server = ServerProc::start(bin(), &args);
        std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777
    };
    assert_eq!(mode(&[]), 0o770);
    assert_eq!(mode(&["--uds-socket-mode=0600"]), 0o600);
}

//! HTTP-CONNECT frontend end to end: real curl through mutual TLS, error statuses,
//! wrong-CA client certificates, malformed requests.

use std::path::Path;
use std::time::Duration;

use tether_testkit::process::{socket_path, tcp_frontend_args, uds_frontend_args};
use tether_testkit::{backend, request_head, tls_connect, AgentProc, Pki, ServerProc};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

fn bin() -> &'static Path {
    Path::new(BIN)
}

async fn curl(pki: &Pki, proxy: &str, url: &str) -> std::process::Output {
    let f = &pki.files;
    tokio::process::Command::new("curl")
        .args(["-sS", "-m", "20", "-p", "-x", &format!("https://{proxy}")])
        .arg("--proxy-cacert")
        .arg(&f.ca_cert)
        .arg("--proxy-cert")
        .arg(&f.frontend_cert)
        .arg("--proxy-key")
        .arg(&f.frontend_key)
        .arg(url)
        .output()
        .await
        .expect("run curl")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn curl_through_mtls_http_connect() {
    let pki = Pki::new();
    let web = backend::http("hello through tether\n").await;
    let server = ServerProc::start(bin(), &tcp_frontend_args(&pki, "http-connect"));
    let _agent = AgentProc::start(bin(), &pki, server.agent, &[]);
    server.wait_agents(1).await;

    for _ in 0..3 {
        let out = curl(&pki, &server.frontend, &format!("http://{}/", web.addr)).await;
        assert!(
            out.status.success(),
            "curl failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "hello through tether\n"
        );
    }
    assert_eq!(web.accepted.load(std::sync::atomic::Ordering::Relaxed), 3);

    // A client certificate from another CA is refused; the frontend keeps serving.
    let other = Pki::new();
    let f = &other.files;
    let out = tokio::process::Command::new("curl")
        .args([
            "-sS",
            "-m",
            "10",
            "-p",
            "-x",
            &format!("https://{}", server.frontend),
        ])
        .arg("--proxy-cacert")
        .arg(&pki.files.ca_cert)
        .arg("--proxy-cert")
        .arg(&f.frontend_cert)
        .arg("--proxy-key")
        .arg(&f.frontend_key)
        .arg(format!("http://{}/", web.addr))
        .output()
        .await
        .unwrap();
    assert!(!out.status.success(), "foreign client cert was accepted");
    assert_eq!(web.accepted.load(std::sync::atomic::Ordering::Relaxed), 3);
    // And no client certificate at all is refused too.
    let out = tokio::process::Command::new("curl")
        .args([
            "-sS",
            "-m",
            "10",
            "-p",
            "-x",
            &format!("https://{}", server.frontend),
        ])
        .arg("--proxy-cacert")
        .arg(&pki.files.ca_cert)
        .arg(format!("http://{}/", web.addr))
        .output()
        .await
        .unwrap();
    assert!(
        !out.status.success(),
        "client without certificate was accepted"
    );

    let out = curl(&pki, &server.frontend, &format!("http://{}/", web.addr)).await;
    assert!(out.status.success());
    assert!(server.proc.logged("TLS handshake failed"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_connect_statuses() {
    let pki = Pki::new();
    let echo = backend::echo().await;
    let server = ServerProc::start(bin(), &tcp_frontend_args(&pki, "http-connect"));
    let addr: std::net::SocketAddr = server.frontend.parse().unwrap();
    let tls = pki.frontend_http_tls();

    // No agent yet: 500.
    let mut s = tls_connect(addr, tls.clone()).await.unwrap();
    let head = request_head(
        &mut s,
        format!("CONNECT {0} HTTP/1.1\r\nHost: {0}\r\n\r\n", echo.addr).as_bytes(),
    )
    .await
    .unwrap();
    assert!(head.starts_with("HTTP/1.1 500"), "{head}");

    let _agent = AgentProc::start(bin(), &pki, server.agent, &[]);
    server.wait_agents(1).await;

    // An established tunnel that must survive every bad request below.
    let mut good = tls_connect(addr, tls.clone()).await.unwrap();
    let head = request_head(
        &mut good,
        format!("CONNECT {0} HTTP/1.1\r\nHost: {0}\r\n\r\n", echo.addr).as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(head, "HTTP/1.1 200 Connection Established\r\n\r\n");

    // Other methods: 405.
    let mut s = tls_connect(addr, tls.clone()).await.unwrap();
    let head = request_head(&mut s, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    assert!(head.starts_with("HTTP/1.1 405"), "{head}");

    // Malformed request line or target: 400.
    for bad in [
        &b"CONNECT\r\n\r\n"[..],
        b"CONNECT no-port HTTP/1.1\r\n\r\n",
        b"CONNECT host:notaport HTTP/1.1\r\n\r\n",
        b"\x16\x03\x01garbage\r\n\r\n",
    ] {
        let mut s = tls_connect(addr, tls.clone()).await.unwrap();
        let head = request_head(&mut s, bad).await.unwrap();
        assert!(
            head.starts_with("HTTP/1.1 400"),
            "{:?} -> {head}",
            String::from_utf8_lossy(bad)
        );
    }

    // Unreachable target (connection refused): 502 for that caller only.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let refused = closed.local_addr().unwrap();
    drop(closed);
    let mut s = tls_connect(addr, tls.clone()).await.unwrap();
    let head = request_head(
        &mut s,
        format!("CONNECT {refused} HTTP/1.1\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    assert!(head.starts_with("HTTP/1.1 502"), "{head}");

    // The first tunnel still carries bytes both ways.
    good.write_all(b"still alive").await.unwrap();
    let mut buf = [0u8; 11];
    good.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"still alive");

    // Bytes sent right behind the CONNECT head are delivered, not lost.
    let mut s = tls_connect(addr, tls.clone()).await.unwrap();
    s.write_all(format!("CONNECT {} HTTP/1.1\r\n\r\nearly-bytes", echo.addr).as_bytes())
        .await
        .unwrap();
    let mut buf = vec![0u8; "HTTP/1.1 200 Connection Established\r\n\r\nearly-bytes".len()];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(buf.ends_with(b"early-bytes"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_connect_over_uds_and_dial_timeout() {
    let pki = Pki::new();
    let web = backend::http("via unix socket\n").await;
    let socket = socket_path(pki.dir());
    let mut args = uds_frontend_args(&pki, "http-connect", &socket);
    args.push("--backend-dial-timeout=500ms".into());
    let server = ServerProc::start(bin(), &args);
    let agent = AgentProc::start(bin(), &pki, server.agent, &["--dial-timeout=30s".into()]);
    server.wait_agents(1).await;

    let mut s = tokio::net::UnixStream::connect(&socket).await.unwrap();
    let head = request_head(
        &mut s,
        format!("CONNECT {} HTTP/1.1\r\n\r\n", web.addr).as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(head, "HTTP/1.1 200 Connection Established\r\n\r\n");
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(body.ends_with("via unix socket\n"), "{body}");

    // A target whose connect hangs: the server's --backend-dial-timeout answers 504.
    let hole = backend::Blackhole::new();
    let mut s = tokio::net::UnixStream::connect(&socket).await.unwrap();
    let started = std::time::Instant::now();
    let head = request_head(
        &mut s,
        format!("CONNECT {} HTTP/1.1\r\n\r\n", hole.addr).as_bytes(),
    )
    .await
    .unwrap();
    assert!(head.starts_with("HTTP/1.1 504"), "{head}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let page = server.metrics().await;
    assert_eq!(
        tether_testkit::metric(
            &page,
            "konnectivity_network_proxy_server_dial_failure_count{reason=\"backend_dial_timeout\"}"
        ),
        Some(1.0)
    );
    // The server sent DIAL_CLS and the agent abandoned its connect attempt.
    agent
        .proc
        .wait_event("dial cancelled by server", Duration::from_secs(5), |_| true);
}

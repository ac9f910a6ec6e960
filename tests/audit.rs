//! The audit log with real processes: a tunnel recorded at both ends (the Unix-socket
//! peer's uid and pid, the mutual-TLS client's subject, bytes each way, the dial's
//! random tying the server's record to the agent's), every refusal, rotation by size,
//! drops counted while tunnels keep going when nobody reads the log, and flags that
//! fail at start-up with one line. The kubectl paths are in `tests/apiserver.rs`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use tether_client::Client;
use tether_proto::{packet::Payload, Packet};
use tether_testkit::process::{socket_path, tcp_frontend_args, uds_frontend_args};
use tether_testkit::{
    backend, metric, request_head, tls_connect, wait_until, AgentProc, Pki, ServerProc,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_tether");
/// Generous: the suite runs on two loaded cores.
const PATIENCE: Duration = Duration::from_secs(60);

fn bin() -> &'static Path {
    Path::new(BIN)
}

/// Every line of `path` (and none when it is not there yet), each parsed.
fn records(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// Waits for a record of `path` that `pick` accepts.
async fn record_where(path: &Path, what: &str, pick: impl Fn(&Value) -> bool) -> Value {
    wait_until(what, PATIENCE, || {
        let found = records(path).into_iter().find(|r| pick(r));
        async move { found }
    })
    .await
}

/// The time field: RFC 3339 in UTC, within a minute of now.
fn check_time(r: &Value) {
    let t = r["time"].as_str().expect("time");
    let parsed = time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|e| panic!("{t}: {e}"));
    assert!(t.ends_with('Z'), "{t} is not UTC");
    let age = time::OffsetDateTime::now_utc() - parsed;
    assert!(age.whole_seconds().abs() < 120, "{t} is not now");
}

fn audit_args(path: &Path) -> Vec<String> {
    vec![format!("--audit-log-path={}", path.display())]
}

/// A server on a Unix socket with the audit on, and an agent with its own.
struct Uds {
    pki: Pki,
    server: ServerProc,
    server_log: PathBuf,
    agent_log: PathBuf,
}

fn uds_server(pki: Pki, extra: &[String]) -> Uds {
    let server_log = pki.dir().join("server-audit.log");
    let agent_log = pki.dir().join("agent-audit.log");
    let mut args = uds_frontend_args(&pki, "grpc", &socket_path(pki.dir()));
    args.extend(audit_args(&server_log));
    args.push("--server-id=audit-server".into());
    args.extend(extra.iter().cloned());
    let server = ServerProc::start(bin(), &args);
    Uds {
        pki,
        server,
        server_log,
        agent_log,
    }
}

impl Uds {
    fn agent(&self) -> AgentProc {
        let mut args = audit_args(&self.agent_log);
        args.push("--agent-id=audit-agent".into());
        AgentProc::start(bin(), &self.pki, self.server.agent, &args)
    }
}

/// One tunnel over the gRPC frontend: the server's record names the socket peer
/// (this test process: its uid and pid), the address, the strategy and agent, the dial
/// time, the bytes each way and why it ended; the agent's records name the same dial
/// (random, connectID), the address it dialled, the server stream and the same bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tunnel_is_recorded_at_both_ends() {
    let u = uds_server(Pki::new(), &[]);
    let _agent = u.agent();
    u.server.wait_agents(1).await;
    let echo = backend::echo().await;
    let target = echo.addr.to_string();

    let client = Client::uds(socket_path(u.pki.dir())).await.unwrap();
    let mut conn = client.dial(&target).await.unwrap();
    let connect_id = conn.connect_id();
    let sent = vec![7u8; 3000];
    conn.write_all(&sent).await.unwrap();
    let mut back = vec![0u8; sent.len()];
    conn.read_exact(&mut back).await.unwrap();
    assert_eq!(back, sent);
    // CLOSE_REQ from the client; the agent answers CLOSE_RSP.
    conn.shutdown().await.unwrap();
    drop(conn);

    let r = record_where(&u.server_log, "the server's tunnel record", |r| {
        r["event"] == "tunnel"
    })
    .await;
    check_time(&r);
    assert_eq!(r["reason"], "client", "{r}");
    assert_eq!(r["frontend"]["kind"], "grpc");
    assert_eq!(r["frontend"]["transport"], "uds");
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata("/proc/self").unwrap().uid();
    assert_eq!(r["frontend"]["uid"], uid);
    assert_eq!(r["frontend"]["pid"], std::process::id());
    assert_eq!(r["address"], target);
    assert_eq!(r["strategy"], "default");
    assert_eq!(r["agent"]["id"], "audit-agent");
    assert_eq!(r["agent"]["verified_by"], "certificate");
    assert_eq!(r["connect_id"], connect_id);
    assert!(r["dial_ms"].as_f64().unwrap() >= 0.0, "{r}");
    assert!(r["duration_ms"].as_f64().unwrap() > 0.0, "{r}");
    assert_eq!(r["bytes_to_agent"], 3000);
    assert_eq!(r["bytes_from_agent"], 3000);
    assert!(r.get("error").is_none(), "{r}");
    let random = r["random"].as_i64().expect("random");

    let dial = record_where(&u.agent_log, "the agent's dial record", |a| {
        a["event"] == "dial"
    })
    .await;
    check_time(&dial);
    assert_eq!(dial["outcome"], "connected", "{dial}");
    assert_eq!(dial["address"], target);
    assert_eq!(dial["dialed"], target);
    assert_eq!(dial["random"], random);
    assert_eq!(dial["connect_id"], connect_id);
    assert_eq!(dial["server_id"], "audit-server");
    assert!(dial["dial_ms"].as_f64().unwrap() >= 0.0);

    let closed = record_where(&u.agent_log, "the agent's closed record", |a| {
        a["event"] == "closed"
    })
    .await;
    check_time(&closed);
    assert_eq!(closed["outcome"], "server_closed", "{closed}");
    assert_eq!(closed["random"], random);
    assert_eq!(closed["connect_id"], connect_id);
    assert_eq!(closed["server_id"], "audit-server");
    assert_eq!(closed["dialed"], target);
    assert_eq!(closed["bytes_to_target"], 3000);
    assert_eq!(closed["bytes_from_target"], 3000);
    assert!(closed["duration_ms"].as_f64().unwrap() > 0.0);

    // Counted as written.
    u.server
        .wait_metric("tether_audit_records_total", 1.0)
        .await;
    let page = u.server.metrics().await;
    assert_eq!(
        metric(&page, "tether_audit_records_dropped_total"),
        Some(0.0)
    );
}

/// Sends a DIAL_REQ for `address` on a stream of its own and returns the DIAL_RSP's
/// error.
async fn dial_error(client: &Client, address: &str) -> String {
    let (mut tx, mut rx) = client.open_stream().await.unwrap();
    tx.send(Packet::dial_request("tcp", address, 4242))
        .await
        .unwrap();
    loop {
        match rx.message().await.unwrap().and_then(|p| p.payload) {
            Some(Payload::DialResponse(d)) => return d.error,
            Some(_) => continue,
            None => panic!("stream ended without a DIAL_RSP"),
        }
    }
}

/// Each refusal leaves one record with its reason: no agent, an address the server
/// does not route, a dial the agent could not make (with the agent's record of it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_refusal_is_recorded() {
    let u = uds_server(Pki::new(), &[]);
    let client = Client::uds(socket_path(u.pki.dir())).await.unwrap();

    // No agent yet.
    let error = dial_error(&client, "10.0.0.1:443").await;
    assert_eq!(error, "No agent available");
    let r = record_where(&u.server_log, "no_agent", |r| r["reason"] == "no_agent").await;
    check_time(&r);
    assert_eq!(r["event"], "refused");
    assert_eq!(r["address"], "10.0.0.1:443");
    assert_eq!(r["frontend"]["pid"], std::process::id());
    assert!(r["error"].as_str().unwrap().contains("no agent"), "{r}");
    assert!(r.get("agent").is_none(), "{r}");

    let _agent = u.agent();
    u.server.wait_agents(1).await;

    // An address the server will not route.
    let error = dial_error(&client, "010.0.0.1:443").await;
    assert!(!error.is_empty());
    let r = record_where(&u.server_log, "bad_address", |r| {
        r["reason"] == "bad_address"
    })
    .await;
    assert_eq!(r["event"], "refused");
    assert_eq!(r["address"], "010.0.0.1:443");
    assert_eq!(r["error"], error.as_str());

    // A port nobody listens on: the agent's dial fails.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = closed.local_addr().unwrap().to_string();
    drop(closed);
    let error = dial_error(&client, &address).await;
    assert!(error.contains("refused"), "{error}");
    let r = record_where(&u.server_log, "dial_error", |r| r["reason"] == "dial_error").await;
    assert_eq!(r["event"], "refused");
    assert_eq!(r["address"], address.as_str());
    assert_eq!(r["agent"]["id"], "audit-agent");
    assert_eq!(r["strategy"], "default");
    assert_eq!(r["random"], 4242);
    assert_eq!(r["error"], error.as_str());
    assert!(r["dial_ms"].as_f64().is_some(), "{r}");
    let a = record_where(&u.agent_log, "the agent's failed dial", |a| {
        a["outcome"] == "failed"
    })
    .await;
    assert_eq!(a["event"], "dial");
    assert_eq!(a["address"], address.as_str());
    assert_eq!(a["random"], 4242);
    assert_eq!(a["error"], error.as_str());
    assert!(a.get("dialed").is_none(), "{a}");
}

/// HTTP-CONNECT over mutual TLS: the record carries the client certificate's subject
/// and address; a certificate `--frontend-client-names` does not list is recorded as
/// `frontend_not_allowed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_tls_clients_are_named_by_their_certificate() {
    let pki = Pki::new();
    let log = pki.dir().join("audit.log");
    let mut args = tcp_frontend_args(&pki, "http-connect");
    args.extend(audit_args(&log));
    let server = ServerProc::start(bin(), &args);
    let _agent = AgentProc::start(bin(), &pki, server.agent, &["--agent-id=tls-agent".into()]);
    server.wait_agents(1).await;
    let echo = backend::echo().await;

    let addr = server.frontend.parse().unwrap();
    let mut tls = tls_connect(addr, pki.frontend_http_tls()).await.unwrap();
    let local = tls.get_ref().0.local_addr().unwrap().to_string();
    let head = request_head(
        &mut tls,
        format!("CONNECT {} HTTP/1.1\r\nHost: x\r\n\r\n", echo.addr).as_bytes(),
    )
    .await
    .unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    tls.write_all(b"ping").await.unwrap();
    let mut buf = [0u8; 4];
    tls.read_exact(&mut buf).await.unwrap();
    drop(tls);

    let r = record_where(&log, "the tunnel record", |r| r["event"] == "tunnel").await;
    check_time(&r);
    assert_eq!(r["reason"], "client", "{r}");
    assert_eq!(r["frontend"]["kind"], "http-connect");
    assert_eq!(r["frontend"]["transport"], "tcp");
    assert_eq!(r["frontend"]["remote"], local.as_str());
    assert!(
        r["frontend"]["subject"]
            .as_str()
            .unwrap()
            .contains("CN=system:kube-apiserver"),
        "{r}"
    );
    assert!(r["frontend"].get("uid").is_none(), "{r}");
    assert_eq!(r["agent"]["id"], "tls-agent");
    assert_eq!(r["bytes_to_agent"], 4);
    assert_eq!(r["bytes_from_agent"], 4);

    // A server that admits only another name.
    let log = pki.dir().join("refused.log");
    let mut args = tcp_frontend_args(&pki, "http-connect");
    args.extend(audit_args(&log));
    args.push("--frontend-client-names=someone-else".into());
    let picky = ServerProc::start(bin(), &args);
    let addr = picky.frontend.parse().unwrap();
    if let Ok(Ok(mut tls)) =
        tokio::time::timeout(PATIENCE, tls_connect(addr, pki.frontend_http_tls())).await
    {
        let _ = tls.write_all(b"CONNECT 10.0.0.1:1 HTTP/1.1\r\n\r\n").await;
        let mut rest = Vec::new();
        let _ = tls.read_to_end(&mut rest).await;
    }
    let r = record_where(&log, "frontend_not_allowed", |r| {
        r["reason"] == "frontend_not_allowed"
    })
    .await;
    assert_eq!(r["event"], "refused");
    assert!(r["frontend"]["subject"]
        .as_str()
        .unwrap()
        .contains("system:kube-apiserver"));
    assert!(r["error"]
        .as_str()
        .unwrap()
        .contains("--frontend-client-names"));
}

/// `n` refusals of long addresses, sent on one stream without waiting for each
/// answer: the cheapest way to make records.
async fn refusals(client: &Client, n: usize) {
    let address = format!("{}:1", "h".repeat(400));
    let (mut tx, mut rx) = client.open_stream().await.unwrap();
    let answers = tokio::spawn(async move {
        let mut got = 0;
        while got < n {
            match rx.message().await.unwrap().and_then(|p| p.payload) {
                Some(Payload::DialResponse(_)) => got += 1,
                Some(_) => {}
                None => panic!("stream ended after {got} answers"),
            }
        }
    });
    for i in 0..n {
        tx.send(Packet::dial_request("tcp", &address, i as i64))
            .await
            .unwrap();
    }
    tokio::time::timeout(PATIENCE, answers)
        .await
        .expect("every dial answered")
        .unwrap();
}

/// `--audit-log-maxsize=1 --audit-log-maxbackup=2`: past 1 MiB the file becomes
/// `.1`, `.1` becomes `.2`, and no more than two rotated files are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_log_rotates_by_size_and_keeps_maxbackup_files() {
    let pki = Pki::new();
    let dir = pki.dir().join("audit");
    std::fs::create_dir(&dir).unwrap();
    let log = dir.join("audit.log");
    let mut args = uds_frontend_args(&pki, "grpc", &socket_path(pki.dir()));
    args.extend(audit_args(&log));
    args.extend([
        "--audit-log-maxsize=1".into(),
        "--audit-log-maxbackup=2".into(),
    ]);
    let server = ServerProc::start(bin(), &args);
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    // Records of about 0.5 KiB: 8,000 of them make about 4 MiB, three rotations.
    let n = 8000;
    refusals(&client, n).await;
    server
        .wait_metric("tether_audit_records_total", n as f64)
        .await;
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(files, ["audit.log", "audit.log.1", "audit.log.2"]);
    for f in &files {
        let path = dir.join(f);
        let size = std::fs::metadata(&path).unwrap().len();
        assert!(size <= 1 << 20, "{f} is {size} bytes");
        let lines = records(&path);
        assert!(lines.iter().all(|r| r["reason"] == "no_agent"));
        if f != "audit.log" {
            assert!(
                size > (1 << 20) - 2048,
                "{f} was rotated early: {size} bytes"
            );
        }
    }
    // The file mode keeps the records to the server's user.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&log).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
}

/// A reader of the log that stops reading (a FIFO nobody drains): records are dropped
/// and counted, a warning says so, and tunnels keep going at full speed. A full disk
/// (`/dev/full`) drops and counts too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stuck_log_drops_records_and_never_blocks_a_tunnel() {
    let pki = Pki::new();
    let fifo = pki.dir().join("audit.fifo");
    let made = Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    // Hold the reading end open (so the server can open the writing end) and never
    // read from it.
    use std::os::unix::fs::OpenOptionsExt;
    let _reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&fifo)
        .unwrap();
    let u = {
        let mut args = uds_frontend_args(&pki, "grpc", &socket_path(pki.dir()));
        args.extend(audit_args(&fifo));
        ServerProc::start(bin(), &args)
    };
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    // The pipe holds 64 KiB and the queue 4,096 records: 6,000 records of 0.5 KiB
    // overflow both.
    refusals(&client, 6000).await;
    wait_until("records dropped", PATIENCE, || async {
        let page = u.metrics().await;
        metric(&page, "tether_audit_records_dropped_total").filter(|d| *d > 0.0)
    })
    .await;
    assert!(u.proc.logged("audit records dropped"));

    // The writer is stuck; a tunnel still carries 8 MiB both ways.
    let _agent = AgentProc::start(bin(), &pki, u.agent, &[]);
    u.wait_agents(1).await;
    let bulk = backend::bulk().await;
    let conn = client.dial(&bulk.addr.to_string()).await.unwrap();
    tokio::time::timeout(
        PATIENCE,
        backend::bulk_exchange(conn, 0xa0d1_0001, 0xa0d1_0002, 8 << 20, async {}),
    )
    .await
    .expect("the tunnel is not held up by the audit log")
    .unwrap();

    // A full disk.
    let mut args = uds_frontend_args(&pki, "grpc", &pki.dir().join("full.sock"));
    args.push("--audit-log-path=/dev/full".into());
    let full = ServerProc::start(bin(), &args);
    let client = Client::uds(pki.dir().join("full.sock")).await.unwrap();
    refusals(&client, 3).await;
    full.wait_metric("tether_audit_records_dropped_total", 3.0)
        .await;
    let page = full.metrics().await;
    assert_eq!(metric(&page, "tether_audit_records_total"), Some(0.0));
}

/// The one `error:` line `tether args` exits with.
fn start_up_error(args: &[String]) -> String {
    tether_testkit::process::start_up_error(std::path::Path::new(BIN), args)
}

/// Unusable audit flags stop the server and the agent at start-up with one line that
/// says what to give instead.
#[test]
fn bad_audit_flags_fail_at_start_up() {
    let pki = Pki::new();
    let mut server = vec!["server".to_string(), "--health-port=0".into()];
    server.extend(["--admin-port=0".into(), "--agent-port=0".into()]);
    server.extend(uds_frontend_args(&pki, "grpc", &socket_path(pki.dir())));
    let mut agent = vec!["agent".to_string(), "--health-server-port=0".into()];
    agent.push(format!("--ca-cert={}", pki.files.ca_cert.display()));
    let missing = pki.dir().join("no-such-dir/audit.log");
    for base in [&server, &agent] {
        let with = |extra: &[&str]| -> Vec<String> {
            let mut a = base.clone();
            a.extend(extra.iter().map(|s| s.to_string()));
            a
        };
        let line = start_up_error(&with(&[
            "--audit-log-path=/tmp/x.log",
            "--audit-log-maxsize=0",
        ]));
        assert!(
            line.contains("--audit-log-maxsize must be at least 1"),
            "{line}"
        );
        let line = start_up_error(&with(&[
            "--audit-log-path=/tmp/x.log",
            "--audit-log-maxbackup=0",
        ]));
        assert!(
            line.contains("--audit-log-maxbackup must be at least 1"),
            "{line}"
        );
        let line = start_up_error(&with(&["--audit-log-maxsize=ten"]));
        assert!(line.contains("--audit-log-maxsize"), "{line}");
        let line = start_up_error(&with(&["--audit-log-path=/var/log/"]));
        assert!(line.contains("names a directory"), "{line}");
        let line = start_up_error(&with(&[&format!("--audit-log-path={}", missing.display())]));
        assert!(line.contains("cannot open the audit log"), "{line}");
        assert_eq!(
            line.matches("No such file or directory").count(),
            1,
            "{line}"
        );
    }
}

/// The server's stop cuts an open tunnel: its record says `drain`, and it is written
/// before the process exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tunnel_cut_by_the_stop_is_recorded_as_drain() {
    let mut u = uds_server(Pki::new(), &[]);
    let _agent = u.agent();
    u.server.wait_agents(1).await;
    let echo = backend::echo().await;
    let client = Client::uds(socket_path(u.pki.dir())).await.unwrap();
    let mut conn = client.dial(&echo.addr.to_string()).await.unwrap();
    conn.write_all(b"hello").await.unwrap();
    let mut buf = [0u8; 5];
    conn.read_exact(&mut buf).await.unwrap();

    u.server.proc.signal("TERM");
    let status = tokio::task::block_in_place(|| u.server.proc.wait_exit(PATIENCE));
    assert!(status.is_some(), "the server did not stop");
    let r = records(&u.server_log)
        .into_iter()
        .find(|r| r["event"] == "tunnel")
        .expect("the tunnel's record is written before the server exits");
    assert_eq!(r["reason"], "drain", "{r}");
    assert_eq!(r["bytes_to_agent"], 5);
    assert_eq!(r["bytes_from_agent"], 5);
    drop(conn);
}

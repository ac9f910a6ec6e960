//! Each failure the troubleshooting guide lists names its cause exactly once: start-up
//! failures in their one `error:` line, link failures in the agent's log line. Causes
//! are printed by one formatter (`tether_core::error::chain`), and no error type both
//! embeds its cause in its message and returns it as `source()`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tether_testkit::kube::free_port;
use tether_testkit::{Pki, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

/// The one `error:` line `tether args` exits with.
fn start_up_error(args: &[String]) -> String {
    tether_testkit::process::start_up_error(std::path::Path::new(BIN), args)
}

/// Asserts `line` holds each of `parts`, and `cause` exactly once.
fn names_once(line: &str, parts: &[&str], cause: &str) {
    for part in parts {
        assert!(line.contains(part), "{part:?} not in {line}");
    }
    assert_eq!(
        line.matches(cause).count(),
        1,
        "{cause:?} not once in {line}"
    );
}

fn server_args(pki: &Pki, extra: &[String]) -> Vec<String> {
    let f = &pki.files;
    let mut args = vec![
        "server".to_string(),
        "--health-port=0".into(),
        "--admin-port=0".into(),
        "--agent-port=0".into(),
        "--server-port=0".into(),
        format!("--uds-name={}", pki.dir().join("s.sock").display()),
        format!("--cluster-cert={}", f.server_cert.display()),
        format!("--cluster-key={}", f.server_key.display()),
        format!("--cluster-ca-cert={}", f.ca_cert.display()),
    ];
    args.extend(extra.iter().cloned());
    args
}

#[test]
fn start_up_failures_name_their_cause_once() {
    let pki = Pki::new();
    let f = &pki.files;
    let missing = pki.dir().join("missing.crt");

    // A certificate file that is not there.
    let line = start_up_error(&server_args(
        &pki,
        &[format!("--cluster-cert={}", missing.display())],
    ));
    names_once(&line, &["cannot read", "missing.crt"], "No such file");

    // A key that does not belong to its certificate.
    let line = start_up_error(&server_args(
        &pki,
        &[format!("--cluster-key={}", f.agent_key.display())],
    ));
    names_once(&line, &["server.crt", "agent.key"], "KeyMismatch");

    // A port someone else holds.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let line = start_up_error(&server_args(
        &pki,
        &[
            "--agent-bind-address=127.0.0.1".into(),
            format!("--agent-port={port}"),
        ],
    ));
    names_once(&line, &["cannot listen on agent"], "in use");

    // TLS on the admin port: half a pair, then a key that is not the certificate's.
    let line = start_up_error(&server_args(
        &pki,
        &[format!("--admin-cert={}", f.server_cert.display())],
    ));
    names_once(&line, &["--admin-cert"], "needs --admin-key");
    let line = start_up_error(&server_args(
        &pki,
        &[
            format!("--admin-cert={}", f.server_cert.display()),
            format!("--admin-key={}", f.agent_key.display()),
        ],
    ));
    names_once(&line, &["server.crt", "agent.key"], "KeyMismatch");

    // A kubeconfig that is not there (token authentication needs the cluster).
    let line = start_up_error(&[
        "server".into(),
        "--health-port=0".into(),
        "--admin-port=0".into(),
        "--agent-port=0".into(),
        "--server-port=0".into(),
        format!("--uds-name={}", pki.dir().join("t.sock").display()),
        format!("--cluster-cert={}", f.server_cert.display()),
        format!("--cluster-key={}", f.server_key.display()),
        "--agent-namespace=kube-system".into(),
        "--agent-service-account=konnectivity-agent".into(),
        "--authentication-audience=system:konnectivity-server".into(),
        "--kubeconfig=/nonexistent/kubeconfig".into(),
    ]);
    names_once(&line, &["/nonexistent/kubeconfig"], "No such file");

    // The CCM's inventory: missing, then not YAML.
    let dir = TempDir::new("tether-errors");
    let ccm = |config: &std::path::Path| {
        start_up_error(&[
            "ccm".into(),
            "--kubeconfig=/nonexistent/kubeconfig".into(),
            format!("--cloud-config={}", config.display()),
            "--secure-port=0".into(),
        ])
    };
    let line = ccm(&dir.path().join("inventory.yaml"));
    names_once(&line, &["cannot read cloud config"], "No such file");
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "nodes: [\n").unwrap();
    let line = ccm(&bad);
    names_once(
        &line,
        &["not a valid tether inventory"],
        "did not find expected",
    );

    // `tether certs inspect` on a file that is not there.
    let line = start_up_error(&[
        "certs".into(),
        "inspect".into(),
        missing.display().to_string(),
    ]);
    names_once(&line, &["missing.crt"], "No such file");
}

/// The first stderr line of `tether args` that holds `needle`, within a minute.
fn log_line(args: &[String], needle: &str) -> String {
    let mut child = Command::new(BIN)
        .args(args)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    let found = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(needle) => break Some(line),
            Ok(line) => seen.push(line),
            Err(_) => break None,
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    found.unwrap_or_else(|| {
        panic!(
            "no {needle:?} line from tether {args:?}:\n{}",
            seen.join("\n")
        )
    })
}

fn agent_args(ca: &std::path::Path, port: u16) -> Vec<String> {
    vec![
        "agent".into(),
        "--proxy-server-host=127.0.0.1".into(),
        format!("--proxy-server-port={port}"),
        "--health-server-port=0".into(),
        "--admin-server-port=0".into(),
        format!("--ca-cert={}", ca.display()),
    ]
}

#[test]
fn link_failures_name_their_cause_once() {
    let pki = Pki::new();
    const DOWN: &str = "proxy server stream down; reconnecting";

    // Nothing listens where the agent dials.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let line = log_line(&agent_args(&pki.files.ca_cert, port), DOWN);
    names_once(&line, &["cannot connect to proxy server"], "refused");

    // A server whose certificate the agent's CA did not sign.
    let port = free_port();
    let mut server = Command::new(BIN)
        .args(server_args(&pki, &[format!("--agent-port={port}")]))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(server.try_wait().unwrap().is_none(), "the server exited");
        assert!(Instant::now() < deadline, "the server never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let other = Pki::new();
    let line = log_line(&agent_args(&other.files.ca_cert, port), DOWN);
    let _ = server.kill();
    let _ = server.wait();
    names_once(
        &line,
        &["cannot connect to proxy server"],
        "invalid peer certificate",
    );
}

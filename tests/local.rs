//! `tether local`, the embedded default: the curl line it prints works as printed (its
//! agent over h2, over WebSocket with `--transports=websocket`, over QUIC with
//! `--transports=quic`), and Ctrl-C stops it and removes its temporary files.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_tether");

#[test]
fn local_prints_a_working_curl_line() {
    prints_a_working_curl_line(&[]);
}

#[test]
fn local_over_websocket_prints_a_working_curl_line() {
    let log = prints_a_working_curl_line(&["--transports=websocket"]);
    assert!(
        log.lines()
            .any(|l| l.contains("connected to proxy server")
                && l.contains(r#""transport":"websocket""#)),
        "{log}"
    );
}

#[test]
fn local_over_quic_prints_a_working_curl_line() {
    let log = prints_a_working_curl_line(&["--transports=quic"]);
    assert!(
        log.lines()
            .any(|l| l.contains("connected to proxy server") && l.contains(r#""transport":"quic""#)),
        "{log}"
    );
}

/// Runs `tether local` with `extra`, uses its curl line, stops it; its log.
fn prints_a_working_curl_line(extra: &[&str]) -> String {
    let dir = tether_testkit::TempDir::new("tether-local-test");
    let log = dir.path().join("local.log");
    let mut child = Command::new(BIN)
        .args(["local", "--log-format=json"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut curl_line = None;
    let mut pki_dir = None;
    while curl_line.is_none() {
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("tether local printed no curl line");
        if let Some(rest) = line.split("throwaway PKI in ").nth(1) {
            pki_dir = Some(std::path::PathBuf::from(rest.trim()));
        }
        if line.trim_start().starts_with("curl ") {
            curl_line = Some(line.trim().to_string());
        }
    }
    let words: Vec<String> = curl_line
        .unwrap()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let out = Command::new(&words[0])
        .args(&words[1..])
        .args(["-sS", "-m", "20"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("hello from behind the tunnel"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "tether local did not stop on SIGINT"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success());
    assert!(!pki_dir.unwrap().exists(), "temporary PKI left behind");
    std::fs::read_to_string(&log).unwrap_or_default()
}

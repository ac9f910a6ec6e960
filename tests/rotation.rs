//! Certificate rotation without dropping tunnels: the CA bundle and the leaf
//! certificates of server and agent are replaced under live traffic; new handshakes use
//! the new material, the established tunnel never notices. Expiry is visible.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tether_client::Client;
use tether_testkit::{
    backend, metric, replace_file, tls_connect, wait_until, AgentProc, Pki, ServerProc, TempDir,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

fn bin() -> &'static Path {
    Path::new(BIN)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rotating_ca_bundle_and_leaves_under_live_traffic_loses_nothing() {
    let (old, new) = (Pki::new(), Pki::new());
    let live = TempDir::new("tether-live-certs");
    let l = |n: &str| live.path().join(n);
    replace_file(&old.files.server_cert, &l("server.crt"));
    replace_file(&old.files.server_key, &l("server.key"));
    replace_file(&old.files.agent_cert, &l("agent.crt"));
    replace_file(&old.files.agent_key, &l("agent.key"));
    replace_file(&old.files.ca_cert, &l("ca-bundle.crt"));
    let socket = l("s.sock");
    let server = ServerProc::start(
        bin(),
        &[
            format!("--uds-name={}", socket.display()),
            "--server-port=0".into(),
            format!("--cluster-cert={}", l("server.crt").display()),
            format!("--cluster-key={}", l("server.key").display()),
            format!("--cluster-ca-cert={}", l("ca-bundle.crt").display()),
            "--cert-reload-interval=100ms".into(),
        ],
    );
    let agent = AgentProc::start(
        bin(),
        &old,
        server.agent,
        &[
            format!("--ca-cert={}", l("ca-bundle.crt").display()),
            format!("--agent-cert={}", l("agent.crt").display()),
            format!("--agent-key={}", l("agent.key").display()),
            "--cert-reload-interval=100ms".into(),
        ],
    );
    server.wait_agents(1).await;

    // Live traffic on one tunnel for the whole rotation.
    let echo = backend::echo().await;
    let client = Client::uds(&socket).await.unwrap();
    let mut conn = client.dial(&echo.addr.to_string()).await.unwrap();
    let rounds = Arc::new(AtomicU64::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let traffic = {
        let (rounds, stop) = (rounds.clone(), stop.clone());
        tokio::spawn(async move {
            let msg = vec![0x5au8; 1024];
            let mut buf = vec![0u8; 1024];
            while !stop.is_cancelled() {
                conn.write_all(&msg)
                    .await
                    .expect("tunnel write failed during rotation");
                conn.read_exact(&mut buf)
                    .await
                    .expect("tunnel read failed during rotation");
                assert_eq!(buf, msg);
                rounds.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let moving = |rounds: Arc<AtomicU64>| async move {
        let start = rounds.load(Ordering::Relaxed);
        wait_until("traffic to flow", Duration::from_secs(10), || {
            let r = rounds.clone();
            async move { (r.load(Ordering::Relaxed) > start + 50).then_some(()) }
        })
        .await;
    };
    moving(rounds.clone()).await;

    // 1. Both CAs in the bundle, on both sides.
    let bundle = format!(
        "{}{}",
        std::fs::read_to_string(&old.files.ca_cert).unwrap(),
        std::fs::read_to_string(&new.files.ca_cert).unwrap()
    );
    let tmp = live.path().join("bundle.new");
    std::fs::write(&tmp, bundle).unwrap();
    replace_file(&tmp, &l("ca-bundle.crt"));
    let (s, a) = (&server, &agent);
    wait_until(
        "both sides reload the bundle",
        Duration::from_secs(10),
        || async move {
            (s.proc
                .count_events("reloaded TLS material; new handshakes use it")
                >= 1
                && a.proc
                    .count_events("reloaded TLS material; new handshakes use it")
                    >= 1)
                .then_some(())
        },
    )
    .await;
    moving(rounds.clone()).await;

    // 2. New leaves signed by the new CA.
    replace_file(&new.files.server_cert, &l("server.crt"));
    replace_file(&new.files.server_key, &l("server.key"));
    replace_file(&new.files.agent_cert, &l("agent.crt"));
    replace_file(&new.files.agent_key, &l("agent.key"));

    // New handshakes present the new server certificate: a client that trusts only the
    // new CA gets in, one that trusts only the old CA does not.
    let agent_port = server.agent;
    let new_only = tether_core::tls::client_config(
        &new.files.ca_cert,
        Some((&new.files.agent_cert, &new.files.agent_key)),
        &[tether_core::tls::ALPN_H2],
    )
    .unwrap();
    wait_until(
        "server presents the new certificate",
        Duration::from_secs(10),
        || {
            let tls = new_only.clone();
            async move { tls_connect(agent_port, tls).await.ok().map(|_| ()) }
        },
    )
    .await;
    let old_only = tether_core::tls::client_config(
        &old.files.ca_cert,
        Some((&old.files.agent_cert, &old.files.agent_key)),
        &[tether_core::tls::ALPN_H2],
    )
    .unwrap();
    assert!(
        tls_connect(agent_port, old_only).await.is_err(),
        "old certificate still served"
    );
    wait_until(
        "agent reloads its new certificate",
        Duration::from_secs(10),
        || async move {
            (a.proc
                .count_events("reloaded TLS material; new handshakes use it")
                >= 2)
                .then_some(())
        },
    )
    .await;
    // A new agent with only new material joins.
    let _second = AgentProc::start(
        bin(),
        &new,
        server.agent,
        &[
            format!("--ca-cert={}", new.files.ca_cert.display()),
            "--agent-id=second".into(),
        ],
    );
    server.wait_agents(2).await;

    moving(rounds.clone()).await;
    stop.cancel();
    traffic
        .await
        .expect("the live tunnel failed during rotation");
    assert!(
        !agent.proc.logged("proxy server stream down"),
        "the agent's stream was dropped"
    );
    let page = agent.metrics().await;
    assert_eq!(
        metric(
            &page,
            "konnectivity_network_proxy_agent_open_server_connections"
        ),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn certificates_close_to_expiry_are_reported() {
    let dir = TempDir::new("tether-expiry");
    let pki = dir.path().join("pki");
    let out = std::process::Command::new(BIN)
        .args([
            "certs",
            "init",
            "--out",
            pki.to_str().unwrap(),
            "--server-san",
            "127.0.0.1",
            "--validity-days",
            "10",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let server = ServerProc::start(
        bin(),
        &[
            format!("--uds-name={}", dir.path().join("s.sock").display()),
            "--server-port=0".into(),
            format!("--cluster-cert={}", pki.join("server-agent.crt").display()),
            format!("--cluster-key={}", pki.join("server-agent.key").display()),
            format!("--cluster-ca-cert={}", pki.join("ca.crt").display()),
        ],
    );
    let ev = server.proc.wait_event(
        "certificate expires within 30 days; rotate it",
        Duration::from_secs(10),
        |_| true,
    );
    assert!(ev["days_left"].as_i64().unwrap() <= 10);
    let page = server.metrics().await;
    let line = page
        .lines()
        .find(|l| {
            l.starts_with("tether_certificate_expiry_timestamp_seconds")
                && l.contains("server-agent.crt")
        })
        .expect("expiry metric");
    let not_after: i64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!((not_after - now) <= 10 * 86_400 && not_after > now);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sighup_reloads_at_once() {
    let pki = Pki::new();
    let live = TempDir::new("tether-sighup");
    let l = |n: &str| live.path().join(n);
    replace_file(&pki.files.server_cert, &l("server.crt"));
    replace_file(&pki.files.server_key, &l("server.key"));
    let server = ServerProc::start(
        bin(),
        &[
            format!("--uds-name={}", l("s.sock").display()),
            "--server-port=0".into(),
            format!("--cluster-cert={}", l("server.crt").display()),
            format!("--cluster-key={}", l("server.key").display()),
            format!("--cluster-ca-cert={}", pki.files.ca_cert.display()),
            // Polling effectively off: only the signal can trigger the reload.
            "--cert-reload-interval=1h".into(),
        ],
    );
    // A new leaf from the same CA.
    let out = std::process::Command::new(BIN)
        .args(["certs", "init", "--out"])
        .arg(l("next"))
        .args(["--server-san", "127.0.0.1", "--ca-cert"])
        .arg(&pki.files.ca_cert)
        .arg("--ca-key")
        .arg(&pki.files.ca_key)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    replace_file(&l("next/server-agent.crt"), &l("server.crt"));
    replace_file(&l("next/server-agent.key"), &l("server.key"));
    let tls = pki.frontend_client_tls();
    let agent_port = server.agent;
    let presented = |tls| async move {
        let s = tls_connect(agent_port, tls).await.unwrap();
        s.get_ref().1.peer_certificates().unwrap()[0].to_vec()
    };
    let old_der = presented(tls.clone()).await;
    assert_eq!(
        old_der,
        pem_der(&pki.files.server_cert),
        "served the new certificate before SIGHUP"
    );
    server.proc.signal("HUP");
    server.proc.wait_event(
        "reloaded TLS material; new handshakes use it",
        Duration::from_secs(10),
        |_| true,
    );
    assert_eq!(presented(tls).await, pem_der(&l("server.crt")));
}

fn pem_der(path: &Path) -> Vec<u8> {
    use base64::Engine;
    let pem = std::fs::read_to_string(path).unwrap();
    let b64: String = pem
        .lines()
        .skip_while(|l| !l.starts_with("-----BEGIN CERTIFICATE"))
        .skip(1)
        .take_while(|l| !l.starts_with("-----END"))
        .collect();
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap()
}

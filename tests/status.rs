//! `tether status` against real servers on port 0: healthy (exit 0), no agent (exit 1),
//! a certificate about to expire (exit 1 unless --warn-days allows it), an upstream
//! server that only has `/metrics` (the agent count, said to be all that is known), and
//! an endpoint it cannot read (exit 2, one line); a loopback admin or health port
//! refuses a request whose `Host` a DNS-rebound page would send; an admin port over
//! TLS (`--admin-cert`) is read with its CA by `tether status` and the CCM.

use std::io::{Read, Write};
use std::path::Path;
use std::process::Command;

use serde_json::Value;
use tether_testkit::process::{socket_path, uds_frontend_args};
use tether_testkit::{AgentProc, Pki, ServerProc};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

/// What one `tether status` run printed and how it exited.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

fn status(url: &str, extra: &[&str]) -> Run {
    let out = Command::new(BIN)
        .args(["status", "--admin-url", url, "--timeout=5s"])
        .args(extra)
        .output()
        .unwrap();
    Run {
        code: out.status.code().expect("exited"),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn server(pki: &Pki, extra: &[String]) -> ServerProc {
    let mut args = uds_frontend_args(pki, "grpc", &socket_path(pki.dir()));
    args.push("--server-id=status-test".into());
    args.extend(extra.iter().cloned());
    ServerProc::start(Path::new(BIN), &args)
}

async fn agent(pki: &Pki, server: &ServerProc) -> AgentProc {
    let agent = AgentProc::start(
        Path::new(BIN),
        pki,
        server.agent,
        &pki.node_agent_args("node-a", "127.0.0.1"),
    );
    server.wait_agents(1).await;
    agent
}

#[tokio::test]
async fn a_healthy_server_exits_0_and_names_its_agent() {
    let pki = Pki::new();
    let server = server(&pki, &[]);
    let _agent = agent(&pki, &server).await;
    let url = format!("http://{}", server.admin);

    let table = status(&url, &[]);
    assert_eq!(table.code, 0, "{}{}", table.stdout, table.stderr);
    assert!(table.stderr.is_empty(), "{}", table.stderr);
    for says in [
        "status-test",
        "grpc/uds",
        "node-a",
        "certificate",
        "lease: controller off",
    ] {
        assert!(table.stdout.contains(says), "{says} in:\n{}", table.stdout);
    }
    let row = table
        .stdout
        .lines()
        .find(|l| l.starts_with("node-a"))
        .unwrap();
    assert!(row.contains("127.0.0.1") && row.contains(" no "), "{row}");
    assert!(
        row.trim_end().ends_with(" h2"),
        "the agent's transport: {row}"
    );

    let json = status(&url, &["-o", "json"]);
    assert_eq!(json.code, 0, "{}", json.stderr);
    let doc: Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!(doc["serverId"], "status-test");
    assert_eq!(doc["mode"], "grpc/uds");
    assert_eq!(doc["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(doc["agents"][0]["id"], "node-a");
    assert_eq!(doc["agents"][0]["verifiedBy"], "certificate");
    assert_eq!(doc["agents"][0]["draining"], false);
    assert_eq!(doc["agents"][0]["transports"], serde_json::json!(["h2"]));
    assert_eq!(doc["problems"], serde_json::json!([]));
    assert_eq!(doc["lease"]["enabled"], false);
    let certs = doc["certificates"].as_array().unwrap();
    assert!(
        certs
            .iter()
            .any(|c| c["expiresInSeconds"].as_i64() > Some(300 * 86_400)),
        "{doc:#}"
    );
}

#[tokio::test]
async fn no_agent_is_a_problem() {
    let pki = Pki::new();
    let server = server(&pki, &[]);
    let run = status(&format!("http://{}", server.admin), &[]);
    assert_eq!(run.code, 1, "{}{}", run.stdout, run.stderr);
    assert_eq!(run.stderr, "problem: no agent connected\n");
    assert!(
        run.stdout.contains("agents: none connected"),
        "{}",
        run.stdout
    );
}

/// What curl got for `url` with `Host: host` (the default Host when `None`): the HTTP
/// status and the body.
fn curl_host(url: &str, host: Option<&str>) -> (u16, String) {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--max-time", "10", "-w", "\n%{http_code}", url]);
    if let Some(h) = host {
        cmd.args(["-H", &format!("Host: {h}")]);
    }
    let out = cmd.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (code.parse().unwrap(), body.to_string())
}

/// A web page an attacker's DNS re-points at 127.0.0.1 (DNS rebinding) sends its own
/// name as `Host`: the loopback admin and health ports of the server and the agent
/// refuse it, and serve curl asking for 127.0.0.1, [::1]'s spelling and localhost.
#[tokio::test]
async fn a_page_rebound_to_loopback_reads_nothing() {
    let pki = Pki::new();
    let server = server(&pki, &[]);
    let agent = agent(&pki, &server).await;
    for (what, addr, path) in [
        ("server admin", server.admin, "/agents"),
        ("server admin", server.admin, "/status"),
        ("server admin", server.admin, "/metrics"),
        ("server health", server.health, "/metrics"),
        ("agent health", agent.health, "/metrics"),
    ] {
        assert!(addr.ip().is_loopback(), "{what} on {addr}");
        let url = format!("http://{addr}{path}");
        let port = addr.port();
        for host in [
            "rebound.attacker.example",
            &format!("rebound.attacker.example:{port}"),
        ] {
            let (code, body) = curl_host(&url, Some(host));
            assert_eq!(code, 403, "{what} {path} for Host {host}: {body}");
            assert!(body.contains("DNS rebinding"), "{body}");
            assert!(!body.contains("node-a"), "{body}");
        }
        for host in [
            None,
            Some(format!("localhost:{port}")),
            Some("[::1]".to_string()),
        ] {
            let (code, body) = curl_host(&url, host.as_deref());
            assert_eq!(code, 200, "{what} {path} for Host {host:?}: {body}");
        }
    }
}

/// The CCM and `tether status` name an admin port on `[::1]` as their URL spells it, so
/// the DNS-rebinding guard lets them in.
#[tokio::test]
async fn the_ccm_and_status_read_an_admin_port_on_ipv6_loopback() {
    let pki = Pki::new();
    let server = server(&pki, &["--admin-bind-address=::1".to_string()]);
    let _agent = agent(&pki, &server).await;
    assert_eq!(
        server.admin.ip(),
        "::1".parse::<std::net::IpAddr>().unwrap()
    );
    let base = format!("http://[::1]:{}", server.admin.port());

    let run = status(&base, &[]);
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);

    let agents = tether_ccm::provider::agents::ConnectedAgents::new(
        &tether_ccm::provider::agents::AgentsConfig {
            urls: vec![format!("{base}/agents")],
            ..Default::default()
        },
    )
    .unwrap();
    let presence = agents.presence("node-a").await.unwrap();
    assert!(
        matches!(
            presence,
            tether_ccm::provider::agents::Presence::Connected(_)
        ),
        "{presence:?}"
    );
}

/// `--admin-cert`: the admin port speaks TLS only. `tether status` and the CCM read it
/// with the CA that signed it; plain HTTP gets no answer, and a reader trusting
/// another CA is told the TLS handshake failed.
#[tokio::test]
async fn the_admin_port_over_tls_is_read_with_its_ca_only() {
    let pki = Pki::new();
    let f = &pki.files;
    let server = server(
        &pki,
        &[
            format!("--admin-cert={}", f.server_cert.display()),
            format!("--admin-key={}", f.server_key.display()),
        ],
    );
    let _agent = agent(&pki, &server).await;
    let https = format!("https://{}", server.admin);
    let ca = f.ca_cert.display().to_string();

    let run = status(&https, &["--cacert", &ca]);
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("node-a"), "{}", run.stdout);
    // curl, verifying the certificate.
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "10", "--cacert", &ca])
        .arg(format!("{https}/agents"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("node-a"));
    // Plain HTTP is not served.
    let (code, _) = curl_host(&format!("http://{}/agents", server.admin), None);
    assert_ne!(code, 200);
    // Another CA is not trusted.
    let foreign = f.frontend_ca_cert.display().to_string();
    let run = status(&https, &["--cacert", &foreign]);
    assert_eq!(run.code, 2, "{}{}", run.stdout, run.stderr);

    use tether_ccm::provider::agents::{AgentsConfig, ConnectedAgents, Presence};
    let reader = |ca: &str| {
        ConnectedAgents::new(&AgentsConfig {
            urls: vec![format!("{https}/agents")],
            ca_file: Some(ca.to_string()),
            ..Default::default()
        })
        .unwrap()
    };
    let presence = reader(&ca).presence("node-a").await.unwrap();
    assert!(matches!(presence, Presence::Connected(_)), "{presence:?}");
    let refused = reader(&foreign).presence("node-a").await.unwrap_err();
    assert!(refused.to_string().contains("TLS"), "{refused}");
}

#[tokio::test]
async fn a_certificate_within_the_warning_days_is_a_problem() {
    let pki = Pki::new();
    let ca = tether_certs::Ca::load(&pki.files.ca_cert, &pki.files.ca_key).unwrap();
    let pair = ca
        .issue(&tether_certs::LeafSpec {
            common_name: "short-lived".into(),
            sans: vec!["127.0.0.1".into(), "localhost".into()],
            server: true,
            validity_days: 5,
            ..Default::default()
        })
        .unwrap();
    let (cert, key) = tether_certs::write_pair(pki.dir(), "short-lived", &pair).unwrap();
    let server = server(
        &pki,
        &[
            format!("--cluster-cert={}", cert.display()),
            format!("--cluster-key={}", key.display()),
        ],
    );
    let _agent = agent(&pki, &server).await;
    let url = format!("http://{}", server.admin);

    let run = status(&url, &[]);
    assert_eq!(run.code, 1, "{}{}", run.stdout, run.stderr);
    let problems: Vec<&str> = run.stderr.lines().collect();
    assert_eq!(problems.len(), 1, "{}", run.stderr);
    assert!(
        problems[0].starts_with("problem: certificate short-lived.crt")
            && problems[0].contains("within --warn-days 14"),
        "{}",
        problems[0]
    );
    let row = run
        .stdout
        .lines()
        .find(|l| l.contains("short-lived.crt"))
        .unwrap();
    assert!(row.ends_with("warning"), "{row}");

    let allowed = status(&url, &["--warn-days=3"]);
    assert_eq!(allowed.code, 0, "{}", allowed.stderr);
}

/// An upstream server's admin port as seen from outside: `/metrics` and nothing else,
/// for `requests` requests (each `tether status` run makes two: `/status`, `/metrics`).
fn fake_upstream(metrics: &'static str, requests: usize) -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming().take(requests) {
            let Ok(mut conn) = conn else { return };
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                head.push(byte[0]);
            }
            let (status, body) = if head.starts_with(b"GET /metrics ") {
                ("200 OK", metrics)
            } else {
                ("404 Not Found", "404 page not found\n")
            };
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    addr
}

#[tokio::test]
async fn an_upstream_server_gives_the_agent_count_only() {
    let addr = fake_upstream(
        "# HELP konnectivity_network_proxy_server_ready_backends Number of konnectivity agent connected to the proxy server\n\
         # TYPE konnectivity_network_proxy_server_ready_backends gauge\n\
         konnectivity_network_proxy_server_ready_backends{proxy_strategy=\"default\"} 3\n\
         konnectivity_network_proxy_server_ready_backend_connections 3\n",
        4,
    );
    let url = format!("http://{addr}");
    let run = status(&url, &[]);
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("upstream (or older Tether) server")
            && run.stdout.contains("only the agent count is known"),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("agents connected: 3"), "{}", run.stdout);

    let json = status(&url, &["-o=json"]);
    let doc: Value = serde_json::from_str(&json.stdout).unwrap();
    assert_eq!(doc["upstream"], true);
    assert_eq!(doc["agentCount"], 3);

    let empty = fake_upstream(
        "konnectivity_network_proxy_server_ready_backends{proxy_strategy=\"default\"} 0\n",
        2,
    );
    let run = status(&format!("http://{empty}"), &[]);
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert_eq!(run.stderr, "problem: no agent connected\n");

    let agent_port = fake_upstream("process_open_fds 9\n", 2);
    let run = status(&format!("http://{agent_port}"), &[]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("not an agent's"), "{}", run.stderr);
}

#[test]
fn an_unreachable_endpoint_exits_2_with_one_line() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let run = status(&format!("http://127.0.0.1:{port}"), &[]);
    assert_eq!(run.code, 2);
    assert!(run.stdout.is_empty(), "{}", run.stdout);
    assert_eq!(run.stderr.lines().count(), 1, "{}", run.stderr);
    assert!(
        run.stderr.starts_with(&format!(
            "error: cannot read http://127.0.0.1:{port}/status"
        )) && run.stderr.contains("--admin-url"),
        "{}",
        run.stderr
    );

    let run = status("127.0.0.1:8133", &[]);
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("http://HOST:PORT"), "{}", run.stderr);
}

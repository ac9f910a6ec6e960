//! `tether certs`: init/agent/inspect, Secret output, RSA keys, reuse of an existing
//! CA, no silent overwrites, identity-bound agent certificates.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tether_testkit::{metric, AgentProc, ServerProc, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

fn tether(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn p(dir: &Path, name: &str) -> String {
    dir.join(name).display().to_string()
}

#[test]
fn init_writes_a_pki_inspect_checks_it_and_nothing_is_overwritten() {
    let dir = TempDir::new("tether-certs-init");
    let out = dir.path().join("pki");
    let out_s = out.display().to_string();
    let (ok, stdout, stderr) = tether(&[
        "certs",
        "init",
        "--out",
        &out_s,
        "--server-san",
        "konnectivity.example",
        "--server-san",
        "10.0.0.1",
        "--apiserver-url",
        "https://10.0.0.1:6443",
    ]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("server-agent.crt"));
    for key in [
        "ca.key",
        "server-agent.key",
        "server-frontend.key",
        "apiserver-client.key",
        "konnectivity-server-client.key",
    ] {
        let mode = std::fs::metadata(out.join(key))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o600, "{key}");
    }
    let kubeconfig = std::fs::read_to_string(out.join("konnectivity-server.conf")).unwrap();
    assert!(kubeconfig.contains("server: https://10.0.0.1:6443"));

    // Never overwritten without --force, and nothing half-written.
    let before = std::fs::read(out.join("server-agent.crt")).unwrap();
    let (ok, _, stderr) = tether(&[
        "certs",
        "init",
        "--out",
        &out_s,
        "--server-san",
        "x.example",
    ]);
    assert!(!ok);
    assert!(stderr.contains("already exists; pass --force"), "{stderr}");
    assert_eq!(std::fs::read(out.join("server-agent.crt")).unwrap(), before);

    // inspect: one block per certificate, checks pass.
    let (ok, stdout, stderr) = tether(&[
        "certs",
        "inspect",
        &p(&out, "server-agent.crt"),
        "--ca",
        &p(&out, "ca.crt"),
        "--san",
        "10.0.0.1",
        "--key",
        &p(&out, "server-agent.key"),
    ]);
    assert!(ok, "{stderr}");
    for needle in [
        "subject:       CN=konnectivity-server",
        "SANs:          konnectivity.example, 10.0.0.1",
        "ext key usage: serverAuth",
        "chains to CA:  yes",
        "key matches:   yes",
        "days left",
    ] {
        assert!(stdout.contains(needle), "missing {needle:?} in\n{stdout}");
    }
    let (_, stdout, _) = tether(&[
        "certs",
        "inspect",
        &p(&out, "konnectivity-server-client.crt"),
    ]);
    assert!(
        stdout.contains("CN=system:konnectivity-server") && stdout.contains("clientAuth"),
        "{stdout}"
    );

    // Mismatches: wrong SAN, wrong key, wrong CA, expired.
    let (ok, _, stderr) = tether(&[
        "certs",
        "inspect",
        &p(&out, "server-agent.crt"),
        "--san",
        "other.example",
    ]);
    assert!(
        !ok && stderr.contains("not valid for other.example: add it as a SAN"),
        "{stderr}"
    );
    let (ok, _, stderr) = tether(&[
        "certs",
        "inspect",
        &p(&out, "server-agent.crt"),
        "--key",
        &p(&out, "ca.key"),
    ]);
    assert!(!ok && stderr.contains("does not belong to"), "{stderr}");
    let other = dir.path().join("other");
    assert!(
        tether(&[
            "certs",
            "init",
            "--out",
            &other.display().to_string(),
            "--server-san",
            "a"
        ])
        .0
    );
    let (ok, _, stderr) = tether(&[
        "certs",
        "inspect",
        &p(&out, "server-agent.crt"),
        "--ca",
        &p(&other, "ca.crt"),
    ]);
    assert!(!ok && stderr.contains("is not signed by"), "{stderr}");
    let expired = dir.path().join("expired.crt");
    tether_testkit::write_expired_cert(&expired);
    let (ok, stdout, stderr) = tether(&["certs", "inspect", &expired.display().to_string()]);
    assert!(
        !ok && stdout.contains("EXPIRED") && stderr.contains("is expired"),
        "{stdout}{stderr}"
    );

    // Reusing the cluster's CA: no ca.key is written and leaves chain to it.
    let reuse = dir.path().join("reuse");
    let (ok, _, stderr) = tether(&[
        "certs",
        "init",
        "--out",
        &reuse.display().to_string(),
        "--server-san",
        "b",
        "--ca-cert",
        &p(&out, "ca.crt"),
        "--ca-key",
        &p(&out, "ca.key"),
    ]);
    assert!(ok, "{stderr}");
    assert!(!reuse.join("ca.key").exists());
    assert!(
        tether(&[
            "certs",
            "inspect",
            &p(&reuse, "server-agent.crt"),
            "--ca",
            &p(&out, "ca.crt")
        ])
        .0
    );
    // A CA key that does not match its certificate is named.
    let (ok, _, stderr) = tether(&[
        "certs",
        "init",
        "--out",
        &dir.path().join("bad").display().to_string(),
        "--server-san",
        "b",
        "--ca-cert",
        &p(&out, "ca.crt"),
        "--ca-key",
        &p(&out, "server-agent.key"),
    ]);
    assert!(
        !ok && stderr.contains("server-agent.key") && stderr.contains("does not belong"),
        "{stderr}"
    );
}

#[test]
fn secret_format_and_rsa_keys() {
    let dir = TempDir::new("tether-certs-secret");
    let out = dir.path().join("s");
    let (ok, _, stderr) = tether(&[
        "certs",
        "init",
        "--out",
        &out.display().to_string(),
        "--server-san",
        "a.example",
        "--format",
        "secret",
        "--namespace",
        "tether-system",
    ]);
    assert!(ok, "{stderr}");
    let yaml = std::fs::read_to_string(out.join("secrets.yaml")).unwrap();
    assert_eq!(
        yaml.matches("kind: Secret").count(),
        6,
        "with the frontend CA's"
    );
    assert_eq!(yaml.matches("type: kubernetes.io/tls").count(), 6);
    assert!(
        yaml.contains("namespace: tether-system")
            && yaml.contains("tls.key: ")
            && yaml.contains("ca.crt: ")
    );
    assert_eq!(
        std::fs::metadata(out.join("secrets.yaml"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );

    let rsa = dir.path().join("rsa");
    let (ok, _, stderr) = tether(&[
        "certs",
        "init",
        "--out",
        &rsa.display().to_string(),
        "--server-san",
        "127.0.0.1",
        "--key-algorithm",
        "rsa-2048",
    ]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = tether(&[
        "certs",
        "inspect",
        &p(&rsa, "server-agent.crt"),
        "--ca",
        &p(&rsa, "ca.crt"),
        "--key",
        &p(&rsa, "server-agent.key"),
    ]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = tether(&[
        "certs",
        "init",
        "--out",
        "x",
        "--server-san",
        "a",
        "--key-algorithm",
        "dsa",
    ]);
    assert!(
        !ok && stderr.contains("use ecdsa-p256, rsa-2048 or rsa-4096"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_certificates_bind_identity() {
    let dir = TempDir::new("tether-certs-agent");
    let pki = dir.path().join("pki");
    assert!(
        tether(&[
            "certs",
            "init",
            "--out",
            &pki.display().to_string(),
            "--server-san",
            "127.0.0.1"
        ])
        .0
    );
    let (ok, _, stderr) = tether(&[
        "certs",
        "agent",
        "--node",
        "node-1",
        "--node-ip",
        "127.0.0.1",
        "--out",
        &pki.display().to_string(),
        "--ca-cert",
        &p(&pki, "ca.crt"),
        "--ca-key",
        &p(&pki, "ca.key"),
    ]);
    assert!(ok, "{stderr}");
    let (_, stdout, _) = tether(&["certs", "inspect", &p(&pki, "agent-node-1.crt")]);
    assert!(
        stdout.contains("CN=node-1") && stdout.contains("SANs:          node-1, 127.0.0.1"),
        "{stdout}"
    );

    let socket = dir.path().join("s.sock");
    let server = ServerProc::start(
        Path::new(BIN),
        &[
            format!("--uds-name={}", socket.display()),
            "--server-port=0".into(),
            format!("--cluster-cert={}", p(&pki, "server-agent.crt")),
            format!("--cluster-key={}", p(&pki, "server-agent.key")),
            format!("--cluster-ca-cert={}", p(&pki, "ca.crt")),
            "--require-agent-identity-match".into(),
        ],
    );
    let test_pki = tether_testkit::Pki::new();
    let agent_args = |id: &str, ids: &str| {
        vec![
            format!("--ca-cert={}", p(&pki, "ca.crt")),
            format!("--agent-cert={}", p(&pki, "agent-node-1.crt")),
            format!("--agent-key={}", p(&pki, "agent-node-1.key")),
            format!("--agent-id={id}"),
            format!("--agent-identifiers={ids}"),
        ]
    };
    for (id, ids, why) in [
        ("node-2", "ipv4=127.0.0.1", "agentid"),
        ("node-1", "ipv4=127.0.0.9", "ip=127.0.0.9"),
        ("node-1", "host=node-2", "host=node-2"),
        ("node-1", "default-route=true", "default-route=true"),
    ] {
        let _impostor = AgentProc::start(
            Path::new(BIN),
            &test_pki,
            server.agent,
            &agent_args(id, ids),
        );
        let ev = server.proc.wait_event(
            "agent claims identifiers the server could not verify; stream refused (--require-agent-identity-match)",
            Duration::from_secs(20),
            |v| v["unverified"].as_str() == Some(why),
        );
        assert_eq!(ev["agent_id"], id);
    }
    let page = server.metrics().await;
    assert_eq!(
        metric(
            &page,
            "konnectivity_network_proxy_server_ready_backend_connections"
        ),
        Some(0.0)
    );
    let _agent = AgentProc::start(
        Path::new(BIN),
        &test_pki,
        server.agent,
        &agent_args("node-1", "host=node-1&ipv4=127.0.0.1"),
    );
    server.wait_agents(1).await;
    // The loaded certificates' expiry is published.
    let page = server.metrics().await;
    assert!(
        page.lines().any(
            |l| l.starts_with("tether_certificate_expiry_timestamp_seconds{")
                && l.contains("source=\"agent listener\"")
                && !l.contains("path=")
                && !l.contains("subject=")
        ),
        "{page}"
    );
}

/// A CA as kubeadm writes `/etc/kubernetes/pki/ca.{crt,key}`, made by openssl: `rsa`
/// (PKCS#1, kubeadm's default), `ec256` or `ec384` (SEC1, kubeadm 1.31+ with ECDSA;
/// openssl puts an `EC PARAMETERS` block first), or `pkcs8` (an RSA key in PKCS#8).
fn openssl_ca(dir: &Path, kind: &str) {
    let key = match kind {
        "rsa" => "openssl genrsa -traditional -out ca.key 2048",
        "ec256" => "openssl ecparam -name prime256v1 -genkey -out ca.key",
        "ec384" => "openssl ecparam -name secp384r1 -genkey -noout -out ca.key",
        _ => "openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out ca.key",
    };
    let script = format!(
        "set -e; {key} 2>/dev/null; openssl req -x509 -new -key ca.key -out ca.crt -days 30 -subj /CN=kubernetes -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,digitalSignature,keyEncipherment,keyCertSign"
    );
    let out = Command::new("bash")
        .args(["-c", &script])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// kubeadm's own CA key, in every form kubeadm and openssl write it, works for `init`,
/// `agent`, the renewal (`init --force` with the same CA) and `inspect --key`; the
/// server then serves an agent with the certificates it wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubeadm_format_ca_keys_are_read_everywhere_a_key_is_taken() {
    for kind in ["rsa", "ec256", "ec384", "pkcs8"] {
        let dir = TempDir::new(&format!("tether-kubeadm-ca-{kind}"));
        openssl_ca(dir.path(), kind);
        let first = std::fs::read_to_string(dir.path().join("ca.key")).unwrap();
        let label = match kind {
            "rsa" => "BEGIN RSA PRIVATE KEY",
            "ec256" | "ec384" => "BEGIN EC PRIVATE KEY",
            _ => "BEGIN PRIVATE KEY",
        };
        assert!(first.contains(label), "{kind}: {first}");
        let (ca, key, out) = (
            p(dir.path(), "ca.crt"),
            p(dir.path(), "ca.key"),
            p(dir.path(), "pki"),
        );
        let init = [
            "certs",
            "init",
            "--out",
            &out,
            "--ca-cert",
            &ca,
            "--ca-key",
            &key,
            "--server-san",
            "127.0.0.1",
            "--apiserver-url",
            "https://127.0.0.1:6443",
        ];
        let (ok, _, err) = tether(&init);
        assert!(ok, "{kind}: init: {err}");
        let agent = [
            "certs",
            "agent",
            "--node",
            "node-1",
            "--node-ip",
            "127.0.0.1",
            "--out",
            &out,
            "--ca-cert",
            &ca,
            "--ca-key",
            &key,
        ];
        let (ok, _, err) = tether(&agent);
        assert!(ok, "{kind}: agent: {err}");
        // Renewal, as docs/operating.md says: the same commands with --force.
        let renew: Vec<&str> = init.iter().copied().chain(["--force"]).collect();
        let (ok, _, err) = tether(&renew);
        assert!(ok, "{kind}: renewal: {err}");
        let (ok, _, err) = tether(&["certs", "inspect", &ca, "--key", &key]);
        assert!(ok, "{kind}: inspect: {err}");
        let (ok, _, err) = tether(&[
            "certs",
            "inspect",
            &p(&dir.path().join("pki"), "agent-node-1.crt"),
            "--ca",
            &ca,
        ]);
        assert!(ok, "{kind}: the agent certificate chains to the CA: {err}");
        // The written keys are PKCS#8, as before.
        let written = std::fs::read_to_string(dir.path().join("pki/agent-node-1.key")).unwrap();
        assert!(written.contains("BEGIN PRIVATE KEY"), "{kind}");
    }
}

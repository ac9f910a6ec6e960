//! Items 7 and 8: the credentials `tether certs` writes, and the shared-CA guard. `tether
//! certs dev` writes per-node agent certificates, so one node's cannot lock another out
//! by claiming its ID; a frontend CA below the agents' root (R -> I1 -> I2, made with
//! openssl) is refused at start-up, however deep.

use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering;

use tether_client::Client;
use tether_testkit::process::{frontend_cas_command, socket_path};
use tether_testkit::rogue::Rogue;
use tether_testkit::{backend, AgentProc, Pki, ServerProc, TempDir};

use super::bin;

/// `tether certs dev`'s files as a Pki: the testkit's shape, over the command's output.
fn dev_pki(dir: &Path, nodes: &[&str]) -> Pki {
    let mut cmd = Command::new(bin());
    cmd.args(["certs", "dev", "--out"]).arg(dir);
    for n in nodes {
        cmd.args(["--node", n]);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    Pki::from_dev_dir(dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn certs_dev_binds_every_agent_certificate_to_one_node() {
    let dir = TempDir::new("tether-certs-dev");
    let pki = dev_pki(dir.path(), &["node-b"]);
    let server = ServerProc::start(
        bin(),
        &tether_testkit::process::uds_frontend_args(&pki, "grpc", &socket_path(pki.dir())),
    );
    let node_b = |pki: &Pki| {
        AgentProc::start(
            bin(),
            pki,
            server.agent,
            &[
                "--agent-id=node-b".to_string(),
                format!(
                    "--agent-cert={}",
                    dir.path().join("agent-node-b.crt").display()
                ),
                format!(
                    "--agent-key={}",
                    dir.path().join("agent-node-b.key").display()
                ),
            ],
        )
    };
    let mut b = node_b(&pki);
    server.wait_agents(1).await;

    // agent.crt is node local-agent's: claiming node-b's ID on eight streams fills its
    // own share, not node-b's (before, the fleet certificate locked node-b out).
    let rogue = Rogue::connect(
        &pki,
        server.agent,
        Some((&dir.path().join("agent.crt"), &dir.path().join("agent.key"))),
    )
    .await;
    let (streams, _) = rogue.open_many(8, "node-b", "host=node-b", None).await;
    assert_eq!(streams.len(), 8);
    b.proc.kill();
    server.wait_agents(8).await;
    let _b = node_b(&pki);
    server.wait_agents(9).await;

    // node-b's name is node-b's: its dials never reach the impostor.
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let echo = backend::echo().await;
    for _ in 0..20 {
        let _ = client.dial(&format!("node-b:{}", echo.addr.port())).await;
    }
    assert_eq!(rogue.dials.load(Ordering::SeqCst), 0);
    drop(streams);
}

/// openssl's three-level PKI: R (root) -> I1 -> I2, and an agent leaf under I2.
fn three_levels(dir: &Path) {
    let script = r#"
set -e
ext() { printf '%s\n' "$@" > "$1.ext.tmp"; }
ca_ext='basicConstraints=critical,CA:TRUE
keyUsage=critical,keyCertSign,cRLSign'
printf '%s\n' "$ca_ext" > ca.ext
printf '%s\n' 'basicConstraints=critical,CA:FALSE' 'keyUsage=critical,digitalSignature' 'extendedKeyUsage=clientAuth' > leaf.ext
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout r.key -out r.crt -subj /CN=root -days 30 -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
for pair in i1:r i2:i1; do
  c=${pair%%:*}; p=${pair##*:}
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout $c.key -out $c.csr -subj /CN=$c 2>/dev/null
  openssl x509 -req -in $c.csr -CA $p.crt -CAkey $p.key -CAcreateserial -out $c.crt -days 30 -extfile ca.ext 2>/dev/null
done
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout leaf.key -out leaf.csr -subj /CN=node-x/O=system:konnectivity-agents 2>/dev/null
openssl x509 -req -in leaf.csr -CA i2.crt -CAkey i2.key -CAcreateserial -out leaf.crt -days 30 -extfile leaf.ext 2>/dev/null
"#;
    let out = Command::new("bash")
        .args(["-c", script])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// Starts a server with a TCP frontend trusting `frontend_ca` and agents trusting
/// `agent_ca`; its stderr and whether it started.
fn start(pki: &Pki, frontend_ca: &Path, agent_ca: &Path, extra: &[&str]) -> (bool, String) {
    let mut child = frontend_cas_command(bin(), pki, frontend_ca, agent_ca)
        .args(extra)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let mut text = String::new();
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let listening = line.contains("server listening");
            text.push_str(&line);
            text.push('\n');
            if listening {
                let _ = tx.send((true, text.clone()));
            }
        }
        let _ = tx.send((false, text));
    });
    let (started, text) = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the server started or failed within 60 s");
    let _ = child.kill();
    let _ = child.wait();
    (started, text)
}

#[test]
fn a_frontend_ca_below_the_agents_root_is_refused_however_deep() {
    let pki = Pki::new();
    let dir = TempDir::new("tether-three-levels");
    three_levels(dir.path());
    let p = |n: &str| dir.path().join(n);
    // The frontend trusts I2 alone: its issuers are in neither file, so nothing proves
    // that agent certificates (chained to R) cannot reach it. Before, this started.
    let (started, log) = start(&pki, &p("i2.crt"), &p("r.crt"), &[]);
    assert!(!started, "{log}");
    assert!(
        log.contains("holds the intermediate CA") && log.contains("--frontend-client-names"),
        "{log}"
    );
    // With the chain at hand, the guard sees I2 is under R: the same refusal as one CA.
    let chain = format!(
        "{}{}",
        std::fs::read_to_string(p("i2.crt")).unwrap(),
        std::fs::read_to_string(p("i1.crt")).unwrap()
    );
    std::fs::write(p("i2-chain.crt"), chain).unwrap();
    let (started, log) = start(&pki, &p("i2-chain.crt"), &p("r.crt"), &[]);
    assert!(!started && log.contains("share the CA"), "{log}");
    // Naming the apiserver's certificate is the fix the message names.
    let (started, log) = start(
        &pki,
        &p("i2.crt"),
        &p("r.crt"),
        &["--frontend-client-names=system:kube-apiserver"],
    );
    assert!(started, "{log}");
    // A root of its own beside the agents' root: two trusts that never meet.
    let (started, log) = start(&pki, &pki.files.frontend_ca_cert, &p("r.crt"), &[]);
    assert!(started, "{log}");
}

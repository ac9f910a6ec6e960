//! Agents without client certificates: bound service-account tokens checked by
//! TokenReview against a real kube-apiserver, with deploy/rbac.yaml granting the server
//! identity `system:auth-delegator`.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use tether_testkit::kube::{Cluster, Egress};
use tether_testkit::process::{socket_path, token_auth_server_args};
use tether_testkit::{metric, AgentProc, Pki, ServerProc, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_tether");
const AUDIENCE: &str = "system:konnectivity-server";

fn bin() -> &'static Path {
    Path::new(BIN)
}

fn token_request(cluster: &Cluster, sa: &str, audience: &str) -> String {
    cluster.service_account_token(sa, Some(audience))
}

/// A service-account JWT signed with the cluster's real signing key, valid in every way
/// except (when `exp_offset` is negative) its expiry.
fn signed_token(cluster: &Cluster, sa: &str, uid: &str, exp_offset: i64) -> String {
    use ring::signature::{EcdsaKeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
    let pem = std::fs::read_to_string(&cluster.files.sa_key).unwrap();
    let der = base64::engine::general_purpose::STANDARD
        .decode(
            pem.lines()
                .filter(|l| !l.starts_with("-----"))
                .collect::<String>(),
        )
        .unwrap();
    let rng = ring::rand::SystemRandom::new();
    let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &der, &rng).unwrap();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let b64 = |v: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v);
    let header = b64(br#"{"alg":"ES256","typ":"JWT"}"#);
    let claims = serde_json::json!({
        "iss": cluster.issuer,
        "aud": [AUDIENCE],
        "sub": format!("system:serviceaccount:kube-system:{sa}"),
        "iat": now - 7200,
        "nbf": now - 7200,
        "exp": now + exp_offset,
        "kubernetes.io": {"namespace": "kube-system", "serviceaccount": {"name": sa, "uid": uid}},
    });
    let payload = b64(claims.to_string().as_bytes());
    let signing_input = format!("{header}.{payload}");
    let sig = key.sign(&rng, signing_input.as_bytes()).unwrap();
    format!("{signing_input}.{}", b64(sig.as_ref()))
}

fn agent_with_token(
    pki: &Pki,
    server: &ServerProc,
    dir: &Path,
    name: &str,
    token: &str,
) -> AgentProc {
    AgentProc::start_with_token(bin(), pki, server.agent, dir, name, token, &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_are_checked_by_token_review() {
    let pki = Pki::new();
    let cluster = Cluster::start(&Egress::GrpcUds(socket_path(pki.dir())));
    cluster.apply_shipped_rbac();
    cluster.kubectl_ok(&["create", "serviceaccount", "intruder", "-n", "kube-system"]);
    let uid = cluster.kubectl_ok(&[
        "get",
        "serviceaccount",
        "konnectivity-agent",
        "-n",
        "kube-system",
        "-o",
        "jsonpath={.metadata.uid}",
    ]);

    let server = ServerProc::start(
        bin(),
        &token_auth_server_args(&pki, &cluster.files.server_kubeconfig),
    );
    let tokens = TempDir::new("tether-tokens");

    // Rejected: each gets a clear log line on the server and no stream.
    let bad = [
        (
            "wrong-audience",
            token_request(&cluster, "konnectivity-agent", "some-other-audience"),
            "audience",
        ),
        (
            "wrong-sa",
            token_request(&cluster, "intruder", AUDIENCE),
            "system:serviceaccount:kube-system:intruder",
        ),
        (
            "expired",
            signed_token(&cluster, "konnectivity-agent", &uid, -3600),
            "expired",
        ),
        (
            "garbage",
            "not-a-token-at-all".to_string(),
            "invalid bearer token",
        ),
    ];
    for (name, token, why) in &bad {
        let agent = agent_with_token(&pki, &server, tokens.path(), name, token);
        let event = server.proc.wait_event(
            "agent authentication failed; stream refused",
            Duration::from_secs(20),
            |v| v["agent_id"] == *name,
        );
        let error = event["error"].as_str().unwrap_or_default();
        assert!(error.contains(why), "{name}: {error}");
        agent.proc.wait_event(
            "proxy server stream down; reconnecting",
            Duration::from_secs(20),
            |_| true,
        );
        let page = server.metrics().await;
        assert_eq!(
            metric(
                &page,
                "konnectivity_network_proxy_server_ready_backend_connections"
            ),
            Some(0.0),
            "{name} got in"
        );
    }
    let page = server.metrics().await;
    assert!(
        metric(
            &page,
            "tether_server_token_reviews_total{result=\"rejected\"}"
        )
        .unwrap()
            >= 4.0
    );

    // The hand-signed token is accepted when it is not expired: the expired one was
    // refused for its expiry alone.
    let fresh = signed_token(&cluster, "konnectivity-agent", &uid, 3600);
    let mut agent = agent_with_token(&pki, &server, tokens.path(), "hand-signed", &fresh);
    server.wait_agents(1).await;
    agent.proc.kill();
    server.wait_agents(0).await;

    // A TokenRequest token is accepted; reconnects within the cache lifetime send no
    // new TokenReview.
    let good = token_request(&cluster, "konnectivity-agent", AUDIENCE);
    for round in 0..3 {
        let mut agent = agent_with_token(&pki, &server, tokens.path(), "good", &good);
        server.wait_agents(1).await;
        if round < 2 {
            agent.proc.kill();
            server.wait_agents(0).await;
        }
    }
    let page = server.metrics().await;
    assert_eq!(
        metric(
            &page,
            "tether_server_token_reviews_total{result=\"authenticated\"}"
        ),
        Some(2.0)
    );
    assert_eq!(
        metric(
            &page,
            "tether_server_token_reviews_total{result=\"cached\"}"
        ),
        Some(2.0)
    );
}

/// `/agents` names nodes and addresses: on an admin port off loopback it needs a bearer
/// token bound to the `tether-admin` audience that a TokenReview accepts and a
/// SubjectAccessReview allowing `get` on `/agents` (as the CCM's ClusterRole grants);
/// the CCM's client sends its token file.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_agents_listing_off_loopback_needs_an_authorized_token() {
    let pki = Pki::new();
    let cluster = Cluster::start(&Egress::GrpcUds(socket_path(pki.dir())));
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    cluster.kubectl_ok(&["apply", "-f", deploy.join("rbac.yaml").to_str().unwrap()]);
    // The CCM's ClusterRole as shipped, bound to a reader ServiceAccount.
    let ccm = std::fs::read_to_string(deploy.join("tether-ccm.yaml")).unwrap();
    let role = ccm
        .split("\n---\n")
        .find(|d| d.contains("name: system:tether-cloud-controller-manager\nrules:"))
        .expect("the CCM's ClusterRole");
    cluster.apply(role);
    for sa in ["reader", "stranger"] {
        cluster.kubectl_ok(&["create", "serviceaccount", sa, "-n", "kube-system"]);
    }
    cluster.kubectl_ok(&[
        "create",
        "clusterrolebinding",
        "agents-reader",
        "--clusterrole=system:tether-cloud-controller-manager",
        "--serviceaccount=kube-system:reader",
    ]);

    let mut args = token_auth_server_args(&pki, &cluster.files.server_kubeconfig);
    args.push("--admin-bind-address=0.0.0.0".into());
    let server = ServerProc::start(bin(), &args);
    let tokens = TempDir::new("tether-tokens");
    let good = token_request(&cluster, "konnectivity-agent", AUDIENCE);
    let _agent = agent_with_token(&pki, &server, tokens.path(), "edge-1", &good);
    server.wait_agents(1).await;

    let url = format!("http://127.0.0.1:{}/agents", server.admin.port());
    let get = |token: Option<&str>| -> (String, String) {
        let mut cmd = std::process::Command::new("curl");
        cmd.args(["-s", "-w", "\n%{http_code}", &url]);
        if let Some(t) = token {
            cmd.args(["-H", &format!("Authorization: Bearer {t}")]);
        }
        let out = String::from_utf8(cmd.output().unwrap().stdout).unwrap();
        let (body, code) = out.rsplit_once('\n').unwrap();
        (code.to_string(), body.to_string())
    };
    assert_eq!(get(None).0, "401");
    assert_eq!(get(Some("not-a-token")).0, "401");
    let audience = tether_server::AGENTS_AUDIENCE;
    let stranger = cluster.service_account_token("stranger", Some(audience));
    let (code, body) = get(Some(&stranger));
    assert_eq!(code, "403", "{body}");
    assert!(body.contains("may not get /agents"), "{body}");
    // The reader's token for kube-apiserver itself (the kind one could replay against
    // the cluster, were it read off this plain-HTTP port) is refused.
    let api_token = cluster.service_account_token("reader", None);
    assert_eq!(get(Some(&api_token)).0, "401");
    let reader = cluster.service_account_token("reader", Some(audience));
    let (code, body) = get(Some(&reader));
    assert_eq!(code, "200", "{body}");
    assert!(body.contains("edge-1"), "{body}");

    // The CCM's client, with and without its token file.
    let token_file = tokens.path().join("ccm-token");
    std::fs::write(&token_file, &reader).unwrap();
    let config = |token_file: Option<String>| tether_ccm::provider::agents::AgentsConfig {
        urls: vec![url.clone()],
        token_file,
        // The agent's TokenRequest token is bound to no pod, so nothing is verified.
        trust_unverified_identifiers: true,
        ..Default::default()
    };
    let with = tether_ccm::provider::agents::ConnectedAgents::new(&config(Some(
        token_file.display().to_string(),
    )))
    .unwrap();
    assert!(
        matches!(
            with.presence("edge-1").await,
            Ok(tether_ccm::provider::agents::Presence::Connected(_))
        ),
        "the CCM's client with its token reads /agents"
    );
    let without = tether_ccm::provider::agents::ConnectedAgents::new(&config(None)).unwrap();
    let e = without.presence("edge-1").await.unwrap_err().to_string();
    assert!(e.contains("401"), "{e}");

    // On loopback (the default bind) the listing stays open, as before.
    let open = ServerProc::start(
        bin(),
        &token_auth_server_args(&pki, &cluster.files.server_kubeconfig)
            .into_iter()
            .map(|a| a.replace("konnectivity.sock", "konnectivity-open.sock"))
            .collect::<Vec<_>>(),
    );
    let url = format!("http://{}/agents", open.admin);
    let out = std::process::Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", &url])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
}

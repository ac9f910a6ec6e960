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
    let rbac = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/rbac.yaml");
    cluster.kubectl_ok(&["apply", "-f", rbac.to_str().unwrap()]);
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

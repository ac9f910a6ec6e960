//! Item 3: one node's credential cannot hold the agent listener's connection slots. A
//! connection counts against its verified identity (at most `--max-agent-streams`), a
//! connection whose streams have all ended is closed after 10 s, and at the connection
//! cap a connection that never proved itself makes room for a new one.

use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tether_testkit::rogue::node_cert;
use tether_testkit::{metric, AgentProc, Pki, TempDir};

use super::{bin, readme_server};

/// One connection of the attacker's: TLS with `identity` (or none), HTTP/2, a Connect
/// stream as `agent_id` (with `token`), answered and then cancelled; the connection is
/// kept open. `Some(true)` when the stream was admitted, `Some(false)` when refused.
pub(crate) async fn admit_then_cancel(
    server: std::net::SocketAddr,
    pki: &Pki,
    identity: Option<(&Path, &Path)>,
    agent_id: &str,
    token: Option<&str>,
    keep: &mut Vec<h2::client::SendRequest<Bytes>>,
) -> Option<bool> {
    let tls = tether_core::tls::client_config(&pki.files.ca_cert, identity, &[b"h2"]).ok()?;
    let stream = tether_testkit::tls_connect(server, tls).await.ok()?;
    let (mut send, conn) = h2::client::handshake(stream).await.ok()?;
    tokio::spawn(conn);
    let mut request = http::Request::post("https://127.0.0.1/AgentService/Connect")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("agentid", agent_id);
    if let Some(t) = token {
        request = request.header("authorization", format!("Bearer {t}"));
    }
    let (response, mut body) = send.send_request(request.body(()).ok()?, false).ok()?;
    let response = tokio::time::timeout(Duration::from_secs(20), response)
        .await
        .ok()?
        .ok()?;
    let admitted = response.headers().contains_key("serverid");
    body.send_reset(h2::Reason::CANCEL);
    keep.push(send);
    Some(admitted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admitted_then_cancelled_connections_give_their_slots_back() {
    let _heavy = super::HEAVY.lock().await;
    let pki = Pki::new();
    let certs = TempDir::new("tether-node-certs");
    let cert_a = node_cert(bin(), &pki, certs.path(), "node-a", "127.0.0.3");
    let server = readme_server(&pki, &["--max-connections=64"]);

    // node-a opens connection after connection, has a stream admitted on each, cancels
    // it and keeps the connection: before, 64 of them locked every other agent out.
    let mut keep = Vec::new();
    let (mut admitted, mut refused) = (0, 0);
    for _ in 0..64 {
        let identity = Some((cert_a.0.as_path(), cert_a.1.as_path()));
        match admit_then_cancel(server.agent, &pki, identity, "node-a", None, &mut keep).await {
            Some(true) => admitted += 1,
            Some(false) => refused += 1,
            None => {}
        }
    }
    // --max-agent-streams (8) connections per verified identity, and a few more where
    // a slow machine took over 10 s and the first were closed as idle meanwhile.
    assert!((8..=16).contains(&admitted), "{admitted} admitted");
    assert!(refused > 0);
    let page = server.metrics().await;
    assert!(
        metric(
            &page,
            r#"tether_server_agent_streams_refused_total{reason="too_many_connections"}"#
        )
        .unwrap_or(0.0)
            >= 1.0
    );

    // Another node's agent gets in at once, while node-a keeps trying.
    let started = Instant::now();
    let node_b = pki.node_agent_args("node-b", "127.0.0.2");
    let _b = AgentProc::start(bin(), &pki, server.agent, &node_b);
    let flood = {
        let agent = server.agent;
        let (cert, key) = cert_a.clone();
        let ca = pki.files.ca_cert.clone();
        tokio::spawn(async move {
            let tls = tether_core::tls::client_config(&ca, Some((&cert, &key)), &[b"h2"]).unwrap();
            let mut held = Vec::new();
            loop {
                if let Ok(s) = tether_testkit::tls_connect(agent, tls.clone()).await {
                    held.push(s);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    server.wait_agents(1).await;
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(10), "node-b waited {waited:?}");

    // The cancelled connections are closed within the same 10 s as unadmitted ones.
    server
        .wait_refused("agent", &["idle"], 7.0, Duration::from_secs(60))
        .await;
    flood.abort();
}

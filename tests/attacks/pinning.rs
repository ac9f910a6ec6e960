//! Items 2 and 5: certificate mode pins a node's dials to its agent. The README's
//! by-hand server (certificates, `--proxy-strategies=default`, no Node watch) learns
//! each node's names and addresses from its certificate and keeps them after its agent
//! goes; every spelling of a node's address is that address or refused.

use std::sync::atomic::Ordering;

use tether_client::Client;
use tether_testkit::process::socket_path;
use tether_testkit::rogue::{certified_agent, node_cert, ping, Rogue, ROGUE};
use tether_testkit::{backend, Pki, TempDir};

use super::{bin, readme_server};

/// Dials `address` and says whether it reached the attacker (an error is a refusal).
async fn reached_attacker(client: &Client, address: &str) -> bool {
    match client.dial(address).await {
        Err(_) => false,
        Ok(mut conn) => {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let _ = conn.write_all(b"ping").await;
            let mut back = [0u8; 4];
            let read = tokio::time::timeout(
                std::time::Duration::from_secs(20),
                conn.read_exact(&mut back),
            )
            .await;
            matches!(read, Ok(Ok(_))) && &back == ROGUE
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_nodes_dials_reach_only_its_agent_connected_or_not() {
    let pki = Pki::new();
    let certs = TempDir::new("tether-node-certs");
    let cert_a = node_cert(bin(), &pki, certs.path(), "node-a", "127.0.0.3");
    let cert_b = node_cert(bin(), &pki, certs.path(), "node-b", "127.0.0.2");
    let kubelet_b = backend::echo_on("127.0.0.2").await;
    let elsewhere = backend::echo().await;
    let server = readme_server(&pki, &[]);
    assert!(
        server.proc.logged("the server watches no Nodes"),
        "certificate mode without a Node watch says what it cannot pin"
    );
    let mut node_b = certified_agent(bin(), &pki, &server, "node-b", "127.0.0.2", &cert_b);
    // node-a's own certificate, claiming nothing false.
    let rogue = Rogue::connect(&pki, server.agent, Some((&cert_a.0, &cert_a.1))).await;
    let _a = rogue
        .open("node-a", "host=node-a&ipv4=127.0.0.3", None)
        .await
        .unwrap();
    server.wait_agents(2).await;

    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let port = kubelet_b.addr.port();
    // Upstream's `default` strategy with node-b connected: all of node-b's dials go to
    // node-b (before, node-a took 9 of 20).
    for _ in 0..20 {
        assert_eq!(ping(&client, &format!("127.0.0.2:{port}")).await, b"ping");
    }
    assert_eq!(rogue.dials.load(Ordering::SeqCst), 0);

    // node-b goes. Its address and name stay its own: no dial to them reaches node-a
    // (before, 20 of 20 did).
    node_b.proc.kill();
    server.wait_agents(1).await;
    for _ in 0..10 {
        assert!(!reached_attacker(&client, &format!("127.0.0.2:{port}")).await);
        assert!(!reached_attacker(&client, &format!("node-b:{port}")).await);
    }
    // Item 5: every spelling a resolver reads as node-b's address or name.
    for spelled in [
        "0177.0.0.2",
        "127.000.000.002",
        "127.2",
        "2130706434",
        "0x7f000002",
        "127.0.0.2.",
        "[::ffff:127.0.0.2]",
        "node-b..",
        "NODE-B",
        "010.244.2.5",
        "127.0.0.2 x",
    ] {
        assert!(
            !reached_attacker(&client, &format!("{spelled}:{port}")).await,
            "{spelled}"
        );
    }
    assert_eq!(
        rogue.dials.load(Ordering::SeqCst),
        0,
        "no dial of node-b's reached node-a"
    );
    assert!(server.proc.logged("looks like an address") || server.proc.logged("spelled unusually"));

    // Dials no node owns still go by the strategies: node-a may take them.
    assert_eq!(ping(&client, &elsewhere.addr.to_string()).await, ROGUE);
}

//! Item 10, and items 2, 3, 4 and 5 where they need the cluster: the manifests' token
//! mode against the suite's real kube-apiserver (slots, an unauthenticated flood,
//! forged packets, a revoked token, a token for another audience), and certificate mode
//! with a kubeconfig, whose Node watch pins a node's addresses and names (its
//! `Hostname` among them) before its agent ever connects.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tether_client::Client;
use tether_testkit::kube::{Cluster, Egress};
use tether_testkit::process::socket_path;
use tether_testkit::rogue::{
    forged_packets_reach_no_tunnel, manifest_agent_identifiers, manifest_server_args, node_cert,
    ping, preface_flood, raise_open_files, wait_verified_ips, Rogue,
};
use tether_testkit::{backend, metric, wait_until, AgentProc, Pki, ServerProc, TempDir};

use super::slots::admit_then_cancel;
use super::{bin, readme_server};

/// The cluster both tests run against: the shipped RBAC, Nodes edge-1 (127.0.0.2, with
/// a `Hostname` of its own) and edge-2 (127.0.0.3).
fn cluster() -> Cluster {
    let cluster = Cluster::start(&Egress::Direct);
    cluster.apply_shipped_rbac();
    for (node, ip, n) in [("edge-1", "127.0.0.2", 2), ("edge-2", "127.0.0.3", 3)] {
        cluster.apply(&format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {node}\nspec:\n  podCIDR: 10.244.{n}.0/24\n  podCIDRs: [10.244.{n}.0/24]\n"
        ));
        cluster.patch_node_status(
            node,
            &format!(
                r#"{{"addresses":[{{"type":"InternalIP","address":"{ip}"}},{{"type":"Hostname","address":"{node}.lan"}},{{"type":"InternalDNS","address":"webhook.kube-system.svc"}}]}}"#
            ),
        );
    }
    cluster
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn token_mode_holds_against_slots_floods_forgeries_and_revocation() {
    let _heavy = super::HEAVY.lock().await;
    let cluster = cluster();
    let pki = Pki::new();
    let kubelet_1 = backend::echo_on("127.0.0.2").await;
    let mut args = manifest_server_args(&pki, &cluster.files.server_kubeconfig);
    args.push("--max-connections=256".into());
    let server = ServerProc::start(bin(), &args);
    let tokens = TempDir::new("tether-tokens");
    let token_1 = cluster.pod_bound_agent_token("konnectivity-agent-edge-1", "edge-1");
    let edge_1 = || {
        AgentProc::start_with_token(
            bin(),
            &pki,
            server.agent,
            tokens.path(),
            "edge-1",
            &token_1,
            &[format!(
                "--agent-identifiers={}",
                manifest_agent_identifiers("edge-1", "127.0.0.2")
            )],
        )
    };
    let mut agent_1 = edge_1();
    wait_verified_ips(&server, "edge-1", serde_json::json!(["127.0.0.2"])).await;

    // Slots: edge-2's valid token, admitted then cancelled on connection after
    // connection (before: 1,907 connections held, a restarted agent kept out 56 s).
    let token_2 = cluster.pod_bound_agent_token("konnectivity-agent-edge-2", "edge-2");
    let mut keep = Vec::new();
    let mut admitted = 0;
    for _ in 0..100 {
        let r = admit_then_cancel(
            server.agent,
            &pki,
            None,
            "edge-2",
            Some(&token_2),
            &mut keep,
        )
        .await;
        admitted += usize::from(r == Some(true));
    }
    assert!((8..=16).contains(&admitted), "{admitted} admitted");
    agent_1.proc.kill();
    server.wait_agents(0).await;
    let started = Instant::now();
    agent_1 = edge_1();
    server.wait_agents(1).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "edge-1 back in {:?}",
        started.elapsed()
    );
    drop(keep);

    // Anyone finishes TLS and the HTTP/2 preface here: 40 sources x 32, reopened as
    // they close (before: 40 sources held 7,264 descriptors for 10 s each).
    raise_open_files();
    let opened = Arc::new(AtomicUsize::new(0));
    let flood = tokio::spawn(preface_flood(
        server.agent,
        pki.files.ca_cert.clone(),
        40,
        32,
        opened.clone(),
    ));
    wait_until(
        "the flood's connections open",
        Duration::from_secs(60),
        || async { (opened.load(Ordering::Relaxed) > 1000).then_some(()) },
    )
    .await;
    agent_1.proc.kill();
    server.wait_agents(0).await;
    let started = Instant::now();
    agent_1 = edge_1();
    server.wait_agents(1).await;
    let took = started.elapsed();
    let held = std::fs::read_dir(format!("/proc/{}/fd", server.proc.pid()))
        .unwrap()
        .count();
    flood.abort();
    eprintln!(
        "under the preface flood: edge-1 back in {took:?}; the server held {held} descriptors"
    );
    assert!(took < Duration::from_secs(10), "edge-1 back in {took:?}");
    assert!(held < 1024 + 256, "the server held {held} descriptors");

    // Forged packets on edge-2's own stream reach none of edge-1's tunnels.
    let rogue = Rogue::connect(&pki, server.agent, None).await;
    let own = rogue.open("edge-2", "", Some(&token_2)).await.unwrap();
    server.wait_agents(2).await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let victim = kubelet_1.addr.to_string();
    forged_packets_reach_no_tunnel(&client, &own, &victim, "127.0.0.3:9", 16).await;
    assert_eq!(ping(&client, &kubelet_1.addr.to_string()).await, b"ping");

    // A token for another audience: refused, with the server's words only.
    let wrong = cluster.service_account_token("konnectivity-agent", Some("not-the-server"));
    let refused = rogue.open("edge-2", "", Some(&wrong)).await.err().unwrap();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    assert_eq!(refused.message(), "token not accepted");

    // Revocation: edge-2's Pod is deleted. Its live stream ends at the next review
    // (30 s and jitter), with a log line and a metric; before, it stayed up for good.
    let started = Instant::now();
    cluster.kubectl_ok(&[
        "delete",
        "pod",
        "-n",
        "kube-system",
        "konnectivity-agent-edge-2",
        "--grace-period=0",
        "--force",
    ]);
    tokio::time::timeout(Duration::from_secs(90), own.out.closed())
        .await
        .expect("the revoked token's stream ended within 90 s");
    eprintln!(
        "a revoked token's stream ended {:?} after its Pod was deleted",
        started.elapsed()
    );
    let page = server.metrics().await;
    assert_eq!(
        metric(&page, "tether_server_agent_streams_revoked_total"),
        Some(1.0)
    );
    assert!(server.proc.logged("no longer passes a review"));
    server.wait_agents(1).await;
    drop(agent_1);
}

/// Items 2 and 5 with a Node watch: certificate mode given a kubeconfig pins edge-1's
/// address, name and Hostname to edge-1's agent before it ever connected, so node-a's
/// certificate (with upstream's `default` strategy) takes none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn certificate_mode_with_a_kubeconfig_pins_nodes_from_the_start() {
    let cluster = cluster();
    let pki = Pki::new();
    let certs = TempDir::new("tether-node-certs");
    let cert_a = node_cert(bin(), &pki, certs.path(), "node-a", "127.0.0.9");
    let kubelet_1 = backend::echo_on("127.0.0.2").await;
    let kubeconfig = format!("--kubeconfig={}", cluster.files.server_kubeconfig.display());
    let server = readme_server(&pki, &[&kubeconfig]);
    assert!(!server.proc.logged("the server watches no Nodes"));
    wait_until("the Nodes are known", Duration::from_secs(60), || async {
        server
            .proc
            .logged("the nodes' addresses and pod networks are known")
            .then_some(())
    })
    .await;
    let rogue = Rogue::connect(&pki, server.agent, Some((&cert_a.0, &cert_a.1))).await;
    let _a = rogue.open("node-a", "", None).await.unwrap();
    server.wait_agents(1).await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    let port = kubelet_1.addr.port();
    for host in [
        "127.0.0.2",
        "edge-1",
        "edge-1.lan",
        "EDGE-1.LAN.",
        "10.244.2.7",
    ] {
        let refused = client.dial(&format!("{host}:{port}")).await.err();
        assert!(refused.is_some(), "{host}");
    }
    assert_eq!(rogue.dials.load(Ordering::SeqCst), 0);

    // edge-1's agent (its own certificate) takes them once it connects.
    let _edge_1 = AgentProc::start(
        bin(),
        &pki,
        server.agent,
        &pki.node_agent_args("edge-1", "127.0.0.2"),
    );
    server.wait_agents(2).await;
    for _ in 0..10 {
        assert_eq!(ping(&client, &format!("127.0.0.2:{port}")).await, b"ping");
    }
    // Its Hostname is routed to it (its resolver then decides; here it knows no such
    // name, so the dial fails there, not at the attacker).
    let _ = client.dial(&format!("edge-1.lan:{port}")).await;
    assert_eq!(rogue.dials.load(Ordering::SeqCst), 0);
    // A name edge-1's kubelet lists that is not its own (a webhook Service's) is not
    // edge-1's to take: it goes by the strategies, as before any kubelet listed it.
    let routed = client
        .dial(&format!("webhook.kube-system.svc:{port}"))
        .await;
    assert!(
        routed
            .as_ref()
            .err()
            .is_none_or(|e| !e.to_string().contains("No agent available")),
        "a Service name was pinned to the nodes that listed it: {:?}",
        routed.err()
    );
}

/// Item 5 of the review: a server that watches Nodes sends no dial to just any agent
/// until it has read them; but one the apiserver refuses the watch (the Kubernetes docs'
/// RBAC grants only TokenReviews) says so loudly and routes as without a watch, rather
/// than failing every dial of a cluster swapped in from upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_server_refused_the_node_watch_says_so_and_routes_as_without_it() {
    let cluster = cluster();
    cluster.kubectl_ok(&[
        "delete",
        "clusterrolebinding",
        "system:konnectivity-server:nodes",
    ]);
    let pki = Pki::new();
    let target = backend::echo().await;
    let server = ServerProc::start(
        bin(),
        &manifest_server_args(&pki, &cluster.files.server_kubeconfig),
    );
    wait_until("the refusal logged", Duration::from_secs(60), || async {
        server
            .proc
            .logged("the apiserver refuses this server list and watch on nodes")
            .then_some(())
    })
    .await;
    let tokens = TempDir::new("tether-tokens");
    let token = cluster.pod_bound_agent_token("konnectivity-agent-edge-1", "edge-1");
    let _agent = AgentProc::start_with_token(
        bin(),
        &pki,
        server.agent,
        tokens.path(),
        "edge-1",
        &token,
        &["--agent-identifiers=host=edge-1".into()],
    );
    server.wait_agents(1).await;
    let client = Client::uds(socket_path(pki.dir())).await.unwrap();
    assert_eq!(ping(&client, &target.addr.to_string()).await, b"ping");
}

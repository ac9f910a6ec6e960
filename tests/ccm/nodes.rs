//! Nodes: initialised from the inventory, tainted on shutdown and deleted when gone;
//! nodes vouched for by a connected (and verified) agent, kept through an agent's long
//! absence; an upstream command line on a dual-stack node.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use tether_testkit::ccm::{
    add_uninitialized_node, inventory_dir, node_json, scrape, start_ccm, start_ccm_with,
    wait_for_event, wait_node, write_inventory, write_machines, Tunnel,
};
use tether_testkit::kube::{free_port, wait_blocking, Cluster, Egress};
use tether_testkit::netns::Node;
use tether_testkit::process::token_auth_server_args;
use tether_testkit::{AgentProc, Pki, ServerProc, TempDir};

use crate::BIN;

fn taint_keys(node: &Value) -> Vec<String> {
    node["spec"]["taints"]
        .as_array()
        .map(|t| {
            t.iter()
                .map(|t| t["key"].as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn nodes_are_initialized_tainted_on_shutdown_and_deleted_when_gone() {
    let cluster = Cluster::start(&Egress::Direct);
    let (_dir, inventory) = inventory_dir();
    write_machines(
        &inventory,
        &[("node-a", "10.0.0.1", false), ("node-b", "10.0.0.2", false)],
    );
    add_uninitialized_node(&cluster, "node-a", "10.0.0.1");
    add_uninitialized_node(&cluster, "node-b", "10.0.0.2");
    add_uninitialized_node(&cluster, "stranger", "10.0.0.9");
    // Ready, so the lifecycle controller leaves it alone (a NotReady node the provider
    // does not know is deleted, as upstream does).
    cluster.set_node_ready("stranger", true);
    let ccm = start_ccm(Path::new(BIN), &cluster, &inventory, "ccm");

    // Initialised: provider ID, labels and their beta twins, addresses with the
    // provided node IP first, taint gone.
    let a = wait_node(&cluster, "node-a", "initialized", |n| {
        !taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into())
    });
    assert_eq!(a["spec"]["providerID"], "tether://node-a");
    let labels = &a["metadata"]["labels"];
    assert_eq!(labels["topology.kubernetes.io/zone"], "eu-west-1a");
    assert_eq!(
        labels["failure-domain.beta.kubernetes.io/zone"],
        "eu-west-1a"
    );
    assert_eq!(labels["topology.kubernetes.io/region"], "eu-west");
    assert_eq!(
        labels["failure-domain.beta.kubernetes.io/region"],
        "eu-west"
    );
    assert_eq!(labels["node.kubernetes.io/instance-type"], "bare-metal");
    assert_eq!(labels["beta.kubernetes.io/instance-type"], "bare-metal");
    let addresses = &a["status"]["addresses"];
    assert_eq!(addresses[0]["address"], "10.0.0.1", "{addresses}");
    assert_eq!(addresses[0]["type"], "InternalIP");
    assert_eq!(addresses[1]["address"], "203.0.113.1");
    wait_for_event(&cluster, "node-a", "Synced");

    // A node the provider does not know stays uninitialized, with a warning event.
    wait_for_event(&cluster, "stranger", "InstanceNotFound");
    let stranger = node_json(&cluster, "stranger").unwrap();
    assert!(
        taint_keys(&stranger).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into())
    );

    // Shut down: NotReady + machine off -> shutdown taint; Ready again -> removed.
    wait_node(&cluster, "node-b", "initialized", |n| {
        n["spec"]["providerID"] == "tether://node-b"
    });
    write_machines(
        &inventory,
        &[("node-a", "10.0.0.1", true), ("node-b", "10.0.0.2", false)],
    );
    cluster.set_node_ready("node-a", false);
    wait_node(&cluster, "node-a", "shutdown taint", |n| {
        taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/shutdown".into())
    });
    cluster.set_node_ready("node-a", true);
    wait_node(&cluster, "node-a", "shutdown taint removed", |n| {
        !taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/shutdown".into())
    });

    // Gone from the inventory and NotReady: the Node is deleted. A Ready node that is
    // gone is left alone (upstream checks only nodes that are not Ready).
    // (NotReady first: once it is gone from the inventory, a NotReady node may be
    // deleted at the next monitor period.)
    cluster.set_node_ready("node-b", false);
    write_machines(&inventory, &[("node-a", "10.0.0.1", false)]);
    wait_blocking("node-b deleted", Duration::from_secs(30), || {
        node_json(&cluster, "node-b").is_none().then_some(())
    });
    assert!(node_json(&cluster, "node-a").is_some());
    assert!(ccm.logged("node initialized"));
}

#[test]
fn a_node_whose_agent_is_connected_exists_without_being_in_the_inventory() {
    let node = Node::create();
    let mut tunnel = Tunnel::start(
        Path::new(BIN),
        &node,
        "edge-1",
        &format!("host=edge-1&ipv4={}", node.node_ip),
    );
    let server = &tunnel.server;
    let cluster = Cluster::start(&Egress::Direct);
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        // Lab settings: the test server does not verify identifiers, and deletion is
        // opted in with no delay.
        &format!(
            "agents:\n  urls: [http://{}/agents]\n  deleteNodesAfterSeconds: 0\n  trustUnverifiedIdentifiers: true\nnodes: []\n",
            server.admin
        ),
    );
    add_uninitialized_node(&cluster, "edge-1", &node.node_ip);
    let _ccm = start_ccm(Path::new(BIN), &cluster, &inventory, "ccm");
    let n = wait_node(&cluster, "edge-1", "initialized from its agent", |n| {
        !taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into())
    });
    assert_eq!(n["spec"]["providerID"], "tether://edge-1");
    assert_eq!(
        n["status"]["addresses"][0]["address"],
        node.node_ip.as_str()
    );
    assert_eq!(
        n["metadata"]["labels"]["tether.dev/instance-source"],
        "agent"
    );
    // NotReady but its agent is connected: it exists, so it stays. A NotReady node
    // this CCM initialised from the inventory and no longer listed is deleted in the
    // same lifecycle pass, which proves the pass ran.
    cluster.set_node_ready("edge-1", false);
    // (No Ready condition at all counts as not Ready, as upstream; it may be deleted
    // at once, so nothing else is written to it.)
    cluster.apply("apiVersion: v1\nkind: Node\nmetadata:\n  name: ghost\n  labels: {tether.dev/instance-source: inventory}\nspec:\n  providerID: tether://ghost\n");
    // Never initialised by us: never deleted, one Warning event instead.
    cluster.apply("apiVersion: v1\nkind: Node\nmetadata:\n  name: stray\n");
    wait_for_event(&cluster, "stray", "DeletionWithheld");
    assert!(node_json(&cluster, "stray").is_some());
    wait_blocking("ghost deleted", Duration::from_secs(30), || {
        node_json(&cluster, "ghost").is_none().then_some(())
    });
    assert!(
        node_json(&cluster, "edge-1").is_some(),
        "edge-1 was deleted while its agent was connected"
    );
    // Its agent leaves (grace period 0): NotReady and gone, so it is deleted.
    tunnel.agent.proc.kill();
    wait_blocking("edge-1 deleted", Duration::from_secs(30), || {
        node_json(&cluster, "edge-1").is_none().then_some(())
    });
}

/// Waits, without sleeping, until lifecycle passes have run for `long` from now: each
/// round registers a node this CCM initialised from an inventory that no longer lists it
/// (NotReady), which the next pass deletes. (The agent listing is cached for 2 s, so
/// passes past that have seen a fresh one.)
fn prove_lifecycle_passes_for(cluster: &Cluster, long: Duration) {
    let since = Instant::now();
    let mut round = 0;
    while since.elapsed() < long {
        round += 1;
        let ghost = format!("ghost-{round}");
        cluster.apply(&format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {ghost}\n  labels: {{tether.dev/instance-source: inventory}}\nspec:\n  providerID: tether://{ghost}\n"
        ));
        wait_blocking(&format!("{ghost} deleted"), Duration::from_secs(30), || {
            node_json(cluster, &ghost).is_none().then_some(())
        });
    }
    assert!(round >= 2, "the lifecycle passes did not run");
}

fn token_agent(
    pki: &Pki,
    server: &ServerProc,
    dir: &Path,
    id: &str,
    ids: &str,
    token: &str,
) -> AgentProc {
    AgentProc::start_with_token(
        Path::new(BIN),
        pki,
        server.agent,
        dir,
        id,
        token,
        &[format!("--agent-identifiers={ids}")],
    )
}

fn agents_listing(server: &ServerProc) -> Value {
    let out = Command::new("curl")
        .args([
            "-s",
            "--max-time",
            "5",
            &format!("http://{}/agents", server.admin),
        ])
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

/// A cluster with the shipped RBAC, and a Tether server authenticating agents by
/// pod-bound tokens against it, as the manifests run it.
fn cluster_with_token_server() -> (Cluster, Pki, ServerProc) {
    let cluster = Cluster::start(&Egress::Direct);
    cluster.apply_shipped_rbac();
    let pki = Pki::new();
    let server = ServerProc::start(
        Path::new(BIN),
        &token_auth_server_args(&pki, &cluster.files.server_kubeconfig),
    );
    (cluster, pki, server)
}

/// With the shipped token authentication: an agent whose token is bound to a Pod on
/// node edge-1 is vouched for by the server as edge-1, and that node is initialised from
/// it; another agent's bare claim to be edge-2 changes nothing but one event. When
/// edge-1's agent goes away for good, the NotReady node stays (many lifecycle passes
/// later, each proven by a node deleted beside it); only the opt-in policy deletes it.
#[test]
fn only_verified_agents_vouch_for_nodes_and_an_absent_agent_costs_no_node() {
    let (cluster, pki, server) = cluster_with_token_server();
    let tokens = TempDir::new("tether-tokens");
    let bound = cluster.pod_bound_agent_token("konnectivity-agent-edge-1", "edge-1");
    let mut verified = token_agent(
        &pki,
        &server,
        tokens.path(),
        "edge-1",
        "host=edge-1&ipv4=127.0.0.1",
        &bound,
    );
    // A valid token of the right ServiceAccount, bound to no pod: admitted, unverified.
    let unbound =
        cluster.service_account_token("konnectivity-agent", Some("system:konnectivity-server"));
    let _claimer = token_agent(
        &pki,
        &server,
        tokens.path(),
        "edge-2",
        "host=edge-2&ipv4=127.0.0.2",
        &unbound,
    );
    let listing = wait_blocking("both agents listed", Duration::from_secs(30), || {
        let v = agents_listing(&server);
        (v["agents"].as_array().map(|a| a.len()) == Some(2)).then_some(v)
    });
    let agent = |id: &str| {
        listing["agents"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["id"] == id)
            .unwrap()
            .clone()
    };
    assert_eq!(
        agent("edge-1")["verifiedBy"],
        "serviceaccount-token",
        "{listing}"
    );
    assert_eq!(
        agent("edge-1")["verifiedHosts"],
        serde_json::json!(["edge-1"]),
        "{listing}"
    );
    assert!(
        agent("edge-1")["verifiedIps"]
            .as_array()
            .unwrap()
            .is_empty(),
        "a token proves no address: {listing}"
    );
    assert_eq!(agent("edge-2")["verifiedBy"], "", "{listing}");
    assert!(
        agent("edge-2")["verifiedHosts"]
            .as_array()
            .unwrap()
            .is_empty(),
        "{listing}"
    );

    let (_dir, inventory) = inventory_dir();
    let agents_only = format!(
        "agents:\n  urls: [http://{}/agents]\nnodes: []\n",
        server.admin
    );
    write_inventory(&inventory, &agents_only);
    // edge-1's kubelet was given --node-ip, so it reports that address (a 1.29+ kubelet
    // with --cloud-provider=external reports none without it: the next test).
    add_uninitialized_node(&cluster, "edge-1", "127.0.0.1");
    cluster.patch_node_status(
        "edge-1",
        r#"{"addresses":[{"type":"InternalIP","address":"127.0.0.1"}]}"#,
    );
    add_uninitialized_node(&cluster, "edge-2", "");
    let mut ccm = start_ccm(Path::new(BIN), &cluster, &inventory, "ccm");
    let n = wait_node(
        &cluster,
        "edge-1",
        "initialised from its verified agent",
        |n| !taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into()),
    );
    assert_eq!(n["spec"]["providerID"], "tether://edge-1");
    assert_eq!(
        n["metadata"]["labels"]["tether.dev/instance-source"],
        "agent"
    );
    wait_for_event(&cluster, "edge-2", "UnverifiedAgentIdentity");
    let edge2 = node_json(&cluster, "edge-2").unwrap();
    assert!(
        taint_keys(&edge2).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into())
            && edge2["spec"]["providerID"].is_null(),
        "an unverified claim initialised edge-2: {edge2}"
    );

    // The WAN link to edge-1 goes: NotReady, its agent gone from every server.
    cluster.set_node_ready("edge-1", false);
    verified.proc.kill();
    wait_blocking("edge-1's agent gone", Duration::from_secs(30), || {
        let v = agents_listing(&server);
        (!v.to_string().contains("\"edge-1\"")).then_some(())
    });
    prove_lifecycle_passes_for(&cluster, Duration::from_secs(6));
    let kept = node_json(&cluster, "edge-1").expect("edge-1 was deleted while its agent was away");
    assert_eq!(kept["spec"]["providerID"], "tether://edge-1");
    assert!(!ccm.exited(), "{}", ccm.log_text());
    drop(ccm);

    // The operator opts in: away longer than 1 s (since this CCM started) and NotReady.
    write_inventory(
        &inventory,
        &format!(
            "agents:\n  urls: [http://{}/agents]\n  deleteNodesAfterSeconds: 1\nnodes: []\n",
            server.admin
        ),
    );
    let _ccm = start_ccm(Path::new(BIN), &cluster, &inventory, "ccm-opt-in");
    wait_blocking(
        "edge-1 deleted under the opt-in policy",
        Duration::from_secs(30),
        || node_json(&cluster, "edge-1").is_none().then_some(()),
    );
    assert!(
        node_json(&cluster, "edge-2").is_some(),
        "edge-2 was never ours to delete"
    );
}

/// Kubernetes 1.29+ node bootstrap, emulated on 1.20: a kubelet with
/// `--cloud-provider=external` and no `--node-ip` registers a Node with no address and
/// no `provided-node-ip`, and the DaemonSet's agent (a pod-bound token, claiming only
/// its node) connects without one. With no inventory entry the node stays uninitialized
/// with a `NodeAddressesUnknown` event, a log line and a metric that name the fix; an
/// impostor node's agent claiming the address edge-3 will have gains nothing; once the
/// operator lists edge-3's address in the inventory it is initialised with it, and its
/// dials go to its own agent.
#[test]
fn a_node_no_one_gives_an_address_says_how_to_fix_it_and_no_impostor_gains() {
    let (cluster, pki, server) = cluster_with_token_server();
    add_uninitialized_node(&cluster, "edge-3", "");
    add_uninitialized_node(&cluster, "edge-4", "127.0.0.4");
    cluster.patch_node_status(
        "edge-4",
        r#"{"addresses":[{"type":"InternalIP","address":"127.0.0.4"}]}"#,
    );
    let tokens = TempDir::new("tether-tokens");
    let token_3 = cluster.pod_bound_agent_token("konnectivity-agent-edge-3", "edge-3");
    let _edge_3 = token_agent(
        &pki,
        &server,
        tokens.path(),
        "edge-3",
        "host=edge-3",
        &token_3,
    );
    // edge-4's agent (its own valid token) claims the address edge-3 is about to get.
    let token_4 = cluster.pod_bound_agent_token("konnectivity-agent-edge-4", "edge-4");
    let _edge_4 = token_agent(
        &pki,
        &server,
        tokens.path(),
        "edge-4",
        "host=edge-4&ipv4=127.0.0.3",
        &token_4,
    );
    wait_blocking("both agents connected", Duration::from_secs(60), || {
        (agents_listing(&server)["agents"]
            .as_array()
            .map(|a| a.len())
            == Some(2))
        .then_some(())
    });
    let (_dir, inventory) = inventory_dir();
    let agents = format!("agents:\n  urls: [http://{}/agents]\n", server.admin);
    write_inventory(&inventory, &format!("{agents}nodes: []\n"));
    let port = free_port();
    let ccm = start_ccm_with(
        Path::new(BIN),
        &cluster,
        &inventory,
        "ccm",
        &[
            format!("--secure-port={port}"),
            "--bind-address=127.0.0.1".into(),
        ],
    );
    wait_for_event(&cluster, "edge-3", "NodeAddressesUnknown");
    let n = node_json(&cluster, "edge-3").unwrap();
    assert!(
        taint_keys(&n).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into()),
        "a node without an address stays uninitialized: {n}"
    );
    wait_blocking(
        "the log line naming the fix",
        Duration::from_secs(30),
        || ccm.logged("Give the kubelet --node-ip").then_some(()),
    );
    scrape(
        &cluster,
        &format!("https://127.0.0.1:{port}"),
        &["tether_ccm_node_initialization_failures_total{reason=\"no_addresses\"}"],
    );
    // edge-4 itself is initialised with its own address only.
    let n = wait_node(&cluster, "edge-4", "initialised", |n| {
        n["spec"]["providerID"] == "tether://edge-4"
    });
    assert_eq!(
        n["status"]["addresses"],
        serde_json::json!([{"type": "InternalIP", "address": "127.0.0.4"}]),
        "the claimed 127.0.0.3 is not edge-4's"
    );

    // The operator's fix: edge-3 in the inventory with its address.
    write_inventory(
        &inventory,
        &format!("{agents}nodes:\n- name: edge-3\n  addresses:\n  - {{type: InternalIP, address: 127.0.0.3}}\n"),
    );
    // At the next retry (every 30 s for a node without an address).
    let n = wait_blocking(
        "edge-3 initialised from the inventory",
        Duration::from_secs(90),
        || {
            node_json(&cluster, "edge-3").filter(|n| {
                !taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into())
            })
        },
    );
    assert_eq!(n["status"]["addresses"][0]["address"], "127.0.0.3");
    // Its address is its agent's to dial; edge-4's claim takes none of it.
    let listing = wait_blocking("edge-3 owns 127.0.0.3", Duration::from_secs(30), || {
        let v = agents_listing(&server);
        let owned = |id: &str| {
            v["agents"]
                .as_array()?
                .iter()
                .find(|a| a["id"] == id)
                .map(|a| a["verifiedIps"].clone())
        };
        (owned("edge-3")? == serde_json::json!(["127.0.0.3"])).then(|| v.clone())
    });
    let edge_4 = listing["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["id"] == "edge-4")
        .unwrap();
    assert_eq!(
        edge_4["verifiedIps"],
        serde_json::json!(["127.0.0.4"]),
        "{listing}"
    );
    drop(ccm);
}

/// A kubelet 1.29+ dual-stack registration (`--node-ip v4,v6` in the provided-node-ip
/// annotation, its Hostname address) under an upstream CCM command line: canonical
/// controller names, --use-service-account-credentials, the delegated-auth kubeconfigs,
/// --concurrent-node-syncs. Then the upstream metrics are scraped.
#[test]
fn an_upstream_command_line_initialises_a_dual_stack_node_and_serves_upstream_metrics() {
    let cluster = Cluster::start(&Egress::Direct);
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        "nodes:\n- name: dual-1\n  zone: z1\n  labels: {example.com/rack: r1}\n  addresses:\n  - {type: InternalIP, address: 10.0.0.5}\n  - {type: InternalIP, address: 10.0.0.99}\n  - {type: InternalIP, address: fd00::5}\n  - {type: ExternalIP, address: 203.0.113.5}\n",
    );
    cluster.apply(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: dual-1\n  annotations:\n    alpha.kubernetes.io/provided-node-ip: \"10.0.0.5,fd00::5\"\nspec:\n  taints:\n  - key: node.cloudprovider.kubernetes.io/uninitialized\n    value: \"true\"\n    effect: NoSchedule\n",
    );
    cluster.patch_node_status(
        "dual-1",
        r#"{"addresses":[{"type":"InternalIP","address":"10.0.0.5"},{"type":"Hostname","address":"dual-1"}]}"#,
    );
    let kubeconfig = cluster.ccm_kubeconfig();
    let port = free_port();
    let upstream: Vec<String> = vec![
        "--controllers=*,-node-route-controller,-service-lb-controller,cloud-node-controller"
            .into(),
        "--use-service-account-credentials=true".into(),
        format!("--authentication-kubeconfig={}", kubeconfig.display()),
        format!("--authorization-kubeconfig={}", kubeconfig.display()),
        "--concurrent-node-syncs=2".into(),
        "--leader-elect-resource-lock=leases".into(),
        "--allocate-node-cidrs=false".into(),
        "--configure-cloud-routes=false".into(),
        "--cloud-provider=tether".into(),
        format!("--secure-port={port}"),
        "--bind-address=127.0.0.1".into(),
        "--v=2".into(),
    ];
    let mut ccm = start_ccm_with(Path::new(BIN), &cluster, &inventory, "ccm", &upstream);
    let n = wait_node(&cluster, "dual-1", "initialised", |n| {
        n["spec"]["providerID"] == "tether://dual-1"
    });
    let addresses: Vec<(String, String)> = n["status"]["addresses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["type"].as_str().unwrap().into(),
                a["address"].as_str().unwrap().into(),
            )
        })
        .collect();
    let pair = |t: &str, a: &str| (t.to_string(), a.to_string());
    assert_eq!(
        addresses,
        vec![
            pair("InternalIP", "10.0.0.5"),
            pair("InternalIP", "fd00::5"),
            pair("ExternalIP", "203.0.113.5"),
            pair("Hostname", "dual-1"),
        ],
        "provided IPs first, the other v4 InternalIP left out as upstream, the kubelet's Hostname kept"
    );
    assert_eq!(n["metadata"]["labels"]["example.com/rack"], "r1");
    // It acted as node-controller, with a token of its own.
    let sa = cluster.kubectl_ok(&[
        "get",
        "serviceaccount",
        "node-controller",
        "-n",
        "kube-system",
        "-o",
        "name",
    ]);
    assert!(sa.contains("node-controller"), "{sa}");
    assert!(
        ccm.logged("controllers use their own ServiceAccount credentials"),
        "{}",
        ccm.log_text()
    );

    scrape(
        &cluster,
        &format!("https://127.0.0.1:{port}"),
        &[
            "workqueue_adds_total{name=\"node\"}",
            "workqueue_depth{name=\"node\"}",
            "workqueue_work_duration_seconds_count{name=\"node\"}",
            "workqueue_queue_duration_seconds_count{name=\"node\"}",
            "leader_election_master_status{name=\"cloud-controller-manager\"} 1",
            "rest_client_requests_total{code=\"201\",host=",
            "rest_client_request_duration_seconds_count{",
            "node_controller_node_initializations_total{result=\"initialized\"} 1",
            "service_controller_loadbalancer_sync_total 0",
            "route_controller_route_sync_total 0",
        ],
    );
    tether_testkit::stop_ccm_and_check_its_tokens_are_gone(&mut ccm);
}

/// A real node (containerd, kubelet with --cloud-provider=external, the agent-only
/// binary) known only through its agent is initialised from it; the site then goes dark
/// (its agent gone, the link down so the kubelet cannot report) and the node is marked
/// NotReady: it stays, with its pod, through lifecycle passes well past every grace
/// period; only the operator's opt-in deletes it.
#[test]
fn a_real_node_survives_its_agents_long_absence() {
    if let Err(why) = tether_testkit::node::available() {
        panic!("real nodes unavailable: {why} (run scripts/install-kube.sh)");
    }
    let net = Node::create();
    let pki = Pki::with_sans(std::slice::from_ref(&net.host_ip));
    let frontend = tether_testkit::kube::Frontend::GrpcUds;
    let server = ServerProc::start(Path::new(BIN), &frontend.server_args(&pki));
    let cluster = Cluster::start_with(
        &frontend.egress(&pki, &server),
        &tether_testkit::kube::ClusterOptions {
            reachable_from_nodes: true,
            ..Default::default()
        },
    );
    let opts = tether_testkit::node::NodeOptions {
        external_cloud_provider: true,
        ..Default::default()
    };
    let mut node = tether_testkit::node::RealNode::start_on(net, &cluster, "edge-real", &opts);
    node.start_agent(
        Path::new(env!("CARGO_BIN_EXE_tether-agent")),
        &pki,
        server.agent.port(),
        &[],
    );
    let (_dir, inventory) = inventory_dir();
    // The test server does not verify identifiers (see the verified-agent test for that).
    let lab = format!(
        "agents:\n  urls: [http://{}/agents]\n  trustUnverifiedIdentifiers: true\nnodes: []\n",
        server.admin
    );
    write_inventory(&inventory, &lab);
    let ccm = start_ccm(Path::new(BIN), &cluster, &inventory, "ccm");
    let n = wait_node(&cluster, "edge-real", "initialised from its agent", |n| {
        !taint_keys(n).contains(&"node.cloudprovider.kubernetes.io/uninitialized".into())
    });
    assert_eq!(n["spec"]["providerID"], "tether://edge-real");
    assert_eq!(n["status"]["addresses"][0]["address"], node.ip());
    node.run_pod(
        &cluster,
        "survivor",
        "app: survivor",
        &format!("  - name: c\n    image: {}\n    imagePullPolicy: Never\n    command: [sleep, '3600']\n", tether_testkit::node::BUSYBOX_IMAGE),
    );

    // The site goes dark: its agent's stream ends, then the WAN link goes down so that
    // the kubelet cannot report either.
    node.agent.as_mut().unwrap().proc.kill();
    node.net.set_link(false);
    wait_blocking(
        "the agent gone from the server",
        Duration::from_secs(60),
        || {
            (!agents_listing(&server)
                .to_string()
                .contains("\"edge-real\""))
            .then_some(())
        },
    );
    cluster.set_node_ready("edge-real", false);
    prove_lifecycle_passes_for(&cluster, Duration::from_secs(6));
    let kept = node_json(&cluster, "edge-real").expect("the node was deleted during the outage");
    assert_eq!(kept["spec"]["providerID"], "tether://edge-real");
    assert!(
        cluster
            .kubectl(&["get", "pod", "survivor"])
            .status
            .success(),
        "the node's pod is gone"
    );
    drop(ccm);

    // The operator opts in to deleting nodes whose agent is away (here: 1 s).
    write_inventory(
        &inventory,
        &lab.replace("nodes: []", "  deleteNodesAfterSeconds: 1\nnodes: []"),
    );
    let _ccm = start_ccm(Path::new(BIN), &cluster, &inventory, "ccm-opt-in");
    wait_blocking(
        "edge-real deleted under the opt-in policy",
        Duration::from_secs(30),
        || node_json(&cluster, "edge-real").is_none().then_some(()),
    );
    node.net.set_link(true);
}

//! Pod-network routes in the routing table of the CCM's host: programmed, repaired,
//! refused with an event, and kept on the leader's host alone.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tether_testkit::ccm::{
    add_node_with_pod_cidr, inventory_dir, node_json, start_ccm_in, wait_for_event, wait_node,
    write_inventory,
};
use tether_testkit::kube::{wait_blocking, Cluster, Egress};
use tether_testkit::netns::Node;
use tether_testkit::process::START_TIMEOUT;
use tether_testkit::TempDir;

use crate::BIN;

/// The NetworkUnavailable condition of `node`: (status, reason).
fn network_unavailable(node: &Value) -> Option<(String, String)> {
    node["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "NetworkUnavailable")
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_string(),
                c["reason"].as_str().unwrap_or_default().to_string(),
            )
        })
}

#[test]
fn pod_routes_are_programmed_in_the_hosts_routing_table() {
    // The CCM runs in a namespace of its own (its "host"); 10.233.0.0/24 is a network
    // directly attached there (a veth pair inside the namespace), where the nodes'
    // InternalIPs live.
    let host = Node::router_host();
    // Routes that are not ours to touch: a foreign one in the pod network, one of ours
    // (protocol 84) outside --cluster-cidr; and a stale one of ours that must go.
    host.ip(&[
        "route",
        "add",
        "10.244.200.0/24",
        "via",
        "10.233.0.50",
        "proto",
        "static",
    ]);
    host.ip(&[
        "route",
        "add",
        "10.98.0.0/24",
        "via",
        "10.233.0.51",
        "proto",
        "84",
    ]);
    host.ip(&[
        "route",
        "add",
        "10.244.99.0/24",
        "via",
        "10.233.0.52",
        "proto",
        "84",
    ]);

    let cluster = Cluster::start(&Egress::Direct);
    let relay_dir = TempDir::new("tether-relay");
    let api_port: u16 = cluster.url.rsplit(':').next().unwrap().parse().unwrap();
    let _relays = host.reach_host_port(api_port, relay_dir.path());
    add_node_with_pod_cidr(&cluster, "n1", "10.233.0.2", "10.244.1.0/24");
    add_node_with_pod_cidr(&cluster, "n2", "10.233.0.3", "10.244.2.0/24");
    // Its next hop is not on an attached network: the kernel refuses the route.
    add_node_with_pod_cidr(&cluster, "n3", "10.240.0.9", "10.244.3.0/24");
    // Outside --cluster-cidr: no route, no condition.
    add_node_with_pod_cidr(&cluster, "n4", "10.233.0.5", "10.97.0.0/24");

    let (_dir, inventory) = inventory_dir();
    // Routes are opt-in: the `routes:` section makes this host the pod-network router.
    write_inventory(&inventory, "routes: {}\nnodes: []\n");
    let mut ccm = start_ccm_in(
        Path::new(BIN),
        Some(&host),
        &cluster,
        &inventory,
        "ccm",
        &[
            "--controllers=route".into(),
            "--leader-elect=false".into(),
            "--secure-port=0".into(),
            "--cluster-cidr=10.244.0.0/16".into(),
            "--route-reconciliation-period=500ms".into(),
        ],
    );
    let ours = || host.ip(&["route", "show", "proto", "84"]);
    let routes = wait_blocking("routes for n1 and n2", Duration::from_secs(30), || {
        let r = ours();
        (r.contains("10.244.1.0/24 via 10.233.0.2")
            && r.contains("10.244.2.0/24 via 10.233.0.3")
            && !r.contains("10.244.99.0/24"))
        .then_some(r)
    });
    assert!(
        routes.contains("10.98.0.0/24"),
        "ours outside --cluster-cidr was deleted:\n{routes}"
    );
    assert!(!routes.contains("10.244.3.0"), "{routes}");
    assert!(!routes.contains("10.97.0.0"), "{routes}");
    assert!(
        host.ip(&["route", "show"])
            .contains("10.244.200.0/24 via 10.233.0.50"),
        "a foreign route was touched"
    );
    for n in ["n1", "n2"] {
        wait_node(&cluster, n, "NetworkUnavailable False/RouteCreated", |v| {
            network_unavailable(v) == Some(("False".into(), "RouteCreated".into()))
        });
    }
    // The kernel refuses n3's route (its next hop is not on a local link): one event,
    // and no NetworkUnavailable=True, which would keep every pod off the node (its
    // condition is not ours to flip).
    wait_for_event(&cluster, "n3", "FailedToCreateRoute");
    let n3 = node_json(&cluster, "n3").unwrap();
    assert!(network_unavailable(&n3).is_none(), "{n3}");
    // Repeats count into the one event instead of making new ones.
    let count = |c: &Cluster| -> (usize, i64) {
        let v: Value = serde_json::from_str(&c.kubectl_ok(&[
            "get",
            "events",
            "-n",
            "default",
            "--field-selector=involvedObject.name=n3,reason=FailedToCreateRoute",
            "-o",
            "json",
        ]))
        .unwrap();
        let items = v["items"].as_array().unwrap().clone();
        let n = items
            .first()
            .map(|e| e["count"].as_i64().unwrap_or(0))
            .unwrap_or(0);
        (items.len(), n)
    };
    wait_blocking("the event's count rises", Duration::from_secs(30), || {
        let (objects, n) = count(&cluster);
        assert_eq!(objects, 1, "one Event object per reason and node");
        (n >= 2).then_some(())
    });
    assert!(network_unavailable(&node_json(&cluster, "n4").unwrap()).is_none());

    // Drift: a route deleted by hand comes back; a node's new address moves its
    // route; a deleted node's route goes.
    host.ip(&["route", "del", "10.244.1.0/24", "proto", "84"]);
    cluster.patch_node_status(
        "n2",
        r#"{"addresses":[{"type":"InternalIP","address":"10.233.0.4"}]}"#,
    );
    cluster.kubectl_ok(&["delete", "node", "n3"]);
    wait_blocking("routes repaired", Duration::from_secs(30), || {
        let r = ours();
        (r.contains("10.244.1.0/24 via 10.233.0.2")
            && r.contains("10.244.2.0/24 via 10.233.0.4")
            && !r.contains("10.233.0.3"))
        .then_some(())
    });
    cluster.kubectl_ok(&["delete", "node", "n1"]);
    wait_blocking("n1's route removed", Duration::from_secs(30), || {
        (!ours().contains("10.244.1.0/24")).then_some(())
    });
    assert!(!ccm.exited(), "the CCM exited:\n{}", ccm.log_text());
    // Stopping: the routes are the leader's alone, and they go with it.
    ccm.signal("TERM");
    ccm.wait_exit(Duration::from_secs(30))
        .expect("the CCM stops");
    let left = ours();
    assert!(
        !left.contains("10.244."),
        "routes left behind after shutdown:\n{left}"
    );
    assert!(
        left.contains("10.98.0.0/24"),
        "ours outside --cluster-cidr: {left}"
    );
}

/// Two replicas, each on its own host: routes live only in the leader's table. A leader
/// that steps down (SIGTERM) takes its routes with it and the other host gets them; a
/// leader that crashes (SIGKILL) leaves them, and they are removed when it comes back as
/// a standby.
#[test]
fn routes_follow_the_leader_and_leave_no_stale_entry() {
    let cluster = Cluster::start(&Egress::Direct);
    add_node_with_pod_cidr(&cluster, "n1", "10.233.0.2", "10.244.1.0/24");
    add_node_with_pod_cidr(&cluster, "n2", "10.233.0.3", "10.244.2.0/24");
    let (_dir, inventory) = inventory_dir();
    write_inventory(&inventory, "routes: {}\nnodes: []\n");
    let hosts: Vec<Node> = (0..2).map(|_| Node::router_host()).collect();
    let relay_dirs: Vec<TempDir> = (0..2).map(|_| TempDir::new("tether-relay")).collect();
    let _relays: Vec<_> = hosts
        .iter()
        .zip(&relay_dirs)
        .map(|(h, d)| h.reach_host_port(cluster.port, d.path()))
        .collect();
    let start = |i: usize, name: &str| {
        start_ccm_in(
            Path::new(BIN),
            Some(&hosts[i]),
            &cluster,
            &inventory,
            name,
            &[
                "--controllers=route".into(),
                "--secure-port=0".into(),
                "--cluster-cidr=10.244.0.0/16".into(),
                "--route-reconciliation-period=500ms".into(),
            ],
        )
    };
    let table = |i: usize| hosts[i].ip(&["route", "show", "proto", "84"]);
    let routed = |i: usize| {
        let t = table(i);
        t.contains("10.244.1.0/24 via 10.233.0.2") && t.contains("10.244.2.0/24 via 10.233.0.3")
    };
    let mut a = start(0, "ccm-a");
    wait_blocking("routes on host A (leader)", Duration::from_secs(30), || {
        routed(0).then_some(())
    });
    let mut b = start(1, "ccm-b");
    b.wait_event("waiting to become leader", START_TIMEOUT, |_| true);
    assert!(
        table(1).trim().is_empty(),
        "a standby made routes: {}",
        table(1)
    );

    // A steps down: its routes go, B's host gets them.
    a.signal("TERM");
    a.wait_exit(Duration::from_secs(30)).expect("A stops");
    assert!(
        table(0).trim().is_empty(),
        "A left routes behind: {}",
        table(0)
    );
    wait_blocking(
        "routes on host B (new leader)",
        Duration::from_secs(30),
        || routed(1).then_some(()),
    );

    // B crashes: nothing can clean its table, until it comes back as a standby.
    let a = start(0, "ccm-a2");
    a.wait_event("waiting to become leader", START_TIMEOUT, |_| true);
    b.kill();
    wait_blocking("routes on host A again", Duration::from_secs(30), || {
        routed(0).then_some(())
    });
    assert!(
        routed(1),
        "the crashed leader's routes are still there (expected)"
    );
    let b = start(1, "ccm-b2");
    b.wait_event("waiting to become leader", START_TIMEOUT, |_| true);
    assert!(
        table(1).trim().is_empty(),
        "the former leader's stale routes survived its restart: {}",
        table(1)
    );
    assert!(routed(0));
    drop(a);
}

//! Leader election between replicas: only the leader acts; a standby takes over when
//! the leader is killed, and at once when it is stopped with SIGTERM.

use std::path::Path;
use std::time::{Duration, Instant};

use tether_testkit::ccm::{
    add_uninitialized_node, inventory_dir, start_ccm, wait_node, write_machines, LEASE,
};
use tether_testkit::kube::{Cluster, Egress};
use tether_testkit::process::START_TIMEOUT;

use crate::BIN;

#[test]
fn only_the_leader_acts_and_a_standby_takes_over_when_it_dies() {
    let cluster = Cluster::start(&Egress::Direct);
    let (_dir, inventory) = inventory_dir();
    write_machines(
        &inventory,
        &[("node-a", "10.0.0.1", false), ("node-b", "10.0.0.2", false)],
    );
    let mut first = start_ccm(Path::new(BIN), &cluster, &inventory, "ccm-1");
    first.wait_event("became leader", START_TIMEOUT, |_| true);
    let second = start_ccm(Path::new(BIN), &cluster, &inventory, "ccm-2");
    second.wait_event("waiting to become leader", START_TIMEOUT, |_| true);

    add_uninitialized_node(&cluster, "node-a", "10.0.0.1");
    wait_node(&cluster, "node-a", "initialized by the leader", |n| {
        n["spec"]["providerID"] == "tether://node-a"
    });
    assert!(first.logged("node initialized"));
    assert!(!second.logged("node initialized"));
    assert!(!second.logged("became leader"));

    // The leader dies without releasing its lease: the standby must take over within
    // the lease duration (plus a retry period and some scheduling slack).
    first.kill();
    let killed = Instant::now();
    second.wait_event("became leader", LEASE * 3, |_| true);
    let took = killed.elapsed();
    eprintln!("standby took over {took:?} after the leader was killed (lease {LEASE:?})");
    assert!(
        took <= LEASE + Duration::from_secs(2),
        "takeover took {took:?}"
    );
    add_uninitialized_node(&cluster, "node-b", "10.0.0.2");
    wait_node(&cluster, "node-b", "initialized by the new leader", |n| {
        n["spec"]["providerID"] == "tether://node-b"
    });

    // SIGTERM (a rolling update): the leader stops its controllers, then releases the
    // lease and waits for kube-apiserver to have it before it exits; the standby takes
    // over at its next retry, well inside the lease duration.
    let mut second = second;
    let identity = second.wait_event("cloud-controller-manager starting", START_TIMEOUT, |_| true)
        ["identity"]
        .as_str()
        .unwrap()
        .to_string();
    let third = start_ccm(Path::new(BIN), &cluster, &inventory, "ccm-3");
    third.wait_event("waiting to become leader", START_TIMEOUT, |_| true);
    second.signal("TERM");
    let termed = Instant::now();
    second
        .wait_exit(Duration::from_secs(30))
        .expect("the leader stops on SIGTERM");
    let holder = cluster.kubectl_ok(&[
        "get",
        "lease",
        "-n",
        "kube-system",
        "cloud-controller-manager",
        "-o",
        "jsonpath={.spec.holderIdentity}",
    ]);
    assert!(
        holder != identity && second.logged("leader lease released"),
        "the lease still names the old leader after it exited: {holder:?}"
    );
    third.wait_event("became leader", LEASE * 3, |_| true);
    let took = termed.elapsed();
    eprintln!("standby took over {took:?} after SIGTERM of the leader (lease {LEASE:?})");
    assert!(took < LEASE, "graceful handover took {took:?}");
}

//! `tether ccm` against a real kube-apiserver + etcd, as real processes: nodes tainted
//! uninitialized are initialised from the inventory (provider ID, addresses, topology
//! labels, taint removed, event); a shut-down machine's node is tainted and untainted
//! again; a node gone from the inventory is deleted; with two replicas only the leader
//! acts and the other takes over when the leader is killed; pod-network routes are
//! programmed in a network namespace's routing table; a node whose agent is connected
//! exists without being in the inventory.
//!
//! One test binary, one module a subject; the helpers more than one of them uses are
//! in `tether_testkit::ccm` (starting the CCM, its inventory, nodes, Services, events,
//! the tunnel, its HTTPS endpoints) and `tether_testkit::netns` (`curl`).

mod lb_failover;
mod lb_limits;
mod leader_election;
mod load_balancers;
mod nodes;
mod routes;
mod serving;

/// The `tether` binary under test.
const BIN: &str = env!("CARGO_BIN_EXE_tether");

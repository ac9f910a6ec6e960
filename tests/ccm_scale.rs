//! `tether ccm` at scale against the real test apiserver: 1,000 uninitialized nodes and
//! 200 LoadBalancer Services (no kubelets needed) converge, and the test reports how
//! long that took and how many Kubernetes API and provider calls it cost.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use tether_testkit::kube::{free_port, wait_blocking, Cluster, Egress};
use tether_testkit::process::{socket_path, uds_frontend_args, Proc, START_TIMEOUT};
use tether_testkit::{Pki, ServerProc, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_tether");
const NODES: usize = 1000;
const SERVICES: usize = 200;

fn count(cluster: &Cluster, args: &[&str], pred: impl Fn(&Value) -> bool) -> usize {
    let out = cluster.kubectl_ok(args);
    let v: Value = serde_json::from_str(&out).unwrap();
    v["items"]
        .as_array()
        .map(|items| items.iter().filter(|i| pred(i)).count())
        .unwrap_or(0)
}

#[test]
fn a_thousand_nodes_and_two_hundred_load_balancers_converge() {
    let pki = Pki::new();
    let socket = socket_path(pki.dir());
    let _server = ServerProc::start(Path::new(BIN), &uds_frontend_args(&pki, "grpc", &socket));
    let cluster = Cluster::start(&Egress::Direct);
    let dir = TempDir::new("tether-ccm-scale");

    let mut inventory = String::from("nodes:\n");
    let mut nodes = String::new();
    for i in 0..NODES {
        let name = format!("node-{i:04}");
        let ip = format!("10.100.{}.{}", i / 250, i % 250 + 1);
        writeln!(
            inventory,
            "- name: {name}\n  zone: zone-{}\n  region: region-a\n  instanceType: t{}\n  addresses: [{{type: InternalIP, address: {ip}}}]",
            i % 3,
            i % 5
        )
        .unwrap();
        write!(
            nodes,
            "---\napiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\nspec:\n  taints:\n  - {{key: node.cloudprovider.kubernetes.io/uninitialized, value: \"true\", effect: NoSchedule}}\n"
        )
        .unwrap();
    }
    let mut services = String::new();
    for i in 0..SERVICES {
        write!(
            services,
            "---\napiVersion: v1\nkind: Service\nmetadata:\n  name: svc-{i:03}\n  namespace: default\nspec:\n  type: LoadBalancer\n  ports:\n  - port: {}\n",
            free_port()
        )
        .unwrap();
    }
    let inventory_path = dir.path().join("inventory.yaml");
    std::fs::write(&inventory_path, inventory).unwrap();
    for (name, text) in [("nodes.yaml", &nodes), ("services.yaml", &services)] {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        cluster.kubectl_ok(&["create", "-f", path.to_str().unwrap()]);
    }

    let started = Instant::now();
    let ccm = Proc::spawn(
        "ccm",
        Path::new(BIN),
        &[
            "ccm".into(),
            "--log-format=json".into(),
            format!("--cloud-config={}", inventory_path.display()),
            format!("--kubeconfig={}", cluster.files.admin_kubeconfig.display()),
            "--lb-bind-address=127.0.0.1".into(),
            "--secure-port=0".into(),
            "--concurrent-service-syncs=4".into(),
            format!("--tunnel-uds={}", socket.display()),
            // What an operator sets for a cluster of this size (defaults 20/30).
            "--kube-api-qps=200".into(),
            "--kube-api-burst=300".into(),
            "--provider-qps=1000".into(),
            "--provider-burst=1000".into(),
        ],
    );
    ccm.wait_event("controllers started", START_TIMEOUT, |_| true);

    wait_blocking("all nodes initialized", Duration::from_secs(180), || {
        let left = count(&cluster, &["get", "nodes", "-o", "json"], |n| {
            n["spec"]["taints"].as_array().is_some_and(|t| {
                t.iter()
                    .any(|t| t["key"] == "node.cloudprovider.kubernetes.io/uninitialized")
            })
        });
        (left == 0).then_some(())
    });
    let nodes_done = started.elapsed();
    wait_blocking(
        "all services have an ingress IP",
        Duration::from_secs(180),
        || {
            let done = count(
                &cluster,
                &["get", "services", "-n", "default", "-o", "json"],
                |s| s["status"]["loadBalancer"]["ingress"][0]["ip"] == "127.0.0.1",
            );
            (done == SERVICES).then_some(())
        },
    );
    let all_done = started.elapsed();

    // The next usage report after convergence has the totals.
    let before = ccm.count_events("api usage");
    let last = wait_blocking("api usage report", Duration::from_secs(30), || {
        let reports = ccm.events("api usage");
        (reports.len() > before)
            .then(|| reports.last().cloned())
            .flatten()
    });
    let kube_calls = last["kube_api_calls"].as_u64().unwrap();
    let provider_calls = last["provider_calls"].as_u64().unwrap();
    eprintln!(
        "{NODES} nodes initialized in {nodes_done:?}; {SERVICES} load balancers ready after {all_done:?}; {kube_calls} Kubernetes API calls, {provider_calls} provider calls"
    );
    // Per node: status patch, spec patch, event; per Service: finalizer, status, two
    // events; plus watches and leader election. Anything far beyond is a hot loop.
    let budget = (NODES * 3 + SERVICES * 4 + 500) as u64;
    assert!(
        kube_calls <= budget,
        "{kube_calls} API calls for {NODES} nodes and {SERVICES} services (budget {budget})"
    );
}

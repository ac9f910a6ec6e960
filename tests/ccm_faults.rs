//! The CCM controllers in-process against the real test apiserver, with the
//! fault-injecting fake provider: provider errors are retried with per-key backoff,
//! RetryAfter is honoured, slow providers are tolerated, and load balancers follow
//! node-set and Service type changes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tether_ccm::cloud::fake::{FakeCloud, LbCall};
use tether_ccm::cloud::CloudError;
use tether_ccm::{CcmConfig, Enabled};
use tether_testkit::ccm::get_json;
use tether_testkit::kube::{wait_blocking, Cluster, Egress};
use tokio_util::sync::CancellationToken;

fn config(enabled: Enabled) -> CcmConfig {
    CcmConfig {
        cluster_name: "kubernetes".into(),
        enabled,
        node_monitor_period: Duration::from_millis(500),
        node_status_update_frequency: Duration::from_secs(300),
        load_balancer_class: None,
        lb_resync_period: Duration::from_secs(60),
        concurrent_service_syncs: 2,
        concurrent_node_syncs: 2,
        cluster_cidrs: vec!["10.244.0.0/16".parse().unwrap()],
        configure_cloud_routes: true,
        route_reconciliation_period: Duration::from_millis(500),
        leader_election: None,
        load_balancer_lease: None,
        identity: "test".into(),
        metrics: Default::default(),
    }
}

/// Runs the controllers in the background until the returned `drain` is cancelled.
async fn start(cluster: &Cluster, fake: &FakeCloud, enabled: Enabled) -> CancellationToken {
    let client = tether_ops::kubeclient::client(Some(&cluster.files.admin_kubeconfig))
        .await
        .unwrap();
    let drain = CancellationToken::new();
    let provider: Arc<dyn tether_ccm::cloud::Provider> = Arc::new(fake.clone());
    tokio::spawn(tether_ccm::run(
        client,
        provider,
        config(enabled),
        Default::default(),
        drain.clone(),
    ));
    drain
}

fn tainted_node(cluster: &Cluster, name: &str) {
    cluster.apply(&format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\nspec:\n  taints:\n  - {{key: node.cloudprovider.kubernetes.io/uninitialized, value: \"true\", effect: NoSchedule}}\n"
    ));
    set_ready(cluster, name, true, None);
}

fn set_ready(cluster: &Cluster, name: &str, ready: bool, ip: Option<&str>) {
    cluster.set_node_ready(name, ready);
    if let Some(ip) = ip {
        cluster.patch_node_status(
            name,
            &format!(r#"{{"addresses":[{{"type":"InternalIP","address":"{ip}"}}]}}"#),
        );
    }
}

fn wait_initialized(cluster: &Cluster, name: &str, timeout: Duration) {
    wait_blocking(&format!("{name} initialized"), timeout, || {
        let n = get_json(cluster, &["get", "node", name, "-o", "json"])?;
        (n["spec"]["providerID"] == format!("fake://{name}").as_str()).then_some(())
    });
}

fn only(list: &[&str]) -> Enabled {
    Enabled::parse(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn provider_faults_are_retried_and_retry_after_is_honoured() {
    let cluster = Cluster::start(&Egress::Direct);
    let fake = FakeCloud::default();
    for n in ["node-a", "node-b", "slow-0", "slow-1", "slow-2"] {
        fake.add_machine(n, "10.0.0.1", "z1");
    }
    // The first call asks to come back after 1 s.
    fake.fail_next([CloudError::RetryAfter {
        after: Duration::from_secs(1),
        reason: "throttled".into(),
    }]);
    tainted_node(&cluster, "node-a");
    let started = Instant::now();
    let drain = start(&cluster, &fake, only(&["cloud-node"])).await;
    wait_initialized(&cluster, "node-a", Duration::from_secs(20));
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(1),
        "retried after {took:?}, before RetryAfter"
    );
    // One throttled call and one that worked; a third when the node changed between
    // the cache read and the untaint (set_ready's status patch, on a loaded machine:
    // a conflict, retried after 500 ms with a fresh provider call). Once in a CI run.
    assert!(
        matches!(fake.calls(), 2 | 3),
        "{} calls: one throttled, one that worked (and one after a conflict)",
        fake.calls()
    );

    // A plain provider error: retried after the per-key backoff (5 s first).
    fake.fail_next([CloudError::Provider("cloud API is down".into())]);
    let added = Instant::now();
    tainted_node(&cluster, "node-b");
    wait_initialized(&cluster, "node-b", Duration::from_secs(30));
    let took = added.elapsed();
    assert!(
        took >= Duration::from_millis(4500),
        "an error must back off (5 s), retried after {took:?}"
    );

    // A slow provider (300 ms per call) still gets every node initialised.
    fake.set_latency(Duration::from_millis(300));
    for n in ["slow-0", "slow-1", "slow-2"] {
        tainted_node(&cluster, n);
    }
    for n in ["slow-0", "slow-1", "slow-2"] {
        wait_initialized(&cluster, n, Duration::from_secs(30));
    }
    drain.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn load_balancers_follow_node_set_and_type_changes() {
    let cluster = Cluster::start(&Egress::Direct);
    let fake = FakeCloud::default();
    for (n, ip) in [("n1", "10.0.0.1"), ("n2", "10.0.0.2")] {
        fake.add_machine(n, ip, "z1");
        cluster.add_node(n, ip);
        set_ready(&cluster, n, true, Some(ip));
    }
    for s in ["s1", "s2"] {
        cluster.apply(&format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {s}\n  namespace: default\nspec:\n  type: LoadBalancer\n  ports:\n  - port: 80\n"
        ));
    }
    let drain = start(&cluster, &fake, only(&["service"])).await;
    let svc = |s: &str| {
        get_json(
            &cluster,
            &["get", "service", s, "-n", "default", "-o", "json"],
        )
    };
    for s in ["s1", "s2"] {
        let v = wait_blocking(&format!("{s} ingress"), Duration::from_secs(20), || {
            let v = svc(s)?;
            (v["status"]["loadBalancer"]["ingress"][0]["ip"] == "192.0.2.10").then_some(v)
        });
        assert_eq!(
            v["metadata"]["finalizers"][0],
            "service.kubernetes.io/load-balancer-cleanup"
        );
    }
    let both = vec!["n1".to_string(), "n2".to_string()];
    assert!(fake
        .lb_calls()
        .contains(&LbCall::Ensure("default/s1".into(), both.clone())));

    // n2 is excluded: every balancer is updated to n1 alone.
    cluster.kubectl_ok(&[
        "label",
        "node",
        "n2",
        "node.kubernetes.io/exclude-from-external-load-balancers=true",
    ]);
    for s in ["default/s1", "default/s2"] {
        wait_blocking(&format!("{s} updated"), Duration::from_secs(20), || {
            fake.lb_calls()
                .contains(&LbCall::Update(s.into(), vec!["n1".into()]))
                .then_some(())
        });
    }

    // s1 stops being a LoadBalancer: balancer deleted, ingress and finalizer gone.
    cluster.kubectl_ok(&[
        "patch",
        "service",
        "s1",
        "-n",
        "default",
        "--type=json",
        "-p",
        r#"[{"op":"replace","path":"/spec/type","value":"ClusterIP"},{"op":"remove","path":"/spec/ports/0/nodePort"}]"#,
    ]);
    wait_blocking("s1 cleaned up", Duration::from_secs(20), || {
        let v = svc("s1")?;
        (v["metadata"]["finalizers"].is_null() && v["status"]["loadBalancer"]["ingress"].is_null())
            .then_some(())
    });
    assert!(fake
        .lb_calls()
        .contains(&LbCall::Delete("default/s1".into())));

    // A failing ensure: a warning event, then success on retry.
    fake.fail_next([CloudError::Provider("quota exceeded".into())]);
    cluster.apply(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: s3\n  namespace: default\nspec:\n  type: LoadBalancer\n  ports:\n  - port: 80\n",
    );
    wait_blocking("s3 ingress after a retry", Duration::from_secs(30), || {
        let v = svc("s3")?;
        (v["status"]["loadBalancer"]["ingress"][0]["ip"] == "192.0.2.10").then_some(())
    });
    assert!(
        cluster.has_event("default", "s3", "SyncLoadBalancerFailed"),
        "no SyncLoadBalancerFailed event"
    );
    drain.cancel();
}

//! Load-balancer addresses moving between replicas on a LAN: after a crash, on a
//! graceful handover, spread over replicas, when the holder hangs, loses its interface
//! or is cut from the apiserver; and the holder's host daemons neither exposed nor
//! blocked.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tether_testkit::ccm::{
    event_count, get_json, ingress_ips, inventory_dir, lb_service, machine, start_ccm_in,
    wait_ingress, write_inventory, Tunnel,
};
use tether_testkit::kube::{wait_blocking, Cluster, Egress};
use tether_testkit::netns::{curl_within, Node};
use tether_testkit::process::{socket_path, uds_frontend_args, Proc, START_TIMEOUT};
use tether_testkit::refusals::Refusals;
use tether_testkit::{Pki, TempDir};

use crate::BIN;

/// One quick try at `url` from inside `netns` (half a second at most).
fn curl_quick(netns: &str, url: &str) -> Option<String> {
    curl_within(Some(netns), url, "0.5")
}

/// Who answers ARP for `vip` on the LAN, asked from `client` (100 ms for answers).
fn arp_answers(client: &Node, vip: &str) -> Vec<String> {
    tether_testkit::arp::who_has(
        &client.ns,
        tether_testkit::netns::Lan::INTERFACE,
        vip.parse().unwrap(),
        Duration::from_millis(100),
    )
}

/// Service `default/web`, port 80 on NodePort 30080 (where the fixture's page is), from
/// the pool.
fn web_service(cluster: &Cluster) {
    lb_service(
        cluster,
        "default",
        "web",
        80,
        Some(30080),
        serde_json::json!({}),
        serde_json::json!({}),
    );
}

/// The holder of pool `lan`'s lease, if any.
fn lb_lease_holder(cluster: &Cluster) -> Option<String> {
    pool_lease_holder(cluster, "lan")
}

/// The holder of `pool`'s lease, if any.
fn pool_lease_holder(cluster: &Cluster, pool: &str) -> Option<String> {
    get_json(
        cluster,
        &[
            "-n",
            "kube-system",
            "get",
            "lease",
            &format!("cloud-controller-manager-lb-{pool}"),
            "-o",
            "json",
        ],
    )
    .and_then(|l| l["spec"]["holderIdentity"].as_str().map(str::to_string))
    .filter(|h| !h.is_empty())
}

/// Two control-plane "hosts" sharing a LAN with a client, the set-up of the failover
/// tests: a node behind the tunnel serving the NodePort, a Service on port 80 and the
/// pool's one address.
struct Failover {
    node: Node,
    tunnel: Tunnel,
    _page: tether_testkit::netns::ServedPage,
    cluster: Cluster,
    lan: tether_testkit::netns::Lan,
    hosts: Vec<Node>,
    client: Node,
    _relays: Vec<[Proc; 2]>,
    _relay_dirs: Vec<TempDir>,
    _dir: TempDir,
    inventory: PathBuf,
    vip: String,
    /// With two pools: the second pool's address (Service `web2`, port 80) and its page.
    vip2: Option<String>,
    _page2: Option<tether_testkit::netns::ServedPage>,
}

impl Failover {
    fn new() -> Failover {
        Failover::with_pools(1)
    }

    /// With `pools` (1 or 2) pools of one address each, a Service on each.
    fn with_pools(pools: usize) -> Failover {
        use tether_testkit::netns::Lan;
        let node = Node::create();
        let tunnel = Tunnel::to_node(Path::new(BIN), &node, "node-1");
        let page = node.serve_page(30080, "hello over the lan\n");
        let cluster = Cluster::start(&Egress::Direct);
        cluster.add_node("node-1", &node.node_ip);
        cluster.set_node_ready("node-1", true);
        let lan = Lan::create();
        let hosts: Vec<Node> = (0..2).map(|_| Node::create()).collect();
        let client = Node::create();
        for n in hosts.iter().chain([&client]) {
            lan.attach(n);
        }
        let relay_dirs: Vec<TempDir> = (0..2).map(|_| TempDir::new("tether-relay")).collect();
        let relays: Vec<_> = hosts
            .iter()
            .zip(&relay_dirs)
            .map(|(h, d)| h.reach_host_port(cluster.port, d.path()))
            .collect();
        let vip = lan.address(100);
        let vip2 = (pools > 1).then(|| lan.address(101));
        let (dir, inventory) = inventory_dir();
        write_inventory(
            &inventory,
            &format!(
                "nodes:\n{}loadBalancer:\n  interface: {}\n  pools:\n  - name: lan\n    addresses: [{vip}]\n{}",
                machine("node-1", &node.node_ip, false),
                Lan::INTERFACE,
                vip2.as_ref()
                    .map(|v| format!("  - name: lan2\n    addresses: [{v}]\n"))
                    .unwrap_or_default()
            ),
        );
        let page2 = vip2.as_ref().map(|v| {
            lb_service(
                &cluster,
                "default",
                "web2",
                80,
                Some(30081),
                serde_json::json!({}),
                serde_json::json!({"loadBalancerIP": v}),
            );
            node.serve_page(30081, "hello from the second pool\n")
        });
        web_service(&cluster);
        Failover {
            node,
            tunnel,
            _page: page,
            cluster,
            lan,
            hosts,
            client,
            _relays: relays,
            _relay_dirs: relay_dirs,
            _dir: dir,
            inventory,
            vip,
            vip2,
            _page2: page2,
        }
    }

    /// A replica on host `i`; returns once it stands by for (or holds) the
    /// load-balancer lease.
    fn start(&self, i: usize, name: &str) -> Proc {
        let p = start_ccm_in(
            Path::new(BIN),
            Some(&self.hosts[i]),
            &self.cluster,
            &self.inventory,
            name,
            &[
                "--secure-port=0".into(),
                format!("--tunnel-uds={}", self.tunnel.socket.display()),
            ],
        );
        p.wait_event("waiting to become leader", START_TIMEOUT, |e| {
            e.to_string().contains("cloud-controller-manager-lb-lan")
        });
        p
    }

    fn url(&self) -> String {
        format!("http://{}/", self.vip)
    }

    /// Probes ARP every 100 ms from `since` until a MAC other than `old` answers alone
    /// (asserting that two never answer at once): returns when `old` first went silent
    /// and when the other first answered.
    fn takeover(&self, old: &str, since: Instant, limit: Duration) -> (Duration, Duration) {
        let mut silent = None;
        loop {
            let answers = arp_answers(&self.client, &self.vip);
            assert!(
                answers.len() <= 1,
                "two hosts answer ARP at once: {answers:?}"
            );
            if silent.is_none() && !answers.iter().any(|a| a == old) {
                silent = Some(since.elapsed());
            }
            if answers.len() == 1 && answers[0] != old {
                return (silent.unwrap_or_default(), since.elapsed());
            }
            assert!(since.elapsed() < limit, "nobody took the address over");
        }
    }

    /// Waits until exactly one MAC answers ARP for the address, and returns it.
    fn wait_single_answer(&self, what: &str) -> String {
        wait_blocking(what, Duration::from_secs(30), || {
            let answers = arp_answers(&self.client, &self.vip);
            (answers.len() == 1).then(|| answers[0].clone())
        })
    }

    /// `n` connections in a row, each with a flushed neighbour cache first: all reach
    /// the page.
    fn hundred_tries(&self, n: usize) {
        for i in 0..n {
            self.client.ip(&[
                "neigh",
                "flush",
                "dev",
                tether_testkit::netns::Lan::INTERFACE,
            ]);
            assert_eq!(
                curl_within(Some(&self.client.ns), &self.url(), "2").as_deref(),
                Some("hello over the lan\n"),
                "try {i} of {n} failed"
            );
        }
    }
}

/// Connects to `url` from `ns` every 100 ms (0.3 s each) until finished: the
/// moments the page did not come back.
struct ConnProber {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(usize, Vec<Duration>)>,
}

impl ConnProber {
    fn start(ns: &str, url: String, page: &'static str) -> ConnProber {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, ns) = (stop.clone(), ns.to_string());
        let thread = std::thread::spawn(move || {
            let start = Instant::now();
            let (mut tries, mut failures) = (0, Vec::new());
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                let at = Instant::now();
                tries += 1;
                if curl_within(Some(&ns), &url, "0.3").as_deref() != Some(page) {
                    failures.push(start.elapsed());
                }
                std::thread::sleep(Duration::from_millis(100).saturating_sub(at.elapsed()));
            }
            (tries, failures)
        });
        ConnProber { stop, thread }
    }

    /// Stops: (tries, failures, the window from the first failure to the last).
    fn finish(self) -> (usize, Vec<Duration>, Duration) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (tries, failures) = self.thread.join().unwrap();
        let window = match (failures.first(), failures.last()) {
            (Some(first), Some(last)) => *last - *first + Duration::from_millis(100),
            _ => Duration::ZERO,
        };
        (tries, failures, window)
    }
}

/// `ip addr show` of the load-balancer device inside process `pid`'s namespace (the
/// one its `tether-lb-netns` thread made).
fn lb_namespace_addresses(pid: u32) -> String {
    lb_namespace_ip(pid, &["addr", "show", "dev", "tether-lb"])
}

/// `ip <args>` inside process `pid`'s load-balancer namespace.
fn lb_namespace_ip(pid: u32, args: &[&str]) -> String {
    let task = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| t.ok())
        .find(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim() == "tether-lb-netns")
        })
        .expect("the namespace thread");
    let out = Command::new("nsenter")
        .arg(format!("--net={}", task.path().join("ns/net").display()))
        .arg("ip")
        .args(args)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The namespace's last address goes (its only Service is deleted), and the kernel
/// flushes every route on a device left with no IPv4 address: the copied on-link
/// prefix and default routes too. A Service made again on the same address must get
/// its replies back to the client, so the routes come back with the address.
#[test]
fn a_service_made_again_after_the_last_address_went_is_answered() {
    let f = Failover::new();
    let a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    wait_blocking(
        "the client reaches the Service",
        Duration::from_secs(30),
        || curl_quick(&f.client.ns, &f.url()),
    );
    let deleted = f.cluster.kubectl(&["delete", "service", "web"]);
    assert!(deleted.status.success(), "{deleted:?}");
    wait_blocking("the address goes", Duration::from_secs(30), || {
        arp_answers(&f.client, &f.vip).is_empty().then_some(())
    });
    web_service(&f.cluster);
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let routes = || {
        format!(
            "routes in the load-balancer namespace:\n{}",
            lb_namespace_ip(a.pid(), &["route", "show"])
        )
    };
    let page = tether_testkit::kube::wait_blocking_or(
        "the client reaches the Service made again",
        Duration::from_secs(30),
        || curl_quick(&f.client.ns, &f.url()),
        routes,
    );
    assert_eq!(page, "hello over the lan\n");
}

/// Crash: SIGKILL the replica holding the address and restart none on its host. Its
/// namespace dies with it, so its host stops answering ARP at once (no stale address);
/// the standby takes the load-balancer lease when it runs out (4 s) and answers. At no
/// moment do both answer. Then a client with a flushed neighbour cache connects 100
/// times out of 100. The host's own interface never carries the address.
#[test]
fn a_crashed_holders_address_moves_within_seconds_and_its_host_goes_silent() {
    let f = Failover::new();
    let mut a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let mac_a = f.wait_single_answer("the first replica answering ARP");
    let _b = f.start(1, "ccm-b");
    assert_eq!(arp_answers(&f.client, &f.vip), std::slice::from_ref(&mac_a));
    for h in &f.hosts {
        assert!(
            !h.ip(&["addr", "show"]).contains(&f.vip),
            "the address is on a host's own interface"
        );
    }
    // It is on the macvlan in the CCM's own namespace (its namespace thread's), alone:
    // no IPv6 address of the device's own either.
    let inside = lb_namespace_addresses(a.pid());
    assert!(inside.contains(&format!("{}/32", f.vip)), "{inside}");
    assert!(!inside.contains("inet6"), "{inside}");
    wait_blocking(
        "the client reaches the Service",
        Duration::from_secs(30),
        || curl_quick(&f.client.ns, &f.url()),
    );

    a.kill();
    let killed = Instant::now();
    let (silent, answered) = f.takeover(&mac_a, killed, Duration::from_secs(30));
    f.hundred_tries(100);
    let served = killed.elapsed();
    eprintln!(
        "crash: the dead host stopped answering ARP {silent:?} after SIGKILL; the standby answered after {answered:?}; 100/100 connections done at {served:?}"
    );
    assert!(
        silent < Duration::from_secs(2),
        "the dead host answered for {silent:?}"
    );
    assert!(
        answered < Duration::from_secs(6),
        "takeover took {answered:?}"
    );
    assert_eq!(
        ingress_ips(&f.cluster, "default", "web"),
        std::slice::from_ref(&f.vip)
    );
    drop(f.node);
}

/// SIGTERM of the holder, the way a rolling update stops it: the addresses go first,
/// then the lease is released, and the process waits until the standby holds it. A
/// client connecting every 100 ms sees under a second of failures.
#[test]
fn a_graceful_handover_costs_under_a_second() {
    let f = Failover::new();
    let mut a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let mac_a = f.wait_single_answer("the first replica answering ARP");
    let _b = f.start(1, "ccm-b");
    let holder_a = lb_lease_holder(&f.cluster).expect("a holder");
    wait_blocking(
        "the client reaches the Service",
        Duration::from_secs(30),
        || curl_quick(&f.client.ns, &f.url()),
    );
    // Connect every 100 ms from before the signal until well after the handover; and
    // every 5 ms, counting resets (an address there without its listener).
    let prober = ConnProber::start(&f.client.ns, f.url(), "hello over the lan\n");
    let vip: std::net::IpAddr = f.vip.parse().unwrap();
    let refusals = Refusals::start(&f.client.ns, (vip, 80).into());
    std::thread::sleep(Duration::from_secs(1));
    a.signal("TERM");
    a.exits_cleanly(Duration::from_secs(30), "the holder exits");
    let holder = lb_lease_holder(&f.cluster);
    assert!(
        holder.is_some() && holder.as_ref() != Some(&holder_a),
        "the lease had no new holder when the old process exited: {holder:?}"
    );
    let mac_b = f.wait_single_answer("the standby answering ARP");
    assert_ne!(mac_b, mac_a);
    std::thread::sleep(Duration::from_secs(2));
    let (tries, failures, window) = prober.finish();
    let (quick_tries, refused) = refusals.finish();
    eprintln!(
        "graceful handover: {} of {tries} connections failed, over {window:?}; {} of {quick_tries} reset",
        failures.len(),
        refused.len()
    );
    // Neither holder resets a SYN: the old one drops them once it lets go (its
    // listeners closed quietly until the address is gone), the new one listens before
    // its address is there.
    assert!(
        refused.is_empty(),
        "connections refused at {refused:?}; the old holder's log:\n{}",
        a.log_text()
    );
    assert!(
        window < Duration::from_secs(1),
        "connections failed for {window:?}: {failures:?}"
    );
    drop(f.node);
}

/// A request in flight when its holder is stopped (a rolling update) is answered: the
/// holder lets go of the pool at a moment when no connection is open through it
/// (within 2 s), not halfway through one. Before, the connection was cut as its
/// address went, and its client waited for an answer that never came.
#[test]
fn a_request_in_flight_at_a_graceful_handover_is_answered() {
    let f = Failover::new();
    // The pool's one address goes to a Service whose backend answers 1.5 s late.
    f.cluster
        .kubectl_ok(&["delete", "service", "web", "-n", "default"]);
    let slow = f
        .node
        .serve_slow_page(30082, "slow hello\n", Duration::from_millis(1500));
    lb_service(
        &f.cluster,
        "default",
        "slow",
        8080,
        Some(30082),
        serde_json::json!({}),
        serde_json::json!({}),
    );
    let mut a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "slow"), f.vip);
    let _b = f.start(1, "ccm-b");
    let url = format!("http://{}:8080/", f.vip);
    wait_blocking(
        "the slow Service answering",
        Duration::from_secs(60),
        || curl_within(Some(&f.client.ns), &url, "5"),
    );
    let requests = slow.count_events("request");
    let in_flight = {
        let (ns, url) = (f.client.ns.clone(), url.clone());
        std::thread::spawn(move || curl_within(Some(&ns), &url, "20"))
    };
    wait_blocking(
        "the request reaching the backend",
        Duration::from_secs(30),
        || (slow.count_events("request") > requests).then_some(()),
    );
    a.signal("TERM");
    let answer = in_flight.join().unwrap();
    a.wait_exit(Duration::from_secs(30))
        .expect("the holder exits");
    assert_eq!(
        answer.as_deref(),
        Some("slow hello\n"),
        "the request in flight at the handover; the holder's log:\n{}",
        a.log_text()
    );
    assert!(a.logged("letting go of the pool"), "{}", a.log_text());
    drop(f.node);
}

/// Two pools, two replicas: the pools spread. The first replica takes both; the second,
/// holding none, asks for one and is handed it gracefully (connections to the moved
/// address fail for under a second, the other address's never); after the first
/// replica stops, the second holds both, and a replica started again takes one back.
#[test]
fn pools_spread_over_the_replicas() {
    let f = Failover::with_pools(2);
    let vip2 = f.vip2.clone().unwrap();
    let a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    assert_eq!(wait_ingress(&f.cluster, "default", "web2"), vip2);
    let mac_a = f.wait_single_answer("the first replica answering ARP");
    wait_blocking(
        "the first replica holding both pools",
        Duration::from_secs(30),
        || (arp_answers(&f.client, &vip2) == [mac_a.clone()]).then_some(()),
    );
    let url2 = format!("http://{vip2}/");
    for url in [f.url(), url2.clone()] {
        wait_blocking("the client reaching both", Duration::from_secs(30), || {
            curl_quick(&f.client.ns, &url)
        });
    }
    let probes = [
        ConnProber::start(&f.client.ns, f.url(), "hello over the lan\n"),
        ConnProber::start(&f.client.ns, url2.clone(), "hello from the second pool\n"),
    ];
    let spread = |what: &str| {
        let started = Instant::now();
        let macs = wait_blocking(what, Duration::from_secs(30), || {
            let one = arp_answers(&f.client, &f.vip);
            let two = arp_answers(&f.client, &vip2);
            assert!(
                one.len() <= 1 && two.len() <= 1,
                "two hosts answer at once: {one:?} {two:?}"
            );
            (one.len() == 1 && two.len() == 1 && one != two)
                .then(|| (one[0].clone(), two[0].clone()))
        });
        (macs, started.elapsed())
    };
    let b = f.start(1, "ccm-b");
    let ((one, two), took) = spread("the second replica taking a pool");
    assert!(one == mac_a || two == mac_a);
    let holders: Vec<Option<String>> = ["lan", "lan2"]
        .iter()
        .map(|p| pool_lease_holder(&f.cluster, p))
        .collect();
    assert!(
        holders[0].is_some() && holders[1].is_some() && holders[0] != holders[1],
        "{holders:?}"
    );
    std::thread::sleep(Duration::from_secs(2));
    let results: Vec<_> = probes.into_iter().map(ConnProber::finish).collect();
    let moved = if one == mac_a { 1 } else { 0 };
    eprintln!(
        "spread: pool {} moved {took:?} after the second replica stood by; its connections failed for {:?} ({} of {}), the other pool's {} of {}",
        moved + 1,
        results[moved].2,
        results[moved].1.len(),
        results[moved].0,
        results[1 - moved].1.len(),
        results[1 - moved].0,
    );
    assert!(
        results[moved].2 < Duration::from_secs(1),
        "{:?}",
        results[moved].1
    );
    // (One probe of 0.3 s may time out on a loaded machine; an outage would be many.)
    assert!(
        results[1 - moved].1.len() <= 1,
        "{:?}",
        results[1 - moved].1
    );
    // The first replica stops: the second holds both; one started again takes one back.
    let mut a = a;
    a.signal("TERM");
    a.wait_exit(Duration::from_secs(30))
        .expect("the first replica exits");
    let mac_b = if one == mac_a { two } else { one };
    wait_blocking(
        "the second replica holding both",
        Duration::from_secs(30),
        || {
            (arp_answers(&f.client, &f.vip) == [mac_b.clone()]
                && arp_answers(&f.client, &vip2) == [mac_b.clone()])
            .then_some(())
        },
    );
    let _a2 = f.start(0, "ccm-a2");
    spread("a restarted replica taking a pool back");
    drop(b);
}

/// Host exposure: the addresses live in the CCM's own namespace, so the holder's host
/// daemons are never reachable on them and never blocked by them. A Service on 6443 is
/// refused with an event (and gets no address); a daemon on `0.0.0.0:P` of the holder's
/// host is not reachable on the address, while a Service on the same P is, and the
/// daemon restarts on P while the address is held; a Tether server on the holder's
/// host restarts on 0.0.0.0:8132 while the address is held.
#[test]
fn the_holders_host_daemons_are_neither_exposed_nor_blocked() {
    let f = Failover::new();
    let a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let host = &f.hosts[0];
    // A Service on the apiserver's port: refused, said in an event, no ingress.
    lb_service(
        &f.cluster,
        "default",
        "api",
        6443,
        Some(30443),
        serde_json::json!({}),
        serde_json::json!({}),
    );
    wait_blocking("a PortReserved event", Duration::from_secs(30), || {
        (event_count(&f.cluster, "api", "PortReserved") > 0).then_some(())
    });
    assert!(ingress_ips(&f.cluster, "default", "api").is_empty());

    // A host daemon on 0.0.0.0:P and a Service on P, side by side.
    let p = 18000 + (std::process::id() % 1000) as u16;
    let daemon = |name: &str| {
        host.spawn(
            name,
            "socat",
            &[
                format!("TCP-LISTEN:{p},fork,reuseaddr"),
                "SYSTEM:echo host daemon".into(),
            ],
        )
    };
    // What a connection from inside the host to its own P gets.
    let local = || {
        let out = Command::new("ip")
            .args(["netns", "exec", &host.ns, "sh", "-c"])
            .arg(format!("socat -T1 - TCP:127.0.0.1:{p} </dev/null"))
            .output()
            .ok()?;
        String::from_utf8_lossy(&out.stdout)
            .contains("host daemon")
            .then_some(())
    };
    let mut d = daemon("host-daemon");
    wait_blocking("the host daemon", Duration::from_secs(10), local);
    let vip_p = format!("http://{}:{p}/", f.vip);
    assert!(
        curl_within(Some(&f.client.ns), &vip_p, "1").is_none(),
        "the host daemon answered on the load-balancer address"
    );
    let holder_port = f.cluster.kubectl(&[
        "patch", "service", "web", "--type=json", "-p",
        &format!(r#"[{{"op":"add","path":"/spec/ports/-","value":{{"name":"alt","port":{p},"targetPort":{p},"nodePort":30081}}}}]"#),
    ]);
    assert!(
        holder_port.status.success(),
        "{}",
        String::from_utf8_lossy(&holder_port.stderr)
    );
    let _alt = f.node.serve_page(30081, "the service on P\n");
    let context = || {
        let svc = f.cluster.kubectl(&["get", "service", "web", "-o", "yaml"]);
        let log = a.log_text();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        format!(
            "the Service:\n{}\nthe replica's last log lines, newest first:\n{}",
            String::from_utf8_lossy(&svc.stdout),
            tail.join("\n")
        )
    };
    let served = tether_testkit::kube::wait_blocking_or(
        "the Service on P",
        Duration::from_secs(60),
        || curl_quick(&f.client.ns, &vip_p),
        context,
    );
    assert_eq!(served, "the service on P\n");
    // The daemon restarts on P while the address holds P.
    d.kill();
    let d2 = daemon("host-daemon-again");
    wait_blocking(
        "the host daemon bound to P again",
        Duration::from_secs(10),
        local,
    );
    assert_eq!(
        curl_quick(&f.client.ns, &vip_p).as_deref(),
        Some("the service on P\n")
    );

    // A Tether server on the holder's host, on the agents' port of every address.
    let pki = Pki::with_sans(std::slice::from_ref(&host.link_ip));
    let socket = socket_path(pki.dir());
    let mut args: Vec<String> = vec![
        "server".into(),
        "--log-format=json".into(),
        "--agent-port=8132".into(),
        "--agent-bind-address=0.0.0.0".into(),
        "--health-port=0".into(),
        "--admin-port=0".into(),
    ];
    args.extend(uds_frontend_args(&pki, "grpc", &socket));
    for round in 0..2 {
        let mut server = host.spawn(&format!("host-server-{round}"), BIN, &args);
        server.wait_event("server listening", START_TIMEOUT, |_| true);
        assert!(
            curl_within(Some(&f.client.ns), &format!("http://{}:8132/", f.vip), "1").is_none(),
            "the host's Tether server answered on the load-balancer address"
        );
        server.signal("TERM");
        server
            .wait_exit(Duration::from_secs(30))
            .expect("the server stops");
    }
    drop(d2);
}

/// A holder that hangs while alive (SIGSTOP): its addresses' kernel lifetime (2 s,
/// refreshed while it holds the lease) runs out, so its host goes silent before the
/// standby can take the lease (4 s); never both answer. Woken again (SIGCONT), it finds
/// itself late, lets go and stands by without answering again.
#[test]
fn a_hung_holder_goes_silent_before_the_standby_takes_over() {
    let f = Failover::new();
    let a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let mac_a = f.wait_single_answer("the first replica answering ARP");
    let _b = f.start(1, "ccm-b");
    // Hold the address a few lifetimes first: it is refreshed, not expiring.
    for _ in 0..30 {
        assert_eq!(arp_answers(&f.client, &f.vip), std::slice::from_ref(&mac_a));
    }
    a.signal("STOP");
    let stopped = Instant::now();
    let (silent, answered) = f.takeover(&mac_a, stopped, Duration::from_secs(30));
    eprintln!(
        "hung holder: silent {silent:?} after SIGSTOP (address lifetime); the standby answered from {answered:?}"
    );
    a.signal("CONT");
    // It lets go, or exits: its controllers' lease ran out too, and a leader that loses
    // that lease exits, as upstream's does.
    let mut a = a;
    wait_blocking("the woken replica lets go", Duration::from_secs(30), || {
        (a.exited() || a.logged("stepping down") || a.logged("giving up the pool's lease"))
            .then_some(())
    });
    for _ in 0..20 {
        let answers = arp_answers(&f.client, &f.vip);
        assert_eq!(answers.len(), 1, "after SIGCONT: {answers:?}");
        assert_ne!(answers[0], mac_a, "the woken replica answers again");
    }
    f.hundred_tries(20);
}

/// The holder's interface goes down: it gives up the load-balancer lease at once (not
/// when the lease runs out), and the standby takes the address; brought back up, the
/// first replica stands by and does not answer.
#[test]
fn a_holder_whose_interface_goes_down_gives_up_the_lease() {
    use tether_testkit::netns::Lan;
    let f = Failover::new();
    let a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let mac_a = f.wait_single_answer("the first replica answering ARP");
    let _b = f.start(1, "ccm-b");
    let holder_a = lb_lease_holder(&f.cluster).expect("a holder");
    f.hosts[0].ip(&["link", "set", Lan::INTERFACE, "down"]);
    let down = Instant::now();
    a.wait_event(
        "giving up the pool's lease",
        Duration::from_secs(30),
        |_| true,
    );
    let (_, answered) = f.takeover(&mac_a, down, Duration::from_secs(30));
    let holder = lb_lease_holder(&f.cluster);
    eprintln!("interface down: the standby answered ARP {answered:?} after the holder's interface went down");
    assert!(holder.is_some() && holder != Some(holder_a), "{holder:?}");
    assert!(
        answered < Duration::from_secs(3),
        "the standby took {answered:?}: the lease was not given up"
    );
    f.hosts[0].ip(&["link", "set", Lan::INTERFACE, "up"]);
    for _ in 0..20 {
        let answers = arp_answers(&f.client, &f.vip);
        assert_eq!(answers.len(), 1, "{answers:?}");
        assert_ne!(answers[0], mac_a);
    }
}

/// Partition: cut the holder from the apiserver only (its packets to the apiserver
/// dropped in its namespace). It lets go of the address when it cannot renew (2 s),
/// before the lease can run out for the standby (4 s): at no moment do both hosts
/// answer ARP; the time until only the standby answers is printed.
#[test]
fn a_holder_cut_from_the_apiserver_lets_go_before_the_standby_takes_over() {
    let f = Failover::new();
    let _a = f.start(0, "ccm-a");
    assert_eq!(wait_ingress(&f.cluster, "default", "web"), f.vip);
    let mac_a = f.wait_single_answer("the first replica answering ARP");
    let _b = f.start(1, "ccm-b");
    f.hosts[0].iptables(&[
        "-A",
        "OUTPUT",
        "-p",
        "tcp",
        "--dport",
        &f.cluster.port.to_string(),
        "-j",
        "DROP",
    ]);
    let cut = Instant::now();
    let (silent, answered) = f.takeover(&mac_a, cut, Duration::from_secs(40));
    eprintln!(
        "partition: the cut-off holder stopped answering ARP {silent:?} after the cut; only the standby answered from {answered:?}"
    );
    f.hundred_tries(20);
    drop(f.lan);
}

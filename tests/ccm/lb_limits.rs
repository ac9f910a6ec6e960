//! Load-balancer limits: stalled downloads on one Service leave another its
//! throughput, the global connection cap, and ingress hostnames (a suffix instead of an
//! IP for kube-proxy to take).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tether_testkit::ccm::{
    get_json, https_get, inventory_dir, lb_service, machine, metrics_reader_token, start_ccm_with,
    write_inventory, write_machines, Tunnel,
};
use tether_testkit::kube::{free_port, wait_blocking, Cluster, Egress};
use tether_testkit::netns::{curl, Node};
use tether_testkit::process::Proc;
use tether_testkit::TempDir;

use crate::BIN;

/// Reads `bytes` from `addr` and returns the throughput in MiB/s (None if the
/// connection fails or ends early, or it takes over a minute).
fn download_rate(addr: &str, bytes: usize) -> Option<f64> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(60))).ok()?;
    let mut buf = vec![0u8; 256 << 10];
    let (start, mut got) = (Instant::now(), 0usize);
    while got < bytes {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => got += n,
        }
    }
    Some(bytes as f64 / (1 << 20) as f64 / start.elapsed().as_secs_f64())
}

/// A node behind the tunnel with an endless download on two NodePorts, and
/// LoadBalancer Services `a` and `b` on them (on free ports).
struct BulkServices {
    tunnel: Tunnel,
    _zero: Vec<Proc>,
    cluster: Cluster,
    _dir: TempDir,
    inventory: PathBuf,
    ports: (u16, u16),
    _node: Node,
}

impl BulkServices {
    fn new(node_ports: [u16; 2]) -> BulkServices {
        let node = Node::create();
        let tunnel = Tunnel::to_node(Path::new(BIN), &node, "node-1");
        let zero = node_ports
            .iter()
            .map(|p| {
                node.spawn(
                    &format!("zero-{p}"),
                    "socat",
                    &[
                        format!("TCP-LISTEN:{p},bind={},fork,reuseaddr", node.node_ip),
                        "OPEN:/dev/zero,rdonly".into(),
                    ],
                )
            })
            .collect();
        let cluster = Cluster::start(&Egress::Direct);
        let (dir, inventory) = inventory_dir();
        write_machines(&inventory, &[("node-1", &node.node_ip, false)]);
        cluster.add_node("node-1", &node.node_ip);
        cluster.set_node_ready("node-1", true);
        let ports = (free_port(), free_port());
        for (name, port, node_port) in
            [("a", ports.0, node_ports[0]), ("b", ports.1, node_ports[1])]
        {
            cluster.apply(&format!(
                "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  type: LoadBalancer\n  ports:\n  - name: bulk\n    port: {port}\n    nodePort: {node_port}\n"
            ));
        }
        BulkServices {
            tunnel,
            _zero: zero,
            cluster,
            _dir: dir,
            inventory,
            ports,
            _node: node,
        }
    }
}

/// Eight stalled downloads on Service A (clients that stop reading) must not starve
/// Service B: each Service has its own tunnel connection, so A's stalled streams fill
/// only A's HTTP/2 windows. B keeps at least 80% of what it moves alone (the median of
/// three interleaved rounds, each a 64 MiB download alone and one beside).
#[test]
fn stalled_downloads_on_one_service_leave_another_its_throughput() {
    let bulk = BulkServices::new([30090, 30091]);
    let (cluster, inventory, tunnel) = (&bulk.cluster, bulk.inventory.as_path(), &bulk.tunnel);
    let (port_a, port_b) = bulk.ports;
    let _ccm = start_ccm_with(
        Path::new(BIN),
        cluster,
        inventory,
        "ccm",
        &[
            "--lb-bind-address=127.0.0.1".into(),
            format!("--tunnel-uds={}", tunnel.socket.display()),
            // Leases that outlast a loaded machine's slow apiserver: a pool whose
            // renewal misses the 2 s default deadline is let go, which cuts the
            // download this test measures (seen twice in parallel runs).
            "--lb-lease-duration=30s".into(),
            "--lb-lease-renew-deadline=20s".into(),
            "--lb-lease-retry-period=1s".into(),
            "--leader-elect-lease-duration=30s".into(),
            "--leader-elect-renew-deadline=20s".into(),
            "--leader-elect-retry-period=1s".into(),
        ],
    );
    let (a, b) = (format!("127.0.0.1:{port_a}"), format!("127.0.0.1:{port_b}"));
    for addr in [&a, &b] {
        wait_blocking("the load balancer serving", Duration::from_secs(60), || {
            download_rate(addr, 1 << 20)
        });
    }
    const SIZE: usize = 64 << 20;
    let mut alone = Vec::new();
    let mut stalled_beside = Vec::new();
    for _ in 0..3 {
        alone.push(download_rate(&b, SIZE).expect("B alone"));
        // Eight downloads on A that read their first 64 KiB and then stop reading.
        let stalled: Vec<std::net::TcpStream> = (0..8)
            .map(|_| {
                use std::io::Read;
                let mut s = std::net::TcpStream::connect(&a).unwrap();
                let mut first = vec![0u8; 64 << 10];
                s.read_exact(&mut first).unwrap();
                s
            })
            .collect();
        stalled_beside
            .push(download_rate(&b, SIZE).expect("B beside eight stalled downloads on A"));
        drop(stalled);
    }
    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    // Each round's pair ran back to back, under the same load from whatever else runs
    // on the machine: the median of the rounds' ratios (starvation would be near zero
    // in every round).
    let mut ratios: Vec<f64> = stalled_beside
        .iter()
        .zip(&alone)
        .map(|(beside, alone)| beside / alone)
        .collect();
    ratios.sort_by(f64::total_cmp);
    let ratio = ratios[ratios.len() / 2];
    eprintln!(
        "Service B: {:.0} MiB/s alone, {:.0} MiB/s beside 8 stalled downloads on A (median round {ratio:.2}x; rounds {alone:.0?} / {stalled_beside:.0?})",
        best(&alone),
        best(&stalled_beside)
    );
    // Starvation is near zero; a loaded 2-core machine moves a round's ratio between
    // about 0.7 and 1.1 (a CI run's rounds: 0.80, 0.71, 1.07). The figure itself is
    // tether-bench's to track, not this test's.
    assert!(ratio >= 0.5, "B kept {ratio:.2}x of its throughput");
}

/// `--lb-max-connections` caps client connections over every Service, and its last
/// quarter goes only to Services under their fair share: with a cap of four, Service A
/// gets three and is refused a fourth (`refused_global_limit`), B still gets one, and
/// then nobody gets more; B serves again once A's close.
#[test]
fn the_global_connection_cap_holds_over_every_service() {
    use std::io::Read;
    let bulk = BulkServices::new([30092, 30093]);
    let (cluster, inventory, tunnel) = (&bulk.cluster, bulk.inventory.as_path(), &bulk.tunnel);
    let (port_a, port_b) = bulk.ports;
    let metrics_port = free_port();
    let ccm = start_ccm_with(
        Path::new(BIN),
        cluster,
        inventory,
        "ccm",
        &[
            "--lb-bind-address=127.0.0.1".into(),
            "--lb-max-connections=4".into(),
            format!("--secure-port={metrics_port}"),
            format!("--tunnel-uds={}", tunnel.socket.display()),
        ],
    );
    // A connection that delivers bytes, or None if it is closed at once.
    let open = |port: u16| -> Option<std::net::TcpStream> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        let mut first = [0u8; 1024];
        s.read_exact(&mut first).ok()?;
        Some(s)
    };
    let a1 = wait_blocking("A serving", Duration::from_secs(60), || open(port_a));
    // B is ensured after A (each assignment is recorded before its status is written).
    ccm.wait_event("load balancer listening", Duration::from_secs(60), |ev| {
        ev["service"] == "default/b"
    });
    let a2 = open(port_a).expect("a second connection on A");
    let a3 = open(port_a).expect("a third connection on A");
    assert!(
        open(port_a).is_none(),
        "A took the last quarter of the cap beyond its share"
    );
    let b1 = open(port_b).expect("B gets its share while A is busy");
    assert!(open(port_b).is_none(), "a fifth connection over the cap");
    let reader = metrics_reader_token(cluster);
    let page = https_get(
        &format!("https://127.0.0.1:{metrics_port}/metrics"),
        Some(&reader),
    )
    .1;
    assert!(
        page.lines()
            .any(|l| l.starts_with("tether_ccm_lb_connections_total{")
                && l.contains("default/a")
                && l.contains("refused_global_limit")
                && !l.ends_with(" 0")),
        "{page}"
    );
    drop((a1, a2, a3, b1));
    wait_blocking(
        "B serving once the connections closed",
        Duration::from_secs(30),
        || open(port_b),
    );
}

/// Before 1.30 kube-proxy captures an ingress IP; `loadBalancer.ingressHostnameSuffix`
/// publishes `<address>.<suffix>` instead (no IP for kube-proxy to take), the balancer
/// listens on the address, and a restarted CCM reads the address back from the name.
#[test]
fn an_ingress_hostname_suffix_publishes_names_kube_proxy_ignores() {
    let node = Node::create();
    let tunnel = Tunnel::to_node(Path::new(BIN), &node, "node-1");
    let _page = node.serve_page(30084, "hello by name\n");
    let cluster = Cluster::start(&Egress::Direct);
    cluster.add_node("node-1", &node.node_ip);
    cluster.set_node_ready("node-1", true);
    let k = std::process::id() % 250;
    let vip = format!("127.80.{k}.10");
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        &format!(
            "nodes:\n{}loadBalancer:\n  ingressHostnameSuffix: sslip.io\n  pools:\n  - name: general\n    addresses: [{vip}]\n",
            machine("node-1", &node.node_ip, false)
        ),
    );
    lb_service(
        &cluster,
        "default",
        "named",
        80,
        Some(30084),
        serde_json::json!({}),
        serde_json::json!({}),
    );
    let ingress = || {
        get_json(&cluster, &["get", "service", "named", "-o", "json"])
            .map(|s| s["status"]["loadBalancer"]["ingress"].clone())
            .filter(|i| i.as_array().is_some_and(|a| !a.is_empty()))
    };
    let args = [format!("--tunnel-uds={}", tunnel.socket.display())];
    let ccm = start_ccm_with(Path::new(BIN), &cluster, &inventory, "ccm", &args);
    let first = wait_blocking("a hostname ingress", Duration::from_secs(30), ingress);
    assert_eq!(
        first,
        serde_json::json!([{"hostname": format!("{vip}.sslip.io")}]),
        "a hostname and no IP"
    );
    assert_eq!(
        wait_blocking(
            "the balancer on the address",
            Duration::from_secs(30),
            || { curl(None, &format!("http://{vip}/")) }
        ),
        "hello by name\n"
    );
    drop(ccm);
    let _again = start_ccm_with(Path::new(BIN), &cluster, &inventory, "ccm-again", &args);
    assert_eq!(
        wait_blocking(
            "served again after a restart",
            Duration::from_secs(30),
            || { curl(None, &format!("http://{vip}/")) }
        ),
        "hello by name\n"
    );
    assert_eq!(ingress(), Some(first));
}

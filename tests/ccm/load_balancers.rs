//! LoadBalancer Services through the tunnel: reachability, ports, source ranges,
//! limits and metrics; addresses from pools (sharing, restarts, exhaustion, PROXY
//! headers); `externalTrafficPolicy: Local`; pod IPs dialled by the agent on their node.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use tether_testkit::ccm::{
    add_node_with_pod_cidr, allocation_record, event_count, https_get, ingress_ips, inventory_dir,
    lb_service, machine, metrics_reader_token, start_ccm_with, wait_for_event, wait_ingress,
    write_inventory, write_machines, Tunnel,
};
use tether_testkit::kube::{free_port, wait_blocking, Cluster, Egress};
use tether_testkit::netns::{curl, curl_within, Node};
use tether_testkit::process::{socket_path, uds_frontend_args};
use tether_testkit::{AgentProc, Pki, ServerProc};

use crate::BIN;

#[test]
fn a_load_balancer_service_is_reachable_through_the_tunnel() {
    // A node on its own network: its address is reachable only through its agent.
    let node = Node::create();
    let tunnel = Tunnel::to_node(Path::new(BIN), &node, "node-1");
    let socket = &tunnel.socket;
    // The "NodePort": an HTTP server on the node's private address.
    let _page = node.serve_page(30080, "hello from node-1\n");
    let node_url = format!("http://{}:30080/", node.node_ip);
    wait_blocking("node port serving", Duration::from_secs(20), || {
        curl(Some(&node.ns), &node_url)
    });
    assert!(
        curl(None, &node_url).is_none(),
        "the node must not be reachable directly"
    );

    let cluster = Cluster::start(&Egress::Direct);
    let (_dir, inventory) = inventory_dir();
    write_machines(&inventory, &[("node-1", &node.node_ip, false)]);
    cluster.add_node("node-1", &node.node_ip);
    cluster.set_node_ready("node-1", true);
    let port = free_port();
    cluster.apply(&format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\nspec:\n  type: LoadBalancer\n  ports:\n  - name: http\n    port: {port}\n    nodePort: 30080\n"
    ));
    let secure = free_port();
    let ccm = start_ccm_with(
        Path::new(BIN),
        &cluster,
        &inventory,
        "ccm",
        &[
            "--lb-bind-address=127.0.0.1".into(),
            format!("--tunnel-uds={}", socket.display()),
            format!("--secure-port={secure}"),
        ],
    );
    let svc = wait_blocking("ingress IP", Duration::from_secs(30), || {
        let out = cluster.kubectl_ok(&["get", "service", "web", "-o", "json"]);
        let v: Value = serde_json::from_str(&out).unwrap();
        (v["status"]["loadBalancer"]["ingress"][0]["ip"] == "127.0.0.1").then_some(v)
    });
    assert_eq!(
        svc["metadata"]["finalizers"][0],
        "service.kubernetes.io/load-balancer-cleanup"
    );
    let lb_url = format!("http://127.0.0.1:{port}/");
    for _ in 0..5 {
        let body = wait_blocking(
            "page through the load balancer",
            Duration::from_secs(20),
            || curl(None, &lb_url),
        );
        assert_eq!(body, "hello from node-1\n");
    }
    for reason in ["EnsuringLoadBalancer", "EnsuredLoadBalancer"] {
        assert!(
            cluster.has_event("default", "web", reason),
            "no {reason} event"
        );
    }

    // A long-lived connection on one port survives another port being added: only what
    // changed is rebound. (An echo server on the node, port 30081.)
    let _echo = node.spawn(
        "echo",
        "socat",
        &[
            format!("TCP-LISTEN:30081,bind={},fork,reuseaddr", node.node_ip),
            "EXEC:cat".into(),
        ],
    );
    let add_port = |name: &str, port: u16, node_port: u16| {
        cluster.kubectl_ok(&[
            "patch",
            "service",
            "web",
            "--type=json",
            "-p",
            &format!(r#"[{{"op":"add","path":"/spec/ports/-","value":{{"name":"{name}","port":{port},"nodePort":{node_port}}}}}]"#),
        ]);
    };
    let echo_port = free_port();
    add_port("echo", echo_port, 30081);
    let mut held = wait_blocking(
        "echo through the load balancer",
        Duration::from_secs(30),
        || {
            use std::io::{Read, Write};
            let mut c = std::net::TcpStream::connect(("127.0.0.1", echo_port)).ok()?;
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            c.write_all(b"a").ok()?;
            let mut b = [0u8; 1];
            c.read_exact(&mut b).ok()?;
            (&b == b"a").then_some(c)
        },
    );
    let third = free_port();
    add_port("third", third, 30082);
    wait_blocking("the third port listening", Duration::from_secs(30), || {
        std::net::TcpStream::connect(("127.0.0.1", third)).ok()
    });
    {
        use std::io::{Read, Write};
        held.write_all(b"b").expect("the held connection was cut");
        let mut b = [0u8; 1];
        held.read_exact(&mut b)
            .expect("the held connection was cut");
        assert_eq!(&b, b"b");
    }
    assert_eq!(
        wait_blocking("page after the change", Duration::from_secs(20), || curl(
            None, &lb_url
        )),
        "hello from node-1\n"
    );
    // UDP cannot go through Konnectivity: one Warning event, nothing else breaks.
    cluster.apply(&format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: dns\n  namespace: default\nspec:\n  type: LoadBalancer\n  ports:\n  - name: dns\n    protocol: UDP\n    port: {}\n",
        free_port()
    ));
    wait_for_event(&cluster, "dns", "UnsupportedProtocol");
    // With no TCP port it gets no address and no ingress.
    assert!(ingress_ips(&cluster, "default", "dns").is_empty());
    cluster.kubectl_ok(&["delete", "service", "dns"]);

    // Source ranges are enforced at accept, changed in place, and counted.
    let patch_web = |spec: &str| {
        cluster.kubectl_ok(&[
            "patch",
            "service",
            "web",
            "--type=merge",
            "-p",
            &format!(r#"{{"spec":{spec}}}"#),
        ]);
    };
    let ranges = |list: &str| patch_web(&format!(r#"{{"loadBalancerSourceRanges":{list}}}"#));
    ranges(r#"["10.99.0.0/24"]"#);
    wait_blocking(
        "a client outside the ranges refused",
        Duration::from_secs(30),
        || curl(None, &lb_url).is_none().then_some(()),
    );
    ranges(r#"["10.99.0.0/24","127.0.0.0/8"]"#);
    assert_eq!(
        wait_blocking("admitted again", Duration::from_secs(30), || curl(
            None, &lb_url
        )),
        "hello from node-1\n"
    );
    // Limits: one connection at a time, closed after 1 s idle.
    drop(held);
    cluster.kubectl_ok(&[
        "annotate",
        "service",
        "web",
        "tether.dev/lb-max-connections=1",
        "tether.dev/lb-idle-timeout=1s",
    ]);
    let echo = |c: &mut std::net::TcpStream, byte: u8| -> bool {
        use std::io::{Read, Write};
        let mut b = [0u8; 1];
        c.write_all(&[byte]).is_ok() && c.read_exact(&mut b).is_ok() && b[0] == byte
    };
    // A connection admitted before the annotations reached the balancer keeps the old
    // policy (no limit, the default idle timeout), so retry until one connection both
    // holds the only slot and is closed by the 1 s idle timeout: EOF, not a read timeout.
    wait_blocking("the limit applied", Duration::from_secs(60), || {
        use std::io::Read;
        let mut a = std::net::TcpStream::connect(("127.0.0.1", echo_port)).ok()?;
        a.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        if !echo(&mut a, b'c') {
            return None;
        }
        // A second one at once is refused while the first is open.
        let mut b = std::net::TcpStream::connect(("127.0.0.1", echo_port)).ok()?;
        b.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        if echo(&mut b, b'd') {
            return None;
        }
        // Idle for 1 s: the balancer closes it (EOF within the read deadline).
        a.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut byte = [0u8; 1];
        matches!(a.read(&mut byte), Ok(0)).then_some(())
    });
    wait_blocking(
        "a new connection after the idle one closed",
        Duration::from_secs(30),
        || {
            let mut c = std::net::TcpStream::connect(("127.0.0.1", echo_port)).ok()?;
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            echo(&mut c, b'e').then_some(())
        },
    );
    let reader = metrics_reader_token(&cluster);
    let metrics_url = format!("https://127.0.0.1:{secure}/metrics");
    let page = https_get(&metrics_url, Some(&reader)).1;
    let value = |needles: &[&str]| -> f64 {
        page.lines()
            .find(|l| needles.iter().all(|n| l.contains(n)))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    let web = "service=\"default/web\"";
    assert!(
        value(&[
            "tether_ccm_lb_connections_total{",
            web,
            "refused_source_range"
        ]) >= 1.0,
        "{page}"
    );
    assert!(
        value(&["tether_ccm_lb_connections_total{", web, "\"accepted\""]) >= 6.0,
        "{page}"
    );
    assert!(
        value(&["tether_ccm_lb_bytes_total{", web, "to_client"]) > 0.0,
        "{page}"
    );
    assert!(
        value(&["tether_ccm_lb_connections_total{", web, "refused_limit"]) >= 1.0,
        "{page}"
    );

    // externalTrafficPolicy: Local: only nodes with a ready endpoint are backends.
    patch_web(r#"{"externalTrafficPolicy":"Local"}"#);
    wait_blocking(
        "no node has an endpoint: nothing served",
        Duration::from_secs(30),
        || curl(None, &lb_url).is_none().then_some(()),
    );
    cluster.apply(&endpoint_slice(
        "web",
        "http",
        30080,
        &[(&node.node_ip, "node-1")],
    ));
    assert_eq!(
        wait_blocking(
            "node-1 has a ready endpoint: served",
            Duration::from_secs(30),
            || curl(None, &lb_url)
        ),
        "hello from node-1\n"
    );

    // Deleting the Service removes the listener, then the finalizer (and so the
    // Service).
    cluster.kubectl_ok(&["delete", "service", "web", "--wait=false"]);
    wait_blocking("service gone", Duration::from_secs(30), || {
        (!cluster.kubectl(&["get", "service", "web"]).status.success()).then_some(())
    });
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "listener still open after the Service was deleted"
    );
    // Its per-Service series went with it.
    let page = https_get(&metrics_url, Some(&reader)).1;
    assert!(page.contains("tether_ccm_lb_"), "{page}");
    assert!(
        !page
            .lines()
            .any(|l| l.starts_with("tether_ccm_lb_") && l.contains(web)),
        "series of the deleted Service remain:\n{page}"
    );
    // 1.20 drops ipMode: the CCM wrote it once, learnt that, and said so once; after
    // that the status was compared without it (no status write loop through all the
    // changes above).
    assert_eq!(
        ccm.count_events("the apiserver drops status.loadBalancer.ingress[].ipMode (Kubernetes before 1.30): kube-proxy captures the load balancers' addresses on every node it runs on; keep it off the hosts that hold them (docs/ccm.md#before-kubernetes-130)"),
        1,
        "{}",
        ccm.log_text()
    );
    drop(tunnel);
}

/// An EndpointSlice (v1beta1, as 1.20 serves it) of Service `default/service`: ready
/// endpoints (address, node) on port `port` named `port_name`. The tests' clusters run
/// no kube-controller-manager, so hand-made Endpoints would not be mirrored into one.
/// A dual-stack node (InternalIPs IPv4 and IPv6) behind the tunnel, and a LoadBalancer
/// Service of each family (1.20's `IPv6DualStack` gate): each balancer dials the node at
/// its InternalIP of the Service's family. The node's port 30081 answers differently on
/// each address, so a balancer that took the wrong one would show it.
#[test]
fn each_family_of_service_reaches_the_node_at_its_address_of_that_family() {
    let node = Node::create();
    let tunnel = Tunnel::to_node(Path::new(BIN), &node, "node-1");
    let v6 = format!("[{}]", node.node_ip6);
    let _v4_page = node.serve_page_at(&node.node_ip, 30080, "v4 service, v4 address\n");
    let _v6_page = node.serve_page_at(&node.node_ip6, 30081, "v6 service, v6 address\n");
    let _wrong = node.serve_page_at(&node.node_ip, 30081, "v6 service, v4 address\n");
    for url in [
        format!("http://{}:30080/", node.node_ip),
        format!("http://{v6}:30081/"),
    ] {
        wait_blocking("node ports serving", Duration::from_secs(20), || {
            curl(Some(&node.ns), &url)
        });
        assert!(
            curl(None, &url).is_none(),
            "{url} reachable without the tunnel"
        );
    }
    let cluster = Cluster::start_with(
        &Egress::Direct,
        &tether_testkit::kube::ClusterOptions {
            dual_stack: true,
            ..Default::default()
        },
    );
    let (_dir, inventory) = inventory_dir();
    write_machines(&inventory, &[("node-1", &node.node_ip, false)]);
    cluster.add_node("node-1", &node.node_ip);
    cluster.patch_node_status(
        "node-1",
        &format!(
            r#"{{"addresses":[{{"type":"InternalIP","address":"{}"}},{{"type":"InternalIP","address":"{}"}}]}}"#,
            node.node_ip, node.node_ip6
        ),
    );
    cluster.set_node_ready("node-1", true);
    let (p4, p6) = (free_port(), free_port());
    for (name, family, port, node_port) in
        [("web4", "IPv4", p4, 30080), ("web6", "IPv6", p6, 30081)]
    {
        cluster.apply(&format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  type: LoadBalancer\n  ipFamilies: [{family}]\n  ports:\n  - name: http\n    port: {port}\n    nodePort: {node_port}\n"
        ));
    }
    let secure = free_port();
    let _ccm = start_ccm_with(
        Path::new(BIN),
        &cluster,
        &inventory,
        "ccm",
        &[
            "--lb-bind-address=127.0.0.1".into(),
            format!("--tunnel-uds={}", tunnel.socket.display()),
            format!("--secure-port={secure}"),
        ],
    );
    for (port, body) in [
        (p4, "v4 service, v4 address\n"),
        (p6, "v6 service, v6 address\n"),
    ] {
        let got = wait_blocking(
            "a page through each balancer",
            Duration::from_secs(60),
            || curl(None, &format!("http://127.0.0.1:{port}/")),
        );
        assert_eq!(got, body);
    }
}

fn endpoint_slice(service: &str, port_name: &str, port: u16, endpoints: &[(&str, &str)]) -> String {
    let endpoints: String = endpoints
        .iter()
        .map(|(ip, node)| {
            format!("- addresses: [{ip}]\n  conditions:\n    ready: true\n  topology:\n    kubernetes.io/hostname: {node}\n")
        })
        .collect();
    format!(
        "apiVersion: discovery.k8s.io/v1beta1\nkind: EndpointSlice\nmetadata:\n  name: {service}-1\n  namespace: default\n  labels:\n    kubernetes.io/service-name: {service}\n    endpointslice.kubernetes.io/managed-by: tests\naddressType: IPv4\nendpoints:\n{endpoints}ports:\n- name: {port_name}\n  port: {port}\n  protocol: TCP\n"
    )
}

/// Address pools against the real apiserver: two Services on port 443 get distinct
/// addresses and both serve; `loadBalancerIP` is honoured; an address taken, outside
/// the pools (or in another namespace's pool) or of the wrong family is one Warning
/// event; a sharing key shares an address until ports collide, and across namespaces
/// only when both sides opt in; a namespace's pool
/// serves it first; allocations survive a restart (a Service created meanwhile does
/// not take them); an exhausted pool is an event, and the Service gets the address a
/// deleted one frees; `allocateLoadBalancerNodePorts: false` reaches the pod; a PROXY
/// header carries the client's address.
#[test]
fn services_get_their_own_addresses_from_the_pools() {
    use serde_json::json;
    let node = Node::create();
    let tunnel = Tunnel::to_node(Path::new(BIN), &node, "node-1");
    let _page_a = node.serve_page(30080, "page a\n");
    let _page_b = node.serve_page(30081, "page b\n");
    let _pod = node.serve_page_at(&node.pod_ip, 8080, "from the pod\n");
    let _echo = node.spawn(
        "echo",
        "socat",
        &[
            format!("TCP-LISTEN:30090,bind={},fork,reuseaddr", node.node_ip),
            "EXEC:cat".into(),
        ],
    );
    wait_blocking("node pages serving", Duration::from_secs(20), || {
        curl(Some(&node.ns), &format!("http://{}:30081/", node.node_ip))
    });

    let cluster = Cluster::start(&Egress::Direct);
    cluster.add_node("node-1", &node.node_ip);
    cluster.set_node_ready("node-1", true);
    cluster.kubectl_ok(&["create", "namespace", "team"]);
    let k = std::process::id() % 250;
    let addr = |n: u8| format!("127.77.{k}.{n}");
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        &format!(
            "nodes:\n{}loadBalancer:\n  pools:\n  - name: general\n    addresses: [{}-{}]\n  - name: team\n    addresses: [{}]\n    namespaces: [team]\n",
            machine("node-1", &node.node_ip, false),
            addr(10),
            addr(17),
            addr(30)
        ),
    );
    let no = json!({});
    lb_service(
        &cluster,
        "default",
        "web-a",
        443,
        Some(30080),
        json!({}),
        json!({}),
    );
    lb_service(
        &cluster,
        "default",
        "web-b",
        443,
        Some(30081),
        json!({}),
        json!({}),
    );
    let secure = free_port();
    let ccm_args = [
        format!("--tunnel-uds={}", tunnel.socket.display()),
        "--lb-resync-period=1s".into(),
        format!("--secure-port={secure}"),
    ];
    let mut ccm = start_ccm_with(Path::new(BIN), &cluster, &inventory, "ccm", &ccm_args);

    // Two Services on 443: their own addresses, both serving.
    let ip_a = wait_ingress(&cluster, "default", "web-a");
    let ip_b = wait_ingress(&cluster, "default", "web-b");
    assert_ne!(ip_a, ip_b);
    for (ip, page) in [(&ip_a, "page a\n"), (&ip_b, "page b\n")] {
        let got = wait_blocking(
            &format!("{page:?} at {ip}:443"),
            Duration::from_secs(20),
            || curl(None, &format!("http://{ip}:443/")),
        );
        assert_eq!(got, page);
    }

    // Asked for: honoured; taken, outside every pool, another namespace's, the wrong
    // family: one event naming why, and no address.
    lb_service(
        &cluster,
        "default",
        "web-c",
        8080,
        None,
        json!({}),
        json!({"loadBalancerIP": addr(17)}),
    );
    assert_eq!(wait_ingress(&cluster, "default", "web-c"), addr(17));
    lb_service(
        &cluster,
        "default",
        "web-d",
        8080,
        None,
        json!({}),
        json!({"loadBalancerIP": ip_a}),
    );
    lb_service(
        &cluster,
        "default",
        "web-e",
        8080,
        None,
        json!({}),
        json!({"loadBalancerIP": "127.99.0.1"}),
    );
    lb_service(
        &cluster,
        "default",
        "web-t",
        8080,
        None,
        json!({}),
        json!({"loadBalancerIP": addr(30)}),
    );
    lb_service(
        &cluster,
        "default",
        "web-f",
        8080,
        None,
        json!({"tether.dev/load-balancer-ips": "fd00::1"}),
        no.clone(),
    );
    for (name, reason) in [
        ("web-d", "AddressInUse"),
        ("web-e", "AddressNotInPool"),
        ("web-t", "AddressNotInPool"),
        ("web-f", "AddressFamilyMismatch"),
    ] {
        wait_for_event(&cluster, name, reason);
        assert!(
            ingress_ips(&cluster, "default", name).is_empty(),
            "{name} got an address"
        );
    }
    for name in ["web-e", "web-t", "web-f"] {
        cluster.kubectl_ok(&["delete", "service", name]);
    }
    // A namespace's own pool first.
    lb_service(&cluster, "team", "t1", 8080, None, json!({}), no.clone());
    assert_eq!(wait_ingress(&cluster, "team", "t1"), addr(30));

    // A sharing key shares an address while the ports differ.
    let key = json!({"tether.dev/lb-sharing-key": "dns"});
    lb_service(
        &cluster,
        "default",
        "s1",
        8053,
        None,
        key.clone(),
        no.clone(),
    );
    let ip_s = wait_ingress(&cluster, "default", "s1");
    lb_service(
        &cluster,
        "default",
        "s2",
        8054,
        None,
        key.clone(),
        no.clone(),
    );
    assert_eq!(wait_ingress(&cluster, "default", "s2"), ip_s);
    lb_service(
        &cluster,
        "default",
        "s3",
        8053,
        None,
        key.clone(),
        json!({"loadBalancerIP": ip_s}),
    );
    wait_for_event(&cluster, "s3", "PortCollision");
    cluster.kubectl_ok(&["delete", "service", "s3"]);

    // The same key in another namespace gets an address of its own, until both sides
    // name each other's namespace.
    lb_service(&cluster, "team", "x1", 8055, None, key.clone(), no.clone());
    let ip_x = wait_ingress(&cluster, "team", "x1");
    assert_ne!(ip_x, ip_s, "shared across namespaces without an opt-in");
    let cross = |ns: &str| json!({"tether.dev/lb-sharing-key": "dns", "tether.dev/lb-sharing-cross-namespace": ns});
    lb_service(
        &cluster,
        "default",
        "s1",
        8053,
        None,
        cross("team"),
        no.clone(),
    );
    lb_service(
        &cluster,
        "default",
        "s2",
        8054,
        None,
        cross("team"),
        no.clone(),
    );
    lb_service(
        &cluster,
        "team",
        "x2",
        8056,
        None,
        cross("default"),
        json!({"loadBalancerIP": ip_s}),
    );
    assert_eq!(wait_ingress(&cluster, "team", "x2"), ip_s);
    cluster.kubectl_ok(&["delete", "service", "-n", "team", "x1", "x2"]);

    // No node ports: straight to the ready endpoint's pod IP and targetPort.
    lb_service(
        &cluster,
        "default",
        "web-p",
        80,
        None,
        no.clone(),
        json!({"allocateLoadBalancerNodePorts": false, "ports": [{"name": "p", "port": 80, "targetPort": 8080}]}),
    );
    let svc_p: Value =
        serde_json::from_str(&cluster.kubectl_ok(&["get", "service", "web-p", "-o", "json"]))
            .unwrap();
    assert!(
        svc_p["spec"]["ports"][0]["nodePort"].is_null(),
        "the apiserver allocated a nodePort: {svc_p}"
    );
    // An EndpointSlice and no Endpoints (as a cluster whose Endpoints stopped at 1,000
    // addresses, or a controller that writes only slices): v1beta1 is what 1.20 serves.
    cluster.apply(&endpoint_slice(
        "web-p",
        "p",
        8080,
        &[(&node.pod_ip, "node-1")],
    ));
    assert!(cluster
        .kubectl(&["get", "endpoints", "web-p"])
        .stderr
        .starts_with(b"Error from server (NotFound)"));
    let ip_p = wait_ingress(&cluster, "default", "web-p");
    assert_eq!(
        wait_blocking(
            "the pod through the balancer",
            Duration::from_secs(30),
            || curl(None, &format!("http://{ip_p}:80/"))
        ),
        "from the pod\n"
    );

    // PROXY protocol v1: the echo backend sends back what it got first.
    lb_service(
        &cluster,
        "default",
        "web-pp",
        7000,
        Some(30090),
        json!({"tether.dev/lb-proxy-protocol": "v1"}),
        no.clone(),
    );
    let ip_pp = wait_ingress(&cluster, "default", "web-pp");
    let (line, client_port) =
        wait_blocking("a PROXY header echoed", Duration::from_secs(30), || {
            use std::io::{BufRead, BufReader};
            let c = std::net::TcpStream::connect((ip_pp.as_str(), 7000)).ok()?;
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let port = c.local_addr().unwrap().port();
            let mut line = String::new();
            BufReader::new(c).read_line(&mut line).ok()?;
            (!line.is_empty()).then_some((line, port))
        });
    assert_eq!(
        line,
        format!("PROXY TCP4 127.0.0.1 {ip_pp} {client_port} 7000\r\n")
    );

    // Said once, though resyncs (every second) came and went meanwhile.
    assert_eq!(event_count(&cluster, "web-d", "AddressInUse"), 1);

    // A restart, from a version that kept no allocation record (its data removed):
    // allocations read back from the statuses, and the record written from them; a
    // Service created while no CCM ran does not take any of them.
    let before: Vec<(String, String)> = ["web-a", "web-b", "web-c", "s1", "s2", "web-p", "web-pp"]
        .iter()
        .map(|n| (n.to_string(), wait_ingress(&cluster, "default", n)))
        .collect();
    ccm.kill();
    cluster.kubectl_ok(&[
        "patch",
        "configmap",
        "-n",
        "kube-system",
        "cloud-controller-manager-lb-allocations",
        "--type=json",
        "-p",
        r#"[{"op":"remove","path":"/data"}]"#,
    ]);
    lb_service(
        &cluster,
        "default",
        "web-n",
        8080,
        None,
        no.clone(),
        no.clone(),
    );
    let ccm = start_ccm_with(Path::new(BIN), &cluster, &inventory, "ccm-2", &ccm_args);
    let ip_n = wait_ingress(&cluster, "default", "web-n");
    assert!(
        before.iter().all(|(_, ip)| *ip != ip_n),
        "{ip_n} handed out twice: {before:?}"
    );
    for (name, ip) in &before {
        assert_eq!(&wait_ingress(&cluster, "default", name), ip, "{name} moved");
    }
    let record = allocation_record(&cluster);
    for (name, ip) in &before {
        assert!(
            record.contains(ip.as_str()),
            "{name}'s {ip} not in the record: {record}"
        );
    }
    assert_eq!(
        wait_blocking("web-a after the restart", Duration::from_secs(20), || curl(
            None,
            &format!("http://{ip_a}:443/")
        )),
        "page a\n"
    );

    // The pool runs out: an event; a deleted Service's address goes to the waiting one.
    lb_service(
        &cluster,
        "default",
        "x1",
        8080,
        None,
        no.clone(),
        no.clone(),
    );
    wait_ingress(&cluster, "default", "x1");
    lb_service(
        &cluster,
        "default",
        "x2",
        8080,
        None,
        no.clone(),
        no.clone(),
    );
    wait_for_event(&cluster, "x2", "NoAddressAvailable");
    cluster.kubectl_ok(&["delete", "service", "web-c"]);
    assert_eq!(wait_ingress(&cluster, "default", "x2"), addr(17));
    // An address freed by a change (not a deletion) goes to the Service refused for
    // it: web-a moves to x2's address once x2 is gone, and web-d, refused since the
    // start for wanting ip_a, gets it.
    cluster.kubectl_ok(&["delete", "service", "x2"]);
    lb_service(
        &cluster,
        "default",
        "web-a",
        443,
        Some(30080),
        no.clone(),
        json!({"loadBalancerIP": addr(17)}),
    );
    assert_eq!(
        wait_blocking("web-a moved", Duration::from_secs(30), || {
            let ips = ingress_ips(&cluster, "default", "web-a");
            (ips == [addr(17)]).then_some(ips)
        }),
        [addr(17)]
    );
    assert_eq!(wait_ingress(&cluster, "default", "web-d"), ip_a);

    // The general pool is full. Pools reload without a restart: one more address in
    // the cloud config, and the waiting Service gets it at the next resync.
    lb_service(
        &cluster,
        "default",
        "x3",
        8080,
        None,
        no.clone(),
        no.clone(),
    );
    wait_for_event(&cluster, "x3", "NoAddressAvailable");
    let url = format!("https://127.0.0.1:{secure}/metrics");
    let reader = metrics_reader_token(&cluster);
    let page = https_get(&url, Some(&reader)).1;
    // (addresses in all, in use) of the general pool.
    let usage = |page: &str| {
        let gauge =
            |name: &str| tether_testkit::metric(page, &format!("{name}{{pool=\"general\"}}"));
        (
            gauge("tether_ccm_lb_addresses_total"),
            gauge("tether_ccm_lb_addresses_in_use"),
        )
    };
    assert_eq!(usage(&page), (Some(8.0), Some(8.0)), "{page}");
    write_inventory(
        &inventory,
        &format!(
            "nodes:\n{}loadBalancer:\n  pools:\n  - name: general\n    addresses: [{}-{}]\n  - name: team\n    addresses: [{}]\n    namespaces: [team]\n",
            machine("node-1", &node.node_ip, false),
            addr(10),
            addr(18),
            addr(30)
        ),
    );
    assert_eq!(wait_ingress(&cluster, "default", "x3"), addr(18));
    let page = https_get(&url, Some(&reader)).1;
    assert_eq!(usage(&page), (Some(9.0), Some(9.0)), "{page}");
    drop(ccm);
    drop(tunnel);
}

/// `allocateLoadBalancerNodePorts: false` with pod networks that are not routed between
/// nodes: the server (`destCIDR` with `--watch-node-pod-cidrs`, RBAC from
/// deploy/rbac.yaml) sends each dial to a pod IP to the agent on that pod's node, so
/// every connection through the balancer reaches its pod, on either node.
#[test]
fn a_pod_ip_is_dialled_by_the_agent_on_its_node() {
    use serde_json::json;
    let nodes = [Node::create(), Node::create()];
    let pki = Pki::with_sans(&[nodes[0].host_ip.clone(), nodes[1].host_ip.clone()]);
    let socket = socket_path(pki.dir());
    let cluster = Cluster::start(&Egress::Direct);
    cluster.apply_shipped_rbac();
    let mut args = uds_frontend_args(&pki, "grpc", &socket);
    args.extend([
        "--agent-bind-address=0.0.0.0".into(),
        "--proxy-strategies=destHost,destCIDR".into(),
        "--watch-node-pod-cidrs".into(),
        format!("--kubeconfig={}", cluster.files.server_kubeconfig.display()),
    ]);
    let server = ServerProc::start(Path::new(BIN), &args);
    let mut machines = String::new();
    let mut endpoints = Vec::new();
    let mut _running = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let name = format!("node-{i}");
        // Its own node's certificate: the server routes to the agent it verified.
        _running.push(node_agent(node, &name, &pki, &server));
        let pod_cidr = format!("{}.0/24", &node.pod_ip[..node.pod_ip.rfind('.').unwrap()]);
        add_node_with_pod_cidr(&cluster, &name, &node.node_ip, &pod_cidr);
        cluster.set_node_ready(&name, true);
        machines.push_str(&machine(&name, &node.node_ip, false));
        endpoints.push((node.pod_ip.as_str(), name));
    }
    let _pods: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| n.serve_page_at(&n.pod_ip, 8080, &format!("pod on node-{i}\n")))
        .collect();
    for (i, node) in nodes.iter().enumerate() {
        let url = format!("http://{}:8080/", node.pod_ip);
        wait_blocking("pod serving", Duration::from_secs(20), || {
            curl(Some(&node.ns), &url)
        });
        assert!(
            curl_within(Some(&nodes[1 - i].ns), &url, "2").is_none(),
            "pod networks must not be routed between the nodes"
        );
    }

    let k = std::process::id() % 250;
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        &format!("nodes:\n{machines}loadBalancer:\n  pools:\n  - name: general\n    addresses: [127.78.{k}.10]\n"),
    );
    lb_service(
        &cluster,
        "default",
        "pods",
        80,
        None,
        json!({}),
        json!({"allocateLoadBalancerNodePorts": false, "ports": [{"name": "p", "port": 80, "targetPort": 8080}]}),
    );
    let endpoints: Vec<(&str, &str)> = endpoints.iter().map(|(ip, n)| (*ip, n.as_str())).collect();
    cluster.apply(&endpoint_slice("pods", "p", 8080, &endpoints));
    let _ccm = start_ccm_with(
        Path::new(BIN),
        &cluster,
        &inventory,
        "ccm",
        &[format!("--tunnel-uds={}", socket.display())],
    );
    let ip = wait_ingress(&cluster, "default", "pods");
    let url = format!("http://{ip}:80/");
    // Both pods answer once the server knows the nodes' pod networks...
    let mut seen = std::collections::BTreeSet::new();
    wait_blocking(
        "both pods through the balancer",
        Duration::from_secs(30),
        || {
            seen.extend(curl(None, &url));
            (seen.len() == 2).then_some(())
        },
    );
    // ...and from then on every connection reaches its pod, whichever node it is on.
    let mut seen = std::collections::BTreeSet::new();
    for n in 0..16 {
        let body = curl(None, &url).unwrap_or_else(|| panic!("connection {n} failed"));
        seen.insert(body);
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        ["pod on node-0\n", "pod on node-1\n"]
    );
    // No dial ever went to the wrong node's agent (the balancer would have hidden it by
    // trying the next endpoint).
    let out = Command::new("curl")
        .args([
            "-s",
            "--max-time",
            "5",
            &format!("http://{}/metrics", server.health),
        ])
        .output()
        .unwrap();
    // (The series appears with the first such failure, as upstream's.)
    assert_eq!(
        tether_testkit::metric(
            &String::from_utf8_lossy(&out.stdout),
            r#"konnectivity_network_proxy_server_dial_failure_count{reason="error_response"}"#
        )
        .unwrap_or(0.0),
        0.0,
        "a pod IP was sent to the wrong agent"
    );
}

/// An agent in `node`, named `name`, with that node's own certificate (bound to its
/// address), connected to `server`.
fn node_agent(node: &Node, name: &str, pki: &Pki, server: &ServerProc) -> AgentProc {
    AgentProc::start_in(
        Some(node),
        Path::new(BIN),
        pki,
        format!("{}:{}", node.host_ip, server.agent.port())
            .parse()
            .unwrap(),
        &pki.node_agent_args(name, &node.node_ip),
    )
}

/// `externalTrafficPolicy: Local` with two nodes, only one of which has an endpoint:
/// every connection goes to that node's NodePort; none reaches the other node (whose
/// NodePort answers differently, and whose agent is connected and verified).
#[test]
fn local_policy_sends_nothing_to_a_node_without_an_endpoint() {
    use serde_json::json;
    let nodes = [Node::create(), Node::create()];
    let pki = Pki::with_sans(&[nodes[0].host_ip.clone(), nodes[1].host_ip.clone()]);
    let socket = socket_path(pki.dir());
    let cluster = Cluster::start(&Egress::Direct);
    let mut args = uds_frontend_args(&pki, "grpc", &socket);
    // Dials go to the agent verified for the node's address (the LB needs destHost:
    // with `default` alone the server picks any agent).
    args.push("--agent-bind-address=0.0.0.0".into());
    args.push("--proxy-strategies=destHost".into());
    let server = ServerProc::start(Path::new(BIN), &args);
    let mut machines = String::new();
    let mut _running = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let name = format!("node-{i}");
        // Its own node's certificate: the server routes to the agent it verified.
        _running.push(node_agent(node, &name, &pki, &server));
        cluster.add_node(&name, &node.node_ip);
        cluster.set_node_ready(&name, true);
        machines.push_str(&machine(&name, &node.node_ip, false));
    }
    let _pages: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| n.serve_page(30082, &format!("node-{i}\n")))
        .collect();
    let k = std::process::id() % 250;
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        &format!("nodes:\n{machines}loadBalancer:\n  pools:\n  - name: general\n    addresses: [127.79.{k}.10]\n"),
    );
    lb_service(
        &cluster,
        "default",
        "local",
        80,
        Some(30082),
        json!({}),
        json!({"externalTrafficPolicy": "Local"}),
    );
    cluster.apply(&endpoint_slice(
        "local",
        "p",
        8080,
        &[(&nodes[0].pod_ip, "node-0")],
    ));
    let ccm = start_ccm_with(
        Path::new(BIN),
        &cluster,
        &inventory,
        "ccm",
        &[format!("--tunnel-uds={}", socket.display())],
    );
    let ip = wait_ingress(&cluster, "default", "local");
    let url = format!("http://{ip}:80/");

    assert_eq!(
        wait_blocking("the balancer serving", Duration::from_secs(30), || curl(
            None, &url
        )),
        "node-0\n"
    );
    for n in 0..20 {
        assert_eq!(
            curl(None, &url)
                .unwrap_or_else(|| panic!("connection {n} failed:\n{}", ccm.log_text())),
            "node-0\n",
            "connection {n} reached the node without an endpoint"
        );
    }
}

/// Serving trusts the CCM's allocation record (a ConfigMap only the CCM may write),
/// never a Service's status alone, which anyone allowed `services/status` can write:
/// a status pointed at another Service's address gets no traffic there and a Warning
/// event; a change refused for a port collision is not served on its new port. Both
/// hold across a restart, when the allocations are read back from the record and the
/// Services are served again in no particular order.
#[test]
fn a_forged_status_gets_no_traffic_and_an_event() {
    use serde_json::json;
    let node = Node::create();
    let tunnel = Tunnel::to_node(Path::new(BIN), &node, "node-1");
    let _page_a = node.serve_page(30080, "page a\n");
    let _page_b = node.serve_page(30081, "page b\n");
    let _page_c = node.serve_page(30082, "page c\n");
    let _page_d = node.serve_page(30083, "page d\n");
    wait_blocking("node pages serving", Duration::from_secs(20), || {
        curl(Some(&node.ns), &format!("http://{}:30081/", node.node_ip))
    });
    let cluster = Cluster::start(&Egress::Direct);
    cluster.add_node("node-1", &node.node_ip);
    cluster.set_node_ready("node-1", true);
    let k = std::process::id() % 250;
    let (_dir, inventory) = inventory_dir();
    write_inventory(
        &inventory,
        &format!(
            "nodes:\n{}loadBalancer:\n  pools:\n  - name: general\n    addresses: [127.81.{k}.10-127.81.{k}.13]\n",
            machine("node-1", &node.node_ip, false),
        ),
    );
    let no = json!({});
    let key = json!({"tether.dev/lb-sharing-key": "k"});
    lb_service(
        &cluster,
        "default",
        "web-a",
        443,
        Some(30080),
        no.clone(),
        no.clone(),
    );
    lb_service(
        &cluster,
        "default",
        "evil",
        8443,
        Some(30081),
        no.clone(),
        no.clone(),
    );
    lb_service(
        &cluster,
        "default",
        "s1",
        8053,
        Some(30082),
        key.clone(),
        no.clone(),
    );
    lb_service(
        &cluster,
        "default",
        "s2",
        8054,
        Some(30083),
        key.clone(),
        no.clone(),
    );
    let ccm_args = [format!("--tunnel-uds={}", tunnel.socket.display())];
    let ccm = start_ccm_with(Path::new(BIN), &cluster, &inventory, "ccm", &ccm_args);
    let ip_a = wait_ingress(&cluster, "default", "web-a");
    let ip_e = wait_ingress(&cluster, "default", "evil");
    let ip_s = wait_ingress(&cluster, "default", "s1");
    assert_eq!(wait_ingress(&cluster, "default", "s2"), ip_s);
    let page = |url: String| curl(None, &url);
    let serves = |url: String, want: &str| {
        let got = wait_blocking(
            &format!("{want:?} at {url}"),
            Duration::from_secs(30),
            || page(url.clone()),
        );
        assert_eq!(got, want, "{url}");
    };
    serves(format!("http://{ip_a}:443/"), "page a\n");
    serves(format!("http://{ip_e}:8443/"), "page b\n");
    serves(format!("http://{ip_s}:8053/"), "page c\n");
    serves(format!("http://{ip_s}:8054/"), "page d\n");
    let record = allocation_record(&cluster);
    for ip in [&ip_a, &ip_e, &ip_s] {
        assert!(
            record.contains(ip.as_str()),
            "{ip} not in the record: {record}"
        );
    }

    // evil asks for web-a's address (refused: AddressInUse) and its status is pointed
    // there (as anyone allowed services/status can do).
    lb_service(
        &cluster,
        "default",
        "evil",
        8443,
        Some(30081),
        no.clone(),
        json!({"loadBalancerIP": ip_a}),
    );
    wait_for_event(&cluster, "evil", "AddressInUse");
    cluster.kubectl_ok(&[
        "patch",
        "service",
        "evil",
        "--subresource=status",
        "--type=merge",
        "-p",
        &format!(r#"{{"status":{{"loadBalancer":{{"ingress":[{{"ip":"{ip_a}"}}]}}}}}}"#),
    ]);
    wait_for_event(&cluster, "evil", "LoadBalancerStatusNotAllocated");
    assert_eq!(
        ingress_ips(&cluster, "default", "evil"),
        std::slice::from_ref(&ip_a)
    );
    // s2 adds s1's port: refused (PortCollision), and served on its old port only.
    let both = json!({"ports": [
        {"name": "p", "port": 8054, "nodePort": 30083},
        {"name": "q", "port": 8053},
    ]});
    lb_service(&cluster, "default", "s2", 8054, None, key.clone(), both);
    wait_for_event(&cluster, "s2", "PortCollision");

    let holds = |when: &str| {
        serves(format!("http://{ip_s}:8053/"), "page c\n");
        assert_eq!(
            page(format!("http://{ip_a}:8443/")),
            None,
            "{when}: evil served on web-a's address"
        );
        for _ in 0..5 {
            assert_eq!(
                page(format!("http://{ip_a}:443/")).as_deref(),
                Some("page a\n"),
                "{when}"
            );
            assert_eq!(
                page(format!("http://{ip_s}:8053/")).as_deref(),
                Some("page c\n"),
                "{when}: s2 on s1's port"
            );
        }
        serves(format!("http://{ip_s}:8054/"), "page d\n");
    };
    holds("after the forgery");
    drop(ccm);
    let ccm = start_ccm_with(Path::new(BIN), &cluster, &inventory, "ccm-2", &ccm_args);
    serves(format!("http://{ip_a}:443/"), "page a\n");
    holds("after a restart");
    assert_eq!(wait_ingress(&cluster, "default", "s1"), ip_s, "s1 moved");
    assert_eq!(wait_ingress(&cluster, "default", "web-a"), ip_a);
    drop(ccm);
    drop(tunnel);
}

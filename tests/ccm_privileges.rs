//! `tether ccm` run exactly as deploy/tether-ccm.yaml runs it: the uid, gid and
//! capability set are read from the manifest's securityContext and applied with
//! `setpriv`; the Tether server gets the socket flags deploy/konnectivity-server.yaml
//! passes. What needs the privilege then works: the load balancer connects to the
//! server's socket and reaches a node only its agent can reach.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use tether_testkit::kube::{free_port, wait_blocking, Cluster, Egress};
use tether_testkit::netns::{curl, Node};
use tether_testkit::process::{uds_frontend_args, Proc, START_TIMEOUT};
use tether_testkit::{AgentProc, Pki, ServerProc, TempDir};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

fn manifest(name: &str) -> Vec<serde_yaml::Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(name);
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .filter_map(|d| serde::Deserialize::deserialize(d).ok())
        .filter(|v: &serde_yaml::Value| !v.is_null())
        .collect()
}

/// The CCM container's (uid, gid, capabilities added) from the Deployment, which must
/// drop ALL.
fn ccm_security() -> (u32, u32, Vec<String>) {
    let docs = manifest("tether-ccm.yaml");
    let deploy = docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("a Deployment");
    let sc = &deploy["spec"]["template"]["spec"]["containers"][0]["securityContext"];
    let caps = &sc["capabilities"];
    let drop: Vec<&str> = caps["drop"]
        .as_sequence()
        .map(|s| s.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    assert_eq!(
        drop,
        ["ALL"],
        "the CCM must drop every capability it does not add"
    );
    let add = added_caps(sc);
    let id = |k: &str| {
        sc[k]
            .as_u64()
            .unwrap_or_else(|| panic!("securityContext.{k} is set")) as u32
    };
    (id("runAsUser"), id("runAsGroup"), add)
}

/// The server's `--uds-socket-*` flags from its static pod.
fn server_socket_flags() -> Vec<String> {
    let docs = manifest("konnectivity-server.yaml");
    let pod = docs.iter().find(|d| d["kind"] == "Pod").expect("a Pod");
    pod["spec"]["containers"][0]["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .filter(|a| a.starts_with("--uds-socket-"))
        .map(str::to_string)
        .collect()
}

/// `setpriv` arguments running `tether ccm` as uid/gid with only `caps` (lowercase
/// names) in its bounding set, no supplementary groups and no inheritable capabilities,
/// followed by the CCM's common flags.
fn as_manifest(
    uid: u32,
    gid: u32,
    caps: &[String],
    inventory: &Path,
    kubeconfig: &Path,
) -> Vec<String> {
    let bounding = std::iter::once("-all".to_string())
        .chain(caps.iter().map(|c| format!("+{}", c.to_lowercase())))
        .collect::<Vec<_>>()
        .join(",");
    vec![
        format!("--reuid={uid}"),
        format!("--regid={gid}"),
        "--clear-groups".into(),
        format!("--bounding-set={bounding}"),
        "--inh-caps=-all".into(),
        "--no-new-privs".into(),
        "--".into(),
        BIN.into(),
        "ccm".into(),
        "--log-format=json".into(),
        format!("--cloud-config={}", inventory.display()),
        format!("--kubeconfig={}", kubeconfig.display()),
        "--leader-elect=false".into(),
        "--secure-port=0".into(),
    ]
}

/// The agent of `node` (as node-1, its private address its identifier) connected to
/// `server`.
fn node_1_agent(node: &Node, pki: &Pki, server: &ServerProc) -> AgentProc {
    AgentProc::start_in(
        Some(node),
        Path::new(BIN),
        pki,
        format!("{}:{}", node.host_ip, server.agent.port())
            .parse()
            .unwrap(),
        &[
            pki.node_cert_args("node-1", &node.node_ip),
            vec![
                "--agent-id=node-1".into(),
                format!("--agent-identifiers=ipv4={}", node.node_ip),
            ],
        ]
        .concat(),
    )
}

/// The capabilities a securityContext adds, lowercase.
fn added_caps(sc: &serde_yaml::Value) -> Vec<String> {
    sc["capabilities"]["add"]
        .as_sequence()
        .map(|s| {
            s.iter()
                .filter_map(|c| c.as_str().map(str::to_lowercase))
                .collect()
        })
        .unwrap_or_default()
}

fn give(path: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).unwrap();
}

/// The non-root variant (no interface, no routes): no capability at all, and the
/// server's socket opened by group.
#[test]
fn the_ccm_runs_with_exactly_the_manifests_uid_and_capabilities() {
    let (uid, gid, caps) = unprivileged_variant();
    assert_ne!(uid, 0, "the variant runs the CCM as non-root");
    assert!(caps.is_empty(), "the variant adds no capability");
    assert_eq!(
        gid,
        ccm_security().1,
        "both variants open the socket by the same group"
    );
    let socket_flags = server_socket_flags();
    assert!(
        !socket_flags.is_empty(),
        "the server manifest opens its socket to the CCM"
    );

    let node = Node::create();
    let pki = Pki::with_sans(std::slice::from_ref(&node.host_ip));
    // The socket's directory is world-traversable, like the hostPath directory.
    let sock_dir = TempDir::new("tether-sock");
    std::fs::set_permissions(sock_dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let socket = sock_dir.path().join("konnectivity-server.socket");
    let mut args = uds_frontend_args(&pki, "grpc", &socket);
    args.push("--agent-bind-address=0.0.0.0".into());
    args.extend(socket_flags);
    let server = ServerProc::start(Path::new(BIN), &args);
    {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(&socket).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o660, "socket mode");
        assert_eq!(meta.gid(), gid, "the socket's group is the CCM's");
    }
    let _agent = node_1_agent(&node, &pki, &server);
    let _page = node.serve_page(30080, "hello from node-1\n");

    let cluster = Cluster::start(&Egress::Direct);
    // The files the pod would mount, readable by the CCM's uid as in the pod.
    let kubeconfig = cluster.ccm_kubeconfig();
    let text = std::fs::read_to_string(&kubeconfig).unwrap();
    give(&kubeconfig, uid, gid);
    for line in text.lines() {
        let line = line.trim();
        for key in ["client-certificate:", "client-key:"] {
            if let Some(p) = line.strip_prefix(key) {
                give(Path::new(p.trim()), uid, gid);
            }
        }
        if let Some(p) = line.strip_prefix("certificate-authority:") {
            std::fs::set_permissions(p.trim(), std::fs::Permissions::from_mode(0o644)).unwrap();
        }
    }
    let conf = TempDir::new("tether-ccm-conf");
    std::fs::set_permissions(conf.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let inventory = conf.path().join("inventory.yaml");
    std::fs::write(
        &inventory,
        format!(
            "nodes:\n- name: node-1\n  addresses:\n  - {{type: InternalIP, address: {}}}\n",
            node.node_ip
        ),
    )
    .unwrap();
    std::fs::set_permissions(&inventory, std::fs::Permissions::from_mode(0o644)).unwrap();
    cluster.add_node("node-1", &node.node_ip);
    cluster.set_node_ready("node-1", true);
    let port = free_port();
    cluster.apply(&format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\nspec:\n  type: LoadBalancer\n  ports:\n  - name: http\n    port: {port}\n    nodePort: 30080\n"
    ));

    let mut all = as_manifest(uid, gid, &caps, &inventory, &kubeconfig);
    all.extend([
        "--lb-bind-address=127.0.0.1".into(),
        format!("--tunnel-uds={}", socket.display()),
        // The manifest's other flag that matters to privileges.
        "--use-service-account-credentials".into(),
    ]);
    let mut ccm = Proc::spawn("ccm", Path::new("setpriv"), &all);
    ccm.wait_event("cloud-controller-manager starting", START_TIMEOUT, |_| true);

    // It really runs as that user with no capabilities at all.
    let status = std::fs::read_to_string(format!("/proc/{}/status", ccm.pid())).unwrap();
    let field = |k: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .unwrap()
            .split_whitespace()
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert_eq!(field("Uid:")[0], uid.to_string(), "{status}");
    assert_eq!(field("Gid:")[0], gid.to_string(), "{status}");
    if caps.is_empty() {
        assert_eq!(field("CapEff:")[0], "0000000000000000", "{status}");
        assert_eq!(field("CapPrm:")[0], "0000000000000000", "{status}");
    }

    wait_blocking("ingress IP", Duration::from_secs(30), || {
        let log = ccm.log_text();
        // Every warning but the one a 1.20 apiserver earns (it drops `ipMode`), which
        // says nothing about privileges.
        let complaints: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("\"level\":\"WARN\"") || l.contains("\"level\":\"ERROR\""))
            .filter(|l| !l.contains("ipMode"))
            .collect();
        assert!(complaints.is_empty(), "the CCM complains:\n{log}");
        let out = cluster.kubectl_ok(&["get", "service", "web", "-o", "json"]);
        let v: Value = serde_json::from_str(&out).unwrap();
        (v["status"]["loadBalancer"]["ingress"][0]["ip"] == "127.0.0.1").then_some(())
    });
    let body = wait_blocking(
        "page through the load balancer",
        Duration::from_secs(30),
        || curl(None, &format!("http://127.0.0.1:{port}/")),
    );
    assert_eq!(body, "hello from node-1\n");
    assert!(
        !ccm.logged("Permission denied"),
        "a privilege was missing:\n{}",
        ccm.log_text()
    );
    tether_testkit::stop_ccm_and_check_its_tokens_are_gone(&mut ccm);
}

/// The manifest's commented non-root variant (the lines after its marker,
/// uncommented): (uid, gid, capabilities added).
fn unprivileged_variant() -> (u32, u32, Vec<String>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/tether-ccm.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text
        .lines()
        .skip_while(|l| !l.contains("Without loadBalancer.interface and without routes, instead:"));
    lines
        .next()
        .expect("the non-root variant is documented in the manifest");
    let yaml: String = lines
        .map_while(|l| l.trim_start().strip_prefix('#'))
        .map(|l| format!("{}\n", l.strip_prefix(' ').unwrap_or(l)))
        .collect();
    let v: serde_yaml::Value = serde_yaml::from_str(&yaml).unwrap();
    let sc = &v["securityContext"];
    assert_eq!(sc["capabilities"]["drop"][0], "ALL");
    let add = added_caps(sc);
    let id = |k: &str| sc[k].as_u64().unwrap() as u32;
    (id("runAsUser"), id("runAsGroup"), add)
}

/// The effective capability set of process `pid` (`CapEff` of /proc/PID/status).
fn effective_caps(pid: u32) -> u64 {
    // Every thread's (capabilities are per thread): their union.
    let mut all = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let Ok(status) = std::fs::read_to_string(task.unwrap().path().join("status")) else {
            continue;
        };
        let eff = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .unwrap()
            .trim();
        all |= u64::from_str_radix(eff, 16).unwrap();
    }
    all
}

/// Capability bits: NET_BIND_SERVICE 10, NET_ADMIN 12, NET_RAW 13 (SYS_ADMIN, 21, is
/// dropped at start-up).
const NET_BIND_SERVICE: u64 = 1 << 10;
const NET_ADMIN: u64 = 1 << 12;
const NET_RAW: u64 = 1 << 13;

/// The manifest's privileges are exactly what holding addresses needs.
fn announcing_caps() -> (u32, u32, Vec<String>) {
    let (uid, gid, mut caps) = ccm_security();
    caps.sort();
    assert_eq!(
        caps,
        ["net_admin", "net_bind_service", "net_raw", "sys_admin"],
        "the manifest adds exactly what announcing addresses needs"
    );
    (uid, gid, caps)
}

/// With `routes:`, the manifest's privileges program routes in the host's table;
/// without NET_ADMIN the kernel refuses and the CCM says what is missing.
#[test]
fn routes_need_net_admin() {
    let (uid, gid, caps) = announcing_caps();
    let host = Node::router_host();
    let cluster = Cluster::start(&Egress::Direct);
    let relay = TempDir::new("tether-relay");
    let _relays = host.reach_host_port(cluster.port, relay.path());
    cluster.add_node("n1", "10.233.0.2");
    cluster.kubectl_ok(&[
        "patch",
        "node",
        "n1",
        "--type=merge",
        "-p",
        r#"{"spec":{"podCIDR":"10.244.1.0/24","podCIDRs":["10.244.1.0/24"]}}"#,
    ]);
    let conf = TempDir::new("tether-ccm-conf");
    let inventory = conf.path().join("inventory.yaml");
    std::fs::write(&inventory, "routes: {}\nnodes: []\n").unwrap();
    let kubeconfig = cluster.ccm_kubeconfig();
    let run = |name: &str, caps: &[String]| {
        let mut args = as_manifest(uid, gid, caps, &inventory, &kubeconfig);
        args.extend([
            "--controllers=route".into(),
            "--cluster-cidr=10.244.0.0/16".into(),
            "--route-reconciliation-period=500ms".into(),
        ]);
        let p = host.spawn(name, "setpriv", &args);
        p.wait_event("cloud-controller-manager starting", START_TIMEOUT, |_| true);
        p
    };
    let without: Vec<String> = caps.iter().filter(|c| *c != "net_admin").cloned().collect();
    let without = run("ccm-no-net-admin", &without);
    wait_blocking(
        "the refusal, saying what is missing",
        Duration::from_secs(30),
        || without.logged("needs CAP_NET_ADMIN").then_some(()),
    );
    assert!(!host
        .ip(&["route", "show", "proto", "84"])
        .contains("10.244.1.0"));
    drop(without);
    let with = run("ccm-manifest-caps", &caps);
    wait_blocking(
        "the route, made with the manifest's capabilities",
        Duration::from_secs(30),
        || {
            host.ip(&["route", "show", "proto", "84"])
                .contains("10.244.1.0/24 via 10.233.0.2")
                .then_some(())
        },
    );
    assert_eq!(
        effective_caps(with.pid()),
        NET_ADMIN | NET_RAW | NET_BIND_SERVICE,
        "SYS_ADMIN is dropped once the namespace exists"
    );
}

/// The manifest's privileges, and nothing more, hold a Service's address: the CCM (root
/// with exactly SYS_ADMIN, NET_ADMIN, NET_RAW and NET_BIND_SERVICE, on a control-plane
/// "host" sharing a LAN with a client) adds the address to a macvlan in its own
/// namespace, announces it (a
/// client that never asked learns it from the gratuitous ARP) and serves port 443
/// through the tunnel. Without any one of the three it says what is missing.
#[test]
fn holding_load_balancer_addresses_needs_exactly_the_manifests_capabilities() {
    use tether_testkit::netns::Lan;
    let (uid, gid, caps) = announcing_caps();
    let node = Node::create();
    let pki = Pki::with_sans(std::slice::from_ref(&node.host_ip));
    let socket = tether_testkit::process::socket_path(pki.dir());
    let mut args = uds_frontend_args(&pki, "grpc", &socket);
    args.push("--agent-bind-address=0.0.0.0".into());
    args.extend(server_socket_flags());
    let server = ServerProc::start(Path::new(BIN), &args);
    let _agent = node_1_agent(&node, &pki, &server);
    let _page = node.serve_page(30080, "hello from node-1\n");
    let cluster = Cluster::start(&Egress::Direct);
    cluster.add_node("node-1", &node.node_ip);
    cluster.set_node_ready("node-1", true);
    cluster.apply(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\nspec:\n  type: LoadBalancer\n  ports:\n  - name: https\n    port: 443\n    nodePort: 30080\n",
    );

    let lan = Lan::create();
    let host = Node::create();
    let client = Node::create();
    lan.attach(&host);
    lan.attach(&client);
    // The client takes addresses from announcements it did not ask for.
    let sysctl = Command::new("ip")
        .args(["netns", "exec", &client.ns, "sysctl", "-qw"])
        .arg(format!("net.ipv4.conf.{}.arp_accept=1", Lan::INTERFACE))
        .status()
        .unwrap();
    assert!(sysctl.success());
    let relay = TempDir::new("tether-relay");
    let _relays = host.reach_host_port(cluster.port, relay.path());
    let vip = lan.address(100);
    let conf = TempDir::new("tether-ccm-conf");
    let inventory = conf.path().join("inventory.yaml");
    std::fs::write(
        &inventory,
        format!(
            "nodes:\n- name: node-1\n  addresses:\n  - {{type: InternalIP, address: {}}}\nloadBalancer:\n  interface: {}\n  pools:\n  - name: lan\n    addresses: [{vip}]\n",
            node.node_ip,
            Lan::INTERFACE
        ),
    )
    .unwrap();
    let kubeconfig = cluster.ccm_kubeconfig();
    let spawn = |name: &str, caps: &[String]| {
        let mut args = as_manifest(uid, gid, caps, &inventory, &kubeconfig);
        args.push(format!("--tunnel-uds={}", socket.display()));
        host.spawn(name, "setpriv", &args)
    };
    let run = |name: &str, caps: &[String]| {
        let p = spawn(name, caps);
        p.wait_event("cloud-controller-manager starting", START_TIMEOUT, |_| true);
        p
    };
    // Without SYS_ADMIN there is no namespace for the addresses: a start-up error.
    let fewer: Vec<String> = caps.iter().filter(|c| *c != "sys_admin").cloned().collect();
    let mut ccm = spawn("ccm-no-sys_admin", &fewer);
    let status = ccm.wait_exit(START_TIMEOUT).expect("the CCM exits");
    assert!(!status.success());
    assert!(
        ccm.logged("needs CAP_SYS_ADMIN"),
        "without SYS_ADMIN: {}",
        ccm.log_text()
    );
    for (missing, says) in [
        ("net_admin", "needs CAP_NET_ADMIN"),
        ("net_raw", "needs CAP_NET_RAW"),
        ("net_bind_service", "Permission denied"),
    ] {
        let fewer: Vec<String> = caps.iter().filter(|c| *c != missing).cloned().collect();
        let ccm = run(&format!("ccm-no-{missing}"), &fewer);
        wait_blocking(
            &format!("without {missing}: a refusal saying {says:?}"),
            Duration::from_secs(30),
            || ccm.logged(says).then_some(()),
        );
    }

    client.ip(&["neigh", "flush", "dev", Lan::INTERFACE]);
    let ccm = run("ccm-manifest-caps", &caps);
    wait_blocking("the address announced", Duration::from_secs(30), || {
        let seen = client.ip(&["neigh", "show", &vip]);
        seen.contains("lladdr").then_some(())
    });
    let page = wait_blocking(
        "the Service on 443 from the client",
        Duration::from_secs(30),
        || curl(Some(&client.ns), &format!("http://{vip}:443/")),
    );
    assert_eq!(page, "hello from node-1\n");
    assert_eq!(
        effective_caps(ccm.pid()),
        NET_ADMIN | NET_RAW | NET_BIND_SERVICE,
        "SYS_ADMIN is dropped once the namespace exists"
    );
    assert!(
        !ccm.logged("Permission denied") && !ccm.logged("needs CAP_"),
        "a privilege was missing:\n{}",
        ccm.log_text()
    );
}

/// The inventory the manifest ships (its ConfigMap) is one `tether ccm` accepts,
/// `loadBalancer:` pools included.
#[test]
fn the_manifests_inventory_is_valid() {
    let docs = manifest("tether-ccm.yaml");
    let cm = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == "tether-ccm-inventory")
        .expect("the inventory ConfigMap");
    let text = cm["data"]["inventory.yaml"].as_str().unwrap();
    let config = tether_ccm::provider::parse(Path::new("inventory.yaml"), text)
        .unwrap_or_else(|e| panic!("{e}"));
    // Shipped off: no address is announced until the operator sets their own.
    assert!(config.load_balancer.is_none());
    // The commented example, uncommented, is valid.
    let mut uncommented = String::new();
    let mut inside = false;
    for line in text.lines() {
        if line.trim_start() == "# loadBalancer:" {
            inside = true;
        } else if inside && !line.trim_start().starts_with("#   ") {
            inside = false;
        }
        uncommented.push_str(&if inside {
            line.replacen("# ", "", 1)
        } else {
            line.to_string()
        });
        uncommented.push('\n');
    }
    let config = tether_ccm::provider::parse(Path::new("inventory.yaml"), &uncommented)
        .unwrap_or_else(|e| panic!("{e}\n{uncommented}"));
    let pools = config.load_balancer.expect("the manifest shows pools");
    assert_eq!(pools.interface.as_deref(), Some("eth0"));
    assert!(pools.contains("192.0.2.10".parse().unwrap()));
}

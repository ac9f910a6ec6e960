//! Simulated nodes: network namespaces joined to the test's namespace by a veth pair.
//! A node has a link address (reachable from the host, where the server runs) and a
//! private address on its loopback (its "InternalIP", reachable only inside the node),
//! so anything that reaches the private address must have gone through the tunnel.

use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// Is this process allowed to create network namespaces (root with iproute2)?
pub fn available() -> bool {
    Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
        && std::env::var("USER").map(|u| u == "root").unwrap_or(true)
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A node namespace; deleted (with its veth) on drop.
#[derive(Debug)]
pub struct Node {
    /// Namespace name.
    pub ns: String,
    /// Host side of the link (where the server listens), e.g. 10.231.7.1.
    pub host_ip: String,
    /// Node side of the link.
    pub link_ip: String,
    /// The node's private InternalIP (kubelet), reachable only inside the namespace.
    pub node_ip: String,
    /// A pod IP inside the node, also private.
    pub pod_ip: String,
    /// The node's private IPv6 address (`fd00:232:K::2`), reachable only inside the
    /// namespace: an IPv6-only or dual-stack node's InternalIP.
    pub node_ip6: String,
    /// The subnet index of this node: its addresses are 10.231.K.x (link), 10.232.K.x
    /// (private) and 10.234.K.0/24 (pods of a real node).
    pub index: u32,
    host_if: String,
    node_if: String,
}

impl Node {
    /// Creates a namespace with a veth link to the host and private addresses.
    pub fn create() -> Node {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // Subnet index unique per test process and node.
        let k = (pid.wrapping_mul(7) + n) % 250 + 1;
        let ns = format!("tt{pid}n{n}");
        let host_if = format!("th{}x{n}", pid % 100_000);
        let node_if = format!("tn{}x{n}", pid % 100_000);
        // Nothing addressed to the test ranges may leave this machine: unroutable
        // addresses hit a local blackhole instead of the default route.
        for net in ["10.231.0.0/16", "10.232.0.0/16", "10.234.0.0/16"] {
            ip(&["route", "replace", "blackhole", net]);
        }
        ip(&["-6", "route", "replace", "blackhole", "fd00:232::/32"]);
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        let _ = Command::new("ip").args(["link", "del", &host_if]).output();
        ip(&["netns", "add", &ns]);
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", &node_if,
        ]);
        ip(&["link", "set", &node_if, "netns", &ns]);
        let host_ip = format!("10.231.{k}.1");
        let link_ip = format!("10.231.{k}.2");
        let node_ip = format!("10.232.{k}.2");
        let pod_ip = format!("10.232.{k}.3");
        let node_ip6 = format!("fd00:232:{k:x}::2");
        ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{link_ip}/30"),
            "dev",
            &node_if,
        ]);
        ip(&["-n", &ns, "link", "set", &node_if, "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{node_ip}/32"),
            "dev",
            "lo",
        ]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{pod_ip}/32"),
            "dev",
            "lo",
        ]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{node_ip6}/128"),
            "dev",
            "lo",
            "nodad",
        ]);
        Node {
            ns,
            host_ip,
            link_ip,
            node_ip,
            pod_ip,
            node_ip6,
            index: k,
            host_if,
            node_if,
        }
    }

    /// Takes the node's link down (a partition: packets vanish, nothing is reset) or
    /// back up.
    pub fn set_link(&self, up: bool) {
        ip(&[
            "-n",
            &self.ns,
            "link",
            "set",
            &self.node_if,
            if up { "up" } else { "down" },
        ]);
    }

    /// Reaches `other`'s host address over this node's own link to the host, as the
    /// host routes it (not over a LAN both are on).
    pub fn reach_over_own_link(&self, other: &Node) {
        let host = format!("{}/32", other.host_ip);
        self.ip(&["route", "replace", &host, "via", &self.host_ip]);
    }

    /// Runs `ip -n NS args...` (asserting success) and returns its stdout.
    pub fn ip(&self, args: &[&str]) -> String {
        let out = Command::new("ip")
            .args(["-n", &self.ns])
            .args(args)
            .output()
            .expect("run ip");
        assert!(
            out.status.success(),
            "ip -n {} {}: {}",
            self.ns,
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `iptables args...` inside the namespace (asserting success).
    pub fn iptables(&self, args: &[&str]) {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns, "iptables", "-w"])
            .args(args)
            .output()
            .expect("run iptables");
        assert!(
            out.status.success(),
            "iptables {} in {}: {}",
            args.join(" "),
            self.ns,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Limits the node's link to `mbit` Mbit/s each way (tbf on both ends of the veth
    /// pair, with a 50 ms queue, as an edge site's uplink): this kernel has no netem.
    pub fn shape(&self, mbit: u32) {
        let rate = format!("{mbit}mbit");
        // At least one timer tick of the rate (HZ 250), and a whole GSO packet.
        let burst = format!("{}", (u64::from(mbit) * 1_000_000 / 8 / 250).max(64 * 1024));
        let tbf = [
            "root", "tbf", "rate", &rate, "burst", &burst, "latency", "50ms",
        ];
        for (ns, dev) in [(None, &self.host_if), (Some(&self.ns), &self.node_if)] {
            let mut cmd = Command::new("tc");
            if let Some(ns) = ns {
                cmd.args(["-n", ns]);
            }
            let out = cmd
                .args(["qdisc", "replace", "dev", dev])
                .args(tbf)
                .output()
                .expect("run tc");
            assert!(
                out.status.success(),
                "tc qdisc replace dev {dev} {}: {}",
                tbf.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    /// Drops connections other hosts open to this namespace over `iface`; its own go
    /// out and their answers come back: a node behind NAT.
    pub fn refuse_inbound(&self, iface: &str) {
        for chain in ["INPUT", "FORWARD"] {
            self.iptables(&[
                "-A",
                chain,
                "-i",
                iface,
                "-m",
                "conntrack",
                "--ctstate",
                "NEW",
                "-j",
                "DROP",
            ]);
        }
    }

    /// Makes `127.0.0.1:port` inside the namespace reach `127.0.0.1:port` of the host
    /// (say, the test's kube-apiserver), through a Unix socket in `dir` and a relay on
    /// each side. The relays stop when the returned processes drop.
    pub fn reach_host_port(&self, port: u16, dir: &std::path::Path) -> [crate::Proc; 2] {
        let socket = dir.join(format!("relay-{port}.sock"));
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/relay.py");
        let ready = std::time::Duration::from_secs(20);
        let host = crate::Proc::spawn(
            "relay@host",
            std::path::Path::new("python3"),
            &[
                script.display().to_string(),
                format!("--listen=unix:{}", socket.display()),
                format!("--connect=tcp:127.0.0.1:{port}"),
            ],
        );
        host.wait_event("relay ready", ready, |_| true);
        let inside = self.spawn(
            &format!("relay@{}", self.ns),
            "python3",
            &[
                script.display().to_string(),
                format!("--listen=tcp:127.0.0.1:{port}"),
                format!("--connect=unix:{}", socket.display()),
            ],
        );
        inside.wait_event("relay ready", ready, |_| true);
        [host, inside]
    }

    /// A namespace standing for a router host (the CCM's, say): 10.233.0.0/24, where
    /// test nodes' InternalIPs live, is directly attached (a veth pair inside it).
    pub fn router_host() -> Node {
        let host = Node::create();
        host.ip(&[
            "link", "add", "nodes0", "type", "veth", "peer", "name", "nodes1",
        ]);
        host.ip(&["addr", "add", "10.233.0.1/24", "dev", "nodes0"]);
        host.ip(&["link", "set", "nodes1", "up"]);
        host.ip(&["link", "set", "nodes0", "up"]);
        host
    }

    /// `ip netns exec NS` + `program args`, as a prefix for spawning.
    pub fn exec_prefix(&self) -> Vec<String> {
        vec!["netns".into(), "exec".into(), self.ns.clone()]
    }

    /// Runs `program args` inside the namespace as a [`crate::Proc`] called `name`.
    pub fn spawn(&self, name: &str, program: &str, args: &[String]) -> crate::Proc {
        self.spawn_with_env(name, program, args, &[])
    }

    /// [`Node::spawn`] with the environment variables `env` set.
    pub fn spawn_with_env(
        &self,
        name: &str,
        program: &str,
        args: &[String],
        env: &[(&str, &str)],
    ) -> crate::Proc {
        let mut all = self.exec_prefix();
        all.push(program.into());
        all.extend(args.iter().cloned());
        crate::Proc::spawn_with_env(name, std::path::Path::new("ip"), &all, env)
    }

    /// Serves `body` as `/` over HTTP on `node_ip:port` inside the namespace (a
    /// NodePort stand-in) until the returned value drops.
    pub fn serve_page(&self, port: u16, body: &str) -> ServedPage {
        self.serve_page_at(&self.node_ip, port, body)
    }

    /// Serves `body` as `/` over HTTP on `ip:port` inside the namespace (say, on the
    /// pod IP: a pod's server) until the returned value drops.
    pub fn serve_page_at(&self, ip: &str, port: u16, body: &str) -> ServedPage {
        let dir = crate::TempDir::new("tether-www");
        std::fs::write(dir.path().join("index.html"), body).unwrap();
        let proc = self.spawn(
            &format!("http@{}", self.ns),
            "python3",
            &[
                "-m".into(),
                "http.server".into(),
                port.to_string(),
                "--bind".into(),
                ip.to_string(),
                "--directory".into(),
                dir.path().display().to_string(),
            ],
        );
        ServedPage {
            _proc: proc,
            _dir: dir,
        }
    }
}

impl Node {
    /// Serves `body` over HTTP on `port` of the node's address, answering each request
    /// only `delay` after it came (a slow backend: a request stays in flight that
    /// long). Each request logs the JSON event `request` as it comes.
    pub fn serve_slow_page(
        &self,
        port: u16,
        body: &str,
        delay: std::time::Duration,
    ) -> crate::Proc {
        const SLOW: &str = r#"
import http.server, sys, time
class Slow(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        print('{"message":"request"}', file=sys.stderr, flush=True)
        time.sleep(float(sys.argv[3]))
        body = sys.argv[4].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Slow).serve_forever()
"#;
        let args = [
            "-c".to_string(),
            SLOW.to_string(),
            self.node_ip.clone(),
            port.to_string(),
            delay.as_secs_f64().to_string(),
            body.to_string(),
        ];
        self.spawn(&format!("slow-http@{}", self.ns), "python3", &args)
    }
}

/// A page served inside a namespace, see [`Node::serve_page`].
pub struct ServedPage {
    _proc: crate::Proc,
    _dir: crate::TempDir,
}

/// A layer-2 segment: a bridge in a namespace of its own, into which nodes are plugged
/// (interface `lan0` inside each, address 10.235.K.N/24): hosts that share a LAN, the
/// way two control-plane machines and their clients do. Deleted on drop.
#[derive(Debug)]
pub struct Lan {
    bridge: Node,
    /// The subnet index K.
    pub index: u32,
    next: AtomicU32,
}

impl Lan {
    /// The interface name inside each attached namespace.
    pub const INTERFACE: &'static str = "lan0";

    /// An empty segment.
    pub fn create() -> Lan {
        ip(&["route", "replace", "blackhole", "10.235.0.0/16"]);
        let bridge = Node::create();
        bridge.ip(&["link", "add", "br0", "type", "bridge"]);
        bridge.ip(&["link", "set", "br0", "up"]);
        let index = bridge.index;
        Lan {
            bridge,
            index,
            next: AtomicU32::new(1),
        }
    }

    /// 10.235.K.`host`.
    pub fn address(&self, host: u8) -> String {
        format!("10.235.{}.{host}", self.index)
    }

    /// Plugs `node` in; returns its address on the segment.
    pub fn attach(&self, node: &Node) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}y{}x{n}", std::process::id() % 100_000, self.index);
        let (port, peer) = (format!("lp{tag}"), format!("lq{tag}"));
        ip(&["link", "add", &port, "type", "veth", "peer", "name", &peer]);
        ip(&["link", "set", &port, "netns", &self.bridge.ns]);
        ip(&["link", "set", &peer, "netns", &node.ns]);
        self.bridge.ip(&["link", "set", &port, "master", "br0"]);
        self.bridge.ip(&["link", "set", &port, "up"]);
        node.ip(&["link", "set", &peer, "name", Self::INTERFACE]);
        let addr = self.address(n as u8);
        node.ip(&["addr", "add", &format!("{addr}/24"), "dev", Self::INTERFACE]);
        node.ip(&["link", "set", Self::INTERFACE, "up"]);
        addr
    }
}

impl Node {
    /// The host side of the veth pair (gone once the node is dropped).
    pub fn host_interface(&self) -> &str {
        &self.host_if
    }

    /// The node side of the veth pair, inside the namespace.
    pub fn node_interface(&self) -> &str {
        &self.node_if
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

/// curl `url`, optionally inside a network namespace; the body on success.
pub fn curl(netns: Option<&str>, url: &str) -> Option<String> {
    curl_within(netns, url, "5")
}

/// Like [`curl`], giving up after `max_time` seconds.
pub fn curl_within(netns: Option<&str>, url: &str, max_time: &str) -> Option<String> {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "curl"]);
            c
        }
        None => Command::new("curl"),
    };
    let out = cmd
        .args(["-sf", "--max-time", max_time, url])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Moves this thread (only) into network namespace `ns`.
#[allow(unsafe_code)]
pub fn enter(ns: &str) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(format!("/var/run/netns/{ns}"))?;
    // SAFETY: setns on a descriptor we own; affects this thread only.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

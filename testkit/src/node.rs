//! Real Kubernetes nodes for tests: containerd 1.6 + runc + kubelet 1.20.2 (+ a Tether
//! agent) inside a network namespace of their own, registered to a test
//! [`Cluster`](crate::kube::Cluster). The node's InternalIP and its pods' addresses are
//! reachable only inside the namespace, so anything the apiserver gets from the kubelet
//! or a pod came through the tunnel.
//!
//! Every process of a node (holder, containerd, shims, containers, kubelet, agent) runs
//! in one cgroup of its own (`tether-node-PID-N` in every hierarchy); containerd and the
//! kubelet share a private mount namespace held by a `sleep` process, in which the
//! host's /var/log, /run/containerd, /var/lib/cni and the kubelet's sysctls are replaced
//! by the node's own files. Dropping a [`RealNode`] (also while a test panics) kills the
//! whole cgroup, removes it, the namespace, the veth and the node's files; nodes left by
//! a killed test process are swept when the next one starts.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::kube::{cache_dir, require_kube_binary, Cluster};
use crate::netns::Node;
use crate::{AgentProc, Pki, Proc, TempDir};

/// The image every test pod runs (Debian's busybox-static, imported from the cache).
pub const BUSYBOX_IMAGE: &str = "tether.local/busybox:1";
/// The pod sandbox image.
pub const PAUSE_IMAGE: &str = "tether.local/pause:1";
/// How long a cold node may take to become Ready (27-30 s seen on 2 cores).
pub const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// How a node's kubelet is configured.
#[derive(Debug, Clone, Default)]
pub struct NodeOptions {
    /// `serverTLSBootstrap: true`: the kubelet asks for its serving certificate with a
    /// `kubernetes.io/kubelet-serving` CSR instead of signing one itself, and serves no
    /// TLS until it is issued.
    pub server_tls_bootstrap: bool,
    /// `--cloud-provider=external`: the node registers with the uninitialized taint and
    /// waits for a cloud-controller-manager.
    pub external_cloud_provider: bool,
    /// A control-plane node as kubeadm lays it out: this directory is the node's
    /// `/etc/kubernetes` (what its pods' hostPaths see), and its kubelet runs the static
    /// pods in `manifests/` there.
    pub etc_kubernetes: Option<PathBuf>,
    /// Pods' traffic to other hosts leaves with the node's address (the bridge plugin's
    /// `ipMasq`), as pod networks do: a pod reaches the hosts the node reaches.
    pub masquerade_pods: bool,
    /// Image archives (path, reference) imported besides busybox and pause, as a
    /// registry pull would leave them (see [`RealNode::import_image`]).
    pub images: Vec<(PathBuf, String)>,
    /// Run kube-proxy 1.20.2 (iptables mode) on the node, as user `system:kube-proxy`
    /// (the bootstrap role `system:node-proxier`): Services' node ports and cluster IPs
    /// work on it.
    pub kube_proxy: bool,
    /// The families of the node's InternalIPs (`--node-ip`).
    pub family: NodeFamily,
}

/// Which InternalIPs a node's kubelet reports (`--node-ip`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum NodeFamily {
    /// Its private IPv4 address only.
    #[default]
    V4,
    /// Its private IPv6 address only (the kubelet also listens on IPv6).
    V6,
    /// Both, IPv6 first (kubelet 1.20's `IPv6DualStack` gate).
    DualV6First,
}

/// A running real node. See the module documentation.
pub struct RealNode {
    /// Node name (`--hostname-override`).
    pub name: String,
    /// The network namespace, its link and its private InternalIP.
    pub net: Node,
    /// This node's pod range (bridge CNI, host-local IPAM).
    pub pod_cidr: String,
    /// The Tether agent, once [`RealNode::start_agent`] ran.
    pub agent: Option<AgentProc>,
    /// Its InternalIPs' families.
    pub family: NodeFamily,
    kubelet: Option<Proc>,
    kube_proxy: Option<Proc>,
    containerd: Option<Proc>,
    holder: Option<Proc>,
    cgroup: NodeCgroup,
    dir: Option<TempDir>,
}

impl std::fmt::Debug for RealNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RealNode")
            .field("name", &self.name)
            .field("ns", &self.net.ns)
            .finish()
    }
}

/// Can this machine run real nodes (root, the cached kubelet, containerd, the images)?
pub fn available() -> Result<(), String> {
    if !crate::netns::available() {
        return Err("network namespaces need root and iproute2".into());
    }
    for tool in ["containerd", "runc", "nsenter", "unshare", "ctr"] {
        if !Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
        {
            return Err(format!("{tool} is missing: run scripts/install-kube.sh"));
        }
    }
    if crate::kube::kube_binary("kubelet").is_none() {
        return Err("kubelet is not built: run scripts/install-kube.sh".into());
    }
    if !images_dir().join("busybox.tar").exists() {
        return Err("node images are missing: run scripts/install-kube.sh".into());
    }
    Ok(())
}

fn images_dir() -> PathBuf {
    cache_dir().unwrap_or_default().join("images")
}

fn cni_bin_dir() -> &'static str {
    if Path::new("/usr/lib/cni/bridge").exists() {
        "/usr/lib/cni"
    } else {
        "/opt/cni/bin"
    }
}

fn run(what: &str, cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl RealNode {
    /// Creates the namespace, starts containerd and the kubelet registered to `cluster`
    /// (which must have been started with `reachable_from_nodes`), and waits until the
    /// Node is Ready.
    pub fn start(cluster: &Cluster, name: &str, opts: &NodeOptions) -> RealNode {
        Self::start_on(Node::create(), cluster, name, opts)
    }

    /// Like [`RealNode::start`] in a namespace made beforehand (so that its host address
    /// can go into a certificate first).
    pub fn start_on(net: Node, cluster: &Cluster, name: &str, opts: &NodeOptions) -> RealNode {
        available().unwrap_or_else(|e| panic!("real node {name}: {e}"));
        sweep_stale_nodes();
        let dir = TempDir::new("tether-node");
        let cgroup = NodeCgroup::create(&net);
        let pod_cidr = format!("10.234.{}.0/24", net.index);
        let mut node = RealNode {
            name: name.to_string(),
            family: opts.family,
            net,
            pod_cidr,
            agent: None,
            kubelet: None,
            kube_proxy: None,
            containerd: None,
            holder: None,
            cgroup,
            dir: Some(dir),
        };
        node.start_holder(opts);
        node.start_containerd(opts);
        for (archive, reference) in &opts.images {
            node.import_image(archive, reference);
        }
        node.start_kubelet(cluster, opts);
        node.wait_ready(cluster);
        if opts.kube_proxy {
            node.start_kube_proxy(cluster);
        }
        node
    }

    /// kube-proxy in the node's namespaces and cgroup, iptables mode; it leaves the
    /// machine-wide conntrack sysctls alone.
    fn start_kube_proxy(&mut self, cluster: &Cluster) {
        let d = self.dir().to_path_buf();
        let kubeconfig = cluster.kubeconfig_at(
            "system:kube-proxy",
            None,
            &self.net.host_ip,
            &d,
            "kube-proxy",
        );
        let args = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--hostname-override={}", self.name),
            "--proxy-mode=iptables".into(),
            "--cluster-cidr=10.234.0.0/16".into(),
            "--conntrack-max-per-core=0".into(),
            "--conntrack-tcp-timeout-established=0".into(),
            "--conntrack-tcp-timeout-close-wait=0".into(),
            "--metrics-bind-address=127.0.0.1:10249".into(),
            "--healthz-bind-address=127.0.0.1:10256".into(),
            "--oom-score-adj=0".into(),
            "--logtostderr=true".into(),
            "--v=1".into(),
        ];
        // A Service's ClusterIP is routed before kube-proxy's DNAT rewrites it: give the
        // range a route, as a node's default route would (the host blackholes it, so
        // nothing unproxied leaves the machine).
        let service_range = crate::kube::SERVICE_CIDRS.split(',').next().unwrap();
        run(
            "blackhole the Service range",
            Command::new("ip").args(["route", "replace", "blackhole", service_range]),
        );
        run(
            "route the Service range",
            Command::new("ip").args([
                "-n",
                &self.net.ns,
                "route",
                "replace",
                service_range,
                "via",
                &self.net.host_ip,
            ]),
        );
        let bin = require_kube_binary("kube-proxy");
        let args = self.in_node(&bin.display().to_string(), &args);
        let mut proc = Proc::spawn(&format!("kube-proxy@{}", self.name), Path::new("sh"), &args);
        // Ready once it has written its rules.
        let ns = self.net.ns.clone();
        wait_alive(
            &mut proc,
            &format!("node {}: kube-proxy's rules", self.name),
            Duration::from_secs(60),
            || {
                Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        &ns,
                        "iptables",
                        "-w",
                        "-t",
                        "nat",
                        "-S",
                        "KUBE-SERVICES",
                    ])
                    .output()
                    .map(|o| o.status.success())
                    .unwrap_or(false)
            },
            String::new,
        );
        self.kube_proxy = Some(proc);
    }

    /// The node's directory (its kubelet, containerd and log files).
    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("node directory").path()
    }

    /// The InternalIP the kubelet reports (reachable only inside the node).
    pub fn ip(&self) -> &str {
        match self.family {
            NodeFamily::V4 => &self.net.node_ip,
            NodeFamily::V6 | NodeFamily::DualV6First => &self.net.node_ip6,
        }
    }

    /// Every InternalIP of the node, in the kubelet's `--node-ip` order.
    pub fn ips(&self) -> Vec<&str> {
        match self.family {
            NodeFamily::V4 => vec![&self.net.node_ip],
            NodeFamily::V6 => vec![&self.net.node_ip6],
            NodeFamily::DualV6First => vec![&self.net.node_ip6, &self.net.node_ip],
        }
    }

    /// A command run inside the node's namespaces and cgroup (`sh -c` joins the cgroup,
    /// then `nsenter` enters the holder's mount and network namespaces).
    fn in_node(&self, program: &str, args: &[String]) -> Vec<String> {
        let holder = self.holder.as_ref().expect("holder runs").pid();
        let mut v = vec![
            "-c".to_string(),
            format!("{} exec \"$@\"", self.cgroup.join_script()),
            "sh".into(),
            "nsenter".into(),
            "-t".into(),
            holder.to_string(),
            "-m".into(),
            "-n".into(),
            "--".into(),
            program.into(),
        ];
        v.extend(args.iter().cloned());
        v
    }

    /// Imports the OCI or docker archive `archive` into the node's containerd as
    /// `reference` (say `docker.io/library/tether:v0.1.0`, the name a kubelet resolves
    /// `tether:v0.1.0` to).
    pub fn import_image(&self, archive: &Path, reference: &str) {
        let base = reference
            .rsplit_once(':')
            .filter(|(_, tag)| !tag.contains('/'))
            .map_or(reference, |(name, _)| name);
        run(
            &format!("node {}: import {}", self.name, archive.display()),
            Command::new("ctr")
                .arg("--address")
                .arg(self.containerd_socket())
                .args(["-n", "k8s.io", "images", "import", "--base-name", base])
                .arg(archive),
        );
        let listed = run(
            &format!("node {}: list images", self.name),
            Command::new("ctr")
                .arg("--address")
                .arg(self.containerd_socket())
                .args(["-n", "k8s.io", "images", "ls", "-q"]),
        );
        assert!(
            listed.lines().any(|l| l == reference),
            "node {}: {} imported, but not as {reference}: {listed}",
            self.name,
            archive.display()
        );
    }

    /// The process that holds the node's mount namespace, and the mounts in it.
    fn start_holder(&mut self, opts: &NodeOptions) {
        let d = self.dir().to_path_buf();
        for sub in [
            "log",
            "run-containerd",
            "cni-state",
            "cni/net.d",
            "cni/ipam",
            "sysctl",
            "kubelet/pki",
            "kubelet/volume-plugins",
            "containerd/root",
            "containerd/state",
        ] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        // The kubelet sets these sysctls unless they already have its values: give it
        // private files that do, so the host's stay as they are.
        let sysctls = [
            ("vm/overcommit_memory", "1"),
            ("vm/panic_on_oom", "0"),
            ("kernel/panic", "10"),
            ("kernel/panic_on_oops", "1"),
            ("kernel/keys/root_maxkeys", "1000000"),
            ("kernel/keys/root_maxbytes", "25000000"),
        ];
        let mut script = String::from("set -e\n");
        for (path, value) in sysctls {
            let file = d.join("sysctl").join(path.replace('/', "."));
            std::fs::write(&file, format!("{value}\n")).unwrap();
            script.push_str(&format!(
                "mount --bind {} /proc/sys/{path}\n",
                file.display()
            ));
        }
        // Mount points the node covers with its own directories.
        for host_dir in ["/run/containerd", "/var/lib/cni"] {
            std::fs::create_dir_all(host_dir).unwrap();
        }
        let mut covered = vec![
            ("log", "/var/log"),
            ("run-containerd", "/run/containerd"),
            ("cni-state", "/var/lib/cni"),
        ];
        if let Some(etc) = &opts.etc_kubernetes {
            std::fs::create_dir_all(etc.join("manifests")).unwrap();
            // The mount point; kubeadm's hosts have it, this one may not.
            std::fs::create_dir_all("/etc/kubernetes").unwrap();
            covered.push((etc.to_str().unwrap(), "/etc/kubernetes"));
        }
        for (own, host) in covered {
            script.push_str(&format!("mount --bind {} {host}\n", d.join(own).display()));
        }
        std::fs::create_dir_all(d.join("log/pods")).unwrap();
        std::fs::create_dir_all(d.join("log/containers")).unwrap();

        let args = vec![
            "-c".to_string(),
            format!(
                "{} exec nsenter --net=/run/netns/{} -- unshare --mount --propagation private -- sleep infinity",
                self.cgroup.join_script(),
                self.net.ns
            ),
        ];
        let holder = Proc::spawn(&format!("holder@{}", self.name), Path::new("sh"), &args);
        let pid = holder.pid();
        self.holder = Some(holder);
        // Wait until the holder has its own mount namespace (sh -> nsenter -> unshare
        // -> sleep, all by exec, so the pid stays).
        let own = std::fs::read_link("/proc/self/ns/mnt").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let mnt = std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok();
            if comm.trim() == "sleep" && mnt.is_some_and(|m| m != own) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node {}: the namespace holder did not start",
                self.name
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        run(
            &format!("node {}: mounts", self.name),
            Command::new("nsenter").args(["-t", &pid.to_string(), "-m", "--", "sh", "-c", &script]),
        );
    }

    fn containerd_socket(&self) -> PathBuf {
        self.dir().join("containerd.sock")
    }

    fn start_containerd(&mut self, opts: &NodeOptions) {
        let d = self.dir().to_path_buf();
        let config = d.join("containerd.toml");
        let cni_conf = format!(
            r#"{{"cniVersion":"0.4.0","name":"tether-pods","plugins":[{{"type":"bridge","bridge":"cni0","isGateway":true,"ipMasq":{},"hairpinMode":true,"ipam":{{"type":"host-local","ranges":[[{{"subnet":"{}"}}]],"routes":[{{"dst":"0.0.0.0/0"}}],"dataDir":"{}"}}}}]}}"#,
            opts.masquerade_pods,
            self.pod_cidr,
            d.join("cni/ipam").display()
        );
        std::fs::write(d.join("cni/net.d/10-tether.conflist"), cni_conf).unwrap();
        let toml = format!(
            r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{sock}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{cni_dir}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
"#,
            root = d.join("containerd/root").display(),
            state = d.join("containerd/state").display(),
            sock = self.containerd_socket().display(),
            pause = PAUSE_IMAGE,
            cni_bin = cni_bin_dir(),
            cni_dir = d.join("cni/net.d").display(),
            opt = d.join("containerd/opt").display(),
        );
        std::fs::write(&config, toml).unwrap();
        let args = self.in_node("containerd", &[format!("--config={}", config.display())]);
        let mut proc = Proc::spawn(&format!("containerd@{}", self.name), Path::new("sh"), &args);
        let sock = self.containerd_socket();
        wait_alive(
            &mut proc,
            &format!("node {}: containerd's socket", self.name),
            Duration::from_secs(30),
            || sock.exists(),
            String::new,
        );
        self.containerd = Some(proc);
        // The images cannot be pulled here: import the cached archives.
        for image in ["pause.tar", "busybox.tar"] {
            run(
                &format!("node {}: import {image}", self.name),
                Command::new("ctr")
                    .arg("--address")
                    .arg(&sock)
                    .args(["-n", "k8s.io", "images", "import"])
                    .arg(images_dir().join(image)),
            );
        }
    }

    fn start_kubelet(&mut self, cluster: &Cluster, opts: &NodeOptions) {
        let d = self.dir().to_path_buf();
        let kubeconfig = cluster.node_kubeconfig(&self.name, &self.net.host_ip, &d);
        let config = d.join("kubelet.yaml");
        let yaml = format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 0.0.0.0
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {ca}
authorization:
  mode: Webhook
serverTLSBootstrap: {bootstrap}
rotateCertificates: false{static_pods}
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup}
cgroupsPerQOS: true
enforceNodeAllocatable: ["pods"]
failSwapOn: false
makeIPTablesUtilChains: false
protectKernelDefaults: false
resolvConf: ""
volumePluginDir: {plugins}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
evictionPressureTransitionPeriod: 5s
nodeStatusUpdateFrequency: 5s
syncFrequency: 10s
fileCheckFrequency: 10s
containerLogMaxSize: 10Mi
serializeImagePulls: false
"#,
            ca = cluster.files.ca.display(),
            bootstrap = opts.server_tls_bootstrap,
            static_pods = if opts.etc_kubernetes.is_some() {
                // Where kubeadm puts them (this node's own /etc/kubernetes).
                "\nstaticPodPath: /etc/kubernetes/manifests"
            } else {
                ""
            },
            cgroup = self.cgroup.name,
            plugins = d.join("kubelet/volume-plugins").display(),
        );
        std::fs::write(&config, yaml).unwrap();
        let mut args = vec![
            format!("--config={}", config.display()),
            format!("--kubeconfig={}", kubeconfig.display()),
            "--container-runtime=remote".into(),
            format!(
                "--container-runtime-endpoint=unix://{}",
                self.containerd_socket().display()
            ),
            format!("--hostname-override={}", self.name),
            format!("--node-ip={}", self.ips().join(",")),
            format!("--root-dir={}", d.join("kubelet").display()),
            format!("--cert-dir={}", d.join("kubelet/pki").display()),
            "--logtostderr=true".into(),
            "--v=1".into(),
        ];
        if opts.external_cloud_provider {
            args.push("--cloud-provider=external".into());
        }
        if self.family != NodeFamily::V4 {
            // Serve IPv6 too (the default, 0.0.0.0, is IPv4 only).
            args.push("--address=::".into());
        }
        if self.family == NodeFamily::DualV6First {
            args.push("--feature-gates=IPv6DualStack=true".into());
        }
        let bin = require_kube_binary("kubelet");
        let args = self.in_node(&bin.display().to_string(), &args);
        self.kubelet = Some(Proc::spawn(
            &format!("kubelet@{}", self.name),
            Path::new("sh"),
            &args,
        ));
    }

    fn wait_ready(&mut self, cluster: &Cluster) {
        let name = self.name.clone();
        let containerd = self.containerd.as_ref().unwrap();
        wait_alive(
            self.kubelet.as_mut().unwrap(),
            &format!("node {name}: Ready"),
            READY_TIMEOUT,
            || {
                let out = cluster.kubectl(&[
                    "get",
                    "node",
                    &name,
                    "-o",
                    r#"jsonpath={.status.conditions[?(@.type=="Ready")].status}"#,
                ]);
                String::from_utf8_lossy(&out.stdout).trim() == "True"
            },
            || format!("containerd log:\n{}", tail(&containerd.log_text(), 30)),
        );
    }

    /// Starts the agent-only binary `bin` inside the node (its network namespace and
    /// cgroup), dialling the server's agent port on the host side of the link, with a
    /// certificate of the node's own and the node's name, InternalIP and pod range as
    /// identifiers, plus `args`.
    pub fn start_agent(&mut self, bin: &Path, pki: &Pki, agent_port: u16, args: &[String]) {
        let server = format!("{}:{agent_port}", self.net.host_ip)
            .parse()
            .unwrap();
        // The node's own certificate, so that the server verifies its name and
        // addresses.
        let mut all = pki.node_cert_args(&self.name, &self.ips().join(","));
        let claims: Vec<String> = self
            .ips()
            .iter()
            .map(|ip| match ip.contains(':') {
                true => format!("ipv6={ip}"),
                false => format!("ipv4={ip}"),
            })
            .collect();
        all.extend([
            format!("--agent-id={}", self.name),
            format!(
                "--agent-identifiers=host={}&{}&cidr={}",
                self.name,
                claims.join("&"),
                self.pod_cidr
            ),
            format!("--health-server-host={}", self.net.link_ip),
        ]);
        // The dial policy as the DaemonSet sets it: the node's name (its Node object,
        // read with the kubelet's credentials where the kubelet runs) and addresses,
        // and, for nodes whose Node carries no pod range, that range.
        if !args.iter().any(|a| a.starts_with("--dial-")) {
            all.extend([
                format!("--node-name={}", self.name),
                format!("--node-ip={}", self.ips().join(",")),
                format!("--dial-allow={}", self.pod_cidr),
                format!("--service-cidr={}", crate::kube::SERVICE_CIDRS),
            ]);
            let kubeconfig = self.dir().join("kubelet.kubeconfig");
            if kubeconfig.exists() {
                all.push(format!("--kubeconfig={}", kubeconfig.display()));
            }
        }
        all.extend(args.iter().cloned());
        let agent = AgentProc::start_in(Some(&self.net), bin, pki, server, &all);
        self.cgroup.adopt(agent.proc.pid());
        self.agent = Some(agent);
    }

    /// Routes the host to this node's InternalIP and pod range over its link, until the
    /// guard drops: for measuring the path without the tunnel. (Every other node stays
    /// unreachable.)
    pub fn direct_route(&self) -> DirectRoute {
        let targets = vec![format!("{}/32", self.net.node_ip), self.pod_cidr.clone()];
        for t in &targets {
            run(
                "ip route replace",
                Command::new("ip").args(["route", "replace", t, "via", &self.net.link_ip]),
            );
        }
        DirectRoute { targets }
    }

    /// The kubelet's log so far.
    pub fn kubelet_log(&self) -> String {
        self.kubelet
            .as_ref()
            .map(|k| k.log_text())
            .unwrap_or_default()
    }

    /// Every container log file on this node (`/var/log/pods/POD/CONTAINER/N.log`):
    /// (pod directory, container, path).
    fn container_log_files(&self) -> Vec<(String, String, PathBuf)> {
        let mut files = Vec::new();
        let pods = self.dir().join("log/pods");
        for pod in std::fs::read_dir(&pods).into_iter().flatten().flatten() {
            for container in std::fs::read_dir(pod.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                for log in std::fs::read_dir(container.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                {
                    files.push((
                        pod.file_name().to_string_lossy().into_owned(),
                        container.file_name().to_string_lossy().into_owned(),
                        log.path(),
                    ));
                }
            }
        }
        files
    }

    /// The last lines of every container log on this node, read from its files: what
    /// `kubectl logs` shows, without the tunnel.
    pub fn container_logs(&self) -> String {
        self.container_log_files()
            .into_iter()
            .map(|(pod, container, path)| {
                let text = std::fs::read_to_string(path).unwrap_or_default();
                format!(
                    "--- {}: {pod}/{container}\n{}\n",
                    self.name,
                    tail(&text, 40)
                )
            })
            .collect()
    }

    /// Everything the containers of pods whose directory starts with `prefix`
    /// (`NAMESPACE_NAME`) logged, read from the node's files.
    pub fn pod_logs(&self, prefix: &str) -> String {
        self.container_log_files()
            .into_iter()
            .filter(|(pod, _, _)| pod.starts_with(prefix))
            .map(|(_, _, path)| std::fs::read_to_string(path).unwrap_or_default())
            .collect()
    }

    /// Writes a pod on this node running busybox `command` (one container `main`,
    /// image never pulled) and waits until it is Ready.
    pub fn run_pod(&self, cluster: &Cluster, name: &str, labels: &str, containers: &str) {
        cluster.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: default\n  labels: {{{labels}}}\nspec:\n  nodeName: {node}\n  automountServiceAccountToken: false\n  enableServiceLinks: false\n  terminationGracePeriodSeconds: 1\n  containers:\n{containers}",
            node = self.name
        ));
        let out = cluster.kubectl(&[
            "wait",
            "--for=condition=Ready",
            &format!("pod/{name}"),
            "--timeout=120s",
        ]);
        assert!(
            out.status.success(),
            "pod {name} on {} not Ready: {}\n{}\nkubelet log:\n{}",
            self.name,
            String::from_utf8_lossy(&out.stderr),
            cluster
                .kubectl(&["describe", "pod", name])
                .stdout
                .iter()
                .map(|&b| b as char)
                .collect::<String>(),
            tail(&self.kubelet_log(), 40)
        );
    }

    /// What a node leaves behind if teardown missed something: (what, detail) pairs.
    /// Empty once the node is gone; see [`Leftovers`].
    pub fn leftovers(&self) -> Leftovers {
        Leftovers {
            ns: self.net.ns.clone(),
            veth: self.net.host_interface().to_string(),
            cgroup: self.cgroup.name.clone(),
            dir: self.dir().to_path_buf(),
        }
    }

    fn teardown(&mut self) {
        // Everything in the cgroup: holder, containerd, shims, containers, kubelet, agent.
        self.cgroup.kill_all();
        for p in [
            self.kube_proxy.take(),
            self.kubelet.take(),
            self.containerd.take(),
            self.holder.take(),
        ]
        .into_iter()
        .flatten()
        {
            drop(p);
        }
        drop(self.agent.take());
        self.cgroup.kill_all();
        self.cgroup.remove();
    }
}

impl Drop for RealNode {
    fn drop(&mut self) {
        self.teardown();
        // Then the namespace and veth (Node's drop) and the files (TempDir's drop); the
        // node's mounts lived in its own mount namespace, which ended with its last
        // process.
        drop(self.dir.take());
    }
}

/// Host routes to one node; removed on drop (the blackhole behind them takes over).
#[derive(Debug)]
pub struct DirectRoute {
    targets: Vec<String>,
}

impl Drop for DirectRoute {
    fn drop(&mut self) {
        for t in &self.targets {
            let _ = Command::new("ip").args(["route", "del", t]).output();
        }
    }
}

/// What to look for after a node is dropped: a test asserts [`Leftovers::found`] is
/// empty.
#[derive(Debug, Clone)]
pub struct Leftovers {
    ns: String,
    veth: String,
    cgroup: String,
    dir: PathBuf,
}

impl Leftovers {
    /// Everything of the node still present on the machine.
    pub fn found(&self) -> Vec<String> {
        let mut found = Vec::new();
        let netns = Command::new("ip")
            .args(["netns", "list"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        if netns
            .lines()
            .any(|l| l.split_whitespace().next() == Some(&self.ns))
        {
            found.push(format!("network namespace {}", self.ns));
        }
        if Path::new("/sys/class/net").join(&self.veth).exists() {
            found.push(format!("interface {}", self.veth));
        }
        for h in hierarchies() {
            if h.join(&self.cgroup).exists() {
                found.push(format!("cgroup {}", h.join(&self.cgroup).display()));
            }
        }
        if self.dir.exists() {
            found.push(format!("directory {}", self.dir.display()));
        }
        let dir = self.dir.display().to_string();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let pid = entry.file_name().to_string_lossy().into_owned();
            if !pid.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            // A zombie (killed, not yet reaped by init) holds no memory, file, mount or
            // cgroup.
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            if stat
                .rsplit_once(')')
                .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
            {
                continue;
            }
            let cgroups = std::fs::read_to_string(entry.path().join("cgroup")).unwrap_or_default();
            let cmdline = std::fs::read(entry.path().join("cmdline"))
                .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
                .unwrap_or_default();
            if cgroups.contains(&self.cgroup) || cmdline.contains(&dir) {
                found.push(format!("process {pid}: {}", cmdline.trim()));
            }
            let mounts =
                std::fs::read_to_string(entry.path().join("mountinfo")).unwrap_or_default();
            if mounts.contains(&dir) {
                found.push(format!("mounts of {dir} seen by process {pid}"));
            }
        }
        found
    }
}

/// Polls `ready` until it holds, failing with `proc`'s log (and `context()`) when `proc`
/// exits first or `timeout` passes.
fn wait_alive(
    proc: &mut Proc,
    what: &str,
    timeout: Duration,
    mut ready: impl FnMut() -> bool,
    context: impl Fn() -> String,
) {
    let deadline = Instant::now() + timeout;
    while !ready() {
        assert!(
            !proc.exited(),
            "{what}: {proc:?} exited:\n{}\n{}\n{}",
            fatal_lines(&proc.log_text()),
            tail(&proc.log_text(), 60),
            context()
        );
        assert!(
            Instant::now() < deadline,
            "{what}: not within {timeout:?}; {proc:?} log:\n{}\n{}",
            tail(&proc.log_text(), 60),
            context()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// klog's fatal and error lines (`F1127 ...`, `E1127 ...`): a kubelet that exits with
/// klog.Fatal prints every goroutine after its reason, which the tail then shows alone.
fn fatal_lines(text: &str) -> String {
    let klog = |l: &&str, level: char| {
        l.starts_with(level) && l.len() > 5 && l[1..5].bytes().all(|b| b.is_ascii_digit())
    };
    let found: Vec<&str> = text
        .lines()
        .filter(|l| klog(l, 'F') || klog(l, 'E'))
        .collect();
    found[found.len().saturating_sub(20)..].join("\n")
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The cgroup hierarchies mounted under /sys/fs/cgroup (v1: one per controller; v2:
/// the one).
fn hierarchies() -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.procs").exists() {
        return vec![root.to_path_buf()];
    }
    let mut seen = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(root).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.join("cgroup.procs").exists() {
            if let Ok(real) = std::fs::canonicalize(&path) {
                seen.insert(real);
            }
        }
    }
    seen.into_iter().collect()
}

/// One cgroup per node in every hierarchy.
#[derive(Debug)]
struct NodeCgroup {
    /// `tether-node-PID-N` (PID: the test process that made it).
    name: String,
}

impl NodeCgroup {
    fn create(net: &Node) -> NodeCgroup {
        let name = format!("tether-node-{}-{}", std::process::id(), net.index);
        let cg = NodeCgroup { name };
        for h in hierarchies() {
            let dir = h.join(&cg.name);
            std::fs::create_dir_all(&dir)
                .unwrap_or_else(|e| panic!("create cgroup {}: {e}", dir.display()));
            // cgroup v1 cpuset: a new group has no CPUs or memory nodes until given.
            for file in ["cpuset.cpus", "cpuset.mems"] {
                let own = dir.join(file);
                if own.exists()
                    && std::fs::read_to_string(&own)
                        .unwrap_or_default()
                        .trim()
                        .is_empty()
                {
                    let parent = std::fs::read_to_string(h.join(file)).unwrap_or_default();
                    std::fs::write(&own, parent.trim()).unwrap();
                }
            }
        }
        cg
    }

    /// Shell that moves the running shell into this cgroup (every hierarchy).
    fn join_script(&self) -> String {
        hierarchies()
            .iter()
            .map(|h| format!("echo $$ > {}/cgroup.procs;", h.join(&self.name).display()))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Moves process `pid` into this cgroup.
    fn adopt(&self, pid: u32) {
        for h in hierarchies() {
            let _ = std::fs::write(h.join(&self.name).join("cgroup.procs"), pid.to_string());
        }
    }

    /// Every pid in the cgroup or below it, in any hierarchy.
    fn pids(&self) -> Vec<u32> {
        let mut pids = std::collections::BTreeSet::new();
        for h in hierarchies() {
            for dir in walk(&h.join(&self.name)) {
                let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                pids.extend(procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
        }
        pids.into_iter().collect()
    }

    /// SIGKILLs every process in the cgroup until none is left (20 s at most).
    fn kill_all(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                return;
            }
            for pid in &pids {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .output();
            }
            if Instant::now() > deadline {
                eprintln!(
                    "cgroup {}: processes {pids:?} survived SIGKILL for 20s",
                    self.name
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Removes the cgroup and everything the kubelet made below it.
    fn remove(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        for h in hierarchies() {
            let mut dirs = walk(&h.join(&self.name));
            dirs.reverse();
            for dir in dirs {
                while std::fs::remove_dir(&dir).is_err() && dir.exists() {
                    if Instant::now() > deadline {
                        eprintln!("cgroup {} could not be removed", dir.display());
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
}

/// `dir` and every directory below it, parents first.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if !dir.is_dir() {
        return out;
    }
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                stack.push(entry.path());
            }
        }
        out.push(d);
    }
    out.sort_by_key(|p| p.components().count());
    out
}

/// Removes nodes (cgroups, namespaces, veths) left by test processes that no longer
/// run: a test killed by a timeout never ran its drops.
fn sweep_stale_nodes() {
    let alive = |pid: &str| Path::new("/proc").join(pid).exists();
    for h in hierarchies() {
        for entry in std::fs::read_dir(&h).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(rest) = name.strip_prefix("tether-node-") else {
                continue;
            };
            let pid = rest.split('-').next().unwrap_or_default();
            if !alive(pid) {
                let cg = NodeCgroup { name };
                cg.kill_all();
                cg.remove();
            }
        }
    }
    let netns = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    for ns in netns.lines().filter_map(|l| l.split_whitespace().next()) {
        // Test namespaces are named ttPIDnN (see netns::Node::create).
        let Some(rest) = ns.strip_prefix("tt") else {
            continue;
        };
        let Some((pid, _)) = rest.split_once('n') else {
            continue;
        };
        if pid.bytes().all(|b| b.is_ascii_digit()) && !alive(pid) {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

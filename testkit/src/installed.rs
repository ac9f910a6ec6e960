//! Tether as an operator installs it: our image built from `deploy/Dockerfile`, a
//! control-plane node laid out as kubeadm lays it out (the server a static pod of its
//! kubelet, kube-apiserver reaching it only through the socket on the hostPath), worker
//! nodes behind NAT, and `deploy/` applied with `kubectl apply -k` through an overlay
//! that changes only the image, the address agents dial and the CCM's inventory.
//!
//! The layout, all on this machine:
//! - etcd, kube-apiserver, kube-controller-manager and kube-scheduler are processes of
//!   the host (the control-plane machine; the test is its operator). kube-apiserver's
//!   egress is `deploy/egress-selector-configuration.yaml`, its `udsName` the socket in
//!   the control-plane node's `/etc/kubernetes/konnectivity-server`.
//! - The control-plane node: a real node (kubelet, containerd) in a namespace of its
//!   own whose `/etc/kubernetes` holds `manifests/konnectivity-server.yaml` (copied from
//!   `deploy/`), and the PKI that `tether certs init` wrote, as the README says.
//! - Workers: real nodes on a LAN with the control-plane node that drop every
//!   connection opened to them over it (the NAT case); kube-apiserver reaches neither
//!   their InternalIPs nor their pods.
//! - A client namespace on the LAN, for LoadBalancer Services.
//! - With [`InstalledOptions::ha`], a second control-plane host, `control-plane-2`: a
//!   kube-apiserver of its own on this host (the same etcd, its egress the socket in
//!   that node's `/etc/kubernetes`), its own server static pod and PKI from its own
//!   `tether certs init`, agents dialling both hosts (`PROXY_SERVER_HOST` lists both)
//!   and one CCM replica on each.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::kube::{Cluster, ClusterOptions, Egress};
use crate::netns::{Lan, Node};
use crate::node::{NodeOptions, RealNode};
use crate::TempDir;

/// The image reference the manifests in `deploy/` name.
pub const IMAGE: &str = "tether:v0.1.0";

/// The image as an operator pushes it to a registry of theirs: what the installed
/// cluster runs, set by the README's commands (a `sed` for the static pod, the
/// overlay's `images:` for the rest), so that anything still naming [`IMAGE`] fails.
pub const REGISTRY_IMAGE: &str = "registry.tether.test/tether:v0.1.0";

/// Where this repository's `deploy/` is.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// `reference` as a kubelet resolves it (`tether:v0.1.0` is
/// `docker.io/library/tether:v0.1.0`).
pub fn normalised(reference: &str) -> String {
    let (name, tag) = match reference.rsplit_once(':') {
        Some((n, t)) if !t.contains('/') => (n, t),
        _ => (reference, "latest"),
    };
    let full = match name.split_once('/') {
        None => format!("docker.io/library/{name}"),
        Some((first, _)) if first.contains(['.', ':']) || first == "localhost" => name.into(),
        Some(_) => format!("docker.io/{name}"),
    };
    format!("{full}:{tag}")
}

/// An image archive built by `scripts/build-image.sh`.
#[derive(Debug, Clone)]
pub struct Image {
    /// The OCI archive.
    pub archive: PathBuf,
    /// Its reference, normalised.
    pub reference: String,
}

impl Image {
    /// Builds `deploy/Dockerfile` with `tether` and `tether-agent` from `bin_dir`,
    /// tagged `tag`, into `out`.
    pub fn build(bin_dir: &Path, tag: &str, out: &Path) -> Image {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/build-image.sh");
        let run = Command::new("bash")
            .arg(&script)
            .arg("--binaries")
            .arg(bin_dir)
            .args(["--tag", tag])
            .arg("--out")
            .arg(out)
            .output()
            .expect("run scripts/build-image.sh");
        assert!(
            run.status.success(),
            "scripts/build-image.sh failed:\n{}{}",
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&run.stderr)
        );
        eprintln!("{}", String::from_utf8_lossy(&run.stderr).trim());
        Image {
            archive: out.to_path_buf(),
            reference: normalised(tag),
        }
    }
}

/// How [`Installed::start`] builds the cluster.
#[derive(Debug, Clone)]
pub struct InstalledOptions {
    /// Where the `tether` and `tether-agent` binaries that go into the image are.
    pub bin_dir: PathBuf,
    /// How many workers.
    pub workers: usize,
    /// Two: a second control-plane host, `control-plane-2`, with a kube-apiserver of
    /// its own (the same etcd) and its own server static pod, and two CCM replicas.
    pub ha: bool,
}

/// The second control-plane host of an HA cluster ([`InstalledOptions::ha`]).
pub struct SecondHost {
    /// The node, `control-plane-2`.
    pub node: RealNode,
    /// Its kube-apiserver, whose egress is this host's server's socket.
    pub apiserver: crate::kube::PeerApiserver,
    /// What the node sees as `/etc/kubernetes`.
    pub etc: PathBuf,
    /// Its address on the LAN: what agents dial.
    pub server_address: String,
}

/// The cluster of the module documentation; everything stops and is removed on drop
/// (workers first, then the control-plane node, then the control plane).
pub struct Installed {
    /// Worker nodes `worker-0`, `worker-1`, ...
    pub workers: Vec<RealNode>,
    /// The second control-plane host, in an HA cluster.
    pub second: Option<SecondHost>,
    /// The control-plane node, `control-plane`.
    pub control_plane: RealNode,
    /// etcd, kube-apiserver, kube-controller-manager, kube-scheduler.
    pub cluster: Cluster,
    /// A host on the LAN outside the cluster.
    pub client: Node,
    /// The control-plane node's address on the LAN: what agents dial.
    pub server_address: String,
    /// The image every node has.
    pub image: Image,
    /// The LAN.
    pub lan: Lan,
    etc: PathBuf,
    dir: TempDir,
}

impl std::fmt::Debug for Installed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Installed")
            .field("server_address", &self.server_address)
            .finish()
    }
}

/// How long pods may take to come up on a loaded 2-core machine.
pub const POD_TIMEOUT: Duration = Duration::from_secs(180);

impl Installed {
    /// Builds the image, starts the control plane and the nodes, follows the README's
    /// "Install on a cluster" (certificates, static pod, `kubectl apply -k`) and waits
    /// until every agent is ready and the CCM has initialised every node.
    pub fn start(opts: &InstalledOptions) -> Installed {
        crate::node::available().unwrap_or_else(|e| panic!("installed cluster: {e}"));
        let dir = TempDir::new("tether-installed");
        let d = dir.path().to_path_buf();
        let image = Image::build(&opts.bin_dir, REGISTRY_IMAGE, &d.join("tether.oci.tar"));

        let lan = Lan::create();
        let cp_net = Node::create();
        let server_address = lan.attach(&cp_net);
        let mut worker_nets = Vec::new();
        for _ in 0..opts.workers {
            let net = Node::create();
            lan.attach(&net);
            net.refuse_inbound(Lan::INTERFACE);
            // kube-apiserver where the control-plane host has it, the address pods
            // are told (KUBERNETES_SERVICE_HOST): a worker reaches it as it reaches
            // the apiserver, over its own link.
            net.reach_over_own_link(&cp_net);
            worker_nets.push(net);
        }
        let client = Node::create();
        lan.attach(&client);
        // The second control-plane host reaches the first one's kube-apiserver (what the
        // kubelets and the CCM use) as the workers do.
        let cp2_net = opts.ha.then(|| {
            let net = Node::create();
            let address = lan.attach(&net);
            net.reach_over_own_link(&cp_net);
            (net, address)
        });

        // kube-apiserver's egress: the file users copy, its socket where the
        // control-plane node's /etc/kubernetes is on this host.
        let etc = d.join("etc-kubernetes");
        std::fs::create_dir_all(etc.join("konnectivity-server")).unwrap();
        let egress =
            std::fs::read_to_string(deploy_dir().join("egress-selector-configuration.yaml"))
                .unwrap()
                .replace("/etc/kubernetes/", &format!("{}/", etc.display()));
        let egress_file = d.join("egress-selector-configuration.yaml");
        std::fs::write(&egress_file, egress).unwrap();
        let cluster = Cluster::start_with(
            &Egress::File(egress_file),
            &ClusterOptions {
                reachable_from_nodes: true,
                verify_kubelet_certificates: true,
                controller_manager: true,
                workloads: true,
                extra_sans: std::iter::once(cp_net.host_ip.clone())
                    .chain(cp2_net.iter().map(|(n, _)| n.host_ip.clone()))
                    .collect(),
                kubeadm_ca: true,
                dual_stack: false,
                // Nodes at edge sites do not reach each other's pods: webhooks and
                // aggregated APIs are dialled at pod IPs, which the server sends to the
                // pod's node (docs/operating.md, "What the agent dials").
                aggregator_routing: true,
            },
        );

        let tether = opts.bin_dir.join("tether");
        let apiserver_url = format!("https://{}:{}", cp_net.host_ip, cluster.port);
        control_plane_host(&etc, &cluster, &tether, &server_address, &apiserver_url);
        let node_opts = NodeOptions {
            server_tls_bootstrap: true,
            external_cloud_provider: true,
            etc_kubernetes: None,
            masquerade_pods: true,
            images: vec![(image.archive.clone(), image.reference.clone())],
            kube_proxy: true,
            family: Default::default(),
        };
        let control_plane = RealNode::start_on(
            cp_net,
            &cluster,
            "control-plane",
            &NodeOptions {
                etc_kubernetes: Some(etc.clone()),
                // Before Kubernetes 1.30 kube-proxy takes a LoadBalancer's ingress IP
                // on its host (the status's `ipMode: Proxy` is dropped), so on the
                // host holding the CCM's addresses it would send the balancer's
                // clients to pod IPs that host cannot reach (README, "Install on a
                // cluster").
                kube_proxy: false,
                ..node_opts.clone()
            },
        );
        mark_control_plane(&cluster, "control-plane");
        let second = cp2_net
            .map(|(net, address)| second_host(&d, net, address, &cluster, &tether, &node_opts));
        let mut workers = Vec::new();
        for (i, net) in worker_nets.into_iter().enumerate() {
            workers.push(RealNode::start_on(
                net,
                &cluster,
                &format!("worker-{i}"),
                &node_opts,
            ));
        }

        // kube-controller-manager's node IPAM, as the pod network uses it: each Node's
        // spec.podCIDR is the range its bridge network hands out.
        let second_node = second.as_ref().map(|s| &s.node);
        for node in std::iter::once(&control_plane)
            .chain(second_node)
            .chain(&workers)
        {
            cluster.kubectl_ok(&[
                "patch",
                "node",
                &node.name,
                "--type=merge",
                "-p",
                &format!(
                    r#"{{"spec":{{"podCIDR":"{0}","podCIDRs":["{0}"]}}}}"#,
                    node.pod_cidr
                ),
            ]);
        }

        let installed = Installed {
            workers,
            second,
            control_plane,
            cluster,
            client,
            server_address,
            image,
            lan,
            etc,
            dir,
        };
        installed.apply_overlay(REGISTRY_IMAGE);
        installed.wait_installed();
        installed
    }

    /// The directory of the overlay [`Installed::apply_overlay`] writes.
    pub fn overlay_dir(&self) -> PathBuf {
        self.dir.path().join("overlay")
    }

    /// What the control-plane node sees as `/etc/kubernetes`.
    pub fn etc_kubernetes(&self) -> &Path {
        &self.etc
    }

    /// The CCM inventory of this cluster: the server's agents, and a pool of LAN
    /// addresses held on the control-plane node's LAN interface.
    pub fn inventory(&self) -> String {
        format!(
            "agents:\n  urls: [http://127.0.0.1:8133/agents]\nloadBalancer:\n  interface: {}\n  pools:\n  - name: lan\n    addresses: [{}-{}]\nnodes: []\n",
            Lan::INTERFACE,
            self.lan.address(200),
            self.lan.address(209)
        )
    }

    /// Writes the overlay an operator would (README, "Install on a cluster"): `deploy/`
    /// with `image` as the image, the control-plane node's LAN address as
    /// `PROXY_SERVER_HOST`, one CCM replica for the one control-plane host, which reaches
    /// kube-apiserver at the address that host has for it (`KUBERNETES_SERVICE_HOST`,
    /// `_PORT`: no kube-proxy there), no PodDisruptionBudget (1.20 serves no policy/v1)
    /// and [`Installed::inventory`]; applies it with `kubectl apply --server-side -k`.
    pub fn apply_overlay(&self, image: &str) {
        let overlay = self.overlay_dir();
        std::fs::create_dir_all(&overlay).unwrap();
        let (name, tag) = image.rsplit_once(':').unwrap_or((image, "latest"));
        // kustomize takes relative paths only.
        let deploy = std::fs::canonicalize(deploy_dir()).unwrap();
        let up = "../".repeat(overlay.components().count() - 1);
        let deploy = format!(
            "{up}{}",
            deploy.display().to_string().trim_start_matches('/')
        );
        let inventory: String = self
            .inventory()
            .lines()
            .map(|l| format!("    {l}\n"))
            .collect();
        let kustomization = format!(
            r#"apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
- {deploy}
images:
- name: tether
  newName: {name}
  newTag: {tag}
patches:
- patch: |-
    apiVersion: apps/v1
    kind: DaemonSet
    metadata:
      name: konnectivity-agent
      namespace: kube-system
    spec:
      template:
        spec:
          containers:
          - name: konnectivity-agent
            env:
            - name: PROXY_SERVER_HOST
              value: "{address}"
            # The dial policy reads the Node: kube-apiserver where the nodes reach it
            # (the control-plane host runs no kube-proxy to carry its ClusterIP).
            - name: KUBERNETES_SERVICE_HOST
              value: "{apiserver_host}"
            - name: KUBERNETES_SERVICE_PORT
              value: "{apiserver_port}"
      # Kubernetes 1.20: no DaemonSet surge (docs/install.md, "Before Kubernetes 1.25").
      updateStrategy:
        rollingUpdate:
          maxSurge: null
          maxUnavailable: 10%
- patch: |-
    # One CCM replica per control-plane host (the manifest's two need two hosts), and
    # kube-apiserver where this host reaches it (no kube-proxy here).
    apiVersion: apps/v1
    kind: Deployment
    metadata:
      name: tether-ccm
      namespace: kube-system
    spec:
      replicas: {replicas}
      template:
        spec:
          containers:
          - name: tether-ccm
            env:
            - name: KUBERNETES_SERVICE_HOST
              value: "{apiserver_host}"
            - name: KUBERNETES_SERVICE_PORT
              value: "{apiserver_port}"
- patch: |-
    # Kubernetes 1.20 serves no policy/v1 (deploy/tether-ccm-pdb.yaml).
    $patch: delete
    apiVersion: policy/v1
    kind: PodDisruptionBudget
    metadata:
      name: tether-ccm
      namespace: kube-system
- path: inventory.yaml
"#,
            address = self.server_addresses().join(","),
            replicas = 1 + usize::from(self.second.is_some()),
            apiserver_host = self.control_plane.net.host_ip,
            apiserver_port = self.cluster.port,
        );
        std::fs::write(overlay.join("kustomization.yaml"), kustomization).unwrap();
        std::fs::write(
            overlay.join("inventory.yaml"),
            format!(
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: tether-ccm-inventory\n  namespace: kube-system\ndata:\n  inventory.yaml: |\n{inventory}"
            ),
        )
        .unwrap();
        self.cluster
            .kubectl_ok(&["apply", "--server-side", "-k", overlay.to_str().unwrap()]);
    }

    /// Waits until the server's static pod runs, every node's agent is ready, a CCM
    /// replica is ready and every node is initialised (no `uninitialized` taint).
    pub fn wait_installed(&self) {
        let c = &self.cluster;
        let nodes = self.nodes().count();
        self.wait_or_explain("every agent ready", || {
            let ready = c.kubectl_ok(&[
                "get",
                "daemonset",
                "-n",
                "kube-system",
                "konnectivity-agent",
                "-o",
                "jsonpath={.status.numberReady}",
            ]);
            (ready.trim() == nodes.to_string()).then_some(())
        });
        self.wait_or_explain("a CCM replica ready", || {
            let ready = c.kubectl_ok(&[
                "get",
                "deployment",
                "-n",
                "kube-system",
                "tether-ccm",
                "-o",
                "jsonpath={.status.readyReplicas}",
            ]);
            let want = 1 + u32::from(self.second.is_some());
            (ready.trim().parse::<u32>().unwrap_or(0) >= want).then_some(())
        });
        self.wait_or_explain("every node initialised by the CCM", || {
            let taints = c.kubectl_ok(&[
                "get",
                "nodes",
                "-o",
                "jsonpath={range .items[*]}{.metadata.name}={.spec.taints[*].key};{end}",
            ]);
            (!taints.contains("node.cloudprovider.kubernetes.io/uninitialized")).then_some(())
        });
    }

    /// Polls `probe` until it returns something, for [`POD_TIMEOUT`]; fails with the
    /// cluster's state (pods, events, every container's log) if it does not.
    pub fn wait_or_explain<T>(&self, what: &str, probe: impl FnMut() -> Option<T>) -> T {
        self.wait_or_explain_first(what, probe, String::new)
    }

    /// [`Self::wait_or_explain`], with `first()` (what matters most to this wait) at
    /// the head of the failure's message, where a truncated CI log still shows it.
    pub fn wait_or_explain_first<T>(
        &self,
        what: &str,
        mut probe: impl FnMut() -> Option<T>,
        first: impl FnOnce() -> String,
    ) -> T {
        let deadline = std::time::Instant::now() + POD_TIMEOUT;
        loop {
            if let Some(v) = probe() {
                return v;
            }
            if std::time::Instant::now() > deadline {
                panic!(
                    "{what}: not within {POD_TIMEOUT:?}\n{}\n{}",
                    first(),
                    self.explain()
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Pods, events and every container's log, for a failing test's message.
    pub fn explain(&self) -> String {
        let c = &self.cluster;
        let text = |args: &[&str]| {
            let out = c.kubectl(args);
            format!(
                "$ kubectl {}\n{}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        };
        format!(
            "{}\n{}\n{}\n{}\n{}\n{}",
            text(&["get", "pods", "-A", "-o", "wide"]),
            text(&["get", "nodes", "-o", "wide"]),
            text(&[
                "get",
                "nodes",
                "-o",
                "jsonpath={range .items[*]}{.metadata.name}: taints {.spec.taints} conditions {.status.conditions[*].type}={.status.conditions[*].status}{\"\\n\"}{end}",
            ]),
            text(&["get", "daemonsets", "-A", "-o", "wide"]),
            text(&["get", "events", "-A", "--sort-by=.lastTimestamp"]),
            self.logs()
        )
    }

    /// `kubectl rollout status` of `what` (say `daemonset/konnectivity-agent`) in
    /// kube-system, which must finish within 5 minutes.
    pub fn rollout_status(&self, what: &str) {
        let out = self.cluster.kubectl(&[
            "rollout",
            "status",
            what,
            "-n",
            "kube-system",
            "--timeout=300s",
        ]);
        assert!(
            out.status.success(),
            "rollout of {what}: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.explain()
        );
    }

    /// The Tether server's `/agents`, read on the control-plane node.
    pub fn server_agents(&self) -> serde_json::Value {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.control_plane.net.ns, "curl", "-sf"])
            .arg("http://127.0.0.1:8133/agents")
            .output()
            .unwrap();
        assert!(out.status.success(), "the server's /agents is not served");
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The control-plane hosts' LAN addresses, what agents dial.
    pub fn server_addresses(&self) -> Vec<String> {
        std::iter::once(self.server_address.clone())
            .chain(self.second.as_ref().map(|s| s.server_address.clone()))
            .collect()
    }

    /// What `url` answers on the control-plane host's network (its loopback ports),
    /// or `None` when it does not answer 2xx.
    pub fn on_control_plane(&self, url: &str) -> Option<String> {
        self.on_host(&self.control_plane, url)
    }

    /// What `url` answers on `node`'s network, or `None` when it does not answer 2xx.
    pub fn on_host(&self, node: &RealNode, url: &str) -> Option<String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &node.net.ns, "curl", "-sf"])
            .arg(url)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Every node: the control-plane node, then the workers.
    pub fn nodes(&self) -> impl Iterator<Item = &RealNode> {
        std::iter::once(&self.control_plane)
            .chain(self.second.as_ref().map(|s| &s.node))
            .chain(&self.workers)
    }

    /// A node by name.
    pub fn node(&self, name: &str) -> &RealNode {
        self.nodes()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    /// Everything the pods and kubelets logged, for a failing test's message: read from
    /// the nodes' files, not through the tunnel.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for node in self.nodes() {
            out.push_str(&node.container_logs());
        }
        out
    }
}

/// A control-plane host's `/etc/kubernetes` in `etc` as kubeadm leaves it (the cluster
/// CA), then the README's commands: `tether certs init` (the server certificate for
/// `server_address`, the server's kubeconfig for `apiserver_url`) and the static pod with
/// the registry's image (`sed 's|image: tether:v0.1.0|image: REGISTRY/tether:v0.1.0|'`).
fn control_plane_host(
    etc: &Path,
    cluster: &Cluster,
    tether: &Path,
    server_address: &str,
    apiserver_url: &str,
) {
    let pki = etc.join("pki");
    std::fs::create_dir_all(etc.join("konnectivity-server")).unwrap();
    std::fs::create_dir_all(&pki).unwrap();
    std::fs::copy(&cluster.files.ca, pki.join("ca.crt")).unwrap();
    std::fs::copy(&cluster.files.ca_key, pki.join("ca.key")).unwrap();
    let out = Command::new(tether)
        .args(["certs", "init", "--out"])
        .arg(pki.join("konnectivity"))
        .arg("--ca-cert")
        .arg(pki.join("ca.crt"))
        .arg("--ca-key")
        .arg(pki.join("ca.key"))
        .args(["--server-san", server_address])
        .args(["--apiserver-url", apiserver_url])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tether certs init: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::create_dir_all(etc.join("manifests")).unwrap();
    let manifest = std::fs::read_to_string(deploy_dir().join("konnectivity-server.yaml"))
        .unwrap()
        .replace(
            &format!("image: {IMAGE}"),
            &format!("image: {REGISTRY_IMAGE}"),
        );
    std::fs::write(etc.join("manifests/konnectivity-server.yaml"), manifest).unwrap();
}

/// The second control-plane host: its `/etc/kubernetes`, its kube-apiserver (egress to
/// its own server's socket), its node, marked as a control-plane node.
fn second_host(
    d: &Path,
    net: Node,
    server_address: String,
    cluster: &Cluster,
    tether: &Path,
    node_opts: &NodeOptions,
) -> SecondHost {
    let etc = d.join("etc-kubernetes-2");
    let egress = std::fs::read_to_string(deploy_dir().join("egress-selector-configuration.yaml"))
        .unwrap()
        .replace("/etc/kubernetes/", &format!("{}/", etc.display()));
    let egress_file = d.join("egress-selector-configuration-2.yaml");
    std::fs::write(&egress_file, egress).unwrap();
    let apiserver = cluster.start_peer_apiserver(&Egress::File(egress_file));
    let port = apiserver.url.rsplit(':').next().unwrap().to_string();
    // This host's server talks to this host's kube-apiserver.
    let apiserver_url = format!("https://{}:{port}", net.host_ip);
    control_plane_host(&etc, cluster, tether, &server_address, &apiserver_url);
    let node = RealNode::start_on(
        net,
        cluster,
        "control-plane-2",
        &NodeOptions {
            etc_kubernetes: Some(etc.clone()),
            kube_proxy: false,
            ..node_opts.clone()
        },
    );
    mark_control_plane(cluster, &node.name);
    SecondHost {
        node,
        apiserver,
        etc,
        server_address,
    }
}

/// kubeadm's mark-control-plane phase (1.20 names the taint `master`, and keeps the
/// node out of load balancers' backends).
fn mark_control_plane(cluster: &Cluster, node: &str) {
    cluster.kubectl_ok(&[
        "label",
        "node",
        node,
        "node-role.kubernetes.io/control-plane=",
        "node-role.kubernetes.io/master=",
        "node.kubernetes.io/exclude-from-external-load-balancers=",
    ]);
    cluster.kubectl_ok(&[
        "taint",
        "node",
        node,
        "node-role.kubernetes.io/master:NoSchedule",
    ]);
}

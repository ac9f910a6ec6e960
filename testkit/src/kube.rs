//! A real control plane for tests: etcd (Debian's etcd-server), kube-apiserver 1.20.2
//! and, when asked, kube-controller-manager 1.20.2 (built once by
//! `scripts/install-kube.sh`, cached outside the repo) on free ports, with a throwaway
//! PKI and an EgressSelectorConfiguration pointing at a Tether server. Everything is
//! stopped and removed on drop.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use tether_certs::{write_file, write_pair, Ca, LeafSpec};

use crate::{Proc, TempDir};

/// kube-apiserver version the tests run.
pub const APISERVER_VERSION: &str = "1.20.2";

/// The test cache ($TETHER_CACHE, else ~/.cache/tether): binaries and images
/// `scripts/install-kube.sh` built.
pub fn cache_dir() -> Option<PathBuf> {
    std::env::var_os("TETHER_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/tether")))
}

/// A cached Kubernetes binary (`kube-apiserver`, `kubelet`, `kube-controller-manager`),
/// if built.
pub fn kube_binary(name: &str) -> Option<PathBuf> {
    let bin = cache_dir()?.join(format!("{name}-{APISERVER_VERSION}"));
    bin.exists().then_some(bin)
}

/// A cached Kubernetes binary, or a panic telling how to build it.
pub fn require_kube_binary(name: &str) -> PathBuf {
    kube_binary(name).unwrap_or_else(|| {
        panic!("{name} {APISERVER_VERSION} is not built: run scripts/install-kube.sh (scripts/test.sh does)")
    })
}

/// The cached kube-apiserver binary ($TETHER_KUBE_APISERVER overrides), if built.
pub fn apiserver_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TETHER_KUBE_APISERVER") {
        return Some(PathBuf::from(p));
    }
    kube_binary("kube-apiserver")
}

/// The apiserver binary, or a panic telling how to build it.
pub fn require_apiserver() -> PathBuf {
    apiserver_binary().expect(
        "kube-apiserver 1.20.2 is not built: run scripts/install-kube.sh (scripts/test.sh does)",
    )
}

/// The grpc-go test double for the upstream agent and server
/// (`testkit/grpc-go-peer/main.go`), as `scripts/install-kube.sh` built it; panics
/// telling how to build it when it is missing or older than its source.
pub fn require_grpc_go_peer() -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("grpc-go-peer/main.go");
    let bin = cache_dir()
        .expect("HOME or TETHER_CACHE is set")
        .join("tether-grpc-go-peer");
    let built = std::fs::read_to_string(bin.with_extension("sha256")).unwrap_or_default();
    let out = Command::new("sha256sum")
        .arg(&src)
        .output()
        .expect("run sha256sum");
    let sum = String::from_utf8_lossy(&out.stdout);
    let sum = sum.split_whitespace().next().unwrap_or_default();
    assert!(
        bin.exists() && built.trim() == sum,
        "{} is missing or older than {}: run scripts/install-kube.sh (scripts/test.sh does)",
        bin.display(),
        src.display()
    );
    bin
}

/// A free TCP port on 127.0.0.1 for a child process to bind.
///
/// Ports come from 20000..32768, below Linux's ephemeral range, so an outgoing
/// connection (the apiserver dialling etcd, kubectl, curl) can never take a port between
/// our check and the child's bind. Each test process walks its own pid-derived sequence
/// so that parallel tests in one binary never pick the same port twice.
pub fn free_port() -> u16 {
    free_port_where(|port| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok())
}

/// A UDP port free on 127.0.0.1 (and TCP too), as [`free_port`] picks them: for a
/// server's `--agent-quic-port`, which has no port 0.
pub fn free_udp_port() -> u16 {
    free_port_where(|port| {
        std::net::UdpSocket::bind(("127.0.0.1", port)).is_ok()
            && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
    })
}

fn free_port_where(free: impl Fn(u16) -> bool) -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 20000;
    const SPAN: u32 = 12768;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        (std::process::id().wrapping_mul(7919)) % SPAN,
        Ordering::SeqCst,
        Ordering::SeqCst,
    );
    for _ in 0..SPAN {
        let port = (LOW + NEXT.fetch_add(1, Ordering::SeqCst) % SPAN) as u16;
        if free(port) {
            return port;
        }
    }
    panic!("no free port in 20000..32768 on 127.0.0.1")
}

/// How the apiserver reaches Tether (the `cluster` egress selection).
#[derive(Debug, Clone)]
pub enum Egress {
    /// GRPC over a Unix socket.
    GrpcUds(PathBuf),
    /// HTTPConnect over a Unix socket.
    HttpConnectUds(PathBuf),
    /// HTTPConnect over TCP with mutual TLS.
    HttpConnectTcp {
        /// `https://127.0.0.1:PORT`.
        url: String,
        /// CA that signs the Tether frontend certificate.
        ca: PathBuf,
        /// Client certificate the apiserver presents.
        cert: PathBuf,
        /// Its key.
        key: PathBuf,
    },
    /// A complete EgressSelectorConfiguration file, used as it is.
    File(PathBuf),
    /// No proxy: the apiserver dials directly (tests that need no tunnel).
    Direct,
}

impl Egress {
    /// The EgressSelectorConfiguration document.
    pub fn config_yaml(&self) -> String {
        let connection = match self {
            Egress::File(p) => return std::fs::read_to_string(p).expect("read egress configuration"),
            Egress::Direct => "    proxyProtocol: Direct\n".to_string(),
            Egress::GrpcUds(p) => format!(
                "    proxyProtocol: GRPC\n    transport:\n      uds:\n        udsName: {}\n",
                p.display()
            ),
            Egress::HttpConnectUds(p) => format!(
                "    proxyProtocol: HTTPConnect\n    transport:\n      uds:\n        udsName: {}\n",
                p.display()
            ),
            Egress::HttpConnectTcp { url, ca, cert, key } => format!(
                "    proxyProtocol: HTTPConnect\n    transport:\n      tcp:\n        url: {url}\n        tlsConfig:\n          caBundle: {}\n          clientCert: {}\n          clientKey: {}\n",
                ca.display(),
                cert.display(),
                key.display()
            ),
        };
        format!(
            "apiVersion: apiserver.k8s.io/v1beta1\nkind: EgressSelectorConfiguration\negressSelections:\n- name: cluster\n  connection:\n{connection}"
        )
    }
}

/// Which Tether frontend the apiserver's egress goes through in an end-to-end test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frontend {
    /// GRPC over a Unix socket (what most deployments use).
    GrpcUds,
    /// HTTPConnect over a Unix socket.
    HttpConnectUds,
    /// HTTPConnect over TCP with mutual TLS.
    HttpConnectTcp,
}

impl Frontend {
    /// All three.
    pub const ALL: [Frontend; 3] = [
        Frontend::GrpcUds,
        Frontend::HttpConnectUds,
        Frontend::HttpConnectTcp,
    ];

    /// Server arguments for this frontend with the agent port on every interface
    /// (agents run in node namespaces) and agents verified by the PKI's CA.
    pub fn server_args(self, pki: &crate::Pki) -> Vec<String> {
        let f = &pki.files;
        let mut args = vec![
            "--agent-bind-address=0.0.0.0".to_string(),
            format!("--cluster-cert={}", f.server_cert.display()),
            format!("--cluster-key={}", f.server_key.display()),
            format!("--cluster-ca-cert={}", f.ca_cert.display()),
        ];
        let socket = crate::process::socket_path(pki.dir());
        match self {
            Frontend::GrpcUds => args.extend([
                "--mode=grpc".to_string(),
                format!("--uds-name={}", socket.display()),
                "--server-port=0".into(),
            ]),
            Frontend::HttpConnectUds => args.extend([
                "--mode=http-connect".to_string(),
                format!("--uds-name={}", socket.display()),
                "--server-port=0".into(),
            ]),
            Frontend::HttpConnectTcp => args.extend([
                "--mode=http-connect".to_string(),
                "--server-port=0".into(),
                "--server-bind-address=127.0.0.1".into(),
                format!("--server-cert={}", f.server_cert.display()),
                format!("--server-key={}", f.server_key.display()),
                format!("--server-ca-cert={}", f.frontend_ca_cert.display()),
            ]),
        }
        args
    }

    /// The apiserver's egress to `server` through this frontend.
    pub fn egress(self, pki: &crate::Pki, server: &crate::ServerProc) -> Egress {
        let f = &pki.files;
        let socket = crate::process::socket_path(pki.dir());
        match self {
            Frontend::GrpcUds => Egress::GrpcUds(socket),
            Frontend::HttpConnectUds => Egress::HttpConnectUds(socket),
            Frontend::HttpConnectTcp => Egress::HttpConnectTcp {
                url: format!("https://{}", server.frontend),
                ca: f.ca_cert.clone(),
                cert: f.frontend_cert.clone(),
                key: f.frontend_key.clone(),
            },
        }
    }
}

/// The clusters' Service ranges (the IPv6 one with [`ClusterOptions::dual_stack`]).
pub const SERVICE_CIDRS: &str = "10.96.0.0/16,fd00:96::/112";

/// Files of the cluster PKI.
#[derive(Debug, Clone)]
pub struct ClusterFiles {
    /// Cluster CA.
    pub ca: PathBuf,
    /// Cluster CA key (to issue more client certificates).
    pub ca_key: PathBuf,
    /// Service-account token signing key (PKCS#8 EC) and its public key.
    pub sa_key: PathBuf,
    /// Public half of `sa_key`.
    pub sa_pub: PathBuf,
    /// Admin kubeconfig (system:masters).
    pub admin_kubeconfig: PathBuf,
    /// Kubeconfig for `system:konnectivity-server` (what Tether's server uses).
    pub server_kubeconfig: PathBuf,
    /// Admin client certificate and key (for curl).
    pub admin_cert: PathBuf,
    /// Admin key.
    pub admin_key: PathBuf,
}

/// How a test cluster differs from the default (loopback only, no controller manager,
/// kubelet certificates not verified).
#[derive(Debug, Clone, Default)]
pub struct ClusterOptions {
    /// The apiserver listens on every address (`--bind-address=0.0.0.0`), so that
    /// kubelets in node namespaces reach it over their link; nothing leaves the machine
    /// (test ranges are blackholed, see [`crate::netns`]).
    pub reachable_from_nodes: bool,
    /// Verify kubelets' serving certificates against the cluster CA
    /// (`--kubelet-certificate-authority`): the hardened configuration.
    pub verify_kubelet_certificates: bool,
    /// Run kube-controller-manager 1.20.2: it signs approved CSRs with the cluster CA
    /// (csrsigning) and keeps Endpoints/EndpointSlices of Services with selectors.
    pub controller_manager: bool,
    /// Run workloads as a kubeadm control plane does: kube-scheduler 1.20.2, the
    /// ServiceAccount admission plugin (every pod gets its account's token and the
    /// cluster CA mounted) and, in the controller manager (implied), the DaemonSet,
    /// Deployment, ReplicaSet, ServiceAccount, token and garbage-collector controllers.
    pub workloads: bool,
    /// More names and addresses in the apiserver's serving certificate (say, the
    /// address of a control-plane node's link, from which a static pod reaches it).
    pub extra_sans: Vec<String>,
    /// Make the cluster CA as kubeadm does: an RSA key in PKCS#1 (`RSA PRIVATE KEY`),
    /// written by openssl, and a certificate named `kubernetes`.
    pub kubeadm_ca: bool,
    /// Dual-stack Services (1.20's `IPv6DualStack` gate, and an IPv6 Service range
    /// `fd00:96::/112` beside 10.96.0.0/16).
    pub dual_stack: bool,
    /// `--enable-aggregator-routing`: webhooks and aggregated APIs are dialled at their
    /// Service's endpoints (pod IPs) instead of its ClusterIP.
    pub aggregator_routing: bool,
}

/// A running etcd + kube-apiserver (+ kube-controller-manager when asked).
pub struct Cluster {
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    /// The apiserver's port.
    pub port: u16,
    /// PKI and kubeconfigs.
    pub files: ClusterFiles,
    /// The apiserver's service-account issuer.
    pub issuer: String,
    controller_manager: Option<Proc>,
    root_ca: Option<PathBuf>,
    scheduler: Option<Proc>,
    workloads: bool,
    apiserver_args: Vec<String>,
    apiserver: Proc,
    _etcd: Proc,
    dir: TempDir,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").field("url", &self.url).finish()
    }
}

/// A CA as `kubeadm init` writes `/etc/kubernetes/pki/ca.{crt,key}` (kubeadm's
/// default RSA key, in PKCS#1), made with openssl in `dir`.
fn kubeadm_ca(dir: &Path) -> (Ca, PathBuf, PathBuf) {
    let script = "set -e; openssl genrsa -traditional -out ca.key 2048 2>/dev/null; \
        openssl req -x509 -new -key ca.key -out ca.crt -days 3650 -subj /CN=kubernetes \
        -addext basicConstraints=critical,CA:TRUE \
        -addext keyUsage=critical,digitalSignature,keyEncipherment,keyCertSign; \
        chmod 600 ca.key";
    let out = Command::new("bash")
        .args(["-c", script])
        .current_dir(dir)
        .output()
        .expect("openssl");
    assert!(out.status.success(), "openssl: {out:?}");
    let (cert, key) = (dir.join("ca.crt"), dir.join("ca.key"));
    let pem = std::fs::read_to_string(&key).unwrap();
    assert!(
        pem.contains("BEGIN RSA PRIVATE KEY"),
        "kubeadm's PKCS#1 form"
    );
    (
        Ca::load(&cert, &key).expect("the kubeadm-style CA"),
        cert,
        key,
    )
}

fn kubeconfig(url: &str, ca: &Path, cert: &Path, key: &Path, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {url}\n    certificate-authority: {}\nusers:\n- name: {user}\n  user:\n    client-certificate: {}\n    client-key: {}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: {user}\ncurrent-context: test\n",
        ca.display(),
        cert.display(),
        key.display()
    )
}

impl Cluster {
    /// Starts etcd and kube-apiserver with `egress` and waits until /readyz is ok.
    pub fn start(egress: &Egress) -> Cluster {
        Self::start_with(egress, &ClusterOptions::default())
    }

    /// Like [`Cluster::start`], with `opts`.
    pub fn start_with(egress: &Egress, opts: &ClusterOptions) -> Cluster {
        let apiserver_bin = require_apiserver();
        let dir = TempDir::new("tether-cluster");
        let d = dir.path();

        // PKI.
        let (ca, ca_cert, ca_key) = if opts.kubeadm_ca {
            kubeadm_ca(d)
        } else {
            let ca = Ca::new("tether-test-cluster-ca").unwrap();
            let (cert, key) = write_pair(d, "ca", ca.pair()).unwrap();
            (ca, cert, key)
        };
        let mut sans: Vec<String> = [
            "127.0.0.1",
            "localhost",
            "kubernetes",
            "kubernetes.default",
            "10.96.0.1",
        ]
        .map(String::from)
        .to_vec();
        sans.extend(opts.extra_sans.iter().cloned());
        let serving = ca
            .issue(&LeafSpec {
                common_name: "kube-apiserver".into(),
                sans,
                server: true,
                ..Default::default()
            })
            .unwrap();
        let (serving_cert, serving_key) = write_pair(d, "apiserver", &serving).unwrap();
        let admin = ca
            .issue(&LeafSpec {
                common_name: "admin".into(),
                organization: Some("system:masters".into()),
                client: true,
                ..Default::default()
            })
            .unwrap();
        let (admin_cert, admin_key) = write_pair(d, "admin", &admin).unwrap();
        let server_id = ca
            .issue(&LeafSpec {
                common_name: "system:konnectivity-server".into(),
                client: true,
                ..Default::default()
            })
            .unwrap();
        let (server_cert, server_key) = write_pair(d, "konnectivity-server", &server_id).unwrap();
        let kubelet_client = ca
            .issue(&LeafSpec {
                common_name: "kube-apiserver-kubelet-client".into(),
                organization: Some("system:masters".into()),
                client: true,
                ..Default::default()
            })
            .unwrap();
        let (kubelet_cert, kubelet_key) = write_pair(d, "kubelet-client", &kubelet_client).unwrap();
        let sa = rcgen_key();
        let sa_key = d.join("sa.key");
        let sa_pub = d.join("sa.pub");
        write_file(&sa_key, &sa.0, true).unwrap();
        write_file(&sa_pub, &sa.1, false).unwrap();

        let egress_file = d.join("egress-selector.yaml");
        write_file(&egress_file, &egress.config_yaml(), false).unwrap();

        // etcd; started again on new ports if it exits before it is healthy (a port
        // taken between our check and its bind).
        let (etcd, etcd_url) = start_etcd(&d.join("etcd"));

        // kube-apiserver.
        let port = free_port();
        let url = format!("https://127.0.0.1:{port}");
        let issuer = "https://kubernetes.default.svc.cluster.local".to_string();
        let bind = if opts.reachable_from_nodes {
            "0.0.0.0"
        } else {
            "127.0.0.1"
        };
        let mut extra = Vec::new();
        if opts.verify_kubelet_certificates {
            extra.push(format!(
                "--kubelet-certificate-authority={}",
                ca_cert.display()
            ));
        }
        if opts.aggregator_routing {
            extra.push("--enable-aggregator-routing=true".into());
        }
        if !opts.workloads {
            // Pods of the other tests name no ServiceAccount, and no controller makes
            // the `default` ones.
            extra.push("--disable-admission-plugins=ServiceAccount".into());
        }
        // Everything but the port and the egress: a peer apiserver on the same etcd
        // (see `start_peer_apiserver`) takes the same.
        let shared_args: Vec<String> = [
            format!("--etcd-servers={etcd_url}"),
            format!("--bind-address={bind}"),
            "--advertise-address=127.0.0.1".into(),
            "--insecure-port=0".into(),
            format!("--tls-cert-file={}", serving_cert.display()),
            format!("--tls-private-key-file={}", serving_key.display()),
            format!("--client-ca-file={}", ca_cert.display()),
            "--authorization-mode=Node,RBAC".into(),
            "--enable-admission-plugins=NodeRestriction".into(),
            format!("--service-account-issuer={issuer}"),
            format!("--service-account-key-file={}", sa_pub.display()),
            format!("--service-account-signing-key-file={}", sa_key.display()),
            match opts.dual_stack {
                true => format!("--service-cluster-ip-range={SERVICE_CIDRS}"),
                false => format!(
                    "--service-cluster-ip-range={}",
                    SERVICE_CIDRS.split(',').next().unwrap()
                ),
            },
            // 1.20 serves allocateLoadBalancerNodePorts only behind this gate (on by
            // default from 1.22).
            match opts.dual_stack {
                true => "--feature-gates=ServiceLBNodePortControl=true,IPv6DualStack=true".into(),
                false => "--feature-gates=ServiceLBNodePortControl=true".into(),
            },
            "--kubelet-preferred-address-types=InternalIP".into(),
            format!("--kubelet-client-certificate={}", kubelet_cert.display()),
            format!("--kubelet-client-key={}", kubelet_key.display()),
            "--endpoint-reconciler-type=none".into(),
            "--enable-priority-and-fairness=false".into(),
            "--allow-privileged=true".into(),
            "--profiling=false".into(),
            "--logtostderr=true".into(),
            "--v=1".into(),
        ]
        .into_iter()
        .chain(extra)
        .collect();
        let apiserver = Proc::spawn(
            "kube-apiserver",
            &apiserver_bin,
            &[
                format!("--secure-port={port}"),
                format!("--egress-selector-config-file={}", egress_file.display()),
            ]
            .into_iter()
            .chain(shared_args.iter().cloned())
            .collect::<Vec<_>>(),
        );
        let admin_kubeconfig = d.join("admin.kubeconfig");
        write_file(
            &admin_kubeconfig,
            &kubeconfig(&url, &ca_cert, &admin_cert, &admin_key, "admin"),
            true,
        )
        .unwrap();
        let server_kubeconfig = d.join("konnectivity-server.kubeconfig");
        write_file(
            &server_kubeconfig,
            &kubeconfig(
                &url,
                &ca_cert,
                &server_cert,
                &server_key,
                "system:konnectivity-server",
            ),
            true,
        )
        .unwrap();
        let mut cluster = Cluster {
            url,
            port,
            controller_manager: None,
            root_ca: None,
            scheduler: None,
            workloads: opts.workloads,
            apiserver_args: shared_args,
            files: ClusterFiles {
                ca: ca_cert,
                ca_key,
                sa_key,
                sa_pub,
                admin_kubeconfig,
                server_kubeconfig,
                admin_cert,
                admin_key,
            },
            issuer,
            apiserver,
            _etcd: etcd,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while !cluster
            .kubectl(&["get", "--raw", "/readyz"])
            .status
            .success()
        {
            assert!(
                !cluster.apiserver.exited(),
                "kube-apiserver exited before it was ready; its log:\n{}",
                cluster.apiserver.log_text()
            );
            assert!(
                Instant::now() < deadline,
                "timed out after 120s waiting for kube-apiserver /readyz"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // RBAC bootstrap (system:masters works at once; default roles take a moment).
        wait_blocking("default cluster roles", Duration::from_secs(60), || {
            cluster
                .kubectl(&["get", "clusterrole", "system:auth-delegator"])
                .status
                .success()
                .then_some(())
        });
        if opts.controller_manager || opts.workloads {
            cluster.controller_manager = Some(cluster.start_controller_manager());
        }
        if opts.workloads {
            cluster.scheduler = Some(cluster.start_scheduler());
        }
        cluster
    }

    /// Restarts kube-controller-manager with `--root-ca-file=root_ca` (a cluster with
    /// `workloads`): what an operator does to rotate the cluster CA. Its token
    /// controller then puts the new bundle in every ServiceAccount token Secret's
    /// `ca.crt`, and the kubelets update the pods' volumes.
    pub fn restart_controller_manager(&mut self, root_ca: &Path) {
        drop(self.controller_manager.take());
        self.root_ca = Some(root_ca.to_path_buf());
        self.controller_manager = Some(self.start_controller_manager());
    }

    /// kube-scheduler as admin, no leader election, no serving port.
    fn start_scheduler(&self) -> Proc {
        let bin = require_kube_binary("kube-scheduler");
        Proc::spawn(
            "kube-scheduler",
            &bin,
            &[
                format!("--kubeconfig={}", self.files.admin_kubeconfig.display()),
                "--leader-elect=false".into(),
                "--port=0".into(),
                "--secure-port=0".into(),
                "--logtostderr=true".into(),
                "--v=1".into(),
            ],
        )
    }

    /// kube-controller-manager with the CSR signer (cluster CA) and the endpoint
    /// controllers (slices mirrored from hand-made Endpoints too), as admin, no leader election, no serving port.
    fn start_controller_manager(&self) -> Proc {
        let bin = require_kube_binary("kube-controller-manager");
        let f = &self.files;
        let mut controllers =
            "csrsigning,csrcleaner,endpoint,endpointslice,endpointslicemirroring".to_string();
        let mut extra = Vec::new();
        if self.workloads {
            // nodelifecycle: as in any cluster, it lifts the `not-ready` taint kubelets
            // register with once they are Ready (pods that do not tolerate every taint,
            // such as the Kubernetes docs' agent DaemonSet, wait for that).
            // root-ca-cert-publisher: the kube-root-ca.crt ConfigMap in every namespace,
            // where the agent DaemonSet takes the cluster CA from (1.20+).
            controllers.push_str(",daemonset,deployment,replicaset,serviceaccount,serviceaccount-token,garbagecollector,nodelifecycle,root-ca-cert-publisher");
            extra.push(format!(
                "--service-account-private-key-file={}",
                f.sa_key.display()
            ));
            let root_ca = self.root_ca.as_ref().unwrap_or(&f.ca);
            extra.push(format!("--root-ca-file={}", root_ca.display()));
        }
        Proc::spawn(
            "kube-controller-manager",
            &bin,
            &[
                format!("--kubeconfig={}", f.admin_kubeconfig.display()),
                format!("--controllers={controllers}"),
                format!("--cluster-signing-cert-file={}", f.ca.display()),
                format!("--cluster-signing-key-file={}", f.ca_key.display()),
                "--leader-elect=false".into(),
                "--use-service-account-credentials=false".into(),
                "--port=0".into(),
                "--secure-port=0".into(),
                "--logtostderr=true".into(),
                "--v=1".into(),
            ]
            .into_iter()
            .chain(extra)
            .collect::<Vec<_>>(),
        )
    }

    /// A kubeconfig for kubelet `node` (user `system:node:NODE`, group `system:nodes`,
    /// as the Node authorizer expects) that reaches the apiserver at `host:PORT` and
    /// verifies it under the name `localhost` (a SAN of its certificate).
    pub fn node_kubeconfig(&self, node: &str, host: &str, dir: &Path) -> PathBuf {
        self.kubeconfig_at(
            &format!("system:node:{node}"),
            Some("system:nodes"),
            host,
            dir,
            "kubelet",
        )
    }

    /// A kubeconfig for `user` (in group `org`) in `dir` as `STEM.kubeconfig`, reaching
    /// the apiserver at `host:PORT` and verifying it under the name `localhost`.
    pub fn kubeconfig_at(
        &self,
        user: &str,
        org: Option<&str>,
        host: &str,
        dir: &Path,
        stem: &str,
    ) -> PathBuf {
        let ca = Ca::load(&self.files.ca, &self.files.ca_key).unwrap();
        let leaf = ca
            .issue(&LeafSpec {
                common_name: user.into(),
                organization: org.map(String::from),
                client: true,
                ..Default::default()
            })
            .unwrap();
        let (cert, key) = write_pair(dir, &format!("{stem}-client"), &leaf).unwrap();
        let path = dir.join(format!("{stem}.kubeconfig"));
        let url = format!("https://{host}:{}", self.port);
        let text = kubeconfig(&url, &self.files.ca, &cert, &key, user).replace(
            "    certificate-authority:",
            "    tls-server-name: localhost\n    certificate-authority:",
        );
        write_file(&path, &text, true).unwrap();
        path
    }

    /// Runs kubectl as admin with `input` on stdin; returns the output, success or not.
    pub fn kubectl_input(&self, args: &[&str], input: &[u8]) -> Output {
        let mut cmd = self.kubectl_command();
        cmd.args(args);
        run_with_input(cmd, input)
    }

    /// A kubectl command as admin, not yet started (for long-running ones: logs -f,
    /// port-forward, attach).
    pub fn kubectl_command(&self) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.arg(format!(
            "--kubeconfig={}",
            self.files.admin_kubeconfig.display()
        ));
        cmd
    }

    /// A second kube-apiserver of this cluster (same etcd, certificates and users) whose
    /// egress is `egress`: the same kubectl command against both compares two paths to
    /// the kubelets. Runs until dropped.
    pub fn start_peer_apiserver(&self, egress: &Egress) -> PeerApiserver {
        let port = free_port();
        let egress_file = self.dir.path().join(format!("egress-selector-{port}.yaml"));
        write_file(&egress_file, &egress.config_yaml(), false).unwrap();
        let args: Vec<String> = [
            format!("--secure-port={port}"),
            format!("--egress-selector-config-file={}", egress_file.display()),
        ]
        .into_iter()
        .chain(self.apiserver_args.iter().cloned())
        .collect();
        let mut proc = Proc::spawn("kube-apiserver-peer", &require_apiserver(), &args);
        let url = format!("https://127.0.0.1:{port}");
        let peer_kubeconfig = self.dir.path().join(format!("admin-{port}.kubeconfig"));
        let text = std::fs::read_to_string(&self.files.admin_kubeconfig)
            .unwrap()
            .replace(&self.url, &url);
        write_file(&peer_kubeconfig, &text, true).unwrap();
        wait_blocking(
            "the peer apiserver's /readyz",
            Duration::from_secs(120),
            || {
                assert!(
                    !proc.exited(),
                    "peer kube-apiserver exited:\n{}",
                    proc.log_text()
                );
                Command::new("kubectl")
                    .arg(format!("--kubeconfig={}", peer_kubeconfig.display()))
                    .args(["get", "--raw", "/readyz"])
                    .output()
                    .ok()?
                    .status
                    .success()
                    .then_some(())
            },
        );
        PeerApiserver {
            url,
            admin_kubeconfig: peer_kubeconfig,
            _proc: proc,
        }
    }

    /// The controller manager's log, when it runs.
    pub fn controller_manager_log(&self) -> Option<String> {
        self.controller_manager.as_ref().map(|p| p.log_text())
    }

    /// kube-apiserver's process ID (what a Unix-socket peer credential names).
    pub fn apiserver_pid(&self) -> u32 {
        self.apiserver.pid()
    }

    /// The directory holding the cluster's files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Runs kubectl as admin.
    pub fn kubectl(&self, args: &[&str]) -> Output {
        Command::new("kubectl")
            .arg(format!(
                "--kubeconfig={}",
                self.files.admin_kubeconfig.display()
            ))
            .args(args)
            .output()
            .expect("run kubectl")
    }

    /// Applies `deploy/rbac.yaml` as shipped: what the server (TokenReviews, Nodes,
    /// Leases), the agents and the CCM are granted.
    pub fn apply_shipped_rbac(&self) {
        let rbac = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/rbac.yaml");
        self.kubectl_ok(&["apply", "-f", rbac.to_str().unwrap()]);
    }

    /// Runs kubectl as admin and panics on failure; returns stdout.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(
            out.status.success(),
            "kubectl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    /// `kubectl apply -f -` with `yaml`.
    pub fn apply(&self, yaml: &str) -> String {
        self.kubectl_stdin(&["apply", "-f", "-"], yaml)
    }

    /// Runs kubectl with `input` on stdin; panics on failure; returns stdout.
    pub fn kubectl_stdin(&self, args: &[&str], input: &str) -> String {
        let out = self.kubectl_input(args, input.as_bytes());
        assert!(
            out.status.success(),
            "kubectl {}: {}\ninput:\n{input}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    /// Registers a Node named `name` with InternalIP `ip` and kubelet port 10250.
    pub fn add_node(&self, name: &str, ip: &str) {
        self.apply(&format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  labels:\n    kubernetes.io/hostname: {name}\n"
        ));
        self.patch_node_status(
            name,
            &format!(
                r#"{{"addresses":[{{"type":"InternalIP","address":"{ip}"}},{{"type":"Hostname","address":"{name}"}}],"daemonEndpoints":{{"kubeletEndpoint":{{"Port":10250}}}}}}"#
            ),
        );
    }

    /// Sets node `name`'s Ready condition (what a kubelet would report).
    pub fn set_node_ready(&self, name: &str, ready: bool) {
        let status = if ready { "True" } else { "False" };
        let t = "2026-01-01T00:00:00Z";
        self.patch_node_status(
            name,
            &format!(
                r#"{{"conditions":[{{"type":"Ready","status":"{status}","reason":"Test","lastHeartbeatTime":"{t}","lastTransitionTime":"{t}"}}]}}"#
            ),
        );
    }

    /// Merge-patches node `name`'s status with the JSON object `status`.
    pub fn patch_node_status(&self, name: &str, status: &str) {
        self.kubectl_ok(&[
            "patch",
            "node",
            name,
            "--subresource=status",
            "--type=merge",
            "-p",
            &format!(r#"{{"status":{status}}}"#),
        ]);
    }

    /// A token for ServiceAccount `kube-system/sa` from the TokenRequest API, for
    /// `audience` (None: the apiserver's own).
    pub fn service_account_token(&self, sa: &str, audience: Option<&str>) -> String {
        let audiences = audience
            .map(|a| format!(r#","audiences":["{a}"]"#))
            .unwrap_or_default();
        let body = format!(
            r#"{{"apiVersion":"authentication.k8s.io/v1","kind":"TokenRequest","spec":{{"expirationSeconds":3600{audiences}}}}}"#
        );
        let out = self.kubectl_stdin(
            &[
                "create",
                "--raw",
                &format!("/api/v1/namespaces/kube-system/serviceaccounts/{sa}/token"),
                "-f",
                "-",
            ],
            &body,
        );
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["status"]["token"].as_str().unwrap().to_string()
    }

    /// A token of ServiceAccount `kube-system/konnectivity-agent` for the server's
    /// audience, bound to a Pod `pod` (created here) on node `node`: what the agent
    /// DaemonSet's projected volume holds on that node.
    pub fn pod_bound_agent_token(&self, pod: &str, node: &str) -> String {
        self.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {pod}\n  namespace: kube-system\nspec:\n  nodeName: {node}\n  serviceAccountName: konnectivity-agent\n  automountServiceAccountToken: false\n  containers:\n  - name: agent\n    image: tether:v0.1.0\n"
        ));
        let uid = self.kubectl_ok(&[
            "get",
            "pod",
            pod,
            "-n",
            "kube-system",
            "-o",
            "jsonpath={.metadata.uid}",
        ]);
        let body = format!(
            r#"{{"apiVersion":"authentication.k8s.io/v1","kind":"TokenRequest","spec":{{"expirationSeconds":3600,"audiences":["system:konnectivity-server"],"boundObjectRef":{{"kind":"Pod","apiVersion":"v1","name":"{pod}","uid":"{uid}"}}}}}}"#
        );
        let out = self.kubectl_stdin(
            &[
                "create",
                "--raw",
                "/api/v1/namespaces/kube-system/serviceaccounts/konnectivity-agent/token",
                "-f",
                "-",
            ],
            &body,
        );
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["status"]["token"].as_str().unwrap().to_string()
    }

    /// Does namespace `ns` have an event with `reason` about object `name`?
    pub fn has_event(&self, ns: &str, name: &str, reason: &str) -> bool {
        let out = self.kubectl_ok(&[
            "get",
            "events",
            "-n",
            ns,
            &format!("--field-selector=involvedObject.name={name},reason={reason}"),
            "-o",
            "name",
        ]);
        !out.trim().is_empty()
    }

    /// Creates pod `name` in `default` bound to `node`, with `pod_ip` in its status.
    pub fn add_pod(&self, name: &str, node: &str, pod_ip: &str) {
        self.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  nodeName: {node}\n  automountServiceAccountToken: false\n  containers:\n  - name: app\n    image: app:latest\n"
        ));
        let patch = format!(
            r#"{{"status":{{"phase":"Running","podIP":"{pod_ip}","podIPs":[{{"ip":"{pod_ip}"}}]}}}}"#
        );
        self.kubectl_ok(&[
            "patch",
            "pod",
            name,
            "-n",
            "default",
            "--subresource=status",
            "--type=merge",
            "-p",
            &patch,
        ]);
    }

    /// A kubeconfig for user `user` (a client certificate from the cluster CA, no
    /// groups): what RBAC grants that user is all it can do.
    pub fn kubeconfig_for(&self, user: &str) -> PathBuf {
        let ca = Ca::load(&self.files.ca, &self.files.ca_key).unwrap();
        let leaf = ca
            .issue(&LeafSpec {
                common_name: user.into(),
                client: true,
                ..Default::default()
            })
            .unwrap();
        let file_stem = user.replace([':', '/'], "_");
        let (cert, key) = write_pair(self.dir.path(), &file_stem, &leaf).unwrap();
        let path = self.dir.path().join(format!("{file_stem}.kubeconfig"));
        write_file(
            &path,
            &kubeconfig(&self.url, &self.files.ca, &cert, &key, user),
            true,
        )
        .unwrap();
        path
    }

    /// Applies deploy/tether-ccm.yaml (RBAC, ServiceAccount, Deployment: no scheduler
    /// runs here, so it stays unscheduled) and returns a kubeconfig for that
    /// ServiceAccount's user: a CCM run with it has exactly the RBAC the manifest grants.
    pub fn ccm_kubeconfig(&self) -> PathBuf {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/tether-ccm.yaml");
        self.kubectl_ok(&["apply", "-f", manifest.to_str().unwrap()]);
        self.kubeconfig_for("system:serviceaccount:kube-system:cloud-controller-manager")
    }

    /// The apiserver's log so far (for a failure message).
    pub fn apiserver_log(&self) -> String {
        self.apiserver.log_text()
    }

    /// Does the apiserver log contain `needle`?
    pub fn apiserver_logged(&self, needle: &str) -> bool {
        self.apiserver.logged(needle)
    }
}

/// A second apiserver of a [`Cluster`], see [`Cluster::start_peer_apiserver`].
pub struct PeerApiserver {
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    /// Admin kubeconfig pointing at this apiserver.
    pub admin_kubeconfig: PathBuf,
    _proc: Proc,
}

impl PeerApiserver {
    /// A kubectl command as admin against this apiserver, not yet started.
    pub fn kubectl_command(&self) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.arg(format!("--kubeconfig={}", self.admin_kubeconfig.display()));
        cmd
    }
}

/// Runs `cmd` with `input` written to its stdin (from a thread, so a large input never
/// blocks against a full stdout pipe) and returns its output.
pub fn run_with_input(mut cmd: Command, input: &[u8]) -> Output {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {:?}: {e}", cmd.get_program()));
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let out = child.wait_with_output().expect("wait for the child");
    let _ = writer.join();
    out
}

/// Starts etcd with its data in `data_dir`, waits until /health says true; returns the
/// process and its client URL. Retries on new ports when etcd exits early.
fn start_etcd(data_dir: &Path) -> (Proc, String) {
    for _attempt in 0..3 {
        let _ = std::fs::remove_dir_all(data_dir);
        let (client_port, peer_port) = (free_port(), free_port());
        let etcd_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let mut etcd = Proc::spawn(
            "etcd",
            Path::new("etcd"),
            &[
                "--name=default".into(),
                format!("--data-dir={}", data_dir.display()),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=default={peer_url}"),
                "--log-level=warn".into(),
            ],
        );
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let healthy = Command::new("curl")
                .args(["-sf", "--max-time", "2", &format!("{etcd_url}/health")])
                .output()
                .map(|out| String::from_utf8_lossy(&out.stdout).contains("true"))
                .unwrap_or(false);
            if healthy {
                return (etcd, etcd_url);
            }
            if etcd.exited() {
                eprintln!(
                    "etcd exited before it was healthy; retrying on new ports:\n{}",
                    etcd.log_text()
                );
                break;
            }
            assert!(
                Instant::now() < deadline,
                "timed out after 60s waiting for etcd at {etcd_url}; its log:\n{}",
                etcd.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    panic!("etcd exited before it was healthy three times")
}

/// Polls `probe` (blocking) until it returns Some.
pub fn wait_blocking<T>(what: &str, timeout: Duration, probe: impl FnMut() -> Option<T>) -> T {
    wait_blocking_or(what, timeout, probe, String::new)
}

/// [`wait_blocking`], whose timeout also prints `context()` (a log, an object).
pub fn wait_blocking_or<T>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> Option<T>,
    context: impl Fn() -> String,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = probe() {
            return v;
        }
        if Instant::now() >= deadline {
            panic!(
                "timed out after {timeout:?} waiting for {what}\n{}",
                context()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A fresh ECDSA P-256 key: (PKCS#8 private PEM, SPKI public PEM).
fn rcgen_key() -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    (key.serialize_pem(), key.public_key_pem())
}

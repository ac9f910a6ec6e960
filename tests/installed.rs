//! The product as an operator installs it (see `tether_testkit::installed`): the image
//! built from `deploy/Dockerfile`, the server a static pod of a control-plane kubelet,
//! the agent DaemonSet and the CCM Deployment applied with `kubectl apply -k`, agents
//! authenticated by their projected, pod-bound tokens, workers behind NAT. Every kubectl
//! path and a LoadBalancer Service work through it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tether_testkit::installed::{Image, Installed, InstalledOptions, IMAGE, REGISTRY_IMAGE};
use tether_testkit::kube::{wait_blocking, Cluster};
use tether_testkit::kubectl::{
    compare_paths, every_kubectl_path, exec, port_forward, web_pod_containers, Killed, Streams,
};
use tether_testkit::TempDir;

const BIN: &str = env!("CARGO_BIN_EXE_tether");

/// The binaries that go into the image: this test run's (a debug build), or
/// `$TETHER_IMAGE_BINARIES` (say `target/release`, for the figures in docs/benchmarks.md).
fn bin_dir() -> PathBuf {
    match std::env::var_os("TETHER_IMAGE_BINARIES") {
        Some(dir) => std::fs::canonicalize(dir).expect("TETHER_IMAGE_BINARIES"),
        None => Path::new(BIN).parent().unwrap().to_path_buf(),
    }
}

/// `curl -sf --max-time MAX_TIME URL`, inside network namespace `ns` if given: the
/// body when it succeeded.
fn curl(ns: Option<&str>, url: &str, max_time: u32) -> Option<String> {
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, "curl"]);
            c
        }
        None => Command::new("curl"),
    };
    let out = cmd
        .args(["-sf", "--max-time", &max_time.to_string(), url])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn blob(layout: &Path, digest: &str) -> PathBuf {
    layout
        .join("blobs/sha256")
        .join(digest.trim_start_matches("sha256:"))
}

/// The image holds what deploy/Dockerfile says: user 65532, entrypoint `/tether`, both
/// binaries, and the libraries they need to run as that user with nothing else.
#[test]
fn the_image_is_what_the_dockerfile_says() {
    let dir = TempDir::new("tether-image");
    let image = Image::build(&bin_dir(), IMAGE, &dir.path().join("tether.oci.tar"));
    assert_eq!(image.reference, "docker.io/library/tether:v0.1.0");

    let layout = dir.path().join("layout");
    std::fs::create_dir_all(&layout).unwrap();
    let untar = Command::new("tar")
        .arg("-xf")
        .arg(&image.archive)
        .arg("-C")
        .arg(&layout)
        .status()
        .unwrap();
    assert!(untar.success());
    let index = json(&layout.join("index.json"));
    let entry = &index["manifests"][0];
    assert_eq!(
        entry["annotations"]["org.opencontainers.image.ref.name"],
        image.reference.as_str(),
        "the archive is not tagged as the manifests name the image"
    );
    let manifest = json(&blob(&layout, entry["digest"].as_str().unwrap()));
    let config = json(&blob(
        &layout,
        manifest["config"]["digest"].as_str().unwrap(),
    ));
    assert_eq!(config["config"]["User"], "65532:65532", "{config}");
    assert_eq!(
        config["config"]["Entrypoint"],
        serde_json::json!(["/tether"])
    );

    // The filesystem, layer over layer.
    let rootfs = dir.path().join("rootfs");
    std::fs::create_dir_all(&rootfs).unwrap();
    for layer in manifest["layers"].as_array().unwrap() {
        let untar = Command::new("tar")
            .arg("-xf")
            .arg(blob(&layout, layer["digest"].as_str().unwrap()))
            .arg("-C")
            .arg(&rootfs)
            .status()
            .unwrap();
        assert!(untar.success());
    }
    let passwd = std::fs::read_to_string(rootfs.join("etc/passwd")).unwrap();
    assert!(passwd.contains("nonroot:x:65532:65532:"), "{passwd}");
    assert!(!rootfs.join("bin/sh").exists(), "the image has a shell");
    for (bin, version) in [
        ("/tether", "tether "),
        ("/tether-agent", "tether-agent "),
        // Upstream's program names (its manifests run /proxy-server, /proxy-agent, or
        // the /usr/bin/ ones): the server by the first, the agent by the second.
        ("/proxy-server", "tether-server "),
        ("/usr/bin/proxy-server", "tether-server "),
        ("/proxy-agent", "tether-agent "),
        ("/usr/bin/proxy-agent", "tether-agent "),
    ] {
        let out = Command::new("chroot")
            .arg("--userspec=65532:65532")
            .arg(&rootfs)
            .args([bin, "--version"])
            .output()
            .unwrap();
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).starts_with(version),
            "{bin} does not run in the image as 65532: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The pod-bound token proved each agent's node: `/agents` says so for every node.
fn assert_agents_verified_by_token(i: &Installed) {
    let agents = i.server_agents();
    let agents = agents["agents"].as_array().unwrap();
    for node in i.nodes() {
        let agent = agents
            .iter()
            .find(|a| a["id"] == node.name.as_str())
            .unwrap_or_else(|| panic!("no agent of {} in {agents:?}", node.name));
        assert_eq!(agent["verifiedNode"], node.name.as_str(), "{agent}");
        assert!(
            agent["verifiedIps"]
                .as_array()
                .unwrap()
                .iter()
                .any(|ip| ip == node.ip()),
            "{} not verified: {agent}",
            node.ip()
        );
    }
}

/// `tether status` as docs/operating.md tells an operator to run it: in the server's
/// static pod (host network), against the admin port on loopback. Every node's agent
/// is listed and nothing is wrong.
fn assert_status_is_healthy(i: &Installed) {
    let pod = format!("konnectivity-server-{}", i.control_plane.name);
    let out = i.cluster.kubectl(&[
        "-n",
        "kube-system",
        "exec",
        &pod,
        "--",
        "/tether",
        "status",
        "-o",
        "json",
    ]);
    assert!(
        out.status.success(),
        "tether status in {pod}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["problems"], serde_json::json!([]), "{doc}");
    assert_eq!(
        doc["agents"].as_array().map(Vec::len),
        Some(i.nodes().count()),
        "{doc}"
    );
}

/// `jsonpath` of the agent pods that `field_selector` picks (say `spec.nodeName=N`).
fn agent_pods(c: &Cluster, field_selector: &str, jsonpath: &str) -> String {
    c.kubectl_ok(&[
        "get",
        "pods",
        "-n",
        "kube-system",
        "-l",
        "k8s-app=konnectivity-agent",
        "--field-selector",
        field_selector,
        "-o",
        &format!("jsonpath={jsonpath}"),
    ])
}

/// Every kubelet's serving certificate was requested, approved by the CCM and issued
/// (kube-apiserver verifies them: `--kubelet-certificate-authority`).
fn assert_serving_certificates_issued(i: &Installed) {
    let c = &i.cluster;
    wait_blocking(
        "every kubelet's serving certificate issued",
        Duration::from_secs(120),
        || {
            let out = c.kubectl_ok(&[
                "get",
                "csr",
                "-o",
                "jsonpath={range .items[?(@.spec.signerName==\"kubernetes.io/kubelet-serving\")]}{.spec.username} {.status.conditions[0].type} {.status.certificate}{\"\\n\"}{end}",
            ]);
            let issued: Vec<&str> = out
                .lines()
                .filter(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    f.len() == 3 && f[1] == "Approved" && !f[2].is_empty()
                })
                .collect();
            (issued.len() > i.workers.len()).then_some(())
        },
    );
}

#[test]
fn the_installed_form_carries_every_kubectl_path_and_a_load_balancer() {
    let i = Installed::start(&InstalledOptions {
        bin_dir: bin_dir(),
        workers: 2,
        ha: false,
    });
    let c = &i.cluster;
    assert_agents_verified_by_token(&i);
    assert_status_is_healthy(&i);
    assert_serving_certificates_issued(&i);

    let worker = &i.workers[0];
    worker.run_pod(c, "web", "app: web", &web_pod_containers());
    let scratch = TempDir::new("tether-installed-scratch");
    every_kubectl_path(c, &worker.name, worker.ip(), scratch.path());

    // A webhook, an aggregated API and the services proxy served by a pod on a worker
    // behind NAT: kube-apiserver (--enable-aggregator-routing) dials the pod's IP, the
    // server sends it to that node's agent (destCIDR), whose default dial policy
    // allows it by the pod range its Node object gives.
    let hook = tether_testkit::webhook::install(c, &i.workers[1].name, "webhook_backend");
    hook.assert_served(c);

    // A LoadBalancer Service, from a host on the LAN.
    let ip = web_load_balancer(&i);
    let page = i.wait_or_explain("the page through the load balancer", || {
        curl(Some(&i.client.ns), &format!("http://{ip}/"), 5)
    });
    assert_eq!(page, "hello from the pod\n");

    figures_beside_direct(&i);
    the_docs_agent_manifest_runs_with_only_the_image_changed(&i, scratch.path());
}

/// A platform team's image swap: the Kubernetes docs' agent DaemonSet
/// (tests/golden/k8s-docs-konnectivity-agent.yaml, verbatim), with only its image and
/// `--proxy-server-host` changed, replaces the shipped one. Its `/proxy-agent` runs
/// from Tether's image, logs klog's lines, authenticates with the docs' token, and
/// every kubectl path to worker-0 works through it.
fn the_docs_agent_manifest_runs_with_only_the_image_changed(i: &Installed, scratch: &Path) {
    let c = &i.cluster;
    let docs = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/k8s-docs-konnectivity-agent.yaml"),
    )
    .unwrap()
    .replace(
        "us.gcr.io/k8s-artifacts-prod/kas-network-proxy/proxy-agent:v0.0.37",
        REGISTRY_IMAGE,
    )
    .replace("35.225.206.7", &i.server_address);
    let file = scratch.join("docs-agent.yaml");
    std::fs::write(&file, docs).unwrap();
    c.kubectl_ok(&["replace", "-f", file.to_str().unwrap()]);
    i.rollout_status("daemonset/konnectivity-agent");
    // The docs' agents have random IDs and no identifiers: the server knows each
    // worker's by its pod-bound token. (Their only toleration is CriticalAddonsOnly,
    // so the tainted control-plane node has none.)
    for worker in &i.workers {
        i.wait_or_explain(&format!("{}'s docs agent verified", worker.name), || {
            let agents = i.server_agents();
            agents["agents"]
                .as_array()?
                .iter()
                .any(|a| {
                    a["verifiedNode"] == worker.name.as_str() && a["id"] != worker.name.as_str()
                })
                .then_some(())
        });
    }
    // Worker-0's agent's log (through that agent: the control-plane node has none
    // now, so the label's every pod would not do).
    let worker = &i.workers[0];
    let pod = agent_pods(
        c,
        &format!("spec.nodeName={},status.phase=Running", worker.name),
        "{.items[0].metadata.name}",
    );
    let logs = c.kubectl_ok(&["logs", "-n", "kube-system", pod.trim()]);
    assert!(
        logs.lines()
            .any(|l| l.starts_with('I') && l.contains("] \"connected to proxy server\"")),
        "the docs' /proxy-agent logs klog lines:\n{logs}"
    );
    let again = scratch.join("docs-agent");
    std::fs::create_dir_all(&again).unwrap();
    every_kubectl_path(c, &worker.name, worker.ip(), &again);
}

/// The figures in docs/benchmarks.md: `kubectl port-forward` throughput (64 MiB, 3 rounds) and the
/// time from `kubectl exec` to its first output (5 rounds) to pod `web` on worker-0,
/// through Tether beside a second kube-apiserver of the same cluster that dials the
/// kubelet directly (a route to the node for the measurement). Prints medians; asserts
/// only that both paths deliver every byte.
fn figures_beside_direct(i: &Installed) {
    let c = &i.cluster;
    let worker = &i.workers[0];
    let sum = exec(
        c,
        "web",
        "web",
        "dd if=/dev/urandom of=/www/big bs=1048576 count=64 2>/dev/null && sha256sum /www/big",
    );
    let sum = sum.split_whitespace().next().unwrap().to_string();
    let _route = worker.direct_route();
    let direct = c.start_peer_apiserver(&tether_testkit::kube::Egress::Direct);
    let scratch = TempDir::new("tether-installed-figures");
    let file = scratch.path().join("big.download");
    compare_paths(
        &format!(
            "installed form ({}), kubectl to a pod on {} (medians)",
            bin_dir().display(),
            worker.name
        ),
        &|| c.kubectl_command(),
        &|| direct.kubectl_command(),
        &file,
        &sum,
    );
}

/// Runs `probe` every 250 ms on a thread of its own until dropped, recording when it
/// failed.
struct Prober {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<Vec<(Instant, bool)>>>,
}

impl Prober {
    /// Probes every 250 ms.
    fn start(probe: impl Fn() -> bool + Send + 'static) -> Prober {
        Self::every(Duration::from_millis(250), probe)
    }

    fn every(interval: Duration, probe: impl Fn() -> bool + Send + 'static) -> Prober {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                let at = Instant::now();
                seen.push((at, probe()));
                std::thread::sleep(interval.saturating_sub(at.elapsed()));
            }
            seen
        });
        Prober {
            stop,
            thread: Some(thread),
        }
    }

    /// The probes so far; stops probing.
    fn finish(mut self) -> Vec<(Instant, bool)> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The longest run of failed probes: from the first failure to the next success.
fn longest_outage(seen: &[(Instant, bool)]) -> (Duration, usize) {
    let (mut longest, mut failures) = (Duration::ZERO, 0);
    let mut since: Option<Instant> = None;
    for &(at, ok) in seen {
        if ok {
            if let Some(s) = since.take() {
                longest = longest.max(at - s);
            }
        } else {
            failures += 1;
            since.get_or_insert(at);
        }
    }
    if let (Some(s), Some(&(last, _))) = (since, seen.last()) {
        longest = longest.max(last - s);
    }
    (longest, failures)
}

/// A call the validating webhook must admit (a server-side dry run still asks it):
/// kube-apiserver dials the webhook's pod through the tunnel.
fn webhook_answers(kubeconfig: &Path) -> bool {
    Command::new("kubectl")
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args([
            "create",
            "configmap",
            "probe",
            "-n",
            tether_testkit::webhook::NAMESPACE,
            "--dry-run=server",
            "--request-timeout=5s",
        ])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A cheap kubectl call that goes to `node`'s kubelet through the tunnel.
fn node_answers(kubeconfig: &Path, node: &str) -> bool {
    Command::new("kubectl")
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .args([
            "get",
            "--raw",
            &format!("/api/v1/nodes/{node}/proxy/healthz"),
        ])
        .arg("--request-timeout=5s")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// A LoadBalancer Service `web-lb` for pod `web` as users write it (node ports
/// allocated): the CCM dials its node ports through the tunnel, and kube-proxy on the
/// node forwards to the pod. Returns its address once it has one.
fn web_load_balancer(i: &Installed) -> String {
    i.cluster.apply(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: web-lb\n  namespace: default\nspec:\n  type: LoadBalancer\n  selector:\n    app: web\n  ports:\n  - name: http\n    port: 80\n    targetPort: 8080\n",
    );
    i.wait_or_explain("the Service's address", || {
        Some(lb_address(&i.cluster)).filter(|a| !a.is_empty())
    })
}

/// The Service `web-lb`'s address, or "" if it has none.
fn lb_address(c: &Cluster) -> String {
    let out = c.kubectl(&[
        "get",
        "service",
        "web-lb",
        "-o",
        "jsonpath={.status.loadBalancer.ingress[0].ip}",
    ]);
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Day two on the installed form: the agent DaemonSet rolled from image A to B while a
/// `kubectl logs -f` and a port-forward run through a node's agent; the server's
/// static pod upgraded; the CCM Deployment rolled. Prints how long new kubectl calls to
/// the node failed in each, and asserts the bounds docs/operating.md states.
#[test]
fn day_two_rolling_update_server_restart_and_ccm_rollout() {
    let i = Installed::start(&InstalledOptions {
        bin_dir: bin_dir(),
        workers: 2,
        ha: false,
    });
    let c = &i.cluster;
    let worker = &i.workers[0];
    worker.run_pod(c, "web", "app: web", &web_pod_containers());
    let address = web_load_balancer(&i);
    let admin = c.files.admin_kubeconfig.clone();
    // A webhook whose pod is on the node whose agent is rolled.
    let hook = tether_testkit::webhook::install(c, &worker.name, "webhook_backend");
    hook.assert_served(c);

    let image_b = image_b(&i);

    // --- The agent DaemonSet, A to B, with streams open through worker-0's agent.
    let logs = LogsFollowed::start(&i, "logs-f-agents");
    let (port, _pf) = port_forward(c.kubectl_command(), Streams::Default);
    let page = |port: u16| curl(None, &format!("http://127.0.0.1:{port}/"), 5).is_some();
    assert!(page(port), "port-forward before the update");

    let prober = prober_to(&admin, &worker.name);
    let probe_kubeconfig = admin.clone();
    let hook_prober = Prober::start(move || webhook_answers(&probe_kubeconfig));
    let rolled = Instant::now();
    let rollout = AgentRollout::start(&i, &image_b);
    // While worker-0's old agent drains, the port-forward session it carries still works.
    let draining = i.wait_or_explain("worker-0's old agent draining", || {
        let phase = agent_pods(
            c,
            &format!("spec.nodeName={}", worker.name),
            "{.items[*].metadata.deletionTimestamp}",
        );
        (!phase.trim().is_empty()).then(Instant::now)
    });
    assert!(page(port), "port-forward while the agent drains");
    // logs -f ends with the old agent's drain (--drain-timeout=30s): at its first quiet
    // moment in the last 5 s.
    let (last_line, _) = logs.until_end();
    let logs_ended = Instant::now();
    // The port-forward session, carried by the same agent, ends with it.
    i.wait_or_explain("the port-forward ending with the old agent", || {
        (!page(port)).then_some(())
    });
    let said = rollout.finish(&i);
    let done = rolled.elapsed();
    let seen = prober.finish();
    let (outage, failures) = longest_outage(&seen);
    let (hook_outage, hook_failures) = longest_outage(&hook_prober.finish());
    assert_agents_run(&i, &image_b);
    println!(
        "agent rollout (tether rollout agents): logs -f streamed {:.1} s into the old agent's drain and ended {:.1} s after the rollout began; {failures} of {} kubectl calls to {} failed (longest failure {:.1} s); {hook_failures} of the webhook's calls failed ({:.1} s); done in {:.1} s",
        (last_line.max(draining).saturating_duration_since(draining)).as_secs_f64(),
        (logs_ended - rolled).as_secs_f64(),
        seen.len(),
        worker.name,
        outage.as_secs_f64(),
        hook_outage.as_secs_f64(),
        done.as_secs_f64()
    );
    assert_eq!(
        failures, 0,
        "kubectl calls to the node failed through the rollout\n{said}"
    );
    // kube-apiserver's keep-alive connection to the webhook, carried by the old agent,
    // is closed between two calls in the drain's last seconds (at a quiet moment, the
    // webhook having answered last), so its next call dials through the new agent.
    assert_eq!(
        hook_failures, 0,
        "the webhook failed for {hook_outage:?} through the rollout\n{said}"
    );

    // --- The server, blue/green (docs/operating.md, "Upgrading the server"): a
    // successor's static pod (image B) beside the old one, the old one's manifest
    // removed once the successor holds every agent; then back the other way.
    let manifests = i.etc_kubernetes().join("manifests");
    let prober = prober_to(&admin, &worker.name);
    // A `logs -f` started before: carried by the old server through its drain, cut
    // when its 20 s (--graceful-shutdown-timeout) run out.
    let logs = LogsFollowed::start(&i, "logs-f-servers");
    let upgrade = Instant::now();
    let mut first_stop = None;
    for (old, new) in [(BLUE, GREEN), (GREEN, BLUE)] {
        let stopped = blue_green(&i, &i.control_plane, &manifests, (old, new), &image_b);
        first_stop.get_or_insert(stopped);
    }
    let took = upgrade.elapsed();
    let seen = prober.finish();
    let (outage, failures) = longest_outage(&seen);
    let first_stop = first_stop.unwrap();
    let (last_line, said) = logs.until_end();
    println!(
        "server upgrade, blue/green and back: {failures} of {} kubectl calls to {} failed (longest failure {:.1} s); done in {:.1} s; a logs -f through the first old server streamed {:.1} s after it was told to stop, then kubectl said {said:?}",
        seen.len(),
        worker.name,
        outage.as_secs_f64(),
        took.as_secs_f64(),
        last_line.saturating_duration_since(first_stop).as_secs_f64()
    );
    assert_eq!(
        failures, 0,
        "kubectl calls failed through the server upgrade"
    );
    assert!(
        last_line.saturating_duration_since(first_stop) > Duration::from_secs(10),
        "logs -f did not last through the old server's drain"
    );
    // The old server closes what is left when its grace runs out (CLOSE_RSP): without
    // that, kube-apiserver 1.20's client kept the stream open, silent, for ever.
    assert!(
        !said.starts_with("nothing"),
        "logs -f did not end with the old server: {said}"
    );
    i.wait_or_explain("every agent on the server", || {
        let agents = i.server_agents();
        (agents["agents"].as_array().map_or(0, |a| a.len()) == i.nodes().count()).then_some(())
    });

    // --- The CCM Deployment, rolled: the Service keeps its address throughout.
    let lb_probe = {
        let ns = i.client.ns.clone();
        let address = address.clone();
        Prober::start(move || curl(Some(&ns), &format!("http://{address}/"), 2).is_some())
    };
    let kubeconfig = admin.clone();
    let status_probe = Prober::start(move || {
        let out = Command::new("kubectl")
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args([
                "get",
                "service",
                "web-lb",
                "-o",
                "jsonpath={.status.loadBalancer.ingress[0].ip}",
            ])
            .output();
        // Only an answer without the address counts; a kubectl that timed out on a
        // loaded machine says nothing about the Service.
        out.map(|o| !o.status.success() || !String::from_utf8_lossy(&o.stdout).trim().is_empty())
            .unwrap_or(true)
    });
    let (rolled, _) = roll_ccm(&i, &address);
    let (unserved, _) = longest_outage(&lb_probe.finish());
    let (_, no_address) = longest_outage(&status_probe.finish());
    println!(
        "CCM rollout: done in {:.1} s; the Service kept {address} throughout ({no_address} probes without it); the load balancer did not answer for at most {:.1} s",
        rolled.elapsed().as_secs_f64(),
        unserved.as_secs_f64()
    );
    assert_eq!(
        no_address, 0,
        "the Service lost its address during the rollout"
    );
    assert_eq!(lb_address(c), address);
}

/// One of the two static pods a server upgrade alternates between: its manifest's
/// name (the pod's) and its health port; the agent and admin ports are shared
/// (`--reuse-port`).
#[derive(Clone, Copy)]
struct Colour {
    name: &'static str,
    health: u16,
}

const BLUE: Colour = Colour {
    name: "konnectivity-server",
    health: 8134,
};

const GREEN: Colour = Colour {
    name: "konnectivity-server-green",
    health: 8136,
};

/// `kubectl logs -f` of pod `web`, each line's arrival noted; kubectl's stderr kept in
/// a file named `name` beside the cluster's.
struct LogsFollowed {
    process: Killed,
    lines: std::sync::mpsc::Receiver<Instant>,
    reader: std::thread::JoinHandle<()>,
    err: PathBuf,
    /// When the first line came.
    first: Instant,
}

impl LogsFollowed {
    /// Started, and streaming (its first line came).
    fn start(i: &Installed, name: &str) -> LogsFollowed {
        let err = i.overlay_dir().with_file_name(format!("{name}.err"));
        let mut follow = i.cluster.kubectl_command();
        follow
            .args(["logs", "-f", "web", "-c", "web", "--tail=1"])
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&err).unwrap());
        let mut process = Killed(follow.spawn().unwrap());
        let (lines_tx, lines) = std::sync::mpsc::channel::<Instant>();
        let out = process.0.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            use std::io::BufRead;
            for _ in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let _ = lines_tx.send(Instant::now());
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("logs -f streams");
        LogsFollowed {
            process,
            lines,
            reader,
            err,
            first,
        }
    }

    /// Waits until it ends (or 60 s pass without a line, or 150 s in all): when its
    /// last line came, and what kubectl said on stderr (or that it was still running).
    fn until_end(mut self) -> (Instant, String) {
        let deadline = Instant::now() + Duration::from_secs(150);
        let mut last = self.first;
        while let Ok(at) = self.lines.recv_timeout(Duration::from_secs(60)) {
            last = at;
            if Instant::now() > deadline {
                break;
            }
        }
        let ended = self.process.0.try_wait().ok().flatten();
        drop(self.process);
        let _ = self.reader.join();
        let said = std::fs::read_to_string(&self.err).unwrap_or_default();
        match ended {
            Some(status) => (last, format!("{} ({status})", said.trim())),
            None => (last, "nothing: still running, silent".into()),
        }
    }
}

/// Image B: the same binaries under another tag, on every node as a pull would leave
/// it.
fn image_b(i: &Installed) -> String {
    let image_b = format!("{REGISTRY_IMAGE}-b");
    let b = Image::build(
        &bin_dir(),
        &image_b,
        &i.overlay_dir().with_file_name("tether-b.oci.tar"),
    );
    for node in i.nodes() {
        node.import_image(&b.archive, &b.reference);
    }
    image_b
}

/// `tether rollout agents --image IMAGE` running (1.20's DaemonSets cannot surge: it
/// overlaps old and new agents), its output in files beside the cluster's.
struct AgentRollout {
    process: Killed,
    log: PathBuf,
}

impl AgentRollout {
    fn start(i: &Installed, image: &str) -> AgentRollout {
        let log = i.overlay_dir().with_file_name("rollout-agents.log");
        let mut rollout = Command::new(BIN);
        rollout
            .args(["rollout", "agents", "--image", image, "--kubeconfig"])
            .arg(&i.cluster.files.admin_kubeconfig)
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(Stdio::from(
                std::fs::File::create(log.with_extension("err")).unwrap(),
            ));
        AgentRollout {
            process: Killed(rollout.spawn().unwrap()),
            log,
        }
    }

    /// Waits until it has finished, asserting success; what it printed.
    fn finish(mut self, i: &Installed) -> String {
        let status = i.wait_or_explain("tether rollout agents finishing", || {
            self.process.0.try_wait().unwrap()
        });
        let said = std::fs::read_to_string(&self.log).unwrap_or_default();
        assert!(
            status.success(),
            "tether rollout agents: {status}\n{said}{}",
            std::fs::read_to_string(self.log.with_extension("err")).unwrap_or_default()
        );
        said
    }
}

/// Every node runs one agent, of `image`.
fn assert_agents_run(i: &Installed, image: &str) {
    let images = agent_pods(
        &i.cluster,
        "metadata.namespace=kube-system",
        "{.items[*].spec.containers[0].image}",
    );
    assert!(images.split_whitespace().all(|i| i == image), "{images}");
    assert_eq!(
        images.split_whitespace().count(),
        i.nodes().count(),
        "one agent a node: {images}"
    );
}

/// One blue/green server upgrade on `host` (docs/operating.md, "Upgrading the
/// server"): the successor's static pod (`image`) written beside the old one in
/// `manifests`, the old one's manifest removed once the successor is ready and holds
/// every agent, and waited until the old pod is gone. Returns when the old one's
/// manifest was removed (the kubelet stops it then).
fn blue_green(
    i: &Installed,
    host: &tether_testkit::node::RealNode,
    manifests: &Path,
    (old, new): (Colour, Colour),
    image: &str,
) -> Instant {
    let c = &i.cluster;
    let nodes = i.nodes().count() as f64;
    let old_manifest = manifests.join(format!("{}.yaml", old.name));
    let text = std::fs::read_to_string(&old_manifest).unwrap();
    let text = successor_manifest(&text, old, new, image);
    std::fs::write(manifests.join(format!("{}.yaml", new.name)), text).unwrap();
    let pod = format!("{}-{}", new.name, host.name);
    i.wait_or_explain(&format!("{pod} ready"), || {
        let out = c.kubectl(&[
            "get",
            "pod",
            "-n",
            "kube-system",
            &pod,
            "-o",
            "jsonpath={.status.containerStatuses[0].ready}",
        ]);
        (String::from_utf8_lossy(&out.stdout).trim() == "true").then_some(())
    });
    i.wait_or_explain(&format!("{pod} holding every agent"), || {
        let page = i.on_host(host, &format!("http://127.0.0.1:{}/metrics", new.health));
        let held = tether_testkit::metric(
            &page?,
            "konnectivity_network_proxy_server_ready_backend_connections",
        );
        (held == Some(nodes)).then_some(())
    });
    std::fs::remove_file(&old_manifest).unwrap();
    let stopped = Instant::now();
    let gone = format!("{}-{}", old.name, host.name);
    i.wait_or_explain(&format!("{gone} gone"), || {
        let out = c.kubectl(&["get", "pod", "-n", "kube-system", &gone]);
        (!out.status.success()).then_some(())
    });
    stopped
}

/// The successor's manifest made from the running one's, as docs/operating.md's `sed`
/// makes it: the pod's name, the health port (flag and probes) and the image.
fn successor_manifest(text: &str, old: Colour, new: Colour, image: &str) -> String {
    let text = text
        .replace(
            &format!("\n  name: {}\n", old.name),
            &format!("\n  name: {}\n", new.name),
        )
        .replace(&old.health.to_string(), &new.health.to_string());
    let image_line = text
        .lines()
        .find(|l| l.trim_start().starts_with("image: "))
        .unwrap();
    let indent = &image_line[..image_line.len() - image_line.trim_start().len()];
    text.replace(image_line, &format!("{indent}image: {image}"))
}

/// `tether certs init` as the README gives it, into `out`, with `ca` (cert, key) or a
/// new CA.
fn certs_init(i: &Installed, out: &Path, ca: Option<(&Path, &Path)>, force: bool) {
    let mut cmd = Command::new(BIN);
    cmd.args(["certs", "init", "--out"]).arg(out);
    if let Some((cert, key)) = ca {
        cmd.arg("--ca-cert").arg(cert).arg("--ca-key").arg(key);
    }
    if force {
        cmd.arg("--force");
    }
    cmd.args(["--server-san", &i.server_address]).args([
        "--apiserver-url",
        &format!("https://{}:{}", i.control_plane.net.host_ip, i.cluster.port),
    ]);
    let run = cmd.output().unwrap();
    assert!(
        run.status.success(),
        "tether certs init: {}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// The serial of the first certificate in `pem`.
fn serial_of(pem: &[u8]) -> String {
    let out = tether_testkit::kube::run_with_input(
        {
            let mut c = Command::new("openssl");
            c.args(["x509", "-noout", "-serial"]);
            c
        },
        pem,
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The serial of the certificate the server presents on the agent port, seen from
/// `node`'s namespace.
fn served_serial(i: &Installed, node: &str) -> String {
    let ns = i.node(node).net.ns.clone();
    let out = tether_testkit::kube::run_with_input(
        {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &ns, "openssl", "s_client", "-connect"])
                .arg(format!("{}:8132", i.server_address));
            c
        },
        b"",
    );
    serial_of(&out.stdout)
}

/// Certificates rotated as a cluster rotates them, with tunnels open throughout:
/// - the agents' CA bundle, through their ServiceAccount Secret volume: the operator
///   gives kube-controller-manager a bundle of the old and a new CA, Kubernetes updates
///   the Secret and the kubelet swaps the volume's `..data` link; every agent reloads it;
/// - the server's certificate, renewed in its host directory with the README's
///   `tether certs init --force`; the server reloads it.
///
/// A port-forward through the node's agent keeps working across both, new kubectl
/// calls work, and an agent started afterwards connects with the new bundle.
#[test]
fn certificates_rotate_without_dropping_tunnels() {
    let mut i = Installed::start(&InstalledOptions {
        bin_dir: bin_dir(),
        workers: 1,
        ha: false,
    });
    let worker = i.workers[0].name.clone();
    i.workers[0].run_pod(&i.cluster, "web", "app: web", &web_pod_containers());
    let (port, _pf) = port_forward(i.cluster.kubectl_command(), Streams::Default);
    let page = || curl(None, &format!("http://127.0.0.1:{port}/"), 5).is_some();
    assert!(page(), "port-forward before the rotation");
    let admin = i.cluster.files.admin_kubeconfig.clone();
    let scratch = TempDir::new("tether-rotation");

    // --- The agents' CA bundle, through the Secret volume.
    let new = scratch.path().join("new-ca");
    certs_init(&i, &new, None, false);
    let bundle = scratch.path().join("ca-bundle.crt");
    let mut pem = std::fs::read(&i.cluster.files.ca).unwrap();
    pem.extend(std::fs::read(new.join("ca.crt")).unwrap());
    std::fs::write(&bundle, &pem).unwrap();
    let reloaded = |node: &tether_testkit::node::RealNode| {
        node.pod_logs("kube-system_konnectivity-agent")
            .matches("reloaded TLS material")
            .count()
    };
    let before: Vec<usize> = i.nodes().map(reloaded).collect();
    let rotated = Instant::now();
    i.cluster.restart_controller_manager(&bundle);
    i.wait_or_explain("every agent reloading the CA bundle", || {
        i.nodes()
            .zip(&before)
            .all(|(n, b)| reloaded(n) > *b)
            .then_some(())
    });
    println!(
        "agents' CA bundle: every agent reloaded it {:.1} s after kube-controller-manager got it",
        rotated.elapsed().as_secs_f64()
    );
    assert!(page(), "port-forward after the agents' CA reload");
    assert!(node_answers(&admin, &worker), "kubectl after the CA reload");

    // --- The server's certificate, renewed in place.
    let konnectivity = i.etc_kubernetes().join("pki/konnectivity");
    let old_serial = serial_of(&std::fs::read(konnectivity.join("server-agent.crt")).unwrap());
    assert_eq!(served_serial(&i, &worker), old_serial);
    let server_reloads = |i: &Installed| {
        i.control_plane
            .pod_logs("kube-system_konnectivity-server")
            .matches("reloaded TLS material")
            .count()
    };
    let before = server_reloads(&i);
    let pki = i.etc_kubernetes().join("pki");
    certs_init(
        &i,
        &konnectivity,
        Some((&pki.join("ca.crt"), &pki.join("ca.key"))),
        true,
    );
    let new_serial = serial_of(&std::fs::read(konnectivity.join("server-agent.crt")).unwrap());
    assert_ne!(new_serial, old_serial);
    let renewed = Instant::now();
    i.wait_or_explain("the server reloading its certificate", || {
        (server_reloads(&i) > before).then_some(())
    });
    assert_eq!(
        served_serial(&i, &worker),
        new_serial,
        "the server serves the old certificate"
    );
    println!(
        "server certificate: reloaded {:.1} s after it was renewed (--cert-reload-interval, 1m)",
        renewed.elapsed().as_secs_f64()
    );
    assert!(page(), "port-forward after the server's reload");
    assert!(
        node_answers(&admin, &worker),
        "kubectl after the server's reload"
    );

    // A new agent on the worker connects with the new bundle.
    let agent_on_worker = |i: &Installed| {
        agent_pods(
            &i.cluster,
            &format!("spec.nodeName={worker}"),
            "{range .items[*]}{.metadata.name} {.status.containerStatuses[0].ready}{\"\\n\"}{end}",
        )
    };
    let old = agent_on_worker(&i);
    let old = old.split_whitespace().next().unwrap().to_string();
    i.cluster
        .kubectl_ok(&["delete", "pod", "-n", "kube-system", &old, "--wait=false"]);
    i.wait_or_explain("a new agent on the worker, ready", || {
        let now = agent_on_worker(&i);
        let fresh = now
            .lines()
            .any(|l| !l.starts_with(&format!("{old} ")) && l.ends_with(" true"));
        (fresh && now.lines().count() == 1).then_some(())
    });
    i.wait_or_explain("kubectl to the worker through the new agent", || {
        node_answers(&admin, &worker).then_some(())
    });
}

/// The webhook's backend when a pod runs this binary (`tether_testkit::webhook`);
/// nothing otherwise.
#[test]
#[ignore = "the backend of a webhook pod, run by the_installed_form_carries_every_kubectl_path_and_a_load_balancer"]
fn webhook_backend() {
    tether_testkit::webhook::serve_if_asked();
}

/// How many agent streams the server on `host` holds (its health port's metrics), or
/// `None` while it does not answer.
fn streams_on(i: &Installed, host: &tether_testkit::node::RealNode) -> Option<f64> {
    let page = i.on_host(host, "http://127.0.0.1:8134/metrics")?;
    tether_testkit::metric(
        &page,
        "konnectivity_network_proxy_server_ready_backend_connections",
    )
}

/// The id of the server on `host` and how many agents it holds (its admin port's
/// `/status`), or `None` while it does not answer. With `--reuse-port` an old and a
/// new server share the port, and either may answer.
fn server_status(i: &Installed, host: &tether_testkit::node::RealNode) -> Option<(String, usize)> {
    let status = i.on_host(host, "http://127.0.0.1:8133/status")?;
    let status: serde_json::Value = serde_json::from_str(&status).ok()?;
    let agents = status["agents"].as_array().map_or(0, Vec::len);
    Some((status["serverId"].as_str()?.to_string(), agents))
}

/// The server processes running on `host` (in its network namespace).
fn servers_running(host: &tether_testkit::node::RealNode) -> usize {
    let out = Command::new("ip")
        .args(["netns", "pids", &host.net.ns])
        .output()
        .expect("ip netns pids");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|pid| {
            let cmdline =
                std::fs::read(format!("/proc/{}/cmdline", pid.trim())).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            args.len() > 1 && args[0].ends_with(b"tether") && args[1] == b"server"
        })
        .count()
}

/// kubectl calls through the apiserver of `kubeconfig` to `node`'s kubelet and pod
/// `web` on it, every 250 ms, in turn: the node proxy, `logs` and `exec`.
fn prober_to(kubeconfig: &Path, node: &str) -> Prober {
    let (kubeconfig, node) = (kubeconfig.to_path_buf(), node.to_string());
    let turn = std::sync::atomic::AtomicUsize::new(0);
    let kubectl = move |args: &[&str]| {
        Command::new("kubectl")
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .args(args)
            .arg("--request-timeout=5s")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    Prober::start(
        move || match turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 3 {
            0 => kubectl(&[
                "get",
                "--raw",
                &format!("/api/v1/nodes/{node}/proxy/healthz"),
            ]),
            1 => kubectl(&["logs", "web", "-c", "web", "--tail=1"]),
            _ => kubectl(&["exec", "web", "-c", "web", "--", "true"]),
        },
    )
}

/// Runs `step` while kubectl calls go to `node` through each kube-apiserver of
/// `through` (host, kubeconfig), then says how they fared and asserts that none
/// failed.
fn no_call_fails(through: &[(&str, &Path)], node: &str, what: &str, step: impl FnOnce()) {
    let probers: Vec<Prober> = through
        .iter()
        .map(|(_, kubeconfig)| prober_to(kubeconfig, node))
        .collect();
    let began = Instant::now();
    step();
    let took = began.elapsed();
    for ((host, _), prober) in through.iter().zip(probers) {
        let seen = prober.finish();
        let (outage, failures) = longest_outage(&seen);
        println!(
            "{what}, in {:.1} s: {failures} of {} calls through {host}'s kube-apiserver failed (longest {:.1} s)",
            took.as_secs_f64(),
            seen.len(),
            outage.as_secs_f64()
        );
        assert_eq!(
            failures, 0,
            "calls through {host}'s kube-apiserver failed: {what}"
        );
    }
}

/// Two control-plane hosts, each with its kube-apiserver and its server static pod,
/// every agent holding a stream to both (Leases), two CCM replicas:
/// - Kubermatic's rolling restart (issue 16303): each host's server restarted in
///   place, one host after the other. Every agent must hold a stream to the new server
///   within [`AGENTS_BACK`] of its first answer (the old server's DRAIN sends them
///   while it still serves its last tunnels), and no call through either host's
///   kube-apiserver may fail meanwhile.
/// - Both hosts' servers upgraded blue/green, one host after the other, then the agent
///   DaemonSet rolled: no call through either host's kube-apiserver may fail.
/// - The CCM Deployment rolled, as shipped (two replicas, one per host): the load
///   balancer must answer every request while its pool moves.
#[test]
fn ha_control_plane_restarted_host_by_host_and_ccm_rolled() {
    let i = Installed::start(&InstalledOptions {
        bin_dir: bin_dir(),
        workers: 1,
        ha: true,
    });
    let c = &i.cluster;
    let second = i.second.as_ref().unwrap();
    let nodes = i.nodes().count() as f64;
    let hosts = [
        (
            &i.control_plane,
            i.etc_kubernetes().to_path_buf(),
            c.files.admin_kubeconfig.clone(),
        ),
        (
            &second.node,
            second.etc.clone(),
            second.apiserver.admin_kubeconfig.clone(),
        ),
    ];
    for (host, _, _) in &hosts {
        i.wait_or_explain(&format!("{} holding every agent", host.name), || {
            (streams_on(&i, host) == Some(nodes)).then_some(())
        });
    }
    let worker = &i.workers[0];
    worker.run_pod(c, "web", "app: web", &web_pod_containers());
    let address = web_load_balancer(&i);

    // --- Kubermatic's rolling restart: one host's server, then the other's.
    for (n, (host, etc, own_kubeconfig)) in hosts.iter().enumerate() {
        let (_, _, other_kubeconfig) = &hosts[1 - n];
        let other = prober_to(other_kubeconfig, &worker.name);
        let own = prober_to(own_kubeconfig, &worker.name);
        let manifest = etc.join("manifests/konnectivity-server.yaml");
        let text = std::fs::read_to_string(&manifest).unwrap();
        // A changed annotation: the kubelet replaces the pod, as a rolling update does.
        let restarted = text.replacen(
            "  labels:\n",
            &format!("  annotations:\n    tether.test/restart: \"{n}\"\n  labels:\n"),
            1,
        );
        assert_ne!(restarted, text);
        let (old_id, _) = server_status(&i, host).expect("the server's /status");
        let edited = Instant::now();
        std::fs::write(&manifest, restarted).unwrap();
        // The old server drains, and the new one (another random id) answers; both may
        // run for a while (the old one serving its last tunnels).
        let (up, new_id) =
            i.wait_or_explain(&format!("{}'s new server answering", host.name), || {
                let (id, _) = server_status(&i, host).filter(|(id, _)| *id != old_id)?;
                Some((Instant::now(), id))
            });
        let all = i.wait_or_explain(
            &format!("every agent on {}'s new server", host.name),
            || {
                let (id, agents) = server_status(&i, host)?;
                (id == new_id && agents as f64 == nodes).then(Instant::now)
            },
        );
        let gone = i.wait_or_explain(&format!("{}'s old server gone", host.name), || {
            (servers_running(host) == 1).then(Instant::now)
        });
        let seen = other.finish();
        let (outage, failures) = longest_outage(&seen);
        let seen_own = own.finish();
        let (own_outage, own_failures) = longest_outage(&seen_own);
        println!(
            "rolling restart of {}: the new server answered {:.1} s after the edit and held every agent {:.1} s after that; the old one exited {:.1} s after the edit; calls through its own kube-apiserver: {own_failures} of {} failed (longest {:.1} s); through the other host's: {failures} of {} (longest {:.1} s)",
            host.name,
            (up - edited).as_secs_f64(),
            (all - up).as_secs_f64(),
            (gone - edited).as_secs_f64(),
            seen_own.len(),
            own_outage.as_secs_f64(),
            seen.len(),
            outage.as_secs_f64()
        );
        assert!(
            all - up < AGENTS_BACK,
            "the agents took {:?} to reach {}'s new server",
            all - up,
            host.name
        );
        assert_eq!(failures, 0, "calls through the other host failed");
    }

    // --- The servers upgraded blue/green, one host at a time (the same image: the
    // handover is what is measured), calls through both hosts' kube-apiservers.
    let through: Vec<(&str, &Path)> = hosts
        .iter()
        .map(|(host, _, kubeconfig)| (host.name.as_str(), kubeconfig.as_path()))
        .collect();
    no_call_fails(
        &through,
        &worker.name,
        "servers upgraded blue/green",
        || {
            for (host, etc, _) in &hosts {
                let manifests = etc.join("manifests");
                let text =
                    std::fs::read_to_string(manifests.join("konnectivity-server.yaml")).unwrap();
                let image = text
                    .lines()
                    .find_map(|l| l.trim_start().strip_prefix("image: "))
                    .unwrap()
                    .to_string();
                blue_green(&i, host, &manifests, (BLUE, GREEN), &image);
            }
        },
    );

    // --- The agent DaemonSet rolled to image B with `tether rollout agents` (1.20's
    // DaemonSets cannot surge), calls through both hosts' kube-apiservers.
    let image = image_b(&i);
    no_call_fails(&through, &worker.name, "agents rolled", || {
        AgentRollout::start(&i, &image).finish(&i);
    });
    assert_agents_run(&i, &image);

    // --- The CCM Deployment, rolled with its two replicas: a request every 250 ms.
    let slowest = std::sync::Arc::new(std::sync::Mutex::new(Duration::ZERO));
    let failed_probes = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let lb_probe = {
        let (ns, address) = (i.client.ns.clone(), address.clone());
        let (slowest, failed_probes) = (slowest.clone(), failed_probes.clone());
        Prober::start(move || {
            let at = Instant::now();
            let (started, seen) = (wall_clock(), lb_request(&ns, &address));
            let mut s = slowest.lock().unwrap();
            *s = (*s).max(at.elapsed());
            if let Err(what) = &seen {
                failed_probes
                    .lock()
                    .unwrap()
                    .push(format!("{started}: {what}"));
            }
            seen.is_ok()
        })
    };
    // How long the address answers nothing: a request every 100 ms given 300 ms to
    // connect (a SYN lost as the pool moves is not sent again in that time) and 1 s
    // to be answered.
    let unanswered_probe = {
        let (ns, url) = (i.client.ns.clone(), format!("http://{address}/"));
        Prober::every(Duration::from_millis(100), move || {
            Command::new("ip")
                .args(["netns", "exec", &ns, "curl", "-sf", "-o", "/dev/null"])
                .args(["--connect-timeout", "0.3", "--max-time", "1", &url])
                .status()
                .is_ok_and(|s| s.success())
        })
    };
    // The replicas' logs, kept past their pods for a failure's message.
    let pods = c.kubectl_ok(&[
        "get",
        "pods",
        "-n",
        "kube-system",
        "-l",
        "k8s-app=tether-ccm",
        "-o",
        "jsonpath={.items[*].metadata.name}",
    ]);
    let followed: Vec<(PathBuf, Killed)> = pods
        .split_whitespace()
        .map(|pod| {
            let file = i.overlay_dir().with_file_name(format!("{pod}.log"));
            let mut cmd = c.kubectl_command();
            cmd.args(["logs", "-f", "-n", "kube-system", pod])
                .stdout(std::fs::File::create(&file).unwrap())
                .stderr(Stdio::null());
            (file, Killed(cmd.spawn().unwrap()))
        })
        .collect();
    let (rolled, rolled_at) = roll_ccm(&i, &address);
    let seen = lb_probe.finish();
    let (outage, failures) = longest_outage(&seen);
    let slowest = *slowest.lock().unwrap();
    let (unanswered, _) = longest_outage(&unanswered_probe.finish());
    println!(
        "CCM rollout, two replicas: done in {:.1} s; {failures} of {} requests to {address} failed (longest run of failures {:.1} s), the slowest took {:.2} s; the address answered nothing for at most {:.2} s",
        rolled.elapsed().as_secs_f64(),
        seen.len(),
        outage.as_secs_f64(),
        slowest.as_secs_f64(),
        unanswered.as_secs_f64()
    );
    // What the replicas and servers warned about, for a failure's message.
    let warnings = || {
        let mut text: String = followed
            .iter()
            .map(|(f, _)| std::fs::read_to_string(f).unwrap_or_default())
            .collect();
        text.push_str(&i.logs());
        let failed: Vec<String> = seen
            .iter()
            .filter(|(_, ok)| !ok)
            .map(|(at, _)| format!("{:.2}", (*at - rolled).as_secs_f64()))
            .collect();
        let failed = format!(
            "{failed:?} (the rollout began at {rolled_at}):\n{}",
            failed_probes.lock().unwrap().join("\n")
        );
        let keep = [
            "WARN",
            "became leader",
            "released",
            "listening",
            "SIGTERM",
            "stopped",
        ];
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| keep.iter().any(|k| l.contains(k)))
            .collect();
        format!(
            "failed at {failed} s into the rollout\n{}",
            lines.join("\n")
        )
    };
    // No failed request: the pool moves in a fraction of a second, and a SYN sent to
    // the old holder meanwhile is sent again a second later. Each request is given
    // LB_REQUEST, room for two retransmissions on a loaded machine.
    assert_eq!(
        failures,
        0,
        "the load balancer failed requests (longest run {outage:?}): {}",
        warnings()
    );
    assert!(
        unanswered < LB_UNANSWERED,
        "the load balancer's address answered nothing for {unanswered:?}: {}",
        warnings()
    );
    assert_eq!(lb_address(c), address);
}

/// `kubectl rollout restart` of the CCM Deployment, waited out, and the page served
/// through the load balancer at `address` again; returns when it began (and the time
/// of day, for the logs).
fn roll_ccm(i: &Installed, address: &str) -> (Instant, String) {
    let began = (Instant::now(), wall_clock());
    i.cluster.kubectl_ok(&[
        "rollout",
        "restart",
        "deployment/tether-ccm",
        "-n",
        "kube-system",
    ]);
    i.rollout_status("deployment/tether-ccm");
    i.wait_or_explain_first(
        "the page through the load balancer after the rollout",
        || curl(Some(&i.client.ns), &format!("http://{address}/"), 2).map(|_| ()),
        || lb_diagnosis(i, address),
    );
    began
}

/// What a load balancer that does not answer shows: the CCM's recent log, what curl
/// saw, the client's neighbour entry, and the network namespaces on the CCM's host
/// (the load balancers' own among them).
fn lb_diagnosis(i: &Installed, address: &str) -> String {
    let run = |ns: &str, args: &[&str]| {
        let out = Command::new("ip")
            .args(["netns", "exec", ns])
            .args(args)
            .output()
            .map(|o| {
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                )
            })
            .unwrap_or_else(|e| e.to_string());
        format!("$ {}\n{out}", args.join(" "))
    };
    let url = format!("http://{address}/");
    let logs = i.cluster.kubectl(&[
        "logs",
        "-n",
        "kube-system",
        "deployment/tether-ccm",
        "--tail=80",
    ]);
    format!(
        "$ kubectl logs deployment/tether-ccm --tail=80\n{}{}\n{}\n{}\n{}",
        String::from_utf8_lossy(&logs.stdout),
        String::from_utf8_lossy(&logs.stderr),
        run(
            &i.client.ns,
            &["curl", "-sv", "-o", "/dev/null", "--max-time", "3", &url]
        ),
        run(&i.client.ns, &["ip", "neigh", "show", address]),
        run(
            &i.control_plane.net.ns,
            &["lsns", "-t", "net", "-o", "NS,NPROCS,PID,COMMAND"]
        ),
    )
}

/// One request to the load balancer at `address` from the client namespace `ns`, given
/// [`LB_REQUEST`]; a failure says how far curl got and where the client's neighbour entry for the
/// address pointed after it.
fn lb_request(ns: &str, address: &str) -> Result<(), String> {
    let out = Command::new("ip")
        .args(["netns", "exec", ns, "curl", "-sf", "-o", "/dev/null"])
        .args(["--max-time", &LB_REQUEST.as_secs().to_string(), "-w"])
        .arg("%{http_code} connected after %{time_connect} s, first byte after %{time_starttransfer} s")
        .arg(format!("http://{address}/"))
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        return Ok(());
    }
    let neighbour = Command::new("ip")
        .args(["-n", ns, "neigh", "show", address])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    Err(format!(
        "curl exit {:?}: {}; neighbour: {neighbour}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout)
    ))
}

/// The time of day (UTC, to the millisecond), to set the test's events beside logs.
fn wall_clock() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let (secs, ms) = (now.as_secs() % 86_400, now.subsec_millis());
    format!(
        "{:02}:{:02}:{:02}.{ms:03}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// The test's bound on how long a load balancer's address answers nothing while its
/// pool moves (the target, 1 s, with room for a loaded machine; measured:
/// docs/operating.md).
const LB_UNANSWERED: Duration = Duration::from_secs(2);

/// How long each request to a load balancer is given while its pool moves between two
/// replicas: a SYN lost in the move is sent again after 1 s, then 2 s more.
const LB_REQUEST: Duration = Duration::from_secs(5);

/// How soon every agent holds a stream to a restarted server once it answers: they see
/// its Lease and dial (their backoff is at most 10 s).
const AGENTS_BACK: Duration = Duration::from_secs(30);

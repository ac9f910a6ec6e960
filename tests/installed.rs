//! The product as an operator installs it (see `tether_testkit::installed`): the image
//! built from `deploy/Dockerfile`, the server a static pod of a control-plane kubelet,
//! the agent DaemonSet and the CCM Deployment applied with `kubectl apply -k`, agents
//! authenticated by their projected, pod-bound tokens, workers behind NAT. Every kubectl
//! path and a LoadBalancer Service work through it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tether_testkit::installed::{Image, Installed, InstalledOptions, IMAGE};
use tether_testkit::kube::wait_blocking;
use tether_testkit::kubectl::{every_kubectl_path, web_pod_containers};
use tether_testkit::TempDir;

const BIN: &str = env!("CARGO_BIN_EXE_tether");

/// Where the binaries this test run built are (they go into the image).
fn bin_dir() -> PathBuf {
    Path::new(BIN).parent().unwrap().to_path_buf()
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
    for (bin, version) in [("/tether", "tether "), ("/tether-agent", "tether-agent ")] {
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
    for node in std::iter::once(&i.control_plane).chain(&i.workers) {
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
    });
    let c = &i.cluster;
    assert_agents_verified_by_token(&i);
    assert_serving_certificates_issued(&i);

    let worker = &i.workers[0];
    worker.run_pod(c, "web", "app: web", &web_pod_containers());
    let scratch = TempDir::new("tether-installed-scratch");
    every_kubectl_path(c, &worker.name, worker.ip(), scratch.path());

    // A LoadBalancer Service, from a host on the LAN. No kube-proxy runs on these
    // nodes to serve node ports, so the Service has none: the CCM dials its endpoints,
    // the pods, through the tunnel.
    c.apply("apiVersion: v1\nkind: Service\nmetadata:\n  name: web-lb\n  namespace: default\nspec:\n  type: LoadBalancer\n  allocateLoadBalancerNodePorts: false\n  selector:\n    app: web\n  ports:\n  - name: http\n    port: 80\n    targetPort: 8080\n");
    let ip = wait_blocking("the Service's address", Duration::from_secs(120), || {
        let ip = c.kubectl_ok(&[
            "get",
            "service",
            "web-lb",
            "-o",
            "jsonpath={.status.loadBalancer.ingress[0].ip}",
        ]);
        (!ip.trim().is_empty()).then(|| ip.trim().to_string())
    });
    let page = i.wait_or_explain("the page through the load balancer", || {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &i.client.ns,
                "curl",
                "-sf",
                "--max-time",
                "5",
            ])
            .arg(format!("http://{ip}/"))
            .output()
            .unwrap();
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    });
    assert_eq!(page, "hello from the pod\n");
}

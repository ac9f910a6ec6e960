//! deploy/: every Kubernetes manifest passes `kubectl apply --dry-run=server` against a
//! real kube-apiserver, and kube-apiserver starts with each EgressSelectorConfiguration.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use tether_testkit::kube::{Cluster, Egress};

fn deploy(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(name)
}

/// Manifests of APIs the suite's kube-apiserver (1.20) does not serve yet: checked for
/// their shape below, and left out of its dry runs.
const NEWER_THAN_1_20: &[&str] = &["tether-ccm-pdb.yaml"];

/// The agent DaemonSet's surge (Kubernetes 1.22+), and what docs/install.md says to use
/// before: 1.20 knows no `maxSurge` and refuses `maxUnavailable: 0` without it.
const SURGE: &str = "maxSurge: 1\n      maxUnavailable: 0";
const BEFORE_SURGE: &str = "maxUnavailable: 10%";

/// `text` as a 1.20 cluster takes it (docs/install.md, "Before Kubernetes 1.25").
fn for_1_20(text: &str) -> String {
    text.replace(SURGE, BEFORE_SURGE)
}

#[test]
fn manifests_newer_than_the_suites_apiserver_have_their_shape() {
    let pdb: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(deploy("tether-ccm-pdb.yaml")).unwrap())
            .unwrap();
    assert_eq!(pdb["apiVersion"], "policy/v1");
    assert_eq!(pdb["kind"], "PodDisruptionBudget");
    assert_eq!(pdb["spec"]["maxUnavailable"], 1);
    // It selects the CCM's pods.
    let ccm = std::fs::read_to_string(deploy("tether-ccm.yaml")).unwrap();
    let deployment = serde_yaml::Deserializer::from_str(&ccm)
        .map(|d| serde_yaml::Value::deserialize(d).unwrap())
        .find(|d| d["kind"] == "Deployment")
        .unwrap();
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"]
    );
}

#[test]
fn manifests_pass_server_side_dry_run() {
    // The GRPC egress configuration is used verbatim.
    let cluster = Cluster::start(&Egress::File(deploy("egress-selector-configuration.yaml")));
    let mut checked = 0;
    for entry in std::fs::read_dir(deploy("")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        // kube-apiserver's own file, and kustomize's (applied below with -k).
        if !name.ends_with(".yaml")
            || name.starts_with("egress-selector-configuration")
            || name == "kustomization.yaml"
            || NEWER_THAN_1_20.contains(&name.as_str())
        {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        if name == "konnectivity-agent.yaml" {
            assert!(text.contains(SURGE), "the agent surges");
        }
        let out = cluster.kubectl_input(
            &["apply", "--dry-run=server", "-f", "-"],
            for_1_20(&text).as_bytes(),
        );
        assert!(
            out.status.success(),
            "{name} failed server-side dry run:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        checked += 1;
    }
    assert!(
        checked >= 3,
        "expected rbac, server and agent manifests, checked {checked}"
    );
    // `kubectl apply -k deploy/`: what kustomize renders, but the objects 1.20 does not
    // serve.
    let rendered = cluster.kubectl_ok(&["kustomize", deploy("").to_str().unwrap()]);
    let served: Vec<&str> = rendered
        .split("\n---\n")
        .filter(|d| !d.contains("kind: PodDisruptionBudget"))
        .collect();
    assert_eq!(served.len() + 1, rendered.split("\n---\n").count());
    let out = cluster.kubectl_input(
        &["apply", "--dry-run=server", "-f", "-"],
        for_1_20(&served.join("\n---\n")).as_bytes(),
    );
    assert!(
        out.status.success(),
        "kubectl apply -k deploy/ failed server-side dry run:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    monitoring_passes_server_side_dry_run(&cluster);
}

/// `deploy/monitoring/` (the PrometheusRule and the dashboard's ConfigMap), with the
/// Prometheus Operator's CRD reduced to its names: kustomize's output and the objects'
/// kinds are checked; the rules themselves are promtool's (`tests/monitoring.rs`).
fn monitoring_passes_server_side_dry_run(cluster: &Cluster) {
    cluster.apply(
        "apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: prometheusrules.monitoring.coreos.com
spec:
  group: monitoring.coreos.com
  names: {kind: PrometheusRule, listKind: PrometheusRuleList, plural: prometheusrules, singular: prometheusrule}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        x-kubernetes-preserve-unknown-fields: true
",
    );
    let established = cluster.kubectl(&[
        "wait",
        "--for=condition=established",
        "--timeout=60s",
        "crd/prometheusrules.monitoring.coreos.com",
    ]);
    assert!(established.status.success(), "the CRD is not established");
    let dir = deploy("monitoring");
    let dir = dir.to_str().unwrap();
    // The PrometheusRule goes through kustomize and the CRD's discovery with a client
    // dry run: kube-apiserver 1.20.2 as built here dies on any custom resource (a Go
    // runtime fault: its vendored reflect2 predates Go 1.18's maps), dry run or not.
    let out = cluster.kubectl(&["apply", "--dry-run=client", "-k", dir]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kubectl apply --dry-run=client -k deploy/monitoring/ failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for object in [
        "prometheusrule.monitoring.coreos.com/tether",
        "configmap/tether-dashboard",
    ] {
        assert!(said.contains(object), "{object} not applied: {said}");
    }
    // The dashboard's ConfigMap, as kustomize generates it, passes the server.
    let built = cluster.kubectl_ok(&["kustomize", dir]);
    let configmap = built
        .split("\n---\n")
        .find(|doc| doc.contains("kind: ConfigMap"))
        .expect("kustomize generates the dashboard's ConfigMap");
    assert!(
        configmap.contains("grafana_dashboard: \"1\""),
        "{configmap}"
    );
    let out = cluster.kubectl_input(
        &["apply", "--dry-run=server", "-f", "-"],
        configmap.as_bytes(),
    );
    assert!(
        out.status.success(),
        "the dashboard ConfigMap failed server-side dry run:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn http_connect_egress_configuration_is_accepted() {
    // Same file with its TLS paths pointed at real files (the apiserver loads them).
    let pki = tether_testkit::Pki::new();
    let f = &pki.files;
    let text = std::fs::read_to_string(deploy("egress-selector-configuration-httpconnect.yaml"))
        .unwrap()
        .replace(
            "/etc/kubernetes/pki/konnectivity/ca.crt",
            f.ca_cert.to_str().unwrap(),
        )
        .replace(
            "/etc/kubernetes/pki/konnectivity/apiserver-client.crt",
            f.frontend_cert.to_str().unwrap(),
        )
        .replace(
            "/etc/kubernetes/pki/konnectivity/apiserver-client.key",
            f.frontend_key.to_str().unwrap(),
        );
    let file = pki.dir().join("egress.yaml");
    std::fs::write(&file, text).unwrap();
    let cluster = Cluster::start(&Egress::File(file));
    assert!(cluster
        .kubectl(&["get", "--raw", "/readyz"])
        .status
        .success());
}

/// The kubeadm examples in deploy/kubeadm/, each under its apiVersion's shape: v1beta3
/// (kubeadm 1.22-1.30) takes `extraArgs` and `kubeletExtraArgs` as maps, v1beta4 (1.31+)
/// as lists of `{name, value}`. No kubeadm binary is at hand, so this reads them as
/// kubeadm's types are laid out: the flags the install needs, on the right components,
/// and the volumes the server's static pod shares with kube-apiserver.
#[test]
fn kubeadm_examples_have_each_versions_shape() {
    let docs = |name: &str| -> Vec<serde_yaml::Value> {
        let text = std::fs::read_to_string(deploy("kubeadm").join(name)).unwrap();
        serde_yaml::Deserializer::from_str(&text)
            .map(|d| serde_yaml::Value::deserialize(d).unwrap())
            .collect()
    };
    // Flags as (name, value) pairs, in either version's form.
    let args = |v: &serde_yaml::Value, version: &str| -> Vec<(String, String)> {
        match version {
            "v1beta3" => v
                .as_mapping()
                .unwrap_or_else(|| panic!("v1beta3 takes a map: {v:?}"))
                .iter()
                .map(|(k, v)| (k.as_str().unwrap().into(), v.as_str().unwrap().into()))
                .collect(),
            _ => v
                .as_sequence()
                .unwrap_or_else(|| panic!("v1beta4 takes a list: {v:?}"))
                .iter()
                .map(|e| {
                    let keys: Vec<_> = e.as_mapping().unwrap().keys().collect();
                    assert_eq!(keys.len(), 2, "{e:?}");
                    (
                        e["name"].as_str().unwrap().into(),
                        e["value"].as_str().unwrap().into(),
                    )
                })
                .collect(),
        }
    };
    let has = |list: &[(String, String)], name: &str| -> String {
        list.iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("{name} missing from {list:?}"))
            .1
            .clone()
    };
    let server = std::fs::read_to_string(deploy("konnectivity-server.yaml")).unwrap();
    for version in ["v1beta3", "v1beta4"] {
        let api = format!("kubeadm.k8s.io/{version}");
        let init = docs(&format!("init-{version}.yaml"));
        let kinds: Vec<&str> = init.iter().map(|d| d["kind"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "InitConfiguration",
                "ClusterConfiguration",
                "KubeletConfiguration"
            ]
        );
        for d in &init[..2] {
            assert_eq!(d["apiVersion"].as_str(), Some(api.as_str()));
        }
        let kubelet = args(&init[0]["nodeRegistration"]["kubeletExtraArgs"], version);
        assert_eq!(has(&kubelet, "cloud-provider"), "external");
        assert!(!has(&kubelet, "node-ip").is_empty());
        let apiserver = args(&init[1]["apiServer"]["extraArgs"], version);
        let egress = has(&apiserver, "egress-selector-config-file");
        assert!(
            has(&apiserver, "kubelet-preferred-address-types").starts_with("InternalIP"),
            "kubelets dialled by address first"
        );
        assert!(!has(&apiserver, "kubelet-certificate-authority").is_empty());
        assert_eq!(has(&apiserver, "enable-aggregator-routing"), "true");
        let volumes = init[1]["apiServer"]["extraVolumes"].as_sequence().unwrap();
        let paths: Vec<&str> = volumes
            .iter()
            .map(|v| v["hostPath"].as_str().unwrap())
            .collect();
        assert!(paths.contains(&egress.as_str()), "{paths:?}");
        // The socket's directory is the one the server's static pod binds.
        assert!(
            paths.iter().any(|p| server.contains(&format!("path: {p}"))),
            "{paths:?}"
        );
        assert!(init[1]["controlPlaneEndpoint"].as_str().is_some());
        assert_eq!(init[2]["apiVersion"], "kubelet.config.k8s.io/v1beta1");
        assert_eq!(init[2]["serverTLSBootstrap"], true);
        let join = docs(&format!("join-{version}.yaml"));
        assert_eq!(join.len(), 1);
        assert_eq!(join[0]["apiVersion"].as_str(), Some(api.as_str()));
        assert_eq!(join[0]["kind"], "JoinConfiguration");
        let kubelet = args(&join[0]["nodeRegistration"]["kubeletExtraArgs"], version);
        assert_eq!(has(&kubelet, "cloud-provider"), "external");
        assert!(!has(&kubelet, "node-ip").is_empty());
    }
}

/// What the manifests promise clusters of today: the agent needs no kubelet address to
/// start and no automounted API token (its dial policy reads its Node with a projected
/// one), takes the cluster CA from `kube-root-ca.crt`, and surges; node
/// components are node-critical; the CCM reaches kube-apiserver without kube-proxy, with
/// readiness, on kubeadm's, k3s' and RKE2's control-plane labels, and a DNS that does not
/// wait on itself.
#[test]
fn the_manifests_fit_clusters_of_today() {
    let agent = std::fs::read_to_string(deploy("konnectivity-agent.yaml")).unwrap();
    assert!(
        !agent.contains("status.hostIP"),
        "no kubelet address needed to start"
    );
    // No automounted token: the two it has are projected, each for its purpose.
    assert!(agent.contains("automountServiceAccountToken: false"));
    assert!(agent.contains("audience: system:konnectivity-server"));
    assert!(agent.contains("--node-name=$(NODE_NAME)") && agent.contains("--service-cidr="));
    assert!(agent.contains("name: kube-root-ca.crt"));
    assert!(agent.contains("maxSurge: 1") && agent.contains("maxUnavailable: 0"));
    assert!(agent.contains("priorityClassName: system-node-critical"));
    let server = std::fs::read_to_string(deploy("konnectivity-server.yaml")).unwrap();
    assert!(server.contains("priorityClassName: system-node-critical"));
    let ccm = std::fs::read_to_string(deploy("tether-ccm.yaml")).unwrap();
    let deployment = serde_yaml::Deserializer::from_str(&ccm)
        .map(|d| serde_yaml::Value::deserialize(d).unwrap())
        .find(|d| d["kind"] == "Deployment")
        .unwrap();
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["dnsPolicy"], "Default");
    let env: Vec<&str> = pod["containers"][0]["env"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert!(env.contains(&"KUBERNETES_SERVICE_HOST") && env.contains(&"KUBERNETES_SERVICE_PORT"));
    assert!(pod["containers"][0]["readinessProbe"].is_mapping());
    let terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        ["nodeSelectorTerms"]
        .as_sequence()
        .unwrap();
    for label in [
        "node-role.kubernetes.io/control-plane",
        "node-role.kubernetes.io/master",
    ] {
        assert!(
            terms
                .iter()
                .any(|t| t["matchExpressions"][0]["key"] == label
                    && t["matchExpressions"][0]["operator"] == "Exists"),
            "{label}: any value (kubeadm's \"\", k3s' and RKE2's \"true\")"
        );
    }
}

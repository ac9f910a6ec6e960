//! deploy/: every Kubernetes manifest passes `kubectl apply --dry-run=server` against a
//! real kube-apiserver, and kube-apiserver starts with each EgressSelectorConfiguration.

use std::path::{Path, PathBuf};

use tether_testkit::kube::{Cluster, Egress};

fn deploy(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(name)
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
        {
            continue;
        }
        let out = cluster.kubectl(&["apply", "--dry-run=server", "-f", path.to_str().unwrap()]);
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
    let out = cluster.kubectl(&[
        "apply",
        "--dry-run=server",
        "-k",
        deploy("").to_str().unwrap(),
    ]);
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

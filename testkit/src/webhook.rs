//! A validating admission webhook and an aggregated API (metrics-server style) served by
//! a pod on a real node, so that kube-apiserver reaches them only through the tunnel.
//! The pod runs the test binary itself (mounted from the host with the host's glibc into
//! the busybox image), whose ignored test `webhook_backend` serves HTTPS on 8443 when
//! [`ENV`] names the directory holding its certificate: `tls.crt` and `tls.key`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use tether_certs::{Ca, LeafSpec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::kube::Cluster;
use crate::node::BUSYBOX_IMAGE;

/// Set in the pod: where `tls.crt` and `tls.key` are.
pub const ENV: &str = "TETHER_TEST_WEBHOOK";
/// The namespace everything lives in; only its objects go to the webhook.
pub const NAMESPACE: &str = "tether-webhook";
/// The aggregated API's group and version.
pub const GROUP_VERSION: &str = "metrics.tether.test/v1beta1";
/// What the webhook says when it refuses an object.
pub const DENIED: &str = "denied by the tether test webhook";
const PORT: u16 = 8443;

/// In the test binary's ignored `webhook_backend` test: serves until killed when
/// [`ENV`] is set, else returns at once.
pub fn serve_if_asked() {
    let Ok(dir) = std::env::var(ENV) else {
        return;
    };
    let dir = Path::new(&dir);
    let cert = std::fs::read(dir.join("tls.crt")).expect("tls.crt");
    let key = std::fs::read(dir.join("tls.key")).expect("tls.key");
    let tls = tether_core::tls::server_config_from_pem(&cert, &key, &[b"http/1.1"])
        .expect("serving certificate");
    let node = Arc::new(std::env::var("NODE_NAME").unwrap_or_default());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(("0.0.0.0", PORT))
            .await
            .expect("bind 8443");
        let acceptor = tokio_rustls::TlsAcceptor::from(tls);
        eprintln!("webhook backend serving on {PORT}");
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                continue;
            };
            let (acceptor, node) = (acceptor.clone(), node.clone());
            tokio::spawn(async move {
                if let Ok(Ok(tls)) =
                    tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await
                {
                    serve_connection(tls, &node).await;
                }
            });
        }
    });
}

/// HTTP/1.1 requests on one connection, kept alive as kube-apiserver keeps them.
async fn serve_connection<S>(mut s: S, node: &str)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 8192];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let length: usize = head
            .lines()
            .filter_map(|l| l.split_once(':'))
            .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
            .and_then(|(_, v)| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 8192];
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body: Vec<u8> = buf[head_end..head_end + length].to_vec();
        buf.drain(..head_end + length);
        let mut words = head.split_whitespace();
        let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
        let (status, answer) = answer(method, path, &body, node);
        let reply = format!(
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{answer}",
            answer.len()
        );
        if s.write_all(reply.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// The answer to one request.
fn answer(method: &str, path: &str, body: &[u8], node: &str) -> (&'static str, String) {
    let path = path.split('?').next().unwrap_or(path);
    let base = format!("/apis/{GROUP_VERSION}");
    match (method, path) {
        ("POST", "/validate") => {
            let review: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
            let request = &review["request"];
            let deny = request["object"]["metadata"]["labels"]["tether-test/deny"].is_string();
            let mut response = serde_json::json!({
                "uid": request["uid"],
                "allowed": !deny,
            });
            if deny {
                response["status"] = serde_json::json!({
                    "code": 403,
                    "message": format!("{DENIED} on {node}"),
                });
            }
            let review = serde_json::json!({
                "apiVersion": review["apiVersion"],
                "kind": "AdmissionReview",
                "response": response,
            });
            ("200 OK", review.to_string())
        }
        ("GET", p) if p == base => (
            "200 OK",
            serde_json::json!({
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": GROUP_VERSION,
                "resources": [{
                    "name": "pings", "singularName": "ping", "namespaced": false,
                    "kind": "Ping", "verbs": ["get"]
                }]
            })
            .to_string(),
        ),
        ("GET", p) if p.starts_with(&format!("{base}/pings/")) => (
            "200 OK",
            serde_json::json!({
                "kind": "Ping",
                "apiVersion": GROUP_VERSION,
                "metadata": {"name": p.rsplit('/').next().unwrap_or_default()},
                "servedBy": node,
            })
            .to_string(),
        ),
        ("GET", "/" | "/healthz") => (
            "200 OK",
            serde_json::json!({"backend": "webhook", "node": node}).to_string(),
        ),
        _ => (
            "404 Not Found",
            serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404})
                .to_string(),
        ),
    }
}

/// What [`install`] made.
#[derive(Debug)]
pub struct Webhook {
    /// The node the backend's pod runs on.
    pub node: String,
}

/// Runs the backend in a pod on `node` (the running test binary, whose ignored test
/// `entry` calls [`serve_if_asked`]) behind Service `webhook` (443 -> 8443), and
/// registers the ValidatingWebhookConfiguration (objects in [`NAMESPACE`] only) and the
/// APIService for [`GROUP_VERSION`], both trusting a CA of their own.
pub fn install(cluster: &Cluster, node: &str, entry: &str) -> Webhook {
    let ca = Ca::new("tether test webhook CA").unwrap();
    let service = format!("webhook.{NAMESPACE}.svc");
    let leaf = ca
        .issue(&LeafSpec {
            common_name: service.clone(),
            sans: vec![service.clone(), format!("{service}.cluster.local")],
            server: true,
            ..Default::default()
        })
        .unwrap();
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let bundle = b64(&ca.pair().cert_pem);
    let exe = std::env::current_exe().unwrap();
    let (dir, file) = (
        exe.parent().unwrap().display().to_string(),
        exe.file_name().unwrap().to_string_lossy().to_string(),
    );
    cluster.apply(&format!(
        r#"apiVersion: v1
kind: Namespace
metadata:
  name: {NAMESPACE}
  labels:
    tether-test/webhook: "on"
---
apiVersion: v1
kind: Secret
metadata:
  name: webhook-tls
  namespace: {NAMESPACE}
type: kubernetes.io/tls
data:
  tls.crt: {crt}
  tls.key: {key}
---
apiVersion: v1
kind: Pod
metadata:
  name: webhook
  namespace: {NAMESPACE}
  labels:
    app: webhook
spec:
  nodeName: {node}
  automountServiceAccountToken: false
  enableServiceLinks: false
  terminationGracePeriodSeconds: 1
  containers:
  - name: webhook
    image: {BUSYBOX_IMAGE}
    imagePullPolicy: Never
    command: ["/test-bin/{file}", "{entry}", "--exact", "--ignored", "--nocapture"]
    env:
    - name: {ENV}
      value: /tls
    - name: NODE_NAME
      valueFrom:
        fieldRef:
          fieldPath: spec.nodeName
    readinessProbe:
      tcpSocket:
        port: {PORT}
      periodSeconds: 1
    volumeMounts:
    - {{name: tls, mountPath: /tls, readOnly: true}}
    - {{name: test-bin, mountPath: /test-bin, readOnly: true}}
    - {{name: libs, mountPath: /lib/x86_64-linux-gnu, readOnly: true}}
    - {{name: lib64, mountPath: /lib64, readOnly: true}}
  volumes:
  - {{name: tls, secret: {{secretName: webhook-tls}}}}
  - {{name: test-bin, hostPath: {{path: "{dir}"}}}}
  - {{name: libs, hostPath: {{path: /lib/x86_64-linux-gnu}}}}
  - {{name: lib64, hostPath: {{path: /lib64}}}}
---
apiVersion: v1
kind: Service
metadata:
  name: webhook
  namespace: {NAMESPACE}
spec:
  selector:
    app: webhook
  ports:
  - port: 443
    targetPort: {PORT}
"#,
        crt = b64(&leaf.cert_pem),
        key = b64(&leaf.key_pem),
    ));
    cluster.kubectl_ok(&[
        "wait",
        "-n",
        NAMESPACE,
        "--for=condition=Ready",
        "pod/webhook",
        "--timeout=180s",
    ]);
    let (group, version) = GROUP_VERSION.split_once('/').unwrap();
    cluster.apply(&format!(
        r#"apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: tether-test
webhooks:
- name: validate.tether.test
  admissionReviewVersions: ["v1"]
  sideEffects: None
  failurePolicy: Fail
  timeoutSeconds: 10
  namespaceSelector:
    matchLabels:
      tether-test/webhook: "on"
  rules:
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: ["CREATE"]
    resources: ["configmaps"]
  clientConfig:
    caBundle: {bundle}
    service:
      namespace: {NAMESPACE}
      name: webhook
      path: /validate
      port: 443
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata:
  name: {version}.{group}
spec:
  group: {group}
  version: {version}
  groupPriorityMinimum: 100
  versionPriority: 100
  caBundle: {bundle}
  service:
    namespace: {NAMESPACE}
    name: webhook
    port: 443
"#
    ));
    Webhook {
        node: node.to_string(),
    }
}

impl Webhook {
    /// Every path kube-apiserver takes to the backend works: the APIService becomes
    /// Available and answers, the webhook admits a ConfigMap and refuses one labelled
    /// `tether-test/deny`, and the services proxy reaches the pod. Each answer names
    /// the node that served it.
    pub fn assert_served(&self, cluster: &Cluster) {
        let (group, version) = GROUP_VERSION.split_once('/').unwrap();
        let out = cluster.kubectl(&[
            "wait",
            "--for=condition=Available",
            &format!("apiservice/{version}.{group}"),
            "--timeout=180s",
        ]);
        assert!(
            out.status.success(),
            "the APIService never became Available: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            cluster.kubectl_ok(&[
                "get",
                "apiservice",
                &format!("{version}.{group}"),
                "-o",
                "yaml"
            ])
        );
        // Available, then the aggregator installs the group's handler: until it has,
        // kube-apiserver itself answers 404.
        let path = format!("/apis/{GROUP_VERSION}/pings/x");
        let ping = crate::kube::wait_blocking(
            "the aggregated API to answer",
            Duration::from_secs(60),
            || {
                let out = cluster.kubectl(&["get", "--raw", &path]);
                out.status
                    .success()
                    .then(|| String::from_utf8_lossy(&out.stdout).to_string())
            },
        );
        assert!(
            ping.contains(&format!(r#""servedBy":"{}""#, self.node)),
            "{ping}"
        );

        let name = |n: &str| format!("cm-{n}-{}", std::process::id());
        cluster.kubectl_ok(&["create", "configmap", "-n", NAMESPACE, &name("ok")]);
        let denied = cluster.kubectl_input(
            &["apply", "-f", "-"],
            format!(
                "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {}\n  namespace: {NAMESPACE}\n  labels:\n    tether-test/deny: \"yes\"\n",
                name("deny")
            )
            .as_bytes(),
        );
        let stderr = String::from_utf8_lossy(&denied.stderr);
        assert!(
            !denied.status.success() && stderr.contains(DENIED) && stderr.contains(&self.node),
            "the webhook did not refuse: {stderr}"
        );

        let page = cluster.kubectl_ok(&[
            "get",
            "--raw",
            &format!("/api/v1/namespaces/{NAMESPACE}/services/https:webhook:443/proxy/"),
        ]);
        assert!(
            page.contains(&format!(r#""node":"{}""#, self.node)),
            "{page}"
        );
    }
}

//! What an operator watches (`deploy/monitoring/`), checked with the real tools from
//! Debian's `prometheus` package: promtool checks the rules and runs their unit tests;
//! the PrometheusRule object is what the rules file renders; every metric the rules
//! and the dashboard name is one our binaries serve; and a real Prometheus scraping a
//! live server, agent and CCM fires and resolves the alerts.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn monitoring(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy/monitoring")
        .join(file)
}

fn read(file: &str) -> String {
    std::fs::read_to_string(monitoring(file)).unwrap_or_else(|e| panic!("read {file}: {e}"))
}

/// Runs promtool with `args` in `dir`, and returns its output; panics with what it said
/// when it fails.
fn promtool(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run promtool ({e}): run scripts/install-deps.sh (Debian's prometheus package)")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

/// The PrometheusRule object for the Prometheus Operator: the rules file's groups
/// under `spec`, its comments kept.
fn prometheus_rule(rules: &str) -> String {
    let mut out = String::from(
        "# Generated from tether.rules.yaml (the source): edit that file, then run\n\
         # `TETHER_BLESS=1 cargo test --test monitoring`. For the Prometheus Operator; add\n\
         # the labels your Prometheus' ruleSelector matches in an overlay.\n\
         apiVersion: monitoring.coreos.com/v1\n\
         kind: PrometheusRule\n\
         metadata:\n  name: tether\n  namespace: kube-system\n  labels:\n    \
         app.kubernetes.io/name: tether\n\
         spec:\n",
    );
    for line in rules
        .lines()
        .skip_while(|l| l.starts_with('#') || l.is_empty())
    {
        if !line.is_empty() {
            out.push_str("  ");
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

#[test]
fn the_prometheus_rule_object_is_the_rules_file() {
    tether_testkit::generated::check(
        &monitoring("prometheusrule.yaml"),
        &prometheus_rule(&read("tether.rules.yaml")),
        "TETHER_BLESS=1 cargo test --test monitoring",
    );
}

#[test]
fn promtool_checks_the_rules_and_passes_their_unit_tests() {
    let dir = monitoring("");
    let checked = promtool(&dir, &["check", "rules", "tether.rules.yaml"]);
    assert!(checked.contains("SUCCESS"), "{checked}");
    promtool(&dir, &["test", "rules", "tether.rules.test.yaml"]);
    // The generated object holds the same rules: promtool reads its spec as a file.
    let spec: serde_yaml::Value = serde_yaml::from_str(&read("prometheusrule.yaml")).unwrap();
    let tmp = tether_testkit::TempDir::new("monitoring");
    let path = tmp.path().join("spec.yaml");
    std::fs::write(&path, serde_yaml::to_string(&spec["spec"]).unwrap()).unwrap();
    promtool(tmp.path(), &["check", "rules", "spec.yaml"]);
}

/// The rules of the rules file: (alert or record name, expression).
fn rules() -> Vec<(String, String)> {
    let doc: serde_yaml::Value = serde_yaml::from_str(&read("tether.rules.yaml")).unwrap();
    let mut out = Vec::new();
    for group in doc["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            let name = rule["alert"].as_str().or(rule["record"].as_str()).unwrap();
            out.push((name.to_string(), rule["expr"].as_str().unwrap().to_string()));
        }
    }
    out
}

/// Every alert has a runbook: a section of docs/monitoring.md with its name.
#[test]
fn every_alert_has_a_runbook_section() {
    let doc: serde_yaml::Value = serde_yaml::from_str(&read("tether.rules.yaml")).unwrap();
    let runbooks =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/monitoring.md"))
            .unwrap();
    for group in doc["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            let Some(alert) = rule["alert"].as_str() else {
                continue;
            };
            let url = rule["annotations"]["runbook_url"].as_str().unwrap_or("");
            assert_eq!(
                url,
                format!("docs/monitoring.md#{}", alert.to_lowercase()),
                "{alert}'s runbook_url"
            );
            assert!(
                runbooks.contains(&format!("\n### {alert}\n")),
                "docs/monitoring.md has no `### {alert}` section"
            );
            let severity = rule["labels"]["severity"].as_str().unwrap_or("");
            assert!(
                ["info", "warning", "critical"].contains(&severity),
                "{alert}'s severity is {severity:?}"
            );
        }
    }
}

/// The dashboard's queries: (panel title, expression).
fn dashboard_queries() -> Vec<(String, String)> {
    let d: serde_json::Value = serde_json::from_str(&read("dashboard.json")).unwrap();
    let mut out = Vec::new();
    for panel in d["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push((
                panel["title"].as_str().unwrap().to_string(),
                target["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    assert!(out.len() > 10, "the dashboard has queries");
    out
}

/// Every dashboard query parses: promtool checks them as recording rules.
#[test]
fn every_dashboard_query_parses() {
    let mut file = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in dashboard_queries().iter().enumerate() {
        file.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {}\n",
            serde_json::to_string(expr).unwrap()
        ));
    }
    let tmp = tether_testkit::TempDir::new("monitoring");
    std::fs::write(tmp.path().join("dashboard.rules.yaml"), file).unwrap();
    promtool(tmp.path(), &["check", "rules", "dashboard.rules.yaml"]);
}

/// The metric names a PromQL expression reads: identifiers that are not functions,
/// keywords, label names (in braces and grouping lists) or durations.
fn metric_names(expr: &str) -> BTreeSet<String> {
    // Besides the words LISTS holds.
    const KEYWORDS: &[&str] = &[
        "and",
        "or",
        "unless",
        "offset",
        "bool",
        // Aggregations, which may come before their `by` list rather than a `(`.
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    const LISTS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    let mut last_word = String::new();
    while i < chars.len() {
        let c = chars[i];
        let skip_to = |close: char, from: usize| {
            chars[from..]
                .iter()
                .position(|&x| x == close)
                .map_or(chars.len(), |p| from + p + 1)
        };
        if c == '"' {
            i = skip_to('"', i + 1);
        } else if c == '{' {
            i = skip_to('}', i + 1);
        } else if c == '[' {
            i = skip_to(']', i + 1);
        } else if c == '(' && LISTS.contains(&last_word.as_str()) {
            i = skip_to(')', i + 1);
            last_word.clear();
        } else if c.is_ascii_digit() || c == '.' {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let next = chars[i..].iter().find(|c| !c.is_whitespace());
            let keyword = KEYWORDS.contains(&word.as_str()) || LISTS.contains(&word.as_str());
            if next != Some(&'(') && !keyword {
                names.insert(word.clone());
            }
            last_word = word;
        } else {
            if !c.is_whitespace() {
                last_word.clear();
            }
            i += 1;
        }
    }
    names
}

#[test]
fn metric_names_are_read_from_promql() {
    let names = metric_names(
        r#"sum by (job, le) (rate(a_bucket{x="y"}[5m])) / ignoring (reason) group_left () (b:c:rate5m > 0) and on (i) c offset 1h or vector(0) > 2 * 86400"#,
    );
    let want: BTreeSet<String> = ["a_bucket", "b:c:rate5m", "c"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(names, want);
}

/// The families our binaries declare (the generated metric reference), with their type.
fn declared_families() -> Vec<(String, String)> {
    tether::reference::metrics_markdown()
        .lines()
        .filter_map(|l| {
            let mut cells = l.strip_prefix("| `")?.split(" | ");
            let name = cells.next()?.trim_end_matches('`').to_string();
            Some((name, cells.next()?.to_string()))
        })
        .collect()
}

/// Metrics the rules read from other exporters: kube-state-metrics'.
const EXTERNAL: &[&str] = &["kube_daemonset_status_number_available"];

/// True when `name` is a series name of a declared family (a histogram's `_bucket`,
/// `_sum` and `_count` included), a recording rule's, or another exporter's we name.
fn known(name: &str, families: &[(String, String)], records: &BTreeSet<String>) -> bool {
    records.contains(name)
        || EXTERNAL.contains(&name)
        || families.iter().any(|(family, kind)| {
            family == name
                || (kind == "histogram"
                    && ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|s| name.strip_suffix(s) == Some(family.as_str())))
        })
}

/// Every metric the rules and the dashboard read is one a binary of ours declares (or
/// a recording rule): a renamed metric cannot leave an alert that never fires.
#[test]
fn the_rules_and_the_dashboard_read_only_metrics_we_serve() {
    let families = declared_families();
    assert!(
        families.len() > 50,
        "the metric reference lists the families"
    );
    let rules = rules();
    let records: BTreeSet<String> = rules
        .iter()
        .map(|(n, _)| n.clone())
        .filter(|n| n.contains(':'))
        .collect();
    let mut unknown = Vec::new();
    let queries = rules.into_iter().chain(dashboard_queries());
    for (what, expr) in queries {
        for name in metric_names(&expr) {
            if !known(&name, &families, &records) {
                unknown.push(format!("{what}: {name}"));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "metrics no binary serves:\n{}",
        unknown.join("\n")
    );
}

// === a real Prometheus against live processes ===

const BIN: &str = env!("CARGO_BIN_EXE_tether");

/// The shipped rules with every `for` cut to 1 s, so that a test at a 1 s evaluation
/// interval sees them fire within seconds.
fn rules_for_a_fast_test() -> String {
    read("tether.rules.yaml")
        .lines()
        .map(|l| match l.trim_start().strip_prefix("for: ") {
            Some(_) => format!("{}for: 1s", &l[..l.len() - l.trim_start().len()]),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A Prometheus on 127.0.0.1 that scrapes `targets` (job, address) every second and
/// evaluates `rules` every second.
struct Prometheus {
    _proc: tether_testkit::Proc,
    address: String,
    _dir: tether_testkit::TempDir,
}

impl Prometheus {
    /// `https` is the CCM's target: HTTPS (its serving certificate is self-signed) with
    /// a bearer token allowed to read `/metrics`.
    fn start(rules: &str, targets: &[(&str, String)], https: Option<(&str, &str)>) -> Prometheus {
        let dir = tether_testkit::TempDir::new("prometheus");
        std::fs::write(dir.path().join("rules.yaml"), rules).unwrap();
        let mut config = String::from(
            "global: {scrape_interval: 1s, scrape_timeout: 1s, evaluation_interval: 1s}\n\
             rule_files: [rules.yaml]\nscrape_configs:\n",
        );
        for (job, address) in targets {
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs: [{{targets: ['{address}']}}]\n"
            ));
        }
        if let Some((address, token)) = https {
            std::fs::write(dir.path().join("token"), token).unwrap();
            config.push_str(&format!(
                "  - job_name: tether-ccm\n    scheme: https\n    tls_config: {{insecure_skip_verify: true}}\n    \
                 authorization: {{credentials_file: {}}}\n    static_configs: [{{targets: ['{address}']}}]\n",
                dir.path().join("token").display()
            ));
        }
        std::fs::write(dir.path().join("prometheus.yml"), config).unwrap();
        let address = format!("127.0.0.1:{}", tether_testkit::kube::free_port());
        let args: Vec<String> = vec![
            format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ),
            format!("--storage.tsdb.path={}", dir.path().join("data").display()),
            format!("--web.listen-address={address}"),
            "--log.format=json".into(),
        ];
        let proc = tether_testkit::Proc::spawn("prometheus", Path::new("prometheus"), &args);
        let p = Prometheus {
            _proc: proc,
            address,
            _dir: dir,
        };
        p.wait("Prometheus ready", || p.get("/-/ready").map(|_| ()));
        p
    }

    /// GET `path`: the body when the answer is 200.
    fn get(&self, path: &str) -> Option<String> {
        let out = Command::new("curl")
            .args(["-sf", "--max-time", "5"])
            .arg(format!("http://{}{path}", self.address))
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).to_string())
    }

    /// The list at `data.<key>` of the API answer to `path` (empty when it fails).
    fn api_list(&self, path: &str, key: &str) -> Vec<serde_json::Value> {
        let doc: serde_json::Value = self
            .get(path)
            .and_then(|body| serde_json::from_str(&body).ok())
            .unwrap_or_default();
        doc["data"][key].as_array().cloned().unwrap_or_default()
    }

    /// The alerts in `state` (pending or firing) now, as their label sets.
    fn alerts(&self, state: &str) -> Vec<serde_json::Value> {
        self.api_list("/api/v1/alerts", "alerts")
            .into_iter()
            .filter(|a| a["state"] == state)
            .map(|a| a["labels"].clone())
            .collect()
    }

    /// Whether `alertname` fires with the labels in `with`.
    fn firing(&self, alertname: &str, with: &[(&str, &str)]) -> bool {
        self.alerts("firing").iter().any(|labels| {
            labels["alertname"] == alertname && with.iter().all(|(k, v)| labels[*k] == *v)
        })
    }

    /// The instant query `expr`'s result.
    fn query(&self, expr: &str) -> Vec<serde_json::Value> {
        self.api_list(&format!("/api/v1/query?query={}", encode(expr)), "result")
    }

    /// Polls `probe` until it answers, for up to 90 s.
    fn wait<T>(&self, what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(90);
        loop {
            if let Some(v) = probe() {
                return v;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}; alerts now: {:?}",
                self.alerts("firing")
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An agent certificate, as the dev PKI issues it, that expires in `days`.
fn agent_cert_valid_for(pki: &tether_testkit::Pki, days: u32) -> Vec<String> {
    let f = &pki.files;
    let ca = tether_certs::Ca::load(&f.ca_cert, &f.ca_key).unwrap();
    let pair = ca
        .issue(&tether_certs::LeafSpec {
            common_name: "system:konnectivity-agent".into(),
            client: true,
            validity_days: days,
            ..Default::default()
        })
        .unwrap();
    let (cert, key) = tether_certs::write_pair(pki.dir(), "agent-short", &pair).unwrap();
    vec![
        format!("--agent-cert={}", cert.display()),
        format!("--agent-key={}", key.display()),
    ]
}

/// A Lease `kube-system/cloud-controller-manager` held for an hour by a replica
/// Prometheus does not scrape (one on a partitioned node, say).
fn lease_held_elsewhere(cluster: &tether_testkit::kube::Cluster) {
    let now = Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%S.000000Z"])
        .output()
        .unwrap();
    let now = String::from_utf8_lossy(&now.stdout).trim().to_string();
    cluster.apply(&format!(
        "apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata:\n  name: cloud-controller-manager\n  \
         namespace: kube-system\nspec:\n  holderIdentity: elsewhere\n  leaseDurationSeconds: 3600\n  \
         acquireTime: {now}\n  renewTime: {now}\n"
    ));
}

#[test]
fn a_real_prometheus_fires_and_resolves_the_alerts() {
    use tether_testkit::{ccm, kube, process, AgentProc, Pki, ServerProc};
    // A CCM that cannot lead: the lease is held elsewhere.
    let cluster = kube::Cluster::start(&kube::Egress::Direct);
    lease_held_elsewhere(&cluster);
    let (_inventory_dir, inventory) = ccm::inventory_dir();
    ccm::write_inventory(&inventory, "nodes: []\n");
    let ccm_at = format!("127.0.0.1:{}", kube::free_port());
    let ccm_port = ccm_at.rsplit(':').next().unwrap();
    let _ccm = ccm::start_ccm_with(
        Path::new(BIN),
        &cluster,
        &inventory,
        "ccm",
        &[format!("--secure-port={ccm_port}")],
    );
    let reader = ccm::metrics_reader_token(&cluster);

    let pki = Pki::new();
    let bin = Path::new(BIN);
    let server = ServerProc::start(
        bin,
        &process::uds_frontend_args(&pki, "grpc", &process::socket_path(pki.dir())),
    );
    let agent_health = format!("--health-server-port={}", tether_testkit::kube::free_port());
    let mut agent = AgentProc::start(bin, &pki, server.agent, std::slice::from_ref(&agent_health));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(server.wait_agents(1));
    let (server_at, agent_at) = (server.health.to_string(), agent.health.to_string());
    let prometheus = Prometheus::start(
        &rules_for_a_fast_test(),
        &[
            ("konnectivity-server", server_at.clone()),
            ("konnectivity-agent", agent_at.clone()),
        ],
        Some((&ccm_at, &reader)),
    );
    // All three scraped, the recording rules evaluated; the CCM stands by, so the
    // lease has no leader Prometheus can see, and that is the only alert.
    prometheus.wait("three targets up and the agent counted", || {
        let up = prometheus.query("sum(up)");
        let agents = prometheus.query("instance:konnectivity_server_ready_backends:max");
        (up.first()?["value"][1] == "3" && agents.first()?["value"][1] == "1").then_some(())
    });
    prometheus.wait("TetherCCMNoLeader to fire", || {
        prometheus
            .firing("TetherCCMNoLeader", &[("name", "cloud-controller-manager")])
            .then_some(())
    });
    let firing = prometheus.alerts("firing");
    assert_eq!(firing.len(), 1, "only TetherCCMNoLeader fires: {firing:?}");

    // The lease is released: the CCM takes it and the alert resolves.
    cluster.kubectl_ok(&[
        "-n",
        "kube-system",
        "delete",
        "lease",
        "cloud-controller-manager",
    ]);
    prometheus.wait("TetherCCMNoLeader to resolve", || {
        prometheus.alerts("firing").is_empty().then_some(())
    });

    // The agent dies: the server has none, and the alert fires for that server.
    agent.proc.kill();
    prometheus.wait("KonnectivityServerNoAgents to fire", || {
        prometheus
            .firing("KonnectivityServerNoAgents", &[("instance", &server_at)])
            .then_some(())
    });

    // It comes back, with a certificate that expires in a day: the first alert
    // resolves, the certificate's fires.
    let mut args = agent_cert_valid_for(&pki, 1);
    args.push(agent_health);
    let _agent = AgentProc::start(bin, &pki, server.agent, &args);
    prometheus.wait("KonnectivityServerNoAgents to resolve", || {
        (!prometheus.firing("KonnectivityServerNoAgents", &[])).then_some(())
    });
    prometheus.wait("TetherCertificateExpiresCritical to fire", || {
        prometheus
            .firing(
                "TetherCertificateExpiresCritical",
                &[("instance", &agent_at), ("severity", "critical")],
            )
            .then_some(())
    });
    assert!(
        !prometheus.firing("TetherCertificateExpiresSoon", &[]),
        "the warning is for 2 to 14 days only"
    );
}

/// What `KonnectivityAgentConnectFailures` reads: an agent that finds nothing listening
/// where it dials counts `reason="connect"`.
#[test]
fn an_agent_counts_why_it_cannot_reach_a_server() {
    let pki = tether_testkit::Pki::new();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let nowhere = closed.local_addr().unwrap();
    drop(closed);
    let agent = tether_testkit::AgentProc::start(Path::new(BIN), &pki, nowhere, &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let failures = rt.block_on(tether_testkit::wait_until(
        "a connect failure counted",
        std::time::Duration::from_secs(30),
        || async {
            let page = agent.metrics().await;
            tether_testkit::metric(
                &page,
                "tether_agent_server_connect_failures_total{reason=\"connect\"}",
            )
            .filter(|n| *n >= 1.0)
        },
    ));
    assert!(failures >= 1.0);
}

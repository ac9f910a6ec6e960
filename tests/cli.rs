//! Start-up validation: bad flags and bad files fail with one line saying what to fix;
//! upstream manifest flags are accepted.

use std::process::Command;

use tether_testkit::Pki;

const BIN: &str = env!("CARGO_BIN_EXE_tether");
const AGENT_BIN: &str = env!("CARGO_BIN_EXE_tether-agent");

fn run(args: &[&str]) -> (bool, String) {
    run_bin(BIN, args)
}

fn run_bin(bin: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(bin).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn error_line(stderr: &str) -> &str {
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "expected one error line in:\n{stderr}");
    errors[0]
}

#[test]
fn bad_flags_fail_with_one_clear_line() {
    let (ok, err) = run(&["server", "--no-such-flag"]);
    assert!(!ok);
    assert!(error_line(&err).contains("--no-such-flag"), "{err}");
    // Exit code 1, as upstream's binaries exit on a bad command line.
    for bin in [BIN, AGENT_BIN] {
        let status = Command::new(bin).arg("--no-such-flag").status().unwrap();
        assert_eq!(status.code(), Some(1), "{bin}");
    }

    let (ok, err) = run(&["server", "--mode=tcp"]);
    assert!(!ok);
    assert!(err.contains("use grpc or http-connect"), "{err}");

    let (ok, err) = run(&[
        "server",
        "--enable-contention-profiling",
        "--uds-name=/tmp/x.sock",
        "--server-port=0",
    ]);
    assert!(!ok);
    assert!(
        error_line(&err).contains("needs --enable-profiling"),
        "{err}"
    );

    for (args, says) in [
        // Go would serve TLS 1.2 with it; rustls has no CBC suite, so nothing would.
        (
            &["server", "--cipher-suites=TLS_RSA_WITH_AES_128_CBC_SHA"][..],
            "only TLS_RSA_WITH_AES_128_CBC_SHA remain",
        ),
        // Upstream refuses Go's insecure list too.
        (
            &[
                "server",
                "--cipher-suites=TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256",
            ][..],
            "is insecure",
        ),
        (
            &["server", "--tls-min-version=TLS12"][..],
            "--tls-min-version",
        ),
        (
            &["agent", "--no-such-flag=1"][..],
            "unknown flag --no-such-flag",
        ),
        (
            &["server", "--stderrthreshold=LOUD"][..],
            "is not a severity",
        ),
        (&["server", "--vmodule=router"][..], "--vmodule"),
        (
            &["agent", "--server-count-source=min"][..],
            "--server-count-source",
        ),
        (
            &["server", "--", "--require-agent-identity-match"][..],
            "comes after `--`",
        ),
        (
            &["agent", "--dead-link-timeout=1s"][..],
            "--dead-link-timeout must be 0 (kernel defaults) or at least 2s",
        ),
        // The dial policy's flags name the entry and show the forms that work.
        (
            &["agent", "--dial-allow=10.0.0.0/33"][..],
            "--dial-allow \"10.0.0.0/33\": prefix /33 is longer than 32 (e.g. 10.20.0.0/16",
        ),
        (&["agent", "--dial-allow=node"][..], "`node` needs a port"),
        (
            &["agent", "--dial-allow=[fd00::/64]443"][..],
            "expected :PORT after ']'",
        ),
        (
            &["agent", "--service-cidr=10.96.0.0"][..],
            "--service-cidr \"10.96.0.0\": expected ADDRESS/PREFIX",
        ),
        (
            &["agent", "--node-ip=node-1"][..],
            "--node-ip \"node-1\" is not an IP address",
        ),
        (
            &["agent", "--node-name=$(NODE_NAME)"][..],
            "an unexpanded $(NODE_NAME)?",
        ),
        (&["agent", "--dial-policy=none"][..], "--dial-policy"),
        (
            &["agent", "--ready-when=all"][..],
            "'--ready-when <READY_WHEN>' (one of: any-server, every-server)",
        ),
        (
            &["agent", "--dial-policy=node"][..],
            "--dial-policy=node allows nothing without knowing the node",
        ),
    ] {
        let (ok, err) = run(args);
        assert!(!ok);
        assert!(error_line(&err).contains(says), "{args:?}: {err}");
    }

    let (ok, err) = run(&["server", "--agent-namespace=kube-system"]);
    assert!(!ok);
    assert!(error_line(&err).contains("go together"), "{err}");

    let (ok, err) = run(&["server", "--uds-name=/tmp/x.sock"]);
    assert!(!ok);
    assert!(
        error_line(&err).contains("--server-port must be 0"),
        "{err}"
    );

    let (ok, err) = run(&["server", "--server-port=0"]);
    assert!(!ok);
    assert!(error_line(&err).contains("--server-ca-cert"), "{err}");

    // Agents must be authenticated unless the operator says otherwise, loudly.
    let (ok, err) = run(&[
        "server",
        "--uds-name=/tmp/x.sock",
        "--server-port=0",
        "--cluster-cert=a.crt",
        "--cluster-key=a.key",
    ]);
    assert!(!ok);
    assert!(
        error_line(&err).contains("agents are not authenticated")
            && error_line(&err).contains("--unsafe-allow-unauthenticated-agents"),
        "{err}"
    );

    let (ok, err) = run(&[
        "server",
        "--backend-dial-timeout=5",
        "--uds-name=/tmp/x.sock",
        "--server-port=0",
    ]);
    assert!(!ok);
    assert!(err.contains("lacks a unit"), "{err}");

    let (ok, err) = run(&["server", "--proxy-strategies=destHost,nearest"]);
    assert!(!ok);
    assert!(err.contains("unknown proxy strategy \"nearest\""), "{err}");

    let (ok, err) = run(&[
        "server",
        "--proxy-strategies=destHost,default",
        "--watch-node-pod-cidrs",
    ]);
    assert!(!ok);
    assert!(
        error_line(&err).contains("add destCIDR to --proxy-strategies"),
        "{err}"
    );

    // Upstream starts with it (it checks only the kinds): a warning, then the next
    // problem (here the CA file) stops it.
    let (ok, err) = run(&[
        "agent",
        "--agent-identifiers=ipv4=not-an-ip",
        "--ca-cert=/nonexistent/ca.crt",
        "--health-server-port=0",
        "--admin-server-port=0",
    ]);
    assert!(!ok);
    assert!(
        err.contains("ipv4=\"not-an-ip\" is invalid") && err.contains("it is ignored"),
        "{err}"
    );
    assert!(error_line(&err).contains("/nonexistent/ca.crt"), "{err}");

    let (ok, err) = run(&["agent", "--stalled-reader-timeout=0s"]);
    assert!(!ok);
    assert!(
        error_line(&err).contains("--stalled-reader-timeout"),
        "{err}"
    );

    let (ok, err) = run(&["ccm"]);
    assert!(!ok);
    assert!(error_line(&err).contains("--cloud-config"), "{err}");

    let dir = tether_testkit::TempDir::new("tether-cli-ccm");
    let inventory = dir.path().join("inventory.yaml");
    std::fs::write(&inventory, "nodes:\n- name: a\n  zones: typo\n").unwrap();
    let cloud_config = format!("--cloud-config={}", inventory.display());
    let (ok, err) = run(&["ccm", &cloud_config]);
    assert!(!ok);
    assert!(error_line(&err).contains("zones"), "{err}");

    std::fs::write(&inventory, "nodes: []\n").unwrap();
    let (ok, err) = run(&["ccm", &cloud_config, "--controllers=*,route"]);
    assert!(!ok);
    assert!(error_line(&err).contains("--cluster-cidr"), "{err}");

    let (ok, err) = run(&["ccm", &cloud_config, "--cluster-cidr=10.244.0.0/33"]);
    assert!(!ok);
    assert!(error_line(&err).contains("--cluster-cidr"), "{err}");

    std::fs::write(
        &inventory,
        "agents: {urls: [\"https://10.0.0.1/agents\"]}\n",
    )
    .unwrap();
    let (ok, err) = run(&["ccm", &cloud_config]);
    assert!(!ok);
    assert!(error_line(&err).contains("agents.caFile"), "{err}");
    std::fs::write(&inventory, "agents: {urls: [\"ftp://10.0.0.1/agents\"]}\n").unwrap();
    let (ok, err) = run(&["ccm", &cloud_config]);
    assert!(!ok);
    assert!(error_line(&err).contains("admin port"), "{err}");
    std::fs::write(&inventory, "nodes: []\n").unwrap();

    let (ok, err) = run(&["ccm", &cloud_config, "--lb-bind-address=127.0.0.1"]);
    assert!(!ok);
    assert!(error_line(&err).contains("needs --tunnel-uds"), "{err}");
    // (--tunnel-uds without pools: load balancers are off, not an error; the shipped
    // manifest is that way until the operator adds pools.)
    // Pools: checked at start-up, and not mixed with --lb-bind-address.
    let pools = "loadBalancer:\n  interface: eth0\n  pools:\n  - {name: a, addresses: [192.0.2.10-192.0.2.20]}\n";
    std::fs::write(&inventory, pools).unwrap();
    let (ok, err) = run(&["ccm", &cloud_config]);
    assert!(!ok);
    assert!(
        error_line(&err).contains("--tunnel-uds is not set"),
        "{err}"
    );
    let (ok, err) = run(&[
        "ccm",
        &cloud_config,
        "--tunnel-uds=/tmp/x.sock",
        "--lb-bind-address=127.0.0.1",
    ]);
    assert!(!ok);
    assert!(error_line(&err).contains("drop --lb-bind-address"), "{err}");
    std::fs::write(
        &inventory,
        "loadBalancer:\n  pools:\n  - {name: a, addresses: [192.0.2.0/24]}\n  - {name: b, addresses: [192.0.2.7]}\n",
    )
    .unwrap();
    let (ok, err) = run(&["ccm", &cloud_config, "--tunnel-uds=/tmp/x.sock"]);
    assert!(!ok);
    assert!(error_line(&err).contains("overlaps"), "{err}");
    std::fs::write(&inventory, "nodes: []\n").unwrap();
    let (ok, err) = run(&[
        "ccm",
        &cloud_config,
        "--lb-bind-address=0.0.0.0",
        "--tunnel-uds=/tmp/x.sock",
    ]);
    assert!(!ok);
    assert!(error_line(&err).contains("clients can reach"), "{err}");

    let (ok, err) = run(&["ccm", &cloud_config, "--kube-api-qps=0"]);
    assert!(!ok);
    assert!(error_line(&err).contains("--kube-api-qps"), "{err}");

    // Upstream flags: node IPAM is kube-controller-manager's; names are checked.
    let (ok, err) = run(&["ccm", &cloud_config, "--allocate-node-cidrs=true"]);
    assert!(!ok);
    assert!(
        error_line(&err).contains("kube-controller-manager"),
        "{err}"
    );
    let (ok, err) = run(&[
        "ccm",
        &cloud_config,
        "--controllers=*,-cloud-node-controllers",
    ]);
    assert!(!ok);
    assert!(error_line(&err).contains("cloud-node-controller"), "{err}");
    // The old agent grace period is refused with what replaced it.
    std::fs::write(
        &inventory,
        "agents: {urls: [\"http://127.0.0.1:8133/agents\"], gracePeriodSeconds: 600}\n",
    )
    .unwrap();
    let (ok, err) = run(&["ccm", &cloud_config]);
    assert!(!ok);
    assert!(
        error_line(&err).contains("deleteNodesAfterSeconds"),
        "{err}"
    );
    std::fs::write(
        &inventory,
        "nodes:\n- name: a\n  labels: {node-role.kubernetes.io/edge: \"\"}\n",
    )
    .unwrap();
    let (ok, err) = run(&["ccm", &cloud_config]);
    assert!(!ok);
    assert!(error_line(&err).contains("reserved domain"), "{err}");

    let (ok, err) = run(&[
        "server",
        "--uds-name=/tmp/x.sock",
        "--server-port=0",
        "--uds-socket-mode=rw",
    ]);
    assert!(!ok);
    assert!(error_line(&err).contains("--uds-socket-mode"), "{err}");
    let (ok, err) = run(&[
        "server",
        "--uds-name=/tmp/x.sock",
        "--server-port=0",
        "--uds-socket-group=wheel",
    ]);
    assert!(!ok);
    assert!(error_line(&err).contains("numeric group"), "{err}");
}

#[test]
fn bad_certificates_name_the_file() {
    let pki = Pki::new();
    let f = &pki.files;
    let socket = pki.dir().join("s.sock");
    let missing = pki.dir().join("missing.crt");
    let (ok, err) = run(&[
        "server",
        "--health-port=0",
        "--admin-port=0",
        "--agent-port=0",
        "--server-port=0",
        &format!("--uds-name={}", socket.display()),
        &format!("--cluster-cert={}", missing.display()),
        &format!("--cluster-key={}", f.server_key.display()),
        &format!("--cluster-ca-cert={}", f.ca_cert.display()),
    ]);
    assert!(!ok);
    let line = error_line(&err);
    assert!(
        line.contains("missing.crt") && line.contains("cannot read"),
        "{line}"
    );

    // A key that does not belong to the certificate.
    let (ok, err) = run(&[
        "server",
        "--health-port=0",
        "--admin-port=0",
        "--agent-port=0",
        "--server-port=0",
        &format!("--uds-name={}", socket.display()),
        &format!("--cluster-cert={}", f.server_cert.display()),
        &format!("--cluster-key={}", f.agent_key.display()),
        &format!("--cluster-ca-cert={}", f.ca_cert.display()),
    ]);
    assert!(!ok);
    let line = error_line(&err);
    assert!(
        line.contains("server.crt") && line.contains("agent.key"),
        "{line}"
    );

    // A certificate file that holds no certificate.
    let (ok, err) = run(&[
        "agent",
        "--health-server-port=0",
        "--admin-server-port=0",
        &format!("--ca-cert={}", f.server_key.display()),
    ]);
    assert!(!ok);
    assert!(error_line(&err).contains("holds no CERTIFICATE"), "{err}");
}

#[test]
fn agent_only_binary_validates_like_tether_agent() {
    let pki = Pki::new();
    let f = &pki.files;

    let (ok, err) = run_bin(
        AGENT_BIN,
        &[
            "--health-server-port=0",
            "--admin-server-port=0",
            &format!("--ca-cert={}", f.server_key.display()),
        ],
    );
    assert!(!ok);
    assert!(error_line(&err).contains("holds no CERTIFICATE"), "{err}");

    // Arguments that are not flags are ignored with a warning, as upstream's
    // proxy-agent ignores them.
    let (ok, err) = run_bin(
        AGENT_BIN,
        &[
            "server",
            "--health-server-port=0",
            "--admin-server-port=0",
            &format!("--ca-cert={}", f.server_key.display()),
        ],
    );
    assert!(!ok);
    assert!(
        err.contains("ignoring arguments that are not flags"),
        "{err}"
    );
    assert!(error_line(&err).contains("holds no CERTIFICATE"), "{err}");

    let out = Command::new(AGENT_BIN).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        help.contains("Konnectivity agent")
            && help.contains("Usage: tether-agent")
            && help.contains("--proxy-server-host"),
        "{help}"
    );
}

#[test]
fn upstream_manifest_flags_are_accepted() {
    let pki = Pki::new();
    let f = &pki.files;
    let socket = pki.dir().join("s.sock");
    let args: Vec<String> = vec![
        "server".into(),
        "--log-format=json".into(),
        "--logtostderr=true".into(),
        "--alsologtostderr".into(),
        "--v=4".into(),
        "--delete-existing-uds-file".into(),
        "--mode=grpc".into(),
        "--server-port=0".into(),
        "--agent-port=0".into(),
        "--admin-port=0".into(),
        "--health-port=0".into(),
        format!("--uds-name={}", socket.display()),
        format!("--cluster-cert={}", f.server_cert.display()),
        format!("--cluster-key={}", f.server_key.display()),
        format!("--cluster-ca-cert={}", f.ca_cert.display()),
        "--keepalive-time=1h".into(),
        "--frontend-keepalive-time=1h".into(),
        "--proxy-strategies=destHost,default".into(),
        "--server-count=1".into(),
        "--lease-namespace=kube-system".into(),
    ];
    let proc = tether_testkit::Proc::spawn("server", std::path::Path::new(BIN), &args);
    proc.wait_event(
        "server listening",
        std::time::Duration::from_secs(20),
        |_| true,
    );
    // --log-format=json took effect on stderr (klog's flags did not swallow it).
    assert!(proc.logged("\"message\":\"server listening\""));
}

/// Values Tether used to refuse start with upstream's meaning: stray positional
/// arguments (ignored with a warning), `--keepalive-time=0` and
/// `--frontend-keepalive-time=0` (grpc-go's defaults), `--server-count=0` (the count is
/// unknown: agents keep looking for servers), an empty `--server-count-source`, and
/// `--vmodule` globs and Go file names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_upstream_accepts_start_with_upstreams_meaning() {
    use std::time::Duration;
    use tether_testkit::process::{socket_path, uds_frontend_args};
    use tether_testkit::{AgentProc, ServerProc};
    let pki = Pki::new();
    let mut args = uds_frontend_args(&pki, "grpc", &socket_path(pki.dir()));
    args.extend(
        [
            "--keepalive-time=0",
            "--frontend-keepalive-time=0",
            "--server-count=0",
            "--vmodule=server*=5,pkg/server/backend_manager.go=4,rout?r=4",
            "stray",
        ]
        .map(String::from),
    );
    let server = ServerProc::start(std::path::Path::new(BIN), &args);
    assert!(server.proc.logged("ignoring arguments that are not flags"));
    assert!(
        server.proc.logged("pkg/server/backend_manager.go"),
        "the unmatched pattern is named"
    );
    let agent = AgentProc::start(
        std::path::Path::new(BIN),
        &pki,
        server.agent,
        &[
            "--keepalive-time=0".into(),
            "--server-count-source=".into(),
            "--sync-interval=200ms".into(),
            "--sync-interval-cap=200ms".into(),
            "another".into(),
        ],
    );
    server.wait_agents(1).await;
    assert!(agent.proc.logged("pinging every 10s"));
    assert!(agent.proc.logged("ignoring arguments that are not flags"));
    // A count of 0 is unknown: holding the one server, the agent still looks for
    // more (and closes the duplicates it reaches), as upstream's agent does.
    let ev = agent
        .proc
        .wait_event("connected to proxy server", Duration::from_secs(10), |_| {
            true
        });
    assert_eq!(ev["server_count"], 0, "{ev}");
    agent.proc.wait_event(
        "reached a server this agent is already connected to; closing the duplicate stream and retrying",
        Duration::from_secs(20),
        |_| true,
    );
    let page = agent.metrics().await;
    assert_eq!(
        tether_testkit::metric(&page, "konnectivity_network_proxy_agent_known_server_count"),
        Some(0.0),
        "{page}"
    );
}

/// The soft and hard open-file limits of process `pid`, from `/proc/PID/limits`.
fn open_file_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap_or_else(|| panic!("no open-file limit in {limits}"));
    let f: Vec<&str> = line.split_whitespace().collect();
    (f[3].to_string(), f[4].to_string())
}

/// Under a soft limit of 256 and a hard one of 4,096 (what `prlimit` sets, as a systemd
/// unit's 1,024:524,288 would), the server and the agent raise the soft limit to the
/// hard one at start-up, as Go programs such as upstream's do, and the server warns
/// that 4,096 descriptors are few for a large cluster. Both then work.
#[test]
fn both_binaries_raise_the_open_file_limit_to_the_hard_limit() {
    use std::time::Duration;
    use tether_testkit::process::{socket_path, uds_frontend_args};
    use tether_testkit::{AgentProc, ServerProc};
    const WAIT: Duration = Duration::from_secs(20);
    const RAISED: &str = "raised the open-file soft limit to the hard limit";
    let pki = Pki::new();
    let args = uds_frontend_args(&pki, "grpc", &socket_path(pki.dir()));
    let server = ServerProc::start_with_open_files(std::path::Path::new(BIN), &args, (256, 4096));
    let raised = server.proc.wait_event(RAISED, WAIT, |_| true);
    assert_eq!(
        (raised["was"].as_u64(), raised["now"].as_u64()),
        (Some(256), Some(4096))
    );
    let low = server.proc.wait_event("the open-file limit is low: every agent stream and every tunnel holds a descriptor; raise the hard limit (LimitNOFILE= in a systemd unit, the container runtime's nofile ulimit) for clusters of more than a few thousand nodes", WAIT, |_| true);
    assert_eq!(low["limit"].as_u64(), Some(4096));
    assert_eq!(
        open_file_limits(server.proc.pid()),
        ("4096".into(), "4096".into())
    );

    let agent = AgentProc::start_with_open_files(
        std::path::Path::new(AGENT_BIN),
        &pki,
        server.agent,
        &[],
        (256, 4096),
    );
    let agent = &agent.proc;
    let raised = agent.wait_event(RAISED, WAIT, |_| true);
    assert_eq!(
        (raised["was"].as_u64(), raised["now"].as_u64()),
        (Some(256), Some(4096))
    );
    agent.wait_event("connected to proxy server", WAIT, |_| true);
    assert_eq!(
        open_file_limits(agent.pid()),
        ("4096".into(), "4096".into())
    );
    // Only the server warns; 4,096 descriptors are plenty for a node's tunnels.
    assert!(
        !agent.logged("the open-file limit is low"),
        "{}",
        agent.log_text()
    );
}

/// What `bin args` writes on stderr until its health port `port` answers.
fn stderr_until_healthy(bin: &str, args: &[String], port: u16) -> String {
    let dir = tether_testkit::TempDir::new("tether-cli-stderr");
    let stderr = dir.path().join("stderr");
    let mut child = Command::new(bin)
        .args(args)
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "{bin} exited: {}",
            std::fs::read_to_string(&stderr).unwrap_or_default()
        );
        assert!(std::time::Instant::now() < deadline, "no health port");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    std::fs::read_to_string(stderr).unwrap()
}

/// What an agent that cannot reach its server writes on stderr until its health port
/// answers, with `extra` flags.
fn agent_stderr_until_healthy(extra: &[&str]) -> String {
    let pki = Pki::new();
    let port = tether_testkit::kube::free_port();
    let mut args: Vec<String> = vec![
        "--proxy-server-host=127.0.0.1".into(),
        "--proxy-server-port=1".into(),
        "--health-server-host=127.0.0.1".into(),
        format!("--health-server-port={port}"),
        "--admin-server-port=0".into(),
        format!("--ca-cert={}", pki.files.ca_cert.display()),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    stderr_until_healthy(AGENT_BIN, &args, port)
}

/// `--kubeconfig` where neither binary reads it starts both, with a warning that says
/// so (upstream accepts it silently). A server whose agents use certificates reads it
/// (to watch Nodes), and fails at start-up when it cannot.
#[test]
fn an_unused_kubeconfig_is_accepted_with_a_warning() {
    let agent = agent_stderr_until_healthy(&["--kubeconfig=/nonexistent/kubeconfig"]);
    assert!(agent.contains("--kubeconfig is unused"), "{agent}");
    let pki = Pki::new();
    let f = &pki.files;
    let port = tether_testkit::kube::free_port();
    let server = stderr_until_healthy(
        BIN,
        &[
            "server".to_string(),
            format!("--uds-name={}", pki.dir().join("s.sock").display()),
            "--server-port=0".into(),
            "--agent-port=0".into(),
            "--admin-port=0".into(),
            format!("--health-port={port}"),
            format!("--cluster-cert={}", f.server_cert.display()),
            format!("--cluster-key={}", f.server_key.display()),
            // With agent certificates (--cluster-ca-cert) the server watches Nodes with
            // the kubeconfig, so it must be usable; without agent authentication nothing
            // reads it.
            "--unsafe-allow-unauthenticated-agents".into(),
            "--kubeconfig=/nonexistent/kubeconfig".into(),
        ],
        port,
    );
    assert!(server.contains("--kubeconfig is unused"), "{server}");
}

/// klog's `--legacy-stderr-threshold-behavior=false` applies `--stderrthreshold` to
/// standard error with `--logtostderr` on: the start-up INFO line is not written.
#[test]
fn stderrthreshold_applies_to_stderr_when_legacy_behaviour_is_off() {
    let legacy = agent_stderr_until_healthy(&["--stderrthreshold=ERROR"]);
    assert!(legacy.contains("agent starting"), "{legacy}");
    let honoured = agent_stderr_until_healthy(&[
        "--stderrthreshold=ERROR",
        "--legacy-stderr-threshold-behavior=false",
    ]);
    assert!(!honoured.contains("agent starting"), "{honoured}");
}

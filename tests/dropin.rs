//! Drop-in for upstream command lines: every flag of upstream's proxy-server and
//! proxy-agent (v0.36.0 and main, klog's included, upstream defaults written out) starts
//! Tether; the flags with behaviour do what upstream's do (log file, TLS policy, ALPN,
//! pprof); both /metrics pages carry every upstream metric name and label set.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tether_client::Client;
use tether_testkit::process::{socket_path, Proc};
use tether_testkit::{backend, metric, wait_until, AgentProc, Pki, ServerProc, TempDir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

/// klog's flags, as both upstream binaries register them, with klog's defaults.
const KLOG: [&str; 16] = [
    "--v=4",
    "--vmodule=",
    "--logtostderr=true",
    "--alsologtostderr=false",
    "--log-dir=",
    "--log-file=",
    "--log-file-max-size=1800",
    "--add-dir-header=false",
    "--skip-headers=false",
    "--skip-log-headers=false",
    "--one-output=false",
    "--stderrthreshold=2",
    "--alsologtostderrthreshold=INFO",
    "--legacy-stderr-threshold-behavior=true",
    "--log-backtrace-at=:0",
    "--log-flush-frequency=5s",
];

/// Upstream proxy-server's flags with their defaults (ports, certificates and the
/// socket are this test's).
fn server_flags(pki: &Pki, socket: &Path) -> Vec<String> {
    let f = &pki.files;
    let mut flags: Vec<String> = [
        "--mode=grpc",
        "--delete-existing-uds-file=true",
        "--server-port=0",
        "--server-bind-address=",
        "--server-cert=",
        "--server-key=",
        "--server-ca-cert=",
        "--frontend-keepalive-time=1h",
        "--agent-port=0",
        "--agent-bind-address=127.0.0.1",
        "--cluster-ca-cert=",
        "--keepalive-time=1h",
        "--agent-namespace=",
        "--agent-service-account=",
        "--authentication-audience=",
        "--kubeconfig=",
        "--kubeconfig-qps=0",
        "--kubeconfig-burst=0",
        "--kube-api-content-type=application/vnd.kubernetes.protobuf",
        "--server-id=",
        "--server-count=1",
        "--enable-lease-controller=false",
        "--lease-namespace=kube-system",
        "--lease-label=k8s-app=konnectivity-server",
        "--proxy-strategies=destHost,default",
        "--backend-dial-timeout=0s",
        "--xfr-channel-size=10",
        "--frontend-write-channel-size=10",
        "--cipher-suites=",
        "--tls-min-version=",
        "--health-port=0",
        "--health-bind-address=127.0.0.1",
        "--admin-port=0",
        "--admin-bind-address=127.0.0.1",
        "--enable-profiling=false",
        "--enable-contention-profiling=false",
        "--graceful-shutdown-timeout=0s",
        "--warn-on-channel-limit=true",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    flags.extend(KLOG.iter().map(|s| s.to_string()));
    flags.push(format!("--uds-name={}", socket.display()));
    flags.push(format!("--cluster-cert={}", f.server_cert.display()));
    flags.push(format!("--cluster-key={}", f.server_key.display()));
    // Agents must be authenticated (upstream's default accepts any): the last value of
    // a repeated flag wins, as with Go's pflag (the empty default stays before it).
    flags.push(format!("--cluster-ca-cert={}", f.ca_cert.display()));
    flags
}

/// Upstream proxy-agent's flags with their defaults (server address and certificates
/// are this test's). `--alpn-proto=konnectivity` is offered besides h2.
fn agent_flags(pki: &Pki, server: std::net::SocketAddr, lease_flag: &str) -> Vec<String> {
    let f = &pki.files;
    let mut flags: Vec<String> = [
        "--alpn-proto=konnectivity",
        "--service-account-token-path=",
        "--agent-id=dropin",
        "--agent-identifiers=host=dropin&ipv4=127.0.0.1",
        "--sync-interval=1s",
        "--sync-interval-cap=10s",
        "--probe-interval=1s",
        "--sync-forever=false",
        "--keepalive-time=1h",
        "--xfr-channel-size=150",
        "--count-server-leases=false",
        "--lease-namespace=kube-system",
        "--server-count-source=default",
        "--kubeconfig=",
        "--health-server-host=127.0.0.1",
        "--health-server-port=0",
        "--admin-bind-address=127.0.0.1",
        "--admin-server-port=0",
        "--enable-profiling=true",
        "--enable-contention-profiling=false",
        "--kube-api-content-type=application/vnd.kubernetes.protobuf",
        "--warn-on-channel-limit=true",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    flags.extend(KLOG.iter().map(|s| s.to_string()));
    flags.push(format!("{lease_flag}=k8s-app=konnectivity-server"));
    flags.push(format!("--proxy-server-host={}", server.ip()));
    flags.push(format!("--proxy-server-port={}", server.port()));
    flags.push(format!("--ca-cert={}", f.ca_cert.display()));
    flags.push(format!("--agent-cert={}", f.agent_cert.display()));
    flags.push(format!("--agent-key={}", f.agent_key.display()));
    flags
}

/// The standard process metrics every Go binary exports.
fn assert_process_metrics(page: &str) {
    for name in [
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        assert!(
            metric(page, name).is_some(),
            "/metrics lacks {name}:\n{page}"
        );
    }
}

async fn get(addr: std::net::SocketAddr, path: &str) -> String {
    tether_testkit::http_get(addr, path)
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
        .1
}

/// Every upstream flag starts both; the agent (offering `konnectivity` and h2) connects;
/// after traffic, both /metrics pages carry every upstream metric name with its labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_upstream_flag_starts_tether_and_every_upstream_metric_is_served() {
    let pki = Pki::new();
    let socket = socket_path(pki.dir());
    let server = ServerProc::start(Path::new(BIN), &server_flags(&pki, &socket));
    let agent = AgentProc::start(
        Path::new(BIN),
        &pki,
        server.agent,
        &agent_flags(&pki, server.agent, "--lease-label-selector"),
    );
    server.wait_agents(1).await;
    // v0.36.0's name for the selector.
    let _agent2 = AgentProc::start(
        Path::new(BIN),
        &pki,
        server.agent,
        &agent_flags(&pki, server.agent, "--lease-label")
            .into_iter()
            .map(|a| {
                if a == "--agent-id=dropin" {
                    "--agent-id=dropin-2".into()
                } else {
                    a
                }
            })
            .collect::<Vec<_>>(),
    );
    server.wait_agents(2).await;

    let echo = backend::echo().await;
    let client = Client::uds(&socket).await.unwrap();
    for _ in 0..3 {
        let mut c = client.dial(&echo.addr.to_string()).await.unwrap();
        c.write_all(b"ping").await.unwrap();
        let mut b = [0u8; 4];
        c.read_exact(&mut b).await.unwrap();
    }
    wait_until("connections closed", Duration::from_secs(10), || async {
        let page = server.metrics().await;
        (metric(
            &page,
            "konnectivity_network_proxy_server_established_connections",
        ) == Some(0.0))
        .then_some(())
    })
    .await;

    let page = server.metrics().await;
    let p = "konnectivity_network_proxy_server_";
    for sample in [
        format!("{p}dial_duration_seconds_count"),
        format!("{p}frontend_write_duration_seconds_count"),
        format!("{p}connection_duration_seconds_count"),
        format!(r#"{p}grpc_connections{{service_method="Proxy"}}"#),
        format!("{p}http_connections"),
        format!(r#"{p}ready_backends{{proxy_strategy="destHost"}}"#),
        format!(r#"{p}ready_backends{{proxy_strategy="default"}}"#),
        format!("{p}ready_backend_connections"),
        format!("{p}pending_backend_dials"),
        format!("{p}established_connections"),
        format!(r#"{p}full_receive_channels{{service_method="Proxy"}}"#),
        format!(r#"{p}dial_failure_count{{reason="no_agent"}}"#),
        format!(r#"{p}stream_packets_total{{packet_type="DIAL_REQ",segment="from_client"}}"#),
        format!(r#"{p}stream_packets_total{{packet_type="DIAL_RSP",segment="from_agent"}}"#),
    ] {
        assert!(
            metric(&page, &sample).is_some(),
            "server /metrics lacks {sample}:\n{page}"
        );
    }
    assert_process_metrics(&page);
    assert_eq!(
        metric(
            &page,
            &format!(r#"{p}ready_backends{{proxy_strategy="default"}}"#)
        ),
        Some(2.0)
    );
    assert_eq!(
        metric(&page, &format!("{p}connection_duration_seconds_count")),
        Some(3.0)
    );

    let page = get(agent.health, "/metrics").await;
    let a = "konnectivity_network_proxy_agent_";
    for sample in [
        format!("{a}dial_duration_seconds_count"),
        format!(r#"{a}endpoint_dial_failure_total{{reason="timeout"}}"#),
        format!("{a}open_server_connections"),
        format!("{a}known_server_count"),
        format!("{a}open_endpoint_connections"),
        format!(r#"{a}stream_packets_total{{packet_type="DIAL_REQ",segment="to_agent"}}"#),
        format!(r#"{a}stream_packets_total{{packet_type="DIAL_RSP",segment="from_agent"}}"#),
    ] {
        assert!(
            metric(&page, &sample).is_some(),
            "agent /metrics lacks {sample}:\n{page}"
        );
    }
    assert_process_metrics(&page);
    // stream_errors_total and server_connection_failure_count appear with their first
    // error, as in client_golang.
}

/// Upstream's example server manifest line: the log goes to the file, not stderr.
#[test]
fn the_upstream_log_file_line_writes_the_log_there() {
    let pki = Pki::new();
    let dir = TempDir::new("tether-log");
    let log = dir.path().join("konnectivity-server.log");
    let f = &pki.files;
    let health = tether_testkit::kube::free_port();
    let proc = Proc::spawn(
        "server",
        Path::new(BIN),
        &[
            "server".into(),
            format!("--uds-name={}", socket_path(pki.dir()).display()),
            "--server-port=0".into(),
            "--agent-port=0".into(),
            "--admin-port=0".into(),
            format!("--health-port={health}"),
            "--health-bind-address=127.0.0.1".into(),
            format!("--cluster-cert={}", f.server_cert.display()),
            format!("--cluster-key={}", f.server_key.display()),
            format!("--cluster-ca-cert={}", f.ca_cert.display()),
            format!("--log-file={}", log.display()),
            "--log-file-max-size=0".into(),
            "--logtostderr=false".into(),
        ],
    );
    let text = tether_testkit::kube::wait_blocking(
        "the log file names the listening server",
        Duration::from_secs(20),
        || {
            std::fs::read_to_string(&log)
                .ok()
                .filter(|t| t.contains("server listening"))
        },
    );
    assert!(text.contains("INFO"), "{text}");
    assert!(
        !proc.logged("server listening"),
        "with --logtostderr=false INFO lines must not reach stderr"
    );
}

/// `openssl s_client` against the agent listener: does the handshake succeed?
fn handshake(pki: &Pki, port: u16, args: &[&str]) -> bool {
    let f = &pki.files;
    let out = Command::new("openssl")
        .args(["s_client", "-connect", &format!("127.0.0.1:{port}")])
        .arg("-cert")
        .arg(&f.agent_cert)
        .arg("-key")
        .arg(&f.agent_key)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("openssl runs");
    let text = String::from_utf8_lossy(&out.stdout);
    out.status.success() && text.contains("Cipher is") && !text.contains("Cipher is (NONE)")
}

/// `--tls-min-version=VersionTLS13` refuses a TLS 1.2 client; `--cipher-suites`
/// offers exactly the TLS 1.2 suites named (Go's names), TLS 1.3 always.
#[test]
fn tls_flags_choose_versions_and_suites() {
    let pki = Pki::new();
    let f = &pki.files;
    let start = |extra: &[&str]| {
        let mut args = vec![
            format!("--uds-name={}", socket_path(pki.dir()).display()),
            "--server-port=0".into(),
            format!("--cluster-cert={}", f.server_cert.display()),
            format!("--cluster-key={}", f.server_key.display()),
            format!("--cluster-ca-cert={}", f.ca_cert.display()),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        ServerProc::start(Path::new(BIN), &args)
    };
    let tls13 = start(&["--tls-min-version=VersionTLS13"]);
    let port = tls13.agent.port();
    assert!(handshake(&pki, port, &["-tls1_3"]));
    assert!(!handshake(&pki, port, &["-tls1_2"]), "TLS 1.2 accepted");
    drop(tls13);

    let suites = start(&["--cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256"]);
    let port = suites.agent.port();
    assert!(handshake(
        &pki,
        port,
        &["-tls1_2", "-cipher", "ECDHE-ECDSA-AES128-GCM-SHA256"]
    ));
    assert!(
        !handshake(
            &pki,
            port,
            &["-tls1_2", "-cipher", "ECDHE-ECDSA-AES256-GCM-SHA384"]
        ),
        "a suite not listed was accepted"
    );
    assert!(handshake(
        &pki,
        port,
        &["-tls1_3", "-ciphersuites", "TLS_AES_256_GCM_SHA384"]
    ));
}

/// `--enable-profiling`: the server's admin port serves CPU and heap profiles that Go's
/// own pprof reads.
#[test]
fn the_cpu_and_heap_profiles_are_read_by_go_pprof() {
    let go = ["/usr/lib/go-1.19/bin/go", "/usr/local/go/bin/go", "go"]
        .into_iter()
        .find(|g| Command::new(g).arg("version").output().is_ok())
        .expect("Go is installed by scripts/install-kube.sh");
    let pki = Pki::new();
    let f = &pki.files;
    let server = ServerProc::start(
        Path::new(BIN),
        &[
            format!("--uds-name={}", socket_path(pki.dir()).display()),
            "--server-port=0".into(),
            format!("--cluster-cert={}", f.server_cert.display()),
            format!("--cluster-key={}", f.server_key.display()),
            format!("--cluster-ca-cert={}", f.ca_cert.display()),
            "--enable-profiling".into(),
        ],
    );
    let dir = TempDir::new("tether-pprof");
    // Fetches a profile with curl and has Go's pprof print it raw.
    let read = |path: &str, file: &str| -> String {
        let file = dir.path().join(file);
        let url = format!("http://{}{path}", server.admin);
        let out = Command::new("curl")
            .args(["-sf", "-o", file.to_str().unwrap(), &url])
            .output()
            .unwrap();
        assert!(out.status.success(), "GET {url} failed");
        let out = Command::new(go)
            .args(["tool", "pprof", "-raw", file.to_str().unwrap()])
            .env("HOME", dir.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "go tool pprof could not read {url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = read("/debug/pprof/profile?seconds=1", "cpu.pb");
    assert!(text.contains("PeriodType: cpu"), "{text}");
    // The CPU profiler (pprof-rs) keeps its sample table (about 64 MiB) from its first
    // profile on; what the heap profile leaves is measured from here.
    let after_cpu = heap_inuse(server.health);

    // Allocate some megabytes in the server (each scrape renders the metrics page),
    // then read the sampled heap.
    let metrics = format!("http://{}/metrics", server.health);
    let scrapes: Vec<&str> = std::iter::repeat_n(metrics.as_str(), 400).collect();
    let out = Command::new("curl")
        .arg("-sf")
        .args(&scrapes)
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = read("/debug/pprof/heap", "heap.pb");
    assert!(
        text.contains("PeriodType: space bytes")
            && text.contains("inuse_space/bytes")
            && text.contains("prometheus"),
        "{text}"
    );

    // Resolving the profile's addresses parsed the binary's debug info (tens of MiB,
    // hundreds in a debug build): none of it stays once the profile is written.
    let grown = heap_inuse(server.health) - after_cpu;
    assert!(
        grown < (16 << 20) as f64,
        "{:.1} MiB more heap in use after the heap profile was written",
        grown / (1 << 20) as f64
    );
}

/// The server's `tether_heap_inuse_bytes`.
fn heap_inuse(health: std::net::SocketAddr) -> f64 {
    let url = format!("http://{health}/metrics");
    let out = Command::new("curl").args(["-sf", &url]).output().unwrap();
    metric(
        &String::from_utf8_lossy(&out.stdout),
        "tether_heap_inuse_bytes",
    )
    .expect("tether_heap_inuse_bytes on /metrics")
}

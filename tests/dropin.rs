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
const AGENT_BIN: &str = env!("CARGO_BIN_EXE_tether-agent");

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
    let agent2 = AgentProc::start(
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

    // The server spreads the dials over both agents: the DIAL_REQ series appear on
    // whichever served one (all three may have gone to either).
    let a = "konnectivity_network_proxy_agent_";
    let mut page = String::new();
    for health in [agent.health, agent2.health] {
        page = get(health, "/metrics").await;
        if metric(&page, &format!("{a}dial_duration_seconds_count")).unwrap_or(0.0) > 0.0 {
            break;
        }
    }
    for sample in [
        format!("{a}dial_duration_seconds_count"),
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
    // stream_errors_total, server_connection_failure_count, dial failures and full
    // receive channels appear with their first use, as client_golang's vectors do
    // (the_metric_series_are_upstreams compares every series with upstream's).
}

/// Series identities (`name{labels sorted}`) of a /metrics page, in the families
/// upstream's binaries share with Tether's (`konnectivity_network_proxy_*`, `process_*`,
/// `promhttp_*`).
fn series(page: &str) -> std::collections::BTreeSet<String> {
    page.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.rsplit_once(' ').map(|(id, _)| id))
        .filter(|id| {
            ["konnectivity_network_proxy_", "process_", "promhttp_"]
                .iter()
                .any(|p| id.starts_with(p))
        })
        .map(|id| match id.split_once('{') {
            None => id.to_string(),
            Some((name, labels)) => {
                let mut pairs: Vec<&str> = labels.trim_end_matches('}').split("\",").collect();
                pairs.sort();
                let pairs: Vec<String> = pairs
                    .iter()
                    .map(|p| p.trim_end_matches('"').to_string() + "\"")
                    .collect();
                format!("{name}{{{}}}", pairs.join(","))
            }
        })
        .collect()
}

/// The golden file's series.
fn golden(name: &str) -> std::collections::BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(str::to_string)
        .collect()
}

/// `ours` against upstream's `golden` series: nothing missing, and nothing extra but the
/// documented Tether additions in those families.
fn diff_series(
    what: &str,
    ours: &std::collections::BTreeSet<String>,
    golden: &std::collections::BTreeSet<String>,
) {
    // Documented differences (docs/upstream-differences.md): the Rust process collector's
    // thread count, and WINDOW_UPDATE, a packet only Tether peers exchange.
    let allowed = |s: &str| s == "process_threads" || s.contains("packet_type=\"WINDOW_UPDATE\"");
    let missing: Vec<_> = golden.difference(ours).collect();
    let extra: Vec<_> = ours.difference(golden).filter(|s| !allowed(s)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{what} /metrics differs from upstream's series.\nmissing: {missing:#?}\nextra: {extra:#?}"
    );
}

/// After the same traffic as the golden files describe, the server's and the agent's
/// /metrics carry exactly upstream's series: the same names, labels, label values,
/// buckets (`le` spelt as Go spells it), and no zero series created ahead of use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metric_series_are_upstreams() {
    let pki = Pki::new();
    let f = &pki.files;
    let socket = socket_path(pki.dir());
    let server = ServerProc::start(
        Path::new(BIN),
        &[
            "--mode=grpc".into(),
            format!("--uds-name={}", socket.display()),
            "--server-port=0".into(),
            format!("--cluster-cert={}", f.server_cert.display()),
            format!("--cluster-key={}", f.server_key.display()),
            format!("--cluster-ca-cert={}", f.ca_cert.display()),
            "--proxy-strategies=default".into(),
            "--server-count=1".into(),
        ],
    );
    let agent = AgentProc::start(Path::new(BIN), &pki, server.agent, &[]);
    server.wait_agents(1).await;
    let echo = backend::echo().await;
    let refused = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };

    // konnectivity-client's tunnel: DIAL_REQ, DATA both ways, CLOSE_REQ, CLOSE_RSP,
    // then the stream cancelled (never half-closed).
    let client = Client::uds(&socket).await.unwrap();
    let (mut tx, mut rx) = client.open_stream().await.unwrap();
    tx.send(tether_proto::Packet::dial_request(
        "tcp",
        &echo.addr.to_string(),
        1,
    ))
    .await
    .unwrap();
    let connect_id = match rx.message().await.unwrap().unwrap().payload {
        Some(tether_proto::packet::Payload::DialResponse(r)) => {
            assert!(r.error.is_empty(), "{}", r.error);
            r.connect_id
        }
        other => panic!("expected DIAL_RSP, got {other:?}"),
    };
    tx.send(tether_proto::Packet::data(connect_id, &b"ping"[..]))
        .await
        .unwrap();
    match rx.message().await.unwrap().unwrap().payload {
        Some(tether_proto::packet::Payload::Data(d)) => assert_eq!(&d.data[..], b"ping"),
        other => panic!("expected DATA, got {other:?}"),
    }
    tx.send(tether_proto::Packet::close_request(connect_id))
        .await
        .unwrap();
    loop {
        match rx.message().await.unwrap().unwrap().payload {
            Some(tether_proto::packet::Payload::CloseResponse(_)) => break,
            Some(tether_proto::packet::Payload::Data(_)) => {}
            other => panic!("expected CLOSE_RSP, got {other:?}"),
        }
    }
    tx.cancel();
    drop(rx);

    // A dial the agent answers with an error (connection refused).
    let (mut tx, mut rx) = client.open_stream().await.unwrap();
    tx.send(tether_proto::Packet::dial_request(
        "tcp",
        &refused.to_string(),
        2,
    ))
    .await
    .unwrap();
    match rx.message().await.unwrap().unwrap().payload {
        Some(tether_proto::packet::Payload::DialResponse(r)) => assert!(!r.error.is_empty()),
        other => panic!("expected DIAL_RSP, got {other:?}"),
    }
    tx.cancel();
    drop(rx);

    let canceled = r#"konnectivity_network_proxy_server_stream_errors_total{code="Canceled",packet_type="Unknown",segment="from_client"}"#;
    wait_until("both tunnels ended", Duration::from_secs(20), || async {
        let page = server.metrics().await;
        (metric(&page, canceled) == Some(2.0)
            && metric(
                &page,
                "konnectivity_network_proxy_server_established_connections",
            ) == Some(0.0))
        .then_some(())
    })
    .await;

    let page = server.metrics().await;
    assert!(page.contains(r#"le="1e-06""#), "{page}");
    diff_series(
        "server",
        &series(&page),
        &golden("upstream-proxy-server.series"),
    );
    let page = get(agent.health, "/metrics").await;
    diff_series(
        "agent",
        &series(&page),
        &golden("upstream-proxy-agent.series"),
    );
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
    drop(suites);

    // HyperShift passes the Mozilla "Old" profile through: TLS 1.0 and CBC suites are
    // dropped with one warning, and the rest is served.
    let old = start(&[
        "--tls-min-version=VersionTLS10",
        "--cipher-suites=TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA,TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA",
    ]);
    let port = old.agent.port();
    assert!(old.proc.logged("VersionTLS10"));
    assert!(old
        .proc
        .logged("TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA, TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA"));
    assert!(handshake(
        &pki,
        port,
        &["-tls1_2", "-cipher", "ECDHE-ECDSA-AES128-GCM-SHA256"]
    ));
    assert!(
        !handshake(&pki, port, &["-tls1_1", "-cipher", "DEFAULT@SECLEVEL=0"]),
        "TLS 1.1 accepted"
    );
    drop(old);

    // A list of TLS 1.3 names only leaves TLS 1.2 no suite, in Go and here.
    let only13 = start(&["--cipher-suites=TLS_AES_128_GCM_SHA256,TLS_AES_256_GCM_SHA384"]);
    let port = only13.agent.port();
    assert!(handshake(&pki, port, &["-tls1_3"]));
    assert!(!handshake(&pki, port, &["-tls1_2"]), "TLS 1.2 accepted");
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

    // Go's other pprof paths: allocs is the heap profile, goroutine lists threads and
    // tasks, the bare path redirects, and what cannot exist says why.
    let text = read("/debug/pprof/allocs", "allocs.pb");
    assert!(text.contains("alloc_space/bytes"), "{text}");
    let text = read("/debug/pprof/goroutine", "goroutine.pb");
    assert!(
        text.contains("goroutine/count") && text.contains("thread tokio-rt-worker"),
        "{text}"
    );
    let curl = |args: &[&str]| -> String {
        let out = Command::new("curl").args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let admin = server.admin;
    let text = curl(&[
        "-s",
        &format!("http://{admin}/debug/pprof/goroutine?debug=1"),
    ]);
    assert!(text.contains("tokio tasks alive:"), "{text}");
    let moved = curl(&[
        "-s",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code} %{redirect_url}",
        &format!("http://{admin}/debug/pprof"),
    ]);
    assert_eq!(moved, format!("301 http://{admin}/debug/pprof/"));
    let block = curl(&[
        "-s",
        "-w",
        " %{http_code}",
        &format!("http://{admin}/debug/pprof/block"),
    ]);
    assert!(
        block.starts_with("block: Tether has no lock contention profile")
            && block.ends_with(" 404"),
        "{block}"
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

/// Waits until a server process logs "server listening" (true) or exits (false).
async fn server_started(proc: &mut Proc) -> bool {
    wait_until(
        "the server starts or exits",
        Duration::from_secs(30),
        || {
            let started = proc.log_text().contains("\"server listening\"");
            let exited = proc.wait_exit(Duration::ZERO).is_some();
            async move {
                if started {
                    Some(true)
                } else if exited {
                    Some(false)
                } else {
                    None
                }
            }
        },
    )
    .await
}

/// One real-world command line (tests/golden/real-world-command-lines.json).
#[derive(serde::Deserialize)]
struct CommandLine {
    name: String,
    role: String,
    run_as: String,
    args: Vec<String>,
}

/// The image's layout (deploy/Dockerfile and deploy/image-links): `/proxy-server` and
/// `/usr/bin/proxy-server` run `tether`, `/proxy-agent` and `/usr/bin/proxy-agent` run
/// `tether-agent`, under a root of this test's.
fn image_layout(root: &Path) {
    std::fs::create_dir_all(root.join("usr/bin")).unwrap();
    for dir in ["", "usr/bin/"] {
        std::os::unix::fs::symlink(BIN, root.join(format!("{dir}proxy-server"))).unwrap();
        std::os::unix::fs::symlink(AGENT_BIN, root.join(format!("{dir}proxy-agent"))).unwrap();
    }
}

/// `line`'s arguments with its files, addresses and ports made this test's (each
/// flag's spelling, its `=` or space-separated form, and every other flag untouched),
/// the ports it leaves at their defaults set to 0, then two logging flags so the test
/// can watch it: JSON lines, also on stderr.
fn localised(line: &CommandLine, pki: &Pki, dir: &Path, n: usize, server_port: u16) -> Vec<String> {
    let f = &pki.files;
    // The value a flag has in the line, in either form.
    let original = |name: &str| -> Option<String> {
        line.args.iter().enumerate().find_map(|(i, a)| {
            let flag = a.trim_start_matches('-');
            match flag.split_once('=') {
                Some((n, v)) if n == name => Some(v.to_string()),
                None if flag == name => line.args.get(i + 1).cloned(),
                _ => None,
            }
        })
    };
    // A line whose frontend and agents share one CA file keeps sharing one.
    let shared_ca = original("server-ca-cert").is_some()
        && original("server-ca-cert") == original("cluster-ca-cert");
    let new_value = |flag: &str, value: &str| -> Option<String> {
        let p = |p: &Path| Some(p.display().to_string());
        match flag {
            "cluster-cert" => p(&f.server_cert),
            "cluster-key" => p(&f.server_key),
            "server-cert" => p(&f.server_cert),
            "server-key" => p(&f.server_key),
            "server-ca-cert" if !shared_ca => p(&f.frontend_ca_cert),
            "cluster-ca-cert" | "server-ca-cert" | "ca-cert" => p(&f.ca_cert),
            "agent-cert" => p(&f.agent_cert),
            "agent-key" => p(&f.agent_key),
            "uds-name" => p(&dir.join(format!("server-{n}.sock"))),
            "agent-port" | "health-port" | "admin-port" | "server-port" | "health-server-port"
            | "admin-server-port" => Some("0".into()),
            "proxy-server-host" => Some("127.0.0.1".into()),
            "proxy-server-port" => Some(server_port.to_string()),
            "kubeconfig" if !value.is_empty() => p(&dir.join("kubeconfig")),
            "service-account-token-path" if !value.is_empty() => p(&dir.join("token")),
            "log-file" => p(&dir.join(format!("log-{n}.log"))),
            _ => None,
        }
    };
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < line.args.len() {
        let arg = line.args[i]
            .replace("$(NODE_IP)", "10.0.0.1")
            .replace("$(POD_IP)", "10.0.0.1")
            .replace("$(HOST_IP)", "10.0.0.1");
        i += 1;
        let flag = arg.trim_start_matches('-');
        match flag.split_once('=') {
            Some((name, value)) => match new_value(name, value) {
                Some(v) => out.push(format!(
                    "{}={v}",
                    &arg[..arg.len() - flag.len() + name.len()]
                )),
                None => out.push(arg),
            },
            None if arg.starts_with('-')
                && i < line.args.len()
                && !line.args[i].starts_with('-') =>
            {
                let value = line.args[i].clone();
                i += 1;
                out.push(arg.clone());
                out.push(new_value(flag, &value).unwrap_or(value));
            }
            None => out.push(arg),
        }
    }
    // Ports the line leaves at their defaults are this test's too (a repeated flag's
    // last value wins, so appending them changes nothing else).
    let ports: &[&str] = if line.role == "agent" {
        &["--health-server-port=0", "--admin-server-port=0"]
    } else {
        &[
            "--agent-port=0",
            "--health-port=0",
            "--admin-port=0",
            "--server-port=0",
        ]
    };
    out.extend(ports.iter().map(|p| p.to_string()));
    out.extend(["--log-format=json".into(), "--alsologtostderr=true".into()]);
    out
}

/// Real-world command lines (upstream's examples, the Kubernetes docs, GCE, k0s, Kamaji,
/// Kubermatic, HyperShift, Gardener, AKS, vcluster: tests/golden/real-world-command-
/// lines.json, with their sources) run as `/proxy-server`, `/usr/bin/proxy-server`,
/// `/proxy-agent` and `/usr/bin/proxy-agent` from the image's layout, with only their
/// files, addresses and ports made local. Repeated flags, appended overrides,
/// space-separated values, TLS profiles and klog flags all start. A server either
/// serves an agent (and a tunnel, on a gRPC socket) or refuses to start for a reason
/// Tether's secure defaults give on purpose; every agent connects and carries a tunnel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_world_command_lines_run_from_the_image_layout() {
    let lines: Vec<CommandLine> = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/golden/real-world-command-lines.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let pki = Pki::new();
    let dir = TempDir::new("tether-replay");
    let root = dir.path().join("image");
    image_layout(&root);
    // Token-authenticated servers get a kubeconfig for a cluster that is not there:
    // they start (reviews fail later); agents a token file.
    std::fs::write(
        dir.path().join("kubeconfig"),
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://127.0.0.1:9\n    insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: t\ncontexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("token"), "not-checked").unwrap();
    let echo = backend::echo().await;
    // Tether's secure defaults refuse these on purpose (docs/upstream-differences.md):
    // agents nobody authenticates, one CA for agents and frontend clients (any agent
    // could open tunnels), and Go's insecure cipher suites (upstream refuses those too).
    const REFUSALS: [&str; 3] = [
        "agents are not authenticated",
        "share the CA",
        "is insecure",
    ];

    // The agents' server: it takes any agent (token agents included), over TLS.
    let socket = socket_path(pki.dir());
    let reference = ServerProc::start(
        Path::new(BIN),
        &[
            format!("--uds-name={}", socket.display()),
            "--server-port=0".into(),
            format!("--cluster-cert={}", pki.files.server_cert.display()),
            format!("--cluster-key={}", pki.files.server_key.display()),
            "--unsafe-allow-unauthenticated-agents".into(),
        ],
    );
    let client = Client::uds(&socket).await.unwrap();

    let mut report = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let mut args = localised(line, &pki, dir.path(), n, reference.agent.port());
        let program = root.join(line.run_as.trim_start_matches('/'));
        let mut proc = Proc::spawn(&format!("{n}"), &program, &args);
        if line.role == "agent" {
            proc.wait_event("connected to proxy server", Duration::from_secs(30), |_| {
                true
            });
            let mut c = client
                .dial(&echo.addr.to_string())
                .await
                .unwrap_or_else(|e| {
                    panic!(
                        "{}: no tunnel through it: {e}\n{}",
                        line.name,
                        proc.log_text()
                    )
                });
            c.write_all(b"ping").await.unwrap();
            let mut b = [0u8; 4];
            c.read_exact(&mut b).await.unwrap();
            drop(c);
            proc.kill();
            reference.wait_agents(0).await;
            report.push(format!("agent  serves   {} ({})", line.name, line.run_as));
            continue;
        }
        // A server: listening, or one start-up error line.
        let mut listening = server_started(&mut proc).await;
        let mut fix = "";
        if !listening && proc.log_text().contains("share the CA") {
            // The fix the error names: require the apiserver's client certificate name.
            fix = " after --frontend-client-names";
            args.push("--frontend-client-names=system:kube-apiserver".into());
            proc = Proc::spawn(&format!("{n}"), &program, &args);
            listening = server_started(&mut proc).await;
        }
        if !listening {
            let text = proc.log_text();
            let refusal = REFUSALS
                .iter()
                .find(|r| text.contains(*r))
                .unwrap_or_else(|| {
                    panic!(
                        "{}: did not start, and not for a documented reason:\n{text}",
                        line.name
                    )
                });
            report.push(format!("server refuses {} ({refusal})", line.name));
            continue;
        }
        let ev = proc.wait_event("server listening", Duration::from_secs(1), |_| true);
        let port = |key: &str| -> u16 {
            ev[key]
                .as_str()
                .and_then(|a| a.rsplit_once(':'))
                .unwrap()
                .1
                .parse()
                .unwrap()
        };
        let health: std::net::SocketAddr = ([127, 0, 0, 1], port("health")).into();
        let verified_agents = args.iter().any(|a| a.starts_with("--cluster-ca-cert"));
        if verified_agents {
            let agent = AgentProc::start(
                Path::new(BIN),
                &pki,
                ([127, 0, 0, 1], port("agent")).into(),
                &[],
            );
            wait_until(
                "the server is ready with the agent",
                Duration::from_secs(30),
                || async {
                    (tether_testkit::http_get(health, "/readyz").await.ok()?.0 == 200).then_some(())
                },
            )
            .await;
            let uds = args
                .iter()
                .find_map(|a| a.strip_prefix("--uds-name="))
                .map(str::to_string);
            let grpc = !args.iter().any(|a| a == "--mode=http-connect");
            if let (Some(uds), true) = (uds, grpc) {
                let c = Client::uds(&uds).await.unwrap();
                let mut t = c.dial(&echo.addr.to_string()).await.unwrap();
                t.write_all(b"ping").await.unwrap();
                let mut b = [0u8; 4];
                t.read_exact(&mut b).await.unwrap();
                report.push(format!(
                    "server tunnels {} ({}){fix}",
                    line.name, line.run_as
                ));
            } else {
                report.push(format!(
                    "server serves  {} ({}){fix}",
                    line.name, line.run_as
                ));
            }
            drop(agent);
        } else {
            // Token authentication against a cluster that is not there: up and healthy.
            assert_eq!(
                tether_testkit::http_get(health, "/healthz")
                    .await
                    .unwrap()
                    .0,
                200
            );
            report.push(format!(
                "server starts  {} ({}; token agents)",
                line.name, line.run_as
            ));
        }
        proc.kill();
    }
    eprintln!("{}", report.join("\n"));

    // Run by upstream's names and told nothing about the format, both log klog's lines.
    let klog_line = |text: &str, message: &str| {
        text.lines().any(|l| {
            let b = l.as_bytes();
            // `I1127 15:04:05.000000    1234 file.rs:42] "message" key=value`
            b.len() > 30
                && b"IWE".contains(&b[0])
                && b[1..5].iter().all(u8::is_ascii_digit)
                && b[8] == b':'
                && b[14] == b'.'
                && l.contains(&format!("] \"{message}\""))
        })
    };
    let f = &pki.files;
    let runs: [(&str, Vec<String>, &str); 2] = [
        (
            "proxy-server",
            vec![
                format!("--uds-name={}", dir.path().join("klog.sock").display()),
                "--server-port=0".into(),
                "--agent-port=0".into(),
                "--health-port=0".into(),
                "--admin-port=0".into(),
                format!("--cluster-cert={}", f.server_cert.display()),
                format!("--cluster-key={}", f.server_key.display()),
                format!("--cluster-ca-cert={}", f.ca_cert.display()),
            ],
            "server listening",
        ),
        (
            "usr/bin/proxy-agent",
            vec![
                format!("--ca-cert={}", f.ca_cert.display()),
                format!("--agent-cert={}", f.agent_cert.display()),
                format!("--agent-key={}", f.agent_key.display()),
                "--proxy-server-host=127.0.0.1".into(),
                format!("--proxy-server-port={}", reference.agent.port()),
                "--health-server-port=0".into(),
                "--admin-server-port=0".into(),
            ],
            "connected to proxy server",
        ),
    ];
    for (program, args, message) in runs {
        let mut proc = Proc::spawn(program, &root.join(program), &args);
        wait_until(
            &format!("a klog line from /{program}"),
            Duration::from_secs(30),
            || {
                let ok = klog_line(&proc.log_text(), message);
                async move { ok.then_some(()) }
            },
        )
        .await;
        proc.kill();
    }
}

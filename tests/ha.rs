//! High availability: several servers, every agent holding one stream to each, through
//! a load balancer or a list of addresses; servers going away and coming back; server
//! counts from Leases on a real kube-apiserver; partitions found by keepalive.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tether_client::Client;
use tether_testkit::backend::{self, LoadBalancer};
use tether_testkit::kube::{Cluster, Egress};
use tether_testkit::netns::Node;
use tether_testkit::{metric, AgentProc, Pki, ServerProc, TempDir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

fn bin() -> &'static Path {
    Path::new(BIN)
}

fn server(pki: &Pki, dir: &Path, id: &str, extra: &[String]) -> ServerProc {
    let f = &pki.files;
    let mut args = vec![
        format!("--server-id={id}"),
        format!("--uds-name={}", dir.join(format!("{id}.sock")).display()),
        "--server-port=0".into(),
        format!("--cluster-cert={}", f.server_cert.display()),
        format!("--cluster-key={}", f.server_key.display()),
        format!("--cluster-ca-cert={}", f.ca_cert.display()),
    ];
    args.extend(extra.iter().cloned());
    ServerProc::start(bin(), &args)
}

async fn streams(agent: &AgentProc) -> Option<f64> {
    metric(
        &agent.metrics().await,
        "konnectivity_network_proxy_agent_open_server_connections",
    )
}

/// Waits (60 s at most: agents re-count leases and back off between dials, and CI
/// machines are slow) until every agent holds `n` streams.
async fn wait_streams(agents: &[AgentProc], n: f64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    for (i, a) in agents.iter().enumerate() {
        loop {
            let have = streams(a).await;
            if have == Some(n) {
                break;
            }
            if std::time::Instant::now() > deadline {
                let log = a.proc.log_text();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                panic!(
                    "timed out after 60s waiting for agent {i} to hold {n} streams (it holds {have:?}); its last log lines, newest first:\n{}",
                    tail.join("\n")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

async fn echo_roundtrip(socket: &Path, target: &str) -> Result<(), String> {
    let client = Client::uds(socket).await.map_err(|e| e.to_string())?;
    let mut c = client.dial(target).await.map_err(|e| e.to_string())?;
    c.write_all(b"ha").await.map_err(|e| e.to_string())?;
    let mut b = [0u8; 2];
    c.read_exact(&mut b).await.map_err(|e| e.to_string())?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_servers_five_agents_through_a_load_balancer() {
    let pki = Pki::new();
    let dir = TempDir::new("tether-ha");
    let count = ["--server-count=3".to_string()];
    let mut servers: Vec<ServerProc> = ["s1", "s2", "s3"]
        .iter()
        .map(|id| server(&pki, dir.path(), id, &count))
        .collect();
    let lb = LoadBalancer::new(servers.iter().map(|s| s.agent).collect()).await;
    let agents: Vec<AgentProc> = (0..5)
        .map(|i| {
            AgentProc::start(
                bin(),
                &pki,
                lb.addr,
                &[
                    format!("--agent-id=agent-{i}"),
                    "--keepalive-time=2s".into(),
                ],
            )
        })
        .collect();
    wait_streams(&agents, 3.0).await;
    for s in &servers {
        s.wait_agents(5).await;
    }

    // One server dies; agents notice within seconds and keep serving through the others.
    let echo = backend::echo().await;
    let target = echo.addr.to_string();
    let s3_agent_port = servers[2].agent.port();
    servers[2].proc.kill();
    wait_streams(&agents, 2.0).await;
    for s in &servers[..2] {
        s.wait_agents(5).await;
    }
    let mut failures = Vec::new();
    for round in 0..60 {
        let id = ["s1", "s2"][round % 2];
        if let Err(e) = echo_roundtrip(&dir.path().join(format!("{id}.sock")), &target).await {
            failures.push(format!("round {round} via {id}: {e}"));
        }
    }
    assert!(
        failures.is_empty(),
        "dials failed after the agents noticed the dead server: {failures:#?}"
    );

    // It comes back (same address): the agents pick it up without a restart.
    servers[2] = server(
        &pki,
        dir.path(),
        "s3",
        &[count[0].clone(), format!("--agent-port={s3_agent_port}")],
    );
    wait_streams(&agents, 3.0).await;
    servers[2].wait_agents(5).await;
    echo_roundtrip(&dir.path().join("s3.sock"), &target)
        .await
        .unwrap();
    // No agent ever holds two streams to one server.
    for a in &agents {
        assert!(streams(a).await.unwrap() <= 3.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agents_follow_server_leases() {
    let pki = Pki::new();
    let dir = TempDir::new("tether-leases");
    let cluster = Cluster::start(&Egress::GrpcUds(dir.path().join("unused.sock")));
    let kubeconfig = cluster.files.admin_kubeconfig.display().to_string();
    // An expired lease left by a server that died long ago.
    cluster.apply(
        "apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata:\n  name: konnectivity-proxy-server-ghost\n  namespace: kube-system\n  labels:\n    k8s-app: konnectivity-server\nspec:\n  holderIdentity: ghost\n  leaseDurationSeconds: 30\n  renewTime: \"2020-01-01T00:00:00.000000Z\"\n",
    );
    let lease_args = vec![
        "--enable-lease-controller".to_string(),
        format!("--kubeconfig={kubeconfig}"),
        "--server-count=1".into(),
    ];
    let s1 = server(&pki, dir.path(), "s1", &lease_args);
    let s2 = server(&pki, dir.path(), "s2", &lease_args);
    let lb = LoadBalancer::new(vec![s1.agent, s2.agent]).await;
    let agents: Vec<AgentProc> = (0..3)
        .map(|i| {
            AgentProc::start(
                bin(),
                &pki,
                lb.addr,
                &[
                    format!("--agent-id=agent-{i}"),
                    "--count-server-leases".into(),
                    format!("--kubeconfig={kubeconfig}"),
                ],
            )
        })
        .collect();
    wait_streams(&agents, 2.0).await;
    let leases = cluster.kubectl_ok(&[
        "get",
        "leases",
        "-n",
        "kube-system",
        "-l",
        "k8s-app=konnectivity-server",
        "-o",
        "name",
    ]);
    assert!(
        leases.contains("konnectivity-proxy-server-s1")
            && leases.contains("konnectivity-proxy-server-s2"),
        "{leases}"
    );
    assert!(
        !leases.contains("ghost"),
        "expired lease not garbage-collected: {leases}"
    );
    // Upstream's lease metrics: exactly one server culled the ghost (the delete carries
    // the listed resourceVersion), both listed; agents list once and watch.
    let p = "konnectivity_network_proxy_server_";
    let mut culled = 0.0;
    for s in [&s1, &s2] {
        let page = s.metrics().await;
        culled += metric(&page, &format!("{p}culled_leases_count")).unwrap();
        for sample in [
            format!(r#"{p}lease_list_total{{http_status_code="200",reason=""}}"#),
            format!(r#"{p}lease_list_latency_seconds_count{{http_status_code="200"}}"#),
        ] {
            assert!(
                metric(&page, &sample).unwrap_or(0.0) >= 1.0,
                "{sample}:\n{page}"
            );
        }
    }
    assert_eq!(culled, 1.0);
    let a = "konnectivity_network_proxy_agent_";
    for agent in &agents {
        let page = agent.metrics().await;
        for sample in [
            format!(r#"{a}lease_lists_total{{http_response_code="200",reason=""}}"#),
            format!(r#"{a}lease_list_latency_seconds_count{{http_response_code="200"}}"#),
            format!(r#"{a}lease_watches_total{{http_response_code="200",reason=""}}"#),
        ] {
            assert!(
                metric(&page, &sample).unwrap_or(0.0) >= 1.0,
                "{sample}:\n{page}"
            );
        }
    }

    // A third server appears: its lease raises the count and agents open a third stream.
    let mut s3 = server(&pki, dir.path(), "s3", &lease_args);
    lb.set_targets(vec![s1.agent, s2.agent, s3.agent]);
    wait_streams(&agents, 3.0).await;
    for a in &agents {
        let page = a.metrics().await;
        assert_eq!(
            metric(&page, "konnectivity_network_proxy_agent_known_server_count"),
            Some(3.0)
        );
    }

    // Graceful shutdown deletes the lease.
    s3.proc.signal("TERM");
    s3.proc
        .wait_exit(Duration::from_secs(15))
        .expect("server exits");
    let leases = cluster.kubectl_ok(&["get", "leases", "-n", "kube-system", "-o", "name"]);
    assert!(!leases.contains("konnectivity-proxy-server-s3"), "{leases}");
    lb.set_targets(vec![s1.agent, s2.agent]);
    wait_streams(&agents, 2.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitioned_agent_is_removed_by_keepalive() {
    // HTTP/2 PINGs every second, unanswered for 1 s: the stream is dead.
    let keepalive = ["--keepalive-time=1s".to_string()];
    partition(&keepalive, &keepalive, Duration::from_secs(15)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitioned_agent_is_removed_within_the_dead_link_timeout_whatever_the_keepalive() {
    // Upstream's hour-long keepalive: only --dead-link-timeout bounds the silence.
    let args = [
        "--keepalive-time=1h".to_string(),
        "--dead-link-timeout=3s".into(),
    ];
    partition(&args, &args, Duration::from_secs(3 + 4)).await;
}

/// Two servers, one agent in a network namespace: its link goes down, both servers
/// drop its streams within `bound`, and it reconnects to both once the link is back.
async fn partition(server_args: &[String], agent_args: &[String], bound: Duration) {
    let node = Node::create();
    let pki = Pki::with_sans(std::slice::from_ref(&node.host_ip));
    let dir = TempDir::new("tether-partition");
    let mut extra = vec![
        "--agent-bind-address=0.0.0.0".to_string(),
        "--server-count=2".into(),
    ];
    extra.extend_from_slice(server_args);
    let s1 = server(&pki, dir.path(), "s1", &extra);
    let s2 = server(&pki, dir.path(), "s2", &extra);
    // No load balancer: the agent is given both servers' addresses.
    let list = format!(
        "{0}:{1},{0}:{2}",
        node.host_ip,
        s1.agent.port(),
        s2.agent.port()
    );
    let first: SocketAddr = format!("{}:{}", node.host_ip, s1.agent.port())
        .parse()
        .unwrap();
    let mut args = vec![
        format!("--proxy-server-host={list}"),
        format!("--health-server-host={}", node.link_ip),
    ];
    args.extend_from_slice(agent_args);
    let agent = AgentProc::start_in(Some(&node), bin(), &pki, first, &args);
    wait_streams(std::slice::from_ref(&agent), 2.0).await;
    s1.wait_agents(1).await;
    s2.wait_agents(1).await;

    node.set_link(false);
    let started = std::time::Instant::now();
    s1.wait_agents(0).await;
    s2.wait_agents(0).await;
    let detected = started.elapsed();
    eprintln!("partition detected and stale streams removed after {detected:?}");
    assert!(
        detected < bound,
        "stale streams removed only after {detected:?} (bound {bound:?})"
    );

    // Healed: the agent notices its own streams died and reconnects to both.
    node.set_link(true);
    s1.wait_agents(1).await;
    s2.wait_agents(1).await;
}

/// `--ready-when=every-server`: an agent is ready only while it holds a stream to every
/// server it knows of (here the server count, 2), so a rolling update never drains a
/// node's old agent while its new one reaches only some of the servers. The default
/// is ready with any one, as upstream's agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_ready_with_every_server_is_not_ready_with_one() {
    let pki = Pki::new();
    let dir = TempDir::new("tether-ready-when");
    let count = ["--server-count=2".to_string()];
    let s1 = server(&pki, dir.path(), "s1", &count);
    let mut s2 = server(&pki, dir.path(), "s2", &count);
    let s2_port = s2.agent.port();
    let list = format!("127.0.0.1:{},127.0.0.1:{s2_port}", s1.agent.port());
    let agent = |extra: &str| {
        let args = [format!("--proxy-server-host={list}"), extra.to_string()];
        AgentProc::start(bin(), &pki, s1.agent, &args)
    };
    let every = agent("--ready-when=every-server");
    let any = agent("--ready-when=any-server");
    let agents = [every, any];
    wait_streams(&agents, 2.0).await;
    let [every, any] = &agents;
    let ready = |a: &AgentProc| {
        let health = a.health;
        async move { tether_testkit::http_get(health, "/readyz").await.ok() }
    };
    assert_eq!(ready(every).await.map(|r| r.0), Some(200));

    s2.proc.signal("TERM");
    assert!(s2.proc.wait_exit(Duration::from_secs(10)).is_some());
    let (code, body) = tether_testkit::wait_until(
        "the every-server agent unready with one server",
        Duration::from_secs(20),
        || async { ready(every).await.filter(|r| r.0 == 503) },
    )
    .await;
    assert_eq!(code, 503);
    assert!(body.contains("connected to 1 of 2 proxy servers"), "{body}");
    assert_eq!(ready(any).await.map(|r| r.0), Some(200));

    let _s2 = server(
        &pki,
        dir.path(),
        "s2",
        &[count[0].clone(), format!("--agent-port={s2_port}")],
    );
    tether_testkit::wait_until("ready again with both", Duration::from_secs(60), || async {
        ready(every).await.filter(|r| r.0 == 200).map(|_| ())
    })
    .await;
}

/// The handover tests' host: a kube-apiserver for the Leases, the flags two servers
/// on one host share (one agent port and socket path, `--reuse-port`), and agents that
/// follow Leases.
struct SameHost {
    pki: Pki,
    cluster: Cluster,
    socket: PathBuf,
    _dir: TempDir,
}

impl SameHost {
    fn new() -> Self {
        let pki = Pki::new();
        let dir = TempDir::new("tether-handover");
        let cluster = Cluster::start(&Egress::GrpcUds(dir.path().join("unused.sock")));
        let socket = dir.path().join("konnectivity-server.sock");
        SameHost {
            pki,
            cluster,
            socket,
            _dir: dir,
        }
    }

    fn kubeconfig(&self) -> String {
        self.cluster.files.admin_kubeconfig.display().to_string()
    }

    /// Server `id`'s flags, on `agent_port` (0: any).
    fn server_args(&self, id: &str, agent_port: u16) -> Vec<String> {
        let f = &self.pki.files;
        vec![
            format!("--server-id={id}"),
            format!("--uds-name={}", self.socket.display()),
            "--delete-existing-uds-file".into(),
            "--server-port=0".into(),
            format!("--agent-port={agent_port}"),
            "--reuse-port".into(),
            "--wait-for-agent=20s".into(),
            "--graceful-shutdown-timeout=60s".into(),
            "--enable-lease-controller".into(),
            format!("--kubeconfig={}", self.kubeconfig()),
            format!("--cluster-cert={}", f.server_cert.display()),
            format!("--cluster-key={}", f.server_key.display()),
            format!("--cluster-ca-cert={}", f.ca_cert.display()),
        ]
    }

    /// Two agents dialling `server`, counting Leases.
    fn agents(&self, server: SocketAddr) -> Vec<AgentProc> {
        (0..2)
            .map(|i| {
                let args = [
                    format!("--agent-id=agent-{i}"),
                    "--count-server-leases".into(),
                    format!("--kubeconfig={}", self.kubeconfig()),
                ];
                AgentProc::start(bin(), &self.pki, server, &args)
            })
            .collect()
    }
}

/// A server's successor on the same host (`--reuse-port` on one agent port, the Unix
/// socket replaced by a rename, agents following Leases, dials waiting for an agent):
/// a client dialling every 100 ms through the socket path sees no failure from before
/// the successor starts until after the old server has gone, and a tunnel the old
/// server carries lasts through its drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_successor_on_the_same_host_takes_over_with_no_failed_dial() {
    let host = SameHost::new();
    let (socket, cluster) = (&host.socket, &host.cluster);
    let args = |id: &str, port: u16| host.server_args(id, port);
    let mut blue = ServerProc::start(bin(), &args("blue", 0));
    let port = blue.agent.port();
    let agents = host.agents(blue.agent);
    wait_streams(&agents, 1.0).await;
    let echo = backend::echo().await;
    let target = echo.addr.to_string();

    // A long tunnel through the old server.
    let long_client = Client::uds(socket).await.unwrap();
    let mut long = long_client.dial(&target).await.unwrap();
    roundtrip(&mut long).await;

    // The probe: a new tunnel every 100 ms, as kube-apiserver opens one per call.
    let stop = tokio_util::sync::CancellationToken::new();
    let served = Arc::new(AtomicU32::new(0));
    let probe = {
        let (socket, target) = (socket.clone(), target.clone());
        let (stop, served) = (stop.clone(), served.clone());
        tokio::spawn(async move {
            let (mut slowest, mut failed) = (Duration::ZERO, Vec::new());
            while !stop.is_cancelled() {
                let at = std::time::Instant::now();
                match echo_roundtrip(&socket, &target).await {
                    Ok(()) => drop(served.fetch_add(1, Ordering::Relaxed)),
                    Err(e) => failed.push(format!("{e} (took {:?})", at.elapsed())),
                }
                slowest = slowest.max(at.elapsed());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (slowest, failed)
        })
    };
    let probes = |n: u32| {
        let served = served.clone();
        async move {
            let enough = || {
                let served = served.clone();
                async move { (served.load(Ordering::Relaxed) >= n).then_some(()) }
            };
            tether_testkit::wait_until(
                &format!("{n} probes served"),
                Duration::from_secs(60),
                enough,
            )
            .await
        }
    };
    probes(5).await;

    // The successor binds the same agent port and takes the socket path at once; the
    // agents see its Lease and open a stream to it too.
    let green = ServerProc::start(bin(), &args("green", port));
    assert_eq!(green.agent.port(), port);
    // A call at once reaches the successor before any agent has: it waits for one.
    echo_roundtrip(socket, &target).await.unwrap();
    wait_streams(&agents, 2.0).await;
    green.wait_agents(2).await;

    // The old server stops: its frontend and agent port close, its Lease goes, and it
    // serves the tunnel it carries until that ends.
    blue.proc.signal("TERM");
    tether_testkit::wait_until(
        "the old server's Lease is gone",
        Duration::from_secs(30),
        || {
            let out = cluster.kubectl_ok(&["get", "leases", "-n", "kube-system", "-o", "name"]);
            async move { (!out.contains("konnectivity-proxy-server-blue")).then_some(()) }
        },
    )
    .await;
    roundtrip(&mut long).await;
    // A client that keeps its connection (the CCM's load balancers do) got a GOAWAY
    // from the old server: its next tunnel goes to the successor.
    let blue_dials = || async {
        let page = blue.metrics().await;
        let name = "konnectivity_network_proxy_server_dial_duration_seconds_count";
        metric(&page, name).unwrap_or(0.0)
    };
    let before = blue_dials().await;
    let mut again = long_client.dial(&target).await.unwrap();
    roundtrip(&mut again).await;
    assert_eq!(
        blue_dials().await,
        before,
        "the kept client's dial went to the old server"
    );
    drop(again);
    drop(long);
    drop(long_client);
    blue.proc
        .wait_exit(Duration::from_secs(30))
        .expect("the old server exits once its last tunnel has ended");
    let log = blue.proc.log_text();
    assert!(
        log.contains("now belongs to another server; left in place"),
        "{log}"
    );
    wait_streams(&agents, 1.0).await;

    // Some more probes through the successor alone, then the count.
    let page = green.metrics().await;
    let before = metric(
        &page,
        "konnectivity_network_proxy_server_dial_duration_seconds_count",
    )
    .unwrap_or(0.0);
    tether_testkit::wait_until(
        "10 more dials through the successor",
        Duration::from_secs(60),
        || {
            let health = green.health;
            async move {
                let (_, page) = tether_testkit::http_get(health, "/metrics").await.ok()?;
                let now = metric(
                    &page,
                    "konnectivity_network_proxy_server_dial_duration_seconds_count",
                )?;
                (now >= before + 10.0).then_some(())
            }
        },
    )
    .await;
    stop.cancel();
    let (slowest, failed) = probe.await.unwrap();
    let ok = served.load(Ordering::Relaxed);
    let waited = metric(
        &green.metrics().await,
        r#"tether_server_dials_waited_total{result="arrived"}"#,
    );
    println!("handover: {ok} dials, {} failed, slowest {slowest:?}; {waited:?} waited on the successor for an agent", failed.len());
    assert!(
        failed.is_empty(),
        "{} of {} dials failed: {failed:#?}",
        failed.len(),
        ok as usize + failed.len()
    );
}

/// An in-place restart, as the kubelet restarts a changed static pod: the old server is
/// stopped first, and lingers while it carries a tunnel; its successor starts on the
/// same port and socket path. The old server's DRAIN sends the agents to the successor
/// at once, not when the old server exits (before, they held the stopping server's
/// stream as their one server, and a dial through the successor waited for an agent
/// that came only once the old server had gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agents_join_the_successor_while_the_stopped_server_drains() {
    let host = SameHost::new();
    let mut blue_args = host.server_args("blue", 0);
    blue_args.push("--graceful-shutdown-timeout=300s".into());
    let mut blue = ServerProc::start(bin(), &blue_args);
    let agents = host.agents(blue.agent);
    wait_streams(&agents, 1.0).await;
    let echo = backend::echo().await;
    let target = echo.addr.to_string();
    let long_client = Client::uds(&host.socket).await.unwrap();
    let mut long = long_client.dial(&target).await.unwrap();
    roundtrip(&mut long).await;

    blue.proc.signal("TERM");
    blue.proc.wait_event(
        "told the agents this server drains (DRAIN): they connect to the other servers while their streams here serve the last tunnels",
        Duration::from_secs(30),
        |e| e["agents"] == 2,
    );
    let green = ServerProc::start(bin(), &host.server_args("green", blue.agent.port()));
    green.wait_agents(2).await;
    assert!(!blue.proc.exited(), "the old server still drains");
    let started = std::time::Instant::now();
    echo_roundtrip(&host.socket, &target).await.unwrap();
    let took = started.elapsed();
    roundtrip(&mut long).await;
    for a in &agents {
        assert!(
            a.proc.logged("the server is stopping (DRAIN)"),
            "{}",
            a.proc.log_text()
        );
    }
    println!("a dial through the successor while the old server drained: {took:?}");
    drop(long);
    drop(long_client);
    blue.proc
        .wait_exit(Duration::from_secs(30))
        .expect("the old server exits once its last tunnel has ended");
}

async fn roundtrip(c: &mut tether_client::TunnelConn) {
    c.write_all(b"hi").await.unwrap();
    let mut b = [0u8; 2];
    c.read_exact(&mut b).await.unwrap();
}

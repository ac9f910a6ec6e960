//! Agents behind an egress proxy, as grpc-go's agents are: a real CONNECT proxy
//! (Debian's tinyproxy, with Basic authentication) between an agent in a network
//! namespace (a node) and a server on the host. The server listens on the host's side
//! of the node's link, a non-loopback address (Go's rules never proxy loopback), so
//! the agent can take the proxy or, where NO_PROXY says so, go straight there.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tether_client::Client;
use tether_testkit::kube::free_port;
use tether_testkit::netns::Node;
use tether_testkit::process::{socket_path, uds_frontend_args, START_TIMEOUT};
use tether_testkit::{metric, wait_until, AgentProc, Pki, Proc, ServerProc, TempDir};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BIN: &str = env!("CARGO_BIN_EXE_tether");

const USER: &str = "edge";
const PASSWORD: &str = "s3cret-Pa55";
/// What the page inside the node serves.
const PAGE: &str = "the node's kubelet, reached through the tunnel";
/// The page's port inside the node (its namespace is its own: no port is taken).
const PAGE_PORT: u16 = 10250;

/// tinyproxy on `ip`, with Basic authentication and a log of every request; killed
/// when dropped (its [`Proc`] does that).
struct Tinyproxy {
    _proc: Proc,
    addr: SocketAddr,
    log: PathBuf,
}

impl Tinyproxy {
    /// Starts tinyproxy on `ip` at a free port, and waits until it accepts connections.
    async fn start(dir: &Path, ip: &str) -> Tinyproxy {
        let port = free_port();
        let log = dir.join("tinyproxy.log");
        let conf = dir.join("tinyproxy.conf");
        // No ConnectPort line: CONNECT to any port (the agent port is not 443).
        std::fs::write(
            &conf,
            format!(
                "Port {port}\nListen {ip}\nTimeout 60\nMaxClients 20\nLogLevel Connect\nLogFile \"{}\"\nBasicAuth {USER} {PASSWORD}\n",
                log.display()
            ),
        )
        .unwrap();
        let proc = Proc::spawn(
            "tinyproxy",
            Path::new("tinyproxy"),
            &["-d".into(), "-c".into(), conf.display().to_string()],
        );
        let addr: SocketAddr = format!("{ip}:{port}").parse().unwrap();
        wait_until(
            "tinyproxy accepts connections",
            START_TIMEOUT,
            || async move { tokio::net::TcpStream::connect(addr).await.ok().map(|_| ()) },
        )
        .await;
        Tinyproxy {
            _proc: proc,
            addr,
            log,
        }
    }

    /// The CONNECT requests tinyproxy logged for `target`.
    fn connects_to(&self, target: SocketAddr) -> usize {
        let needle = format!("CONNECT {target} ");
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(&needle))
            .count()
    }

    /// The proxy URL with `password`.
    fn url(&self, password: &str) -> String {
        format!("http://{USER}:{password}@{}", self.addr)
    }
}

/// A node with a page on its private address, a server on the host's end of the
/// node's link, and tinyproxy beside the server.
struct Site {
    node: Node,
    pki: Pki,
    _dir: TempDir,
    socket: PathBuf,
    server: ServerProc,
    proxy: Tinyproxy,
    _page: tether_testkit::netns::ServedPage,
}

impl Site {
    async fn new() -> Site {
        let node = Node::create();
        let pki = Pki::with_sans(std::slice::from_ref(&node.host_ip));
        let dir = TempDir::new("tether-egress-proxy");
        let socket = socket_path(dir.path());
        let mut args = uds_frontend_args(&pki, "grpc", &socket);
        args.push(format!("--agent-bind-address={}", node.host_ip));
        let server = ServerProc::start(Path::new(BIN), &args);
        let proxy = Tinyproxy::start(dir.path(), &node.host_ip).await;
        let page = node.serve_page(PAGE_PORT, PAGE);
        Site {
            node,
            pki,
            _dir: dir,
            socket,
            server,
            proxy,
            _page: page,
        }
    }

    /// An agent inside the node with `env`, its health port on the node's link.
    fn agent(&self, env: &[(&str, &str)]) -> AgentProc {
        self.agent_with(env, &[])
    }

    /// [`Site::agent`] with `args` too.
    fn agent_with(&self, env: &[(&str, &str)], args: &[&str]) -> AgentProc {
        let mut all = vec![format!("--health-server-host={}", self.node.link_ip)];
        all.extend(args.iter().map(|a| a.to_string()));
        AgentProc::start_with_env(
            Some(&self.node),
            Path::new(BIN),
            &self.pki,
            self.server.agent,
            &all,
            env,
        )
    }

    /// Fetches the node's page through the server's frontend and the agent's tunnel.
    async fn fetch_page(&self) {
        let target = format!("{}:{PAGE_PORT}", self.node.node_ip);
        let socket = self.socket.clone();
        let body = wait_until("the node's page through the tunnel", START_TIMEOUT, || {
            let (socket, target) = (socket.clone(), target.clone());
            async move { get(&socket, &target).await.ok() }
        })
        .await;
        assert!(body.contains(PAGE), "{body}");
    }
}

/// GET / at `target` through the frontend at `socket`.
async fn get(socket: &Path, target: &str) -> Result<String, String> {
    let client = Client::uds(socket).await.map_err(|e| e.to_string())?;
    let mut conn = client.dial(target).await.map_err(|e| e.to_string())?;
    conn.write_all(b"GET / HTTP/1.0\r\nHost: node\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut body = Vec::new();
    conn.read_to_end(&mut body)
        .await
        .map_err(|e| e.to_string())?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// No line the agent wrote carries the proxy's password.
fn assert_no_password(agent: &AgentProc) {
    let log = agent.proc.log_text();
    assert!(!log.is_empty());
    assert!(
        !log.contains(PASSWORD),
        "the agent logged the proxy password:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_agent_reaches_its_server_only_through_the_proxy() {
    only_through_the_proxy(&[]).await;
}

/// The same over WebSocket: the CONNECT tunnel carries TLS with ALPN http/1.1, then
/// the upgrade.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_websocket_agent_reaches_its_server_only_through_the_proxy() {
    let connected = only_through_the_proxy(&["--transports=websocket"]).await;
    assert_eq!(connected["transport"], "websocket", "{connected}");
}

/// QUIC cannot pass an HTTP CONNECT proxy: a `quic,h2` agent whose server is behind
/// one goes on over h2 through the proxy at once (no QUIC handshake is tried).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quic_first_agent_behind_a_proxy_goes_on_over_h2() {
    let connected = only_through_the_proxy(&["--transports=quic,h2"]).await;
    assert_eq!(connected["transport"], "h2", "{connected}");
}

/// An agent with `args` whose only way to its server is tinyproxy reaches it there,
/// carries a tunnel, and never shows the proxy's password; its "connected" event.
async fn only_through_the_proxy(args: &[&str]) -> serde_json::Value {
    let site = Site::new().await;
    // The node cannot reach the server's port itself: only the proxy (on the host) can.
    let port = site.server.agent.port().to_string();
    site.node.iptables(&[
        "-A",
        "OUTPUT",
        "-p",
        "tcp",
        "-d",
        &site.node.host_ip,
        "--dport",
        &port,
        "-j",
        "DROP",
    ]);
    let url = site.proxy.url(PASSWORD);
    let agent = site.agent_with(&[("HTTPS_PROXY", &url)], args);
    site.server.wait_agents(1).await;
    site.fetch_page().await;

    assert!(
        site.proxy.connects_to(site.server.agent) >= 1,
        "tinyproxy logged no CONNECT to {}",
        site.server.agent
    );
    let route = agent.proc.wait_event(
        "reaching the proxy server through the egress proxy",
        START_TIMEOUT,
        |_| true,
    );
    let shown = format!("http://{USER}:***@{}", site.proxy.addr);
    assert_eq!(route["egress_proxy"], shown.as_str(), "{route}");
    let connected = agent
        .proc
        .wait_event("connected to proxy server", START_TIMEOUT, |_| true);
    assert_eq!(connected["via"], shown.as_str(), "{connected}");
    assert_no_password(&agent);
    connected
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_proxy_naming_the_server_goes_directly() {
    let site = Site::new().await;
    let url = site.proxy.url(PASSWORD);
    // Lower case, with a CIDR and a name beside the server's address: Go's forms.
    let no_proxy = format!("example.com,10.255.0.0/16,{}", site.node.host_ip);
    let agent = site.agent(&[("https_proxy", &url), ("no_proxy", &no_proxy)]);
    site.server.wait_agents(1).await;
    site.fetch_page().await;

    let connected = agent
        .proc
        .wait_event("connected to proxy server", START_TIMEOUT, |_| true);
    assert_eq!(connected["via"], "direct", "{connected}");
    assert!(agent.proc.logged("reaching the proxy server directly"));
    assert_eq!(
        site.proxy.connects_to(site.server.agent),
        0,
        "the agent went through the proxy although NO_PROXY names the server"
    );
    assert_no_password(&agent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wrong_password_is_a_proxy_failure_that_never_shows_the_password() {
    let site = Site::new().await;
    let wrong = format!("{PASSWORD}-wrong");
    let url = site.proxy.url(&wrong);
    let agent = site.agent(&[("HTTPS_PROXY", &url)]);
    let failed = agent.proc.wait_event(
        "proxy server stream down; reconnecting",
        START_TIMEOUT,
        |_| true,
    );
    let error = failed["error"].as_str().unwrap_or_default();
    // tinyproxy before 1.11.2 (Debian 12 has 1.11.1) answers 401 where the standard
    // (and squid) says 407.
    let refused = format!("the egress proxy {} refused CONNECT: ", site.proxy.addr);
    assert!(
        error.contains(&format!("{refused}401 Unauthorized"))
            || error.contains(&format!("{refused}407 Proxy Authentication Required")),
        "{error}"
    );
    assert!(error.contains("check the user and password"), "{error}");

    let page = wait_until("the proxy failure counted", START_TIMEOUT, || async {
        let page = agent.metrics().await;
        let n = metric(
            &page,
            "tether_agent_server_connect_failures_total{reason=\"proxy\"}",
        )?;
        (n >= 1.0).then_some(page)
    })
    .await;
    assert_eq!(
        metric(
            &page,
            "konnectivity_network_proxy_agent_open_server_connections"
        ),
        Some(0.0)
    );
    let page = site.server.metrics().await;
    assert_eq!(
        metric(
            &page,
            "konnectivity_network_proxy_server_ready_backend_connections"
        ),
        Some(0.0)
    );
    assert!(site.proxy.connects_to(site.server.agent) >= 1);
    // Let a few more attempts fail before looking at the whole log (the wrong password
    // starts with the right one: one check covers both).
    wait_until("more failed attempts", Duration::from_secs(10), || {
        let failures = agent
            .proc
            .count_events("proxy server stream down; reconnecting");
        async move { (failures >= 3).then_some(()) }
    })
    .await;
    assert_no_password(&agent);
}

//! Dev-only test helpers: a throwaway PKI in a temporary directory, real `tether`
//! server and agent processes (JSON logs parsed for readiness, killed on drop), test
//! backends on port 0, and `wait_until` with a deadline instead of sleeps.

pub mod arp;
pub mod backend;
pub mod ccm;
pub mod generated;
pub mod installed;
pub mod kube;
pub mod kubectl;
pub mod netns;
pub mod nginx;
pub mod node;
pub mod process;
pub mod refusals;
pub mod rogue;
pub mod webhook;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use process::{AgentProc, Proc, ServerProc};

/// A temporary directory removed on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// A fresh directory under the system temp dir.
    pub fn new(prefix: &str) -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "{prefix}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A throwaway PKI (see [`tether_certs::DevPki`]) that lives as long as this value.
///
/// Its `files.agent_cert` is a **fleet** certificate (CN `system:konnectivity-agent`,
/// no node), as upstream's examples share one among all agents: tests that start many
/// agents, or test routing by what agents claim, are then independent of identity.
/// Tests of identity give agents per-node certificates ([`Pki::node_cert_args`]), as
/// `tether certs agent`, `tether certs dev` and `tether local` make them.
#[derive(Debug)]
pub struct Pki {
    /// The files.
    pub files: tether_certs::DevPki,
    dir: TempDir,
}

impl Pki {
    /// Generates a new PKI.
    pub fn new() -> Self {
        Self::with_sans(&[])
    }

    /// A new PKI whose server certificate also covers `sans` (e.g. veth addresses).
    pub fn with_sans(sans: &[String]) -> Self {
        let dir = TempDir::new("tether-pki");
        let mut files =
            tether_certs::DevPki::generate_with_sans(dir.path(), sans).expect("generate PKI");
        let ca = tether_certs::Ca::load(&files.ca_cert, &files.ca_key).expect("the CA");
        let fleet = ca
            .issue(&tether_certs::LeafSpec {
                common_name: "system:konnectivity-agent".into(),
                client: true,
                ..Default::default()
            })
            .expect("a fleet certificate");
        (files.agent_cert, files.agent_key) =
            tether_certs::write_pair(dir.path(), "fleet-agent", &fleet).expect("written");
        Pki { files, dir }
    }

    /// The files `tether certs dev --out DIR` wrote, as they are (agent.crt is then
    /// node local-agent's, not a fleet certificate). The directory is removed with the
    /// value.
    pub fn from_dev_dir(dir: &Path) -> Self {
        let f = |name: &str| dir.join(name);
        let files = tether_certs::DevPki {
            dir: dir.to_path_buf(),
            ca_cert: f("ca.crt"),
            ca_key: f("ca.key"),
            server_cert: f("server.crt"),
            server_key: f("server.key"),
            frontend_ca_cert: f("frontend-ca.crt"),
            frontend_ca_key: f("frontend-ca.key"),
            frontend_cert: f("frontend-client.crt"),
            frontend_key: f("frontend-client.key"),
            agent_cert: f("agent.crt"),
            agent_key: f("agent.key"),
        };
        Pki {
            files,
            dir: TempDir(dir.to_path_buf()),
        }
    }

    /// The directory (also a good place for sockets).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// A client TLS config trusting this CA and presenting the frontend client cert.
    pub fn frontend_client_tls(&self) -> Arc<rustls::ClientConfig> {
        tether_core::tls::client_config(
            &self.files.ca_cert,
            Some((&self.files.frontend_cert, &self.files.frontend_key)),
            &[tether_core::tls::ALPN_H2],
        )
        .expect("client TLS config")
    }

    /// A per-node agent client certificate, as `tether certs agent` writes it
    /// (O=system:konnectivity-agents, CN and DNS SAN the node, `ip` as IP SAN), signed by
    /// this CA: `--agent-cert` and `--agent-key` flags.
    pub fn node_cert_args(&self, node: &str, ip: &str) -> Vec<String> {
        let ca = tether_certs::Ca::load(&self.files.ca_cert, &self.files.ca_key).expect("the CA");
        // Several addresses comma-separated, as a kubelet's --node-ip.
        let ips: Vec<String> = ip.split(',').map(str::to_string).collect();
        let spec = tether_certs::node_agent_spec(node, &ips, Default::default(), 0);
        let pair = ca.issue(&spec).expect("a node certificate");
        let (cert, key) =
            tether_certs::write_pair(self.dir(), &format!("agent-{node}"), &pair).expect("written");
        vec![
            format!("--agent-cert={}", cert.display()),
            format!("--agent-key={}", key.display()),
        ]
    }

    /// Agent flags for node `node` at `ip`: [`Pki::node_cert_args`], its ID and the
    /// identifiers naming both (what the server can verify).
    pub fn node_agent_args(&self, node: &str, ip: &str) -> Vec<String> {
        let mut args = self.node_cert_args(node, ip);
        args.push(format!("--agent-id={node}"));
        args.push(format!("--agent-identifiers=host={node}&ipv4={ip}"));
        args
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}

/// Polls `probe` until it returns `Some`, failing the test after `timeout`.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A plain HTTP/1.0 GET; returns (status, body).
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// Reads one metric sample value (`name{labels} value`) from a Prometheus text page.
pub fn metric(page: &str, name_with_labels: &str) -> Option<f64> {
    page.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (key, value) = l.rsplit_once(' ')?;
        (key == name_with_labels).then(|| value.parse().ok())?
    })
}

/// Opens a TLS connection to `addr` (server name 127.0.0.1) with `tls`.
pub async fn tls_connect(
    addr: std::net::SocketAddr,
    tls: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name =
        rustls_pki_types::ServerName::try_from(addr.ip().to_string()).expect("IP server name");
    tokio_rustls::TlsConnector::from(tls)
        .connect(name, tcp)
        .await
}

/// The token directories `tether ccm --use-service-account-credentials` (process
/// `pid`) made in the temp dir.
pub fn ccm_token_dirs(pid: u32) -> Vec<PathBuf> {
    let prefix = format!("tether-ccm-tokens-{pid}-");
    std::fs::read_dir(std::env::temp_dir())
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Stops a CCM that uses per-controller credentials with SIGTERM, as a kubelet does,
/// and checks that its tokens left the disk with it.
pub fn stop_ccm_and_check_its_tokens_are_gone(ccm: &mut Proc) {
    let tokens = ccm_token_dirs(ccm.pid());
    assert_eq!(
        tokens.len(),
        1,
        "one token directory while it runs: {tokens:?}"
    );
    ccm.signal("TERM");
    assert!(
        ccm.wait_exit(Duration::from_secs(60)).is_some(),
        "the CCM stops on SIGTERM"
    );
    assert!(
        tokens.iter().all(|d| !d.exists()),
        "its tokens are removed when it stops: {tokens:?}"
    );
}

/// A hand-driven agent's connection: one mutual-TLS HTTP/2 channel to the agent
/// listener at `server` (on 127.0.0.1), trusting `ca` and presenting `identity` when
/// given, with HTTP/2's default 64 KiB windows (what a real agent advertises; hyper's
/// 2 MiB would take long to fill on a slow machine). Streams opened on it share the
/// connection.
pub async fn agent_channel(
    server: std::net::SocketAddr,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> tonic::transport::Channel {
    agent_channel_with(server, ca, identity, false).await
}

/// [`agent_channel`], connected only when first used when `lazy` (an attacker over
/// another transport, whose address speaks no HTTP/2).
pub async fn agent_channel_with(
    server: std::net::SocketAddr,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    lazy: bool,
) -> tonic::transport::Channel {
    let tls = tether_core::tls::client_config(ca, identity, &[b"h2"]).expect("client TLS");
    let authority = server.to_string();
    let connector = tower::service_fn(move |_| {
        let (tls, authority) = (tls.clone(), authority.clone());
        async move {
            let name = tether_core::tls::server_name("127.0.0.1").expect("a server name");
            let tls = tether_core::transport::connect_tls(&authority, name, tls).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tls))
        }
    });
    let endpoint = tonic::transport::Endpoint::from_static("http://127.0.0.1")
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535);
    if lazy {
        return endpoint.connect_with_connector_lazy(connector);
    }
    endpoint
        .connect_with_connector(connector)
        .await
        .expect("connected to the agent listener")
}

/// Writes `request` and reads the response head (up to the blank line).
pub async fn request_head<S>(sock: &mut S, request: &[u8]) -> std::io::Result<String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    sock.write_all(request).await?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if sock.read(&mut byte).await? == 0 {
            break;
        }
        head.push(byte[0]);
    }
    Ok(String::from_utf8_lossy(&head).to_string())
}

impl Pki {
    /// A client TLS config for the HTTP-CONNECT frontend (ALPN http/1.1).
    pub fn frontend_http_tls(&self) -> Arc<rustls::ClientConfig> {
        tether_core::tls::client_config(
            &self.files.ca_cert,
            Some((&self.files.frontend_cert, &self.files.frontend_key)),
            &[tether_core::tls::ALPN_HTTP11],
        )
        .expect("client TLS config")
    }
}

/// Writes a self-signed certificate that expired yesterday to `path`.
pub fn write_expired_cert(path: &Path) {
    let mut params = rcgen::CertificateParams::new(vec!["expired.test".to_string()]).unwrap();
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(30);
    params.not_after = now - time::Duration::days(1);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    std::fs::write(path, cert.pem()).unwrap();
}

/// Replaces `dst` with the contents of `src` atomically (write + rename), as a
/// certificate manager would.
pub fn replace_file(src: &Path, dst: &Path) {
    let tmp = dst.with_extension("tmp");
    std::fs::copy(src, &tmp).unwrap();
    std::fs::rename(&tmp, dst).unwrap();
}

//! Debian's nginx as a TLS-terminating reverse proxy in front of the server's agent
//! port: HTTP/1.1 only on both sides (no HTTP/2), WebSocket upgrades passed on, and a
//! fresh TLS connection to the server (verified against the PKI's CA, optionally with a
//! client certificate of the proxy's own). What an HTTP/1.1-only path in front of the
//! control plane looks like to an agent.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::process::{Proc, START_TIMEOUT};

/// The nginx binary (`scripts/install-deps.sh` installs Debian's nginx-light).
pub fn binary() -> PathBuf {
    ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .expect("nginx is not installed: run scripts/install-deps.sh")
}

/// How nginx reaches the server.
pub struct Upstream<'a> {
    /// The server's agent port.
    pub addr: SocketAddr,
    /// The CA nginx verifies the server's certificate with.
    pub ca: &'a Path,
    /// The name it verifies the server as.
    pub name: &'a str,
    /// The certificate and key nginx presents to the server, if any: the server then
    /// takes nginx for the agent that certificate names, so nginx itself requires and
    /// verifies the agents' certificates (against `ca`), as it must where it does this.
    pub client: Option<(&'a Path, &'a Path)>,
}

/// A running nginx; stopped when dropped.
pub struct Nginx {
    _proc: Proc,
    /// Where it listens (TLS).
    pub addr: SocketAddr,
    dir: PathBuf,
}

impl Nginx {
    /// Starts nginx on `ip` at a free port, serving TLS with `cert` and `key`, and
    /// proxying everything to `upstream`; waits until it accepts connections.
    pub async fn start(
        dir: &Path,
        ip: &str,
        cert: &Path,
        key: &Path,
        upstream: &Upstream<'_>,
    ) -> Nginx {
        let dir = dir.join("nginx");
        std::fs::create_dir_all(dir.join("temp")).unwrap();
        let port = crate::kube::free_port();
        let addr: SocketAddr = format!("{ip}:{port}").parse().unwrap();
        let (client, verify) = upstream
            .client
            .map(|(c, k)| {
                (
                    format!(
                        "proxy_ssl_certificate {};\n      proxy_ssl_certificate_key {};",
                        c.display(),
                        k.display()
                    ),
                    format!(
                        "ssl_verify_client on;\n    ssl_client_certificate {};",
                        upstream.ca.display()
                    ),
                )
            })
            .unwrap_or_default();
        let d = dir.display();
        let conf = format!(
            r#"daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log info;
events {{ worker_connections 256; }}
http {{
  access_log {d}/access.log;
  client_body_temp_path {d}/temp/body;
  proxy_temp_path {d}/temp/proxy;
  fastcgi_temp_path {d}/temp/fastcgi;
  uwsgi_temp_path {d}/temp/uwsgi;
  scgi_temp_path {d}/temp/scgi;
  map $http_upgrade $connection_upgrade {{ default upgrade; '' close; }}
  server {{
    listen {addr} ssl;
    ssl_certificate {cert};
    ssl_certificate_key {key};
    {verify}
    location / {{
      proxy_pass https://{upstream};
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection $connection_upgrade;
      proxy_ssl_verify on;
      proxy_ssl_trusted_certificate {ca};
      proxy_ssl_name {name};
      proxy_ssl_server_name on;
      {client}
      proxy_read_timeout 1h;
      proxy_send_timeout 1h;
    }}
  }}
}}
"#,
            cert = cert.display(),
            key = key.display(),
            upstream = upstream.addr,
            ca = upstream.ca.display(),
            name = upstream.name,
        );
        let path = dir.join("nginx.conf");
        std::fs::write(&path, conf).unwrap();
        let proc = Proc::spawn(
            "nginx",
            &binary(),
            &[
                "-e".into(),
                dir.join("error.log").display().to_string(),
                "-c".into(),
                path.display().to_string(),
            ],
        );
        crate::wait_until("nginx accepts connections", START_TIMEOUT, || async move {
            tokio::net::TcpStream::connect(addr).await.ok().map(|_| ())
        })
        .await;
        Nginx {
            _proc: proc,
            addr,
            dir,
        }
    }

    /// nginx's access log so far: one line per request (an upgraded WebSocket's when
    /// it ends).
    pub fn access_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("access.log")).unwrap_or_default()
    }

    /// nginx's error log so far.
    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("error.log")).unwrap_or_default()
    }
}

/// How long an agent through nginx may take to connect: a failed h2 attempt first,
/// then WebSocket.
pub const CONNECT_WITHIN: Duration = Duration::from_secs(30);

//! The CONNECT exchange with an egress proxy: TCP to it (and TLS, for an https://
//! proxy), one CONNECT request, a response head read with a bound and a timeout, and
//! the tunnel it leaves, over which the agent runs its own TLS to the server.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tether_core::transport::{self, ClientTls};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::either::Either;

use super::address::{ProxyUrl, Scheme};

/// What carries the agent's TLS to a server: TCP (to the server itself, or a tunnel
/// through a plain-HTTP proxy), or a tunnel inside TLS to an https:// proxy.
pub type Carrier = Either<TcpStream, Box<ClientTls>>;

/// The longest response head a proxy may send.
pub const HEAD_LIMIT: usize = 64 << 10;

/// How long reaching the proxy and its answer to CONNECT may take (the proxy answers
/// once it has connected to the server).
pub const PROXY_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest piece of a proxy's status line an error quotes.
const STATUS_SHOWN: usize = 200;

/// Why no tunnel through the egress proxy was opened. Messages name the proxy by its
/// address and never carry its password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyError {
    /// TCP to the proxy failed.
    #[error("cannot reach the egress proxy {proxy}: check its address in HTTPS_PROXY or --egress-proxy, and that this node may connect to it")]
    Unreachable {
        /// The proxy's address.
        proxy: String,
        /// The connect error.
        #[source]
        source: io::Error,
    },
    /// The TLS handshake with an https:// proxy failed.
    #[error("TLS with the egress proxy {proxy} failed: an https:// proxy URL means TLS to the proxy, verified with --egress-proxy-ca-cert (else the system roots); write http:// for a proxy that speaks plain HTTP")]
    Tls {
        /// The proxy's address.
        proxy: String,
        /// The handshake error.
        #[source]
        source: io::Error,
    },
    /// Writing CONNECT or reading the answer failed.
    #[error("the egress proxy {proxy} broke off the CONNECT exchange")]
    Exchange {
        /// The proxy's address.
        proxy: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The answer is no HTTP/1.x response head.
    #[error("the egress proxy {proxy} answered CONNECT with {what}: is it an HTTP proxy?")]
    Malformed {
        /// The proxy's address.
        proxy: String,
        /// What was wrong.
        what: String,
    },
    /// The proxy answered with a status other than 200.
    #[error("the egress proxy {proxy} refused CONNECT: {status}{}", hint(*code))]
    Refused {
        /// The proxy's address.
        proxy: String,
        /// The status code.
        code: u16,
        /// The status line's code and reason (`407 Proxy Authentication Required`).
        status: String,
    },
    /// No answer in time.
    #[error("the egress proxy {proxy} did not answer CONNECT within {after:?}")]
    Timeout {
        /// The proxy's address.
        proxy: String,
        /// The limit.
        after: Duration,
    },
}

/// What to check after a refusal with `code`.
fn hint(code: u16) -> &'static str {
    match code {
        // 401: what tinyproxy before 1.11.2 answers for wrong credentials.
        401 | 407 => " (check the user and password in the proxy URL)",
        403 => " (the proxy does not allow this server: ask for its address and port to be allowed, or list it in NO_PROXY)",
        502..=504 => " (the proxy could not reach the server)",
        _ => "",
    }
}

/// Opens a tunnel to `target` (`host:port`) through `proxy`: TCP (closed by the kernel
/// after `dead_link` of silence), TLS with `tls` for an https:// proxy, then CONNECT,
/// all within [`PROXY_TIMEOUT`].
pub async fn tunnel(
    proxy: &ProxyUrl,
    target: &str,
    tls: Option<Arc<rustls::ClientConfig>>,
    dead_link: Option<Duration>,
) -> Result<Carrier, ProxyError> {
    let addr = proxy.authority();
    let open = async {
        let tcp = transport::connect_tcp(&addr, dead_link)
            .await
            .map_err(|source| ProxyError::Unreachable {
                proxy: addr.clone(),
                source,
            })?;
        match (proxy.scheme(), tls) {
            (Scheme::Https, Some(tls)) => {
                let mut stream = handshake_tls(proxy, tcp, tls).await?;
                connect(&mut stream, proxy, target).await?;
                Ok(Either::Right(Box::new(stream)))
            }
            _ => {
                let mut tcp = tcp;
                connect(&mut tcp, proxy, target).await?;
                Ok(Either::Left(tcp))
            }
        }
    };
    tokio::time::timeout(PROXY_TIMEOUT, open)
        .await
        .unwrap_or_else(|_| {
            Err(ProxyError::Timeout {
                proxy: addr.clone(),
                after: PROXY_TIMEOUT,
            })
        })
}

/// TLS to an https:// proxy, verified as its URL's host.
async fn handshake_tls(
    proxy: &ProxyUrl,
    tcp: TcpStream,
    tls: Arc<rustls::ClientConfig>,
) -> Result<ClientTls, ProxyError> {
    let failed = |source| ProxyError::Tls {
        proxy: proxy.authority(),
        source,
    };
    let name = tether_core::tls::server_name(proxy.host())
        .map_err(|e| failed(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
    transport::tls_over(tcp, name, tls).await.map_err(failed)
}

/// Sends CONNECT for `target` over `io` and reads the proxy's answer: Ok once the
/// proxy answered 200 and the tunnel is open.
pub async fn connect<S>(io: &mut S, proxy: &ProxyUrl, target: &str) -> Result<(), ProxyError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let broke = |source| ProxyError::Exchange {
        proxy: proxy.authority(),
        source,
    };
    io.write_all(request(proxy, target).as_bytes())
        .await
        .map_err(broke)?;
    io.flush().await.map_err(broke)?;
    let (head, extra) = read_head(io).await.map_err(|e| match e {
        HeadError::Io(source) => broke(source),
        HeadError::Malformed(what) => ProxyError::Malformed {
            proxy: proxy.authority(),
            what,
        },
    })?;
    let (code, status) = status(&head, proxy.password()).map_err(|what| ProxyError::Malformed {
        proxy: proxy.authority(),
        what,
    })?;
    if code != 200 {
        return Err(ProxyError::Refused {
            proxy: proxy.authority(),
            code,
            status,
        });
    }
    if extra {
        // The server speaks only after the agent's ClientHello: nothing of the tunnel
        // can have come yet.
        return Err(ProxyError::Malformed {
            proxy: proxy.authority(),
            what: "bytes after its 200 response, before the agent sent any".into(),
        });
    }
    Ok(())
}

/// The CONNECT request as grpc-go writes it: the target as request-target and Host,
/// a User-Agent, and Basic credentials from the URL's user info.
fn request(proxy: &ProxyUrl, target: &str) -> String {
    let mut req = format!(
        "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nUser-Agent: tether-agent/{}\r\n",
        env!("CARGO_PKG_VERSION")
    );
    if let Some(auth) = proxy.basic_auth() {
        req.push_str(&format!("Proxy-Authorization: {auth}\r\n"));
    }
    req.push_str("\r\n");
    req
}

/// Why a response head could not be read.
enum HeadError {
    Io(io::Error),
    Malformed(String),
}

/// Reads up to the blank line ending the response head (CRLF or, as Go tolerates, bare
/// LF line ends), at most [`HEAD_LIMIT`] bytes; also says whether bytes followed it.
async fn read_head<S: AsyncRead + Unpin>(io: &mut S) -> Result<(Vec<u8>, bool), HeadError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = head_end(&buf) {
            let extra = buf.len() > end;
            buf.truncate(end);
            return Ok((buf, extra));
        }
        if buf.len() >= HEAD_LIMIT {
            return Err(HeadError::Malformed(format!(
                "a response head longer than {} KiB",
                HEAD_LIMIT >> 10
            )));
        }
        let room = chunk.len().min(HEAD_LIMIT + 4 - buf.len());
        let n = io.read(&mut chunk[..room]).await.map_err(HeadError::Io)?;
        if n == 0 {
            return Err(HeadError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the proxy closed the connection before the end of its response head",
            )));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Where the head in `buf` ends (just past its blank line), if it does.
fn head_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while let Some(lf) = buf[i..].iter().position(|b| *b == b'\n') {
        let at = i + lf + 1;
        match buf.get(at..) {
            Some([b'\n', ..]) => return Some(at + 1),
            Some([b'\r', b'\n', ..]) => return Some(at + 2),
            _ => i = at,
        }
    }
    None
}

/// The status code and the printable `CODE REASON` of a head's status line
/// (`HTTP/1.1 407 Proxy Authentication Required`), with any echo of `password` masked.
fn status(head: &[u8], password: Option<&[u8]>) -> Result<(u16, String), String> {
    let line = head.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let line: String = String::from_utf8_lossy(line)
        .chars()
        .map(|c| if c.is_ascii_graphic() { c } else { ' ' })
        .take(STATUS_SHOWN)
        .collect();
    let line = match password.map(String::from_utf8_lossy) {
        Some(p) if !p.is_empty() => line.replace(p.as_ref(), "***"),
        _ => line,
    };
    let (version, rest) = line.split_once(' ').unwrap_or((&line, ""));
    let code = rest.get(..3).and_then(|c| c.parse::<u16>().ok());
    match code {
        Some(code) if version.starts_with("HTTP/1.") && (100..600).contains(&code) => {
            Ok((code, rest.trim().to_string()))
        }
        _ => Err(format!("the status line {line:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{duplex, AsyncBufReadExt, BufReader};

    /// Runs CONNECT over an in-memory pipe whose far end answers `answer` once it has
    /// read the request head; returns the result and the request.
    async fn exchange(url: &str, answer: &'static [u8]) -> (Result<(), ProxyError>, String) {
        let proxy = ProxyUrl::parse(url).unwrap();
        let (mut near, far) = duplex(1 << 20);
        let peer = tokio::spawn(async move {
            let mut far = BufReader::new(far);
            let mut req = String::new();
            loop {
                let mut line = String::new();
                far.read_line(&mut line).await.unwrap();
                req.push_str(&line);
                if line == "\r\n" || line.is_empty() {
                    break;
                }
            }
            // Then the far end closes: what is unanswered reads as the end.
            far.get_mut().write_all(answer).await.unwrap();
            req
        });
        let result = connect(&mut near, &proxy, "10.0.0.1:8091").await;
        (result, peer.await.unwrap())
    }

    #[tokio::test]
    async fn connect_with_basic_auth_and_a_200() {
        let (r, req) = exchange(
            "http://user:pass@proxy:3128",
            b"HTTP/1.1 200 Connection established\r\n\r\n",
        )
        .await;
        r.unwrap();
        assert!(req.starts_with("CONNECT 10.0.0.1:8091 HTTP/1.1\r\nHost: 10.0.0.1:8091\r\n"));
        assert!(
            req.contains("\r\nProxy-Authorization: Basic dXNlcjpwYXNz\r\n"),
            "{req}"
        );
        // HTTP/1.0 and bare LF line ends are answers too, as Go reads them.
        let (r, req) = exchange("proxy:3128", b"HTTP/1.0 200 OK\nVia: x\n\n").await;
        r.unwrap();
        assert!(!req.contains("Proxy-Authorization"), "{req}");
    }

    #[tokio::test]
    async fn refusals_name_the_status_line_and_never_the_password() {
        let (r, _) = exchange(
            "http://user:hunter2@10.0.0.9:3128",
            b"HTTP/1.1 407 Proxy Authentication Required hunter2\r\nProxy-Authenticate: Basic\r\n\r\nbody",
        )
        .await;
        let e = r.unwrap_err();
        assert!(matches!(e, ProxyError::Refused { code: 407, .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.starts_with(
                "the egress proxy 10.0.0.9:3128 refused CONNECT: 407 Proxy Authentication Required"
            ),
            "{msg}"
        );
        assert!(!msg.contains("hunter2"), "{msg}");
        let (r, _) = exchange("proxy:3128", b"HTTP/1.1 502 Bad Gateway\r\n\r\n").await;
        assert!(r
            .unwrap_err()
            .to_string()
            .contains("could not reach the server"));
        // A 2xx other than 200 is a refusal too, as grpc-go has it.
        let (r, _) = exchange("proxy:3128", b"HTTP/1.1 204 No Content\r\n\r\n").await;
        assert!(matches!(r, Err(ProxyError::Refused { code: 204, .. })));
    }

    #[tokio::test]
    async fn malformed_answers() {
        for answer in [
            &b"SSH-2.0-OpenSSH_9.2\r\n\r\n"[..],
            b"HTTP/1.1 abc\r\n\r\n",
            b"HTTP/2 200\r\n\r\n",
        ] {
            let answer: &'static [u8] = Box::leak(answer.to_vec().into_boxed_slice());
            let (r, _) = exchange("proxy:3128", answer).await;
            assert!(matches!(r, Err(ProxyError::Malformed { .. })), "{r:?}");
        }
        let (r, _) = exchange("proxy:3128", b"HTTP/1.1 200 OK\r\n\r\nearly").await;
        assert!(matches!(r, Err(ProxyError::Malformed { .. })), "{r:?}");
        let (r, _) = exchange("proxy:3128", b"HTTP/1.1 200 OK\r\n").await;
        assert!(matches!(r, Err(ProxyError::Exchange { .. })), "{r:?}");
    }

    #[tokio::test]
    async fn an_endless_head_is_cut_at_the_limit() {
        let proxy = ProxyUrl::parse("proxy:3128").unwrap();
        let (mut near, mut far) = duplex(1 << 20);
        let feeder = tokio::spawn(async move {
            let mut sink = [0u8; 1024];
            let _ = far.read(&mut sink).await;
            let _ = far.write_all(b"HTTP/1.1 200 OK\r\n").await;
            let line = [b'x'; 1000];
            while far.write_all(&line).await.is_ok() {}
        });
        let r = connect(&mut near, &proxy, "s:1").await;
        assert!(
            matches!(&r, Err(ProxyError::Malformed { what, .. }) if what.contains("64 KiB")),
            "{r:?}"
        );
        drop(near);
        feeder.await.unwrap();
    }

    /// An https:// proxy on 127.0.0.1 (the dev PKI's server certificate) that answers
    /// every CONNECT with 200 and then splices to what was named; its address and CA.
    async fn tls_proxy(dir: &std::path::Path) -> (String, std::path::PathBuf) {
        let pki = tether_certs::DevPki::generate(dir).unwrap();
        let files = tether_core::tls::TlsFiles {
            cert: pki.server_cert.clone(),
            key: pki.server_key.clone(),
            ca: None,
            policy: Default::default(),
        };
        let config = tether_core::tls::server_config(&files, &[b"http/1.1"]).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let hard_stop = tokio_util::sync::CancellationToken::new();
        let mut incoming = transport::tls_incoming(
            listener,
            Arc::new(move || config.clone()),
            "test-proxy",
            hard_stop.clone(),
        );
        tokio::spawn(async move {
            let _keep = hard_stop.drop_guard();
            while let Some(conn) = incoming.recv().await {
                tokio::spawn(async move {
                    let mut conn = BufReader::new(conn);
                    let mut line = String::new();
                    conn.read_line(&mut line).await.unwrap();
                    let target = line.split(' ').nth(1).unwrap().to_string();
                    while line != "\r\n" {
                        line.clear();
                        conn.read_line(&mut line).await.unwrap();
                    }
                    let mut upstream = TcpStream::connect(target).await.unwrap();
                    conn.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                        .await
                        .unwrap();
                    let _ = tokio::io::copy_bidirectional(&mut conn, &mut upstream).await;
                });
            }
        });
        (addr, pki.ca_cert)
    }

    #[tokio::test]
    async fn a_tunnel_inside_tls_to_an_https_proxy() {
        let dir = std::env::temp_dir().join(format!("tether-tls-proxy-{}", std::process::id()));
        let (proxy_addr, ca) = tls_proxy(&dir).await;
        let echo = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = echo.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (s, _) = echo.accept().await.unwrap();
            let (mut r, mut w) = s.into_split();
            let _ = tokio::io::copy(&mut r, &mut w).await;
        });
        let proxy = ProxyUrl::parse(&format!("https://u:p@{proxy_addr}")).unwrap();
        let tls = tether_core::tls::client_config(&ca, None, &[b"http/1.1"]).unwrap();
        let mut carrier = tunnel(&proxy, &target, Some(tls), None).await.unwrap();
        assert!(matches!(carrier, Either::Right(_)), "a TLS carrier");
        carrier.write_all(b"ping").await.unwrap();
        let mut pong = [0u8; 4];
        carrier.read_exact(&mut pong).await.unwrap();
        assert_eq!(&pong, b"ping");

        // A proxy whose certificate the given CA does not sign is refused, with a hint.
        let other = dir.join("other");
        let stranger = tether_certs::DevPki::generate(&other).unwrap().ca_cert;
        let tls = tether_core::tls::client_config(&stranger, None, &[]).unwrap();
        let e = match tunnel(&proxy, &target, Some(tls), None).await {
            Err(e) => e,
            Ok(_) => panic!("a proxy with an unknown CA was trusted"),
        };
        assert!(matches!(e, ProxyError::Tls { .. }), "{e}");
        assert!(e.to_string().contains("write http://"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn an_unreachable_proxy() {
        // A port nothing listens on: bound, then closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let proxy = ProxyUrl::parse(&format!("127.0.0.1:{port}")).unwrap();
        let e = match tunnel(&proxy, "s:1", None, None).await {
            Err(e) => e,
            Ok(_) => panic!("connected to a closed port"),
        };
        assert!(matches!(e, ProxyError::Unreachable { .. }), "{e}");
    }

    #[test]
    fn head_ends() {
        assert_eq!(head_end(b"HTTP/1.1 200 OK\r\n\r\n"), Some(19));
        assert_eq!(head_end(b"HTTP/1.1 200 OK\n\nx"), Some(17));
        assert_eq!(head_end(b"HTTP/1.1 200 OK\r\nA: b\r\n"), None);
        assert_eq!(head_end(b""), None);
    }
}

//! Test backends on 127.0.0.1:0: an HTTP responder, an echo server, a listener whose
//! connects hang, and a bulk source/sink with checksums.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// A running test backend; stops on drop.
#[derive(Debug)]
pub struct Backend {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve<F, Fut>(ip: &str, handler: F) -> Backend
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind((ip, 0)).await.expect("bind backend");
    serve_on(listener, handler)
}

fn serve_on<F, Fut>(listener: TcpListener, handler: F) -> Backend
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    let task = tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(handler(s));
        }
    });
    Backend {
        addr,
        accepted,
        task,
    }
}

/// Answers any HTTP request with 200 and `body`.
pub async fn http(body: &'static str) -> Backend {
    http_on("127.0.0.1", body).await
}

/// [`http`] on a chosen loopback address (e.g. 127.0.0.2 for destHost tests).
pub async fn http_on(ip: &str, body: &'static str) -> Backend {
    serve(ip, move |mut s| async move {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let _ = s.write_all(resp.as_bytes()).await;
        let _ = s.shutdown().await;
    })
    .await
}

/// Echoes every byte back.
pub async fn echo() -> Backend {
    echo_on("127.0.0.1").await
}

/// Echoes one connection's bytes back until it ends.
async fn echo_conn(s: tokio::net::TcpStream) {
    let (mut r, mut w) = s.into_split();
    let _ = tokio::io::copy(&mut r, &mut w).await;
}

/// [`echo`] on a chosen local address (e.g. a veth address nodes reach).
pub async fn echo_on(ip: &str) -> Backend {
    serve(ip, echo_conn).await
}

/// [`echo`] on `ip` inside network namespace `ns` (a node's loopback, where its agent
/// dials as it would a kubelet): the listening socket is made there, served from here.
pub async fn echo_in(ns: &str, ip: std::net::IpAddr) -> Backend {
    let ns = ns.to_string();
    let std = std::thread::spawn(move || -> std::io::Result<std::net::TcpListener> {
        crate::netns::enter(&ns)?;
        let l = std::net::TcpListener::bind((ip, 0))?;
        l.set_nonblocking(true)?;
        Ok(l)
    })
    .join()
    .expect("the namespace thread")
    .expect("bind an echo backend in the namespace");
    let listener = TcpListener::from_std(std).expect("register the echo backend");
    serve_on(listener, echo_conn)
}

/// Reads `n` bytes while writing `n` pseudo-random bytes (seeded by the first 8 bytes
/// the client sends), then writes the FNV-1a checksum of what it read as 8 bytes.
pub async fn bulk() -> Backend {
    serve("127.0.0.1", |s| async move {
        let (mut r, mut w) = s.into_split();
        let mut head = [0u8; 16];
        if r.read_exact(&mut head).await.is_err() {
            return;
        }
        let seed = u64::from_le_bytes(head[..8].try_into().unwrap());
        let n = u64::from_le_bytes(head[8..].try_into().unwrap());
        let writer = tokio::spawn(async move {
            let mut gen = Pattern::new(seed);
            let mut left = n;
            let mut buf = vec![0u8; 64 * 1024];
            while left > 0 {
                let k = left.min(buf.len() as u64) as usize;
                gen.fill(&mut buf[..k]);
                if w.write_all(&buf[..k]).await.is_err() {
                    return None;
                }
                left -= k as u64;
            }
            Some(w)
        });
        let mut sum = Fnv::new();
        let mut left = n;
        let mut buf = vec![0u8; 64 * 1024];
        while left > 0 {
            let k = left.min(buf.len() as u64) as usize;
            match r.read(&mut buf[..k]).await {
                Ok(0) | Err(_) => return,
                Ok(got) => {
                    sum.update(&buf[..got]);
                    left -= got as u64;
                }
            }
        }
        if let Ok(Some(mut w)) = writer.await {
            let _ = w.write_all(&sum.value().to_le_bytes()).await;
            let _ = w.flush().await;
            // Hold the connection until the client closes it.
            let mut rest = [0u8; 1];
            let _ = r.read(&mut rest).await;
        }
    })
    .await
}

/// A listener whose accept queue is full, so new connects to it hang (SYNs dropped)
/// instead of completing or being refused. All on loopback.
#[derive(Debug)]
pub struct Blackhole {
    /// Where connects hang.
    pub addr: SocketAddr,
    _listener: std::net::TcpListener,
    _fillers: Vec<std::net::TcpStream>,
}

impl Blackhole {
    /// Fills the backlog of a never-accepting listener.
    pub fn new() -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        // std's listen backlog is 128; connect until a connect no longer completes fast.
        let mut fillers = Vec::new();
        for _ in 0..1024 {
            match std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_millis(200))
            {
                Ok(s) => fillers.push(s),
                Err(_) => break,
            }
        }
        Blackhole {
            addr,
            _listener: listener,
            _fillers: fillers,
        }
    }
}

impl Default for Blackhole {
    fn default() -> Self {
        Self::new()
    }
}

/// A deterministic byte pattern (xorshift64*).
#[derive(Debug)]
pub struct Pattern(u64);

impl Pattern {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        Pattern(seed | 1)
    }
    /// Fills `buf`.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let v = self.0.wrapping_mul(0x2545F4914F6CDD1D).to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

/// FNV-1a 64-bit.
#[derive(Debug)]
pub struct Fnv(u64);

impl Fnv {
    /// Empty hash.
    pub fn new() -> Self {
        Fnv(0xcbf29ce484222325)
    }
    /// Adds bytes.
    pub fn update(&mut self, data: &[u8]) {
        for b in data {
            self.0 ^= *b as u64;
            self.0 = self.0.wrapping_mul(0x100000001b3);
        }
    }
    /// The hash.
    pub fn value(&self) -> u64 {
        self.0
    }
}

impl Default for Fnv {
    fn default() -> Self {
        Self::new()
    }
}

/// A round-robin TCP load balancer on 127.0.0.1:0, as agents see in front of several
/// servers. A target that refuses the connection is skipped for that client only
/// (like an L4 balancer without health checks, the client sees a closed connection).
#[derive(Debug)]
pub struct LoadBalancer {
    /// Where agents connect.
    pub addr: SocketAddr,
    targets: Arc<std::sync::Mutex<Vec<SocketAddr>>>,
    task: JoinHandle<()>,
}

impl LoadBalancer {
    /// Starts balancing over `targets`.
    pub async fn new(targets: Vec<SocketAddr>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(std::sync::Mutex::new(targets));
        let list = shared.clone();
        let task = tokio::spawn(async move {
            let mut next = 0usize;
            while let Ok((mut client, _)) = listener.accept().await {
                let target = {
                    let l = list.lock().unwrap();
                    if l.is_empty() {
                        continue;
                    }
                    next = next.wrapping_add(1);
                    l[next % l.len()]
                };
                tokio::spawn(async move {
                    if let Ok(mut upstream) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    }
                });
            }
        });
        LoadBalancer {
            addr,
            targets: shared,
            task,
        }
    }

    /// Replaces the targets.
    pub fn set_targets(&self, targets: Vec<SocketAddr>) {
        *self.targets.lock().unwrap() = targets;
    }
}

impl Drop for LoadBalancer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// FNV-1a of the first `n` bytes of `Pattern::new(seed)`.
pub fn pattern_hash(seed: u64, n: u64) -> u64 {
    let mut gen = Pattern::new(seed);
    let mut sum = Fnv::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut left = n;
    while left > 0 {
        let k = left.min(buf.len() as u64) as usize;
        gen.fill(&mut buf[..k]);
        sum.update(&buf[..k]);
        left -= k as u64;
    }
    sum.value()
}

/// Runs the [`bulk`] protocol over `conn`: sends the header, waits for `gate`, then
/// uploads `n` pattern bytes (seed `up`) while downloading `n` (seed `down`), and
/// checks both checksums. `Err` says what went wrong.
pub async fn bulk_exchange<C>(
    conn: C,
    down: u64,
    up: u64,
    n: u64,
    gate: impl std::future::Future<Output = ()>,
) -> Result<(), String>
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let (mut rd, mut wr) = tokio::io::split(conn);
    let mut head = [0u8; 16];
    head[..8].copy_from_slice(&down.to_le_bytes());
    head[8..].copy_from_slice(&n.to_le_bytes());
    wr.write_all(&head)
        .await
        .map_err(|e| format!("header: {e}"))?;
    gate.await;
    let upload = tokio::spawn(async move {
        let mut gen = Pattern::new(up);
        let mut buf = vec![0u8; 64 * 1024];
        let mut left = n;
        while left > 0 {
            let k = left.min(buf.len() as u64) as usize;
            gen.fill(&mut buf[..k]);
            wr.write_all(&buf[..k])
                .await
                .map_err(|e| format!("upload with {left} bytes left: {e}"))?;
            left -= k as u64;
        }
        Ok::<_, String>(wr)
    });
    let mut sum = Fnv::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut left = n;
    while left > 0 {
        let k = left.min(buf.len() as u64) as usize;
        let got = rd
            .read(&mut buf[..k])
            .await
            .map_err(|e| format!("download with {left} bytes left: {e}"))?;
        if got == 0 {
            return Err(format!("tunnel closed with {left} bytes still to come"));
        }
        sum.update(&buf[..got]);
        left -= got as u64;
    }
    let mut remote = [0u8; 8];
    rd.read_exact(&mut remote)
        .await
        .map_err(|e| format!("checksum: {e}"))?;
    let _wr = upload.await.map_err(|e| e.to_string())??;
    if sum.value() != pattern_hash(down, n) {
        return Err("download corrupted".into());
    }
    if u64::from_le_bytes(remote) != pattern_hash(up, n) {
        return Err("upload corrupted".into());
    }
    Ok(())
}

/// Accepts connections and never reads from them (a target whose reader stalled).
pub async fn sink() -> Backend {
    serve("127.0.0.1", |s| async move {
        // Hold the socket open and unread for the rest of the test.
        let _held = s;
        std::future::pending::<()>().await;
    })
    .await
}

/// `n` tunnels through `client` to the echo backend at `echo`, each proven open by one
/// echoed byte.
pub async fn echo_tunnels(
    client: &tether_client::Client,
    echo: SocketAddr,
    n: usize,
) -> Vec<tether_client::TunnelConn> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        let mut c = client.dial(&echo.to_string()).await.unwrap();
        c.write_all(b"x").await.unwrap();
        let mut b = [0u8; 1];
        c.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"x");
        conns.push(c);
    }
    conns
}

//! One load-balancer port's data plane: its accept loop, admission by the Service's
//! source ranges and connection limits (its own and `--lb-max-connections`, shared
//! fairly between busy Services), the next backend that answers through the tunnel,
//! the PROXY header, and the byte splice with its idle timeout.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use tether_client::Client;
use tether_core::error::chain;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::cloud::{Backend, ProxyProtocol, ServiceInfo, ServicePort};

/// Where one port's connections go (changed in place).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PortTarget {
    /// The backend nodes' NodePort.
    NodePort(u16),
    /// Ready endpoints (pod IP, targetPort).
    Endpoints(Vec<SocketAddr>),
}

impl PortTarget {
    pub(super) fn of(svc: &ServiceInfo, port: &ServicePort) -> PortTarget {
        if svc.node_ports {
            PortTarget::NodePort(port.node_port)
        } else {
            PortTarget::Endpoints(port.endpoints.clone())
        }
    }
}

/// One listener: where it forwards (changed in place), its hard stop, and its socket,
/// open as long as this is (after a stop too, until dropped).
pub(super) struct Listener {
    target: Arc<RwLock<PortTarget>>,
    hard_stop: CancellationToken,
    socket: Arc<TcpListener>,
}

impl Listener {
    /// Serves `listener` in a task of its own, forwarding to `target` through
    /// `client`, until [`Listener::stop`].
    pub(super) fn start(
        listener: TcpListener,
        client: Client,
        shared: Shared,
        target: PortTarget,
        span: tracing::Span,
    ) -> Listener {
        let hard_stop = CancellationToken::new();
        let target = Arc::new(RwLock::new(target));
        let socket = Arc::new(listener);
        tokio::spawn(
            serve(
                socket.clone(),
                client,
                shared,
                target.clone(),
                hard_stop.clone(),
            )
            .instrument(span),
        );
        Listener {
            target,
            hard_stop,
            socket,
        }
    }

    /// Closes the door quietly: the kernel drops new connections' SYNs (a socket
    /// filter that passes nothing) where a closed listener would reset them, so that a
    /// client connecting while the address moves sends its SYN again a second later,
    /// to the new holder, instead of failing. Connections the kernel completed before
    /// and nobody accepted yet are accepted and closed now, while their address is
    /// there to tell their clients. Open connections are not touched. Lasts until the
    /// listener is dropped; meant for one that is about to go with its address. False
    /// when the filter could not be attached: drop the listener at once then (a listener
    /// left open and unserved would leave new clients waiting instead).
    pub(super) fn close_quietly(&self) -> bool {
        const DROP_ALL: [socket2::SockFilter; 1] = [socket2::SockFilter::new(
            (libc::BPF_RET | libc::BPF_K) as u16,
            0,
            0,
            0,
        )];
        let socket = socket2::SockRef::from(&*self.socket);
        if let Err(e) = socket.attach_filter(&DROP_ALL) {
            tracing::warn!(error = %e, "cannot close a load-balancer listener quietly; new connections are reset as it stops");
            return false;
        }
        // The socket itself (non-blocking), not the runtime's view of it: a connection
        // the kernel queued before the runtime saw it readable is taken too.
        while let Ok((queued, _)) = socket.accept() {
            drop(queued);
        }
        true
    }

    /// Sends the listener's next connections to `target`.
    pub(super) fn retarget(&self, target: &PortTarget) {
        *self.target.write().unwrap_or_else(|e| e.into_inner()) = target.clone();
    }

    /// Stops the listener and its connections.
    pub(super) fn stop(&self) {
        self.hard_stop.cancel();
    }
}

/// Who may connect and for how long, from the Service (changed in place on updates):
/// everyone, or clients inside the ranges (none when every range the Service gave was
/// invalid); at most `max_connections` at once; closed after `idle_timeout` idle.
#[derive(Debug, Clone)]
pub(super) struct Policy {
    restricted: bool,
    ranges: Vec<tether_core::identifiers::Cidr>,
    max_connections: usize,
    idle_timeout: std::time::Duration,
    proxy_protocol: Option<ProxyProtocol>,
}

impl Policy {
    pub(super) fn of(svc: &ServiceInfo) -> Self {
        Policy {
            restricted: !svc.source_ranges.is_empty() || !svc.invalid_source_ranges.is_empty(),
            ranges: svc.source_ranges.clone(),
            max_connections: svc.max_connections,
            idle_timeout: svc.idle_timeout,
            proxy_protocol: svc.proxy_protocol,
        }
    }

    fn admits(&self, ip: IpAddr) -> bool {
        !self.restricted
            || self
                .ranges
                .iter()
                .any(|r| r.contains(super::proxy_protocol::unmapped(ip)))
    }
}

/// What every listener of one Service shares (changed in place on updates).
#[derive(Clone)]
pub(super) struct Shared {
    nodes: Arc<RwLock<Vec<Backend>>>,
    policy: Arc<RwLock<Policy>>,
    /// Connections open now, every port (`tether_ccm_lb_active_connections{service}`).
    active: prometheus::IntGauge,
    /// Backends to choose from (`tether_ccm_lb_backends{service}`).
    backends: prometheus::IntGauge,
    /// Connections open now over every Service, and their cap.
    all: Arc<AtomicUsize>,
    max_all: usize,
    /// Services with a connection open now (for the fair share).
    busy: Arc<AtomicUsize>,
    /// This Service's open connections (what its limit, its share and `busy` count).
    mine: Arc<AtomicUsize>,
    /// Its counters, looked up once rather than on every connection.
    counters: Arc<Counters>,
}

impl Shared {
    /// The shared state of `svc`'s listeners: its backends and policy, its series,
    /// and the counts every Service shares (`all` open connections, at most
    /// `max_all`; `busy` Services).
    pub(super) fn new(
        metrics: &crate::metrics::Metrics,
        svc: &ServiceInfo,
        nodes: &[Backend],
        all: Arc<AtomicUsize>,
        max_all: usize,
        busy: Arc<AtomicUsize>,
    ) -> Shared {
        let service = label(svc);
        let backends = metrics.lb_backends.with_label_values(&[service.as_str()]);
        backends.set(nodes.len() as i64);
        Shared {
            nodes: Arc::new(RwLock::new(nodes.to_vec())),
            policy: Arc::new(RwLock::new(Policy::of(svc))),
            active: metrics.lb_active.with_label_values(&[service.as_str()]),
            backends,
            all,
            max_all,
            busy,
            mine: Arc::new(AtomicUsize::new(0)),
            counters: Arc::new(Counters::of(metrics, &service)),
        }
    }

    /// This Service's connections open now, every port.
    pub(super) fn open(&self) -> usize {
        self.mine.load(Ordering::Acquire)
    }

    /// How many backends the listeners choose from.
    pub(super) fn node_count(&self) -> usize {
        self.nodes.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Takes a changed Service's backends and policy, for every listener at once.
    pub(super) fn update(&self, svc: &ServiceInfo, nodes: &[Backend]) {
        *self.nodes.write().unwrap_or_else(|e| e.into_inner()) = nodes.to_vec();
        self.backends.set(nodes.len() as i64);
        *self.policy.write().unwrap_or_else(|e| e.into_inner()) = Policy::of(svc);
    }
}

/// `namespace/name`, as the series and the logs name a Service.
pub(super) fn label(svc: &ServiceInfo) -> String {
    format!("{}/{}", svc.namespace, svc.name)
}

/// One Service's series of `tether_ccm_lb_connections_total` (by result) and
/// `tether_ccm_lb_bytes_total` (by direction).
pub(super) struct Counters {
    accepted: prometheus::IntCounter,
    refused_source_range: prometheus::IntCounter,
    refused_limit: prometheus::IntCounter,
    refused_global_limit: prometheus::IntCounter,
    no_backend: prometheus::IntCounter,
    to_backend: prometheus::IntCounter,
    to_client: prometheus::IntCounter,
}

impl Counters {
    pub(super) fn of(m: &crate::metrics::Metrics, service: &str) -> Counters {
        let c = |result: &str| m.lb_connections.with_label_values(&[service, result]);
        let b = |direction: &str| m.lb_bytes.with_label_values(&[service, direction]);
        Counters {
            accepted: c("accepted"),
            refused_source_range: c("refused_source_range"),
            refused_limit: c("refused_limit"),
            refused_global_limit: c("refused_global_limit"),
            no_backend: c("no_backend"),
            to_backend: b("to_backend"),
            to_client: b("to_client"),
        }
    }
}

/// One listener's accept loop and what each of its connections needs.
#[derive(Clone)]
struct PortServer {
    client: Client,
    shared: Shared,
    target: Arc<RwLock<PortTarget>>,
    /// Where the next connection starts in the backend list (round-robin).
    next: Arc<AtomicUsize>,
    hard_stop: CancellationToken,
}

/// Accepts until `hard_stop`; a client outside the Service's source ranges, or over its
/// connection limit, is closed at once; each other connection goes to the next backend
/// that answers.
async fn serve(
    listener: Arc<TcpListener>,
    client: Client,
    shared: Shared,
    target: Arc<RwLock<PortTarget>>,
    hard_stop: CancellationToken,
) {
    let port = PortServer {
        client,
        shared,
        target,
        next: Arc::new(AtomicUsize::new(0)),
        hard_stop,
    };
    loop {
        let (conn, peer) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors, most likely: let some close.
                    tracing::warn!(error = %chain(&e), "accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = port.hard_stop.cancelled() => return,
        };
        let policy = port
            .shared
            .policy
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(open) = port.admit(peer, &policy) else {
            continue;
        };
        let candidates = port.candidates();
        tokio::spawn(
            port.clone()
                .forward(conn, peer, policy, candidates, open)
                .instrument(tracing::debug_span!("lb_conn", %peer)),
        );
    }
}

impl PortServer {
    fn counters(&self) -> &Counters {
        &self.shared.counters
    }

    /// The source-range and connection-limit checks; a guard counting the connection
    /// as open when it is admitted.
    fn admit(&self, peer: SocketAddr, policy: &Policy) -> Option<OpenGuard> {
        if !policy.admits(peer.ip()) {
            self.counters().refused_source_range.inc();
            tracing::debug!(%peer, "client outside loadBalancerSourceRanges refused");
            return None;
        }
        let (max, mine) = (
            self.shared.max_all,
            self.shared.mine.load(Ordering::Acquire),
        );
        if mine >= policy.max_connections {
            self.counters().refused_limit.inc();
            tracing::debug!(%peer, max = policy.max_connections, "connection limit reached; refused");
            return None;
        }
        let before = self.shared.all.fetch_add(1, Ordering::AcqRel);
        // The last quarter of the cap goes only to Services under their fair share
        // (the cap over the Services holding connections, and one more): a busy Service
        // cannot take every connection, and a new one always gets some.
        let congested = before * 4 >= max * 3;
        let others = self.shared.busy.load(Ordering::Acquire) + usize::from(mine == 0);
        let share = max / (others + 1);
        if before >= max || (congested && mine >= share) {
            self.shared.all.fetch_sub(1, Ordering::AcqRel);
            self.counters().refused_global_limit.inc();
            tracing::debug!(%peer, max, open = before, share, "--lb-max-connections (or this Service's share of it) reached; refused");
            return None;
        }
        self.counters().accepted.inc();
        Some(OpenGuard::new(&self.shared))
    }

    /// The backends now, by name: the nodes' NodePort, or the ready endpoints.
    fn candidates(&self) -> Vec<(String, SocketAddr)> {
        match &*self.target.read().unwrap_or_else(|e| e.into_inner()) {
            PortTarget::NodePort(port) => self
                .shared
                .nodes
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .filter_map(|n| {
                    let ip = n.address.parse().ok()?;
                    Some((n.name.clone(), SocketAddr::new(ip, *port)))
                })
                .collect(),
            PortTarget::Endpoints(eps) => eps.iter().map(|e| (e.to_string(), *e)).collect(),
        }
    }

    /// Dials the backends through the tunnel in turn, from the next in round-robin
    /// order, and splices `conn` to the first that answers.
    async fn forward(
        self,
        conn: tokio::net::TcpStream,
        peer: SocketAddr,
        policy: Policy,
        candidates: Vec<(String, SocketAddr)>,
        open: OpenGuard,
    ) {
        if candidates.is_empty() {
            self.counters().no_backend.inc();
            tracing::info!("no ready backend to forward to; connection closed");
            return;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        for i in 0..candidates.len() {
            let (name, target) = &candidates[(start + i) % candidates.len()];
            match self.client.dial(&target.to_string()).await {
                Ok(upstream) => {
                    self.splice(conn, upstream, peer, &policy, name).await;
                    drop(open);
                    return;
                }
                Err(e) => {
                    tracing::warn!(backend = %name, %target, error = %chain(&e), "dial through the tunnel failed; trying the next backend");
                }
            }
        }
        self.counters().no_backend.inc();
        tracing::warn!("no backend answered; connection closed");
    }

    /// Sends the PROXY header when configured, then copies both ways until either side
    /// closes, the connection idles out, or the listener stops.
    async fn splice(
        &self,
        mut conn: tokio::net::TcpStream,
        mut upstream: tether_client::TunnelConn,
        peer: SocketAddr,
        policy: &Policy,
        name: &str,
    ) {
        if let (Some(version), Ok(local)) = (policy.proxy_protocol, conn.local_addr()) {
            let header = super::proxy_protocol::header(version, peer, local);
            if let Err(e) = upstream.write_all(&header).await {
                tracing::debug!(error = %chain(&e), backend = %name, "cannot send the PROXY header");
                return;
            }
        }
        let last = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let epoch = tokio::time::Instant::now();
        let mut splice = Splice::new(&mut conn, &mut upstream, last.clone(), epoch);
        tokio::select! {
            r = &mut splice => {
                if let Err(e) = r {
                    tracing::debug!(error = %chain(&e), backend = %name, "forwarded connection ended with an error");
                }
            },
            _ = idle(last, epoch, policy.idle_timeout) => {
                tracing::debug!(timeout = ?policy.idle_timeout, "idle connection closed");
            }
            _ = self.hard_stop.cancelled() => {}
        }
        // Counted however the connection ended (idle timeout, listener stopped).
        self.counters().to_backend.inc_by(splice.up);
        self.counters().to_client.inc_by(splice.down);
    }
}

/// Counts a connection among a Service's open ones until dropped.
/// (The global count was taken by the caller.)
pub(super) struct OpenGuard {
    open: prometheus::IntGauge,
    all: Arc<AtomicUsize>,
    busy: Arc<AtomicUsize>,
    mine: Arc<AtomicUsize>,
}

impl OpenGuard {
    fn new(shared: &Shared) -> Self {
        shared.active.inc();
        if shared.mine.fetch_add(1, Ordering::AcqRel) == 0 {
            shared.busy.fetch_add(1, Ordering::AcqRel);
        }
        OpenGuard {
            open: shared.active.clone(),
            all: shared.all.clone(),
            busy: shared.busy.clone(),
            mine: shared.mine.clone(),
        }
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.open.dec();
        if self.mine.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.busy.fetch_sub(1, Ordering::AcqRel);
        }
        self.all.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Copies both ways between a client connection and its tunnel connection until both
/// directions have ended, noting (in ms since `epoch`) when bytes last moved. Lean on
/// purpose: what arrives through the tunnel is written to the client as it came (no
/// copy through a buffer of ours), and the client's bytes are read up to
/// [`READ_CHUNK`](tether_core::pump::READ_CHUNK) at a time, one tunnel frame each, in a
/// buffer that starts small (an idle connection holds 16 KiB) and grows while reads
/// fill it.
struct Splice<'a> {
    conn: &'a mut tokio::net::TcpStream,
    tunnel: &'a mut tether_client::TunnelConn,
    last: Arc<std::sync::atomic::AtomicU64>,
    epoch: tokio::time::Instant,
    /// Client to backend: the buffer, how much of it is filled and how much was sent.
    up_buf: Vec<u8>,
    up_filled: usize,
    up_sent: usize,
    up_done: bool,
    /// Backend to client: the chunk being written.
    down_chunk: Option<bytes::Bytes>,
    down_done: bool,
    /// Bytes moved each way.
    up: u64,
    down: u64,
}

/// The client's bytes per read at first; reads that fill it double it, up to
/// `READ_CHUNK`.
const UP_FIRST: usize = 16 * 1024;

impl<'a> Splice<'a> {
    fn new(
        conn: &'a mut tokio::net::TcpStream,
        tunnel: &'a mut tether_client::TunnelConn,
        last: Arc<std::sync::atomic::AtomicU64>,
        epoch: tokio::time::Instant,
    ) -> Self {
        Splice {
            conn,
            tunnel,
            last,
            epoch,
            up_buf: vec![0u8; UP_FIRST],
            up_filled: 0,
            up_sent: 0,
            up_done: false,
            down_chunk: None,
            down_done: false,
            up: 0,
            down: 0,
        }
    }

    fn moved(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.last.store(ms, Ordering::Relaxed);
    }

    /// Client to backend, as far as it can go now; Ready once the client's end of
    /// stream has been passed on.
    fn poll_up(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        use tokio::io::{AsyncRead, AsyncWrite};
        loop {
            if self.up_sent < self.up_filled {
                let buf = &self.up_buf[self.up_sent..self.up_filled];
                let n =
                    std::task::ready!(std::pin::Pin::new(&mut *self.tunnel).poll_write(cx, buf))?;
                self.up_sent += n;
                self.up += n as u64;
                continue;
            }
            let mut rb = tokio::io::ReadBuf::new(&mut self.up_buf);
            std::task::ready!(std::pin::Pin::new(&mut *self.conn).poll_read(cx, &mut rb))?;
            let n = rb.filled().len();
            if n == self.up_buf.len() && n < tether_core::pump::READ_CHUNK {
                let grown = (n * 2).min(tether_core::pump::READ_CHUNK);
                self.up_buf.resize(grown, 0);
            }
            if n == 0 {
                std::task::ready!(std::pin::Pin::new(&mut *self.tunnel).poll_shutdown(cx))?;
                return Poll::Ready(Ok(()));
            }
            self.moved();
            (self.up_filled, self.up_sent) = (n, 0);
        }
    }

    /// Backend to client, likewise.
    fn poll_down(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        use tokio::io::AsyncWrite;
        loop {
            if let Some(chunk) = &mut self.down_chunk {
                let n =
                    std::task::ready!(std::pin::Pin::new(&mut *self.conn).poll_write(cx, chunk))?;
                if n == 0 {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
                }
                self.down += n as u64;
                let _ = chunk.split_to(n);
                if chunk.is_empty() {
                    self.down_chunk = None;
                }
                continue;
            }
            match std::task::ready!(self.tunnel.poll_chunk(cx))? {
                Some(chunk) => {
                    self.moved();
                    self.down_chunk = Some(chunk);
                }
                None => {
                    std::task::ready!(std::pin::Pin::new(&mut *self.conn).poll_shutdown(cx))?;
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
}

impl std::future::Future for Splice<'_> {
    type Output = std::io::Result<()>;
    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let this = &mut *self;
        if !this.up_done {
            match this.poll_up(cx) {
                Poll::Ready(Ok(())) => this.up_done = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
        }
        if !this.down_done {
            match this.poll_down(cx) {
                Poll::Ready(Ok(())) => this.down_done = true,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
        }
        // The backend's end closes the whole connection (Konnectivity has no
        // half-close: nothing more the client sends could reach it).
        if this.down_done {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    }
}

/// Resolves once no byte was read either way for `timeout`.
async fn idle(
    last: Arc<std::sync::atomic::AtomicU64>,
    epoch: tokio::time::Instant,
    timeout: std::time::Duration,
) {
    loop {
        let at = epoch + std::time::Duration::from_millis(last.load(Ordering::Relaxed)) + timeout;
        if tokio::time::Instant::now() >= at {
            return;
        }
        tokio::time::sleep_until(at).await;
    }
}

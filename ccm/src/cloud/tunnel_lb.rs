//! Load balancers over the tunnel, the `tether` provider's LoadBalancers: for each
//! LoadBalancer Service the CCM listens on the control-plane side (`--lb-bind-address`,
//! the Service's ports) and forwards every connection through the Tether server's gRPC
//! frontend to a backend node's NodePort, round-robin, trying the next node when a dial
//! fails. So Services in NAT-ed clusters are reachable with no cloud at all; the ingress
//! IP is the bind address. Konnectivity dials TCP only: other ports are left out (the
//! service controller says so in an event). A changed Service rebinds only the ports
//! that changed; connections on the others carry on.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;
use tether_client::Client;
use tokio::net::TcpListener;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{Backend, CloudError, LoadBalancerStatus, LoadBalancers, ServiceInfo};

/// Where the balancers listen and how they reach the nodes.
#[derive(Debug, Clone)]
pub struct TunnelLbConfig {
    /// `--lb-bind-address`: listeners bind here; it is the ingress IP.
    pub bind: IpAddr,
    /// The Tether server's gRPC frontend socket (`--tunnel-uds`).
    pub tunnel_uds: PathBuf,
}

/// One port's listener: where it forwards (changed in place) and its stop token.
struct Listener {
    node_port: Arc<AtomicU16>,
    stop: CancellationToken,
}

/// Who may connect and for how long, from the Service (changed in place on updates):
/// everyone, or clients inside the ranges (none when every range the Service gave was
/// invalid); at most `max_connections` at once; closed after `idle_timeout` idle.
#[derive(Debug, Clone)]
struct Policy {
    restricted: bool,
    ranges: Vec<tether_core::identifiers::Cidr>,
    max_connections: usize,
    idle_timeout: std::time::Duration,
}

impl Policy {
    fn of(svc: &ServiceInfo) -> Self {
        Policy {
            restricted: !svc.source_ranges.is_empty() || !svc.invalid_source_ranges.is_empty(),
            ranges: svc.source_ranges.clone(),
            max_connections: svc.max_connections,
            idle_timeout: svc.idle_timeout,
        }
    }

    fn admits(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        !self.restricted || self.ranges.iter().any(|r| r.contains(ip))
    }
}

/// What every listener of one Service shares (changed in place on updates).
#[derive(Clone)]
struct Shared {
    service: String,
    nodes: Arc<RwLock<Vec<Backend>>>,
    policy: Arc<RwLock<Policy>>,
    /// Connections open now, every port (`tether_ccm_lb_active_connections{service}`,
    /// also what the limit counts).
    active: prometheus::IntGauge,
}

struct Balancer {
    /// Listeners by Service port.
    listeners: HashMap<u16, Listener>,
    shared: Shared,
}

/// The balancers, by Service UID.
pub struct TunnelLoadBalancers {
    cfg: TunnelLbConfig,
    client: OnceCell<Client>,
    balancers: Mutex<HashMap<String, Balancer>>,
}

impl TunnelLoadBalancers {
    /// Balancers per `cfg` (the tunnel is connected on first use).
    pub fn new(cfg: TunnelLbConfig) -> Self {
        TunnelLoadBalancers {
            cfg,
            client: OnceCell::new(),
            balancers: Mutex::new(HashMap::new()),
        }
    }

    async fn client(&self) -> Result<Client, CloudError> {
        self.client
            .get_or_try_init(|| async {
                Client::uds(&self.cfg.tunnel_uds).await.map_err(|e| {
                    CloudError::Provider(format!(
                        "cannot reach the Tether server at {}: {e}",
                        self.cfg.tunnel_uds.display()
                    ))
                })
            })
            .await
            .cloned()
    }

    fn status(&self) -> LoadBalancerStatus {
        LoadBalancerStatus {
            ips: vec![self.cfg.bind.to_string()],
            hostnames: Vec::new(),
            // Traffic must reach this proxy, never be short-cut by kube-proxy.
            proxy: true,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Balancer>> {
        self.balancers.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn label(svc: &ServiceInfo) -> String {
    format!("{}/{}", svc.namespace, svc.name)
}

#[async_trait]
impl LoadBalancers for TunnelLoadBalancers {
    async fn get(
        &self,
        _cluster: &str,
        svc: &ServiceInfo,
    ) -> Result<Option<LoadBalancerStatus>, CloudError> {
        Ok(self.lock().contains_key(&svc.uid).then(|| self.status()))
    }

    async fn ensure(
        &self,
        _cluster: &str,
        svc: &ServiceInfo,
        nodes: &[Backend],
    ) -> Result<LoadBalancerStatus, CloudError> {
        let tcp: Vec<&super::ServicePort> =
            svc.ports.iter().filter(|p| p.protocol == "TCP").collect();
        if let Some(p) = tcp.iter().find(|p| p.node_port == 0) {
            return Err(CloudError::Provider(format!(
                "port {} has no nodePort yet",
                p.port
            )));
        }
        let client = self.client().await?;
        let (shared, mut keep) = {
            let mut all = self.lock();
            match all.remove(&svc.uid) {
                Some(b) => {
                    *b.shared.nodes.write().unwrap_or_else(|e| e.into_inner()) = nodes.to_vec();
                    *b.shared.policy.write().unwrap_or_else(|e| e.into_inner()) = Policy::of(svc);
                    (b.shared, b.listeners)
                }
                None => (
                    Shared {
                        service: label(svc),
                        nodes: Arc::new(RwLock::new(nodes.to_vec())),
                        policy: Arc::new(RwLock::new(Policy::of(svc))),
                        active: crate::metrics::get()
                            .lb_active
                            .with_label_values(&[label(svc).as_str()]),
                    },
                    HashMap::new(),
                ),
            }
        };
        // Ports gone: their listeners (and connections) stop. Ports kept: a new
        // nodePort is picked up in place.
        keep.retain(|port, l| {
            let wanted = tcp.iter().find(|p| p.port == *port);
            match wanted {
                Some(p) => {
                    l.node_port.store(p.node_port, Ordering::Relaxed);
                    true
                }
                None => {
                    l.stop.cancel();
                    false
                }
            }
        });
        let mut added = Vec::new();
        let new: Vec<&super::ServicePort> = tcp
            .iter()
            .copied()
            .filter(|p| !keep.contains_key(&p.port))
            .collect();
        for port in new {
            let addr = SocketAddr::new(self.cfg.bind, port.port);
            let listener = match TcpListener::bind(addr).await {
                Ok(l) => l,
                Err(e) => {
                    // What was serving before keeps serving; the new ports are retried.
                    for p in added {
                        if let Some(l) = keep.remove(&p) {
                            l.stop.cancel();
                        }
                    }
                    self.lock().insert(
                        svc.uid.clone(),
                        Balancer {
                            listeners: keep,
                            shared,
                        },
                    );
                    return Err(CloudError::Provider(format!(
                        "cannot listen on {addr} for {}: {e}",
                        label(svc)
                    )));
                }
            };
            let stop = CancellationToken::new();
            let node_port = Arc::new(AtomicU16::new(port.node_port));
            let span = tracing::info_span!("load_balancer", service = %label(svc), %addr);
            tokio::spawn(
                serve(
                    listener,
                    client.clone(),
                    shared.clone(),
                    node_port.clone(),
                    stop.clone(),
                )
                .instrument(span),
            );
            keep.insert(port.port, Listener { node_port, stop });
            added.push(port.port);
        }
        if !added.is_empty() {
            tracing::info!(service = %label(svc), bind = %self.cfg.bind, ports = ?added, nodes = nodes.len(), "load balancer listening");
        }
        self.lock().insert(
            svc.uid.clone(),
            Balancer {
                listeners: keep,
                shared,
            },
        );
        Ok(self.status())
    }

    async fn update(
        &self,
        _cluster: &str,
        svc: &ServiceInfo,
        nodes: &[Backend],
    ) -> Result<(), CloudError> {
        match self.lock().get(&svc.uid) {
            Some(b) => {
                *b.shared.nodes.write().unwrap_or_else(|e| e.into_inner()) = nodes.to_vec();
                Ok(())
            }
            None => Err(CloudError::Provider(format!(
                "no load balancer for {} yet",
                label(svc)
            ))),
        }
    }

    async fn delete(&self, _cluster: &str, svc: &ServiceInfo) -> Result<(), CloudError> {
        if let Some(b) = self.lock().remove(&svc.uid) {
            for l in b.listeners.into_values() {
                l.stop.cancel();
            }
            tracing::info!(service = %label(svc), "load balancer removed");
        }
        Ok(())
    }
}

/// Accepts until `stop`; a client outside the Service's source ranges is closed at
/// once; each other connection goes to the next node that answers.
async fn serve(
    listener: TcpListener,
    client: Client,
    shared: Shared,
    node_port: Arc<AtomicU16>,
    stop: CancellationToken,
) {
    let next = Arc::new(AtomicUsize::new(0));
    let m = crate::metrics::get();
    let result = |r: &str| {
        m.lb_connections
            .with_label_values(&[shared.service.as_str(), r])
    };
    let to_backend = m
        .lb_bytes
        .with_label_values(&[shared.service.as_str(), "to_backend"]);
    let to_client = m
        .lb_bytes
        .with_label_values(&[shared.service.as_str(), "to_client"]);
    loop {
        let (mut conn, peer) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
            },
            _ = stop.cancelled() => return,
        };
        let policy = shared
            .policy
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if !policy.admits(peer.ip()) {
            result("refused_source_range").inc();
            tracing::debug!(%peer, "client outside loadBalancerSourceRanges refused");
            drop(conn);
            continue;
        }
        if shared.active.get() >= policy.max_connections as i64 {
            result("refused_limit").inc();
            tracing::debug!(%peer, max = policy.max_connections, "connection limit reached; refused");
            drop(conn);
            continue;
        }
        result("accepted").inc();
        let open = OpenGuard::new(shared.active.clone());
        let (client, nodes, next, stop) = (
            client.clone(),
            shared.nodes.clone(),
            next.clone(),
            stop.clone(),
        );
        let (no_backend, to_backend, to_client) =
            (result("no_backend"), to_backend.clone(), to_client.clone());
        let idle_timeout = policy.idle_timeout;
        let node_port = node_port.load(Ordering::Relaxed);
        tokio::spawn(
            async move {
                let candidates = nodes.read().unwrap_or_else(|e| e.into_inner()).clone();
                if candidates.is_empty() {
                    no_backend.inc();
                    tracing::info!("no ready node to forward to; connection closed");
                    return;
                }
                let start = next.fetch_add(1, Ordering::Relaxed);
                for i in 0..candidates.len() {
                    let node = &candidates[(start + i) % candidates.len()];
                    let target = SocketAddr::new(
                        match node.address.parse() {
                            Ok(ip) => ip,
                            Err(_) => continue,
                        },
                        node_port,
                    );
                    match client.dial(&target.to_string()).await {
                        Ok(upstream) => {
                            let last = Arc::new(std::sync::atomic::AtomicU64::new(0));
                            let epoch = tokio::time::Instant::now();
                            let mut a = Tracked { inner: &mut conn, last: last.clone(), epoch };
                            let mut b = Tracked { inner: upstream, last: last.clone(), epoch };
                            tokio::select! {
                                r = tokio::io::copy_bidirectional(&mut a, &mut b) => {
                                    match r {
                                        Ok((up, down)) => {
                                            to_backend.inc_by(up);
                                            to_client.inc_by(down);
                                        }
                                        Err(e) => tracing::debug!(error = %e, node = %node.name, "forwarded connection ended with an error"),
                                    }
                                }
                                _ = idle(last, epoch, idle_timeout) => {
                                    tracing::debug!(timeout = ?idle_timeout, "idle connection closed");
                                }
                                _ = stop.cancelled() => {}
                            }
                            drop(open);
                            return;
                        }
                        Err(e) => {
                            tracing::warn!(node = %node.name, %target, error = %e, "dial through the tunnel failed; trying the next node");
                        }
                    }
                }
                no_backend.inc();
                tracing::warn!("no node answered; connection closed");
            }
            .instrument(tracing::debug_span!("lb_conn", %peer)),
        );
    }
}

/// Counts a connection among a Service's open ones until dropped.
struct OpenGuard(prometheus::IntGauge);

impl OpenGuard {
    fn new(open: prometheus::IntGauge) -> Self {
        open.inc();
        OpenGuard(open)
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A stream that notes (in ms since `epoch`) when it last read bytes.
struct Tracked<S> {
    inner: S,
    last: Arc<std::sync::atomic::AtomicU64>,
    epoch: tokio::time::Instant,
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            let ms = self.epoch.elapsed().as_millis() as u64;
            self.last.store(ms, Ordering::Relaxed);
        }
        r
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Tracked<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
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

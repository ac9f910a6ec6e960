//! The server core: dials from frontends to agents and the bookkeeping that routes
//! packets between them. Frontends call in (dial, data, close, cancel, gone); agent links
//! call in with what agents send; answers travel back to each frontend through the
//! channel it handed down (`Frontend::tx`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use tether_core::flow::{Admit, Credit, Window};
use tether_core::queue;
use tether_proto::{packet::Payload, DialRequest, Packet};
use tracing::Instrument;

use crate::backend::{Backend, PendingDial, Registry, Strategy};
use crate::metrics::{DialFailure, Metrics, Segment};

/// How often a dial whose agent vanished unanswered is sent to another agent.
const MAX_REDISPATCH: u8 = 2;

/// What a frontend tells a client when no agent can take a dial (upstream's text).
pub const NO_AGENT: &str = "No agent available";

/// One frontend stream (a gRPC Proxy stream or one HTTP-CONNECT connection).
pub struct Frontend {
    id: u64,
    /// Packets for the client: DIAL_RSP, DATA, CLOSE_RSP, DIAL_CLS. Unbounded as a
    /// channel; DATA in it is bounded per connection by `Conn::window`.
    pub(crate) tx: queue::Sender<Outgoing>,
    routes: Mutex<Routes>,
}

#[derive(Default)]
struct Routes {
    /// connectID -> the connection (and so the agent stream carrying it).
    conns: HashMap<i64, Arc<Conn>>,
    /// DialRequest.random -> the agent stream it was sent to.
    pending: HashMap<i64, Arc<Backend>>,
}

/// A packet on its way to a frontend's client; DATA remembers its connection so that
/// the credit goes back to the agent when the client takes it.
pub struct Outgoing {
    packet: Packet,
    conn: Option<Arc<Conn>>,
}

impl From<Packet> for Outgoing {
    fn from(packet: Packet) -> Self {
        Outgoing { packet, conn: None }
    }
}

/// The client-bound packets of a frontend, in order. DATA taken from here leaves its
/// connection's window (and, with a Tether agent, returns credit to it).
pub fn outbox(
    rx: queue::Receiver<Outgoing>,
) -> impl Stream<Item = Packet> + Send + Unpin + 'static {
    rx.map(|out| {
        if let (Some(conn), Some(Payload::Data(d))) = (&out.conn, &out.packet.payload) {
            conn.taken(d.data.len());
        }
        out.packet
    })
}

/// One established connection: which frontend and agent stream it joins, and its
/// flow control.
pub struct Conn {
    connect_id: i64,
    fe: Weak<Frontend>,
    backend: Weak<Backend>,
    /// Credit for DATA to the agent (`None`: upstream agent, no credit).
    pub(crate) credit: Option<Credit>,
    /// DATA from the agent queued towards the client.
    window: Window,
    /// When the dial succeeded (`connection_duration_seconds`).
    established: Instant,
}

impl Conn {
    fn new(connect_id: i64, fe: &Arc<Frontend>, backend: &Arc<Backend>) -> Arc<Self> {
        Arc::new(Conn {
            connect_id,
            fe: Arc::downgrade(fe),
            backend: Arc::downgrade(backend),
            credit: backend.peer_window.map(Credit::new),
            window: Window::for_peer(backend.peer_window.is_some()),
            established: Instant::now(),
        })
    }

    /// The agent stream carrying this connection, while it is connected.
    pub fn backend(&self) -> Option<Arc<Backend>> {
        self.backend.upgrade()
    }

    /// The client took `n` bytes of this connection's DATA.
    fn taken(&self, n: usize) {
        if let Some(grant) = self.window.consumed(n) {
            if let Some(backend) = self.backend.upgrade() {
                let _ = backend
                    .ctl
                    .send(Packet::window_update(self.connect_id, grant));
            }
        }
    }

    /// The connection is gone: wake whoever waits on its credit or window.
    fn close(&self) {
        if let Some(credit) = &self.credit {
            credit.close();
        }
        self.window.close();
    }
}

static NEXT_FRONTEND: AtomicU64 = AtomicU64::new(1);

impl Frontend {
    /// A frontend whose client-bound packets go to `tx` (read them with [`outbox`]).
    pub fn new(tx: queue::Sender<Outgoing>) -> Arc<Self> {
        Arc::new(Frontend {
            id: NEXT_FRONTEND.fetch_add(1, Ordering::Relaxed),
            tx,
            routes: Mutex::new(Routes::default()),
        })
    }

    /// This frontend's id (for logs).
    pub fn id(&self) -> u64 {
        self.id
    }

    fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        self.routes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This frontend's connection `connect_id`.
    pub fn route(&self, connect_id: i64) -> Option<Arc<Conn>> {
        self.routes().conns.get(&connect_id).cloned()
    }
}

/// Why a dial could not even be sent to an agent.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// No agent connected or matched the strategies.
    #[error("No agent available")]
    NoAgent,
}

/// Settings of the server core.
#[derive(Debug, Clone)]
pub struct TunnelConfig {
    /// Backend selection order.
    pub strategies: Vec<Strategy>,
    /// Fail a dial the agent has not answered within this (None = never).
    pub backend_dial_timeout: Option<Duration>,
    /// Offer per-connection credit flow control to agents that ask for it.
    pub flow_control: bool,
    /// With an upstream agent: how long one connection's full queue (its client not
    /// reading) may hold up the agent's stream before the connection is closed.
    pub stall_timeout: Duration,
}

/// The server core shared by frontends and agent links.
pub struct Tunnel {
    pub(crate) registry: Registry,
    pub(crate) metrics: Metrics,
    config: TunnelConfig,
}

impl Tunnel {
    /// A core with no agents yet.
    pub fn new(config: TunnelConfig, metrics: Metrics) -> Arc<Self> {
        Arc::new(Tunnel {
            registry: Registry::default(),
            metrics,
            config,
        })
    }

    /// Do we offer credit flow control to agents?
    pub fn flow_control(&self) -> bool {
        self.config.flow_control
    }

    /// Connected agent streams.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Queues a packet for `fe`'s client (never blocks: DATA was admitted by its
    /// connection's window first). False when the frontend is gone.
    fn to_frontend(&self, fe: &Frontend, out: impl Into<Outgoing>) -> bool {
        let out = out.into();
        self.metrics.packet(Segment::ToClient, out.packet.r#type);
        fe.tx.send(out).is_ok()
    }

    async fn to_agent(&self, backend: &Backend, packet: Packet) -> bool {
        self.metrics.packet(Segment::ToAgent, packet.r#type);
        backend.tx.send(packet).await.is_ok()
    }

    // === frontend -> agent ===

    /// Sends a DIAL_REQ from `fe` to an agent chosen by the strategies. The answer
    /// arrives on `fe.tx` as DIAL_RSP (or DIAL_CLS). On `Err`, nothing was sent.
    pub async fn dial(
        self: &Arc<Self>,
        fe: &Arc<Frontend>,
        req: DialRequest,
    ) -> Result<(), DialError> {
        let Some(backend) = self.registry.select(&self.config.strategies, &req.address) else {
            self.metrics.dial_failed(DialFailure::NoAgent);
            tracing::info!(address = %req.address, "no agent available for dial");
            return Err(DialError::NoAgent);
        };
        self.send_dial(fe, req, backend, Instant::now(), 0).await;
        Ok(())
    }

    /// Registers a pending dial on `backend` and sends it the DIAL_REQ.
    async fn send_dial(
        self: &Arc<Self>,
        fe: &Arc<Frontend>,
        req: DialRequest,
        backend: Arc<Backend>,
        started: Instant,
        attempts: u8,
    ) {
        let random = req.random;
        tracing::debug!(address = %req.address, random, agent_id = %backend.agent_id, attempts, "dialing through agent");
        backend.state().pending.insert(
            random,
            PendingDial {
                frontend: fe.clone(),
                started,
                request: req.clone(),
                attempts,
            },
        );
        fe.routes().pending.insert(random, backend.clone());
        self.metrics.pending_backend_dials.inc();
        let packet = Packet {
            r#type: tether_proto::PacketType::DialReq as i32,
            payload: Some(Payload::DialRequest(req)),
        };
        // --backend-dial-timeout bounds the wait to enqueue the DIAL_REQ too.
        let enqueued = match self.config.backend_dial_timeout {
            _ if backend.closed.is_cancelled() => Ok(false),
            Some(timeout) => {
                let remaining = timeout.saturating_sub(started.elapsed());
                tokio::time::timeout(remaining, self.to_agent(&backend, packet)).await
            }
            None => Ok(self.to_agent(&backend, packet).await),
        };
        let Ok(enqueued) = enqueued else {
            // The agent's stream took nothing for the whole dial timeout: it is stuck
            // (not reading), so it is retired as upstream does; the agent reconnects.
            self.fail_pending(&backend, random, DialFailure::BackendDialTimeout, "dial timeout: the agent's stream did not accept the dial request in time (--backend-dial-timeout)").await;
            tracing::warn!(agent_id = %backend.agent_id, "agent stream stuck: a dial request waited --backend-dial-timeout to be queued; disconnecting the agent");
            backend.closed.cancel();
            return;
        };
        if !enqueued {
            // The stream is going away. Whoever takes the pending entry (this code or
            // the stream's removal) re-dispatches it.
            if let Some(pending) = self.take_pending(&backend, random) {
                self.redispatch(
                    random,
                    pending,
                    format!("agent {} disconnected", backend.agent_id),
                );
            }
            return;
        }
        if let Some(timeout) = self.config.backend_dial_timeout {
            let this = self.clone();
            tokio::spawn(
                async move {
                    let remaining = timeout.saturating_sub(started.elapsed());
                    tokio::select! {
                        _ = tokio::time::sleep(remaining) => {}
                        _ = backend.closed.cancelled() => return,
                    }
                    if this
                        .fail_pending(&backend, random, DialFailure::BackendDialTimeout, "dial timeout: the agent did not answer in time (--backend-dial-timeout)")
                        .await
                    {
                        this.to_agent(&backend, Packet::close_dial(random)).await;
                    }
                }
                .in_current_span(),
            );
        }
    }

    /// A dial whose agent went away before answering: the agent never opened the
    /// connection for it, so it is sent to another eligible agent (a few times at most);
    /// with none left, the frontend gets the error at once.
    fn redispatch(self: &Arc<Self>, random: i64, pending: PendingDial, error: String) {
        let this = self.clone();
        tokio::spawn(
            async move {
                let fe = pending.frontend;
                let next = (pending.attempts < MAX_REDISPATCH && !fe.tx.is_closed())
                    .then(|| this.registry.select(&this.config.strategies, &pending.request.address))
                    .flatten();
                match next {
                    Some(backend) => {
                        tracing::info!(random, agent_id = %backend.agent_id, "agent went away before answering; dial sent to another agent");
                        this.send_dial(&fe, pending.request, backend, pending.started, pending.attempts + 1)
                            .await;
                    }
                    None => {
                        this.metrics.dial_failed(DialFailure::BackendClose);
                        this.to_frontend(&fe, Packet::dial_response(random, 0, error));
                    }
                }
            }
            .in_current_span(),
        );
    }

    /// Removes a pending dial and tells its frontend it failed. False when it was no
    /// longer pending.
    async fn fail_pending(
        &self,
        backend: &Backend,
        random: i64,
        reason: DialFailure,
        error: &str,
    ) -> bool {
        let Some(pending) = self.take_pending(backend, random) else {
            return false;
        };
        self.metrics.dial_failed(reason);
        self.to_frontend(&pending.frontend, Packet::dial_response(random, 0, error));
        true
    }

    /// A DATA packet from `fe` for one of its connections. With a Tether agent it
    /// waits for the connection's credit (holding up only this frontend stream).
    pub async fn data_from_frontend(&self, fe: &Frontend, packet: Packet, connect_id: i64) {
        match fe.route(connect_id) {
            Some(conn) => {
                if let Some(credit) = &conn.credit {
                    if !credit.ready().await {
                        return;
                    }
                    if let Some(Payload::Data(d)) = &packet.payload {
                        credit.spend(d.data.len());
                    }
                }
                if let Some(backend) = conn.backend() {
                    self.to_agent(&backend, packet).await;
                }
            }
            None => {
                tracing::debug!(connect_id, "DATA for unknown connectID");
                self.to_frontend(
                    fe,
                    Packet::close_response(connect_id, format!("unknown connectID {connect_id}")),
                );
            }
        }
    }

    /// A CLOSE_REQ from `fe`: passed to the agent, whose CLOSE_RSP comes back to `fe`.
    pub async fn close_from_frontend(&self, fe: &Frontend, connect_id: i64) {
        match fe.route(connect_id).and_then(|c| c.backend()) {
            Some(backend) => {
                self.to_agent(&backend, Packet::close_request(connect_id))
                    .await;
            }
            None => {
                self.to_frontend(
                    fe,
                    Packet::close_response(connect_id, format!("unknown connectID {connect_id}")),
                );
            }
        }
    }

    /// A DIAL_CLS from `fe`: the client gave up on a pending dial.
    pub async fn cancel_from_frontend(&self, fe: &Frontend, random: i64) {
        let backend = fe.routes().pending.remove(&random);
        if let Some(backend) = backend {
            self.abandon_dial(&backend, random).await;
        }
    }

    /// The frontend no longer wants dial `random`: take it off `backend` and tell the
    /// agent with DIAL_CLS (unless the dial was answered or failed meanwhile).
    async fn abandon_dial(&self, backend: &Backend, random: i64) {
        if self.take_pending(backend, random).is_some() {
            self.metrics.dial_failed(DialFailure::FrontendClose);
            self.to_agent(backend, Packet::close_dial(random)).await;
        }
    }

    /// `fe` is gone: cancel its pending dials and close its connections on the agents.
    pub async fn frontend_gone(&self, fe: &Frontend) {
        let routes = std::mem::take(&mut *fe.routes());
        for (random, backend) in routes.pending {
            self.abandon_dial(&backend, random).await;
        }
        for (connect_id, conn) in routes.conns {
            conn.close();
            let Some(backend) = conn.backend() else {
                continue;
            };
            if backend.state().conns.remove(&connect_id).is_some() {
                self.metrics.connection_ended(conn.established);
                self.to_agent(&backend, Packet::close_request(connect_id))
                    .await;
            }
        }
    }

    // === agent -> frontend ===

    /// A packet from `backend`'s agent.
    pub(crate) async fn handle_agent_packet(&self, backend: &Arc<Backend>, packet: Packet) {
        self.metrics.packet(Segment::FromAgent, packet.r#type);
        match &packet.payload {
            Some(Payload::DialResponse(rsp)) => {
                let (random, connect_id) = (rsp.random, rsp.connect_id);
                let success = rsp.error.is_empty();
                let Some(pending) = self.take_pending(backend, random) else {
                    self.metrics.dial_failed(DialFailure::UnrecognizedResponse);
                    if success {
                        // Nobody waits for it any more (cancelled or timed out): close it.
                        self.to_agent(backend, Packet::close_request(connect_id))
                            .await;
                    }
                    return;
                };
                let fe = pending.frontend;
                if !success {
                    self.metrics.dial_failed(DialFailure::ErrorResponse);
                    tracing::info!(agent_id = %backend.agent_id, error = %rsp.error, "agent failed to dial");
                    self.to_frontend(&fe, packet);
                    return;
                }
                let conn = Conn::new(connect_id, &fe, backend);
                let accepted = {
                    let mut routes = fe.routes();
                    match routes.conns.entry(connect_id) {
                        std::collections::hash_map::Entry::Occupied(_) => false,
                        std::collections::hash_map::Entry::Vacant(v) => {
                            v.insert(conn.clone());
                            true
                        }
                    }
                };
                if !accepted {
                    // Two agents used the same connectID on one frontend stream; the
                    // client could not tell them apart.
                    tracing::warn!(
                        connect_id,
                        "connectID already in use on this frontend stream; refusing"
                    );
                    self.to_agent(backend, Packet::close_request(connect_id))
                        .await;
                    self.to_frontend(
                        &fe,
                        Packet::dial_response(random, 0, "connectID collision, retry the dial"),
                    );
                    return;
                }
                backend.state().conns.insert(connect_id, conn);
                self.metrics.established_connections.inc();
                self.metrics
                    .dial_duration
                    .observe(pending.started.elapsed().as_secs_f64());
                if !self.to_frontend(&fe, packet) {
                    self.metrics.dial_failed(DialFailure::SendRsp);
                    self.frontend_gone(&fe).await;
                }
            }
            Some(Payload::Data(data)) => {
                let (connect_id, len) = (data.connect_id, data.data.len());
                let conn = backend.state().conns.get(&connect_id).cloned();
                let Some(conn) = conn else {
                    tracing::debug!(connect_id, "DATA from agent for unknown connectID; dropped");
                    return;
                };
                let start = Instant::now();
                // The agent's stream waits for this client: upstream's full receive channel.
                let full = conn.window.is_full().then(|| {
                    let g = self
                        .metrics
                        .full_receive_channels
                        .with_label_values(&["Proxy"]);
                    g.inc();
                    g
                });
                let admitted = conn.window.admit(len, self.config.stall_timeout).await;
                if let Some(g) = full {
                    g.dec();
                }
                self.metrics
                    .frontend_write_duration
                    .observe(start.elapsed().as_secs_f64());
                match admitted {
                    Admit::Ok => {
                        let Some(fe) = conn.fe.upgrade() else { return };
                        if !self.to_frontend(
                            &fe,
                            Outgoing {
                                packet,
                                conn: Some(conn),
                            },
                        ) {
                            self.frontend_gone(&fe).await;
                        }
                    }
                    Admit::Closed => {}
                    Admit::Overrun => {
                        tracing::warn!(agent_id = %backend.agent_id, connect_id, "agent sent more than the flow-control window; closing the connection");
                        self.close_conn(
                            backend,
                            &conn,
                            "agent exceeded the flow-control window".into(),
                        )
                        .await;
                    }
                    Admit::Stalled => {
                        let timeout = self.config.stall_timeout;
                        tracing::warn!(agent_id = %backend.agent_id, connect_id, queued = conn.window.queued(), ?timeout, "client stopped reading; closing the connection (--stalled-reader-timeout)");
                        self.close_conn(
                            backend,
                            &conn,
                            format!("client did not read for {timeout:?}; connection closed"),
                        )
                        .await;
                    }
                }
            }
            Some(Payload::WindowUpdate(w)) => {
                let conn = backend.state().conns.get(&w.connect_id).cloned();
                if let Some(credit) = conn.as_ref().and_then(|c| c.credit.as_ref()) {
                    credit.grant(w.bytes);
                }
            }
            Some(Payload::CloseResponse(close)) => {
                let connect_id = close.connect_id;
                let conn = backend.state().conns.remove(&connect_id);
                if let Some(conn) = conn {
                    self.conn_ended(&conn, packet);
                }
            }
            Some(Payload::CloseDial(cls)) => {
                let random = cls.random;
                if let Some(pending) = self.take_pending(backend, random) {
                    self.metrics.dial_failed(DialFailure::ErrorResponse);
                    self.to_frontend(&pending.frontend, packet);
                }
            }
            Some(Payload::Drain(_)) => {
                tracing::info!(agent_id = %backend.agent_id, "agent is draining; it is now last choice for new dials");
                backend.draining.store(true, Ordering::Relaxed);
            }
            _ => tracing::debug!(ty = packet.r#type, "unexpected packet from agent; ignored"),
        }
    }

    // === agent streams ===

    /// Registers a new agent stream.
    pub(crate) fn add_backend(&self, backend: Arc<Backend>) {
        self.count_backend(&backend, 1);
        self.registry.add(backend);
    }

    /// Moves `ready_backends{proxy_strategy}` and `ready_backend_connections` by `by`
    /// for `backend`: each strategy counts the agents it could ever pick.
    fn count_backend(&self, backend: &Backend, by: i64) {
        self.metrics.ready_backend_connections.add(by);
        let pod_networks = self.registry.pod_networks().is_watched();
        for s in &self.config.strategies {
            if backend.counts_for(*s, pod_networks) {
                self.metrics
                    .ready_backends
                    .with_label_values(&[s.name()])
                    .add(by);
            }
        }
    }

    /// An agent stream ended: fail its pending dials and close its connections at once.
    pub(crate) async fn remove_backend(self: &Arc<Self>, backend: &Backend) {
        backend.closed.cancel();
        if self.registry.remove(backend) {
            self.count_backend(backend, -1);
        }
        let state = std::mem::take(&mut *backend.state());
        let error = format!("agent {} disconnected", backend.agent_id);
        for (random, pending) in state.pending {
            self.forget_pending(random, &pending);
            self.redispatch(random, pending, error.clone());
        }
        for (connect_id, conn) in state.conns {
            self.conn_ended(&conn, Packet::close_response(connect_id, error.clone()));
        }
    }

    /// Bookkeeping for a connection just taken off its agent stream's table: the gauge,
    /// waking its credit/window waiters, the frontend's route, and `to_client` (its
    /// CLOSE_RSP) for the client.
    fn conn_ended(&self, conn: &Conn, to_client: Packet) {
        self.metrics.connection_ended(conn.established);
        conn.close();
        if let Some(fe) = conn.fe.upgrade() {
            fe.routes().conns.remove(&conn.connect_id);
            self.to_frontend(&fe, to_client);
        }
    }

    /// Closes `conn` from the server's side: the client gets CLOSE_RSP with `error`,
    /// the agent CLOSE_REQ.
    async fn close_conn(&self, backend: &Backend, conn: &Conn, error: String) {
        let connect_id = conn.connect_id;
        if backend.state().conns.remove(&connect_id).is_none() {
            return;
        }
        self.conn_ended(conn, Packet::close_response(connect_id, error));
        self.to_agent(backend, Packet::close_request(connect_id))
            .await;
    }

    /// Takes dial `random` off `backend`'s pending table (and its frontend's routes);
    /// `None` when someone else already did.
    fn take_pending(&self, backend: &Backend, random: i64) -> Option<PendingDial> {
        let pending = backend.state().pending.remove(&random)?;
        self.forget_pending(random, &pending);
        Some(pending)
    }

    /// Bookkeeping for a pending dial that left its backend's table.
    fn forget_pending(&self, random: i64, pending: &PendingDial) {
        self.metrics.pending_backend_dials.dec();
        pending.frontend.routes().pending.remove(&random);
    }
}

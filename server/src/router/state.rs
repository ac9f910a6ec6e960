//! The router's tables: frontend streams and agent streams, the connections joining
//! them and the dials still pending, with the small operations that keep both sides of
//! each table in step. Nothing here sends a packet or decides a route.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;
use std::time::Instant;

use futures::{Stream, StreamExt};
use serde::Serialize;
use tether_core::drain::Watch;
use tether_core::flow::ConnFlow;
use tether_core::identifiers::AgentIdentifiers;
use tether_core::queue;
use tether_proto::{packet::Payload, DialRequest, Packet};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes `key`, giving memory back once the table is a quarter full: a table that
/// held 100,000 tunnels at its peak would otherwise keep that capacity for good.
fn remove_shrinking<V>(map: &mut HashMap<i64, V>, key: i64) -> Option<V> {
    let v = map.remove(&key);
    if map.capacity() > 64 && map.len() * 4 < map.capacity() {
        map.shrink_to(map.len() * 2);
    }
    v
}

// === FrontendStream ===

/// Who opened a frontend connection, as the kernel or TLS proved it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct FrontendPeer {
    /// `grpc` or `http-connect`.
    pub kind: &'static str,
    /// `uds` or `tcp`.
    pub transport: &'static str,
    /// The client certificate's subject (mutual-TLS TCP).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// The client's address (TCP).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote: Option<String>,
    /// The peer process's user ID (Unix socket, `SO_PEERCRED`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub uid: Option<u32>,
    /// The peer process's ID (Unix socket, `SO_PEERCRED`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
}

/// `grpc/uds uid=0 pid=123`, `http-connect/tcp CN=system:kube-apiserver 10.0.0.5:51234`.
impl std::fmt::Display for FrontendPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.kind, self.transport)?;
        if let Some(s) = &self.subject {
            write!(f, " {}", tether_core::ratelimit::clipped(s, 256))?;
        }
        if let Some(r) = &self.remote {
            write!(f, " {r}")?;
        }
        if let Some(uid) = self.uid {
            write!(f, " uid={uid}")?;
        }
        if let Some(pid) = self.pid {
            write!(f, " pid={pid}")?;
        }
        Ok(())
    }
}

/// One frontend stream: a gRPC Proxy stream or one HTTP-CONNECT connection.
pub struct FrontendStream {
    id: u64,
    /// Packets for the client: DIAL_RSP, DATA, CLOSE_RSP, DIAL_CLS. Unbounded as a
    /// channel; DATA in it is bounded per connection by its receive window.
    tx: queue::Sender<Outgoing>,
    routes: Mutex<Routes>,
    /// Who opened it (for the audit record).
    pub(crate) peer: Arc<FrontendPeer>,
    /// Upstream counts a gRPC frontend's packets and no-agent dials; an HTTP-CONNECT
    /// connection's, never.
    pub(crate) counted: bool,
}

/// A frontend stream's routes.
#[derive(Default)]
pub(crate) struct Routes {
    /// connectID -> the connection (and so the agent stream carrying it).
    pub conns: HashMap<i64, Arc<Conn>>,
    /// DialRequest.random -> the agent stream it was sent to.
    pub pending: HashMap<i64, Arc<AgentStream>>,
    /// DialRequest.random -> the address, for dials waiting for an agent.
    pub waiting: HashMap<i64, String>,
}

static NEXT_FRONTEND: AtomicU64 = AtomicU64::new(1);

impl FrontendStream {
    /// A gRPC frontend stream of an unnamed peer (tests).
    pub fn new(tx: queue::Sender<Outgoing>) -> Arc<Self> {
        let peer = FrontendPeer {
            kind: "grpc",
            ..Default::default()
        };
        Self::grpc(tx, Arc::new(peer))
    }

    /// A gRPC frontend stream of `peer` whose client-bound packets go to `tx` (read
    /// them with [`outbox`]).
    pub fn grpc(tx: queue::Sender<Outgoing>, peer: Arc<FrontendPeer>) -> Arc<Self> {
        Arc::new(FrontendStream {
            id: NEXT_FRONTEND.fetch_add(1, Ordering::Relaxed),
            tx,
            routes: Mutex::new(Routes::default()),
            peer,
            counted: true,
        })
    }

    /// An HTTP-CONNECT connection's stream: as upstream, its `to_client` packets and
    /// its dials that find no agent are not counted in the metrics.
    pub fn http_connect(tx: queue::Sender<Outgoing>, peer: Arc<FrontendPeer>) -> Arc<Self> {
        Arc::new(FrontendStream {
            id: NEXT_FRONTEND.fetch_add(1, Ordering::Relaxed),
            tx,
            routes: Mutex::new(Routes::default()),
            peer,
            counted: false,
        })
    }

    /// This stream's id (for logs).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// This stream's connection `connect_id`.
    pub fn route(&self, connect_id: i64) -> Option<Arc<Conn>> {
        lock(&self.routes).conns.get(&connect_id).cloned()
    }

    /// Queues a packet for the client; false when the client is gone.
    pub(crate) fn send(&self, out: Outgoing) -> bool {
        self.tx.send(out).is_ok()
    }

    /// Is the client gone?
    pub(crate) fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// Dial `random` was sent to `agent`.
    pub(crate) fn expect(&self, random: i64, agent: Arc<AgentStream>) {
        lock(&self.routes).pending.insert(random, agent);
    }

    /// Dial `random` is no longer pending; the agent it was sent to.
    pub(crate) fn unexpect(&self, random: i64) -> Option<Arc<AgentStream>> {
        remove_shrinking(&mut lock(&self.routes).pending, random)
    }

    /// Dial `random` (to `address`) waits for an agent.
    pub(crate) fn wait(&self, random: i64, address: &str) {
        lock(&self.routes)
            .waiting
            .insert(random, address.to_string());
    }

    /// Whether dial `random` still waits for an agent (not cancelled, stream open).
    pub(crate) fn is_waiting(&self, random: i64) -> bool {
        lock(&self.routes).waiting.contains_key(&random)
    }

    /// Dial `random` no longer waits; its address if it still did.
    pub(crate) fn unwait(&self, random: i64) -> Option<String> {
        remove_shrinking(&mut lock(&self.routes).waiting, random)
    }

    /// Routes `conn` here; false when its connectID is taken on this stream.
    pub(crate) fn claim(&self, conn: &Arc<Conn>) -> bool {
        match lock(&self.routes).conns.entry(conn.connect_id) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(conn.clone());
                true
            }
        }
    }

    /// Forgets connection `connect_id`.
    pub(crate) fn unroute(&self, connect_id: i64) {
        remove_shrinking(&mut lock(&self.routes).conns, connect_id);
    }

    /// Empties the routes (the stream is gone).
    pub(crate) fn take_routes(&self) -> Routes {
        std::mem::take(&mut *lock(&self.routes))
    }
}

/// A packet on its way to a frontend's client; DATA remembers its connection so that
/// the credit goes back to the agent when the client takes it.
pub struct Outgoing {
    packet: Packet,
    conn: Option<Arc<Conn>>,
}

impl Outgoing {
    /// DATA of `conn`, accounted in its window until the client takes it.
    pub(crate) fn data(packet: Packet, conn: Arc<Conn>) -> Self {
        Outgoing {
            packet,
            conn: Some(conn),
        }
    }

    /// The packet's type (for counters).
    pub(crate) fn kind(&self) -> i32 {
        self.packet.r#type
    }
}

impl From<Packet> for Outgoing {
    fn from(packet: Packet) -> Self {
        Outgoing { packet, conn: None }
    }
}

/// The client-bound packets of a frontend stream, in order. DATA taken from here leaves
/// its connection's window (and, with a Tether agent, returns credit to it).
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

// === Conn ===

/// One established connection: the frontend and agent streams it joins, and its flow
/// control.
pub struct Conn {
    pub(crate) connect_id: i64,
    fe: Weak<FrontendStream>,
    agent: Weak<AgentStream>,
    pub(crate) flow: ConnFlow,
    /// When the dial succeeded (`connection_duration_seconds`).
    pub(crate) established: Instant,
    /// Holds a graceful drain open until the connection ends.
    work: Mutex<Option<Watch>>,
    /// How it was dialled (for the audit record).
    pub(crate) dialed: Dialed,
    /// DATA payload bytes towards the agent and from it: plain counters bumped where
    /// the bytes already pass (the audit record's).
    to_agent: AtomicU64,
    from_agent: AtomicU64,
    /// The client sent CLOSE_REQ: the agent's CLOSE_RSP answers it.
    close_requested: AtomicBool,
}

/// How a connection was dialled.
pub(crate) struct Dialed {
    pub peer: Arc<FrontendPeer>,
    pub address: String,
    pub random: i64,
    pub strategy: &'static str,
    pub latency: Duration,
}

impl Conn {
    pub(crate) fn new(
        connect_id: i64,
        fe: &Arc<FrontendStream>,
        agent: &Arc<AgentStream>,
        work: Watch,
        dialed: Dialed,
    ) -> Arc<Self> {
        Arc::new(Conn {
            connect_id,
            fe: Arc::downgrade(fe),
            agent: Arc::downgrade(agent),
            flow: ConnFlow::new(agent.peer_window),
            established: Instant::now(),
            work: Mutex::new(Some(work)),
            dialed,
            to_agent: AtomicU64::new(0),
            from_agent: AtomicU64::new(0),
            close_requested: AtomicBool::new(false),
        })
    }

    /// `n` bytes of DATA went towards the agent.
    pub(crate) fn sent(&self, n: usize) {
        self.to_agent.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// `n` bytes of DATA came from the agent.
    pub(crate) fn received(&self, n: usize) {
        self.from_agent.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Bytes towards the agent and from it so far.
    pub(crate) fn bytes(&self) -> (u64, u64) {
        (
            self.to_agent.load(Ordering::Relaxed),
            self.from_agent.load(Ordering::Relaxed),
        )
    }

    /// The client asked to close the connection.
    pub(crate) fn close_requested(&self) {
        self.close_requested.store(true, Ordering::Relaxed);
    }

    /// Did the client ask to close it?
    pub(crate) fn is_close_requested(&self) -> bool {
        self.close_requested.load(Ordering::Relaxed)
    }

    /// The agent stream carrying this connection, while it is connected.
    pub fn agent(&self) -> Option<Arc<AgentStream>> {
        self.agent.upgrade()
    }

    /// The frontend stream, while it is open.
    pub(crate) fn frontend(&self) -> Option<Arc<FrontendStream>> {
        self.fe.upgrade()
    }

    /// The client took `n` bytes of this connection's DATA.
    fn taken(&self, n: usize) {
        if let Some(grant) = self.flow.window().consumed(n) {
            if let Some(agent) = self.agent.upgrade() {
                agent.window_update(self.connect_id, grant);
            }
        }
    }

    /// The connection is gone: wake whoever waits on its credit or window, and let a
    /// drain stop waiting for it.
    pub(crate) fn close(&self) {
        self.flow.close();
        lock(&self.work).take();
    }
}

// === AgentStream ===

/// A dial sent to an agent and not yet answered.
pub(crate) struct PendingDial {
    pub frontend: Arc<FrontendStream>,
    pub started: Instant,
    /// The strategy that chose its agent.
    pub strategy: &'static str,
    /// The request, to send it to another agent if this one goes away unanswered.
    pub request: DialRequest,
    /// How often it was already re-dispatched.
    pub attempts: u8,
    /// Holds a graceful drain open until the dial is answered or fails.
    pub _work: Watch,
}

/// An agent stream's tables.
#[derive(Default)]
pub(crate) struct AgentTables {
    /// By DialRequest.random.
    pub pending: HashMap<i64, PendingDial>,
    /// By connectID.
    pub conns: HashMap<i64, Arc<Conn>>,
}

/// What the server verified of an agent, and how: the names and addresses routing
/// may use (unless `--unsafe-trust-agent-identifiers`), and who the agent proved to be.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verified {
    /// `certificate` (names in its client certificate) or `serviceaccount-token` (a
    /// token bound to a Pod on that node); empty when nothing was verified.
    pub by: &'static str,
    /// Verified names (the agent ID and hosts).
    pub hosts: Vec<String>,
    /// Verified addresses (certificate IP SANs).
    pub ips: Vec<std::net::IpAddr>,
    /// The node a pod-bound token proved: its Node object vouches for addresses and
    /// pod networks, looked up when a dial is routed (they may change).
    pub node: Option<String>,
    /// Who the agent proved to be whatever ID it claims (a token's node, a per-node
    /// certificate's name): its streams are grouped and capped under it.
    pub principal: Option<String>,
}

/// One agent stream.
pub struct AgentStream {
    /// Unique per stream in this process (an agent may hold several).
    pub(crate) key: u64,
    /// The agent's `agentid`.
    pub agent_id: String,
    /// What the agent said it can reach.
    pub identifiers: AgentIdentifiers,
    /// Which of its names and addresses the server checked.
    pub verified: Verified,
    /// Packets to the agent.
    pub(crate) tx: mpsc::Sender<Packet>,
    /// WINDOW_UPDATEs to the agent: never blocked behind DATA, merged into its stream.
    ctl: queue::Sender<Packet>,
    /// The agent's per-connection receive window when it does credit flow control
    /// (negotiated with `tether-flow-window`); `None` for an upstream agent.
    pub(crate) peer_window: Option<u32>,
    draining: AtomicBool,
    /// The agent asked to hear DRAIN when this server stops (a Tether agent).
    hears_drain: bool,
    /// DRAIN was queued to the agent.
    told_drain: AtomicBool,
    tables: Mutex<AgentTables>,
    /// Cancelled when the stream is gone or retired.
    pub(crate) closed: CancellationToken,
    /// What carries the stream: `h2` (gRPC) or `websocket`.
    pub transport: &'static str,
}

static NEXT_AGENT_STREAM: AtomicU64 = AtomicU64::new(1);

impl AgentStream {
    /// A stream to agent `agent_id`: packets go to `tx`, WINDOW_UPDATEs to `ctl`.
    pub fn new(
        agent_id: String,
        identifiers: AgentIdentifiers,
        verified: Verified,
        tx: mpsc::Sender<Packet>,
        ctl: queue::Sender<Packet>,
        peer_window: Option<u32>,
    ) -> Self {
        AgentStream {
            key: NEXT_AGENT_STREAM.fetch_add(1, Ordering::Relaxed),
            agent_id,
            identifiers,
            verified,
            tx,
            ctl,
            peer_window,
            draining: AtomicBool::new(false),
            hears_drain: false,
            told_drain: AtomicBool::new(false),
            tables: Mutex::new(AgentTables::default()),
            closed: CancellationToken::new(),
            transport: "h2",
        }
    }

    /// The stream is carried by `transport` (`h2` unless said).
    pub fn carried_by(mut self, transport: &'static str) -> Self {
        self.transport = transport;
        self
    }

    /// The agent asked to hear DRAIN when this server stops (`tether-drain-notice`).
    pub fn hearing_drain(mut self) -> Self {
        self.hears_drain = true;
        self
    }

    /// Tells the agent, once and if it asked, that this server is stopping: it connects
    /// to the others (a successor among them) while this stream serves its tunnels.
    /// Queued ahead of DATA, never waiting.
    /// True when it was queued now.
    pub(crate) fn tell_drain(&self) -> bool {
        let now = self.hears_drain && !self.told_drain.swap(true, Ordering::Relaxed);
        if now {
            self.tell(Packet::drain());
        }
        now
    }

    /// Queues `packet` to the agent ahead of DATA, never waiting.
    pub(crate) fn tell(&self, packet: Packet) {
        let _ = self.ctl.send(packet);
    }

    /// Was the agent told that this server is stopping?
    pub fn told_drain(&self) -> bool {
        self.told_drain.load(Ordering::Relaxed)
    }

    /// Has the agent sent DRAIN?
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// The agent sent DRAIN.
    pub(crate) fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Has the stream ended or been retired?
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.is_cancelled()
    }

    /// Queues a WINDOW_UPDATE ahead of any DATA.
    fn window_update(&self, connect_id: i64, bytes: i64) {
        let _ = self.ctl.send(Packet::window_update(connect_id, bytes));
    }

    pub(crate) fn add_pending(&self, random: i64, dial: PendingDial) {
        lock(&self.tables).pending.insert(random, dial);
    }

    /// Takes dial `random` off this stream; `None` when someone else already did.
    pub(crate) fn take_pending(&self, random: i64) -> Option<PendingDial> {
        remove_shrinking(&mut lock(&self.tables).pending, random)
    }

    pub(crate) fn add_conn(&self, conn: Arc<Conn>) {
        lock(&self.tables).conns.insert(conn.connect_id, conn);
    }

    pub(crate) fn conn(&self, connect_id: i64) -> Option<Arc<Conn>> {
        lock(&self.tables).conns.get(&connect_id).cloned()
    }

    /// Takes connection `connect_id` off this stream; `None` when someone else did.
    pub(crate) fn remove_conn(&self, connect_id: i64) -> Option<Arc<Conn>> {
        remove_shrinking(&mut lock(&self.tables).conns, connect_id)
    }

    /// Empties the tables (the stream is gone).
    pub(crate) fn take_tables(&self) -> AgentTables {
        std::mem::take(&mut *lock(&self.tables))
    }
}

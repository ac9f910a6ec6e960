//! The server core: routes dials from frontend streams to agent streams and the packets
//! of each connection between them. Frontends call in (dial, send_data, close, cancel,
//! frontend_gone); agent links call in with what agents send (on_agent_packet); answers
//! travel back to each frontend through the queue it handed down.
//!
//! `state` holds the tables, `select` picks an agent, `audit` is the record of each
//! tunnel and refusal, this module is the operations.

pub mod audit;
mod select;
mod state;
#[cfg(test)]
mod tests;
mod wait;

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use tether_core::drain;
use tether_core::flow::Refused;
use tether_core::pump::Sink;
use tether_proto::{packet::Payload, CloseDial, CloseResponse, DialRequest, DialResponse, Packet};
use tracing::Instrument;

pub use select::{parse_strategies, NoRoute, Registry, Strategy, TooManyStreams};
pub use state::{outbox, AgentStream, Conn, FrontendPeer, FrontendStream, Outgoing, Verified};

use crate::metrics::{DialFailure, Metrics, Segment};
use audit::{Audit, Reason, Record};
use state::{Dialed, PendingDial};

/// How often a dial whose agent vanished unanswered is sent to another agent.
const MAX_REDISPATCH: u8 = 2;

/// What a frontend tells a client when no agent can take a dial (upstream's text).
pub const NO_AGENT: &str = "No agent available";

/// Why a dial could not even be sent to an agent.
#[derive(Debug, thiserror::Error)]
pub enum DialError {
    /// No agent connected or matched the strategies.
    #[error("No agent available")]
    NoAgent,
    /// The address is not one the server routes (not `host:port`, an unusual
    /// spelling): no agent is asked to dial it.
    #[error(transparent)]
    BadAddress(tether_core::host::HostError),
    /// The server's graceful shutdown ran out: it takes no more dials.
    #[error("{SHUTTING_DOWN}")]
    ShuttingDown,
}

/// What a tunnel (or dial) still open when the graceful shutdown runs out is closed
/// with, and what a dial made after is refused with.
pub const SHUTTING_DOWN: &str = "proxy server shutting down: graceful shutdown timeout reached";

/// How long a dial may wait for its agent's answer when `--backend-dial-timeout` is not
/// set (upstream waits for ever on gRPC; HTTP-CONNECT clients give up after 30 s).
pub const DIAL_BACKSTOP: Duration = Duration::from_secs(30);

/// Settings of the server core.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Agent selection order.
    pub strategies: Vec<Strategy>,
    /// Fail a dial the agent has not answered within this (None = [`DIAL_BACKSTOP`]).
    pub backend_dial_timeout: Option<Duration>,
    /// `--unsafe-trust-agent-identifiers`: route by identifiers agents claim but the
    /// server could not verify (upstream's behaviour).
    pub trust_claims: bool,
    /// Most streams per agent ID and per verified identity (0 = no cap).
    pub max_agent_streams: usize,
    /// Offer per-connection credit flow control to agents that ask for it.
    pub flow_control: bool,
    /// With an upstream agent: how long one connection's full queue (its client not
    /// reading) may hold up the agent's stream before the connection is closed.
    pub stall_timeout: Duration,
    /// `--wait-for-agent`: how long a dial no connected agent can take waits for one
    /// (zero: it fails at once, as upstream's).
    pub agent_wait: Duration,
}

/// The server core shared by frontends and agent links.
pub struct Router {
    registry: Registry,
    pub(crate) metrics: Metrics,
    config: RouterConfig,
    /// Every pending dial and established connection holds a watch.
    work: drain::Signal,
    /// The audit record of each tunnel and refusal (`--audit-log-path`).
    audit: Audit,
    /// The hard stop came: what ends now ends for `drain`.
    stopping: AtomicBool,
    /// The server drains: every agent stream that asked hears DRAIN, new ones too.
    agents_told: AtomicBool,
    /// The graceful shutdown ran out ([`Router::end_all`]): no more dials.
    closing: AtomicBool,
}

impl Router {
    /// A core with no agents yet.
    pub fn new(config: RouterConfig, metrics: Metrics) -> Arc<Self> {
        Self::with_audit(config, metrics, Audit::off())
    }

    /// A core with no agents yet that records each tunnel and refusal in `audit`.
    pub fn with_audit(config: RouterConfig, metrics: Metrics, audit: Audit) -> Arc<Self> {
        // Every strategy's series exists from the start, at 0 until an agent counts.
        for s in &config.strategies {
            metrics.ready_backends.with_label_values(&[s.name()]);
        }
        Arc::new(Router {
            registry: Registry::new(config.trust_claims, config.max_agent_streams),
            metrics,
            config,
            work: drain::Signal::new(),
            audit,
            stopping: AtomicBool::new(false),
            agents_told: AtomicBool::new(false),
            closing: AtomicBool::new(false),
        })
    }

    /// The audit log.
    pub fn audit(&self) -> &Audit {
        &self.audit
    }

    /// The server's drain: every agent that asked (a Tether agent) hears DRAIN, now and
    /// when it connects later, and connects to the other servers (a successor among
    /// them) while its stream here serves the tunnels it holds; the number told.
    pub fn drain_agents(&self) -> usize {
        self.agents_told.store(true, Ordering::Relaxed);
        let agents = self.registry.snapshot();
        for agent in &agents {
            self.tell_drain(agent);
        }
        agents.iter().filter(|a| a.told_drain()).count()
    }

    /// The graceful shutdown ran out: no more dials are taken ([`SHUTTING_DOWN`]),
    /// every connection still open is closed from the server's side (its client gets
    /// CLOSE_RSP, its agent CLOSE_REQ) and every pending dial fails (its agent gets
    /// DIAL_CLS), so that each client ends its tunnel at once. Cut with the process
    /// instead, a tunnel of a client that misses the broken connection (kube-apiserver
    /// 1.20's konnectivity-client) hangs: `kubectl logs -f` went silent rather than
    /// ending. The number of connections and dials ended.
    pub fn end_all(&self) -> usize {
        self.closing.store(true, Ordering::Relaxed);
        let mut ended = 0;
        for agent in self.registry.snapshot() {
            let tables = agent.take_tables();
            for (random, pending) in tables.pending {
                self.forget_pending(random, &pending);
                self.metrics.dial_failed(DialFailure::BackendClose);
                self.dial_failed(&agent, random, &pending, Reason::Drain, SHUTTING_DOWN);
                let answer = Packet::dial_response(random, 0, SHUTTING_DOWN);
                self.to_frontend(&pending.frontend, answer);
                self.tell_agent(&agent, Packet::close_dial(random));
                ended += 1;
            }
            for (connect_id, conn) in tables.conns {
                self.tunnel_ended(&conn, &agent, Reason::Drain, SHUTTING_DOWN);
                self.conn_ended(&conn, Packet::close_response(connect_id, SHUTTING_DOWN));
                self.tell_agent(&agent, Packet::close_request(connect_id));
                ended += 1;
            }
        }
        ended
    }

    /// The server's hard stop: tunnels it cuts are recorded as ended by `drain`.
    pub fn stopping(&self) {
        self.stopping.store(true, Ordering::Relaxed);
    }

    /// `reason`, unless the hard stop came, which ends everything for `drain`.
    fn unless_stopping(&self, reason: Reason) -> Reason {
        match self.stopping.load(Ordering::Relaxed) {
            true => Reason::Drain,
            false => reason,
        }
    }

    /// Records a refusal of `address` for `fe` (when the audit is on).
    fn refused(&self, fe: &FrontendStream, address: &str, reason: Reason, error: &str) {
        if self.audit.enabled() {
            self.audit
                .record(Record::refused(&fe.peer, address, reason, error));
        }
    }

    /// Records a dial that went to `agent` and failed.
    fn dial_failed(
        &self,
        agent: &AgentStream,
        random: i64,
        pending: &PendingDial,
        reason: Reason,
        error: &str,
    ) {
        if self.audit.enabled() {
            let fe = &pending.frontend;
            let r = Record::refused(&fe.peer, &pending.request.address, reason, error);
            let r = r.dial_failed(agent, pending.strategy, random, pending.started.elapsed());
            self.audit.record(r);
        }
    }

    /// Records the end of tunnel `conn` on `agent`.
    fn tunnel_ended(&self, conn: &Conn, agent: &AgentStream, reason: Reason, error: &str) {
        if self.audit.enabled() {
            let reason = self.unless_stopping(reason);
            self.audit
                .record(Record::tunnel(conn, agent, reason, error));
        }
    }

    /// Do we offer credit flow control to agents?
    pub fn flow_control(&self) -> bool {
        self.config.flow_control
    }

    /// Connected agent streams.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Pending dials and established connections: what a drain waits for.
    pub fn work(&self) -> &drain::Signal {
        &self.work
    }

    /// Queues a packet for `fe`'s client (never blocks: DATA was admitted by its
    /// connection's window first). False when the frontend is gone.
    fn to_frontend(&self, fe: &FrontendStream, out: impl Into<Outgoing>) -> bool {
        let out = out.into();
        if fe.counted {
            self.metrics.packet(Segment::ToClient, out.kind());
        }
        fe.send(out)
    }

    /// Queues a packet for `agent`, waiting for room; false when the stream is gone.
    /// (The channel's future mapped, not an `async fn`: see `pump::Sink`.)
    fn to_agent<'a>(
        &self,
        agent: &'a AgentStream,
        packet: Packet,
    ) -> impl Future<Output = bool> + 'a {
        self.metrics.packet(Segment::ToAgent, packet.r#type);
        agent.tx.send(packet).map(|r| r.is_ok())
    }

    /// Tells `agent`, once and if it asked, that this server is stopping; counted.
    fn tell_drain(&self, agent: &AgentStream) {
        if agent.tell_drain() {
            self.metrics
                .packet(Segment::ToAgent, tether_proto::PacketType::Drain as i32);
        }
    }

    /// Queues `packet` to `agent` ahead of its DATA, never waiting; counted.
    fn tell_agent(&self, agent: &AgentStream, packet: Packet) {
        self.metrics.packet(Segment::ToAgent, packet.r#type);
        agent.tell(packet);
    }

    // === frontend -> agent ===

    /// Sends a DIAL_REQ from `fe` to an agent chosen by the strategies. The answer
    /// arrives on `fe`'s queue as DIAL_RSP (or DIAL_CLS). On `Err`, nothing was sent.
    pub async fn dial(
        self: &Arc<Self>,
        fe: &Arc<FrontendStream>,
        req: DialRequest,
    ) -> Result<(), DialError> {
        if self.closing.load(Ordering::Relaxed) {
            self.refused(fe, &req.address, Reason::Drain, SHUTTING_DOWN);
            return Err(DialError::ShuttingDown);
        }
        let (agent, strategy) = match self.registry.route(&self.config.strategies, &req.address) {
            Ok(routed) => routed,
            Err(NoRoute::Host(e)) => {
                // Where upstream's agent would have failed the dial: counted as its
                // error answer would be, and the caller told what is wrong.
                if fe.counted {
                    self.metrics.dial_failed(DialFailure::ErrorResponse);
                }
                tracing::info!(address = ?req.address, reason = %e, "dial address refused");
                self.refused(fe, &req.address, Reason::BadAddress, &e.to_string());
                return Err(DialError::BadAddress(e));
            }
            Err(why) if wait::worth_waiting(&why, self.config.agent_wait) => {
                self.wait_for_agent(fe.clone(), req, why);
                return Ok(());
            }
            Err(why) => {
                self.no_agent(fe, &req.address, &why);
                return Err(DialError::NoAgent);
            }
        };
        self.send_dial(fe, req, agent, strategy, Instant::now(), 0)
            .await;
        Ok(())
    }

    /// Counts, logs and records a dial no agent takes.
    fn no_agent(&self, fe: &FrontendStream, address: &str, why: &NoRoute) {
        if fe.counted {
            self.metrics.dial_failed(DialFailure::NoAgent);
        }
        tracing::info!(address = %address, reason = %why, "no agent available for dial");
        self.refused(fe, address, Reason::NoAgent, &why.to_string());
    }

    /// Answers dial `random` of `fe` with why [`Router::dial`] failed: upstream's "No
    /// agent available", or what is wrong with the address.
    pub fn dial_refused(&self, fe: &FrontendStream, random: i64, why: &DialError) {
        let error = match why {
            DialError::NoAgent => NO_AGENT.to_string(),
            DialError::BadAddress(e) => e.to_string(),
            DialError::ShuttingDown => SHUTTING_DOWN.to_string(),
        };
        self.to_frontend(fe, Packet::dial_response(random, 0, &error));
    }

    /// Registers a pending dial on `agent` and sends it the DIAL_REQ.
    async fn send_dial(
        self: &Arc<Self>,
        fe: &Arc<FrontendStream>,
        req: DialRequest,
        agent: Arc<AgentStream>,
        strategy: &'static str,
        started: Instant,
        attempts: u8,
    ) {
        let random = req.random;
        tracing::debug!(address = %req.address, random, agent_id = %agent.agent_id, attempts, "dialing through agent");
        let pending = PendingDial {
            frontend: fe.clone(),
            started,
            strategy,
            request: req.clone(),
            attempts,
            _work: self.work.watch(),
        };
        agent.add_pending(random, pending);
        fe.expect(random, agent.clone());
        self.metrics.pending_backend_dials.inc();
        let packet = Packet {
            r#type: tether_proto::PacketType::DialReq as i32,
            payload: Some(Payload::DialRequest(req)),
        };
        // The dial timeout bounds the wait to enqueue the DIAL_REQ too.
        let enqueued = if agent.is_closed() {
            Ok(false)
        } else {
            let remaining = self.dial_timeout().saturating_sub(started.elapsed());
            tokio::time::timeout(remaining, self.to_agent(&agent, packet)).await
        };
        match enqueued {
            Ok(true) => self.arm_dial_timeout(agent, random, started),
            Ok(false) => {
                // The stream is going away. Whoever takes the pending entry (this code
                // or the stream's removal) re-dispatches it.
                if let Some(pending) = self.take_pending(&agent, random) {
                    let error = format!("agent {} disconnected", agent.agent_id);
                    self.redispatch(random, pending, error);
                }
            }
            Err(_) => {
                // The agent's stream took nothing for the whole dial timeout: it is
                // stuck (not reading), so it is retired as upstream does; the agent
                // reconnects.
                self.fail_pending(&agent, random, DialFailure::BackendDialTimeout, "dial timeout: the agent's stream did not accept the dial request in time (--backend-dial-timeout)");
                tracing::warn!(agent_id = %agent.agent_id, timeout = ?self.dial_timeout(), "agent stream stuck: a dial request waited the dial timeout to be queued; disconnecting the agent");
                agent.closed.cancel();
            }
        }
    }

    /// How long a dial may wait for its agent: `--backend-dial-timeout`, else the
    /// backstop.
    pub fn dial_timeout(&self) -> Duration {
        self.config.backend_dial_timeout.unwrap_or(DIAL_BACKSTOP)
    }

    /// Fails dial `random` if `agent` has not answered it within the dial timeout of
    /// `started`, and tells the agent with DIAL_CLS.
    fn arm_dial_timeout(self: &Arc<Self>, agent: Arc<AgentStream>, random: i64, started: Instant) {
        let timeout = self.dial_timeout();
        let this = self.clone();
        tokio::spawn(
            async move {
                let remaining = timeout.saturating_sub(started.elapsed());
                tokio::select! {
                    _ = tokio::time::sleep(remaining) => {}
                    _ = agent.closed.cancelled() => return,
                }
                if this.fail_pending(
                    &agent,
                    random,
                    DialFailure::BackendDialTimeout,
                    "dial timeout: the agent did not answer in time (--backend-dial-timeout)",
                ) {
                    this.to_agent(&agent, Packet::close_dial(random)).await;
                }
            }
            .in_current_span(),
        );
    }

    /// A dial whose agent went away before answering: the agent never opened the
    /// connection for it, so it is sent to another eligible agent (a few times at most);
    /// with none left, the frontend gets the error at once.
    fn redispatch(self: &Arc<Self>, random: i64, pending: PendingDial, error: String) {
        let this = self.clone();
        tokio::spawn(
            async move {
                let fe = pending.frontend.clone();
                let next = (pending.attempts < MAX_REDISPATCH && !fe.is_closed())
                    .then(|| this.registry.route(&this.config.strategies, &pending.request.address).ok())
                    .flatten();
                match next {
                    Some((agent, strategy)) => {
                        tracing::info!(random, agent_id = %agent.agent_id, "agent went away before answering; dial sent to another agent");
                        let PendingDial { request, started, attempts, .. } = pending;
                        this.send_dial(&fe, request, agent, strategy, started, attempts + 1).await;
                    }
                    None => {
                        this.metrics.dial_failed(DialFailure::BackendClose);
                        let reason = this.unless_stopping(Reason::Agent);
                        this.refused(&fe, &pending.request.address, reason, &error);
                        this.to_frontend(&fe, Packet::dial_response(random, 0, error));
                    }
                }
            }
            .in_current_span(),
        );
    }

    /// Removes a pending dial and tells its frontend it failed. False when it was no
    /// longer pending.
    fn fail_pending(
        &self,
        agent: &AgentStream,
        random: i64,
        reason: DialFailure,
        error: &str,
    ) -> bool {
        let Some(pending) = self.take_pending(agent, random) else {
            return false;
        };
        self.metrics.dial_failed(reason);
        self.dial_failed(agent, random, &pending, Reason::Timeout, error);
        self.to_frontend(&pending.frontend, Packet::dial_response(random, 0, error));
        true
    }

    /// A DATA packet from `fe` for one of its connections. With a Tether agent it
    /// waits for the connection's credit (holding up only this frontend stream). False
    /// when the connection or its agent is gone.
    pub async fn send_data(&self, fe: &FrontendStream, packet: Packet) -> bool {
        let Some(Payload::Data(d)) = &packet.payload else {
            return true;
        };
        let (connect_id, len) = (d.connect_id, d.data.len());
        let Some(conn) = fe.route(connect_id) else {
            tracing::debug!(connect_id, "DATA for unknown connectID");
            self.to_frontend(fe, Packet::unknown_connection(connect_id));
            return false;
        };
        if !conn.flow.reserve(len).await {
            return false;
        }
        self.metrics.bytes_to_agent.inc_by(len as u64);
        conn.sent(len);
        match conn.agent() {
            Some(agent) => {
                // The agent's queue is full: this frontend stream waits, as upstream's
                // does when its receive channel is full (`service_method="Proxy"`).
                let full = (agent.tx.capacity() == 0).then(|| {
                    let g = self
                        .metrics
                        .full_receive_channels
                        .with_label_values(&["Proxy"]);
                    g.inc();
                    g
                });
                let sent = self.to_agent(&agent, packet).await;
                if let Some(g) = full {
                    g.dec();
                }
                sent
            }
            None => false,
        }
    }

    /// A CLOSE_REQ from `fe`: passed to the agent, whose CLOSE_RSP comes back to `fe`.
    pub async fn close(&self, fe: &FrontendStream, connect_id: i64) {
        let conn = fe.route(connect_id);
        if let Some(c) = &conn {
            c.close_requested();
        }
        match conn.and_then(|c| c.agent()) {
            Some(agent) => {
                self.to_agent(&agent, Packet::close_request(connect_id))
                    .await;
            }
            None => {
                self.to_frontend(fe, Packet::unknown_connection(connect_id));
            }
        }
    }

    /// A DIAL_CLS from `fe`: the client gave up on a pending dial.
    pub async fn cancel(&self, fe: &FrontendStream, random: i64) {
        if let Some(agent) = fe.unexpect(random) {
            self.abandon_dial(&agent, random).await;
        } else if let Some(address) = fe.unwait(random) {
            self.metrics.dial_failed(DialFailure::FrontendClose);
            let reason = self.unless_stopping(Reason::Client);
            self.refused(fe, &address, reason, "cancelled while waiting for an agent");
        }
    }

    /// The frontend no longer wants dial `random`: take it off `agent` and tell the
    /// agent with DIAL_CLS (unless the dial was answered or failed meanwhile).
    async fn abandon_dial(&self, agent: &AgentStream, random: i64) {
        if let Some(pending) = self.take_pending(agent, random) {
            self.metrics.dial_failed(DialFailure::FrontendClose);
            let reason = self.unless_stopping(Reason::Client);
            self.dial_failed(agent, random, &pending, reason, "");
            self.to_agent(agent, Packet::close_dial(random)).await;
        }
    }

    /// `fe` is gone: cancel its pending dials and close its connections on the agents.
    pub async fn frontend_gone(&self, fe: &FrontendStream) {
        let routes = fe.take_routes();
        for (random, agent) in routes.pending {
            self.abandon_dial(&agent, random).await;
        }
        for (connect_id, conn) in routes.conns {
            conn.close();
            let Some(agent) = conn.agent() else {
                continue;
            };
            if agent.remove_conn(connect_id).is_some() {
                self.metrics.connection_ended(conn.established);
                self.tunnel_ended(&conn, &agent, Reason::Client, "");
                self.to_agent(&agent, Packet::close_request(connect_id))
                    .await;
            }
        }
    }

    // === agent -> frontend ===

    /// A packet from `agent`.
    pub(crate) async fn on_agent_packet(&self, agent: &Arc<AgentStream>, packet: Packet) {
        self.metrics.packet(Segment::FromAgent, packet.r#type);
        match packet.payload {
            Some(Payload::DialResponse(rsp)) => self.on_dial_rsp(agent, rsp).await,
            Some(Payload::Data(ref d)) => {
                let (connect_id, len) = (d.connect_id, d.data.len());
                self.on_data(agent, connect_id, len, packet).await
            }
            Some(Payload::WindowUpdate(w)) => {
                if let Some(conn) = agent.conn(w.connect_id) {
                    conn.flow.grant(w.bytes);
                }
            }
            Some(Payload::CloseResponse(close)) => self.on_close_rsp(agent, close),
            Some(Payload::CloseDial(cls)) => self.on_close_dial(agent, cls),
            Some(Payload::Drain(_)) => {
                tracing::info!(agent_id = %agent.agent_id, "agent is draining; it is now last choice for new dials");
                agent.set_draining();
            }
            _ => tracing::debug!(ty = packet.r#type, "unexpected packet from agent; ignored"),
        }
    }

    /// DIAL_RSP: the pending dial becomes a connection (or fails) on its frontend.
    async fn on_dial_rsp(&self, agent: &Arc<AgentStream>, rsp: DialResponse) {
        let (random, connect_id) = (rsp.random, rsp.connect_id);
        let success = rsp.error.is_empty();
        let Some(pending) = self.take_pending(agent, random) else {
            self.metrics.dial_failed(DialFailure::UnrecognizedResponse);
            if success {
                // Nobody waits for it any more (cancelled or timed out): close it.
                self.to_agent(agent, Packet::close_request(connect_id))
                    .await;
            }
            return;
        };
        let fe = pending.frontend.clone();
        if !success {
            self.metrics.dial_failed(DialFailure::ErrorResponse);
            // Who asked: a policy refusal can be a stolen frontend credential probing
            // the node's network.
            tracing::info!(
                agent_id = %agent.agent_id,
                requester = %fe.peer,
                address = tether_core::ratelimit::clipped(&pending.request.address, 256),
                error = %rsp.error,
                "agent failed to dial"
            );
            let reason = Reason::of_dial_error(&rsp.error);
            self.dial_failed(agent, random, &pending, reason, &rsp.error);
            self.to_frontend(&fe, Packet::dial_response(random, connect_id, rsp.error));
            return;
        }
        let latency = pending.started.elapsed();
        let dialed = Dialed {
            peer: fe.peer.clone(),
            address: pending.request.address,
            random,
            strategy: pending.strategy,
            latency,
        };
        let conn = Conn::new(connect_id, &fe, agent, self.work.watch(), dialed);
        if !fe.claim(&conn) {
            // Two agents used the same connectID on one frontend stream; the client
            // could not tell them apart.
            tracing::warn!(
                connect_id,
                "connectID already in use on this frontend stream; refusing"
            );
            conn.close();
            self.tunnel_ended(&conn, agent, Reason::Agent, "connectID collision");
            self.to_agent(agent, Packet::close_request(connect_id))
                .await;
            self.to_frontend(
                &fe,
                Packet::dial_response(random, 0, "connectID collision, retry the dial"),
            );
            return;
        }
        agent.add_conn(conn);
        self.metrics.established_connections.inc();
        self.metrics.dial_duration.observe(latency.as_secs_f64());
        if !self.to_frontend(&fe, Packet::dial_response(random, connect_id, "")) {
            self.metrics.dial_failed(DialFailure::SendRsp);
            self.frontend_gone(&fe).await;
        }
    }

    /// DATA from the agent: admitted by the connection's window, then queued for the
    /// client. The agent's stream waits here while an upstream agent's connection is
    /// full (upstream's full receive channel).
    async fn on_data(&self, agent: &AgentStream, connect_id: i64, len: usize, packet: Packet) {
        let Some(conn) = agent.conn(connect_id) else {
            tracing::debug!(connect_id, "DATA from agent for unknown connectID; dropped");
            return;
        };
        let start = Instant::now();
        let full = conn.flow.window().is_full().then(|| {
            let g = self
                .metrics
                .full_receive_channels
                .with_label_values(&["Connect"]);
            g.inc();
            g
        });
        let admitted = conn.flow.admit(len, self.config.stall_timeout).await;
        if let Some(g) = full {
            g.dec();
        }
        self.metrics
            .frontend_write_duration
            .observe(start.elapsed().as_secs_f64());
        match admitted {
            Ok(true) => {
                self.metrics.bytes_from_agent.inc_by(len as u64);
                conn.received(len);
                let Some(fe) = conn.frontend() else { return };
                if !self.to_frontend(&fe, Outgoing::data(packet, conn)) {
                    self.frontend_gone(&fe).await;
                }
            }
            Ok(false) => {}
            Err(Refused::Overrun) => {
                tracing::warn!(agent_id = %agent.agent_id, connect_id, "agent sent more than the flow-control window; closing the connection");
                let error = "agent exceeded the flow-control window".to_string();
                self.close_conn(agent, &conn, Reason::Agent, error).await;
            }
            Err(Refused::Stalled(timeout)) => {
                tracing::warn!(agent_id = %agent.agent_id, connect_id, queued = conn.flow.window().queued(), ?timeout, "client stopped reading; closing the connection (--stalled-reader-timeout)");
                let error = format!("client did not read for {timeout:?}; connection closed");
                self.close_conn(agent, &conn, Reason::Timeout, error).await;
            }
        }
    }

    /// CLOSE_RSP: the agent closed the connection; its frontend hears it.
    fn on_close_rsp(&self, agent: &AgentStream, close: CloseResponse) {
        if let Some(conn) = agent.remove_conn(close.connect_id) {
            let reason = match (conn.is_close_requested(), close.error.is_empty()) {
                (true, _) => Reason::Client,
                (false, true) => Reason::Agent,
                (false, false) => Reason::BackendError,
            };
            self.tunnel_ended(&conn, agent, reason, &close.error);
            let packet = Packet::close_response(close.connect_id, close.error);
            self.conn_ended(&conn, packet);
        }
    }

    /// DIAL_CLS: the agent gave up on a dial before answering it.
    fn on_close_dial(&self, agent: &AgentStream, cls: CloseDial) {
        if let Some(pending) = self.take_pending(agent, cls.random) {
            self.metrics.dial_failed(DialFailure::ErrorResponse);
            let error = "the agent gave up the dial (DIAL_CLS)";
            self.dial_failed(agent, cls.random, &pending, Reason::DialError, error);
            self.to_frontend(&pending.frontend, Packet::close_dial(cls.random));
        }
    }

    // === agent streams ===

    /// Registers a new agent stream, unless its agent ID or verified identity already
    /// holds `--max-agent-streams` streams.
    pub fn add_agent(&self, agent: Arc<AgentStream>) -> Result<(), TooManyStreams> {
        self.registry.add(agent.clone())?;
        self.count_agent(&agent, 1);
        if self.agents_told.load(Ordering::Relaxed) {
            self.tell_drain(&agent);
        }
        Ok(())
    }

    /// Moves `ready_backends{proxy_strategy}` and `ready_backend_connections` by `by`
    /// for `agent`: each strategy counts the agents it could ever pick.
    fn count_agent(&self, agent: &AgentStream, by: i64) {
        self.metrics.ready_backend_connections.add(by);
        let pod_ips = self.registry.nodes().routes_pod_ips();
        let trust = self.config.trust_claims;
        for s in &self.config.strategies {
            if agent.counts_for(*s, pod_ips, trust) {
                self.metrics
                    .ready_backends
                    .with_label_values(&[s.name()])
                    .add(by);
            }
        }
    }

    /// An agent stream ended: its pending dials go to other agents (or fail), its
    /// connections close at once.
    pub fn remove_agent(self: &Arc<Self>, agent: &AgentStream) {
        agent.closed.cancel();
        if self.registry.remove(agent) {
            self.count_agent(agent, -1);
        }
        let tables = agent.take_tables();
        let error = format!("agent {} disconnected", agent.agent_id);
        for (random, pending) in tables.pending {
            self.forget_pending(random, &pending);
            self.redispatch(random, pending, error.clone());
        }
        for (connect_id, conn) in tables.conns {
            self.tunnel_ended(&conn, agent, Reason::Agent, &error);
            self.conn_ended(&conn, Packet::close_response(connect_id, error.clone()));
        }
    }

    /// Bookkeeping for a connection just taken off its agent stream's table: the gauge,
    /// waking its credit/window waiters, the frontend's route, and `to_client` (its
    /// CLOSE_RSP) for the client.
    fn conn_ended(&self, conn: &Conn, to_client: Packet) {
        self.metrics.connection_ended(conn.established);
        conn.close();
        if let Some(fe) = conn.frontend() {
            fe.unroute(conn.connect_id);
            self.to_frontend(&fe, to_client);
        }
    }

    /// Closes `conn` from the server's side: the client gets CLOSE_RSP with `error`,
    /// the agent CLOSE_REQ.
    async fn close_conn(&self, agent: &AgentStream, conn: &Conn, reason: Reason, error: String) {
        let connect_id = conn.connect_id;
        if agent.remove_conn(connect_id).is_none() {
            return;
        }
        self.tunnel_ended(conn, agent, reason, &error);
        self.conn_ended(conn, Packet::close_response(connect_id, error));
        self.to_agent(agent, Packet::close_request(connect_id))
            .await;
    }

    /// Takes dial `random` off `agent`'s table (and its frontend's routes); `None` when
    /// someone else already did.
    fn take_pending(&self, agent: &AgentStream, random: i64) -> Option<PendingDial> {
        let pending = agent.take_pending(random)?;
        self.forget_pending(random, &pending);
        Some(pending)
    }

    /// Bookkeeping for a pending dial that left its agent stream's table.
    fn forget_pending(&self, random: i64, pending: &PendingDial) {
        self.metrics.pending_backend_dials.dec();
        pending.frontend.unexpect(random);
    }
}

/// How a frontend's byte pump sends: DATA through [`Router::send_data`], so both
/// frontends take the same road to the agent (credit, counters).
pub struct FrontendSink<'a> {
    router: &'a Router,
    fe: &'a FrontendStream,
}

impl<'a> FrontendSink<'a> {
    /// The sink of `fe`'s connections.
    pub fn new(router: &'a Router, fe: &'a FrontendStream) -> Self {
        FrontendSink { router, fe }
    }
}

impl Sink for FrontendSink<'_> {
    /// Boxed: the pump's state then holds a pointer while idle, not the whole of
    /// `send_data` (one allocation per DATA packet of up to 128 KiB).
    fn send(&self, packet: Packet) -> impl Future<Output = bool> + Send {
        Box::pin(self.router.send_data(self.fe, packet))
    }
}

//! The dialer: opens target TCP connections on the server's DIAL_REQ (with a timeout,
//! cancellable by DIAL_CLS), assigns connectIDs, and pumps bytes between each target
//! socket and the agent stream until either side closes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tether_core::drain;
use tether_core::flow::{ConnFlow, Refused};
use tether_core::pump::{splice, Flow, Sink, SpliceEnd};
use tether_core::queue;
use tether_proto::{packet::Payload, DialRequest, Packet};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::audit::{Audited, Counting, Dial, Outcome, Traffic};
use crate::metrics::Metrics;
use crate::policy::{DialFailure, DialPolicy};

/// Direction indexes for packet counters.
pub(crate) const FROM_SERVER: usize = 0;
pub(crate) const TO_SERVER: usize = 1;

struct Conn {
    /// DATA and CLOSE_REQ for the connection's pump, in arrival order (bounded by
    /// `flow.window()`, not by the channel).
    tx: queue::Sender<Packet>,
    flow: Arc<ConnFlow>,
    /// The connection's hard stop (a child of the session's `closed`): ends its pump.
    hard_stop: CancellationToken,
    /// Holds the agent's drain open while the connection lives.
    _work: drain::Watch,
}

/// What goes to the server, in two queues, both bounded. Answers the stream's reader
/// or a dial gives (DIAL_RSP, DRAIN, CLOSE_RSP for what the agent does not know or
/// aborts) go into `control`, which the writer takes first: a dial's answer never waits
/// behind connection traffic, and it waits on nothing but the server's reading (not on
/// the reader it feeds). A server that stops reading fills it, and then the reader
/// waits too, as upstream's agent blocks in its send: what a server makes the agent
/// hold stays bounded. A connection's DATA, its WINDOW_UPDATEs and its last CLOSE_RSP
/// go into `data` (`--xfr-channel-size`), where its pump waits its turn: a connection's
/// CLOSE_RSP follows its DATA, and its DIAL_RSP (queued first) goes before either. A
/// CLOSE_RSP for a connection the agent aborts goes with the answers, ahead of DATA
/// the pump had queued: the connection is being cut, and the server drops the rest.
pub(crate) struct Outbox {
    /// Answers ([`ANSWERS`] at most).
    pub(crate) control: mpsc::Sender<Packet>,
    /// Connection traffic; bounded.
    pub(crate) data: mpsc::Sender<Packet>,
}

/// The agent's drain, as its sessions take part in it.
#[derive(Clone, Default)]
pub(crate) struct AgentDrain {
    /// Every open target connection, across all sessions, holds a watch: the drain
    /// waits for the last.
    pub(crate) work: Arc<drain::Signal>,
    /// Cancelled for the drain's last seconds: each connection then closes at its
    /// first quiet moment ([`QUIET`]), so that a client's keep-alive connection ends
    /// between two requests, not under one at the hard stop.
    pub(crate) closing: CancellationToken,
}

/// How long a connection must carry nothing, the target having sent last, to be
/// closed at the end of a drain: longer than the gaps within one answer, shorter than
/// the pause between a client's requests on a keep-alive connection.
pub const QUIET: Duration = Duration::from_millis(100);

/// What a session asks before each dial and records after it.
pub(crate) struct Targets {
    /// What servers may have this agent dial.
    pub(crate) policy: Arc<DialPolicy>,
    /// The audit log and the stream's server id.
    pub(crate) audited: Audited,
}

/// What this stream's server negotiated and says.
#[derive(Default)]
pub(crate) struct Peer {
    /// The server's per-connection receive window, when it does credit flow control.
    pub(crate) window: Option<u32>,
    /// Cancelled when the server says DRAIN: it is stopping (a Tether server tells the
    /// agents that asked, `tether-drain-notice`). The stream serves on.
    pub(crate) draining: CancellationToken,
}

/// The connections of one agent stream.
pub(crate) struct Session {
    out: Outbox,
    conns: Mutex<HashMap<i64, Conn>>,
    pending: Mutex<HashMap<i64, CancellationToken>>,
    next_id: AtomicI64,
    draining: AtomicBool,
    dial_timeout: Duration,
    /// What the server negotiated and says.
    peer: Peer,
    /// How long a connection's full queue may hold up the stream (upstream server).
    stall_timeout: Duration,
    metrics: Metrics,
    /// Cancelled when the stream ends: every pump stops.
    pub(crate) closed: CancellationToken,
    /// The agent's drain.
    drain: AgentDrain,
    /// What servers may have this agent dial.
    policy: Arc<DialPolicy>,
    /// The audit log and this stream's server id.
    audited: Audited,
}

impl Session {
    pub(crate) fn new(
        out: Outbox,
        dial_timeout: Duration,
        peer: Peer,
        stall_timeout: Duration,
        metrics: Metrics,
        drain: AgentDrain,
        targets: Targets,
    ) -> Arc<Self> {
        Arc::new(Session {
            out,
            conns: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicI64::new(1),
            draining: AtomicBool::new(false),
            dial_timeout,
            peer,
            stall_timeout,
            metrics,
            closed: CancellationToken::new(),
            drain,
            policy: targets.policy,
            audited: targets.audited,
        })
    }

    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Conn>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<i64, CancellationToken>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a connection's packet behind its earlier ones (waits its turn).
    pub(crate) async fn send(&self, packet: Packet) -> bool {
        self.metrics.packets.inc(TO_SERVER, packet.r#type);
        self.out.data.send(packet).await.is_ok()
    }

    /// Queues an answer; the writer takes answers before connection traffic.
    pub(crate) async fn answer(&self, packet: Packet) -> bool {
        self.metrics.packets.inc(TO_SERVER, packet.r#type);
        self.out.control.send(packet).await.is_ok()
    }

    /// Stops taking dials and tells the server so. It never waits (the stream's task
    /// calls it, and that task also drives the writer that makes room): with the
    /// answers full, DRAIN is queued from a task of its own.
    pub(crate) fn drain(&self) {
        if self.draining.swap(true, Ordering::Relaxed) {
            return;
        }
        self.metrics
            .packets
            .inc(TO_SERVER, tether_proto::PacketType::Drain as i32);
        if let Err(mpsc::error::TrySendError::Full(p)) = self.out.control.try_send(Packet::drain())
        {
            let control = self.out.control.clone();
            tokio::spawn(async move { control.send(p).await });
        }
    }

    /// Handles one packet from the server.
    pub(crate) async fn handle(self: &Arc<Self>, packet: Packet) {
        self.metrics.packets.inc(FROM_SERVER, packet.r#type);
        match packet.payload {
            Some(Payload::DialRequest(req)) => self.dial(req).await,
            Some(Payload::Data(ref d)) => {
                let (connect_id, len) = (d.connect_id, d.data.len());
                self.on_data(connect_id, len, packet).await
            }
            Some(Payload::CloseRequest(c)) => {
                let tx = self.conns().get(&c.connect_id).map(|c| c.tx.clone());
                match tx {
                    // The pump writes what is queued, then closes and answers.
                    Some(tx) => drop(tx.send(packet)),
                    // Behind the CLOSE_RSP a connection that just ended has queued.
                    None => {
                        self.send(Packet::unknown_connection(c.connect_id)).await;
                    }
                }
            }
            Some(Payload::WindowUpdate(w)) => {
                let flow = self.conns().get(&w.connect_id).map(|c| c.flow.clone());
                if let Some(flow) = flow {
                    flow.grant(w.bytes);
                }
            }
            Some(Payload::CloseDial(c)) => {
                if let Some(hard_stop) = self.pending().remove(&c.random) {
                    tracing::info!(random = c.random, "dial cancelled by server");
                    hard_stop.cancel();
                }
            }
            Some(Payload::Drain(_)) if !self.peer.draining.is_cancelled() => {
                tracing::info!("the server is stopping (DRAIN): connecting to the other servers; this stream serves its tunnels to the end");
                self.peer.draining.cancel();
            }
            _ => tracing::debug!(ty = packet.r#type, "unexpected packet from server; ignored"),
        }
    }

    /// DATA from the server: admitted by the connection's window, then queued for its
    /// pump. The stream waits here while an upstream server's connection is full.
    async fn on_data(&self, connect_id: i64, len: usize, packet: Packet) {
        let conn = self
            .conns()
            .get(&connect_id)
            .map(|c| (c.tx.clone(), c.flow.clone()));
        let Some((tx, flow)) = conn else {
            tracing::debug!(connect_id, "DATA for unknown connectID");
            self.send(Packet::unknown_connection(connect_id)).await;
            return;
        };
        match flow.admit(len, self.stall_timeout).await {
            // A failed send means the pump already ended and sent CLOSE_RSP.
            Ok(true) => drop(tx.send(packet)),
            Ok(false) => {}
            Err(Refused::Overrun) => {
                tracing::warn!(
                    connect_id,
                    "server sent more than the flow-control window; closing the connection"
                );
                self.abort(connect_id, "flow-control window exceeded").await;
            }
            Err(Refused::Stalled(timeout)) => {
                tracing::warn!(
                    connect_id,
                    queued = flow.window().queued(),
                    ?timeout,
                    "target stopped reading; closing the connection (--stalled-reader-timeout)"
                );
                let error =
                    format!("agent: target did not read for {timeout:?}; connection closed");
                self.abort(connect_id, &error).await;
            }
        }
    }

    async fn dial(self: &Arc<Self>, req: DialRequest) {
        let random = req.random;
        if req.protocol != "tcp" && !req.protocol.is_empty() {
            let protocol = cut(&req.protocol);
            self.answer(Packet::dial_response(
                random,
                0,
                format!("protocol {protocol:?} is not supported (only tcp)"),
            ))
            .await;
            return;
        }
        let connect_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let hard_stop = self.closed.child_token();
        self.pending().insert(random, hard_stop.clone());
        let this = self.clone();
        // A debug-level span: info-level spans cost ~0.4 KiB per open connection in the
        // subscriber; events that matter at info carry the address themselves.
        let span = tracing::debug_span!("conn", address = %req.address, connect_id);
        tokio::spawn(
            this.run_conn(req.address, random, connect_id, hard_stop)
                .instrument(span),
        );
    }

    async fn run_conn(
        self: Arc<Self>,
        address: String,
        random: i64,
        connect_id: i64,
        hard_stop: CancellationToken,
    ) {
        let Some((stream, dialed)) = self.connect(&address, random, connect_id, &hard_stop).await
        else {
            return;
        };
        let connected = Instant::now();
        let (rx, flow) = self.register(connect_id, &hard_stop);
        if !self
            .answer(Packet::dial_response(random, connect_id, ""))
            .await
        {
            self.finish(connect_id);
            return;
        }
        tracing::debug!("connected");
        let (rd, wr) = stream.into_split();
        let flow = Flow {
            send: flow.credit(),
            recv: Some(flow.window()),
        };
        // What it carries, for the audit record and the quiet close.
        let traffic = Traffic::default();
        let rx = futures::StreamExt::inspect(rx, |p| traffic.count_to_target(p));
        let sink = Counting {
            inner: self.as_ref(),
            traffic: &traffic,
        };
        let spliced = splice(rd, wr, rx, &sink, connect_id, &hard_stop, flow);
        // `None`: closed at a quiet moment at the end of the drain.
        // With credit flow control the pump reads the target only with credit left: a
        // connection out of credit is held up, not quiet.
        let delivered = || flow.send.is_none_or(|credit| credit.available() > 0);
        let end = tokio::select! {
            end = spliced => Some(end),
            () = quiet(&self.drain.closing, &traffic, delivered) => None,
        };
        let audit = Dial {
            address: &address,
            random,
            connect_id,
            started: connected,
        };
        self.audited
            .closed(&audit, dialed, end.as_ref(), traffic.bytes());
        self.ended(connect_id, end).await;
    }

    /// Registers connection `connect_id` (its queue, flow control and hard stop): what
    /// the server sends it comes out of the returned queue.
    fn register(
        &self,
        connect_id: i64,
        hard_stop: &CancellationToken,
    ) -> (queue::Receiver<Packet>, Arc<ConnFlow>) {
        let (tx, rx) = queue::queue();
        let flow = Arc::new(ConnFlow::new(self.peer.window));
        let conn = Conn {
            tx,
            flow: flow.clone(),
            hard_stop: hard_stop.clone(),
            _work: self.drain.work.watch(),
        };
        self.conns().insert(connect_id, conn);
        self.metrics.open_endpoint_connections.inc();
        (rx, flow)
    }

    /// Forgets connection `connect_id`, which ended as `end` (`None`: at a quiet moment
    /// at the end of the drain), and tells the server unless it knows already.
    async fn ended(&self, connect_id: i64, end: Option<SpliceEnd>) {
        let error = match &end {
            Some(SpliceEnd::LocalError(e)) => e.to_string(),
            _ => String::new(),
        };
        tracing::debug!(?end, "connection ended");
        let told = matches!(end, Some(SpliceEnd::Cancelled | SpliceEnd::SinkGone));
        // Forgotten only once its CLOSE_RSP is queued: a CLOSE_REQ or DATA that crosses
        // it meanwhile goes to the ended pump, unanswered, instead of drawing an
        // "unknown connectID" that would reach the server first.
        let registered = self.halt(connect_id);
        if registered && !told {
            self.send(Packet::close_response(connect_id, error)).await;
        }
        self.finish(connect_id);
    }

    /// Wakes whoever waits on `connect_id`'s flow control, leaving it registered; true
    /// when it still was.
    fn halt(&self, connect_id: i64) -> bool {
        let conns = self.conns();
        conns.get(&connect_id).map(|c| c.flow.close()).is_some()
    }

    /// Opens the target connection for dial `random`, with the address it went to when
    /// the audit records it; on failure the server gets the DIAL_RSP error. `None` also
    /// when the server cancelled the dial meanwhile.
    async fn connect(
        &self,
        address: &str,
        random: i64,
        connect_id: i64,
        hard_stop: &CancellationToken,
    ) -> Option<(TcpStream, Option<std::net::SocketAddr>)> {
        let started = Instant::now();
        let audit = Dial {
            address,
            random,
            connect_id,
            started,
        };
        let dialed = tokio::select! {
            r = tokio::time::timeout(self.dial_timeout, self.policy.connect(address)) => Some(r),
            _ = hard_stop.cancelled() => None,
        };
        // DIAL_CLS won the race when the dial is no longer pending: nobody wants it.
        let wanted = self.pending().remove(&random).is_some();
        let Some(dialed) = dialed.filter(|_| wanted) else {
            self.audited.dial(&audit, Outcome::Cancelled, None, None);
            return None;
        };
        let (reason, error) = match dialed {
            Ok(Ok(stream)) => {
                let _ = stream.set_nodelay(true);
                self.metrics
                    .dial_duration
                    .observe(started.elapsed().as_secs_f64());
                let dialed = self.audited.peer_of(&stream);
                self.audited.dial(&audit, Outcome::Connected, dialed, None);
                return Some((stream, dialed));
            }
            Ok(Err(DialFailure::Refused(refusal))) => {
                self.refuse(&audit, refusal).await;
                return None;
            }
            // Upstream's two reasons: a Go net.Error that timed out, and everything
            // else (a refused connection included).
            Ok(Err(DialFailure::Io(e))) if e.kind() == std::io::ErrorKind::TimedOut => {
                ("timeout", e.to_string())
            }
            Ok(Err(e)) => ("unknown", e.to_string()),
            Err(_) => ("timeout", "i/o timeout".to_string()),
        };
        self.metrics
            .dial_failures
            .with_label_values(&[reason])
            .inc();
        tracing::info!(%address, connect_id, %error, "dial failed");
        let address = cut(address);
        let error = format!("dial tcp {address}: {error}");
        self.audited
            .dial(&audit, Outcome::Failed, None, Some(&error));
        let rsp = Packet::dial_response(random, 0, error);
        self.answer(rsp).await;
        None
    }

    /// A dial the policy refused: counted, logged (rate-limited, with what a name
    /// resolved to), recorded, and answered with the refusal's text.
    async fn refuse(&self, dial: &Dial<'_>, refusal: crate::policy::Refusal) {
        self.metrics.dial_refusals.inc();
        if let Some(left_out) = self.policy.refusal_log.allow() {
            tracing::warn!(
                address = cut(dial.address),
                random = dial.random,
                left_out,
                "{}",
                refusal.detail
            );
        }
        self.audited
            .dial(dial, Outcome::Refused, None, Some(&refusal.answer));
        self.answer(Packet::dial_response(dial.random, 0, refusal.answer))
            .await;
    }

    /// Closes `connect_id` from our side: its pump stops and the server gets CLOSE_RSP
    /// with `error` (ahead of what the pump had queued: the connection is being cut).
    async fn abort(&self, connect_id: i64, error: &str) {
        let conn = self.conns().get(&connect_id).map(|c| c.hard_stop.clone());
        if let Some(hard_stop) = conn {
            hard_stop.cancel();
            if self.finish(connect_id) {
                self.answer(Packet::close_response(connect_id, error)).await;
            }
        }
    }

    /// Forgets `connect_id`; true when it was still registered.
    fn finish(&self, connect_id: i64) -> bool {
        let Some(conn) = self.conns().remove(&connect_id) else {
            return false;
        };
        conn.flow.close();
        self.metrics.open_endpoint_connections.dec();
        true
    }
}

/// Resolves at the connection's first quiet moment once `closing` is cancelled: nothing
/// carried either way for [`QUIET`], the target sent last (an answer is complete, no
/// request waits for one) and all it sent is `delivered` (none waits for room or
/// credit on its way). Until then it only waits on the token: the sampling loop is
/// allocated when the drain's end begins, not kept in every pump.
async fn quiet(closing: &CancellationToken, traffic: &Traffic, delivered: impl Fn() -> bool) {
    closing.cancelled().await;
    Box::pin(async {
        let mut seen = traffic.bytes();
        let mut since = Instant::now();
        loop {
            tokio::time::sleep(QUIET / 4).await;
            let now = traffic.bytes();
            if now != seen {
                (seen, since) = (now, Instant::now());
            } else if since.elapsed() >= QUIET && traffic.target_spoke_last() && delivered() {
                return;
            }
        }
    })
    .await
}

/// How many answers may wait for the server to read (see [`Outbox`]).
pub(crate) const ANSWERS: usize = 256;

/// What of a server-given string an answer echoes: at most 256 bytes, so a server
/// cannot make the agent hold large copies of what it sent.
fn cut(s: &str) -> &str {
    tether_core::ratelimit::clipped(s, 256)
}

/// The connections' pumps send through the session: DATA and WINDOW_UPDATE are
/// counted like every other packet to the server.
impl Sink for Session {
    fn send(&self, packet: Packet) -> impl std::future::Future<Output = bool> + Send {
        self.metrics.packets.inc(TO_SERVER, packet.r#type);
        futures::FutureExt::map(self.out.data.send(packet), |r| r.is_ok())
    }
}

#[cfg(test)]
mod tests {
    //! The dialer in process: a session whose packets to the server the test reads,
    //! dialling real sockets on 127.0.0.1.

    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    const PATIENCE: Duration = Duration::from_secs(5);

    /// What the session queues for the server, answers first, as the writer takes them.
    struct ToServer {
        control: mpsc::Receiver<Packet>,
        data: mpsc::Receiver<Packet>,
    }

    impl ToServer {
        fn try_recv(&mut self) -> Option<Packet> {
            self.control
                .try_recv()
                .or_else(|_| self.data.try_recv())
                .ok()
        }
    }

    fn session(window: Option<u32>) -> (Arc<Session>, ToServer, AgentDrain) {
        let (control, control_rx) = mpsc::channel(ANSWERS);
        let (data, data_rx) = mpsc::channel(64);
        let drain = AgentDrain::default();
        let timeout = Duration::from_secs(5);
        let stall = Duration::from_secs(30);
        let out = Outbox { control, data };
        let targets = Targets {
            policy: crate::policy::DialPolicy::new(crate::policy::PolicyConfig {
                any: true,
                ..Default::default()
            }),
            audited: Audited::default(),
        };
        let peer = Peer {
            window,
            ..Peer::default()
        };
        let s = Session::new(
            out,
            timeout,
            peer,
            stall,
            Metrics::new(),
            drain.clone(),
            targets,
        );
        let rx = ToServer {
            control: control_rx,
            data: data_rx,
        };
        (s, rx, drain)
    }

    async fn next(rx: &mut ToServer) -> Payload {
        let p = tokio::time::timeout(PATIENCE, async {
            tokio::select! {
                biased;
                Some(p) = rx.control.recv() => p,
                Some(p) = rx.data.recv() => p,
            }
        })
        .await;
        p.expect("a packet for the server").payload.unwrap()
    }

    async fn dial(session: &Arc<Session>, address: String, random: i64) {
        let req = Packet::dial_request("tcp", &address, random);
        session.handle(req).await;
    }

    #[tokio::test]
    async fn dial_pump_and_close_leave_nothing_open() {
        let (session, mut rx, AgentDrain { work, .. }) = session(None);
        let target = TcpListener::bind("127.0.0.1:0").await.unwrap();
        dial(&session, target.local_addr().unwrap().to_string(), 11).await;
        let (mut sock, _) = target.accept().await.unwrap();
        let connect_id = match next(&mut rx).await {
            Payload::DialResponse(r) if r.error.is_empty() && r.random == 11 => r.connect_id,
            other => panic!("{other:?}"),
        };
        assert_eq!((connect_id, work.open()), (1, 1));

        session.handle(Packet::data(connect_id, &b"ping"[..])).await;
        let mut buf = [0u8; 4];
        sock.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");
        sock.write_all(b"pong").await.unwrap();
        assert!(matches!(next(&mut rx).await, Payload::Data(d) if &d.data[..] == b"pong"));

        session.handle(Packet::close_request(connect_id)).await;
        assert_eq!(sock.read(&mut buf).await.unwrap(), 0, "the target sees EOF");
        assert!(
            matches!(next(&mut rx).await, Payload::CloseResponse(c) if c.connect_id == connect_id)
        );
        work.idle().await;
    }

    #[tokio::test]
    async fn a_refused_dial_is_answered_with_the_error() {
        let (session, mut rx, AgentDrain { work, .. }) = session(None);
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = closed.local_addr().unwrap().to_string();
        drop(closed);
        dial(&session, address.clone(), 3).await;
        match next(&mut rx).await {
            Payload::DialResponse(r) => {
                assert_eq!(r.random, 3);
                assert!(
                    r.error.starts_with(&format!("dial tcp {address}: ")),
                    "{}",
                    r.error
                );
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(work.open(), 0);
    }

    #[tokio::test]
    async fn packets_for_unknown_connections_get_a_close_and_nothing_breaks() {
        let (session, mut rx, _) = session(None);
        session.handle(Packet::data(9, &b"x"[..])).await;
        assert!(
            matches!(next(&mut rx).await, Payload::CloseResponse(c) if c.error == "unknown connectID 9")
        );
        session.handle(Packet::close_request(8)).await;
        // Queued with connection traffic, behind the CLOSE_RSP of a connection that has
        // just ended, never ahead of it.
        let queued = rx.data.try_recv().map(|p| p.payload);
        assert!(matches!(queued, Ok(Some(Payload::CloseResponse(c))) if c.connect_id == 8));
        session.handle(Packet::close_dial(77)).await;
        session.handle(Packet::window_update(5, 100)).await;
        let unsupported = Packet::dial_request("udp", "127.0.0.1:53", 4);
        session.handle(unsupported).await;
        assert!(matches!(next(&mut rx).await, Payload::DialResponse(r) if r.error.contains("udp")));
    }

    #[tokio::test]
    async fn drain_is_announced_once() {
        let (session, mut rx, _) = session(None);
        session.drain();
        session.drain();
        assert!(matches!(next(&mut rx).await, Payload::Drain(_)));
        assert!(rx.try_recv().is_none());
    }

    /// A DRAIN from the server (it is stopping) is noted for the server set, answers
    /// nothing, and the stream still serves dials.
    #[tokio::test]
    async fn a_drain_from_the_server_is_noted_and_dials_go_on() {
        let (session, mut rx, _) = session(None);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        assert!(!session.peer.draining.is_cancelled());
        session.handle(Packet::drain()).await;
        session.handle(Packet::drain()).await;
        assert!(session.peer.draining.is_cancelled());
        assert!(rx.try_recv().is_none(), "a DRAIN is not answered");
        dial(&session, listener.local_addr().unwrap().to_string(), 3).await;
        assert!(matches!(next(&mut rx).await, Payload::DialResponse(r) if r.error.is_empty()));
    }

    #[tokio::test]
    async fn a_server_overrunning_the_window_loses_that_connection() {
        let (session, mut rx, AgentDrain { work, .. }) = session(Some(64 << 10));
        let target = TcpListener::bind("127.0.0.1:0").await.unwrap();
        dial(&session, target.local_addr().unwrap().to_string(), 1).await;
        let (_sock, _) = target.accept().await.unwrap();
        let connect_id = match next(&mut rx).await {
            Payload::DialResponse(r) => r.connect_id,
            other => panic!("{other:?}"),
        };
        let too_much = 2 * tether_core::flow::DEFAULT_WINDOW as usize + 1;
        session
            .handle(Packet::data(connect_id, vec![0u8; too_much]))
            .await;
        match next(&mut rx).await {
            Payload::CloseResponse(c) => assert_eq!(c.error, "flow-control window exceeded"),
            other => panic!("{other:?}"),
        }
        work.idle().await;
    }

    /// Dials a fresh target through `session` as `random`: its socket and connectID.
    async fn connected(
        session: &Arc<Session>,
        rx: &mut ToServer,
        random: i64,
    ) -> (tokio::net::TcpStream, i64) {
        let target = TcpListener::bind("127.0.0.1:0").await.unwrap();
        dial(session, target.local_addr().unwrap().to_string(), random).await;
        let (sock, _) = target.accept().await.unwrap();
        match next(rx).await {
            Payload::DialResponse(r) if r.error.is_empty() => (sock, r.connect_id),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn at_the_end_of_a_drain_a_connection_closes_once_its_answer_is_complete() {
        let (session, mut rx, drain) = session(None);
        let mut buf = [0u8; 8];
        // Answered: the target spoke last.
        let (mut answered, answered_id) = connected(&session, &mut rx, 1).await;
        session.handle(Packet::data(answered_id, &b"GET"[..])).await;
        answered.read_exact(&mut buf[..3]).await.unwrap();
        answered.write_all(b"200").await.unwrap();
        assert!(matches!(next(&mut rx).await, Payload::Data(d) if &d.data[..] == b"200"));
        // Asked and not yet answered: the client spoke last.
        let (mut asked, asked_id) = connected(&session, &mut rx, 2).await;
        session.handle(Packet::data(asked_id, &b"GET"[..])).await;
        asked.read_exact(&mut buf[..3]).await.unwrap();

        drain.closing.cancel();
        match next(&mut rx).await {
            Payload::CloseResponse(c) => assert_eq!((c.connect_id, &*c.error), (answered_id, "")),
            other => panic!("the answered connection closes first: {other:?}"),
        }
        assert_eq!(
            answered.read(&mut buf).await.unwrap(),
            0,
            "its target sees EOF"
        );
        // The open request gets its answer, and only then is its connection closed.
        asked.write_all(b"200").await.unwrap();
        match next(&mut rx).await {
            Payload::Data(d) => assert_eq!((d.connect_id, &d.data[..]), (asked_id, &b"200"[..])),
            other => panic!("the answer comes before the close: {other:?}"),
        }
        match next(&mut rx).await {
            Payload::CloseResponse(c) => assert_eq!(c.connect_id, asked_id),
            other => panic!("{other:?}"),
        }
        drain.work.idle().await;
    }

    #[tokio::test]
    async fn at_the_end_of_a_drain_a_connection_held_up_for_credit_is_not_quiet() {
        let window = 64 << 10;
        let (session, mut rx, drain) = session(Some(window));
        let (mut target, id) = connected(&session, &mut rx, 1).await;
        session.handle(Packet::data(id, &b"GET"[..])).await;
        let mut buf = [0u8; 3];
        target.read_exact(&mut buf).await.unwrap();
        // An answer of four windows: the pump sends its credit's worth and waits.
        let answer = tokio::spawn(async move {
            target
                .write_all(&vec![7u8; 4 * window as usize])
                .await
                .unwrap();
            target
        });
        let mut got = 0;
        while got < window as usize {
            match next(&mut rx).await {
                Payload::Data(d) => got += d.data.len(),
                other => panic!("{other:?}"),
            }
        }
        drain.closing.cancel();
        // An observation window, not synchronisation: ten quiet periods out of credit.
        let early = tokio::time::timeout(QUIET * 10, next(&mut rx)).await;
        assert!(early.is_err(), "closed while held up for credit: {early:?}");
        // Credit comes: the rest of the answer goes out, then the connection closes.
        let mut closed = false;
        while !closed {
            // (A packet may overdraw the credit: grant the whole answer's worth.)
            session
                .handle(Packet::window_update(id, 4 * i64::from(window)))
                .await;
            match next(&mut rx).await {
                Payload::Data(d) => got += d.data.len(),
                Payload::CloseResponse(c) => closed = c.connect_id == id,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(
            got,
            4 * window as usize,
            "the whole answer before the close"
        );
        drop(answer.await.unwrap());
    }
}

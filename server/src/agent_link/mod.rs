//! The agent listener's gRPC service (`/AgentService/Connect`) on bare HTTP/2
//! (`h2serve`, no tonic or hyper between): validates an agent's metadata, registers its
//! stream with the router, answers with `serverid`/`servercount`, then carries the
//! stream in its connection's task, feeding what the agent sends into the server core
//! and writing what the router queues for it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use bytes::Bytes;
use futures::future::Either;
use futures::Stream;
use h2::server::SendResponse;
use h2::RecvStream;
use tether_core::grpc::{MessageError, Messages};
use tether_core::identifiers::AgentIdentifiers;
use tether_core::transport::TlsConnectInfo;
use tether_proto::{header, link, Packet};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Code, Status};
use tracing::Instrument;

use crate::identity::{self, Unverified};
use crate::metrics::Segment;
use crate::router::{AgentStream, Router, Verified};
use tether_core::grpc::server::{self as h2serve, status_from_h2, Reply, Settings};

/// Logs a refused stream (what any peer can cause): a warning while the link's
/// `refusal_log` allows one, which says how many it left out; debug otherwise.
macro_rules! refused {
    ($link:expr, $($rest:tt)*) => {
        match $link.refusal_log.allow() {
            Some(suppressed) => tracing::warn!(suppressed, $($rest)*),
            None => tracing::debug!($($rest)*),
        }
    };
}

pub(crate) mod quic;
mod ws;

/// Most bytes of a peer's agent ID a log line shows.
const SHOWN_ID: usize = 128;

/// What a log line shows of a peer's agent ID: at most [`SHOWN_ID`] bytes.
fn shown(agent_id: &str) -> &str {
    tether_core::ratelimit::clipped(agent_id, SHOWN_ID)
}

/// Serves agents' Connect streams.
pub struct AgentLink {
    pub(crate) router: Arc<Router>,
    pub(crate) server_id: String,
    pub(crate) server_count: Arc<std::sync::atomic::AtomicU32>,
    pub(crate) channel_size: usize,
    pub(crate) hard_stop: CancellationToken,
    pub(crate) authenticator: Option<Arc<crate::auth::TokenAuthenticator>>,
    /// Refuse agents with any claim the server could not verify.
    pub(crate) require_identity_match: bool,
    /// Agents may carry their stream over WebSocket (`--agent-websocket`).
    pub(crate) websocket: bool,
    /// Warnings about unverified claims: a fleet that claims what it cannot prove
    /// (a shared certificate) would otherwise log one per agent at every reconnect.
    pub(crate) unverified_warnings: tether_ops::ratelimit::TokenBucket,
    /// Connections per verified identity.
    pub(crate) identities: IdentityConnections,
    /// Warnings about refused streams: a peer can cause one per request.
    pub(crate) refusal_log: tether_core::ratelimit::LogLimit,
}

/// Warnings about refused streams per second, and their burst.
pub(crate) const REFUSAL_WARNINGS: (f64, u32) = (1.0, 20);

/// Warnings about unverified claims per second, and their burst; the rest are logged
/// at debug level (every claim is counted).
pub(crate) const UNVERIFIED_WARNINGS: (f64, u32) = (1.0, 20);

type PacketStream = Pin<Box<dyn Stream<Item = Packet> + Send>>;

/// An admitted agent stream, open in the router: what carries it.
struct OpenStream {
    agent: Arc<AgentStream>,
    packets: PacketStream,
    body: RecvStream,
    reply: Reply,
    token: Option<Box<(String, crate::auth::Bound)>>,
    span: tracing::Span,
    /// Its place in its connection's count, held until it ends.
    _live: LiveStream,
}

/// An admitted stream opened in the router, before its transport answers.
struct Opened {
    agent: Arc<AgentStream>,
    packets: PacketStream,
    token: Option<Box<(String, crate::auth::Bound)>>,
    span: tracing::Span,
    peer_window: Option<u32>,
    live: LiveStream,
}

/// An agent the link let in: who it is and what the server checked.
struct Admitted {
    agent_id: String,
    identifiers: AgentIdentifiers,
    verified: Verified,
    /// The agent's per-connection window when both sides do credit flow control.
    peer_window: Option<u32>,
    /// The agent asked to hear DRAIN when this server stops (`tether-drain-notice`).
    drain_notice: bool,
    peer: String,
    /// The token and what it proved, to review it again while the stream lives (boxed:
    /// the stream's future holds this for hours).
    token: Option<Box<(String, crate::auth::Bound)>>,
}

/// The method agents call.
const CONNECT_PATH: &str = "/AgentService/Connect";
/// An agent opens one Connect stream per connection; this many leaves room for a
/// reconnecting client's overlap and none for a flood.
const MAX_STREAMS: u32 = 100;
/// The agent's metadata, a bearer token included (hyper's default, which tonic used).
const MAX_HEADER_LIST: u32 = 16 << 10;
/// A connection on which no agent stream was admitted within this, or none has been open
/// for this long, is closed: TLS alone (any client can finish it where agents
/// authenticate by token), or a stream admitted once and cancelled, must not hold a
/// place under the listener's connection cap.
const ADMIT_WITHIN: Duration = Duration::from_secs(10);

/// One agent connection's streams: how many are admitted and open, whether one ever
/// was, and which verified identities the connection counts against.
#[derive(Default)]
pub(crate) struct ConnStreams {
    state: std::sync::Mutex<StreamsState>,
    changed: tokio::sync::Notify,
    /// While the connection is unproven: its stage, `Serving` while a request is
    /// checked (so that no newcomer evicts an agent whose token is under review).
    stages: Option<tether_core::admission::Stages>,
}

#[derive(Default)]
struct StreamsState {
    live: usize,
    ever: bool,
    identities: Vec<String>,
}

/// An admitted stream's place in its connection's count; given back when dropped.
struct LiveStream(Arc<ConnStreams>);

impl Drop for LiveStream {
    fn drop(&mut self) {
        self.0.state().live -= 1;
        self.0.changed.notify_waiters();
    }
}

impl ConnStreams {
    fn state(&self) -> std::sync::MutexGuard<'_, StreamsState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn open(self: &Arc<Self>) -> LiveStream {
        {
            let mut s = self.state();
            s.live += 1;
            s.ever = true;
        }
        self.changed.notify_waiters();
        LiveStream(self.clone())
    }

    /// Waits until `done` holds of the state.
    async fn until(&self, done: impl Fn(&StreamsState) -> bool) {
        loop {
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            if done(&self.state()) {
                return;
            }
            changed.await;
        }
    }

    /// Moves the (still unproven) connection to `stage`.
    fn stage(&self, stage: tether_core::admission::Stage) {
        if let Some(s) = &self.stages {
            s.set(stage);
        }
    }

    /// A stream refused: while unproven, the connection may be evicted at once (a
    /// refusal buys no fresh grace).
    fn refused(&self, mut reply: Reply, status: Status) {
        self.stage(tether_core::admission::Stage::Silent);
        reply.finish(status);
    }

    /// Resolves once the connection has had no admitted stream for [`ADMIT_WITHIN`]
    /// (counted from its start too).
    async fn idle(&self) {
        loop {
            self.until(|s| s.live == 0).await;
            let changed = self.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            if self.state().live > 0 {
                continue;
            }
            tokio::select! {
                _ = tokio::time::sleep(ADMIT_WITHIN) => return,
                _ = changed => {}
            }
        }
    }
}

/// How many connections each verified identity holds (each connection counted once,
/// from its first stream admitted as that identity until it closes): a node's
/// credential cannot hold the listener's connection slots, however many it opens.
pub(crate) struct IdentityConnections {
    max: usize,
    counts: std::sync::Mutex<std::collections::HashMap<String, usize>>,
}

impl IdentityConnections {
    /// At most `max` connections per identity (0 = no cap).
    pub(crate) fn new(max: usize) -> Self {
        IdentityConnections {
            max,
            counts: Default::default(),
        }
    }

    /// Counts `conn` against `identity` unless it already is; `Err(held)` at the cap.
    fn take(&self, identity: &str, conn: &ConnStreams) -> Result<(), usize> {
        let mut state = conn.state();
        if state.identities.iter().any(|i| i == identity) {
            return Ok(());
        }
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let n = counts.entry(identity.to_string()).or_default();
        if self.max > 0 && *n >= self.max {
            return Err(*n);
        }
        *n += 1;
        state.identities.push(identity.to_string());
        Ok(())
    }

    /// Gives back what a closed connection held.
    fn release(&self, conn: &ConnStreams) {
        let held = std::mem::take(&mut conn.state().identities);
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        for identity in held {
            if let Some(n) = counts.get_mut(&identity) {
                *n -= 1;
                if *n == 0 {
                    counts.remove(&identity);
                }
            }
        }
    }
}

impl AgentLink {
    /// Serves one agent connection (mutual TLS done, `info` says who) until the agent
    /// goes, a keepalive ping goes unanswered, the hard stop, or the connection has no
    /// admitted stream for [`ADMIT_WITHIN`]. Until its first stream is admitted it is
    /// unproven (`pending`): evicted when the listener needs room. Its streams run in
    /// this task: a packet read off the connection reaches the router, and one for the
    /// agent reaches the connection, without waking another task.
    pub async fn serve_connection<S>(
        self: Arc<Self>,
        io: S,
        info: TlsConnectInfo,
        pending: Option<tether_core::admission::Pending>,
        keepalive: Duration,
        alpn: Option<Vec<u8>>,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let info = Arc::new(info);
        let streams = Arc::new(ConnStreams {
            stages: pending.as_ref().map(|p| p.stages()),
            ..ConnStreams::default()
        });
        let serve =
            self.clone()
                .carry_connection(io, alpn, info.clone(), streams.clone(), keepalive);
        self.watched(info.remote_addr, &streams, pending, serve)
            .await;
    }

    /// Runs `serve` (one agent connection's) under the connection's watch: until its
    /// first stream is admitted it may be evicted, and it is closed after
    /// [`ADMIT_WITHIN`] without an admitted stream. Its identities are given back when
    /// it ends.
    async fn watched(
        &self,
        peer: std::net::SocketAddr,
        streams: &Arc<ConnStreams>,
        pending: Option<tether_core::admission::Pending>,
        serve: impl Future<Output = ()>,
    ) {
        let serve = std::pin::pin!(serve);
        let watch = std::pin::pin!(watch_admission(streams, pending));
        let why = tokio::select! {
            _ = serve => None,
            why = watch => Some(why),
        };
        self.identities.release(streams);
        if let Some(why) = why {
            self.router
                .metrics
                .connections_refused
                .with_label_values(&["agent", why.label()])
                .inc();
            match why {
                Closed::Unadmitted => {
                    tracing::info!(%peer, "no agent stream admitted on this connection within 10s; closed")
                }
                Closed::Idle => {
                    tracing::info!(%peer, "no agent stream open on this connection for 10s; closed")
                }
                Closed::Evicted => {
                    tracing::debug!(%peer, "unauthenticated connection evicted to make room; closed")
                }
            }
        }
    }

    /// Serves the connection as the protocol agreed by ALPN asks: `h2`, gRPC on HTTP/2
    /// (as upstream), `http/1.1`, a WebSocket ([`ws`]); with none agreed (a reverse
    /// proxy's connection to the server), its first bytes say which.
    async fn carry_connection<S>(
        self: Arc<Self>,
        mut io: S,
        alpn: Option<Vec<u8>>,
        info: Arc<TlsConnectInfo>,
        streams: Arc<ConnStreams>,
        keepalive: Duration,
    ) where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let mut first = bytes::BytesMut::new();
        let h2 = match alpn.as_deref() {
            Some(tether_core::tls::ALPN_H2) => true,
            Some(_) => false,
            None => match tokio::io::AsyncReadExt::read_buf(&mut io, &mut first).await {
                Ok(n) if n > 0 => tether_core::ws::is_h2_preface(&first),
                _ => return,
            },
        };
        if !h2 && !self.websocket {
            tracing::debug!(peer = %info.remote_addr, "an HTTP/1.1 request on the agent port, which takes only HTTP/2 (--agent-websocket=false); closed");
            return;
        }
        if !h2 {
            // Boxed: an HTTP/2 connection's future does not carry a WebSocket's room.
            return Box::pin(ws::serve(self, io, first, info, streams, keepalive)).await;
        }
        let io = tether_core::ws::Rewound::new(first.freeze(), io);
        let settings = Settings {
            max_streams: MAX_STREAMS,
            connection_window: tether_core::transport::H2_CONN_WINDOW,
            max_header_list: MAX_HEADER_LIST,
            keepalive,
        };
        let hard_stop = self.hard_stop.clone();
        let serve = h2serve::serve_connection(io, settings, hard_stop, |request, respond| {
            // Boxed: `FuturesUnordered` keeps a stub the size of its future type, and
            // an agent connection holds one stream for hours.
            let stream: Pin<Box<dyn Future<Output = ()> + Send>> =
                Box::pin(
                    self.clone()
                        .stream(request, respond, info.clone(), streams.clone()),
                );
            Some(stream)
        });
        serve.await
    }

    /// One Connect call: admit the agent, answer with the headers, then carry its
    /// stream until either side ends it, or its token no longer passes; the status goes
    /// in trailers.
    fn stream(
        self: Arc<Self>,
        request: http::Request<RecvStream>,
        respond: SendResponse<Bytes>,
        info: Arc<TlsConnectInfo>,
        streams: Arc<ConnStreams>,
    ) -> impl Future<Output = ()> + Send {
        // The admission is boxed, and the request moved into it before the future that
        // lives as long as the agent's stream is made: that future then holds only what
        // carries the stream, not the request's headers, a TokenReview's request or the
        // admission's own state, which are on the heap only while they are needed.
        // (Combinators, not an async block: one would keep the opened stream twice.)
        use futures::FutureExt;
        let opening = Box::pin(self.clone().open_stream(request, respond, info, streams));
        opening
            .then(move |open| {
                futures::future::OptionFuture::from(open.map(|o| self.carry_stream(o)))
            })
            .map(drop)
    }

    /// Admits the agent's stream and opens it in the router: what carries it, or
    /// `None` when it was refused (the reply sent).
    async fn open_stream(
        self: Arc<Self>,
        request: http::Request<RecvStream>,
        respond: SendResponse<Bytes>,
        info: Arc<TlsConnectInfo>,
        streams: Arc<ConnStreams>,
    ) -> Option<OpenStream> {
        let mut reply = Reply::new(respond);
        let (parts, body) = request.into_parts();
        let opened =
            match h2serve::check_call(&parts.method, &parts.uri, &parts.headers, CONNECT_PATH) {
                Ok(()) => Box::pin(self.admit_and_open(parts.headers, &info, &streams, "h2")).await,
                Err(status) => Err(status),
            };
        let opened = match opened {
            Ok(o) => o,
            Err(status) => {
                streams.refused(reply, status);
                return None;
            }
        };
        reply.headers_mut().extend(self.answer(opened.peer_window));
        Some(OpenStream {
            agent: opened.agent,
            packets: opened.packets,
            body,
            reply,
            token: opened.token,
            span: opened.span,
            _live: opened.live,
        })
    }

    /// Admits an agent stream whose metadata is `headers` (an HTTP/2 Connect call's,
    /// or a WebSocket upgrade's) and opens it in the router, carried by `transport`.
    async fn admit_and_open(
        &self,
        headers: http::HeaderMap,
        info: &TlsConnectInfo,
        streams: &Arc<ConnStreams>,
        transport: &'static str,
    ) -> Result<Opened, Status> {
        streams.stage(tether_core::admission::Stage::Serving);
        // Boxed, as are the router's calls below: a TokenReview's request is large.
        let mut admission = Box::pin(self.admit(&MetadataMap::from_headers(headers), info)).await?;
        self.count_connection(&admission, streams)?;
        let peer_window = admission.peer_window;
        let token = admission.token.take();
        let span = tracing::info_span!("agent_stream", agent_id = %shown(&admission.agent_id), peer = %admission.peer, transport);
        let (agent, packets) = self.open(admission, transport)?;
        Ok(Opened {
            agent,
            packets,
            token,
            span,
            peer_window,
            live: streams.open(),
        })
    }

    /// Carries an opened stream until either side ends it, or its token no longer
    /// passes.
    fn carry_stream(self: Arc<Self>, open: OpenStream) -> impl Future<Output = ()> + Send {
        let OpenStream {
            agent,
            packets,
            body,
            mut reply,
            token,
            span,
            _live,
        } = open;
        let gauge = self
            .router
            .metrics
            .grpc_connections
            .with_label_values(&["Connect"]);
        gauge.inc();
        let streams = self.router.metrics.agent_streams.with_label_values(&["h2"]);
        streams.inc();
        async move {
            let _live = _live;
            if reply.send_headers().is_ok() {
                self.carry_until_revoked(agent, body, &mut reply, packets, token)
                    .await;
            } else {
                self.router.remove_agent(&agent);
            }
            gauge.dec();
            streams.dec();
            tracing::info!("agent disconnected");
        }
        .instrument(span)
    }

    /// The answer's headers: `serverid`, `servercount`, and the flow-control answer
    /// when the agent offered a window.
    fn answer(&self, peer_window: Option<u32>) -> http::HeaderMap {
        let mut meta = MetadataMap::new();
        if let Ok(v) = MetadataValue::try_from(self.server_id.as_str()) {
            meta.insert(header::SERVER_ID, v);
        }
        if peer_window.is_some() {
            link::offer_window(&mut meta);
        }
        let count = self.server_count.load(std::sync::atomic::Ordering::Relaxed);
        meta.insert(header::SERVER_COUNT, MetadataValue::from(count));
        meta.into_headers()
    }

    /// [`AgentLink::carry`], ended early (status UNAUTHENTICATED, a log line, a metric)
    /// when the agent's token no longer passes a review.
    async fn carry_until_revoked(
        &self,
        agent: Arc<AgentStream>,
        body: RecvStream,
        reply: &mut Reply,
        packets: PacketStream,
        token: Option<Box<(String, crate::auth::Bound)>>,
    ) {
        let revoked = self.revocation(token);
        let ended = tokio::select! {
            status = self.carry(agent.clone(), body, reply, packets) => Ok(status),
            why = revoked => Err(why),
        };
        match ended {
            Ok(Some(status)) => reply.finish(status),
            Ok(None) => {}
            Err(why) => {
                self.router.remove_agent(&agent);
                reply.finish(self.revoked(&why));
            }
        }
    }

    /// A stream ended because its token no longer passes a review (`why`): counted,
    /// logged, and the status to end it with, on every transport.
    fn revoked(&self, why: &crate::auth::AuthError) -> Status {
        self.router.metrics.agent_streams_revoked.inc();
        tracing::warn!(error = %chain(why), "the agent's token no longer passes a review; stream ended");
        Status::unauthenticated("token no longer accepted")
    }

    /// Resolves when the stream's token (if it came with one) no longer passes a review.
    fn revocation(
        &self,
        token: Option<Box<(String, crate::auth::Bound)>>,
    ) -> Pin<Box<dyn Future<Output = crate::auth::AuthError> + Send>> {
        match (token, &self.authenticator) {
            (Some(t), Some(auth)) => Box::pin(revoked(auth.clone(), t)),
            _ => Box::pin(futures::future::pending()),
        }
    }

    /// Counts the stream's connection against its verified identity; refuses the
    /// stream when that identity already holds the most connections allowed.
    fn count_connection(&self, a: &Admitted, streams: &ConnStreams) -> Result<(), Status> {
        let Some(node) = &a.verified.principal else {
            return Ok(());
        };
        let key = format!("node/{node}");
        self.identities.take(&key, streams).map_err(|held| {
            self.router
                .metrics
                .agent_streams_refused
                .with_label_values(&["too_many_connections"])
                .inc();
            refused!(self, agent_id = %shown(&a.agent_id), peer = %a.peer, identity = %key, held, "agent stream refused: its verified identity holds the most connections --max-agent-streams allows");
            Status::resource_exhausted(format!(
                "{held} connections already open for verified identity {key:?} (the most --max-agent-streams allows)"
            ))
        })
    }

    /// Carries an admitted stream both ways until both are done; the status to end it
    /// with. An agent that broke the protocol gets its error at once; otherwise what
    /// is queued for the agent goes out first (a half-closed, drained agent waits for
    /// it) and the stream ends OK.
    async fn carry(
        &self,
        agent: Arc<AgentStream>,
        body: RecvStream,
        reply: &mut Reply,
        packets: PacketStream,
    ) -> Option<Status> {
        // Removing the agent retires it, which ends the packets for it; the stream's
        // reference to it goes with the inbound half.
        let router = &self.router;
        let hard_stop = self.hard_stop.clone();
        let inbound = std::pin::pin!(async move {
            let failed = serve_agent(router, &agent, body, hard_stop).await;
            router.remove_agent(&agent);
            failed
        });
        let outbound = std::pin::pin!(write_agent(router, reply, packets));
        let ok = || Status::new(Code::Ok, "");
        match futures::future::select(inbound, outbound).await {
            Either::Left((Some(failed), _)) => Some(failed),
            Either::Left((None, outbound)) => outbound.await.then(ok),
            // Nothing more for the agent (retired, or the server stopping).
            Either::Right((sent_all, inbound)) => {
                let failed = inbound.await;
                sent_all.then(|| failed.unwrap_or_else(ok))
            }
        }
    }

    /// Reads and checks the agent's metadata: its id, its token (with an
    /// authenticator), its identifiers against its certificate (when required).
    async fn admit(
        &self,
        md: &MetadataMap,
        conn_info: &TlsConnectInfo,
    ) -> Result<Admitted, Status> {
        let peer = conn_info.remote_addr.to_string();
        let agent_id = match link::single(md, header::AGENT_ID) {
            Ok("") => return Err(Status::invalid_argument("empty agentid")),
            Ok(id) => id.to_string(),
            Err(e) => {
                refused!(self, %peer, error = %chain(&e), "agent stream refused");
                return Err(Status::invalid_argument(e.to_string()));
            }
        };
        let (bound, token) = self.authenticate(md, &agent_id, &peer).await?;
        let bound_node = bound.node;
        let identifiers = md
            .get(header::AGENT_IDENTIFIERS)
            .and_then(|v| v.to_str().ok())
            .map(|q| AgentIdentifiers::parse(q, false).unwrap_or_default())
            .unwrap_or_default();
        let (verified, unverified) = if self.authenticator.is_some() {
            let nodes = self.router.registry().nodes();
            identity::from_token(bound_node.as_deref(), &agent_id, &identifiers, nodes)
        } else if let Some(cert) = conn_info.peer_certs.as_ref().and_then(|c| c.first()) {
            let info = tether_certs::inspect::parse_der(cert).map_err(|e| {
                refused!(self, agent_id = %shown(&agent_id), %peer, error = %e, "unreadable agent certificate; stream refused");
                Status::unauthenticated(format!("client certificate: {e}"))
            })?;
            let nodes = self.router.registry().nodes();
            if let Some((node, vouched)) = identity::pinned_by_certificate(&info) {
                nodes.certify(&node, vouched);
            }
            identity::from_certificate(&info, &agent_id, &identifiers, nodes)
        } else {
            identity::unauthenticated(&identifiers)
        };
        if !unverified.is_empty() {
            self.report_unverified(&agent_id, &peer, &verified, &unverified)?;
        }
        // Credit flow control when the agent offers it (Tether) and we allow it.
        let peer_window = self
            .router
            .flow_control()
            .then(|| link::peer_window(md))
            .flatten();
        Ok(Admitted {
            agent_id,
            identifiers,
            verified,
            peer_window,
            drain_notice: md.contains_key(tether_proto::header::DRAIN_NOTICE),
            peer,
            token,
        })
    }

    /// With token authentication, checks the agent's token: what it is bound to, and the
    /// token with that, to review again while the stream lives.
    async fn authenticate(
        &self,
        md: &MetadataMap,
        agent_id: &str,
        peer: &str,
    ) -> Result<
        (
            crate::auth::Bound,
            Option<Box<(String, crate::auth::Bound)>>,
        ),
        Status,
    > {
        let Some(auth) = &self.authenticator else {
            return Ok(Default::default());
        };
        let header = md.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        let bound = auth.authenticate(header).await.map_err(|e| {
            refused!(self, agent_id = %shown(agent_id), %peer, error = %chain(&e), "agent authentication failed; stream refused");
            Status::unauthenticated(e.public_message())
        })?;
        let bearer = header
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim);
        let token = bearer.map(|t| Box::new((t.to_string(), bound.clone())));
        Ok((bound, token))
    }

    /// Counts and logs the claims the server could not verify; refuses the stream with
    /// `--require-agent-identity-match`.
    fn report_unverified(
        &self,
        agent_id: &str,
        peer: &str,
        verified: &crate::router::Verified,
        unverified: &Unverified,
    ) -> Result<(), Status> {
        let metrics = &self.router.metrics;
        for (kind, n) in unverified.counts() {
            metrics
                .unverified_identifiers
                .with_label_values(&[kind])
                .inc_by(n as u64);
        }
        let by = if verified.by.is_empty() {
            "nothing"
        } else {
            verified.by
        };
        if self.require_identity_match {
            metrics
                .agent_streams_refused
                .with_label_values(&["unverified"])
                .inc();
            refused!(self, agent_id = %shown(agent_id), %peer, unverified = %unverified, verified_by = by, "agent claims identifiers the server could not verify; stream refused (--require-agent-identity-match)");
            return Err(Status::permission_denied(format!(
                "identifiers not verified by the {by}: {unverified}"
            )));
        }
        if self.router.registry().trusts_claims() {
            tracing::debug!(%agent_id, %peer, unverified = %unverified, verified_by = by, "routing by identifiers the server could not verify (--unsafe-trust-agent-identifiers)");
        } else if self.unverified_warnings.try_acquire() {
            tracing::warn!(agent_id = %shown(agent_id), %peer, unverified = %unverified, verified_by = by, "agent claims identifiers the server could not verify; they are not routed by");
        } else {
            tracing::debug!(%agent_id, %peer, unverified = %unverified, verified_by = by, "agent claims identifiers the server could not verify; they are not routed by");
        }
        Ok(())
    }

    /// Registers the agent's stream with the router and returns it with the stream of
    /// packets to the agent. That stream ends when the agent stream is removed (its
    /// senders dropped with the last reference), retired (`closed`) or the server
    /// stops; WINDOW_UPDATEs overtake queued DATA.
    fn open(
        &self,
        a: Admitted,
        transport: &'static str,
    ) -> Result<(Arc<AgentStream>, PacketStream), Status> {
        let (tx, rx) = mpsc::channel(self.channel_size);
        // WINDOW_UPDATEs: a queue that holds no memory while empty (a tokio channel
        // would keep a 32-packet block, 2.5 KiB, for each of thousands of agents).
        let (ctl, ctl_rx) = tether_core::queue::queue();
        let agent = AgentStream::new(
            a.agent_id.clone(),
            a.identifiers,
            a.verified,
            tx,
            ctl,
            a.peer_window,
        );
        let agent = agent.carried_by(transport);
        let agent = Arc::new(match a.drain_notice {
            true => agent.hearing_drain(),
            false => agent,
        });
        let (agent_id, peer) = (&a.agent_id, &a.peer);
        if let Err(e) = self.router.add_agent(agent.clone()) {
            self.router
                .metrics
                .agent_streams_refused
                .with_label_values(&["too_many_streams"])
                .inc();
            refused!(self, agent_id = %shown(agent_id), %peer, error = %chain(&e), "agent stream refused");
            return Err(Status::resource_exhausted(e.to_string()));
        }
        tracing::info!(agent_id = %shown(agent_id), %peer, identifiers = ?agent.identifiers, flow_control = a.peer_window.is_some(), transport, "agent connected");
        let (hard_stop, retired) = (self.hard_stop.clone(), agent.closed.clone());
        let ended = async move {
            tokio::select! {
                _ = hard_stop.cancelled() => {}
                _ = retired.cancelled() => {}
            }
        };
        let out = ctl_rx.merge(ReceiverStream::new(rx));
        Ok((
            agent,
            Box::pin(futures::StreamExt::take_until(out, Box::pin(ended))),
        ))
    }
}

/// Resolves when a live stream's token no longer passes: reviewed again each time its
/// cached review expires (with jitter, so that streams admitted together spread out).
async fn revoked(
    auth: Arc<crate::auth::TokenAuthenticator>,
    token: Box<(String, crate::auth::Bound)>,
) -> crate::auth::AuthError {
    use rand::Rng;
    loop {
        let ttl = crate::auth::POSITIVE_CACHE_TTL;
        let jitter = ttl.mul_f64(rand::rng().random_range(0.0..0.2));
        tokio::time::sleep(ttl + jitter).await;
        if let Err(e) = auth.still_valid(&token.0, &token.1).await {
            return e;
        }
    }
}

/// Why a connection was closed by the server's watch on it.
#[derive(Debug, Clone, Copy)]
enum Closed {
    /// No stream admitted within [`ADMIT_WITHIN`] of its start.
    Unadmitted,
    /// No stream open for [`ADMIT_WITHIN`] since its last one ended.
    Idle,
    /// Evicted while unproven, to make room.
    Evicted,
}

impl Closed {
    /// The `connections_refused_total{reason}` label.
    fn label(self) -> &'static str {
        match self {
            Closed::Unadmitted => "unadmitted",
            Closed::Idle => "idle",
            Closed::Evicted => "evicted",
        }
    }
}

/// A one-stream transport's halves (WebSocket's, QUIC's) until both are done, as the
/// HTTP/2 stream's: an agent that broke the protocol (`inbound` returns its status)
/// gets its error at once; otherwise what is queued for it goes out first.
async fn both_halves(
    inbound: impl Future<Output = Option<Status>>,
    outbound: impl Future<Output = bool>,
) -> Status {
    let ok = || Status::new(Code::Ok, "");
    let (inbound, outbound) = (std::pin::pin!(inbound), std::pin::pin!(outbound));
    match futures::future::select(inbound, outbound).await {
        Either::Left((Some(failed), _)) => failed,
        Either::Left((None, outbound)) => {
            let _ = outbound.await;
            ok()
        }
        Either::Right((_, inbound)) => inbound.await.unwrap_or_else(ok),
    }
}

/// Watches a connection: while `pending` (unproven) it may be evicted, and once a stream
/// is admitted its place among the unproven goes; it is closed when it has had no
/// admitted stream for [`ADMIT_WITHIN`].
fn watch_admission(
    streams: &ConnStreams,
    pending: Option<tether_core::admission::Pending>,
) -> impl Future<Output = Closed> + '_ {
    // Boxed: what watches an unproven connection is on the heap only until it is
    // proven; what stays for the connection's life is the idle watch.
    let proving = pending.map(|pending| {
        Box::pin(async move {
            tokio::select! {
                _ = streams.until(|s| s.ever) => None,
                _ = pending.evicted() => Some(Closed::Evicted),
                _ = streams.idle() => Some(Closed::Unadmitted),
            }
        })
    });
    async move {
        if let Some(proving) = proving {
            if let Some(why) = proving.await {
                return why;
            }
        }
        streams.idle().await;
        if streams.state().ever {
            Closed::Idle
        } else {
            Closed::Unadmitted
        }
    }
}

/// Feeds what the agent sends into the router until its stream ends, fails, is
/// retired, or `hard_stop`; the status to end the stream with when the agent
/// broke it.
async fn serve_agent(
    router: &Arc<Router>,
    agent: &Arc<AgentStream>,
    mut body: RecvStream,
    hard_stop: CancellationToken,
) -> Option<Status> {
    let mut messages = Messages::default();
    let status = loop {
        match messages.next_packet() {
            Ok(Some(packet)) => {
                Box::pin(router.on_agent_packet(agent, packet)).await;
                continue;
            }
            Ok(None) => {}
            Err(e @ MessageError::TooLarge(_)) => break Status::resource_exhausted(e.to_string()),
            Err(e) => break Status::internal(e.to_string()),
        }
        let next = tokio::select! {
            next = body.data() => next,
            _ = hard_stop.cancelled() => return None,
            _ = agent.closed.cancelled() => return None,
        };
        match next {
            Some(Ok(chunk)) => {
                let _ = body.flow_control().release_capacity(chunk.len());
                messages.push(chunk);
            }
            // The agent cancelled its call or went away: an end for the stream, and a
            // `Canceled` stream error, as upstream counts it.
            Some(Err(e)) if e.reason() == Some(h2::Reason::CANCEL) => {
                router
                    .metrics
                    .stream_error(Segment::FromAgent, Code::Cancelled);
                return None;
            }
            Some(Err(e)) => break status_from_h2(&e),
            None if messages.mid_message() => {
                break Status::internal("the stream ended inside a message")
            }
            None => return None,
        }
    };
    router
        .metrics
        .stream_error(Segment::FromAgent, status.code());
    tracing::info!(error = %status.message(), code = ?status.code(), "agent stream failed");
    Some(status)
}

/// Writes the packets for the agent until they end (true) or the stream fails.
async fn write_agent(router: &Router, reply: &mut Reply, mut packets: PacketStream) -> bool {
    while let Some(packet) = packets.next().await {
        if let Err(e) = reply.send(&packet).await {
            tracing::debug!(error = %chain(&e), "cannot write to the agent");
            router.metrics.send_error(
                Segment::ToAgent,
                h2serve::send_error_code(&e),
                packet.r#type,
            );
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_proto::agent_service_client::AgentServiceClient;
    use tonic::Request;

    /// An agent link served in-process over plain HTTP/2 on 127.0.0.1:0 (the TLS
    /// around it is the transport's, tested there), and its router.
    async fn serve() -> (Arc<Router>, AgentServiceClient<tonic::transport::Channel>) {
        let (router, client, _) = serve_stoppable().await;
        (router, client)
    }

    /// [`serve`], with the hard stop and the address.
    async fn serve_stoppable() -> (
        Arc<Router>,
        AgentServiceClient<tonic::transport::Channel>,
        (CancellationToken, std::net::SocketAddr),
    ) {
        let hard_stop = CancellationToken::new();
        let router = Router::new(
            crate::router::RouterConfig {
                strategies: crate::router::parse_strategies("default").unwrap(),
                backend_dial_timeout: None,
                flow_control: true,
                stall_timeout: Duration::from_secs(30),
                trust_claims: false,
                max_agent_streams: 2,
                agent_wait: Duration::ZERO,
            },
            crate::metrics::Metrics::new(),
        );
        let link = AgentLink {
            router: router.clone(),
            server_id: "s1".into(),
            server_count: Arc::new(std::sync::atomic::AtomicU32::new(3)),
            channel_size: 10,
            hard_stop: hard_stop.clone(),
            authenticator: None,
            require_identity_match: false,
            websocket: true,
            unverified_warnings: tether_ops::ratelimit::TokenBucket::new(
                UNVERIFIED_WARNINGS.0,
                UNVERIFIED_WARNINGS.1,
            ),
            identities: IdentityConnections::new(2),
            refusal_log: tether_core::ratelimit::LogLimit::new(
                REFUSAL_WARNINGS.0,
                REFUSAL_WARNINGS.1,
            ),
        };
        let link = Arc::new(link);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((tcp, remote_addr)) = listener.accept().await {
                let info = TlsConnectInfo {
                    remote_addr,
                    peer_certs: None,
                };
                tokio::spawn(
                    link.clone()
                        .serve_connection(tcp, info, None, Duration::ZERO, None),
                );
            }
        });
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        (router, AgentServiceClient::new(channel), (hard_stop, addr))
    }

    fn request(
        metadata: &[(&'static str, &str)],
    ) -> (mpsc::Sender<Packet>, Request<ReceiverStream<Packet>>) {
        let (tx, rx) = mpsc::channel(4);
        let mut request = Request::new(ReceiverStream::new(rx));
        for (k, v) in metadata {
            request.metadata_mut().append(*k, v.parse().unwrap());
        }
        (tx, request)
    }

    async fn wait_agents(router: &Router, n: usize) {
        let waited = tokio::time::timeout(Duration::from_secs(5), async {
            while router.registry().len() != n {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await;
        assert!(
            waited.is_ok(),
            "{} agents, not {n}",
            router.registry().len()
        );
    }

    #[tokio::test]
    async fn an_agent_is_registered_answered_and_removed_when_its_stream_ends() {
        let (router, mut client) = serve().await;
        let (tx, req) = request(&[
            (header::AGENT_ID, "node-1"),
            // A malformed value is skipped (and logged); the rest is kept.
            (
                header::AGENT_IDENTIFIERS,
                "host=node-1&cidr=10.0.0.0/99&ipv4=10.0.0.1",
            ),
        ]);
        let response = client.connect(req).await.unwrap();
        let md = response.metadata();
        assert_eq!(link::single(md, header::SERVER_ID).unwrap(), "s1");
        assert_eq!(link::single(md, header::SERVER_COUNT).unwrap(), "3");
        assert!(
            link::peer_window(md).is_none(),
            "no window answered to an agent that offered none"
        );
        wait_agents(&router, 1).await;
        let json: serde_json::Value =
            serde_json::from_str(&router.registry().agents_json()).unwrap();
        assert_eq!(json["agents"][0]["id"], "node-1");
        assert_eq!(json["agents"][0]["hosts"][0], "node-1");
        assert_eq!(json["agents"][0]["ips"][0], "10.0.0.1");
        // The agent ends its half of the stream (as a drained agent does): the server
        // forgets it and ends its own half with status OK.
        let mut packets = response.into_inner();
        drop(tx);
        wait_agents(&router, 0).await;
        let end = tokio::time::timeout(Duration::from_secs(5), packets.message()).await;
        assert!(matches!(end, Ok(Ok(None))), "{end:?}");
    }

    #[tokio::test]
    async fn a_flow_window_offer_is_answered() {
        let (router, mut client) = serve().await;
        let (_tx, mut req) = request(&[(header::AGENT_ID, "node-1")]);
        link::offer_window(req.metadata_mut());
        let response = client.connect(req).await.unwrap();
        let window = link::peer_window(response.metadata());
        assert!(
            window.is_some_and(|w| link::WINDOW_RANGE.contains(&w)),
            "{window:?}"
        );
        wait_agents(&router, 1).await;
    }

    #[tokio::test]
    async fn bad_metadata_is_refused_with_a_status_saying_why() {
        let (router, mut client) = serve().await;
        for (metadata, says) in [
            (&[][..], "agentid"),
            (&[(header::AGENT_ID, "")][..], "empty agentid"),
            (
                &[(header::AGENT_ID, "a"), (header::AGENT_ID, "b")][..],
                "agentid",
            ),
        ] {
            let (_tx, req) = request(metadata);
            let status = client.connect(req).await.unwrap_err();
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{metadata:?}");
            assert!(
                status.message().contains(says),
                "{metadata:?}: {}",
                status.message()
            );
        }
        assert_eq!(router.registry().len(), 0);
    }

    #[tokio::test]
    async fn at_the_hard_stop_the_stream_ends_with_status_ok_and_the_agent_is_gone() {
        let (router, mut client, (hard_stop, _)) = serve_stoppable().await;
        let (_tx, req) = request(&[(header::AGENT_ID, "node-1")]);
        let mut packets = client.connect(req).await.unwrap().into_inner();
        wait_agents(&router, 1).await;
        hard_stop.cancel();
        let end = tokio::time::timeout(Duration::from_secs(5), packets.message()).await;
        assert!(matches!(end, Ok(Ok(None))), "{end:?}");
        wait_agents(&router, 0).await;
    }

    /// A gRPC call to `path` on a bare HTTP/2 connection (bytes no tonic client sends),
    /// with `agent_id` as metadata if any; the request body stays open unless `end`.
    async fn raw_call(
        addr: std::net::SocketAddr,
        path: &str,
        agent_id: Option<&str>,
        end: bool,
    ) -> (http::Response<RecvStream>, h2::SendStream<Bytes>) {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut send, conn) = h2::client::handshake(tcp).await.unwrap();
        tokio::spawn(conn);
        let mut request = http::Request::post(format!("http://{addr}{path}"))
            .header(http::header::CONTENT_TYPE, "application/grpc");
        if let Some(id) = agent_id {
            request = request.header(header::AGENT_ID, id);
        }
        let (response, stream) = send.send_request(request.body(()).unwrap(), end).unwrap();
        (response.await.unwrap(), stream)
    }

    #[tokio::test]
    async fn another_method_is_unimplemented() {
        let (_router, _client, (_, addr)) = serve_stoppable().await;
        let (response, _) = raw_call(addr, "/AgentService/Other", None, true).await;
        let status = Status::from_header_map(response.headers()).expect("trailers-only status");
        assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    }

    #[tokio::test]
    async fn an_agent_that_sends_a_malformed_message_gets_an_error_at_once() {
        let (router, _client, (_, addr)) = serve_stoppable().await;
        let (response, mut stream) = raw_call(addr, CONNECT_PATH, Some("node-1"), false).await;
        assert_eq!(response.headers()[header::SERVER_ID], "s1");
        wait_agents(&router, 1).await;
        // A gRPC message whose bytes are no packet; the agent keeps its side open.
        stream
            .send_data(
                Bytes::from_static(&[0, 0, 0, 0, 3, 0xff, 0xff, 0xff]),
                false,
            )
            .unwrap();
        let mut body = response.into_body();
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            while body.data().await.is_some() {}
            body.trailers().await
        })
        .await
        .expect("the server ended the stream");
        let trailers = ended.unwrap().expect("trailers");
        let status = Status::from_header_map(&trailers).expect("a status");
        assert_eq!(status.code(), Code::Internal, "{status:?}");
        wait_agents(&router, 0).await;
    }
}

//! The dialer: opens target TCP connections on the server's DIAL_REQ (with a timeout,
//! cancellable by DIAL_CLS), assigns connectIDs, and pumps bytes between each target
//! socket and the agent stream until either side closes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tether_core::flow::{Admit, Credit, Window};
use tether_core::pump::{splice, Flow, SpliceEnd};
use tether_core::queue;
use tether_proto::{packet::Payload, DialRequest, Packet};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::metrics::Metrics;

/// Direction indexes for packet counters.
pub(crate) const FROM_SERVER: usize = 0;
pub(crate) const TO_SERVER: usize = 1;

struct Conn {
    /// DATA and CLOSE_REQ for the connection's pump, in arrival order (bounded by
    /// `flow.window`, not by the channel).
    tx: queue::Sender<Packet>,
    flow: Arc<ConnFlow>,
    /// Stops the connection's pump.
    cancel: CancellationToken,
}

/// Flow control of one connection.
struct ConnFlow {
    /// Credit for DATA to the server (None: upstream server, no credit).
    credit: Option<Credit>,
    /// DATA from the server queued towards the target.
    window: Window,
}

/// The connections of one agent stream.
pub(crate) struct Session {
    out: mpsc::Sender<Packet>,
    conns: Mutex<HashMap<i64, Conn>>,
    pending: Mutex<HashMap<i64, CancellationToken>>,
    next_id: AtomicI64,
    draining: AtomicBool,
    dial_timeout: Duration,
    /// The server's per-connection receive window, when it does credit flow control.
    peer_window: Option<u32>,
    /// How long a connection's full queue may hold up the stream (upstream server).
    stall_timeout: Duration,
    metrics: Metrics,
    /// Cancelled when the stream ends: every pump stops.
    pub(crate) closed: CancellationToken,
    /// Open target connections across all sessions (for drain).
    open: Arc<AtomicI64>,
}

impl Session {
    pub(crate) fn new(
        out: mpsc::Sender<Packet>,
        dial_timeout: Duration,
        peer_window: Option<u32>,
        stall_timeout: Duration,
        metrics: Metrics,
        open: Arc<AtomicI64>,
    ) -> Arc<Self> {
        Arc::new(Session {
            out,
            conns: Mutex::new(HashMap::new()),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicI64::new(1),
            draining: AtomicBool::new(false),
            dial_timeout,
            peer_window,
            stall_timeout,
            metrics,
            closed: CancellationToken::new(),
            open,
        })
    }

    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<i64, Conn>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<i64, CancellationToken>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) async fn send(&self, packet: Packet) -> bool {
        self.metrics.packets.inc(TO_SERVER, packet.r#type);
        self.out.send(packet).await.is_ok()
    }

    /// Stops taking dials and tells the server so.
    pub(crate) async fn drain(&self) {
        if !self.draining.swap(true, Ordering::Relaxed) {
            self.send(Packet::drain()).await;
        }
    }

    /// Handles one packet from the server.
    pub(crate) async fn handle(self: &Arc<Self>, packet: Packet) {
        self.metrics.packets.inc(FROM_SERVER, packet.r#type);
        match packet.payload {
            Some(Payload::DialRequest(req)) => self.dial(req).await,
            Some(Payload::Data(ref d)) => {
                let connect_id = d.connect_id;
                let conn = self
                    .conns()
                    .get(&connect_id)
                    .map(|c| (c.tx.clone(), c.flow.clone()));
                match conn {
                    Some((tx, flow)) => {
                        match flow.window.admit(d.data.len(), self.stall_timeout).await {
                            // A failed send means the pump already ended and sent CLOSE_RSP.
                            Admit::Ok => drop(tx.send(packet)),
                            Admit::Closed => {}
                            Admit::Overrun => {
                                tracing::warn!(connect_id, "server sent more than the flow-control window; closing the connection");
                                self.abort(connect_id, "flow-control window exceeded").await;
                            }
                            Admit::Stalled => {
                                tracing::warn!(connect_id, queued = flow.window.queued(), timeout = ?self.stall_timeout, "target stopped reading; closing the connection (--stalled-reader-timeout)");
                                self.abort(
                                    connect_id,
                                    &format!(
                                        "agent: target did not read for {:?}; connection closed",
                                        self.stall_timeout
                                    ),
                                )
                                .await;
                            }
                        }
                    }
                    None => {
                        tracing::debug!(connect_id, "DATA for unknown connectID");
                        self.send(Packet::close_response(
                            connect_id,
                            format!("unknown connectID {connect_id}"),
                        ))
                        .await;
                    }
                }
            }
            Some(Payload::CloseRequest(c)) => {
                let tx = self.conns().get(&c.connect_id).map(|c| c.tx.clone());
                match tx {
                    Some(tx) => drop(tx.send(packet)),
                    None => {
                        self.send(Packet::close_response(
                            c.connect_id,
                            format!("unknown connectID {}", c.connect_id),
                        ))
                        .await;
                    }
                }
            }
            Some(Payload::WindowUpdate(w)) => {
                let flow = self.conns().get(&w.connect_id).map(|c| c.flow.clone());
                if let Some(credit) = flow.as_ref().and_then(|f| f.credit.as_ref()) {
                    credit.grant(w.bytes);
                }
            }
            Some(Payload::CloseDial(c)) => {
                if let Some(cancel) = self.pending().remove(&c.random) {
                    tracing::info!(random = c.random, "dial cancelled by server");
                    cancel.cancel();
                }
            }
            _ => tracing::debug!(ty = packet.r#type, "unexpected packet from server; ignored"),
        }
    }

    async fn dial(self: &Arc<Self>, req: DialRequest) {
        let random = req.random;
        if req.protocol != "tcp" && !req.protocol.is_empty() {
            self.send(Packet::dial_response(
                random,
                0,
                format!("protocol {:?} is not supported (only tcp)", req.protocol),
            ))
            .await;
            return;
        }
        let connect_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let cancel = self.closed.child_token();
        self.pending().insert(random, cancel.clone());
        let this = self.clone();
        // A debug-level span: info-level spans cost ~0.4 KiB per open connection in the
        // subscriber; events that matter at info carry the address themselves.
        let span = tracing::debug_span!("conn", address = %req.address, connect_id);
        tokio::spawn(
            this.run_conn(req.address, random, connect_id, cancel)
                .instrument(span),
        );
    }

    async fn run_conn(
        self: Arc<Self>,
        address: String,
        random: i64,
        connect_id: i64,
        cancel: CancellationToken,
    ) {
        let started = Instant::now();
        let dialed = tokio::select! {
            r = tokio::time::timeout(self.dial_timeout, TcpStream::connect(&address)) => r,
            _ = cancel.cancelled() => {
                self.pending().remove(&random);
                return;
            }
        };
        if self.pending().remove(&random).is_none() {
            // DIAL_CLS won the race: nobody wants this connection.
            return;
        }
        let stream = match dialed {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let reason = if e.kind() == std::io::ErrorKind::ConnectionRefused {
                    "refused"
                } else {
                    "unknown"
                };
                self.metrics
                    .dial_failures
                    .with_label_values(&[reason])
                    .inc();
                tracing::info!(%address, connect_id, error = %e, "dial failed");
                self.send(Packet::dial_response(
                    random,
                    0,
                    format!("dial tcp {address}: {e}"),
                ))
                .await;
                return;
            }
            Err(_) => {
                self.metrics
                    .dial_failures
                    .with_label_values(&["timeout"])
                    .inc();
                tracing::info!(%address, connect_id, timeout = ?self.dial_timeout, "dial timed out");
                self.send(Packet::dial_response(
                    random,
                    0,
                    format!("dial tcp {address}: i/o timeout"),
                ))
                .await;
                return;
            }
        };
        let _ = stream.set_nodelay(true);
        self.metrics
            .dial_duration
            .observe(started.elapsed().as_secs_f64());
        let (tx, rx) = queue::queue();
        let flow = Arc::new(ConnFlow {
            credit: self.peer_window.map(Credit::new),
            window: Window::for_peer(self.peer_window.is_some()),
        });
        self.conns().insert(
            connect_id,
            Conn {
                tx,
                flow: flow.clone(),
                cancel: cancel.clone(),
            },
        );
        self.metrics.open_endpoint_connections.inc();
        self.open.fetch_add(1, Ordering::Relaxed);
        if !self
            .send(Packet::dial_response(random, connect_id, ""))
            .await
        {
            self.finish(connect_id);
            return;
        }
        tracing::debug!("connected");
        let (rd, wr) = stream.into_split();
        let end = splice(
            rd,
            wr,
            rx,
            &self.out,
            connect_id,
            &cancel,
            Flow {
                send: flow.credit.as_ref(),
                recv: Some(&flow.window),
            },
        )
        .await;
        let error = match &end {
            SpliceEnd::LocalError(e) => e.to_string(),
            _ => String::new(),
        };
        tracing::debug!(?end, "connection ended");
        if self.finish(connect_id) && !matches!(end, SpliceEnd::Cancelled | SpliceEnd::SinkGone) {
            self.send(Packet::close_response(connect_id, error)).await;
        }
    }

    /// Closes `connect_id` from our side: its pump stops and the server gets CLOSE_RSP
    /// with `error`.
    async fn abort(&self, connect_id: i64, error: &str) {
        let conn = self.conns().get(&connect_id).map(|c| c.cancel.clone());
        if let Some(cancel) = conn {
            cancel.cancel();
            if self.finish(connect_id) {
                self.send(Packet::close_response(connect_id, error)).await;
            }
        }
    }

    /// Forgets `connect_id`; true when it was still registered.
    fn finish(&self, connect_id: i64) -> bool {
        let conn = self.conns().remove(&connect_id);
        let removed = conn.is_some();
        if let Some(conn) = conn {
            conn.flow.window.close();
            if let Some(credit) = &conn.flow.credit {
                credit.close();
            }
            self.metrics.open_endpoint_connections.dec();
            self.open.fetch_sub(1, Ordering::Relaxed);
        }
        removed
    }
}

//! The agent's audit record: one JSON line per dial outcome (connected, failed,
//! cancelled) and one when a connection ends, saying what was asked, what was dialled,
//! for which server stream and dial, and how much went through. Built only when
//! `--audit-log-path` is set; written by `tether_ops::audit`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tether_core::pump::SpliceEnd;
use tether_ops::audit::{millis, AuditLog, Time};

/// The agent's audit log.
pub type Audit = AuditLog<Record>;

/// What a session's records share: the log and the server stream they belong to.
#[derive(Clone, Default)]
pub struct Audited {
    /// The log (off unless `--audit-log-path`).
    pub log: Audit,
    /// The `serverid` of the stream the dials came on.
    pub server_id: Arc<str>,
}

/// `dial` (the outcome of a DIAL_REQ) or `closed` (a connection ended).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// A dial's outcome.
    Dial,
    /// A connection ended.
    Closed,
}

/// How a dial turned out or a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The target accepted the connection.
    Connected,
    /// The dial failed (see `error`).
    Failed,
    /// The dial policy refused it (`error` says why); nothing was dialled.
    Refused,
    /// The server cancelled the dial (DIAL_CLS) before it completed.
    Cancelled,
    /// The target closed its end.
    TargetClosed,
    /// Reading or writing the target failed.
    TargetError,
    /// The server closed the connection (CLOSE_REQ).
    ServerClosed,
    /// The server stream under it went away.
    StreamGone,
    /// The agent cut it (its stop, a flow-control violation, a stalled target).
    Stopped,
    /// The agent closed it at a quiet moment near the end of its drain, so that the
    /// client's next request goes to another agent (see `dialer::QUIET`).
    Drained,
}

impl Outcome {
    /// How a spliced connection's end reads in the record.
    pub fn of(end: &SpliceEnd) -> Self {
        match end {
            SpliceEnd::LocalEof => Outcome::TargetClosed,
            SpliceEnd::LocalError(_) => Outcome::TargetError,
            SpliceEnd::RemoteClosed(_) => Outcome::ServerClosed,
            SpliceEnd::RemoteGone | SpliceEnd::SinkGone => Outcome::StreamGone,
            SpliceEnd::Cancelled => Outcome::Stopped,
        }
    }
}

/// One audit line.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// When (RFC 3339, UTC).
    pub time: Time,
    /// `dial` or `closed`.
    pub event: Event,
    /// How it went.
    pub outcome: Outcome,
    /// The error, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The `serverid` of the stream the dial came on.
    pub server_id: Arc<str>,
    /// The address the server asked for (at most 256 bytes of it).
    pub address: String,
    /// The address the connection went to (resolved), once connected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dialed: Option<SocketAddr>,
    /// The DIAL_REQ's random.
    pub random: i64,
    /// The connectID the agent gave the connection.
    pub connect_id: i64,
    /// How long the dial took, in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dial_ms: Option<f64>,
    /// DATA payload bytes from the server written towards the target.
    pub bytes_to_target: u64,
    /// DATA payload bytes read from the target towards the server.
    pub bytes_from_target: u64,
    /// From connected to closed, in milliseconds (`closed` records).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<f64>,
}

/// The dial a record is about.
pub struct Dial<'a> {
    /// The address asked for.
    pub address: &'a str,
    /// The DIAL_REQ's random.
    pub random: i64,
    /// The connectID given to it.
    pub connect_id: i64,
    /// When the dial started (`dial` records) or the connection was made (`closed`).
    pub started: Instant,
}

impl Audited {
    /// Where `stream` went, when the audit records it (no getpeername otherwise).
    pub fn peer_of(&self, stream: &tokio::net::TcpStream) -> Option<SocketAddr> {
        self.log
            .enabled()
            .then(|| stream.peer_addr().ok())
            .flatten()
    }

    fn line(&self, d: &Dial<'_>, event: Event, outcome: Outcome, error: Option<String>) -> Record {
        Record {
            time: Time::now(),
            event,
            outcome,
            error,
            server_id: self.server_id.clone(),
            address: tether_core::ratelimit::clipped(d.address, 256).to_string(),
            dialed: None,
            random: d.random,
            connect_id: d.connect_id,
            dial_ms: None,
            bytes_to_target: 0,
            bytes_from_target: 0,
            duration_ms: None,
        }
    }

    /// Records a dial's outcome: `dialed` once connected, `error` when it failed.
    pub fn dial(
        &self,
        d: &Dial<'_>,
        outcome: Outcome,
        dialed: Option<SocketAddr>,
        error: Option<&str>,
    ) {
        if !self.log.enabled() {
            return;
        }
        let mut r = self.line(d, Event::Dial, outcome, error.map(str::to_string));
        r.dialed = dialed;
        r.dial_ms = Some(millis(d.started.elapsed()));
        self.log.record(r);
    }

    /// Records the end of connection `d`, connected to `dialed`: how (`None`: the
    /// agent closed it at a quiet moment at the end of its drain), and the bytes it
    /// carried to and from the target.
    pub fn closed(
        &self,
        d: &Dial<'_>,
        dialed: Option<SocketAddr>,
        end: Option<&SpliceEnd>,
        (to_target, from_target): (u64, u64),
    ) {
        if !self.log.enabled() {
            return;
        }
        let error = match end {
            Some(SpliceEnd::LocalError(e)) => Some(e.to_string()),
            Some(SpliceEnd::RemoteClosed(Some(e))) if !e.is_empty() => Some(e.clone()),
            _ => None,
        };
        let outcome = end.map_or(Outcome::Drained, Outcome::of);
        let mut r = self.line(d, Event::Closed, outcome, error);
        r.dialed = dialed;
        r.bytes_to_target = to_target;
        r.bytes_from_target = from_target;
        r.duration_ms = Some(millis(d.started.elapsed()));
        self.log.record(r);
    }
}

/// What one connection carried so far: the bytes each way, for its audit record, and
/// who sent last, for its quiet close at the end of a drain. One relaxed add and one
/// relaxed store per DATA packet; no allocation.
#[derive(Debug, Default)]
pub struct Traffic {
    to_target: AtomicU64,
    from_target: AtomicU64,
    /// The target sent the last DATA: whatever the client asked has its answer.
    target_last: AtomicBool,
    /// DATA from the target waiting for room on the way to the server.
    sending: AtomicU32,
}

impl Traffic {
    /// Counts `packet` (from the server) when it is DATA for the target.
    pub fn count_to_target(&self, packet: &tether_proto::Packet) {
        if let Some(tether_proto::packet::Payload::Data(d)) = &packet.payload {
            self.to_target
                .fetch_add(d.data.len() as u64, Ordering::Relaxed);
            self.target_last.store(false, Ordering::Relaxed);
        }
    }

    /// Counts `packet` (to the server) when it is DATA from the target.
    fn count_from_target(&self, packet: &tether_proto::Packet) {
        if let Some(tether_proto::packet::Payload::Data(d)) = &packet.payload {
            self.from_target
                .fetch_add(d.data.len() as u64, Ordering::Relaxed);
            self.target_last.store(true, Ordering::Relaxed);
        }
    }

    /// Bytes so far: (to the target, from the target).
    pub fn bytes(&self) -> (u64, u64) {
        (
            self.to_target.load(Ordering::Relaxed),
            self.from_target.load(Ordering::Relaxed),
        )
    }

    /// Whether the target sent the last DATA, and all of it has left for the server.
    pub fn target_spoke_last(&self) -> bool {
        self.target_last.load(Ordering::Relaxed) && self.sending.load(Ordering::Relaxed) == 0
    }
}

/// A connection's pump sends through this: its DATA is counted in `traffic` on the way.
pub struct Counting<'a, S> {
    /// Where packets go.
    pub inner: &'a S,
    /// What the connection carried.
    pub traffic: &'a Traffic,
}

impl<S: tether_core::pump::Sink> tether_core::pump::Sink for Counting<'_, S> {
    fn send(&self, packet: tether_proto::Packet) -> impl std::future::Future<Output = bool> + Send {
        self.traffic.count_from_target(&packet);
        let sending = &self.traffic.sending;
        sending.fetch_add(1, Ordering::Relaxed);
        futures::FutureExt::map(self.inner.send(packet), move |sent| {
            sending.fetch_sub(1, Ordering::Relaxed);
            sent
        })
    }
}

//! The server's audit record: one JSON line when a tunnel ends and one at each refusal,
//! saying who asked (the frontend's peer), for what, which agent carried it, how much
//! went through and why it ended. Built only when `--audit-log-path` is set; written
//! by `tether_ops::audit`.

use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use tether_ops::audit::{millis, AuditLog, Time};

pub use super::state::FrontendPeer;
use super::state::{AgentStream, Conn};

/// The server's audit log.
pub type Audit = AuditLog<Record>;

/// Why a tunnel ended, or why a dial or frontend was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The frontend's client closed the tunnel (CLOSE_REQ, its stream or connection
    /// ended) or gave up on the dial.
    Client,
    /// The agent ended it: the target closed, or the agent's stream went away.
    Agent,
    /// The target connection failed at the agent (CLOSE_RSP with an error).
    BackendError,
    /// A deadline passed: the dial timeout, or a client that stopped reading.
    Timeout,
    /// The server stopped (its hard stop cut the tunnel).
    Drain,
    /// The agent's dial policy refused the address.
    Policy,
    /// No agent may take the dial.
    NoAgent,
    /// The address is not one the server routes.
    BadAddress,
    /// The agent's dial failed (connection refused, unreachable, ...).
    DialError,
    /// The frontend client's certificate is not one `--frontend-client-names` admits.
    FrontendNotAllowed,
}

/// The prefix of the agent's dial-policy refusal (DIAL_RSP error).
pub use tether_core::host::POLICY_REFUSAL as POLICY_PREFIX;

impl Reason {
    /// The reason for an agent's DIAL_RSP error.
    pub fn of_dial_error(error: &str) -> Reason {
        if error.starts_with(POLICY_PREFIX) {
            Reason::Policy
        } else {
            Reason::DialError
        }
    }
}

/// `tunnel` (an established connection ended) or `refused` (no connection was made).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Event {
    /// A tunnel ended.
    Tunnel,
    /// A dial or a frontend connection was refused, or the dial failed.
    Refused,
}

/// The agent that took a dial.
#[derive(Debug, Clone, Serialize)]
pub struct AgentRecord {
    /// Its `agentid`.
    pub id: String,
    /// How it was verified: `certificate`, `serviceaccount-token`, or empty.
    #[serde(skip_serializing_if = "str::is_empty")]
    pub verified_by: &'static str,
    /// The node it proved to be (a pod-bound token).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Who it proved to be (a token's node, a per-node certificate's name).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
}

impl AgentRecord {
    /// What the record says of `agent`.
    pub fn of(agent: &AgentStream) -> Self {
        AgentRecord {
            id: agent.agent_id.clone(),
            verified_by: agent.verified.by,
            node: agent.verified.node.clone(),
            identity: agent.verified.principal.clone(),
        }
    }
}

/// One audit line.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    /// When the tunnel ended or the refusal happened (RFC 3339, UTC).
    pub time: Time,
    /// `tunnel` or `refused`.
    pub event: Event,
    /// Why.
    pub reason: Reason,
    /// The error text the client or agent saw, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Who asked.
    pub frontend: Arc<FrontendPeer>,
    /// The requested `host:port`.
    pub address: String,
    /// The proxy strategy that chose the agent (`node` for a host one node owns).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strategy: Option<&'static str>,
    /// The agent chosen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentRecord>,
    /// The dial's random (the agent's record has it too).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub random: Option<i64>,
    /// The connection's connectID, once the agent answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub connect_id: Option<i64>,
    /// From the DIAL_REQ to the agent's answer, in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dial_ms: Option<f64>,
    /// DATA payload bytes from the client towards the target.
    pub bytes_to_agent: u64,
    /// DATA payload bytes from the target towards the client.
    pub bytes_from_agent: u64,
    /// From the agent's answer to the end, in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<f64>,
}

/// What of an address or error text a record keeps: a queued record then holds at
/// most a few KiB, whatever a client or agent sent.
pub const MAX_TEXT: usize = 512;

fn clip(s: &str) -> String {
    tether_core::ratelimit::clipped(s, MAX_TEXT).to_string()
}

/// An error text as a record keeps it: none when empty, else clipped.
fn error_field(e: &str) -> Option<String> {
    (!e.is_empty()).then(|| clip(e))
}

impl Record {
    /// A refusal of `address` for `frontend`: nothing was connected.
    pub fn refused(
        frontend: &Arc<FrontendPeer>,
        address: &str,
        reason: Reason,
        error: &str,
    ) -> Self {
        Record {
            time: Time::now(),
            event: Event::Refused,
            reason,
            error: error_field(error),
            frontend: frontend.clone(),
            address: clip(address),
            strategy: None,
            agent: None,
            random: None,
            connect_id: None,
            dial_ms: None,
            bytes_to_agent: 0,
            bytes_from_agent: 0,
            duration_ms: None,
        }
    }

    /// The dial went to `agent` (chosen by `strategy`) and failed after `dial`.
    pub fn dial_failed(
        mut self,
        agent: &AgentStream,
        strategy: &'static str,
        random: i64,
        dial: Duration,
    ) -> Self {
        self.agent = Some(AgentRecord::of(agent));
        self.strategy = Some(strategy);
        self.random = Some(random);
        self.dial_ms = Some(millis(dial));
        self
    }

    /// Tunnel `conn` carried by `agent` ended.
    pub fn tunnel(conn: &Conn, agent: &AgentStream, reason: Reason, error: &str) -> Self {
        let (to_agent, from_agent) = conn.bytes();
        Record {
            time: Time::now(),
            event: Event::Tunnel,
            reason,
            error: error_field(error),
            frontend: conn.dialed.peer.clone(),
            address: clip(&conn.dialed.address),
            strategy: Some(conn.dialed.strategy),
            agent: Some(AgentRecord::of(agent)),
            random: Some(conn.dialed.random),
            connect_id: Some(conn.connect_id),
            dial_ms: Some(millis(conn.dialed.latency)),
            bytes_to_agent: to_agent,
            bytes_from_agent: from_agent,
            duration_ms: Some(millis(conn.established.elapsed())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_refusals_are_told_apart() {
        assert_eq!(
            Reason::of_dial_error(
                "dial refused by the agent's dial policy: 10.0.0.1:22 is not on node-a"
            ),
            Reason::Policy
        );
        assert_eq!(
            Reason::of_dial_error("dial tcp 10.0.0.1:22: connection refused"),
            Reason::DialError
        );
    }

    #[test]
    fn a_refusal_serialises_without_empty_fields() {
        let peer = Arc::new(FrontendPeer {
            kind: "grpc",
            transport: "uds",
            uid: Some(0),
            pid: Some(42),
            ..Default::default()
        });
        let r = Record::refused(&peer, "x:1", Reason::NoAgent, "No agent available");
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["event"], "refused");
        assert_eq!(v["reason"], "no_agent");
        assert_eq!(v["frontend"]["uid"], 0);
        assert_eq!(v["frontend"]["pid"], 42);
        assert!(v.get("agent").is_none());
        assert!(v["time"].as_str().unwrap().ends_with('Z'));
    }
}

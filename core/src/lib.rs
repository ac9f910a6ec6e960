//! The data path both ends of the tunnel share: the socket <-> DATA-frame pump,
//! per-connection flow control, the per-connection queue, drain, TLS configuration,
//! transports for tonic over TLS/UDS, and agent identifiers.
//!
//! Lean on purpose: the client crate depends on it without pulling kube, axum or
//! prometheus (those live in `tether-ops`). Knows nothing of servers or agents.

pub mod admission;
pub mod drain;
pub mod error;
pub mod flow;
pub mod grpc;
pub mod host;
pub mod identifiers;
pub mod pump;
pub mod queue;
pub mod quic;
pub mod ratelimit;
pub mod read_ahead;
pub mod tls;
pub mod transport;
pub mod write_through;
pub mod ws;

pub use tether_proto as proto;

/// A random non-zero id for DIAL_REQ.random (and other uses where uniqueness by chance
/// suffices).
pub fn random_id() -> i64 {
    loop {
        let v: i64 = rand::random();
        if v != 0 {
            return v;
        }
    }
}

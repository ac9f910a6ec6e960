//! Shared tunnel core for Tether's server, agent and client: the socket <-> DATA-frame
//! pump, TLS configuration builders, agent identifiers, Go-style durations, transports
//! for tonic over TLS/UDS, shutdown helpers and the health/metrics HTTP endpoint.
//!
//! Depends on `tether-proto` only (plus libraries); knows nothing of servers or agents.

pub mod duration;
pub mod flow;
pub mod health;
pub mod heap_profile;
pub mod identifiers;
pub mod kubeclient;
pub mod memory;
pub mod metrics;
pub mod profiling;
pub mod pump;
pub mod queue;
pub mod ratelimit;
pub mod reload;
pub mod shutdown;
pub mod tls;
pub mod transport;

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

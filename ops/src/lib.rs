//! What a running Tether process needs around the data path: health, readiness and
//! metrics HTTP, profiling, certificate reload, allocator policy, the open-file limit,
//! the Kubernetes client with its rate limit, signals, Go-style durations for flags and
//! the audit log's writer.

pub mod audit;
pub mod authz;
pub mod duration;
pub mod health;
pub mod heap_profile;
pub mod kubeclient;
pub mod limits;
pub mod memory;
pub mod metrics;
pub mod profiling;
pub use tether_core::ratelimit;
pub mod reload;
pub mod shutdown;

//! The `tether` provider's load balancers: LoadBalancer Services served by the CCM
//! itself, through the tunnel, with addresses of its own.
//!
//! - [`addresses`]: the pools and the allocator (which Service gets which address).
//! - [`allocation`]: the service controller's side (on the leader): assignments, their
//!   status, kept in the allocation [`record`].
//! - [`netns`]: the network namespace the addresses live in, apart from the host's.
//! - [`announce`]: holding addresses in that namespace and announcing them (ARP/NDP).
//! - [`balancer`]: the data plane every replica runs: what it serves (addresses,
//!   listeners, one tunnel connection per Service).
//! - [`pools`]: which replica holds which pool (a lease per pool, balanced over the
//!   replicas), and serving each held pool's Services from their status.
//! - [`record`]: the allocation record (a ConfigMap only the CCM writes), against which
//!   holders check each Service's status before they serve it.
//! - [`proxy_protocol`]: the PROXY protocol header telling backends the client.

pub mod addresses;
pub mod allocation;
pub mod announce;
pub mod balancer;
pub mod netns;
pub mod pools;
mod port;
pub mod proxy_protocol;
pub mod record;

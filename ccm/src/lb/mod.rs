//! The `tether` provider's load balancers: LoadBalancer Services served by the CCM
//! itself, through the tunnel, with addresses of its own.
//!
//! - [`addresses`]: the pools and the allocator (which Service gets which address).
//! - [`netns`]: the network namespace the addresses live in, apart from the host's.
//! - [`announce`]: holding addresses in that namespace and announcing them (ARP/NDP).
//! - [`balancer`]: the per-port data plane (listeners, backends, the tunnel hop).
//! - [`proxy_protocol`]: the PROXY protocol header telling backends the client.
//!
//! Which replica holds the addresses is decided by a lease of its own (see
//! [`crate::leader`] and `load_balancer_lease` in [`crate::CcmConfig`]).

pub mod addresses;
pub mod announce;
pub mod balancer;
pub mod netns;
pub mod proxy_protocol;

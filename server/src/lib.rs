//! Tether's proxy server: frontends (gRPC ProxyService and HTTP CONNECT, over a Unix
//! socket or mutual-TLS TCP) -> the server core (backend selection, dial and connection
//! bookkeeping) -> agent links (one task per agent connection), plus health and admin HTTP.
//!
//! [`Server::bind`] binds every listener (so bad addresses and certificates fail at
//! start-up); [`BoundServer::run`] serves until its `drain` token is cancelled, then
//! drains and hard-stops.

pub mod agent_link;
pub mod auth;
pub mod frontend;
pub mod identity;
pub mod lease;
pub mod metrics;
pub mod nodes;
pub mod router;

mod accept;
mod config;
mod serve;
mod side;
mod start;
mod status;

pub use config::{
    AgentsAccess, FrontendClients, FrontendConfig, Listen, ServerConfig, AGENTS_AUDIENCE,
    DEFAULT_MAX_AGENT_STREAMS,
};
pub use start::{BoundAddrs, BoundServer, Server, StartError};

pub use frontend::Mode;
pub use router::{parse_strategies, Router, RouterConfig, Strategy};

//! The commands behind the `tether` binary (server, agent, local, ccm, certs) and the
//! agent-only `tether-agent` binary: flag parsing, start-up validation and the runtime
//! each command runs on.

pub mod cli;
pub mod cmd;
pub mod reference;

//! Frontends: where kube-apiserver (or any konnectivity client) hands the server its
//! egress traffic. gRPC `ProxyService` or HTTP CONNECT, each over a Unix socket or over
//! TCP with mandatory mutual TLS.

pub mod grpc;
pub mod hpack;
pub mod http_connect;
pub mod uds_authority;

/// Which protocol a frontend speaks (`--mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// gRPC `/ProxyService/Proxy` streams.
    Grpc,
    /// HTTP/1.1 CONNECT, one tunnel per connection.
    HttpConnect,
}

impl std::str::FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "grpc" => Ok(Mode::Grpc),
            "http-connect" => Ok(Mode::HttpConnect),
            other => Err(format!("unknown mode {other:?} (use grpc or http-connect)")),
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mode::Grpc => "grpc",
            Mode::HttpConnect => "http-connect",
        })
    }
}

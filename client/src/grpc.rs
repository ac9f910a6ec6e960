//! Where the client's `/ProxyService/Proxy` streams go (a Unix socket, or TCP with
//! TLS) and opening them, on the client half of gRPC on bare HTTP/2 that the agent and
//! the bench's swarm share (`tether_core::grpc::client`). Each connection's driver is a
//! task of its own; whoever holds a stream writes and reads it in its own task, so a
//! message costs one hop (to the connection task) instead of three.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use bytes::Bytes;
use h2::client::SendRequest;
use tether_core::grpc::client;
pub use tether_core::grpc::client::Windows;
pub(crate) use tether_core::grpc::client::{Inbound, StreamError};
use tether_core::grpc::PROXY_PATH;
pub(crate) use tether_core::grpc::{frame, frame_data, h2_io, Outbound};
use tether_core::transport;
use tether_proto::Packet;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::UnixStream;
use tracing::Instrument;

/// TCP connect plus TLS handshake plus HTTP/2 preface.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the proxy server's gRPC frontend listens.
pub(crate) enum Target {
    Uds(PathBuf),
    Tls {
        host: String,
        port: u16,
        tls: Arc<rustls::ClientConfig>,
    },
}

impl Target {
    /// The `:authority` of every request: `localhost` on a Unix socket (a socket path
    /// is not a valid authority), `host:port` over TCP.
    pub(crate) fn authority(&self) -> String {
        match self {
            Target::Uds(_) => "localhost".into(),
            Target::Tls { host, port, .. } => transport::authority(host, *port),
        }
    }

    /// Opens a new HTTP/2 connection; its connection task runs until every handle and
    /// stream on it is gone or the peer goes away.
    pub(crate) async fn connect(&self, windows: Windows) -> io::Result<SendRequest<Bytes>> {
        let connect = async {
            match self {
                Target::Uds(path) => handshake(UnixStream::connect(path).await?, windows).await,
                Target::Tls { host, tls, .. } => {
                    let name = tether_core::tls::server_name(host)
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
                    let authority = self.authority();
                    let tls = transport::connect_tls(&authority, name, tls.clone()).await?;
                    handshake(tls, windows).await
                }
            }
        };
        tokio::time::timeout(CONNECT_TIMEOUT, connect)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))?
    }
}

async fn handshake<S>(io: S, windows: Windows) -> io::Result<SendRequest<Bytes>>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = client::handshake(io, windows).await?;
    tokio::spawn(
        async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %chain(&e), "proxy connection ended");
            }
        }
        .instrument(tracing::debug_span!("proxy_connection")),
    );
    Ok(send)
}

/// Opens a Proxy stream on `send`, with `first` in the same write as the headers.
pub(crate) fn open(
    send: &mut SendRequest<Bytes>,
    authority: &str,
    first: Option<&Packet>,
) -> Result<(Outbound, h2::client::ResponseFuture), h2::Error> {
    let mut headers = http::HeaderMap::new();
    headers.insert(
        http::header::USER_AGENT,
        http::HeaderValue::from_static("tether-client"),
    );
    client::open(send, client::request(authority, PROXY_PATH, headers), first)
}

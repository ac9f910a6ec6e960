//! A Rust konnectivity client: what kube-apiserver does with a proxy server's gRPC
//! frontend, for the CCM, tests and benchmarks. [`Client::dial`] opens one Proxy stream
//! per connection and returns a [`TunnelConn`] implementing `AsyncRead + AsyncWrite`.

use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::StreamExt;
use tether_core::transport::{grpc_channel_tls, grpc_channel_uds, ChannelSettings};
use tether_proto::proxy_service_client::ProxyServiceClient;
use tether_proto::{packet::Payload, Packet};
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tonic::Streaming;
use tracing::Instrument;

/// How long to wait for the server's DIAL_RSP (upstream's client backstop).
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a closing connection waits for CLOSE_RSP.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a dial failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The gRPC connection to the proxy server failed.
    #[error("cannot connect to proxy server: {0}")]
    Connect(#[from] tonic::transport::Error),
    /// The Proxy stream failed.
    #[error("proxy stream failed: {}", .0.message())]
    Stream(#[from] tonic::Status),
    /// The server or agent answered the dial with an error.
    #[error("dial {address} failed: {error}")]
    Dial {
        /// The address dialed.
        address: String,
        /// The error text from the server or agent.
        error: String,
    },
    /// No DIAL_RSP within the timeout.
    #[error("dial {0} timed out waiting for the proxy server")]
    Timeout(String),
}

/// A connection to a proxy server's gRPC frontend.
#[derive(Clone)]
pub struct Client {
    channel: Channel,
}

impl Client {
    /// Connects over the Unix socket at `path` (what kube-apiserver does).
    pub async fn uds(path: impl Into<PathBuf>) -> Result<Self, ClientError> {
        let channel = grpc_channel_uds(path.into(), &ChannelSettings::default()).await?;
        Ok(Client { channel })
    }

    /// Connects over TCP with mutual TLS.
    pub async fn tls(
        host: &str,
        port: u16,
        tls: Arc<rustls::ClientConfig>,
    ) -> Result<Self, ClientError> {
        let channel = grpc_channel_tls(host, port, tls, &ChannelSettings::default()).await?;
        Ok(Client { channel })
    }

    /// Opens a raw Proxy stream: packets sent on the returned sender go to the server.
    pub async fn open_stream(
        &self,
    ) -> Result<(mpsc::Sender<Packet>, Streaming<Packet>), ClientError> {
        let (tx, rx) = mpsc::channel(64);
        let mut client = ProxyServiceClient::new(self.channel.clone())
            .max_decoding_message_size(16 << 20)
            .max_encoding_message_size(16 << 20);
        let inbound = client.proxy(ReceiverStream::new(rx)).await?.into_inner();
        Ok((tx, inbound))
    }

    /// Dials `address` (`host:port`) through the tunnel.
    pub async fn dial(&self, address: &str) -> Result<TunnelConn, ClientError> {
        let (tx, mut inbound) = self.open_stream().await?;
        let random = tether_core::random_id();
        let _ = tx.send(Packet::dial_request("tcp", address, random)).await;
        let answer = tokio::time::timeout(DIAL_TIMEOUT, async {
            loop {
                match inbound.message().await? {
                    Some(Packet {
                        payload: Some(Payload::DialResponse(rsp)),
                        ..
                    }) if rsp.random == random => {
                        return Ok::<_, ClientError>(rsp);
                    }
                    Some(Packet {
                        payload: Some(Payload::CloseDial(c)),
                        ..
                    }) if c.random == random => {
                        return Err(ClientError::Dial {
                            address: address.to_string(),
                            error: "dial cancelled by the proxy".into(),
                        });
                    }
                    Some(_) => continue,
                    None => {
                        return Err(ClientError::Dial {
                            address: address.to_string(),
                            error: "proxy server closed the stream".into(),
                        })
                    }
                }
            }
        })
        .await;
        let rsp = match answer {
            Ok(r) => r?,
            Err(_) => {
                let _ = tx.send(Packet::close_dial(random)).await;
                return Err(ClientError::Timeout(address.to_string()));
            }
        };
        if !rsp.error.is_empty() {
            return Err(ClientError::Dial {
                address: address.to_string(),
                error: rsp.error,
            });
        }
        let connect_id = rsp.connect_id;
        let (user, pump_end) = tokio::io::duplex(256 * 1024);
        let cancel = CancellationToken::new();
        let span = tracing::debug_span!("tunnel_conn", %address, connect_id);
        tokio::spawn(
            async move {
                let packets = inbound
                    .take_while(|r| futures::future::ready(r.is_ok()))
                    .filter_map(|r| futures::future::ready(r.ok()));
                let mut packets = Box::pin(packets);
                let (rd, wr) = tokio::io::split(pump_end);
                let end = tether_core::pump::splice(
                    tether_core::pump::Buffered(rd),
                    wr,
                    &mut packets,
                    &tx,
                    connect_id,
                    &cancel,
                    Default::default(),
                )
                .await;
                use tether_core::pump::SpliceEnd;
                if matches!(end, SpliceEnd::LocalEof | SpliceEnd::LocalError(_)) {
                    // We closed: tell the server and wait (bounded) for its CLOSE_RSP.
                    if tx.send(Packet::close_request(connect_id)).await.is_ok() {
                        let _ = tokio::time::timeout(CLOSE_TIMEOUT, async {
                            while let Some(p) = packets.next().await {
                                if matches!(p.payload, Some(Payload::CloseResponse(_))) {
                                    break;
                                }
                            }
                        })
                        .await;
                    }
                }
            }
            .instrument(span),
        );
        Ok(TunnelConn {
            io: user,
            connect_id,
        })
    }
}

/// A connection through the tunnel. Dropping (or shutting down) it closes the
/// connection on the agent: the pump sees end of file and sends CLOSE_REQ.
pub struct TunnelConn {
    io: DuplexStream,
    connect_id: i64,
}

impl TunnelConn {
    /// The connectID the agent assigned.
    pub fn connect_id(&self) -> i64 {
        self.connect_id
    }
}

impl AsyncRead for TunnelConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for TunnelConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

//! One stream to one proxy server: establish it (TLS, the agent's metadata, the
//! server's id and count, the flow-control offer) and serve it, handing every packet
//! to the dialer's session, until it fails, drains or is stopped.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tether_core::goaway::GoAwaySeen;
use tether_core::grpc::body::{BodyPackets, PacketBody};
use tether_core::transport::{grpc_channel_tls, ChannelSettings};
use tether_proto::{header, link};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::metadata::{MetadataMap, MetadataValue};
use tracing::Instrument;

/// The method the agent calls.
const CONNECT_PATH: &str = "/AgentService/Connect";

use crate::dialer::Session;
use crate::Agent;

/// How long a drained agent waits for the server to end a stream it half-closed.
pub(crate) const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// How long opening one stream (TCP, TLS, the server's response headers) may take.
pub(crate) const ESTABLISH_TIMEOUT: Duration = Duration::from_secs(20);

/// Why one stream to the server ended.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// TCP/TLS/HTTP2 connection failed.
    #[error("cannot connect to proxy server")]
    Connect(#[from] tonic::transport::Error),
    /// The server refused or broke the stream.
    #[error("proxy server stream failed: {}", .0.message())]
    Stream(#[from] tonic::Status),
    /// The token file could not be read.
    #[error("cannot read service account token {path}")]
    Token {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The server's response headers were not as the protocol requires.
    #[error("proxy server response: {0}")]
    Protocol(String),
    /// Connecting and reading the response headers took too long.
    #[error("proxy server did not answer within {0:?}")]
    Timeout(Duration),
}

impl Agent {
    /// Opens a stream to the server at `host:port` and reads its id and count.
    pub(crate) async fn establish(&self, host: &str, port: u16) -> Result<Established, LinkError> {
        let cfg = &self.config;
        let keepalive = self.keepalive();
        let settings = ChannelSettings {
            keepalive: Some(keepalive),
            keepalive_timeout: keepalive.min(Duration::from_secs(20)),
            dead_link: cfg.dead_link,
            ..Default::default()
        };
        let goaway = settings.goaway.clone();
        let mut channel = grpc_channel_tls(host, port, self.tls.get(), &settings).await?;
        let (out_tx, out_rx) = mpsc::channel(cfg.channel_size);
        // Straight on the channel's HTTP/2 bodies, not through tonic's codec (whose
        // buffers kept the size of the largest packet the stream ever carried).
        let body = Body::new(PacketBody::request(ReceiverStream::new(out_rx)));
        let request = self.request(body)?;
        std::future::poll_fn(|cx| channel.poll_ready(cx)).await?;
        let (parts, body) = channel.call(request).await?.into_parts();
        if parts.status != http::StatusCode::OK {
            return Err(LinkError::Protocol(format!("HTTP status {}", parts.status)));
        }
        // A refusal comes as headers only, carrying the status.
        if let Some(status) =
            tonic::Status::from_header_map(&parts.headers).filter(|s| s.code() != tonic::Code::Ok)
        {
            return Err(status.into());
        }
        let md = MetadataMap::from_headers(parts.headers);
        let md = &md;
        let protocol = |e: link::MetaError| LinkError::Protocol(e.to_string());
        let server_id = link::single(md, header::SERVER_ID)
            .map_err(protocol)?
            .to_string();
        let server_count: i64 = link::single(md, header::SERVER_COUNT)
            .map_err(protocol)?
            .parse()
            .map_err(|_| LinkError::Protocol("servercount is not a number".into()))?;
        self.header_count.store(server_count, Ordering::Relaxed);
        // Credit flow control only when we offered it and the server answered.
        let peer_window = cfg.flow_control.then(|| link::peer_window(md)).flatten();
        Ok(Established {
            server_id,
            server_count,
            keepalive,
            goaway,
            peer_window,
            out_tx,
            inbound: BodyPackets::new(body),
        })
    }

    /// The Connect request: the agent's id, identifiers, token and flow-control offer.
    fn request(&self, body: Body) -> Result<http::Request<Body>, LinkError> {
        let cfg = &self.config;
        let ascii = |what: &str, v: &str| {
            MetadataValue::try_from(v)
                .map_err(|_| LinkError::Protocol(format!("{what} is not valid ASCII")))
        };
        let mut md = MetadataMap::new();
        md.insert(header::AGENT_ID, ascii("agent id", &cfg.agent_id)?);
        if !cfg.identifiers.is_empty() {
            md.insert(
                header::AGENT_IDENTIFIERS,
                ascii("agent identifiers", &cfg.identifiers)?,
            );
        }
        if let Some(path) = &cfg.token_path {
            let token = std::fs::read_to_string(path).map_err(|source| LinkError::Token {
                path: path.clone(),
                source,
            })?;
            let what = format!("token in {}", path.display());
            md.insert(
                header::AUTHORIZATION,
                ascii(&what, &format!("Bearer {}", token.trim()))?,
            );
        }
        if cfg.flow_control {
            link::offer_window(&mut md);
        }
        let mut request = http::Request::new(body);
        *request.method_mut() = http::Method::POST;
        *request.uri_mut() = http::Uri::from_static(CONNECT_PATH);
        *request.headers_mut() = md.into_headers();
        let headers = request.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        headers.insert(http::header::TE, http::HeaderValue::from_static("trailers"));
        Ok(request)
    }

    /// Serves one established stream until it fails (Err), the agent is drained and
    /// idle, or `stop` (Ok).
    pub(crate) async fn serve(
        &self,
        est: Established,
        drain: &CancellationToken,
        stop: &CancellationToken,
    ) -> Result<(), LinkError> {
        let cfg = &self.config;
        let Established {
            server_id,
            server_count,
            keepalive,
            goaway,
            peer_window,
            out_tx,
            mut inbound,
        } = est;
        let session = Session::new(
            out_tx,
            cfg.dial_timeout,
            peer_window,
            cfg.stall_timeout,
            self.metrics.clone(),
            self.work.clone(),
        );
        let _close_on_exit = session.closed.clone().drop_guard();
        let _count = Decrement::count(&self.streams, &self.metrics.open_server_connections);
        tracing::info!(%server_id, server_count, flow_control = peer_window.is_some(), "connected to proxy server");

        let span = tracing::info_span!("server_stream", %server_id);
        let drained = async {
            let mut draining = false;
            loop {
                let packet = tokio::select! {
                    p = inbound.message() => p,
                    _ = drain.cancelled(), if !draining => {
                        draining = true;
                        tracing::info!("draining: DRAIN sent; dials the server still sends are served");
                        session.drain().await;
                        continue;
                    }
                    // Draining, the stream stays and serves (as upstream's agent
                    // until its second signal); the hard stop ends it, with a
                    // half-close when DRAIN went first.
                    _ = stop.cancelled() => return Ok(draining),
                };
                match packet {
                    Ok(Some(p)) => session.handle(p).await,
                    Ok(None) => return Err(LinkError::Protocol("server closed the stream".into())),
                    Err(status) => return Err(self.stream_failed(status, keepalive, &goaway)),
                }
            }
        }
        .instrument(span)
        .await?;
        if drained {
            // Half-close instead of dropping the stream: with the session gone its
            // sender is too, so the request body sends what is queued (DRAIN among it)
            // and then END_STREAM, where a reset could discard it. The server then ends
            // its side; a server that does not is left after CLOSE_GRACE.
            drop(session);
            let rest = async { while let Ok(Some(_)) = inbound.message().await {} };
            let _ = tokio::time::timeout(CLOSE_GRACE, rest).await;
        }
        Ok(())
    }

    /// The HTTP/2 keepalive interval for a new stream.
    fn keepalive(&self) -> Duration {
        Duration::from_millis(self.keepalive_ms.load(Ordering::Relaxed))
    }

    /// Counts a failed stream (upstream's `stream_errors_total` and
    /// `server_connection_failure_count`). A server that closed the connection for
    /// pinging too often gets half as many pings from then on, as grpc-go clients (the
    /// upstream agent) do, so a short `--keepalive-time` against an upstream server (which
    /// allows one ping per 30 s) settles after a few reconnects instead of flapping.
    fn stream_failed(
        &self,
        status: tonic::Status,
        keepalive: Duration,
        goaway: &GoAwaySeen,
    ) -> LinkError {
        if goaway.told_to_calm_down() {
            let was: u64 = keepalive.as_millis().try_into().unwrap_or(u64::MAX);
            let now = was.saturating_mul(2);
            // Streams to several servers may fail together: double once per interval.
            if self
                .keepalive_ms
                .compare_exchange(was, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            {
                tracing::warn!(
                    was = ?Duration::from_millis(was),
                    now = ?Duration::from_millis(now),
                    "the proxy server closed the connection for pinging too often (GOAWAY ENHANCE_YOUR_CALM); doubling the keepalive interval (--keepalive-time is shorter than the server's ping policy)"
                );
            }
        }
        let code = tether_ops::metrics::grpc_code_name(received_error_code(&status));
        self.metrics
            .stream_errors
            .with_label_values(&["to_agent", code, tether_ops::metrics::NO_PACKET])
            .inc();
        self.metrics
            .server_connection_failures
            .with_label_values(&["from_server"])
            .inc();
        status.into()
    }
}

/// The code grpc-go's client gives a failed read, for `stream_errors_total`: a status
/// the server sent keeps its code; a broken transport (the server gone, a reset
/// connection, a keepalive timeout), which tonic reports as `Unknown` or `Internal`, is
/// `Unavailable`, as grpc-go reports losing the server.
fn received_error_code(status: &tonic::Status) -> tonic::Code {
    use std::error::Error;
    let transport = status.source().is_some();
    match status.code() {
        tonic::Code::Unknown | tonic::Code::Internal if transport => tonic::Code::Unavailable,
        code => code,
    }
}

/// A stream whose response headers have arrived.
pub(crate) struct Established {
    pub(crate) server_id: String,
    server_count: i64,
    /// The HTTP/2 keepalive interval the stream's connection pings at.
    keepalive: Duration,
    /// The last GOAWAY the server sent on the stream's connection.
    goaway: GoAwaySeen,
    /// The server's per-connection window when it agreed to credit flow control.
    peer_window: Option<u32>,
    out_tx: mpsc::Sender<tether_proto::Packet>,
    inbound: BodyPackets<Body>,
}

/// One open stream, counted in the agent's readiness and its gauge while it lives.
struct Decrement(Arc<AtomicI64>, prometheus::IntGauge);

impl Decrement {
    fn count(streams: &Arc<AtomicI64>, gauge: &prometheus::IntGauge) -> Self {
        streams.fetch_add(1, Ordering::Relaxed);
        gauge.inc();
        Decrement(streams.clone(), gauge.clone())
    }
}

impl Drop for Decrement {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
        self.1.dec();
    }
}

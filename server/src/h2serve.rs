//! gRPC serving on bare HTTP/2 (the h2 crate, no tonic or hyper between), shared by the
//! Proxy frontend and the agent link: one task per connection drives HTTP/2, its
//! keepalive pings and every stream's future, so a packet read off the socket reaches
//! the router, and an answer reaches the socket, without waking another task; and
//! [`Reply`], the server's half of a stream (headers, messages, status trailers).

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use h2::server::SendResponse;
use h2::RecvStream;
use tether_core::grpc::{h2_io, percent_encode, Outbound};
use tether_core::transport::{H2_CONN_WINDOW, H2_MAX_FRAME, H2_STREAM_WINDOW};
use tether_proto::Packet;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};

/// The client preface and SETTINGS exchange.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a keepalive ping may go unanswered (hyper's default, which tonic used).
const PING_TIMEOUT: Duration = Duration::from_secs(20);
/// At the hard stop: how long the last frames and the GOAWAY get to leave.
pub(crate) const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// How one listener's connections are served.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    /// Streams a client may have open at once.
    pub max_streams: u32,
    /// The largest header block a client may send.
    pub max_header_list: u32,
    /// PING interval (zero: never).
    pub keepalive: Duration,
}

/// What an h2 error on a stream means as a gRPC status, as tonic maps it.
pub(crate) fn status_from_h2(e: &h2::Error) -> Status {
    use h2::Reason;
    let code = match e.reason() {
        Some(Reason::CANCEL) => Code::Cancelled,
        Some(Reason::REFUSED_STREAM) => Code::Unavailable,
        Some(Reason::ENHANCE_YOUR_CALM) => Code::ResourceExhausted,
        Some(Reason::INADEQUATE_SECURITY) => Code::PermissionDenied,
        Some(_) => Code::Internal,
        None => Code::Unknown,
    };
    Status::new(code, e.to_string())
}

/// Serves one connection until the client goes, a keepalive ping goes unanswered, or
/// `hard_stop`; `start` turns each request into the future that serves it (or `None`
/// when it answered the request itself). At the hard stop the connection says GOAWAY
/// and gets [`CLOSE_GRACE`] for its last frames; the streams' futures then run to
/// their end with the connection gone (their reads and writes fail).
pub(crate) async fn serve_connection<S, F>(
    io: S,
    settings: Settings,
    hard_stop: CancellationToken,
    mut start: impl FnMut(http::Request<RecvStream>, SendResponse<Bytes>) -> Option<F>,
) where
    S: AsyncRead + AsyncWrite + Unpin,
    F: Future<Output = ()>,
{
    // Boxed: the handshake holds the connection's codec and socket until it hands
    // them to `conn`, and inline it would keep that much room in this future (which
    // lives as long as the connection) for good.
    let handshake = Box::pin(
        h2::server::Builder::new()
            .initial_window_size(H2_STREAM_WINDOW)
            .initial_connection_window_size(H2_CONN_WINDOW)
            .max_frame_size(H2_MAX_FRAME)
            .max_concurrent_streams(settings.max_streams)
            .max_header_list_size(settings.max_header_list)
            .handshake::<_, Bytes>(io),
    );
    let mut conn = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => return tracing::debug!(error = %e, "HTTP/2 handshake failed"),
        Err(_) => return tracing::debug!("HTTP/2 handshake timed out"),
    };
    let pings = conn.ping_pong().expect("taken once");
    let mut keepalive = std::pin::pin!(keep_alive(pings, settings.keepalive));
    let mut streams = FuturesUnordered::new();
    // Set at the hard stop (a timer is not kept for every idle connection before).
    let mut closing: Option<std::pin::Pin<Box<tokio::time::Sleep>>> = None;
    let mut stopping = false;
    loop {
        tokio::select! {
            accepted = conn.accept() => match accepted {
                Some(Ok(_)) if stopping => {}
                Some(Ok((request, respond))) => {
                    if let Some(stream) = start(request, respond) {
                        streams.push(stream);
                    }
                }
                Some(Err(e)) => break tracing::debug!(error = %e, "connection ended"),
                None => break,
            },
            Some(()) = streams.next(), if !streams.is_empty() => {}
            _ = &mut keepalive => {
                break tracing::info!("keepalive ping unanswered; closing the connection");
            }
            // Every stream ends at the hard stop: say GOAWAY and let the last frames out.
            _ = hard_stop.cancelled(), if !stopping => {
                stopping = true;
                conn.graceful_shutdown();
                closing = Some(Box::pin(tokio::time::sleep(CLOSE_GRACE)));
            }
            _ = async { closing.as_mut().expect("set").await }, if closing.is_some() => break,
        }
    }
    drop(conn);
    while streams.next().await.is_some() {}
}

/// Pings every `every` (never if zero); returns when a ping goes unanswered.
async fn keep_alive(mut pings: h2::PingPong, every: Duration) {
    if every.is_zero() {
        return std::future::pending().await;
    }
    loop {
        tokio::time::sleep(every).await;
        let ping = pings.ping(h2::Ping::opaque());
        match tokio::time::timeout(PING_TIMEOUT.min(every), ping).await {
            Ok(Ok(_)) => {}
            // The connection is going anyway; its accept loop sees why.
            Ok(Err(_)) => return std::future::pending().await,
            Err(_) => return,
        }
    }
}

/// The server's half of a stream: the response headers go with the first message (as
/// grpc-go's do) unless sent before, the status in trailers, or alone if nothing was
/// sent.
pub(crate) struct Reply {
    respond: Option<SendResponse<Bytes>>,
    headers: http::HeaderMap,
    out: Outbound,
}

impl Reply {
    /// The reply to a request, with `content-type: application/grpc`.
    pub(crate) fn new(respond: SendResponse<Bytes>) -> Self {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        Reply {
            respond: Some(respond),
            headers,
            out: Outbound::closed(),
        }
    }

    /// The response headers, until they are sent.
    pub(crate) fn headers_mut(&mut self) -> &mut http::HeaderMap {
        &mut self.headers
    }

    /// Sends the response headers now (a client waiting for them before its first
    /// message, as agents do).
    pub(crate) fn send_headers(&mut self) -> std::io::Result<()> {
        if let Some(mut respond) = self.respond.take() {
            let mut response = http::Response::new(());
            *response.headers_mut() = std::mem::take(&mut self.headers);
            self.out = Outbound::new(respond.send_response(response, false).map_err(h2_io)?);
        }
        Ok(())
    }

    /// Sends `packet` once HTTP/2 flow control has room.
    pub(crate) async fn send(&mut self, packet: &Packet) -> std::io::Result<()> {
        self.send_headers()?;
        self.out.send(packet).await
    }

    /// Ends the stream with `status`: in trailers, or trailers-only when nothing was
    /// sent.
    pub(crate) fn finish(&mut self, status: Status) {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", (status.code() as i32).into());
        if !status.message().is_empty() {
            if let Ok(m) = http::HeaderValue::from_str(&percent_encode(status.message())) {
                trailers.insert("grpc-message", m);
            }
        }
        if let Some(mut respond) = self.respond.take() {
            let mut only = http::Response::new(());
            *only.headers_mut() = std::mem::take(&mut self.headers);
            only.headers_mut().extend(trailers);
            let _ = respond.send_response(only, true);
        } else if let Some(stream) = self.out.stream() {
            let _ = stream.send_trailers(trailers);
        }
    }
}

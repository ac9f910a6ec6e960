//! The gRPC frontend (`/ProxyService/Proxy`) on bare HTTP/2 (the h2 crate, no tonic or
//! hyper between): one task per connection drives HTTP/2, its keepalive and all its
//! Proxy streams, each of which reads the client's packets into router calls and
//! writes the stream's outbox back, cutting messages straight out of DATA frames. At
//! the hard stop every stream ends and each connection says GOAWAY.

use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use bytes::Bytes;
use futures::StreamExt;
use h2::server::SendResponse;
use h2::RecvStream;
use tether_core::grpc::{MessageError, Messages, PROXY_PATH};
use tether_proto::{packet::Payload, Packet};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};
use tracing::Instrument;

use crate::metrics::Segment;
use crate::router::{outbox, FrontendPeer, FrontendStream, Router};
use tether_core::grpc::server::{self as h2serve, status_from_h2, Reply, Settings};

/// One stream per dial: a client may hold thousands on one connection.
const MAX_STREAMS: u32 = 1 << 16;
/// hyper's default, which tonic used.
const MAX_HEADER_LIST: u32 = 16 << 10;

/// Serves one frontend connection until the client goes, a keepalive ping goes
/// unanswered, or `hard_stop`; at `go_away` (a successor took the listener's address)
/// it says GOAWAY, so its client opens its next streams there, while the open ones go
/// on. Its streams run in this task too (`h2serve`):
/// kube-apiserver opens one connection per tunnel, so there is nothing to gain from
/// running a connection's streams in parallel, and a wake-up per hop to lose.
pub async fn serve_connection<S>(
    io: S,
    router: Arc<Router>,
    peer: Arc<FrontendPeer>,
    keepalive: Duration,
    go_away: CancellationToken,
    hard_stop: CancellationToken,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let settings = Settings {
        max_streams: MAX_STREAMS,
        connection_window: tether_core::transport::H2_MUX_CONN_WINDOW,
        max_header_list: MAX_HEADER_LIST,
        keepalive,
    };
    let stop = hard_stop.clone();
    h2serve::serve_connection_until(io, settings, Some(go_away), stop, |request, respond| {
        start_stream(&router, &peer, request, respond, &hard_stop)
    })
    .await;
}

/// A Proxy stream's work, or `None` when the request was refused (and answered).
fn start_stream(
    router: &Arc<Router>,
    peer: &Arc<FrontendPeer>,
    request: http::Request<RecvStream>,
    respond: SendResponse<Bytes>,
    hard_stop: &CancellationToken,
) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
    let mut reply = Reply::new(respond);
    if let Err(status) = h2serve::check_call(
        request.method(),
        request.uri(),
        request.headers(),
        PROXY_PATH,
    ) {
        tracing::debug!(path = %request.uri().path(), message = %status.message(), "refused a frontend request");
        reply.finish(status);
        return None;
    }
    let (tx, rx) = tether_core::queue::queue();
    let fe = FrontendStream::grpc(tx, peer.clone());
    // Debug level: an info-level span per stream costs ~0.4 KiB in the subscriber.
    let span = tracing::debug_span!("frontend", kind = "grpc", id = fe.id());
    let router = router.clone();
    let hard_stop = hard_stop.clone();
    let body = request.into_body();
    Some(
        async move {
            let gauge = router
                .metrics
                .grpc_connections
                .with_label_values(&["Proxy"]);
            gauge.inc();
            let inbound = async {
                let status = tokio::select! {
                    s = read_client(&router, &fe, body) => s,
                    _ = hard_stop.cancelled() => {
                        tracing::debug!("server stopping: stream ended");
                        Ok(())
                    }
                };
                Box::pin(router.frontend_gone(&fe)).await;
                // The last sender of the outbox goes with `fe`: the writer drains it and ends.
                drop(fe);
                status
            };
            let outbound = write_client(&router, &mut reply, rx, &hard_stop);
            let (status, ()) = futures::future::join(inbound, outbound).await;
            reply.finish(status.err().unwrap_or(Status::new(Code::Ok, "")));
            gauge.dec();
        }
        .instrument(span),
    )
}

/// Feeds the client's packets into the router until the client half-closes or the
/// stream fails. The router's calls are boxed: this task idles in `body.data()` for the
/// life of the stream, so its resident size is that of an idle stream, not of the
/// largest call it ever makes.
async fn read_client(
    router: &Arc<Router>,
    fe: &Arc<FrontendStream>,
    mut body: RecvStream,
) -> Result<(), Status> {
    let mut messages = Messages::default();
    let result = loop {
        match messages.next_packet() {
            Ok(Some(packet)) => on_packet(router, fe, packet).await,
            Ok(None) => match body.data().await {
                Some(Ok(chunk)) => {
                    let _ = body.flow_control().release_capacity(chunk.len());
                    messages.push(chunk);
                }
                Some(Err(e)) => break Err(status_from_h2(&e)),
                None if messages.mid_message() => {
                    break Err(Status::new(Code::Internal, "stream ended inside a message"))
                }
                None => break Ok(()),
            },
            Err(e @ MessageError::TooLarge(_)) => {
                break Err(Status::new(Code::ResourceExhausted, e.to_string()))
            }
            Err(e) => break Err(Status::new(Code::Internal, e.to_string())),
        }
    };
    if let Err(status) = &result {
        router
            .metrics
            .stream_error(Segment::FromClient, status.code());
        tracing::debug!(error = %status.message(), "frontend stream ended with error");
    }
    result
}

async fn on_packet(router: &Arc<Router>, fe: &Arc<FrontendStream>, packet: Packet) {
    router.metrics.packet(Segment::FromClient, packet.r#type);
    match packet.payload {
        Some(Payload::DialRequest(req)) => {
            let random = req.random;
            let span = tracing::info_span!("dial", address = %req.address, random);
            if let Err(why) = Box::pin(router.dial(fe, req).instrument(span)).await {
                router.dial_refused(fe, random, &why);
            }
        }
        Some(Payload::Data(_)) => {
            Box::pin(router.send_data(fe, packet)).await;
        }
        Some(Payload::CloseRequest(c)) => Box::pin(router.close(fe, c.connect_id)).await,
        Some(Payload::CloseDial(c)) => Box::pin(router.cancel(fe, c.random)).await,
        _ => tracing::debug!(
            ty = packet.r#type,
            "unexpected packet from frontend; ignored"
        ),
    }
}

/// Writes the stream's outbox to the client until it ends (the stream is gone from
/// the router and everything queued is out), the client stops the stream, or `hard_stop`.
async fn write_client(
    router: &Router,
    reply: &mut Reply,
    rx: tether_core::queue::Receiver<crate::router::Outgoing>,
    hard_stop: &CancellationToken,
) {
    let mut packets = outbox(rx);
    loop {
        let packet = tokio::select! {
            p = packets.next() => match p {
                Some(p) => p,
                None => return,
            },
            _ = hard_stop.cancelled() => return,
        };
        if let Err(e) = reply.send(&packet).await {
            tracing::debug!(error = %chain(&e), "cannot write to the frontend client");
            router.metrics.send_error(
                Segment::ToClient,
                h2serve::send_error_code(&e),
                packet.r#type,
            );
            return;
        }
    }
}

//! The gRPC frontend (`/ProxyService/Proxy`): one task per client stream turns the
//! client's packets into calls on the router; the router's answers flow back through
//! the stream's outbox. At the hard stop every stream ends, so the HTTP/2 connections
//! can close at once.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tether_proto::proxy_service_server::ProxyService;
use tether_proto::{packet::Payload, Packet};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::metrics::Segment;
use crate::router::{outbox, FrontendStream, Router};

/// Serves `ProxyService`.
pub struct GrpcFrontend {
    pub(crate) router: Arc<Router>,
    /// The server's hard stop: every stream's task ends, and with it the stream.
    pub(crate) stop: CancellationToken,
}

type PacketStream = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send>>;

#[tonic::async_trait]
impl ProxyService for GrpcFrontend {
    type ProxyStream = PacketStream;

    async fn proxy(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<Self::ProxyStream>, Status> {
        let (tx, rx) = tether_core::queue::queue();
        let fe = FrontendStream::new(tx);
        let router = self.router.clone();
        let gauge = router
            .metrics
            .grpc_connections
            .with_label_values(&["Proxy"]);
        gauge.inc();
        let inbound = request.into_inner();
        // Debug level: an info-level span per router costs ~0.4 KiB in the subscriber.
        let span = tracing::debug_span!("frontend", kind = "grpc", id = fe.id());
        let stop = self.stop.clone();
        tokio::spawn(
            async move {
                tokio::select! {
                    _ = serve_client(&router, &fe, inbound) => {}
                    _ = stop.cancelled() => tracing::debug!("server stopping: stream ended"),
                }
                // The last sender of the outbox goes with `fe`: the response stream ends.
                Box::pin(router.frontend_gone(&fe)).await;
                gauge.dec();
            }
            .instrument(span),
        );
        Ok(Response::new(Box::pin(outbox(rx).map(Ok))))
    }
}

/// Feeds the client's packets into the server core. The core's calls are boxed: this
/// task lives as long as the router and idles in `inbound.message()`, so its resident
/// size is what one idle router costs, not the largest call it ever makes.
async fn serve_client(
    router: &Arc<Router>,
    fe: &Arc<FrontendStream>,
    mut inbound: Streaming<Packet>,
) {
    loop {
        let packet = match inbound.message().await {
            Ok(Some(p)) => p,
            Ok(None) => return,
            Err(status) => {
                router
                    .metrics
                    .stream_error(Segment::FromClient, status.code());
                tracing::debug!(error = %status.message(), "frontend stream ended with error");
                return;
            }
        };
        router.metrics.packet(Segment::FromClient, packet.r#type);
        match packet.payload {
            Some(Payload::DialRequest(req)) => {
                let random = req.random;
                let span = tracing::info_span!("dial", address = %req.address, random);
                if Box::pin(router.dial(fe, req).instrument(span))
                    .await
                    .is_err()
                {
                    router.no_agent(fe, random);
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
}

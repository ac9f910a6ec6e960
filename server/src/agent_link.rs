//! The agent listener's gRPC service (`/AgentService/Connect`): validates an agent's
//! metadata, registers its stream as a backend, answers with `serverid`/`servercount`
//! and runs one task per stream feeding what the agent sends into the server core.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tether_core::identifiers::AgentIdentifiers;
use tether_core::transport::TlsConnectInfo;
use tether_proto::agent_service_server::AgentService;
use tether_proto::{header, Packet};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::backend::Backend;
use crate::metrics::Segment;
use crate::tunnel::Tunnel;

/// Serves agents' Connect streams.
pub struct AgentLink {
    pub(crate) tunnel: Arc<Tunnel>,
    pub(crate) server_id: String,
    pub(crate) server_count: u32,
    pub(crate) channel_size: usize,
    pub(crate) shutdown: CancellationToken,
    pub(crate) authenticator: Option<Arc<crate::auth::TokenAuthenticator>>,
}

type PacketStream = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send>>;

#[tonic::async_trait]
impl AgentService for AgentLink {
    type ConnectStream = PacketStream;

    async fn connect(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let peer = request
            .extensions()
            .get::<TlsConnectInfo>()
            .map(|i| i.remote_addr.to_string())
            .unwrap_or_default();
        let md = request.metadata();
        let ids: Vec<_> = md.get_all(header::AGENT_ID).iter().collect();
        let agent_id = match ids.as_slice() {
            [one] => one
                .to_str()
                .map_err(|_| Status::invalid_argument("agentid is not valid ASCII"))?
                .to_string(),
            [] => {
                tracing::warn!(%peer, "agent stream without agentid metadata refused");
                return Err(Status::invalid_argument("missing agentid metadata"));
            }
            _ => {
                tracing::warn!(%peer, "agent stream with several agentid values refused");
                return Err(Status::invalid_argument("expected exactly one agentid"));
            }
        };
        if agent_id.is_empty() {
            return Err(Status::invalid_argument("empty agentid"));
        }
        if let Some(auth) = &self.authenticator {
            let header = md.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
            if let Err(e) = auth.authenticate(header).await {
                tracing::warn!(%agent_id, %peer, error = %e, "agent authentication failed; stream refused");
                return Err(Status::unauthenticated(e.to_string()));
            }
        }
        let identifiers = md
            .get(header::AGENT_IDENTIFIERS)
            .and_then(|v| v.to_str().ok())
            .map(|q| AgentIdentifiers::parse(q, false).unwrap_or_default())
            .unwrap_or_default();

        let (tx, rx) = mpsc::channel(self.channel_size);
        let backend = Arc::new(Backend::new(agent_id.clone(), identifiers, tx));
        self.tunnel.add_backend(backend.clone());
        let grpc_gauge = self
            .tunnel
            .metrics
            .grpc_connections
            .with_label_values(&["Connect"]);
        grpc_gauge.inc();
        tracing::info!(%agent_id, %peer, identifiers = ?backend.identifiers, "agent connected");

        let inbound = request.into_inner();
        let tunnel = self.tunnel.clone();
        let shutdown = self.shutdown.clone();
        let span = tracing::info_span!("agent_stream", %agent_id, %peer);
        tokio::spawn(
            async move {
                serve_agent(&tunnel, &backend, inbound, shutdown).await;
                tunnel.remove_backend(&backend).await;
                grpc_gauge.dec();
                tracing::info!("agent disconnected");
            }
            .instrument(span),
        );

        // The stream to the agent ends when the backend is removed (its sender dropped
        // with the last reference) or when the server shuts down.
        let closed = self.shutdown.clone();
        let out = futures::StreamExt::take_until(
            ReceiverStream::new(rx).map(Ok),
            closed.cancelled_owned(),
        );
        let mut response = Response::new(Box::pin(out) as PacketStream);
        let meta = response.metadata_mut();
        if let Ok(v) = MetadataValue::try_from(self.server_id.as_str()) {
            meta.insert(header::SERVER_ID, v);
        }
        meta.insert(header::SERVER_COUNT, MetadataValue::from(self.server_count));
        Ok(response)
    }
}

async fn serve_agent(
    tunnel: &Arc<Tunnel>,
    backend: &Arc<Backend>,
    mut inbound: Streaming<Packet>,
    shutdown: CancellationToken,
) {
    loop {
        let next = tokio::select! {
            next = inbound.message() => next,
            _ = shutdown.cancelled() => return,
        };
        match next {
            Ok(Some(packet)) => tunnel.handle_agent_packet(backend, packet).await,
            Ok(None) => return,
            Err(status) => {
                tunnel
                    .metrics
                    .stream_error(Segment::FromAgent, status.code());
                tracing::info!(error = %status.message(), code = ?status.code(), "agent stream failed");
                return;
            }
        }
    }
}

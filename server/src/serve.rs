//! A bound server's life: the background jobs, the listeners, then the drain and the
//! hard stop.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::accept::{admission, serve_frontend, spawn_agent_listener};
use crate::config::AgentsAccess;
use crate::side::{spawn_admin, spawn_health, AgentsReaders};
use crate::start::{BoundAddrs, BoundServer, FrontendListener};
use crate::status::StatusSource;
use crate::{agent_link, lease, nodes, Router};

impl BoundServer {
    /// The bound addresses.
    pub fn addrs(&self) -> &BoundAddrs {
        &self.addrs
    }

    /// The server core (for in-process embedding and tests).
    pub fn router(&self) -> &Arc<Router> {
        &self.router
    }

    /// Serves until `drain` is cancelled, then stops taking frontend connections,
    /// lets established tunnels finish for up to `--graceful-shutdown-timeout`, and
    /// returns after the hard stop.
    pub async fn run(mut self, drain: CancellationToken) {
        // Agents and in-flight tunnels outlive the frontend listeners during a graceful
        // drain; `hard_stop` ends them.
        let hard_stop = CancellationToken::new();
        let server_count = Arc::new(AtomicU32::new(self.config.server_count));
        let counted = Arc::new(lease::LastCount::default());
        let lease_task = self.spawn_background(&server_count, &counted, &drain, &hard_stop);
        if let Some(l) = self.health.take() {
            spawn_health(&self.router, l, &hard_stop);
        }
        if let Some(l) = self.admin.take() {
            let access = match (&self.config.agents_access, self.agents_delegation.take()) {
                (AgentsAccess::Anyone, _) => AgentsReaders::Anyone,
                (AgentsAccess::Authorized { .. }, delegation) => AgentsReaders::Authorized {
                    delegation,
                    decisions: Arc::default(),
                },
            };
            let status = StatusSource::new(&self.config, server_count.clone(), counted);
            let profiling = self.config.profiling;
            let tls = self.admin_tls.take();
            spawn_admin(&self.router, l, profiling, access, status, tls, &hard_stop);
        }
        let (config, router) = (self.config.clone(), self.router.clone());
        let (agent_task, frontends) = self.spawn_listeners(server_count, &hard_stop);

        drain.cancelled().await;
        tracing::info!("shutting down: no new frontend connections");
        frontends.close();
        let told = router.drain_agents();
        if told > 0 {
            tracing::info!(agents = told, "told the agents this server drains (DRAIN): they connect to the other servers while their streams here serve the last tunnels");
        }
        if let Some(task) = lease_task {
            // Stop advertising this server before waiting for its tunnels to finish.
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        finish_tunnels(&router, config.graceful_shutdown_timeout).await;
        router.stopping();
        hard_stop.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(2), async {
            for task in frontends.tasks {
                let _ = task.await;
            }
            let _ = agent_task.await;
        });
        if stopped.await.is_err() {
            tracing::warn!("listeners still open 2s after the hard stop; exiting anyway");
        }
        sync_audit(&router).await;
        tracing::info!("server stopped");
    }

    /// Starts what runs beside the listeners: the memory trimmer, certificate reload,
    /// the Node watch and the Lease (returned: it stops at `drain`).
    pub(crate) fn spawn_background(
        &self,
        server_count: &Arc<AtomicU32>,
        counted: &Arc<lease::LastCount>,
        drain: &CancellationToken,
        hard_stop: &CancellationToken,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let router = self.router.clone();
        let open = move || router.work().open() as i64;
        tether_ops::memory::spawn_trimmer(
            open,
            tether_ops::memory::Looks::Steady,
            hard_stop.clone(),
        );
        tether_ops::reload::spawn_watcher(
            self.reloadables.clone(),
            self.config.cert_reload_interval,
            hard_stop.clone(),
        );
        if let Some(client) = &self.nodes_client {
            let inventory = self.router.registry().nodes().clone();
            nodes::spawn(client.clone(), inventory, hard_stop.clone());
        }
        let (Some(client), Some(cfg)) = (&self.lease_client, &self.config.lease) else {
            return None;
        };
        Some(tokio::spawn(lease::run(
            client.clone(),
            cfg.clone(),
            self.config.server_id.clone(),
            server_count.clone(),
            counted.clone(),
            self.router.metrics.clone(),
            drain.clone(),
        )))
    }

    /// Starts the agent listener and the frontends (which stop accepting at
    /// [`Frontends::close`]).
    pub(crate) fn spawn_listeners(
        self,
        server_count: Arc<AtomicU32>,
        hard_stop: &CancellationToken,
    ) -> (tokio::task::JoinHandle<()>, Frontends) {
        let config = self.config;
        let link = new_link(
            &self.router,
            &config,
            server_count,
            hard_stop,
            self.authenticator,
        );
        let keepalive = config.agent_keepalive;
        let mut frontends = Frontends {
            shared: config.reuse_port,
            ..Frontends::default()
        };
        // Sharing its port (--reuse-port), a stopping server stops taking agents with
        // its frontends, so that agents reconnecting meanwhile reach its successor; its
        // streams stay until the hard stop.
        let accepting = match config.reuse_port {
            true => frontends.drain.clone(),
            false => hard_stop.clone(),
        };
        let link = Arc::new(link);
        let admission = admission(&self.router, "agent", config.admission);
        let quic_task = self.agent_quic.map(|port| {
            let tls = self.agent_tls.clone();
            let accept = (admission.clone(), accepting.clone());
            spawn_quic_listener(link.clone(), port, tls, accept)
        });
        let tcp_task = spawn_agent_listener(
            link,
            self.agent_listener,
            self.agent_tls,
            keepalive,
            config.agent_dead_link,
            admission,
            &accepting,
        );
        let agent_task = tokio::spawn(async move {
            let _ = tcp_task.await;
            if let Some(quic) = quic_task {
                let _ = quic.await;
            }
        });
        for (mode, listener) in self.frontends {
            frontends.spawn(&self.router, &config, mode, listener, hard_stop);
        }
        (agent_task, frontends)
    }
}

/// The agent link both agent listeners (TCP and QUIC) serve.
fn new_link(
    router: &Arc<Router>,
    config: &crate::config::ServerConfig,
    server_count: Arc<AtomicU32>,
    hard_stop: &CancellationToken,
    authenticator: Option<Arc<crate::auth::TokenAuthenticator>>,
) -> agent_link::AgentLink {
    agent_link::AgentLink {
        router: router.clone(),
        server_id: config.server_id.clone(),
        server_count,
        channel_size: config.channel_size,
        hard_stop: hard_stop.clone(),
        authenticator,
        require_identity_match: config.require_agent_identity_match,
        websocket: config.agent_websocket,
        unverified_warnings: tether_ops::ratelimit::TokenBucket::new(
            agent_link::UNVERIFIED_WARNINGS.0,
            agent_link::UNVERIFIED_WARNINGS.1,
        ),
        identities: agent_link::IdentityConnections::new(config.router.max_agent_streams),
        refusal_log: tether_core::ratelimit::LogLimit::new(
            agent_link::REFUSAL_WARNINGS.0,
            agent_link::REFUSAL_WARNINGS.1,
        ),
    }
}

/// The QUIC agent listener's accept loop, in a task (with the agent port's admission
/// and what ends its accepting).
fn spawn_quic_listener(
    link: Arc<agent_link::AgentLink>,
    port: agent_link::quic::QuicPort,
    tls: tether_core::transport::ServerConfigSource,
    (admission, accepting): (Arc<tether_core::admission::Admission>, CancellationToken),
) -> tokio::task::JoinHandle<()> {
    let accept = agent_link::quic::accept_loop(link, port, tls, admission, accepting);
    let span = tracing::info_span!("agent_listener", transport = "quic");
    tokio::spawn(accept.instrument(span))
}

/// Lets established tunnels finish for up to `grace` (pending dials and established
/// connections each hold a drain watch); closes those left from the server's side.
async fn finish_tunnels(router: &Router, grace: Duration) {
    let drained = tokio::time::timeout(grace, router.work().drain());
    if drained.await.is_ok() {
        return;
    }
    let closed = router.end_all();
    if !grace.is_zero() {
        tracing::info!(
            open = router.work().open(),
            closed,
            "graceful shutdown timeout reached; closing remaining tunnels"
        );
    }
    if closed > 0 {
        // Their CLOSE_RSPs go out before the connections do.
        tokio::time::sleep(CLOSE_FLUSH).await;
    }
}

/// How long the CLOSE_RSPs of those tunnels get to reach their clients before the
/// hard stop closes the connections.
const CLOSE_FLUSH: Duration = Duration::from_millis(300);

impl Frontends {
    /// Serves one frontend listener until the frontends' drain.
    fn spawn(
        &mut self,
        router: &Arc<Router>,
        config: &crate::ServerConfig,
        mode: crate::Mode,
        listener: FrontendListener,
        hard_stop: &CancellationToken,
    ) {
        if let FrontendListener::Uds(_, file) = &listener {
            self.sockets.push(file.clone());
        }
        let drain = (self.drain.clone(), self.go_away.clone());
        let hard_stop = hard_stop.clone();
        let keepalive = config.frontend_keepalive;
        let span = tracing::info_span!("frontend_listener", %mode);
        let admission = admission(router, "frontend", config.admission);
        self.tasks.push(tokio::spawn(
            serve_frontend(
                mode,
                listener,
                router.clone(),
                keepalive,
                admission,
                drain,
                hard_stop,
            )
            .instrument(span),
        ));
    }
}

/// The running frontends: their tasks and the Unix socket files they serve on.
#[derive(Default)]
pub(crate) struct Frontends {
    pub(crate) tasks: Vec<tokio::task::JoinHandle<()>>,
    pub(crate) sockets: Vec<tether_core::transport::SocketFile>,
    /// The frontends' own drain, after the sockets' paths are dealt with.
    pub(crate) drain: CancellationToken,
    /// Cancelled at the drain when a successor has taken (or may share, with
    /// `--reuse-port`) the listeners' addresses: each gRPC connection says GOAWAY, so
    /// its client (the CCM's load balancers keep theirs) reconnects to the successor.
    pub(crate) go_away: CancellationToken,
    /// `--reuse-port`.
    pub(crate) shared: bool,
}

impl Frontends {
    /// At the drain: each Unix socket's path is removed so no new client can reach it,
    /// unless a successor bound it since (its clients are its own); then the frontends
    /// stop accepting. In that order: a listener closed first frees its socket's
    /// inode, whose number a successor's socket could then take.
    fn close(&self) {
        use tether_core::transport::Removal;
        let mut succeeded = self.shared;
        for socket in &self.sockets {
            let path = socket.path.display();
            match socket.remove_if_ours() {
                Removal::Removed | Removal::Gone => {}
                Removal::NotOurs => {
                    succeeded = true;
                    tracing::info!(%path, "the Unix socket's path now belongs to another server; left in place")
                }
                Removal::Failed(e) => {
                    tracing::warn!(%path, error = %e, "cannot remove the Unix socket")
                }
            }
        }
        if succeeded {
            tracing::info!("telling the frontends' clients to reconnect (GOAWAY): their next tunnels go to the successor");
            self.go_away.cancel();
        }
        self.drain.cancel();
    }
}

/// Waits up to 2 s for the audit records queued so far (the tunnels the hard stop cut
/// among them) to be written.
async fn sync_audit(router: &Router) {
    let audit = router.audit().clone();
    let synced = tokio::task::spawn_blocking(move || audit.sync(Duration::from_secs(2)));
    if !matches!(synced.await, Ok(true)) {
        tracing::warn!("the audit log's last records were not written within 2s of the stop");
    }
}

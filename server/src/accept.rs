//! The accept loops: the agent listener (TLS, admission caps) and the frontends
//! (a Unix socket or mutual-TLS TCP; gRPC or HTTP-CONNECT).

use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;
use tether_core::transport::{self, ServerConfigSource};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::router::audit::{Reason, Record};
use crate::router::FrontendPeer;
use crate::start::FrontendListener;
use crate::{agent_link, frontend, Mode, Router};

/// A TCP listener's admission under `limits`, counting refusals in
/// `tether_server_connections_refused_total{listener}`.
pub(crate) fn admission(
    router: &Arc<Router>,
    listener: &'static str,
    limits: tether_core::admission::AdmissionLimits,
) -> Arc<tether_core::admission::Admission> {
    Arc::new(tether_core::admission::Admission::new(
        limits,
        refusals(router, listener),
    ))
}

/// Counts `listener`'s refusals in `tether_server_connections_refused_total`.
pub(crate) fn refusals(
    router: &Arc<Router>,
    listener: &'static str,
) -> tether_core::admission::OnRefusal {
    let refused = router.metrics.connections_refused.clone();
    Arc::new(move |why| {
        refused.with_label_values(&[listener, why.label()]).inc();
    })
}

/// The agent listener: mutual TLS, then one task per connection serving
/// `AgentService` with HTTP/2 keepalive, until `accepting` is cancelled; then it waits
/// for those tasks (each ends within `tether_core::grpc::server::CLOSE_GRACE` of the
/// hard stop).
pub(crate) fn spawn_agent_listener(
    link: Arc<agent_link::AgentLink>,
    listener: TcpListener,
    tls: ServerConfigSource,
    keepalive: Duration,
    dead_link: Option<Duration>,
    admission: Arc<tether_core::admission::Admission>,
    accepting: &CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let mut incoming = transport::tls_incoming_with(
        listener,
        tls,
        "agent",
        dead_link,
        admission,
        accepting.clone(),
    );
    tokio::spawn(
        async move {
            let connections = tokio_util::task::TaskTracker::new();
            while let Some(mut conn) = incoming.recv().await {
                let info = conn.info().clone();
                let pending = conn.take_pending();
                let alpn = conn.alpn().map(<[u8]>::to_vec);
                let span = tracing::debug_span!("agent_connection", peer = %info.remote_addr);
                // Boxed: the TLS connection (over a KiB) is then once on the heap, not
                // in each of the futures it passes through.
                let serve =
                    link.clone()
                        .serve_connection(Box::new(conn), info, pending, keepalive, alpn);
                connections.spawn(serve.instrument(span));
            }
            connections.close();
            connections.wait().await;
        }
        .instrument(tracing::info_span!("agent_listener")),
    )
}

/// Accepts frontend connections until `drain`, each served in a task of its own until
/// its client goes or `hard_stop`: established streams and tunnels outlive `drain`.
pub(crate) async fn serve_frontend(
    mode: Mode,
    listener: FrontendListener,
    router: Arc<Router>,
    keepalive: Duration,
    admission: Arc<tether_core::admission::Admission>,
    (drain, go_away): (CancellationToken, CancellationToken),
    hard_stop: CancellationToken,
) {
    let serve = Accepted {
        mode,
        router,
        keepalive,
        go_away,
        hard_stop,
    };
    match listener {
        FrontendListener::Uds(l, _) => loop {
            let sock = tokio::select! {
                _ = drain.cancelled() => return,
                a = l.accept() => match a {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(error = %chain(&e), "accept failed");
                        // EMFILE and friends: back off a little instead of spinning.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let peer = serve.uds_peer(&sock);
            match mode {
                Mode::Grpc => serve.spawn(
                    frontend::uds_authority::AuthorityFix::new(sock),
                    "uds",
                    peer,
                ),
                Mode::HttpConnect => serve.spawn(sock, "uds", peer),
            }
        },
        FrontendListener::Tls(l, cfg, clients) => {
            let mut incoming =
                transport::tls_incoming_with(l, cfg, "frontend", None, admission, drain);
            while let Some(mut conn) = incoming.recv().await {
                let peer = conn.info().remote_addr.to_string();
                let leaf = conn.info().peer_certs.as_ref().and_then(|c| c.first());
                let audited = serve.tcp_peer(&peer, leaf);
                if let Err(why) = clients.admit(leaf) {
                    tracing::warn!(%peer, reason = %why, "frontend client refused");
                    serve.not_allowed(&audited, why);
                    continue;
                }
                // Its certificate chains to the frontend's CA and is one it admits.
                drop(conn.take_pending());
                // Boxed, as an agent connection is.
                serve.spawn(Box::new(conn), &peer, audited);
            }
        }
    }
}

/// How an accepted frontend connection is served.
pub(crate) struct Accepted {
    pub(crate) mode: Mode,
    pub(crate) router: Arc<Router>,
    pub(crate) keepalive: Duration,
    /// A successor took the listener's address: gRPC connections say GOAWAY.
    pub(crate) go_away: CancellationToken,
    pub(crate) hard_stop: CancellationToken,
}

impl Accepted {
    /// The frontend kind's name in audit records.
    fn kind(&self) -> &'static str {
        match self.mode {
            Mode::Grpc => "grpc",
            Mode::HttpConnect => "http-connect",
        }
    }

    /// Who is at the other end of a Unix socket, as the kernel says (`SO_PEERCRED`).
    pub(crate) fn uds_peer(&self, sock: &tokio::net::UnixStream) -> Arc<FrontendPeer> {
        let cred = sock.peer_cred().ok();
        Arc::new(FrontendPeer {
            kind: self.kind(),
            transport: "uds",
            uid: cred.map(|c| c.uid()),
            // 0: the peer is in a PID namespace the server cannot see into.
            pid: cred.and_then(|c| c.pid()).filter(|p| *p > 0),
            ..Default::default()
        })
    }

    /// Who is at the other end of a mutual-TLS connection: its address and, when the
    /// audit is on, its certificate's subject.
    pub(crate) fn tcp_peer(
        &self,
        remote: &str,
        leaf: Option<&rustls_pki_types::CertificateDer<'_>>,
    ) -> Arc<FrontendPeer> {
        let subject = leaf
            .filter(|_| self.router.audit().enabled())
            .and_then(|c| tether_certs::inspect::parse_der(c).ok())
            .map(|info| info.subject);
        Arc::new(FrontendPeer {
            kind: self.kind(),
            transport: "tcp",
            subject,
            remote: Some(remote.to_string()),
            ..Default::default()
        })
    }

    /// Records a TCP client `--frontend-client-names` refused.
    fn not_allowed(&self, peer: &Arc<FrontendPeer>, why: String) {
        if self.router.audit().enabled() {
            let r = Record::refused(peer, "", Reason::FrontendNotAllowed, &why);
            self.router.audit().record(r);
        }
    }

    pub(crate) fn spawn<S>(&self, sock: S, peer: &str, audited: Arc<FrontendPeer>)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (router, hard_stop) = (self.router.clone(), self.hard_stop.clone());
        match self.mode {
            Mode::Grpc => {
                let span = tracing::debug_span!("frontend_connection", kind = "grpc", %peer);
                let conn = frontend::grpc::serve_connection(
                    sock,
                    router,
                    audited,
                    self.keepalive,
                    self.go_away.clone(),
                    hard_stop,
                );
                tokio::spawn(conn.instrument(span));
            }
            Mode::HttpConnect => {
                let span = tracing::info_span!("frontend", kind = "http-connect", %peer, address = tracing::field::Empty);
                let conn =
                    frontend::http_connect::serve_connection(router, sock, audited, hard_stop);
                tokio::spawn(conn.instrument(span));
            }
        }
    }
}

//! The attacker's tools for the compromised-node and attack tests: a hand-written
//! agent ([`Rogue`]) that holds one node's credentials and opens what streams it likes
//! with what metadata it likes, a probe that tells whose tunnel a dial reached
//! ([`ping`]), per-node certificates as `tether certs agent` writes them, and the
//! shipped manifests' server flags and agent identifiers.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tether_client::Client;
use tether_proto::agent_service_client::AgentServiceClient;
use tether_proto::{packet::Payload, Packet};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::process::socket_path;
use crate::{wait_until, Pki, ServerProc};

/// What the attacker's agent writes into every tunnel it is given.
pub const ROGUE: &[u8; 4] = b"evil";

/// A per-node agent certificate, as `tether certs agent` writes it: (cert, key).
pub fn node_cert(bin: &Path, pki: &Pki, out: &Path, node: &str, ip: &str) -> (PathBuf, PathBuf) {
    let f = &pki.files;
    let status = Command::new(bin)
        .args(["certs", "agent", "--node", node, "--node-ip", ip, "--out"])
        .arg(out)
        .arg("--ca-cert")
        .arg(&f.ca_cert)
        .arg("--ca-key")
        .arg(&f.ca_key)
        .output()
        .unwrap();
    assert!(status.status.success(), "{status:?}");
    (
        out.join(format!("agent-{node}.crt")),
        out.join(format!("agent-{node}.key")),
    )
}

/// What carries the attacker's streams, as `--transports` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Over {
    /// gRPC on HTTP/2: every stream on one connection.
    H2,
    /// WebSocket on HTTP/1.1: a connection per stream.
    WebSocket,
    /// QUIC: a connection per stream (its control stream), tunnels on streams the
    /// server opens.
    Quic,
}

impl Over {
    /// Every transport an agent may use.
    pub const ALL: [Over; 3] = [Over::H2, Over::WebSocket, Over::Quic];

    /// Where `server` takes agents over this transport.
    pub fn agent_port(self, server: &crate::ServerProc) -> std::net::SocketAddr {
        match self {
            Over::Quic => server
                .agent_quic
                .expect("the server takes QUIC (--agent-quic-port)"),
            _ => server.agent,
        }
    }
}

/// The attacker: one mutual-TLS HTTP/2 connection to the agent port, on which it opens
/// as many Connect streams as it likes with whatever metadata it likes (over WebSocket:
/// a connection per stream, with the same credentials). Every stream answers each dial
/// with a tunnel of its own bytes ([`ROGUE`]), unless `silent`.
pub struct Rogue {
    /// The connection its streams share.
    pub channel: tonic::transport::Channel,
    /// Over WebSocket: where and with what it connects for each stream.
    ws: Option<WsDialer>,
    /// Over QUIC: the same.
    quic: Option<QuicDialer>,
    /// Dials that reached the attacker.
    pub dials: Arc<AtomicUsize>,
    /// Leaves every dial unanswered.
    pub silent: bool,
}

/// One of the attacker's streams: what it sends goes to the server.
pub struct RogueStream {
    /// Packets to the server.
    pub out: mpsc::Sender<Packet>,
}

impl Rogue {
    /// Connects with `identity` (a client certificate and key), or none (tokens).
    pub async fn connect(
        pki: &Pki,
        server: std::net::SocketAddr,
        identity: Option<(&Path, &Path)>,
    ) -> Rogue {
        Self::connect_over(Over::H2, pki, server, identity).await
    }

    /// [`Rogue::connect`], its streams carried `over` a transport.
    pub async fn connect_over(
        over: Over,
        pki: &Pki,
        server: std::net::SocketAddr,
        identity: Option<(&Path, &Path)>,
    ) -> Rogue {
        let lazy = over == Over::Quic;
        let channel = crate::agent_channel_with(server, &pki.files.ca_cert, identity, lazy).await;
        let ws = (over == Over::WebSocket).then(|| WsDialer {
            server,
            tls: tether_core::tls::client_config(
                &pki.files.ca_cert,
                identity,
                &[tether_core::tls::ALPN_HTTP11],
            )
            .expect("client TLS"),
        });
        let quic = (over == Over::Quic).then(|| QuicDialer {
            server,
            tls: tether_core::tls::client_config(&pki.files.ca_cert, identity, &[])
                .expect("client TLS"),
        });
        Rogue {
            channel,
            ws,
            quic,
            dials: Arc::default(),
            silent: false,
        }
    }

    /// Opens a Connect stream as `agent_id` with `identifiers` (and `token`).
    pub async fn open(
        &self,
        agent_id: &str,
        identifiers: &str,
        token: Option<&str>,
    ) -> Result<RogueStream, tonic::Status> {
        let (out, rx) = mpsc::channel(64);
        let mut md = tonic::metadata::MetadataMap::new();
        md.insert("agentid", agent_id.parse().unwrap());
        md.insert("agentidentifiers", identifiers.parse().unwrap());
        if let Some(t) = token {
            md.insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        let (dials, silent, reply) = (self.dials.clone(), self.silent, out.clone());
        let answer = move |packet: Packet| {
            let (dials, reply) = (dials.clone(), reply.clone());
            async move {
                if let Some(Payload::DialRequest(req)) = packet.payload {
                    let next_id = 1_000_000 + dials.fetch_add(1, Ordering::SeqCst) as i64 + 1;
                    if silent {
                        return;
                    }
                    let _ = reply
                        .send(Packet::dial_response(req.random, next_id, ""))
                        .await;
                    let _ = reply.send(Packet::data(next_id, ROGUE.to_vec())).await;
                }
            }
        };
        if let Some(ws) = &self.ws {
            ws.open(md.into_headers(), rx, answer).await?;
            return Ok(RogueStream { out });
        }
        if let Some(quic) = &self.quic {
            quic.open(md.into_headers(), rx, answer).await?;
            return Ok(RogueStream { out });
        }
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        *request.metadata_mut() = md;
        let mut inbound = AgentServiceClient::new(self.channel.clone())
            .connect(request)
            .await?
            .into_inner();
        tokio::spawn(async move {
            while let Ok(Some(packet)) = inbound.message().await {
                answer(packet).await;
            }
        });
        Ok(RogueStream { out })
    }

    /// Opens up to `n` streams; (opened, refusals with their codes).
    pub async fn open_many(
        &self,
        n: usize,
        agent_id: &str,
        identifiers: &str,
        token: Option<&str>,
    ) -> (Vec<RogueStream>, Vec<tonic::Code>) {
        let (mut opened, mut refused) = (Vec::new(), Vec::new());
        for _ in 0..n {
            match self.open(agent_id, identifiers, token).await {
                Ok(s) => opened.push(s),
                Err(status) => refused.push(status.code()),
            }
        }
        (opened, refused)
    }
}

/// How the attacker opens a stream over WebSocket: a TLS connection of its own to the
/// agent port, then the upgrade with its metadata.
struct WsDialer {
    server: std::net::SocketAddr,
    tls: Arc<rustls::ClientConfig>,
}

impl WsDialer {
    /// Opens a stream with `headers`; what `rx` yields goes to the server, and each
    /// packet from it to `answer`. A refusal comes back as the status it carried.
    async fn open<F, Fut>(
        &self,
        headers: http::HeaderMap,
        mut rx: mpsc::Receiver<Packet>,
        answer: F,
    ) -> Result<(), tonic::Status>
    where
        F: Fn(Packet) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        use futures::{SinkExt, StreamExt};
        use tether_core::ws;
        let name = tether_core::tls::server_name("127.0.0.1").expect("a server name");
        let io =
            tether_core::transport::connect_tls(&self.server.to_string(), name, self.tls.clone())
                .await
                .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let authority = self.server.to_string();
        let (socket, _) = ws::client(io, &authority, "/AgentService/Connect", headers)
            .await
            .map_err(|e| match e {
                ws::UpgradeError::Refused {
                    status: Some((code, message)),
                    ..
                } => tonic::Status::new(tonic::Code::from(code), message),
                e => tonic::Status::unavailable(e.to_string()),
            })?;
        let (mut sink, mut source) = socket.split();
        tokio::spawn(async move {
            while let Some(p) = rx.recv().await {
                for m in ws::encode(&p) {
                    if sink.send(m).await.is_err() {
                        return;
                    }
                }
            }
        });
        tokio::spawn(async move {
            while let Some(Ok(m)) = source.next().await {
                if let ws::Message::Binary(data) = m {
                    if let Ok(p) = ws::decode(&data) {
                        answer(p).await;
                    }
                }
            }
        });
        Ok(())
    }
}

/// How the attacker opens a stream over QUIC: a connection of its own to the server's
/// UDP port, then the control stream's head with its metadata.
struct QuicDialer {
    server: std::net::SocketAddr,
    tls: Arc<rustls::ClientConfig>,
}

impl QuicDialer {
    /// Opens a stream with `headers`; what `rx` yields goes to the server (each packet
    /// on its tunnel's stream), and each packet from it to `answer`. A refusal comes
    /// back as the status it carried.
    async fn open<F, Fut>(
        &self,
        headers: http::HeaderMap,
        mut rx: mpsc::Receiver<Packet>,
        answer: F,
    ) -> Result<(), tonic::Status>
    where
        F: Fn(Packet) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        use tether_core::quic;
        let unavailable = |e: String| tonic::Status::unavailable(e);
        let transport =
            quic::transport_config(Duration::from_secs(10), Duration::from_secs(30), false);
        let config = quic::client_config(&self.tls, transport).map_err(unavailable)?;
        let endpoint =
            quic::client_endpoint(self.server).map_err(|e| unavailable(e.to_string()))?;
        let conn = endpoint
            .connect_with(config, self.server, "127.0.0.1")
            .map_err(|e| unavailable(e.to_string()))?
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let (mut send, mut recv) = conn
            .open_bi()
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let head = quic::request_head(&self.server.to_string(), "/AgentService/Connect", &headers);
        send.write_all(&head)
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let (_, rest) = quic::read_answer(&mut recv).await.map_err(|e| match e {
            quic::AnswerError::Refused { code, message } => {
                tonic::Status::new(tonic::Code::from(code), message)
            }
            e => unavailable(e.to_string()),
        })?;
        let reader = quic::PacketReader::new(recv, rest);
        let (mux, mut inbound) = quic::Mux::start(conn, send, reader, tracing::Span::none());
        tokio::spawn(async move {
            let _endpoint = endpoint;
            while let Some(p) = rx.recv().await {
                if !mux.send(&p).await {
                    return;
                }
            }
        });
        tokio::spawn(async move {
            while let Some(Ok(p)) = inbound.recv().await {
                answer(p).await;
            }
        });
        Ok(())
    }
}

/// Node `node`'s real agent: its own certificate `cert` (from [`node_cert`]), and the
/// DaemonSet's identifiers with `ip`.
pub fn certified_agent(
    bin: &Path,
    pki: &Pki,
    server: &ServerProc,
    node: &str,
    ip: &str,
    cert: &(PathBuf, PathBuf),
) -> crate::AgentProc {
    crate::AgentProc::start(
        bin,
        pki,
        server.agent,
        &[
            format!("--agent-id={node}"),
            format!("--agent-identifiers=host={node}&ipv4={ip}"),
            format!("--agent-cert={}", cert.0.display()),
            format!("--agent-key={}", cert.1.display()),
        ],
    )
}

/// Dials `address` through the gRPC frontend, writes "ping" and reads four bytes back:
/// "ping" from the real echo backend, [`ROGUE`] from the attacker.
pub async fn ping(client: &Client, address: &str) -> Vec<u8> {
    let mut conn = client.dial(address).await.expect("dial");
    conn.write_all(b"ping").await.unwrap();
    let mut back = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(20), conn.read_exact(&mut back))
        .await
        .expect("an answer within 20 s")
        .expect("four bytes");
    back.to_vec()
}

/// Opens a tunnel to `victim` (an echo backend another node's agent reaches), then
/// sends, on the rogue's own stream `own`, every kind of packet for connection IDs 1 to
/// `ids` and for the tunnel's own and next IDs: data, window updates, dial and close
/// responses. Asserts that the forgeries were all handled (a dial to `rogue_target`,
/// which `own` answers, comes back after them on the same stream) and that the
/// victim's tunnel still carries exactly its own bytes.
pub async fn forged_packets_reach_no_tunnel(
    client: &Client,
    own: &RogueStream,
    victim: &str,
    rogue_target: &str,
    ids: i64,
) {
    let mut tunnel = client.dial(victim).await.unwrap();
    let connect_id = tunnel.connect_id();
    tunnel.write_all(b"one ").await.unwrap();
    let mut back = [0u8; 4];
    tunnel.read_exact(&mut back).await.unwrap();
    for id in (1..=ids).chain([connect_id, connect_id + 1]) {
        for forged in [
            Packet::data(id, ROGUE.to_vec()),
            Packet::window_update(id, 1 << 30),
            Packet::dial_response(id, id, ""),
            Packet::close_response(id, "forged"),
        ] {
            own.out.send(forged).await.unwrap();
        }
    }
    assert_eq!(ping(client, rogue_target).await, ROGUE);
    tunnel.write_all(b"two!").await.unwrap();
    tunnel.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"two!");
}

/// The deploy manifests' server flags (token authentication, destHost, destCIDR and
/// default, Node watching) with this test's socket, certificate and kubeconfig.
pub fn manifest_server_args(pki: &Pki, kubeconfig: &Path) -> Vec<String> {
    let path = repo().join("deploy/konnectivity-server.yaml");
    let pod: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let args = pod["spec"]["containers"][0]["args"].as_sequence().unwrap();
    let f = &pki.files;
    args.iter()
        .map(|a| {
            let a = a.as_str().unwrap();
            let flag = a.split('=').next().unwrap();
            match flag {
                "--uds-name" => format!("--uds-name={}", socket_path(pki.dir()).display()),
                "--cluster-cert" => format!("--cluster-cert={}", f.server_cert.display()),
                "--cluster-key" => format!("--cluster-key={}", f.server_key.display()),
                "--kubeconfig" => format!("--kubeconfig={}", kubeconfig.display()),
                "--agent-port" | "--admin-port" | "--health-port" => format!("{flag}=0"),
                "--uds-socket-group" => format!("--uds-socket-group={}", own_gid()),
                _ => a.to_string(),
            }
        })
        // The test reads JSON logs, and sets the format itself.
        .filter(|a| !a.starts_with("--log-format"))
        .collect()
}

/// This process's group (the socket's group must exist here).
pub fn own_gid() -> u32 {
    let out = Command::new("id").arg("-g").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

/// The DaemonSet's agent identifiers for a node named `node` at `ip`.
pub fn manifest_agent_identifiers(node: &str, ip: &str) -> String {
    let path = repo().join("deploy/konnectivity-agent.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let flag = text
        .lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix("- --agent-identifiers="))
        .expect("the DaemonSet sets --agent-identifiers");
    flag.replace("$(NODE_NAME)", node).replace("$(HOST_IP)", ip)
}

/// Waits until the server's `/agents` lists agent `id`, verified by its token, with
/// exactly `ips` as verified addresses.
pub async fn wait_verified_ips(server: &ServerProc, id: &str, ips: serde_json::Value) {
    let what = format!("{id} verified with addresses {ips}");
    wait_until(&what, Duration::from_secs(60), || {
        let ips = ips.clone();
        async move {
            let (_, body) = crate::http_get(server.admin, "/agents").await.ok()?;
            let v: serde_json::Value = serde_json::from_str(&body).ok()?;
            let a = v["agents"]
                .as_array()?
                .iter()
                .find(|a| a["id"] == id && a["verifiedBy"] == "serviceaccount-token")?
                .clone();
            (a["verifiedIps"] == ips).then_some(())
        }
    })
    .await;
}

/// The repository's root (manifests live there).
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Raises this process's open-file limit to its hard limit, for tests that hold
/// thousands of sockets themselves (util-linux's `prlimit` on our own pid).
pub fn raise_open_files() {
    let pid = format!("--pid={}", std::process::id());
    let hard = Command::new("prlimit")
        .args([
            pid.as_str(),
            "--nofile",
            "--raw",
            "--noheadings",
            "--output=HARD",
        ])
        .output()
        .expect("prlimit");
    let hard = String::from_utf8_lossy(&hard.stdout).trim().to_string();
    let out = Command::new("prlimit")
        .args([pid, format!("--nofile={hard}:{hard}")])
        .output()
        .expect("prlimit");
    assert!(out.status.success(), "prlimit: {out:?}");
}

/// A flood of clients that finish TLS (no client certificate: where agents use tokens,
/// anyone can) and the HTTP/2 preface on the agent port at `server`, then sit: `per`
/// from each of `sources` addresses in as many /24s (127.10.0.1, 127.11.0.1, ...), each
/// reopened when the server closes it. Counts the connections it completed in `opened`
/// until it is aborted.
pub async fn preface_flood(
    server: std::net::SocketAddr,
    ca: PathBuf,
    sources: u8,
    per: usize,
    opened: Arc<AtomicUsize>,
) {
    let tls = tether_core::tls::client_config(&ca, None, &[b"h2"]).expect("client TLS");
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..sources {
        let source: std::net::SocketAddr =
            format!("127.{}.0.1:0", 10 + u32::from(i)).parse().unwrap();
        for _ in 0..per {
            let (tls, opened) = (tls.clone(), opened.clone());
            tasks.spawn(async move {
                loop {
                    let held = async {
                        let sock = tokio::net::TcpSocket::new_v4().ok()?;
                        sock.bind(source).ok()?;
                        let tcp = sock.connect(server).await.ok()?;
                        let name = tether_core::tls::server_name("127.0.0.1").ok()?;
                        let tls = tokio_rustls::TlsConnector::from(tls.clone())
                            .connect(name, tcp)
                            .await
                            .ok()?;
                        let (_send, conn) = h2::client::handshake(tls).await.ok()?;
                        opened.fetch_add(1, Ordering::Relaxed);
                        let _ = conn.await;
                        Some(())
                    };
                    let _ = held.await;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
        }
    }
    while tasks.join_next().await.is_some() {}
}

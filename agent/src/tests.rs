//! In-process tests of the agent's server set and link: a scripted AgentService over
//! real mutual TLS on 127.0.0.1:0 answers each stream with the next server id of its
//! script, keeps the stream open, and records what the agent sends.

use std::collections::VecDeque;
use std::sync::atomic::AtomicUsize;
use std::sync::Mutex;
use std::time::Duration;

use tether_core::tls::{TlsFiles, TlsPolicy};
use tether_proto::agent_service_server::{AgentService, AgentServiceServer};
use tether_proto::packet::Payload;
use tether_proto::Packet;
use tokio::sync::Notify;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use super::*;
use crate::config::{AgentConfig, AgentTls};

/// What the fake server saw.
#[derive(Default)]
struct Seen {
    /// Streams opened.
    connects: AtomicUsize,
    /// DRAIN packets received.
    drains: AtomicUsize,
    /// DIAL_RSPs received: (random, connectID, error).
    dial_responses: Mutex<Vec<(i64, i64, String)>>,
    /// Streams the agent ended.
    ended: AtomicUsize,
    changed: Notify,
}

struct FakeServer {
    held_out: Arc<Held>,
    ids: Mutex<VecDeque<&'static str>>,
    count: i64,
    seen: Arc<Seen>,
}

/// The open streams' senders: a stream stays up while its sender is held.
type Held = Mutex<Vec<tokio::sync::mpsc::Sender<Result<Packet, tonic::Status>>>>;

#[tonic::async_trait]
impl AgentService for FakeServer {
    type ConnectStream = ReceiverStream<Result<Packet, tonic::Status>>;

    async fn connect(
        &self,
        request: tonic::Request<tonic::Streaming<Packet>>,
    ) -> Result<tonic::Response<Self::ConnectStream>, tonic::Status> {
        let id = self.ids.lock().unwrap().pop_front().unwrap_or("spare");
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        self.held_out.lock().unwrap().push(tx);
        let seen = self.seen.clone();
        let mut inbound = request.into_inner();
        tokio::spawn(async move {
            while let Some(Ok(p)) = inbound.next().await {
                match p.payload {
                    Some(Payload::Drain(_)) => {
                        seen.drains.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(Payload::DialResponse(r)) => {
                        let mut rsps = seen.dial_responses.lock().unwrap();
                        rsps.push((r.random, r.connect_id, r.error));
                    }
                    _ => {}
                }
                seen.changed.notify_waiters();
            }
            seen.ended.fetch_add(1, Ordering::Relaxed);
            seen.changed.notify_waiters();
        });
        let mut response = tonic::Response::new(ReceiverStream::new(rx));
        let md = response.metadata_mut();
        md.insert(tether_proto::header::SERVER_ID, id.parse().unwrap());
        md.insert(
            tether_proto::header::SERVER_COUNT,
            self.count.to_string().parse().unwrap(),
        );
        self.seen.connects.fetch_add(1, Ordering::Relaxed);
        self.seen.changed.notify_waiters();
        Ok(response)
    }
}

/// A fake server at 127.0.0.1:port answering with `ids` in turn, and an agent whose
/// reconnect delay is an hour: whatever it reaches, it reaches by retrying at once.
struct Pair {
    agent: Agent,
    seen: Arc<Seen>,
    held: Arc<Held>,
    hard_stop: CancellationToken,
    dir: std::path::PathBuf,
}

impl Pair {
    async fn start(ids: &[&'static str], count: i64) -> Pair {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("tether-agent-test-{}-{n}", std::process::id()));
        let pki = tether_certs::DevPki::generate(&dir).unwrap();
        let files = TlsFiles {
            cert: pki.server_cert.clone(),
            key: pki.server_key.clone(),
            ca: Some(pki.ca_cert.clone()),
            policy: TlsPolicy::default(),
        };
        let server_tls = tether_core::tls::server_config(&files, &[b"h2"]).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let hard_stop = CancellationToken::new();
        let seen = Arc::new(Seen::default());
        let held = Arc::new(Held::default());
        let fake = FakeServer {
            held_out: held.clone(),
            ids: Mutex::new(ids.iter().copied().collect()),
            count,
            seen: seen.clone(),
        };
        let incoming = tether_core::transport::tls_incoming(
            listener,
            Arc::new(move || server_tls.clone()),
            "fake-agent-listener",
            hard_stop.clone(),
        );
        tokio::spawn(
            tether_core::transport::h2_server()
                .add_service(AgentServiceServer::new(fake))
                .serve_with_incoming_shutdown(
                    ReceiverStream::new(incoming).map(Ok::<_, std::io::Error>),
                    hard_stop.clone().cancelled_owned(),
                ),
        );
        let agent = Agent::new(AgentConfig {
            servers: vec![("127.0.0.1".into(), port)],
            sync_forever: false,
            lease_count: None,
            count_source: Default::default(),
            tls: AgentTls {
                ca: pki.ca_cert.clone(),
                identity: Some((pki.agent_cert.clone(), pki.agent_key.clone())),
                alpn: vec![b"h2".to_vec()],
            },
            cert_reload_interval: Duration::from_secs(3600),
            agent_id: "agent-test".into(),
            identifiers: String::new(),
            token_path: None,
            sync_interval: Duration::from_secs(3600),
            sync_interval_cap: Duration::from_secs(3600),
            keepalive: Duration::from_secs(3600),
            dead_link: Some(Duration::from_secs(30)),
            dial_timeout: Duration::from_secs(5),
            channel_size: 16,
            flow_control: true,
            stall_timeout: Duration::from_secs(5),
            profiling: false,
            egress: Default::default(),
            policy: crate::policy::PolicyConfig {
                any: true,
                ..Default::default()
            },
            ready_with_every_server: false,
            transports: vec![crate::Transport::H2],
            quic_port: None,
        })
        .unwrap();
        Pair {
            agent,
            seen,
            held,
            hard_stop,
            dir,
        }
    }

    /// Waits (10 s at most) until `done` holds of what the server saw and the agent.
    async fn wait(&self, what: &str, done: impl Fn(&Seen, &Agent) -> bool) {
        let waited = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let changed = self.seen.changed.notified();
                if done(&self.seen, &self.agent) {
                    return;
                }
                // The agent counts a stream a moment after the server sent its headers.
                tokio::select! {
                    _ = changed => {}
                    _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            }
        })
        .await;
        assert!(waited.is_ok(), "timed out waiting until {what}");
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        self.hard_stop.cancel();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn streams(agent: &Agent) -> i64 {
    agent.streams.load(Ordering::Relaxed)
}

#[tokio::test]
async fn a_duplicate_server_is_closed_and_the_next_dial_made_at_once() {
    // A balancer that sends the second dial to the server already held.
    let pair = Pair::start(&["s1", "s1", "s2"], 2).await;
    let (drain, hard_stop) = (CancellationToken::new(), CancellationToken::new());
    let agent = pair.agent.clone();
    let run = tokio::spawn({
        let (drain, hard_stop) = (drain.clone(), hard_stop.clone());
        async move { agent.run(drain, hard_stop).await }
    });
    pair.wait("two streams are up", |_, a| streams(a) == 2)
        .await;
    assert_eq!(pair.seen.connects.load(Ordering::Relaxed), 3);
    assert_eq!(pair.agent.metrics.known_server_count.get(), 2);
    hard_stop.cancel();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("run returns after hard_stop")
        .unwrap();
}

#[tokio::test]
async fn drain_announces_itself_on_every_stream_and_serves_until_the_hard_stop() {
    let pair = Pair::start(&["s1", "s2"], 2).await;
    let (drain, hard_stop) = (CancellationToken::new(), CancellationToken::new());
    let agent = pair.agent.clone();
    let mut run = tokio::spawn({
        let (drain, hard_stop) = (drain.clone(), hard_stop.clone());
        async move { agent.run(drain, hard_stop).await }
    });
    pair.wait("two streams are up", |_, a| streams(a) == 2)
        .await;
    // One connection through the first stream to a target here.
    let target = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = target.local_addr().unwrap().to_string();
    let first = pair.held.lock().unwrap()[0].clone();
    first
        .send(Ok(Packet::dial_request("tcp", &address, 42)))
        .await
        .unwrap();
    let (conn, _) = target.accept().await.unwrap();
    pair.wait("the dial is answered", |s, _| {
        !s.dial_responses.lock().unwrap().is_empty()
    })
    .await;
    let (random, connect_id, error) = pair.seen.dial_responses.lock().unwrap()[0].clone();
    assert_eq!((random, error.as_str()), (42, ""));
    assert!(connect_id > 0);

    drain.cancel();
    pair.wait("both streams sent DRAIN", |s, _| {
        s.drains.load(Ordering::Relaxed) == 2
    })
    .await;
    // Draining, the agent keeps its streams while a connection is open...
    assert!(
        tokio::time::timeout(Duration::from_millis(200), &mut run)
            .await
            .is_err(),
        "run returned with a connection open"
    );
    assert_eq!(pair.seen.ended.load(Ordering::Relaxed), 0);
    // ...and after it closes, as upstream's agent until its second signal: a new dial
    // is still served (the server sends one when no other agent can take it).
    drop(conn);
    first
        .send(Ok(Packet::dial_request("tcp", &address, 43)))
        .await
        .unwrap();
    let (_conn, _) = target.accept().await.unwrap();
    pair.wait("the dial while draining is answered", |s, _| {
        s.dial_responses.lock().unwrap().len() == 2
    })
    .await;
    assert_eq!(pair.seen.ended.load(Ordering::Relaxed), 0);
    assert!(!run.is_finished(), "run returned while draining");
    // The hard stop (second signal or --drain-timeout) ends it.
    hard_stop.cancel();
    tokio::time::timeout(Duration::from_secs(10), run)
        .await
        .expect("run returns at the hard stop")
        .unwrap();
    pair.wait("both streams ended", |s, _| {
        s.ended.load(Ordering::Relaxed) == 2
    })
    .await;
    assert_eq!(pair.seen.connects.load(Ordering::Relaxed), 2);
}

#[test]
fn ready_with_one_server_or_with_every_known_one() {
    use crate::readiness;
    assert!(readiness(0, 2, false).is_err());
    assert!(readiness(1, 2, false).is_ok());
    let short = readiness(1, 2, true).unwrap_err();
    assert!(short.contains("1 of 2"), "{short}");
    assert!(readiness(2, 2, true).is_ok());
    // A count not known yet (0) asks for one.
    assert!(readiness(1, 0, true).is_ok());
    assert_eq!(
        readiness(0, 0, true).unwrap_err(),
        "not connected to any proxy server"
    );
}

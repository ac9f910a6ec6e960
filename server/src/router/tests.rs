//! The router in process: fake agent and frontend streams over channels, the way
//! quinn tests its protocol as an in-memory pair. Every race the real processes can
//! only stumble on (redispatch, connectID collisions, a frontend leaving mid-dial, an
//! agent overrunning its window) is driven here step by step.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tether_core::identifiers::AgentIdentifiers;
use tether_proto::{packet::Payload, DialRequest, Packet};
use tokio::sync::mpsc;

use super::*;

/// A wait that only a bug makes long.
const PATIENCE: Duration = Duration::from_secs(5);

fn config(strategies: &str, backend_dial_timeout: Option<Duration>) -> RouterConfig {
    RouterConfig {
        strategies: parse_strategies(strategies).unwrap(),
        backend_dial_timeout,
        flow_control: true,
        stall_timeout: Duration::from_secs(30),
        // These tests are about routing mechanics; verification is select's.
        trust_claims: true,
        max_agent_streams: 0,
        agent_wait: Duration::ZERO,
    }
}

fn router(strategies: &str, backend_dial_timeout: Option<Duration>) -> Arc<Router> {
    Router::new(config(strategies, backend_dial_timeout), Metrics::new())
}

/// An agent stream whose packets the test reads.
struct FakeAgent {
    stream: Arc<AgentStream>,
    rx: mpsc::Receiver<Packet>,
    ctl: tether_core::queue::Receiver<Packet>,
}

impl FakeAgent {
    fn join(router: &Router, id: &str, identifiers: &str, window: Option<u32>) -> Self {
        Self::join_asking(router, id, identifiers, window, false)
    }

    /// An agent that asked to hear DRAIN (`drain_notice`, a Tether agent) or not.
    fn join_asking(
        router: &Router,
        id: &str,
        identifiers: &str,
        window: Option<u32>,
        drain_notice: bool,
    ) -> Self {
        let (tx, rx) = mpsc::channel(64);
        let (ctl_tx, ctl) = tether_core::queue::queue();
        let stream = AgentStream::new(
            id.into(),
            AgentIdentifiers::parse(identifiers, true).unwrap(),
            Verified::default(),
            tx,
            ctl_tx,
            window,
        );
        let stream = Arc::new(match drain_notice {
            true => stream.hearing_drain(),
            false => stream,
        });
        router.add_agent(stream.clone()).unwrap();
        FakeAgent { stream, rx, ctl }
    }

    /// The DRAINs queued to the agent so far.
    fn drains_heard(&self) -> usize {
        std::iter::from_fn(|| self.ctl.try_recv())
            .filter(|p| matches!(p.payload, Some(Payload::Drain(_))))
            .count()
    }

    async fn next(&mut self) -> Payload {
        let p = tokio::time::timeout(PATIENCE, self.rx.recv()).await;
        p.expect("a packet for the agent").unwrap().payload.unwrap()
    }

    fn nothing(&mut self) {
        assert!(self.rx.try_recv().is_err(), "the agent got a packet");
    }

    async fn dial_request(&mut self) -> DialRequest {
        match self.next().await {
            Payload::DialRequest(r) => r,
            other => panic!("expected DIAL_REQ, got {other:?}"),
        }
    }

    async fn send(&self, router: &Router, packet: Packet) {
        router.on_agent_packet(&self.stream, packet).await
    }
}

/// A frontend stream whose client-bound packets the test reads.
struct FakeFrontend {
    fe: Arc<FrontendStream>,
    out: Pin<Box<dyn Stream<Item = Packet> + Send>>,
}

impl FakeFrontend {
    fn open() -> Self {
        let (tx, rx) = tether_core::queue::queue();
        FakeFrontend {
            fe: FrontendStream::new(tx),
            out: Box::pin(outbox(rx)),
        }
    }

    async fn next(&mut self) -> Payload {
        let p = tokio::time::timeout(PATIENCE, self.out.next()).await;
        p.expect("a packet for the client")
            .unwrap()
            .payload
            .unwrap()
    }

    async fn dial(&self, router: &Arc<Router>, address: &str, random: i64) {
        let req = DialRequest {
            protocol: "tcp".into(),
            address: address.into(),
            random,
        };
        router.dial(&self.fe, req).await.unwrap();
    }

    /// The DIAL_RSP for a dial: the connectID, or the error.
    async fn dial_response(&mut self) -> Result<i64, String> {
        match self.next().await {
            Payload::DialResponse(r) if r.error.is_empty() => Ok(r.connect_id),
            Payload::DialResponse(r) => Err(r.error),
            other => panic!("expected DIAL_RSP, got {other:?}"),
        }
    }
}

/// Dials through `agent` and has it answer with `connect_id`.
async fn establish(
    router: &Arc<Router>,
    fe: &mut FakeFrontend,
    agent: &mut FakeAgent,
    connect_id: i64,
) {
    fe.dial(router, "target:80", tether_core::random_id()).await;
    let req = agent.dial_request().await;
    agent
        .send(router, Packet::dial_response(req.random, connect_id, ""))
        .await;
    assert_eq!(fe.dial_response().await, Ok(connect_id));
}

#[tokio::test]
async fn dial_data_and_close_round_trip_and_leave_nothing_open() {
    let router = router("default", None);
    let mut agent = FakeAgent::join(&router, "a", "", None);
    let mut fe = FakeFrontend::open();
    establish(&router, &mut fe, &mut agent, 7).await;
    assert_eq!(
        router.work().open(),
        1,
        "the connection holds a drain watch"
    );

    assert!(
        router
            .send_data(&fe.fe, Packet::data(7, &b"ping"[..]))
            .await
    );
    assert!(matches!(agent.next().await, Payload::Data(d) if &d.data[..] == b"ping"));
    agent.send(&router, Packet::data(7, &b"pong"[..])).await;
    assert!(matches!(fe.next().await, Payload::Data(d) if &d.data[..] == b"pong"));

    router.close(&fe.fe, 7).await;
    assert!(matches!(agent.next().await, Payload::CloseRequest(c) if c.connect_id == 7));
    agent.send(&router, Packet::close_response(7, "")).await;
    assert!(matches!(fe.next().await, Payload::CloseResponse(c) if c.connect_id == 7));
    assert_eq!(router.work().open(), 0);
    assert_eq!(router.metrics.established_connections.get(), 0);
    assert_eq!(router.metrics.pending_backend_dials.get(), 0);
    assert!(fe.fe.route(7).is_none());
}

#[tokio::test]
async fn with_no_agent_the_dial_is_refused_and_nothing_is_pending() {
    let router = router("destHost", None);
    let _elsewhere = FakeAgent::join(&router, "a", "host=node-a", None);
    let fe = FakeFrontend::open();
    let req = DialRequest {
        protocol: "tcp".into(),
        address: "node-b:10250".into(),
        random: 1,
    };
    assert!(matches!(
        router.dial(&fe.fe, req).await,
        Err(DialError::NoAgent)
    ));
    assert_eq!(router.work().open(), 0);
}

#[tokio::test]
async fn a_dial_whose_agent_leaves_unanswered_goes_to_another() {
    let router = router("default", None);
    let mut first = FakeAgent::join(&router, "a", "", None);
    let mut fe = FakeFrontend::open();
    fe.dial(&router, "target:80", 42).await;
    assert_eq!(first.dial_request().await.random, 42);
    let mut second = FakeAgent::join(&router, "b", "", None);
    router.remove_agent(&first.stream);
    assert_eq!(second.dial_request().await.random, 42, "re-dispatched");
    second.send(&router, Packet::dial_response(42, 3, "")).await;
    assert_eq!(fe.dial_response().await, Ok(3));
    first.nothing();
}

#[tokio::test]
async fn a_dial_with_no_agent_left_fails_at_once() {
    let router = router("default", None);
    let mut agent = FakeAgent::join(&router, "a", "", None);
    let mut fe = FakeFrontend::open();
    fe.dial(&router, "target:80", 42).await;
    agent.dial_request().await;
    router.remove_agent(&agent.stream);
    let err = fe.dial_response().await.unwrap_err();
    assert!(err.contains("agent a disconnected"), "{err}");
    assert_eq!(router.work().open(), 0);
}

#[tokio::test]
async fn an_agent_leaving_closes_its_connections_for_the_client() {
    let router = router("default", None);
    let mut agent = FakeAgent::join(&router, "a", "", None);
    let mut fe = FakeFrontend::open();
    establish(&router, &mut fe, &mut agent, 5).await;
    router.remove_agent(&agent.stream);
    match fe.next().await {
        Payload::CloseResponse(c) => assert!(c.connect_id == 5 && c.error.contains("disconnected")),
        other => panic!("{other:?}"),
    }
    assert_eq!(router.work().open(), 0);
    assert_eq!(router.metrics.ready_backend_connections.get(), 0);
}

#[tokio::test]
async fn a_connect_id_already_used_on_the_frontend_stream_is_refused() {
    let router = router("destHost", None);
    let mut a = FakeAgent::join(&router, "a", "host=node-a", None);
    let mut b = FakeAgent::join(&router, "b", "host=node-b", None);
    let mut fe = FakeFrontend::open();
    fe.dial(&router, "node-a:80", 1).await;
    fe.dial(&router, "node-b:80", 2).await;
    a.dial_request().await;
    b.dial_request().await;
    a.send(&router, Packet::dial_response(1, 9, "")).await;
    assert_eq!(fe.dial_response().await, Ok(9));
    b.send(&router, Packet::dial_response(2, 9, "")).await;
    let err = fe.dial_response().await.unwrap_err();
    assert!(err.contains("collision"), "{err}");
    assert!(matches!(b.next().await, Payload::CloseRequest(c) if c.connect_id == 9));
    // The first connection is untouched.
    assert!(router.send_data(&fe.fe, Packet::data(9, &b"x"[..])).await);
    assert!(matches!(a.next().await, Payload::Data(_)));
    assert_eq!(router.work().open(), 1);
}

#[tokio::test]
async fn a_frontend_leaving_cancels_its_dials_and_closes_its_connections() {
    let router = router("default", None);
    let mut agent = FakeAgent::join(&router, "a", "", None);
    let mut fe = FakeFrontend::open();
    establish(&router, &mut fe, &mut agent, 4).await;
    fe.dial(&router, "target:81", 77).await;
    agent.dial_request().await;

    router.frontend_gone(&fe.fe).await;
    let mut seen = [agent.next().await, agent.next().await];
    seen.sort_by_key(|p| matches!(p, Payload::CloseRequest(_)));
    assert!(matches!(&seen[0], Payload::CloseDial(c) if c.random == 77));
    assert!(matches!(&seen[1], Payload::CloseRequest(c) if c.connect_id == 4));
    assert_eq!(router.work().open(), 0);

    // The agent's answer crossed the DIAL_CLS: the connection it opened is closed.
    agent.send(&router, Packet::dial_response(77, 8, "")).await;
    assert!(matches!(agent.next().await, Payload::CloseRequest(c) if c.connect_id == 8));
    // DATA already in flight for the closed connection is dropped.
    agent.send(&router, Packet::data(4, &b"late"[..])).await;
    agent.nothing();
}

#[tokio::test]
async fn data_for_an_unknown_connection_gets_a_close() {
    let router = router("default", None);
    let mut fe = FakeFrontend::open();
    assert!(!router.send_data(&fe.fe, Packet::data(99, &b"x"[..])).await);
    assert!(
        matches!(fe.next().await, Payload::CloseResponse(c) if c.error == "unknown connectID 99")
    );
    router.close(&fe.fe, 98).await;
    assert!(matches!(fe.next().await, Payload::CloseResponse(c) if c.connect_id == 98));
}

#[tokio::test]
async fn credit_holds_frontend_data_until_the_agent_returns_it() {
    let router = router("default", None);
    let mut agent = FakeAgent::join(&router, "a", "", Some(64 << 10));
    let mut fe = FakeFrontend::open();
    establish(&router, &mut fe, &mut agent, 1).await;
    assert!(
        router
            .send_data(&fe.fe, Packet::data(1, vec![0u8; 64 << 10]))
            .await
    );
    agent.next().await;
    let held = {
        let (router, fe) = (router.clone(), fe.fe.clone());
        tokio::spawn(async move { router.send_data(&fe, Packet::data(1, &b"more"[..])).await })
    };
    tokio::task::yield_now().await;
    agent.nothing();
    assert!(!held.is_finished(), "no credit left");
    agent
        .send(&router, Packet::window_update(1, 16 << 10))
        .await;
    assert!(held.await.unwrap());
    assert!(matches!(agent.next().await, Payload::Data(d) if &d.data[..] == b"more"));
}

#[tokio::test]
async fn the_client_taking_data_returns_credit_to_the_agent() {
    let router = router("default", None);
    let mut agent = FakeAgent::join(&router, "a", "", Some(64 << 10));
    let mut fe = FakeFrontend::open();
    establish(&router, &mut fe, &mut agent, 1).await;
    let quarter = (tether_core::flow::DEFAULT_WINDOW / 4) as usize;
    agent
        .send(&router, Packet::data(1, vec![1u8; quarter]))
        .await;
    assert!(agent.ctl.try_recv().is_none(), "nothing taken yet");
    fe.next().await;
    match agent.ctl.try_recv().unwrap().payload {
        Some(Payload::WindowUpdate(w)) => assert_eq!((w.connect_id, w.bytes), (1, quarter as i64)),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn an_agent_overrunning_its_window_loses_that_connection_only() {
    let router = router("default", None);
    let mut agent = FakeAgent::join(&router, "a", "", Some(64 << 10));
    let mut fe = FakeFrontend::open();
    establish(&router, &mut fe, &mut agent, 1).await;
    establish(&router, &mut fe, &mut agent, 2).await;
    let too_much = 2 * tether_core::flow::DEFAULT_WINDOW as usize + 1;
    agent
        .send(&router, Packet::data(1, vec![0u8; too_much]))
        .await;
    match fe.next().await {
        Payload::CloseResponse(c) => {
            assert!(c.connect_id == 1 && c.error.contains("flow-control window"))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(agent.next().await, Payload::CloseRequest(c) if c.connect_id == 1));
    agent.send(&router, Packet::data(2, &b"fine"[..])).await;
    assert!(matches!(fe.next().await, Payload::Data(d) if d.connect_id == 2));
}

#[tokio::test(start_paused = true)]
async fn an_unanswered_dial_fails_after_the_backend_dial_timeout() {
    let router = router("default", Some(Duration::from_secs(2)));
    let mut agent = FakeAgent::join(&router, "a", "", None);
    let mut fe = FakeFrontend::open();
    fe.dial(&router, "target:80", 5).await;
    agent.dial_request().await;
    let err = fe.dial_response().await.unwrap_err();
    assert!(err.contains("did not answer in time"), "{err}");
    assert!(matches!(agent.next().await, Payload::CloseDial(c) if c.random == 5));
    assert_eq!(router.work().open(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_stream_that_takes_no_dial_request_is_retired() {
    let router = router("default", Some(Duration::from_secs(2)));
    let (tx, _rx) = mpsc::channel(1);
    let (ctl, _ctl_rx) = tether_core::queue::queue();
    let stuck = Arc::new(AgentStream::new(
        "stuck".into(),
        AgentIdentifiers::default(),
        Verified::default(),
        tx.clone(),
        ctl,
        None,
    ));
    router.add_agent(stuck.clone()).unwrap();
    tx.try_send(Packet::drain()).unwrap(); // the stream's one slot is taken
    let mut fe = FakeFrontend::open();
    fe.dial(&router, "target:80", 5).await;
    let err = fe.dial_response().await.unwrap_err();
    assert!(err.contains("did not accept the dial request"), "{err}");
    assert!(stuck.is_closed(), "retired");
}

/// Data flows one way: the tables know nothing of the operations, selection only of
/// the tables, and the router nothing of frontends or agent links.
#[test]
fn no_import_circle() {
    let uses = |src: &str| -> Vec<String> {
        src.lines()
            .map(str::trim)
            .filter(|l| l.starts_with("use ") && !l.starts_with("use super::*"))
            .map(String::from)
            .collect()
    };
    let state = uses(include_str!("state.rs"));
    assert!(
        state
            .iter()
            .all(|l| !l.contains("super::") && !l.contains("crate::")),
        "{state:?}"
    );
    let select = uses(include_str!("select.rs"));
    assert!(
        select
            .iter()
            .all(|l| !l.contains("super::") || l.starts_with("use super::state::")),
        "{select:?}"
    );
    for src in [
        include_str!("mod.rs"),
        include_str!("state.rs"),
        include_str!("select.rs"),
    ] {
        for l in uses(src) {
            assert!(
                !l.contains("frontend") && !l.contains("agent_link"),
                "the router reaches up: {l}"
            );
        }
    }
}

/// Every way a tunnel ends, and a policy refusal, leave a record with its reason and
/// the bytes each way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_end_is_recorded_with_its_reason() {
    let path = std::env::temp_dir().join(format!(
        "tether-router-audit-{}-{}",
        std::process::id(),
        tether_core::random_id()
    ));
    let audit_config = tether_ops::audit::AuditConfig {
        path: Some(path.clone()),
        max_size: 1 << 20,
        max_backups: 1,
    };
    let metrics = Metrics::new();
    let audit = Audit::open(&audit_config, metrics.audit.clone(), "audit-test").unwrap();
    let router = Router::with_audit(config("default", None), metrics, audit);
    let mut agent = FakeAgent::join(&router, "a", "", None);
    let mut fe = FakeFrontend::open();

    // 1: the client closes, after 10 bytes up and 7 down.
    establish(&router, &mut fe, &mut agent, 1).await;
    let up = Packet::data(1, bytes::Bytes::from_static(b"0123456789"));
    assert!(router.send_data(&fe.fe, up).await);
    assert!(matches!(agent.next().await, Payload::Data(_)));
    let down = Packet::data(1, bytes::Bytes::from_static(b"abcdefg"));
    agent.send(&router, down).await;
    assert!(matches!(fe.next().await, Payload::Data(_)));
    router.close(&fe.fe, 1).await;
    assert!(matches!(agent.next().await, Payload::CloseRequest(_)));
    agent.send(&router, Packet::close_response(1, "")).await;
    assert!(matches!(fe.next().await, Payload::CloseResponse(_)));
    // 2: the target fails at the agent.
    establish(&router, &mut fe, &mut agent, 2).await;
    let reset = Packet::close_response(2, "connection reset by peer");
    agent.send(&router, reset).await;
    assert!(matches!(fe.next().await, Payload::CloseResponse(_)));
    // 3: the target closes.
    establish(&router, &mut fe, &mut agent, 3).await;
    agent.send(&router, Packet::close_response(3, "")).await;
    assert!(matches!(fe.next().await, Payload::CloseResponse(_)));
    // The agent's dial policy refuses.
    fe.dial(&router, "10.1.2.3:22", 99).await;
    let req = agent.dial_request().await;
    let refusal = format!("{} 10.1.2.3:22 is not on this node", audit::POLICY_PREFIX);
    let rsp = Packet::dial_response(req.random, 0, refusal);
    agent.send(&router, rsp).await;
    assert!(fe.dial_response().await.is_err());
    // 4: the frontend stream goes away.
    let mut other = FakeFrontend::open();
    establish(&router, &mut other, &mut agent, 4).await;
    router.frontend_gone(&other.fe).await;
    assert!(matches!(agent.next().await, Payload::CloseRequest(_)));
    // 5: the agent's stream goes away.
    establish(&router, &mut fe, &mut agent, 5).await;
    router.remove_agent(&agent.stream);

    assert!(router.audit().sync(PATIENCE));
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    std::fs::remove_file(&path).unwrap();
    let seen: Vec<(String, String, Option<i64>)> = lines
        .iter()
        .map(|r| {
            let s = |k: &str| r[k].as_str().unwrap().to_string();
            (s("event"), s("reason"), r["connect_id"].as_i64())
        })
        .collect();
    let want = [
        ("tunnel", "client", Some(1)),
        ("tunnel", "backend_error", Some(2)),
        ("tunnel", "agent", Some(3)),
        ("refused", "policy", None),
        ("tunnel", "client", Some(4)),
        ("tunnel", "agent", Some(5)),
    ];
    let want: Vec<(String, String, Option<i64>)> = want
        .iter()
        .map(|(e, r, c)| (e.to_string(), r.to_string(), *c))
        .collect();
    assert_eq!(seen, want);
    assert_eq!(lines[0]["bytes_to_agent"], 10);
    assert_eq!(lines[0]["bytes_from_agent"], 7);
    assert_eq!(lines[0]["agent"]["id"], "a");
    assert_eq!(lines[0]["strategy"], "default");
    assert_eq!(lines[1]["error"], "connection reset by peer");
    assert_eq!(lines[3]["random"], 99);
    assert_eq!(lines[5]["error"], "agent a disconnected");
}

fn waiting_router(wait: Duration) -> Arc<Router> {
    let config = RouterConfig {
        agent_wait: wait,
        ..config("default", None)
    };
    Router::new(config, Metrics::new())
}

/// `--wait-for-agent`: a dial made before any agent is connected goes to the first that
/// arrives, and the frontend's other traffic is not held up meanwhile.
#[tokio::test]
async fn a_dial_waits_for_an_agent_to_arrive() {
    let router = waiting_router(Duration::from_secs(30));
    let mut fe = FakeFrontend::open();
    fe.dial(&router, "target:80", 7).await;
    // The dial returned at once: the frontend stream reads on while it waits.
    let p = tokio::time::timeout(Duration::from_millis(100), fe.out.next()).await;
    assert!(p.is_err(), "nothing is answered before an agent comes");
    let mut agent = FakeAgent::join(&router, "late", "", None);
    let req = agent.dial_request().await;
    assert_eq!(req.random, 7);
    agent.send(&router, Packet::dial_response(7, 3, "")).await;
    assert_eq!(fe.dial_response().await, Ok(3));
    let waited = router.metrics.dials_waited.with_label_values(&["arrived"]);
    assert_eq!(waited.get(), 1);
}

/// When no agent comes within the wait, the dial fails as upstream's would.
#[tokio::test]
async fn a_dial_that_waited_in_vain_fails_with_no_agent() {
    let router = waiting_router(Duration::from_millis(300));
    let mut fe = FakeFrontend::open();
    let started = Instant::now();
    fe.dial(&router, "target:80", 8).await;
    assert_eq!(fe.dial_response().await, Err(NO_AGENT.to_string()));
    assert!(started.elapsed() >= Duration::from_millis(300));
    let gave_up = router.metrics.dials_waited.with_label_values(&["gave_up"]);
    assert_eq!(gave_up.get(), 1);
    assert_eq!(router.work().open(), 0);
    // An address no agent may ever take is refused at once, without waiting.
    let bad = DialRequest {
        protocol: "tcp".into(),
        address: "no-port".into(),
        random: 9,
    };
    assert!(matches!(
        router.dial(&fe.fe, bad).await,
        Err(DialError::BadAddress(_))
    ));
}

/// A dial the client cancels (DIAL_CLS) while it waits for an agent never reaches the
/// agent that arrives later.
#[tokio::test]
async fn a_dial_cancelled_while_waiting_goes_to_no_agent() {
    let router = waiting_router(Duration::from_secs(30));
    let mut fe = FakeFrontend::open();
    fe.dial(&router, "target:80", 11).await;
    router.cancel(&fe.fe, 11).await;
    let mut agent = FakeAgent::join(&router, "late", "", None);
    // A second dial, made after the agent came, is the first packet it gets.
    fe.dial(&router, "target:80", 12).await;
    assert_eq!(agent.dial_request().await.random, 12);
    agent.nothing();
    until_one_dial_is_open(&router).await;
    let p = tokio::time::timeout(Duration::from_millis(100), fe.out.next()).await;
    assert!(p.is_err(), "the cancelled dial is not answered");
}

/// Until nothing waits: the cancelled dial's task has ended.
async fn until_one_dial_is_open(router: &Router) {
    let deadline = Instant::now() + PATIENCE;
    while router.work().open() > 1 {
        assert!(Instant::now() < deadline, "a waiting dial never ended");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The server's drain: each agent that asked hears DRAIN once, ahead of its DATA, and
/// so does one that connects while the server drains; an upstream agent (which did not
/// ask) hears nothing, and tunnels go on.
#[tokio::test]
async fn a_draining_server_tells_the_agents_that_asked() {
    let router = router("default", None);
    let mut tether = FakeAgent::join_asking(&router, "tether", "", Some(1 << 20), true);
    let mut fe = FakeFrontend::open();
    establish(&router, &mut fe, &mut tether, 1).await;
    let upstream = FakeAgent::join(&router, "upstream", "", None);

    assert_eq!(router.drain_agents(), 1, "one agent asked");
    assert_eq!(router.drain_agents(), 1, "told once, counted again");
    assert_eq!(tether.drains_heard(), 1);
    assert_eq!(upstream.drains_heard(), 0);
    let late = FakeAgent::join_asking(&router, "late", "", None, true);
    assert_eq!(late.drains_heard(), 1, "an agent joining a draining server");
    assert!(tether.stream.told_drain() && !upstream.stream.told_drain());

    // The tunnel the told agent carries goes on.
    assert!(router.send_data(&fe.fe, Packet::data(1, &b"on"[..])).await);
    assert!(matches!(tether.next().await, Payload::Data(d) if &d.data[..] == b"on"));
}

/// The graceful shutdown ran out: the tunnel still open is closed from the server's
/// side (its client gets CLOSE_RSP with the reason, the agent CLOSE_REQ), and a dial
/// still pending fails, so each client ends its tunnel instead of finding it cut.
#[tokio::test]
async fn the_end_of_a_graceful_shutdown_closes_what_is_left() {
    let router = router("default", None);
    let mut agent = FakeAgent::join(&router, "a", "", None);
    let mut fe = FakeFrontend::open();
    establish(&router, &mut fe, &mut agent, 4).await;
    fe.dial(&router, "target:80", 9).await;
    assert_eq!(agent.dial_request().await.random, 9);

    assert_eq!(router.end_all(), 2, "a connection and a dial");
    let mut seen = (false, false);
    for _ in 0..2 {
        match fe.next().await {
            Payload::CloseResponse(c) => {
                assert_eq!((c.connect_id, c.error.as_str()), (4, SHUTTING_DOWN));
                seen.0 = true;
            }
            Payload::DialResponse(r) => {
                assert_eq!((r.random, r.error.as_str()), (9, SHUTTING_DOWN));
                seen.1 = true;
            }
            other => panic!("expected CLOSE_RSP and DIAL_RSP, got {other:?}"),
        }
    }
    assert_eq!(seen, (true, true));
    let told: Vec<Payload> = std::iter::from_fn(|| agent.ctl.try_recv())
        .filter_map(|p| p.payload)
        .collect();
    assert!(
        told.iter()
            .any(|p| matches!(p, Payload::CloseRequest(c) if c.connect_id == 4))
            && told
                .iter()
                .any(|p| matches!(p, Payload::CloseDial(c) if c.random == 9)),
        "the agent is told to close the connection and drop the dial: {told:?}"
    );
    assert_eq!(router.end_all(), 0, "nothing left");
    assert_eq!(router.work().open(), 0);
    // A dial made now is refused, not left to the hard stop.
    let req = DialRequest {
        protocol: "tcp".into(),
        address: "target:80".into(),
        random: 10,
    };
    assert!(matches!(
        router.dial(&fe.fe, req).await,
        Err(DialError::ShuttingDown)
    ));
    agent.nothing();
}

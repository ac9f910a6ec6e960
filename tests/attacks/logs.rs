//! Item 9: the default `text` log format quotes what peers send. An agent ID with a
//! space and `key=value` inside stays one quoted value: it cannot forge the `peer` or
//! `verified_by` fields an operator greps for, nor end the line.

use std::time::Duration;

use tether_testkit::kube::free_port;
use tether_testkit::process::{socket_path, uds_frontend_args};
use tether_testkit::rogue::Rogue;
use tether_testkit::{wait_until, Pki, Proc};

use super::bin;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_text_cannot_forge_a_log_field() {
    let pki = Pki::new();
    let agent_port = free_port();
    let mut args = vec!["server".to_string(), "--log-format=text".into()];
    args.extend(uds_frontend_args(&pki, "grpc", &socket_path(pki.dir())));
    args.extend([
        format!("--agent-port={agent_port}"),
        "--agent-bind-address=127.0.0.1".into(),
        format!("--health-port={}", free_port()),
        "--health-bind-address=127.0.0.1".into(),
        format!("--admin-port={}", free_port()),
    ]);
    let server = Proc::spawn("server", bin(), &args);
    let agent: std::net::SocketAddr = format!("127.0.0.1:{agent_port}").parse().unwrap();
    wait_until(
        "the agent port listens",
        Duration::from_secs(60),
        || async { tokio::net::TcpStream::connect(agent).await.ok() },
    )
    .await;

    let forged = "nodeB peer=10.9.9.9:4242 verified_by=certificate";
    let f = &pki.files;
    let rogue = Rogue::connect(&pki, agent, Some((&f.agent_cert, &f.agent_key))).await;
    let _stream = rogue.open(forged, "host=nodeB", None).await.ok();
    wait_until("the claim logged", Duration::from_secs(30), || async {
        server.logged("could not verify").then_some(())
    })
    .await;
    let text = server.log_text();
    let line = text
        .lines()
        .find(|l| l.contains("could not verify") && l.contains("nodeB"))
        .unwrap_or_else(|| panic!("no warning about nodeB:\n{text}"));
    assert!(
        line.contains(r#"agent_id="nodeB peer=10.9.9.9:4242 verified_by=certificate""#),
        "{line}"
    );
    let rest = line.replace(r#""nodeB peer=10.9.9.9:4242 verified_by=certificate""#, "");
    assert_eq!(rest.matches(" peer=").count(), 1, "one peer field: {line}");
    assert!(rest.contains(" peer=127.0.0.1:"), "{line}");
    assert!(!rest.contains("verified_by=certificate"), "{line}");
}

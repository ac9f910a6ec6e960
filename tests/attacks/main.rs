//! The attacker's second pass, as real processes: each test is one attack that got
//! through before (a hand-written agent, HTTP/2 client or socket script against a
//! release-shaped server), now refused at its cause. `tests/compromised_node.rs` holds
//! the first pass; `docs/threat-model.md` names the test behind each line.
//!
//! One test binary, one module a subject: the header bomb, certificate-mode pinning and
//! host spellings, connection slots, floods (handshakes, the health port, the log), the
//! credentials `tether certs` writes and the shared-CA guard, forged log fields, and
//! token mode against a real kube-apiserver.

mod bomb;
mod credentials;
mod floods;
mod logs;
mod pinning;
mod slots;
mod token_mode;

use std::path::Path;

use tether_testkit::process::{socket_path, uds_frontend_args};
use tether_testkit::{Pki, ServerProc};

/// Held by the tests that flood (tens of thousands of connections, or a cluster and a
/// flood): on two cores, two at once would measure each other, not the server.
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The `tether` binary under test.
const BIN: &str = env!("CARGO_BIN_EXE_tether");

fn bin() -> &'static Path {
    Path::new(BIN)
}

/// The README's by-hand server: agents by certificate, the gRPC frontend on a socket,
/// upstream's default strategy, plus `extra`.
fn readme_server(pki: &Pki, extra: &[&str]) -> ServerProc {
    let mut args = uds_frontend_args(pki, "grpc", &socket_path(pki.dir()));
    args.extend(extra.iter().map(|s| s.to_string()));
    ServerProc::start(bin(), &args)
}

/// The peak resident memory of process `pid` (VmHWM), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kb * 1024
}

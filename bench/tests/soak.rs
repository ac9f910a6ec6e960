//! The soak mode end to end, kept short: real servers and agents killed and restarted,
//! a node's link cut (as root), callers on both frontends. Every caller gets its bytes
//! unaltered or an error within the bound, the gauges go back to zero, every agent
//! reconnects, no file descriptor leaks, and each process's memory is back to what it
//! held after the warm-up (four runs here: servers at most 4.3 MiB against a 7 MiB
//! bound, the six agents 11.5 MiB against 14).

use std::path::Path;
use std::process::Command;

#[test]
fn a_short_soak_answers_every_caller_and_leaks_nothing() {
    let bench = Path::new(env!("CARGO_BIN_EXE_tether-bench"));
    let dir = std::env::temp_dir().join(format!("tether-soak-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("soak.json");
    let _ = std::fs::remove_file(&json);
    let out = Command::new(bench)
        .args([
            "--soak=20",
            "--soak-agents=6",
            "--soak-tunnels=40",
            "--soak-partitions=1",
        ])
        .arg(format!("--json={}", json.display()))
        .output()
        .expect("run tether-bench");
    let report = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let figures = std::fs::read_to_string(&json)
        .unwrap_or_else(|e| panic!("no soak figures ({e}):\n{report}"));
    let v: serde_json::Value = serde_json::from_str(&figures).expect("soak figures");
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("{figures}");
    for check in [
        "no caller hung past the bound",
        "no bytes altered",
        "every agent reconnected to both servers",
        "gauges back to zero",
        "no leaked file descriptor",
        "server memory back to baseline",
        "agent memory back to baseline",
        "traffic flowed",
    ] {
        assert_eq!(v["checks"][check], true, "{check}: {report}");
    }
    let chaos: u64 = v["chaos"]
        .as_object()
        .unwrap()
        .values()
        .filter_map(|n| n.as_u64())
        .sum();
    assert!(chaos > 0, "no chaos happened: {report}");
}

//! The memory figures: resident memory of the gRPC route's server and agent at idle,
//! holding idle tunnels, and after they close.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::procinfo::status_mib;
use crate::route::{Conn, Env, Route};

/// Resident memory of server and agent with `tunnels` held: the total (VmRSS) and its
/// anonymous part (heap and stacks; the rest is mapped program text).
fn memory_point(env: &Env, tunnels: Value) -> Value {
    let (s, a) = (env.grpc_server_pid, env.grpc_agent_pid);
    json!({
        "tunnels": tunnels,
        "server_mib": status_mib(s, "VmRSS"),
        "agent_mib": status_mib(a, "VmRSS"),
        "server_anon_mib": status_mib(s, "RssAnon"),
        "agent_anon_mib": status_mib(a, "RssAnon"),
    })
}

async fn established(env: &Env) -> f64 {
    let Ok(mut s) = tokio::net::TcpStream::connect(env.grpc_health).await else {
        return f64::NAN;
    };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await;
    let mut page = String::new();
    let _ = s.read_to_string(&mut page).await;
    page.lines()
        .find_map(|l| l.strip_prefix("konnectivity_network_proxy_server_established_connections "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

async fn settle(env: &Env, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while established(env).await != want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Lets server and agent idle for 5 s (two of their trim intervals), then waits until
/// neither RSS fell during the last second (at most 15 s in all): they give memory
/// back a few seconds after a burst ends.
async fn settle_rss(env: &Env) {
    tokio::time::sleep(Duration::from_secs(4)).await;
    let deadline = Instant::now() + Duration::from_secs(11);
    let mut last = (f64::MAX, f64::MAX);
    loop {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let now = (
            status_mib(env.grpc_server_pid, "VmRSS"),
            status_mib(env.grpc_agent_pid, "VmRSS"),
        );
        if (now.0 >= last.0 && now.1 >= last.1) || Instant::now() > deadline {
            return;
        }
        last = now;
    }
}

/// RSS of server and agent at idle, holding 1,000 and `max` idle tunnels, and after
/// they close; twice, to show whether memory grows across rounds.
pub(crate) async fn memory(env: &Env, max: usize) -> anyhow::Result<Value> {
    let mut rounds = Vec::new();
    for _ in 0..2 {
        // Idle means a few seconds after the last traffic: both processes give free
        // heap back by then.
        settle_rss(env).await;
        let mut held = Vec::with_capacity(max);
        let mut points = vec![memory_point(env, json!(0))];
        for target in [1_000usize.min(max), max] {
            hold_until(env, &mut held, target).await?;
            settle(env, target as f64).await;
            points.push(memory_point(env, json!(target)));
        }
        drop(held);
        settle(env, 0.0).await;
        settle_rss(env).await;
        points.push(memory_point(env, json!("closed")));
        rounds.push(Value::Array(points));
    }
    Ok(Value::Array(rounds))
}

/// Opens idle gRPC tunnels, 200 at a time, until `held` has `target` of them.
async fn hold_until(env: &Env, held: &mut Vec<Conn>, target: usize) -> anyhow::Result<()> {
    while held.len() < target {
        let batch: Vec<_> =
            futures::future::join_all((held.len()..target.min(held.len() + 200)).map(|_| async {
                let mut c = env.connect(Route::GrpcUds, env.backend).await?;
                c.write_all(b"E").await?;
                Ok::<_, anyhow::Error>(c)
            }))
            .await;
        for c in batch {
            held.push(c?);
        }
    }
    Ok(())
}

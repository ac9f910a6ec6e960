//! Latency measurements: round trips on one connection, new-connection latency, and
//! the dial rate of many clients.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::route::{Env, Route};
use crate::stats::p50_p99;

pub(crate) async fn rtt(env: &Env, route: Route, iters: usize) -> anyhow::Result<(f64, f64)> {
    let mut c = env.connect(route, env.backend).await?;
    c.write_all(b"E").await?;
    let msg = [7u8; 64];
    let mut buf = [0u8; 64];
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters + 50 {
        let t = Instant::now();
        c.write_all(&msg).await?;
        c.read_exact(&mut buf).await?;
        if i >= 50 {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    Ok(p50_p99(samples))
}

async fn one_new_connection(env: &Env, route: Route) -> anyhow::Result<f64> {
    let t = Instant::now();
    let mut c = env.connect(route, env.backend).await?;
    c.write_all(b"Ex").await?;
    let mut b = [0u8; 1];
    c.read_exact(&mut b).await?;
    drop(c);
    Ok(t.elapsed().as_secs_f64() * 1e6)
}

/// The p50 and p99 of `iters` new connections, one after another or with `gap`
/// between them (by then the last one's close has been carried out everywhere and
/// every process on the path has gone idle, as between an apiserver's occasional
/// `kubectl logs`).
pub(crate) async fn new_connections(
    env: &Env,
    route: Route,
    iters: usize,
    gap: Option<Duration>,
) -> anyhow::Result<(f64, f64)> {
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        samples.push(one_new_connection(env, route).await?);
        if let Some(gap) = gap {
            tokio::time::sleep(gap).await;
        }
    }
    Ok(p50_p99(samples))
}

pub(crate) async fn dial_rate(
    env: &Arc<Env>,
    route: Route,
    clients: usize,
    for_how_long: Duration,
) -> anyhow::Result<f64> {
    let start = Instant::now();
    let results = futures::future::join_all((0..clients).map(|_| {
        let env = env.clone();
        async move {
            let mut n = 0u64;
            while start.elapsed() < for_how_long {
                one_new_connection(&env, route).await?;
                n += 1;
            }
            Ok::<_, anyhow::Error>(n)
        }
    }))
    .await;
    let mut total = 0;
    for r in results {
        total += r?;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}

//! Throughput measurements: one download, one upload, parallel downloads, and
//! fairness beside a stalled reader.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::bail;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::backend::STALLED_WRITTEN;
use crate::route::{Env, Route};

pub(crate) async fn download(env: &Env, route: Route, n: u64) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut c = env.connect(route, env.backend).await?;
    c.write_all(b"D").await?;
    c.write_u64(n).await?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut left = n;
    while left > 0 {
        let got = c.read(&mut buf).await?;
        if got == 0 {
            bail!("{}: closed with {left} bytes left", route.name());
        }
        left -= got as u64;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

pub(crate) async fn upload(env: &Env, route: Route, n: u64) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut c = env.connect(route, env.backend).await?;
    c.write_all(b"U").await?;
    c.write_u64(n).await?;
    let buf = vec![0x17u8; 256 * 1024];
    let mut left = n;
    while left > 0 {
        let k = left.min(buf.len() as u64) as usize;
        c.write_all(&buf[..k]).await?;
        left -= k as u64;
    }
    let mut ack = [0u8; 1];
    c.read_exact(&mut ack).await?;
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

pub(crate) async fn parallel(
    env: &Arc<Env>,
    route: Route,
    n: u64,
    conns: usize,
) -> anyhow::Result<f64> {
    let start = Instant::now();
    let each = n / conns as u64;
    let results = futures::future::join_all((0..conns).map(|_| {
        let env = env.clone();
        async move { download(&env, route, each).await }
    }))
    .await;
    for r in results {
        r?;
    }
    Ok((each * conns as u64) as f64 / start.elapsed().as_secs_f64())
}

/// Fairness: the aggregate download throughput of 8 busy connections beside one whose
/// reader has stopped, as a fraction of the same 8 alone; and how many bytes the
/// stalled connection's target could write before everything in between was full.
pub(crate) async fn fairness(env: &Arc<Env>, route: Route, n: u64) -> anyhow::Result<(f64, f64)> {
    let alone = parallel(env, route, n, 8).await?;
    let before = STALLED_WRITTEN.load(Ordering::Relaxed);
    let mut stalled = env.connect(route, env.backend).await?;
    stalled.write_all(b"S").await?;
    // Let the stalled connection fill every buffer on its path first.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = u64::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = STALLED_WRITTEN.load(Ordering::Relaxed);
        if now == last || Instant::now() > deadline {
            break;
        }
        last = now;
    }
    let beside = parallel(env, route, n, 8).await?;
    let buffered = STALLED_WRITTEN.load(Ordering::Relaxed) - before;
    drop(stalled);
    Ok((beside / alone, buffered as f64 / 1048576.0))
}

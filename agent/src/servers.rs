//! The set of proxy servers: keeps one stream up to each (as many as the servers'
//! count or their Leases say), round-robin over the configured addresses with
//! exponential backoff and jitter, and drains them all on request.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tether_core::error::chain;

use rand::Rng;
use tokio_util::sync::CancellationToken;

use crate::config::{AgentConfig, CountSource};
use crate::lease_count::LeaseCounter;
use crate::link::CLOSE_GRACE;
use crate::Agent;

/// The streams held, by server id, each with its hard stop.
#[derive(Clone, Default)]
struct Held {
    streams: Arc<Mutex<HashMap<String, HeldStream>>>,
    /// Notified when a stream ends or its server says it is stopping.
    ended: Arc<tokio::sync::Notify>,
}

/// One stream held, by its server's id.
struct HeldStream {
    hard_stop: CancellationToken,
    /// The server said DRAIN: it is stopping. The stream serves on, but no longer
    /// counts toward the servers held, so the agent connects to a successor meanwhile;
    /// reaching the stopping server again is still a duplicate.
    leaving: bool,
}

/// What one dial reached.
enum Reached {
    /// A server not held before: its stream is now served.
    New,
    /// A server already held: the stream was closed.
    Duplicate,
    /// Nothing (the error is logged).
    Failed,
}

impl Held {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, HeldStream>> {
        self.streams.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The servers held that are not stopping.
    fn count(&self) -> i64 {
        self.lock().values().filter(|s| !s.leaving).count() as i64
    }

    /// `server_id` said it is stopping: look for the others, after `spread` (chosen at
    /// random by the caller), so that a stopping server's agents do not all dial its
    /// peers in the same instant. The stream serves on meanwhile.
    fn leaving(&self, server_id: &str, spread: Duration) {
        if let Some(s) = self.lock().get_mut(server_id) {
            s.leaving = true;
        }
        let ended = self.ended.clone();
        tokio::spawn(async move {
            tokio::time::sleep(spread).await;
            ended.notify_one();
        });
    }

    /// Waits, at most twice `CLOSE_GRACE`, until every stream has ended.
    async fn wait_closed(&self) {
        // Each stream half-closes once its DRAIN is out (link.rs); give the
        // servers a moment to end their side, so none logs a reset.
        let deadline = tokio::time::Instant::now() + CLOSE_GRACE + CLOSE_GRACE;
        loop {
            let ended = self.ended.notified();
            if self.lock().is_empty() {
                break;
            }
            tokio::select! {
                _ = ended => {}
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
    }
}

/// Where the round-robin over the configured addresses stands, and the backoff
/// between dials that reach no new server.
struct Round {
    /// The index of the next address to dial (modulo their number).
    next: usize,
    /// The wait after the next miss, before jitter.
    delay: Duration,
    /// Duplicates reached in a row, each retried at once.
    duplicates: i64,
}

impl Round {
    /// A round from the first address, with the shortest delay.
    fn new(first_delay: Duration) -> Self {
        Round {
            next: 0,
            delay: first_delay,
            duplicates: 0,
        }
    }

    /// After a dial that `reached` (holding `have` of `target` before it): `None` to
    /// dial again at once, else the wait before the next dial, with up to 10% jitter.
    /// A miss makes the next delay half as long again, up to `--sync-interval-cap`.
    fn after(
        &mut self,
        reached: Reached,
        have: i64,
        target: i64,
        cfg: &AgentConfig,
    ) -> Option<Duration> {
        match reached {
            Reached::New => {
                self.delay = cfg.sync_interval;
                self.duplicates = 0;
                return None;
            }
            // Behind a round-robin balancer the next connection may reach
            // another server: retry at once, a server count's worth of times.
            // Backing off instead can lock step with other agents' dials so
            // that this agent reaches the same server every time.
            Reached::Duplicate if have < target && self.duplicates < target => {
                self.duplicates += 1;
                return None;
            }
            Reached::Duplicate | Reached::Failed => self.duplicates = 0,
        }
        let wait = self.delay.mul_f64(1.0 + rand::rng().random_range(0.0..0.1));
        self.delay = self.delay.mul_f64(1.5).min(cfg.sync_interval_cap);
        Some(wait)
    }
}

/// How long after a server's DRAIN its agent looks for the others: at random within
/// `--sync-interval`, which spreads a stopping server's agents over that time.
fn drain_spread(sync_interval: Duration) -> Duration {
    sync_interval.mul_f64(rand::rng().random_range(0.0..1.0))
}

impl Agent {
    /// Keeps one stream to every server up until `hard_stop`: dials (round-robin over
    /// the configured addresses) until it holds as many distinct server ids as there
    /// are servers, closing duplicates. When `drain` is cancelled every stream sends
    /// DRAIN and no new stream is opened, but the streams stay and every dial the
    /// servers still send is served, as upstream's agent does until its second signal:
    /// a server whose every eligible agent drains (a single agent, or a node pinned by
    /// destHost during a rollout) still reaches the node. `run` returns at `hard_stop`.
    pub async fn run(&self, drain: CancellationToken, hard_stop: CancellationToken) {
        self.spawn_upkeep(&hard_stop);
        self.config.egress.log_routes(&self.config.servers);
        let held = Held::default();
        let leases = self.count_leases(&hard_stop).await;
        self.keep_streams(&held, leases.as_ref(), &drain, &hard_stop)
            .await;
        for stream in held.lock().values() {
            stream.hard_stop.cancel();
        }
        if drain.is_cancelled() {
            held.wait_closed().await;
        }
    }

    /// Starts what runs beside the streams until `hard_stop`: the memory trimmer and
    /// the certificate reload.
    fn spawn_upkeep(&self, hard_stop: &CancellationToken) {
        let work = self.drain.work.clone();
        tether_ops::memory::spawn_trimmer(
            move || work.open() as i64,
            tether_ops::memory::Looks::BackOff(self.drain.work.started()),
            hard_stop.clone(),
        );
        let mut watched = vec![self.tls.clone() as Arc<dyn tether_ops::reload::Reload>];
        if let Some(proxy_tls) = &self.proxy_tls {
            watched.push(proxy_tls.clone());
        }
        tether_ops::reload::spawn_watcher(
            watched,
            self.config.cert_reload_interval,
            hard_stop.clone(),
        );
        self.watch_node(hard_stop);
    }

    /// Under `--dial-policy=node` with `--node-name`, reads the Node for the policy.
    fn watch_node(&self, hard_stop: &CancellationToken) {
        let policy = self.policy.clone();
        let c = policy.config();
        let Some(name) = c.node_name.clone().filter(|_| !c.any) else {
            return;
        };
        let kubeconfig = c.kubeconfig.clone();
        let hard_stop = hard_stop.clone();
        tokio::spawn(async move {
            // Tried again (a kubeconfig written after the agent started, a token not
            // yet projected) until it works; warned about once.
            let mut warned = false;
            loop {
                match tether_ops::kubeclient::client(kubeconfig.as_deref()).await {
                    Ok(client) => {
                        return crate::policy::NodeWatch::spawn(client, name, &policy, hard_stop)
                    }
                    Err(e) if !warned => {
                        warned = true;
                        tracing::warn!(
                            error = %chain(&e),
                            "dial policy: no API client to read this node's Node object (--kubeconfig, else in-cluster); until there is one, dials to its pods are refused"
                        );
                    }
                    Err(_) => {}
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(10)) => {}
                    _ = hard_stop.cancelled() => return,
                }
            }
        });
    }

    /// Dials (round-robin, with backoff) until `held` has a stream to every server,
    /// and again whenever one ends, until `hard_stop`; no new stream once `drain`.
    async fn keep_streams(
        &self,
        held: &Held,
        leases: Option<&LeaseCounter>,
        drain: &CancellationToken,
        hard_stop: &CancellationToken,
    ) {
        let cfg = &self.config;
        let mut round = Round::new(cfg.sync_interval);
        loop {
            if hard_stop.is_cancelled() {
                break;
            }
            let have = held.count();
            let target = self.target_count(leases);
            self.metrics.known_server_count.set(target);
            // A count of 0 (`--server-count=0` upstream) is unknown: keep looking for
            // servers, as upstream's agent does.
            let want_more =
                !drain.is_cancelled() && (have < target || target == 0 || cfg.sync_forever);
            let mut wait = cfg.sync_interval;
            if want_more {
                let (host, port) = &cfg.servers[round.next % cfg.servers.len()];
                round.next = round.next.wrapping_add(1);
                let reached = self.connect(host, *port, held, drain, hard_stop).await;
                let Some(backoff) = round.after(reached, have, target, cfg) else {
                    continue;
                };
                wait = backoff;
            }
            // Holding every server, only an event can change that: a stream ending, a
            // drain or the hard stop. Lease counts change with time (a lease expires) and
            // `--sync-forever` looks for new servers, so those still look every interval.
            // An idle agent then has no timer of its own here (each wake-up costs it
            // CPU on every node).
            let timed = want_more || leases.is_some();
            tokio::select! {
                _ = tokio::time::sleep(wait), if timed => {}
                _ = held.ended.notified() => {}
                _ = drain.cancelled(), if !drain.is_cancelled() => {}
                _ = hard_stop.cancelled() => break,
            }
        }
    }

    /// Opens a stream to `host:port` and serves it in a task of its own.
    async fn connect(
        &self,
        host: &str,
        port: u16,
        held: &Held,
        drain: &CancellationToken,
        hard_stop: &CancellationToken,
    ) -> Reached {
        let est = match self.establish(host, port).await {
            Ok(est) => est,
            Err(e) => {
                tracing::warn!(%host, port, error = %chain(&e), "proxy server stream down; reconnecting");
                self.metrics
                    .server_connect_failures
                    .with_label_values(&[e.connect_failure()])
                    .inc();
                return Reached::Failed;
            }
        };
        let server_id = est.server_id.clone();
        let hard_stop = hard_stop.child_token();
        {
            let mut streams = held.lock();
            if streams.contains_key(&server_id) {
                tracing::info!(%server_id, %host, have = streams.len(), "reached a server this agent is already connected to; closing the duplicate stream and retrying");
                return Reached::Duplicate;
            }
            let stream = HeldStream {
                hard_stop: hard_stop.clone(),
                leaving: false,
            };
            streams.insert(server_id.clone(), stream);
        }
        let (this, held, drain) = (self.clone(), held.clone(), drain.clone());
        tokio::spawn(async move {
            let server_draining = CancellationToken::new();
            let served = this.serve(est, &drain, &hard_stop, server_draining.clone());
            let mut served = std::pin::pin!(served);
            let served = tokio::select! {
                served = &mut served => served,
                _ = server_draining.cancelled() => {
                    held.leaving(&server_id, drain_spread(this.config.sync_interval));
                    this.leaving.fetch_add(1, Ordering::Relaxed);
                    let served = served.await;
                    this.leaving.fetch_sub(1, Ordering::Relaxed);
                    served
                }
            };
            if let Err(e) = served {
                tracing::warn!(%server_id, error = %chain(&e), "proxy server stream down; reconnecting");
            }
            held.lock().remove(&server_id);
            held.ended.notify_one();
        });
        Reached::New
    }

    /// Counts server Leases when configured (`--count-server-leases`).
    async fn count_leases(&self, hard_stop: &CancellationToken) -> Option<LeaseCounter> {
        let lc = self.config.lease_count.as_ref()?;
        match tether_ops::kubeclient::client(lc.kubeconfig.as_deref()).await {
            Ok(c) => Some(LeaseCounter::spawn(
                c,
                lc,
                self.metrics.lease.clone(),
                hard_stop.clone(),
            )),
            Err(e) => {
                tracing::error!(error = %chain(&e), "cannot count server leases; using the servers' servercount");
                None
            }
        }
    }

    fn target_count(&self, leases: Option<&LeaseCounter>) -> i64 {
        let header = self.header_count.load(Ordering::Relaxed).max(0);
        let Some(leases) = leases else { return header };
        let counted = leases.count();
        match (self.config.count_source, counted) {
            (_, None) => header,
            (CountSource::Default, Some(n)) => n.max(1),
            (CountSource::Max, Some(n)) => n.max(header),
        }
    }
}

#[cfg(test)]
mod spread_tests {
    use super::*;

    #[test]
    fn agents_told_drain_spread_over_the_sync_interval() {
        let interval = Duration::from_secs(1);
        let spreads: Vec<Duration> = (0..200).map(|_| drain_spread(interval)).collect();
        assert!(spreads.iter().all(|s| *s < interval));
        // Spread, not bunched: some in each half.
        assert!(spreads.iter().any(|s| *s < interval / 2));
        assert!(spreads.iter().any(|s| *s >= interval / 2));
    }
}

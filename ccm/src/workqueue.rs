//! A work queue of object keys, as upstream controllers use: a key is queued at most
//! once, never handled by two workers at once (a key added while it is being handled
//! comes back afterwards), and a key whose sync failed comes back after a per-key
//! exponential backoff (5 s doubling up to 300 s), or when the provider says, even if
//! the object changes meanwhile. Every queue reports client-go's `workqueue_*{name}`
//! metrics, and [`WorkQueue::work`] is the worker loop every controller runs.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// First retry delay.
pub const BACKOFF_BASE: Duration = Duration::from_secs(5);
/// Longest retry delay.
pub const BACKOFF_MAX: Duration = Duration::from_secs(300);
/// How often the running times are reported while nothing else happens (client-go's).
const UNFINISHED_PERIOD: Duration = Duration::from_millis(500);

#[derive(Default)]
struct State {
    queue: VecDeque<String>,
    queued: HashSet<String>,
    active: HashSet<String>,
    dirty: HashSet<String>,
    /// Keys waiting out a backoff: changes to the object do not cut it short.
    waiting: HashSet<String>,
    failures: HashMap<String, u32>,
    /// When each queued key was added (queue latency).
    added: HashMap<String, Instant>,
    /// When each active key was handed out (work duration).
    started: HashMap<String, Instant>,
    closed: bool,
}

/// How a sync ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Done; forget the key's failures.
    Done,
    /// Failed; retry after the key's backoff, or after the given delay.
    Retry(Option<Duration>),
}

/// One queue's series of client-go's `workqueue_*{name}` families.
struct Series {
    adds: prometheus::IntCounter,
    depth: prometheus::IntGauge,
    retries: prometheus::IntCounter,
    latency: prometheus::Histogram,
    work: prometheus::Histogram,
    unfinished: prometheus::Gauge,
    longest: prometheus::Gauge,
}

impl Series {
    /// Every series of queue `name`, created at zero from the start (as client-go's).
    fn of(m: &crate::metrics::Metrics, name: &str) -> Series {
        Series {
            adds: m.queue_adds.with_label_values(&[name]),
            depth: m.queue_depth.with_label_values(&[name]),
            retries: m.queue_retries.with_label_values(&[name]),
            latency: m.queue_latency.with_label_values(&[name]),
            work: m.work_duration.with_label_values(&[name]),
            unfinished: m.unfinished_work.with_label_values(&[name]),
            longest: m.longest_running.with_label_values(&[name]),
        }
    }
}

/// The queue.
pub struct WorkQueue {
    name: &'static str,
    series: Series,
    state: Mutex<State>,
    notify: Notify,
    base: Duration,
    max: Duration,
}

impl WorkQueue {
    /// A queue named `name` (for logs and its series in `metrics`) with the default
    /// backoff.
    pub fn new(name: &'static str, metrics: &crate::metrics::Metrics) -> Arc<Self> {
        Self::with_backoff(name, BACKOFF_BASE, BACKOFF_MAX, metrics)
    }

    /// A queue with a custom backoff (tests).
    pub fn with_backoff(
        name: &'static str,
        base: Duration,
        max: Duration,
        metrics: &crate::metrics::Metrics,
    ) -> Arc<Self> {
        Arc::new(WorkQueue {
            name,
            series: Series::of(metrics, name),
            state: Mutex::new(State::default()),
            notify: Notify::new(),
            base,
            max,
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `key` now.
    pub fn add(&self, key: &str) {
        let mut s = self.state();
        if s.closed || s.queued.contains(key) || s.waiting.contains(key) {
            return;
        }
        if s.active.contains(key) {
            s.dirty.insert(key.to_string());
            return;
        }
        s.queued.insert(key.to_string());
        s.queue.push_back(key.to_string());
        s.added.insert(key.to_string(), Instant::now());
        let depth = s.queue.len();
        drop(s);
        self.series.adds.inc();
        self.series.depth.set(depth as i64);
        self.notify.notify_one();
    }

    /// Queues `key` after `delay`; until then, adding it does nothing.
    pub fn add_after(self: &Arc<Self>, key: String, delay: Duration) {
        if !self.state().waiting.insert(key.clone()) {
            return;
        }
        let this = self.clone();
        tokio::spawn(
            async move {
                tokio::time::sleep(delay).await;
                this.state().waiting.remove(&key);
                this.add(&key);
            }
            .instrument(tracing::debug_span!("requeue", queue = self.name)),
        );
    }

    /// The next key to handle; `None` once the queue is shut down.
    pub async fn next(&self) -> Option<String> {
        loop {
            {
                let mut s = self.state();
                if s.closed {
                    return None;
                }
                if let Some(key) = s.queue.pop_front() {
                    s.queued.remove(&key);
                    s.active.insert(key.clone());
                    let now = Instant::now();
                    if let Some(at) = s.added.remove(&key) {
                        self.series.latency.observe((now - at).as_secs_f64());
                    }
                    self.series.depth.set(s.queue.len() as i64);
                    s.started.insert(key.clone(), now);
                    self.report_unfinished(&s, now);
                    if !s.queue.is_empty() {
                        // Wake another worker for the rest.
                        self.notify.notify_one();
                    }
                    return Some(key);
                }
            }
            self.notify.notified().await;
        }
    }

    /// Reports how handling `key` ended.
    pub fn done(self: &Arc<Self>, key: String, outcome: Outcome) {
        let mut s = self.state();
        s.active.remove(&key);
        let now = Instant::now();
        if let Some(at) = s.started.remove(&key) {
            self.series.work.observe((now - at).as_secs_f64());
        }
        self.report_unfinished(&s, now);
        let again = s.dirty.remove(&key);
        match outcome {
            Outcome::Done => {
                s.failures.remove(&key);
                drop(s);
                if again {
                    self.add(&key);
                }
            }
            Outcome::Retry(after) => {
                let n = s.failures.entry(key.clone()).or_insert(0);
                *n += 1;
                let delay = after.unwrap_or_else(|| self.backoff(*n));
                drop(s);
                self.series.retries.inc();
                // The backoff holds even if the object changed meanwhile: the retry
                // reads the latest state anyway, and a busy object must not turn a
                // failing provider into a hot loop.
                let _ = again;
                tracing::debug!(queue = self.name, %key, ?delay, "sync failed; retrying later");
                self.add_after(key, delay);
            }
        }
    }

    /// `workqueue_unfinished_work_seconds` and `..._longest_running_processor_seconds`.
    fn report_unfinished(&self, s: &State, now: Instant) {
        let running = s.started.values().map(|at| (now - *at).as_secs_f64());
        let (total, longest) = running.fold((0.0, 0.0f64), |(t, l), d| (t + d, l.max(d)));
        self.series.unfinished.set(total);
        self.series.longest.set(longest);
    }

    /// Runs `workers` workers until `hard_stop`: each takes a key, awaits `sync` on it and
    /// reports the outcome; the queue never hands one key to two workers at once.
    pub async fn work<F, Fut>(
        self: Arc<Self>,
        workers: usize,
        hard_stop: CancellationToken,
        sync: F,
    ) where
        F: Fn(String) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Outcome> + Send + 'static,
    {
        let queue = self.clone();
        tokio::spawn(async move {
            // As client-go's, the running times are refreshed every 500 ms, not only
            // when a worker takes or finishes a key: a hung sync shows as a growing
            // longest_running_processor_seconds.
            let mut tick = tokio::time::interval(UNFINISHED_PERIOD);
            loop {
                tokio::select! {
                    _ = hard_stop.cancelled() => break,
                    _ = tick.tick() => queue.report_unfinished(&queue.state(), Instant::now()),
                }
            }
            queue.shut_down();
        });
        let mut set = tokio::task::JoinSet::new();
        for worker in 0..workers.max(1) {
            let (queue, sync) = (self.clone(), sync.clone());
            set.spawn(
                async move {
                    while let Some(key) = queue.next().await {
                        let outcome = sync(key.clone()).await;
                        queue.done(key, outcome);
                    }
                }
                .instrument(tracing::debug_span!(
                    "worker",
                    queue = self.name,
                    worker
                )),
            );
        }
        while set.join_next().await.is_some() {}
    }

    /// The delay before the `n`th retry.
    pub fn backoff(&self, n: u32) -> Duration {
        let factor = 1u32.checked_shl(n.saturating_sub(1)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.max)
    }

    /// Stops the queue: `next` returns `None` from now on.
    pub fn shut_down(&self) {
        self.state().closed = true;
        self.notify.notify_waiters();
    }

    /// Keys waiting (not counting those being handled).
    pub fn len(&self) -> usize {
        self.state().queue.len()
    }

    /// Is nothing waiting?
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A period that does not catch up on missed ticks (a slow pass delays the next).
pub struct Ticker(tokio::time::Interval);

impl Ticker {
    /// The first tick is at once.
    pub fn new(period: std::time::Duration) -> Self {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Ticker(tick)
    }

    /// Waits for the next tick: false once `hard_stop` fires instead.
    pub async fn next(&mut self, hard_stop: &tokio_util::sync::CancellationToken) -> bool {
        tokio::select! {
            _ = self.0.tick() => true,
            _ = hard_stop.cancelled() => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_5s_to_300s() {
        let q = WorkQueue::new("t", &crate::metrics::Metrics::default());
        let d: Vec<u64> = (1..=8).map(|n| q.backoff(n).as_secs()).collect();
        assert_eq!(d, [5, 10, 20, 40, 80, 160, 300, 300]);
        assert_eq!(q.backoff(100), BACKOFF_MAX);
    }

    #[tokio::test(start_paused = true)]
    async fn keys_are_deduplicated_and_failed_ones_come_back() {
        let q = WorkQueue::new("t", &crate::metrics::Metrics::default());
        q.add("a");
        q.add("a");
        q.add("b");
        assert_eq!(q.len(), 2);
        let a = q.next().await.unwrap();
        assert_eq!(a, "a");
        // Added while active: handled again after, not concurrently.
        q.add("a");
        assert_eq!(q.len(), 1);
        q.done(a, Outcome::Done);
        assert_eq!(q.next().await.unwrap(), "b");
        let a = q.next().await.unwrap();
        assert_eq!(a, "a");
        q.done(a, Outcome::Retry(None));
        assert!(q.is_empty());
        // A change during the backoff does not cut it short.
        q.add("a");
        assert!(q.is_empty());
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_eq!(q.next().await.unwrap(), "a");
        q.shut_down();
        assert_eq!(q.next().await, None);
    }
}

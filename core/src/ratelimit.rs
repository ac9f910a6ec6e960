//! A token bucket (QPS with a burst), as client-go's flowcontrol: so that a reconnect
//! storm or a large cluster cannot hammer an API, and a flood cannot flood the log.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Tokens refill at `qps` per second up to `burst`; `acquire` waits for one.
#[derive(Debug)]
pub struct TokenBucket {
    qps: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    /// A full bucket. `qps <= 0` means unlimited.
    pub fn new(qps: f64, burst: u32) -> Self {
        let burst = f64::from(burst.max(1));
        TokenBucket {
            qps,
            burst,
            state: Mutex::new((burst, Instant::now())),
        }
    }

    /// Waits until a token is available and takes it.
    pub async fn acquire(&self) {
        while let Err(wait) = self.take() {
            tokio::time::sleep(wait).await;
        }
    }

    /// Takes a token if one is available now (for work that is skipped, not delayed,
    /// over the rate: log lines, say).
    pub fn try_acquire(&self) -> bool {
        self.take().is_ok()
    }

    /// Takes a token, or says how long until one is there.
    fn take(&self) -> Result<(), Duration> {
        if self.qps <= 0.0 {
            return Ok(());
        }
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let refill = now.duration_since(s.1).as_secs_f64() * self.qps;
        s.0 = (s.0 + refill).min(self.burst);
        s.1 = now;
        if s.0 >= 1.0 {
            s.0 -= 1.0;
            return Ok(());
        }
        Err(Duration::from_secs_f64((1.0 - s.0) / self.qps))
    }
}

/// Log lines a peer can cause, at most `qps` a second after a burst: each allowed line
/// says how many were left out before it, so that a flood neither fills the log nor
/// goes unseen.
#[derive(Debug)]
pub struct LogLimit {
    bucket: TokenBucket,
    left_out: std::sync::atomic::AtomicU64,
}

impl LogLimit {
    /// `qps` lines a second, `burst` at once.
    pub fn new(qps: f64, burst: u32) -> Self {
        LogLimit {
            bucket: TokenBucket::new(qps, burst),
            left_out: Default::default(),
        }
    }

    /// May a line be logged now? `Some(n)`: yes, and `n` were left out before it.
    pub fn allow(&self) -> Option<u64> {
        use std::sync::atomic::Ordering;
        if self.bucket.try_acquire() {
            Some(self.left_out.swap(0, Ordering::Relaxed))
        } else {
            self.left_out.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// `text` cut to at most `max` bytes (on a character boundary), for logging what a peer
/// sent.
pub fn clipped(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_limit_counts_what_it_leaves_out() {
        let limit = LogLimit::new(0.001, 2);
        assert_eq!(limit.allow(), Some(0));
        assert_eq!(limit.allow(), Some(0));
        assert_eq!(limit.allow(), None);
        assert_eq!(limit.allow(), None);
        assert_eq!(clipped("héllo", 2), "h");
        assert_eq!(clipped("abc", 10), "abc");
    }

    #[tokio::test(start_paused = true)]
    async fn burst_then_rate() {
        let bucket = TokenBucket::new(10.0, 5);
        let start = Instant::now();
        for _ in 0..5 {
            bucket.acquire().await;
        }
        assert_eq!(start.elapsed(), Duration::ZERO);
        for _ in 0..10 {
            bucket.acquire().await;
        }
        let elapsed = start.elapsed();
        assert!(
            elapsed >= Duration::from_millis(990) && elapsed <= Duration::from_millis(1010),
            "{elapsed:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn try_acquire_skips_over_the_rate() {
        let bucket = TokenBucket::new(1.0, 2);
        assert!(bucket.try_acquire() && bucket.try_acquire());
        assert!(!bucket.try_acquire());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(bucket.try_acquire());
    }
}

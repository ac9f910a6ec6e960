//! The allocator's policy: keep freed memory while traffic flows (no page faults per
//! buffer), give it back to the kernel once a burst is over (when the number of open
//! tunnels has fallen well below its recent peak, or when the process has gone idle
//! after doing work), so RSS does not stay at the peak.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How often the tunnel count is looked at.
const INTERVAL: Duration = Duration::from_secs(2);

/// Fewer closed tunnels than this since the peak are not worth a trim.
const MIN_DROP: i64 = 256;

/// Free heap glibc may keep at the top of an arena before it shrinks it by itself.
/// `malloc_trim` cannot shrink the top of a thread's arena, so this also bounds what an
/// idle process keeps per arena (about one arena per thread that ever allocated). 1 MiB
/// brought the page faults back (about 90,000 per GiB streamed with 128 KiB reads).
const TRIM_THRESHOLD: usize = 4 << 20;

/// Allocations this large or larger get their own mapping.
const MMAP_THRESHOLD: usize = 4 << 20;

/// Free heap below this is not worth a trim.
const MIN_FREE: usize = 1 << 20;

/// Idle means using at most 1/`IDLE_SHARE` of one CPU over the last interval (5%:
/// 100 ms per 2 s, about 35 MiB tunnelled); after a trim the next one waits until the
/// process has used that much CPU again, so an idle process is not trimmed over and over.
const IDLE_SHARE: u32 = 20;

/// Sets the allocator's thresholds; call once at start-up, before the runtime starts.
///
/// glibc's defaults (a 128 KiB trim threshold) hand pages back to the kernel whenever a
/// few 32 KiB packet buffers at the top of the heap are freed, and the next packets
/// fault them in again: an agent streaming 1 GiB took 58,000 page faults and 30% more
/// CPU (tether-bench download, minor faults from /proc/PID/stat) than with these, which
/// bring it down to none after start-up (4 MiB measured as good as 16 MiB).
#[allow(unsafe_code)]
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets two of the allocator's tunables; no memory is touched.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int);
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
    }
}

/// Bytes the allocator holds free (`None` where it cannot say).
#[allow(unsafe_code)]
fn heap_free() -> Option<usize> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        Some(unsafe { libc::mallinfo2() }.fordblks)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// CPU time (user + system) this process has used so far.
#[allow(unsafe_code)]
fn cpu_time() -> Duration {
    // SAFETY: getrusage writes only into the struct we pass.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// Returns free heap pages to the kernel now.
#[allow(unsafe_code)]
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Watches `open` (the number of open tunnels) and trims once it has fallen to half its
/// peak or less, by at least 256 tunnels; also once the process has gone idle (under 5%
/// of a CPU for a whole interval) after using at least that much CPU since the last
/// trim, with at least 1 MiB of heap free. Runs until `shutdown`.
///
/// The free-heap figure cannot say what is still resident (pages already handed back
/// stay "free" to the allocator), hence the CPU clock: it tells when traffic stopped,
/// and that there was traffic since the last trim.
pub fn spawn_trimmer(open: impl Fn() -> i64 + Send + 'static, shutdown: CancellationToken) {
    spawn_trimmer_every(INTERVAL, open, shutdown)
}

fn spawn_trimmer_every(
    interval: Duration,
    open: impl Fn() -> i64 + Send + 'static,
    shutdown: CancellationToken,
) {
    tokio::spawn(
        async move {
            let mut peak = 0i64;
            let idle_cpu = interval / IDLE_SHARE;
            let (mut last_cpu, mut cpu_at_trim) = (cpu_time(), Duration::ZERO);
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = shutdown.cancelled() => return,
                }
                let now = open();
                peak = peak.max(now);
                let cpu = cpu_time();
                let went_idle = cpu.saturating_sub(last_cpu) <= idle_cpu
                    && cpu.saturating_sub(cpu_at_trim) >= idle_cpu;
                last_cpu = cpu;
                let free = heap_free().unwrap_or(0);
                let burst_over = peak - now >= MIN_DROP && now <= peak / 2;
                if free >= MIN_FREE && (burst_over || went_idle) {
                    tokio::task::spawn_blocking(trim).await.ok();
                    cpu_at_trim = cpu_time();
                    last_cpu = cpu_at_trim;
                    tracing::debug!(
                        peak,
                        now,
                        free,
                        burst_over,
                        went_idle,
                        "returned free memory to the kernel"
                    );
                    peak = now;
                }
            }
        }
        .instrument(tracing::info_span!("memory_trim")),
    );
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;
    use std::time::Instant;

    /// Minor page faults of the calling thread so far.
    #[allow(unsafe_code)]
    fn thread_faults() -> i64 {
        // SAFETY: getrusage writes only into the struct we pass.
        unsafe {
            let mut usage: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_THREAD, &mut usage);
            usage.ru_minflt
        }
    }

    fn rss_anon_kib() -> u64 {
        std::fs::read_to_string("/proc/self/status")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap()
    }

    /// Allocates (and touches) `n` packet-sized buffers, then frees them all.
    fn churn(n: usize) {
        let bufs: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8; 32 * 1024]).collect();
        std::hint::black_box(&bufs);
    }

    // One test: a trim from a parallel test would give the churned pages back mid-way.
    #[tokio::test]
    async fn freed_buffers_are_kept_while_busy_and_given_back_once_idle() {
        tune_allocator();
        churn(64);
        let before = thread_faults();
        for _ in 0..200 {
            churn(64); // 2 MiB each time: above glibc's default 128 KiB trim threshold
        }
        let faults = thread_faults() - before;
        assert!(faults < 512, "{faults} page faults re-using freed buffers");

        // Every other buffer freed: 6 MiB of holes in the heap, which glibc never gives
        // back by itself.
        let mut bufs: Vec<Vec<u8>> = (0..384).map(|i| vec![i as u8; 32 * 1024]).collect();
        let mut keep = Vec::new();
        for (i, b) in bufs.drain(..).enumerate() {
            if i % 2 == 0 {
                keep.push(b);
            }
        }
        let busy = rss_anon_kib();
        assert!(heap_free().unwrap() >= MIN_FREE);
        let stop = CancellationToken::new();
        spawn_trimmer_every(Duration::from_millis(20), || 0, stop.clone());
        let deadline = Instant::now() + Duration::from_secs(10);
        while rss_anon_kib() + 4 * 1024 > busy {
            assert!(
                Instant::now() < deadline,
                "free heap never given back: RssAnon {busy} KiB -> {} KiB",
                rss_anon_kib()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        std::hint::black_box(&keep);
        stop.cancel();
    }
}

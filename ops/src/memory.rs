//! The allocator's policy: keep freed memory while traffic flows (no page faults per
//! buffer), give it back to the kernel once a burst is over (when the number of open
//! tunnels has fallen well below its recent peak, or when the process has gone idle
//! after freeing memory), so RSS does not stay at the peak.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How often the tunnel count is looked at while the process works.
const INTERVAL: Duration = Duration::from_secs(2);

/// How far apart an idle process's looks may grow with [`Looks::BackOff`].
const IDLE_INTERVAL: Duration = Duration::from_secs(32);

/// How the trimmer spaces its looks while the process is idle.
#[derive(Debug, Clone)]
pub enum Looks {
    /// Every 2 s, idle or not: for a server, where agents and frontend connections
    /// free memory its tunnel count does not show.
    Steady,
    /// Twice as far apart each time, from 2 s up to 32 s, while the process stays idle
    /// and its tunnel count does not move; back to 2 s on any work, and at once when
    /// this is notified (work starting: [`tether_core::drain::Signal::started`]). For
    /// an agent, whose memory comes and goes with its tunnels.
    BackOff(Arc<Notify>),
}

/// Fewer closed tunnels than this since the peak are not worth a trim.
const MIN_DROP: i64 = 256;

/// Free heap glibc may keep at the top of an arena before it shrinks it by itself.
/// `malloc_trim` cannot shrink the top of a thread's arena, so this also bounds what an
/// idle process keeps per arena (about one arena per thread that ever allocated). 1 MiB
/// brought the page faults back (about 90,000 per GiB streamed with 128 KiB reads).
const TRIM_THRESHOLD: usize = 4 << 20;

/// Allocations this large or larger get their own mapping.
const MMAP_THRESHOLD: usize = 4 << 20;

/// Free heap below this is not worth a trim; nor is an idle process that has freed
/// (or grown) less than this since its last trim. An idle agent holds about 1 MiB.
const MIN_FREE: usize = 256 << 10;

/// Idle means using at most 1/`IDLE_SHARE` of one CPU over the last interval (5%:
/// 100 ms per 2 s, about 35 MiB tunnelled).
const IDLE_SHARE: u32 = 20;

/// Trims done so far (each with its low points measured afterwards).
static TRIMS: AtomicU64 = AtomicU64::new(0);

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
fn heap_free() -> Option<usize> {
    heap_stats().map(|(_, free)| free)
}

/// What the allocator holds, from glibc's `mallinfo2`: bytes in live allocations and
/// bytes free but kept (holes in the heap, and its top until the next trim). Resident
/// memory well above the first is the allocator's, not live objects.
#[allow(unsafe_code)]
fn heap_stats() -> Option<(usize, usize)> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads the allocator's statistics.
        let m = unsafe { libc::mallinfo2() };
        Some((m.uordblks + m.hblkhd, m.fordblks))
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// `tether_heap_inuse_bytes` and `tether_heap_free_bytes`, read at each scrape (the
/// glibc counterparts of Go's `go_memstats_heap_inuse_bytes` and `..._heap_idle_bytes`,
/// which upstream's binaries export). Nothing is exported where glibc is not the
/// allocator.
#[derive(Debug)]
pub struct HeapCollector {
    inuse: prometheus::IntGauge,
    free: prometheus::IntGauge,
}

impl HeapCollector {
    /// The two gauges, unregistered.
    pub fn new() -> Self {
        let gauge = |name: &str, help: &str| {
            prometheus::IntGauge::new(name, help).expect("valid heap metric")
        };
        HeapCollector {
            inuse: gauge(
                "tether_heap_inuse_bytes",
                "Bytes of the heap in live allocations (glibc mallinfo2: uordblks + hblkhd).",
            ),
            free: gauge(
                "tether_heap_free_bytes",
                "Bytes the heap holds free, not yet returned to the kernel (glibc mallinfo2: fordblks).",
            ),
        }
    }
}

impl Default for HeapCollector {
    fn default() -> Self {
        Self::new()
    }
}

impl prometheus::core::Collector for HeapCollector {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.inuse
            .desc()
            .into_iter()
            .chain(self.free.desc())
            .collect()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let Some((inuse, free)) = heap_stats() else {
            return Vec::new();
        };
        let clamp = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        self.inuse.set(clamp(inuse));
        self.free.set(clamp(free));
        self.inuse
            .collect()
            .into_iter()
            .chain(self.free.collect())
            .collect()
    }
}

/// Anonymous resident bytes of this process (resident minus file-backed and shared
/// pages, from `/proc/self/statm`); 0 where there is no such file.
fn anon_resident() -> u64 {
    let Ok(statm) = std::fs::read_to_string("/proc/self/statm") else {
        return 0;
    };
    let pages: Vec<u64> = statm
        .split_whitespace()
        .map_while(|v| v.parse().ok())
        .collect();
    match pages[..] {
        // The kernel's pages are 4 KiB wherever glibc is trimmed here.
        [_, resident, shared, ..] => resident.saturating_sub(shared) * 4096,
        _ => 0,
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
/// peak or less, by at least 256 tunnels; also once the process is idle (under 5% of a
/// CPU for a whole interval) and has, since the last trim, freed at least 256 KiB (the
/// heap's free bytes are that much above their lowest since) or grown its anonymous
/// resident memory by 256 KiB. Either only with at least 256 KiB of heap free. Runs until
/// `hard_stop`.
///
/// The free figure counts pages already handed back, so it cannot say what is resident;
/// its growth says what was freed since, resident until the next trim. Pages handed
/// back, faulted in again and freed between two looks leave it unchanged, but grow the
/// resident figure. An idle process that neither frees nor grows is not trimmed again,
/// and a little work (a few agents reconnecting) is still followed by a trim.
///
/// `looks` says how far apart the looks of an idle process may grow ([`Looks`]). Each
/// look wakes the process, which is most of what an idle agent costs (1-4 ms of CPU per
/// wake-up as the 2-core test VM's guest counts it).
pub fn spawn_trimmer(
    open: impl Fn() -> i64 + Send + 'static,
    looks: Looks,
    hard_stop: CancellationToken,
) {
    spawn_trimmer_every(INTERVAL, IDLE_INTERVAL, looks, open, hard_stop)
}

/// The wait before the next look: twice the last, up to `idle_interval`, while the
/// process stays idle with the same tunnel count (`quiet`); `interval` again once it
/// works or the count moves.
fn next_period(
    period: Duration,
    interval: Duration,
    idle_interval: Duration,
    quiet: bool,
) -> Duration {
    if quiet {
        (period * 2).min(idle_interval).max(interval)
    } else {
        interval
    }
}

/// How a wait between two looks ended.
#[derive(Debug, PartialEq, Eq)]
enum Waited {
    Period,
    /// Work started during a wait longer than `interval`: look again `interval` from now.
    WorkStarted,
    HardStop,
}

/// Waits `period`; a wait longer than `interval` also ends when `started` (if any) is
/// notified.
async fn wait(
    period: Duration,
    interval: Duration,
    started: Option<&Notify>,
    hard_stop: &CancellationToken,
) -> Waited {
    let work = async {
        match started {
            Some(started) if period > interval => started.notified().await,
            _ => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::time::sleep(period) => Waited::Period,
        _ = work => Waited::WorkStarted,
        _ = hard_stop.cancelled() => Waited::HardStop,
    }
}

fn spawn_trimmer_every(
    interval: Duration,
    idle_interval: Duration,
    looks: Looks,
    open: impl Fn() -> i64 + Send + 'static,
    hard_stop: CancellationToken,
) {
    let (idle_interval, started) = match looks {
        Looks::Steady => (interval, None),
        Looks::BackOff(started) => (idle_interval.max(interval), Some(started)),
    };
    tokio::spawn(
        async move {
            let mut peak = 0i64;
            let mut last_cpu = cpu_time();
            // The heap's free bytes and the anonymous resident bytes, each at their
            // lowest since the last trim.
            let mut free_low = heap_free().unwrap_or(0);
            let mut resident_low = anon_resident();
            let mut period = interval;
            let mut last_open = open();
            // When `last_cpu` was read: a wait cut short by work starting is followed
            // by a look `interval` later, so the time since is not one period.
            let mut last_look = tokio::time::Instant::now();
            loop {
                match wait(period, interval, started.as_deref(), &hard_stop).await {
                    Waited::Period => {}
                    Waited::WorkStarted => {
                        period = interval;
                        continue;
                    }
                    Waited::HardStop => return,
                }
                let now = open();
                let cpu = cpu_time();
                let idle = cpu.saturating_sub(last_cpu) <= last_look.elapsed() / IDLE_SHARE;
                last_cpu = cpu;
                last_look = tokio::time::Instant::now();
                period = next_period(period, interval, idle_interval, idle && now == last_open);
                last_open = now;
                peak = peak.max(now);
                let free = heap_free().unwrap_or(0);
                free_low = free_low.min(free);
                let freed = free - free_low;
                let resident = anon_resident();
                resident_low = resident_low.min(resident);
                let grown = resident - resident_low;
                let burst_over = peak - now >= MIN_DROP && now <= peak / 2;
                let went_idle = idle && (freed >= MIN_FREE || grown >= MIN_FREE as u64);
                if free >= MIN_FREE && (burst_over || went_idle) {
                    tokio::task::spawn_blocking(trim).await.ok();
                    period = interval;
                    last_cpu = cpu_time();
                    last_look = tokio::time::Instant::now();
                    free_low = heap_free().unwrap_or(0);
                    resident_low = anon_resident();
                    TRIMS.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(
                        peak,
                        now,
                        free,
                        freed,
                        grown,
                        resident_after = resident_low,
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
        anon_resident() / 1024
    }

    /// Allocates (and touches) `n` packet-sized buffers, then frees them all.
    fn churn(n: usize) {
        let bufs: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8; 32 * 1024]).collect();
        std::hint::black_box(&bufs);
    }

    fn heap_gauges(c: &HeapCollector) -> (i64, i64) {
        use prometheus::core::Collector;
        let families = c.collect();
        let value = |name: &str| {
            let f = families.iter().find(|f| f.name() == name).unwrap();
            f.get_metric()[0].get_gauge().get_value() as i64
        };
        (
            value("tether_heap_inuse_bytes"),
            value("tether_heap_free_bytes"),
        )
    }

    #[test]
    fn heap_gauges_follow_live_allocations() {
        let c = HeapCollector::new();
        let (before, _) = heap_gauges(&c);
        // 64 MiB is always its own mapping: the brk heap the other test trims is untouched.
        let big = vec![1u8; 64 << 20];
        std::hint::black_box(&big);
        let (held, free) = heap_gauges(&c);
        assert!(held - before >= 60 << 20, "{before} -> {held}");
        assert!(free >= 0);
        drop(big);
        let (after, _) = heap_gauges(&c);
        assert!(held - after >= 60 << 20, "{held} -> {after}");
    }

    #[test]
    fn looks_back_off_while_quiet_and_return_on_work() {
        let (step, cap) = (INTERVAL, IDLE_INTERVAL);
        let mut period = step;
        let mut waits = Vec::new();
        for _ in 0..6 {
            period = next_period(period, step, cap, true);
            waits.push(period.as_secs());
        }
        assert_eq!(waits, [4, 8, 16, 32, 32, 32]);
        assert_eq!(next_period(period, step, cap, false), step);
        // Steady looks cap at the interval itself: they never back off.
        assert_eq!(next_period(step, step, step, true), step);
    }

    #[tokio::test(start_paused = true)]
    async fn work_starting_cuts_a_long_wait_short() {
        let signal = tether_core::drain::Signal::new();
        let started = signal.started();
        let hard_stop = CancellationToken::new();
        let long = wait(IDLE_INTERVAL, INTERVAL, Some(&started), &hard_stop);
        let mut long = std::pin::pin!(long);
        assert!(futures::poll!(long.as_mut()).is_pending());
        let _work = signal.watch();
        assert_eq!(long.await, Waited::WorkStarted);
        // A 2 s wait is not cut short, and runs out.
        let short = wait(INTERVAL, INTERVAL, Some(&started), &hard_stop);
        let mut short = std::pin::pin!(short);
        assert!(futures::poll!(short.as_mut()).is_pending());
        let _more = signal.watch();
        assert_eq!(short.await, Waited::Period);
        // Steady looks have no signal: a long wait only runs out.
        let steady = wait(IDLE_INTERVAL, INTERVAL, None, &hard_stop);
        let mut steady = std::pin::pin!(steady);
        assert!(futures::poll!(steady.as_mut()).is_pending());
        let _again = signal.watch();
        assert_eq!(steady.await, Waited::Period);
        hard_stop.cancel();
        assert_eq!(
            wait(IDLE_INTERVAL, INTERVAL, Some(&started), &hard_stop).await,
            Waited::HardStop
        );
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

        // The trimmer starts with the process, before the work.
        let hard_stop = CancellationToken::new();
        spawn_trimmer_every(
            Duration::from_millis(20),
            Duration::from_millis(320),
            Looks::BackOff(Arc::new(Notify::new())),
            || 0,
            hard_stop.clone(),
        );
        tokio::task::yield_now().await;

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
        let trims = TRIMS.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TRIMS.load(Ordering::Relaxed) == trims || rss_anon_kib() + 4 * 1024 > busy {
            assert!(
                Instant::now() < deadline,
                "free heap never given back: RssAnon {busy} KiB -> {} KiB",
                rss_anon_kib()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        // A little work after that trim (far less CPU than the busy threshold): 1 MiB
        // of new holes, given back too.
        let mut more: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8; 32 * 1024]).collect();
        for (i, b) in more.drain(..).enumerate() {
            if i % 2 == 0 {
                keep.push(b);
            }
        }
        let worked = rss_anon_kib();
        let trims = TRIMS.load(Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        while TRIMS.load(Ordering::Relaxed) == trims || rss_anon_kib() + 512 > worked {
            assert!(
                Instant::now() < deadline,
                "the frees after a little work never given back: RssAnon {worked} KiB -> {} KiB",
                rss_anon_kib()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        std::hint::black_box(&keep);
        hard_stop.cancel();
    }
}

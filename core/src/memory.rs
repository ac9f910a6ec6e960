//! Giving memory back after a burst: when the number of open tunnels has fallen well
//! below its recent peak, the allocator is asked to return its free pages to the
//! kernel (glibc keeps them otherwise, so RSS would stay at the peak forever).

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How often the tunnel count is looked at.
const INTERVAL: Duration = Duration::from_secs(2);

/// Fewer closed tunnels than this since the peak are not worth a trim.
const MIN_DROP: i64 = 256;

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
/// peak or less, by at least 256 tunnels. Runs until `shutdown`.
pub fn spawn_trimmer(open: impl Fn() -> i64 + Send + 'static, shutdown: CancellationToken) {
    tokio::spawn(
        async move {
            let mut peak = 0i64;
            let mut tick = tokio::time::interval(INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = shutdown.cancelled() => return,
                }
                let now = open();
                peak = peak.max(now);
                if peak - now >= MIN_DROP && now <= peak / 2 {
                    tokio::task::spawn_blocking(trim);
                    tracing::debug!(
                        peak,
                        now,
                        "tunnels closed; returned free memory to the kernel"
                    );
                    peak = now;
                }
            }
        }
        .instrument(tracing::info_span!("memory_trim")),
    );
}

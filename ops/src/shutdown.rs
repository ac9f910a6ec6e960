//! Signal helpers for a process's end: SIGINT/SIGTERM cancels the process's `drain`
//! token (graceful); its `hard_stop` (everything ends now) follows once the drain is
//! over or timed out (the agent's also at a second signal). See `tether_core::drain`.

pub use tokio_util::sync::CancellationToken;

/// Resolves on the next SIGINT or SIGTERM.
pub async fn signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("install SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("received SIGTERM"),
        _ = int.recv() => tracing::info!("received SIGINT"),
    }
}

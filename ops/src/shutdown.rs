//! Shutdown helpers: a cancellation token is handed to every server and task; the
//! binary cancels it on SIGINT/SIGTERM.

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

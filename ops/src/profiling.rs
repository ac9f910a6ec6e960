//! pprof endpoints for the admin port (`--enable-profiling`): `/debug/pprof/profile`
//! samples the CPU for `?seconds=N` (default 30, as Go) and `/debug/pprof/heap` answers
//! the sampled heap (see `heap_profile`), both in the pprof protobuf that `go tool
//! pprof` and every pprof viewer read. Symbols are resolved per request and their
//! cache dropped after it.

use std::time::Duration;

use axum::extract::Query;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

/// Samples per second, as Go's runtime/pprof.
const FREQUENCY: i32 = 100;
/// Longest profile served.
const MAX_SECONDS: u64 = 600;

/// The `/debug/pprof/` routes, to merge into an admin router; heap sampling starts
/// with them.
pub fn router() -> Router {
    crate::heap_profile::enable();
    Router::new()
        .route("/debug/pprof/", get(index))
        .route("/debug/pprof/profile", get(profile))
        .route("/debug/pprof/heap", get(heap))
}

async fn index() -> &'static str {
    "Tether pprof endpoints:\n  /debug/pprof/profile?seconds=N  CPU profile (pprof protobuf)\n  /debug/pprof/heap               sampled heap since profiling started (pprof protobuf)\n"
}

async fn heap() -> impl IntoResponse {
    if !crate::heap_profile::available() {
        return (
            StatusCode::NOT_IMPLEMENTED,
            [(header::CONTENT_TYPE, "text/plain")],
            b"heap profiling needs the tether binary's sampling allocator\n".to_vec(),
        );
    }
    let written = tokio::task::spawn_blocking(crate::heap_profile::profile)
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
    answer(written, "Could not write the heap profile")
}

/// A profile, or a plain-text 500 saying `what` failed.
fn answer(
    written: Result<Vec<u8>, String>,
    what: &str,
) -> (StatusCode, [(header::HeaderName, &'static str); 1], Vec<u8>) {
    match written {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/octet-stream")],
            body,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            format!("{what}: {e}\n").into_bytes(),
        ),
    }
}

async fn profile(Query(q): Query<std::collections::HashMap<String, String>>) -> impl IntoResponse {
    let seconds = match q.get("seconds").map(|s| s.parse::<u64>()) {
        None => Ok(30),
        Some(r) => r,
    };
    let Ok(seconds @ 1..=MAX_SECONDS) = seconds else {
        return (
            StatusCode::BAD_REQUEST,
            [(header::CONTENT_TYPE, "text/plain")],
            format!("seconds must be 1..={MAX_SECONDS}\n").into_bytes(),
        );
    };
    answer(
        cpu_profile(Duration::from_secs(seconds)).await,
        "Could not enable CPU profiling",
    )
}

/// Samples every thread's stack for `duration`; the pprof protobuf.
pub async fn cpu_profile(duration: Duration) -> Result<Vec<u8>, String> {
    let guard = pprof::ProfilerGuardBuilder::default()
        .frequency(FREQUENCY)
        .blocklist(&["libc", "libgcc", "pthread", "vdso"])
        .build()
        .map_err(|e| e.to_string())?;
    tokio::time::sleep(duration).await;
    let report = guard.report().build();
    drop(guard);
    let profile = report.and_then(|r| r.pprof());
    drop_symbols();
    use pprof::protos::Message;
    profile
        .map_err(|e| e.to_string())?
        .write_to_bytes()
        .map_err(|e| e.to_string())
}

/// Drops the symbol cache that resolving a profile's addresses filled: the binary's
/// parsed debug info, about 67 MiB for the `tether` binary, which would otherwise stay
/// for the life of the process after the first profile was asked for. Each profile
/// then parses it again (a second or so).
pub(crate) fn drop_symbols() {
    backtrace::clear_symbol_cache();
}

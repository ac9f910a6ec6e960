//! pprof endpoints for the admin port (`--enable-profiling`): `/debug/pprof/profile`
//! samples the CPU for `?seconds=N` (default 30, as Go) and `/debug/pprof/heap` (and
//! `allocs`, the same profile) answers the sampled heap (see `heap_profile`), both in
//! the pprof protobuf that `go tool pprof` and every pprof viewer read.
//! `/debug/pprof/goroutine` lists the process's threads and its live tokio tasks, the
//! closest a Rust process has to goroutines. Go's other profiles answer 404 with one
//! line saying why. Symbols are resolved per request and their cache dropped after it.

use std::time::Duration;
use tether_core::error::chain;

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
        // Go's ServeMux redirects the bare path to the subtree (301).
        .route(
            "/debug/pprof",
            get(|| async {
                (
                    StatusCode::MOVED_PERMANENTLY,
                    [(header::LOCATION, "/debug/pprof/")],
                )
            }),
        )
        .route("/debug/pprof/", get(index))
        .route("/debug/pprof/profile", get(profile))
        .route("/debug/pprof/heap", get(heap))
        .route("/debug/pprof/allocs", get(heap))
        .route("/debug/pprof/goroutine", get(goroutine))
        // As Go's: the command line, arguments separated by NUL bytes.
        .route(
            "/debug/pprof/cmdline",
            get(|| async {
                std::env::args_os()
                    .map(|a| a.to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join("\0")
            }),
        )
        .route("/debug/pprof/{name}", get(missing))
}

async fn index() -> &'static str {
    "Tether pprof endpoints:\n  /debug/pprof/profile?seconds=N  CPU profile (pprof protobuf)\n  /debug/pprof/heap               sampled heap since profiling started (pprof protobuf)\n  /debug/pprof/allocs             the same heap profile (its alloc_* samples)\n  /debug/pprof/goroutine          threads and live tokio tasks (pprof protobuf; ?debug=1 text)\n"
}

/// Go's profiles a Rust process has no counterpart for: one line saying why.
async fn missing(axum::extract::Path(name): axum::extract::Path<String>) -> impl IntoResponse {
    let why = match name.as_str() {
        "block" | "mutex" => "Tether has no lock contention profile (Go's runtime records blocking; Rust's locks do not)",
        "threadcreate" => "threads are listed with their state in /debug/pprof/goroutine",
        "trace" => "Go execution traces have no Rust counterpart; use /debug/pprof/profile",
        "symbol" => "profiles are served symbolised; there is nothing to look up",
        _ => "no such profile",
    };
    (
        StatusCode::NOT_FOUND,
        [(header::CONTENT_TYPE, "text/plain")],
        format!("{name}: {why}\n"),
    )
}

/// One thread of this process, from `/proc/self/task`.
struct Thread {
    name: String,
    state: String,
    wchan: String,
}

fn threads() -> Vec<Thread> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in dir.flatten() {
        let path = entry.path();
        let read = |f: &str| {
            std::fs::read_to_string(path.join(f))
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        };
        let state = read("status")
            .lines()
            .find_map(|l| l.strip_prefix("State:").map(|s| s.trim().to_string()))
            .unwrap_or_default();
        let wchan = read("wchan");
        out.push(Thread {
            name: read("comm"),
            state,
            wchan: if wchan.is_empty() || wchan == "0" {
                "-".into()
            } else {
                wchan
            },
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// `/debug/pprof/goroutine`: a `goroutine`/`count` profile with one sample per thread
/// (its stack: state, then name) and one counting the runtime's live tokio tasks;
/// `?debug=1` (or 2) the same as text.
async fn goroutine(
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> impl IntoResponse {
    let tasks = tokio::runtime::Handle::try_current()
        .map(|h| h.metrics().num_alive_tasks())
        .unwrap_or(0);
    let threads = threads();
    if q.get("debug").is_some_and(|d| d != "0") {
        let mut text = format!("threads: {}\ntokio tasks alive: {tasks}\n\n", threads.len());
        for t in &threads {
            text.push_str(&format!(
                "thread {:<16} {:<16} wchan {}\n",
                t.name, t.state, t.wchan
            ));
        }
        return (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain")],
            text.into_bytes(),
        );
    }
    use pprof::protos::{self, Message};
    let mut strings = crate::heap_profile::Strings::default();
    strings.id("");
    let mut profile = protos::Profile {
        sample_type: vec![protos::ValueType {
            ty: strings.id("goroutine"),
            unit: strings.id("count"),
            ..Default::default()
        }],
        ..Default::default()
    };
    let frame =
        |profile: &mut protos::Profile, strings: &mut crate::heap_profile::Strings, name: &str| {
            let id = profile.function.len() as u64 + 1;
            profile.function.push(protos::Function {
                id,
                name: strings.id(name),
                system_name: strings.id(name),
                ..Default::default()
            });
            profile.location.push(protos::Location {
                id,
                line: vec![protos::Line {
                    function_id: id,
                    ..Default::default()
                }],
                ..Default::default()
            });
            id
        };
    for t in &threads {
        let state = frame(
            &mut profile,
            &mut strings,
            &format!("{} wchan {}", t.state, t.wchan),
        );
        let name = frame(&mut profile, &mut strings, &format!("thread {}", t.name));
        profile.sample.push(protos::Sample {
            location_id: vec![state, name],
            value: vec![1],
            ..Default::default()
        });
    }
    let runtime = frame(&mut profile, &mut strings, "tokio tasks alive");
    profile.sample.push(protos::Sample {
        location_id: vec![runtime],
        value: vec![tasks as i64],
        ..Default::default()
    });
    profile.string_table = strings.table;
    answer(
        profile.write_to_bytes().map_err(|e| chain(&e).to_string()),
        "Could not write the goroutine profile",
    )
}

async fn heap() -> impl IntoResponse {
    if !crate::heap_profile::available() {
        return (
            StatusCode::NOT_IMPLEMENTED,
            [(header::CONTENT_TYPE, "text/plain")],
            b"heap profiling needs the tether binary's sampling allocator\n".to_vec(),
        );
    }
    let written = tokio::task::spawn_blocking(|| {
        let written = crate::heap_profile::profile();
        drop_symbols();
        written
    })
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
        .map_err(|e| chain(&e).to_string())?;
    tokio::time::sleep(duration).await;
    let report = guard.report().build();
    drop(guard);
    let profile = report.and_then(|r| r.pprof());
    drop_symbols();
    use pprof::protos::Message;
    profile
        .map_err(|e| chain(&e).to_string())?
        .write_to_bytes()
        .map_err(|e| chain(&e).to_string())
}

/// Drops the symbol cache that resolving a profile's addresses filled: the binary's
/// parsed debug info, about 67 MiB for the `tether` binary, which would otherwise stay
/// for the life of the process after the first profile was asked for. Each profile
/// then parses it again (a second or so).
pub(crate) fn drop_symbols() {
    backtrace::clear_symbol_cache();
}

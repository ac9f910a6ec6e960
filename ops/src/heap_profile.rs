//! Sampled heap profiling for `/debug/pprof/heap`: a global-allocator wrapper that,
//! once enabled (`--enable-profiling`), records about one allocation per 512 KiB
//! allocated (Go's default `MemProfileRate`) with its call stack, and renders allocated
//! and in-use totals per stack as the pprof protobuf Go's heap profile is. Disabled, it
//! costs one relaxed atomic load per allocation and free.

use std::alloc::{GlobalAlloc, Layout};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use tether_core::error::chain;

/// Mean bytes allocated between two samples.
pub const RATE: u64 = 512 * 1024;
/// Frames kept per sampled stack.
const MAX_DEPTH: usize = 64;
/// Counters of sampled live addresses by hash: a free looks at the table only when its
/// address's counter is non-zero.
const FILTER_BITS: u32 = 14;

static INSTALLED: AtomicBool = AtomicBool::new(false);
static ENABLED: AtomicBool = AtomicBool::new(false);
static FILTER: [AtomicU32; 1 << FILTER_BITS] = [const { AtomicU32::new(0) }; 1 << FILTER_BITS];
static TABLE: Mutex<Option<Table>> = Mutex::new(None);

thread_local! {
    /// Bytes this thread may still allocate before its next sample (signed: it goes
    /// below zero when a sample is due).
    static UNTIL_SAMPLE: Cell<i64> = const { Cell::new(0) };
    /// xorshift state for the sampling intervals.
    static RNG: Cell<u64> = const { Cell::new(0) };
    /// Set while this thread is inside the profiler, so its own allocations are
    /// neither sampled nor looked up.
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// Totals for one call stack (raw sample counts, scaled at render time).
#[derive(Default, Clone, Copy)]
struct Stats {
    alloc_objects: u64,
    alloc_bytes: u64,
    inuse_objects: u64,
    inuse_bytes: u64,
}

#[derive(Default)]
struct Table {
    index: HashMap<Box<[usize]>, usize>,
    stacks: Vec<(Box<[usize]>, Stats)>,
    /// Sampled live allocations: address -> (stack index, size).
    live: HashMap<usize, (usize, u64)>,
}

/// The allocator wrapper: `#[global_allocator] static A: Sampling<System> = Sampling(System);`
/// in a binary, then [`mark_installed`] at start-up.
pub struct Sampling<A>(pub A);

/// Says the binary's global allocator is [`Sampling`], so `/debug/pprof/heap` can serve.
pub fn mark_installed() {
    INSTALLED.store(true, Ordering::Relaxed);
}

/// Starts sampling (`--enable-profiling`). False when the allocator is not installed.
pub fn enable() -> bool {
    ENABLED.store(true, Ordering::Relaxed);
    INSTALLED.load(Ordering::Relaxed)
}

/// Is a heap profile available?
pub fn available() -> bool {
    INSTALLED.load(Ordering::Relaxed) && ENABLED.load(Ordering::Relaxed)
}

fn filter_slot(addr: usize) -> &'static AtomicU32 {
    let h = ((addr as u64) >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - FILTER_BITS);
    &FILTER[h as usize]
}

/// An exponentially distributed interval with mean RATE, as Go's sampler draws.
fn next_interval() -> i64 {
    let mut x = RNG.with(|r| r.get());
    if x == 0 {
        x = (&RNG as *const _ as u64) ^ 0x2545_F491_4F6C_DD1D;
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    RNG.with(|r| r.set(x));
    let u = ((x >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    (-u.ln() * RATE as f64) as i64
}

/// Runs `f` with this thread marked busy; None when it already was.
fn guarded<T>(f: impl FnOnce() -> T) -> Option<T> {
    if BUSY.with(|b| b.replace(true)) {
        return None;
    }
    let out = f();
    BUSY.with(|b| b.set(false));
    Some(out)
}

fn maybe_sample(ptr: *mut u8, size: usize) {
    if ptr.is_null() || !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    let left = UNTIL_SAMPLE.with(|c| c.get()) - size as i64;
    if left > 0 {
        UNTIL_SAMPLE.with(|c| c.set(left));
        return;
    }
    UNTIL_SAMPLE.with(|c| c.set(next_interval()));
    guarded(|| {
        let mut ips = [0usize; MAX_DEPTH];
        let mut n = 0;
        // SAFETY: no other thread is unwinding through our closure's state; the
        // unsynchronized variant is used because the synchronized one may allocate.
        #[allow(unsafe_code)]
        unsafe {
            backtrace::trace_unsynchronized(|frame| {
                ips[n] = frame.ip() as usize;
                n += 1;
                n < MAX_DEPTH
            });
        }
        record(ptr as usize, size as u64, &ips[..n]);
    });
}

fn record(addr: usize, size: u64, ips: &[usize]) {
    let mut guard = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    let table = guard.get_or_insert_with(Table::default);
    let i = match table.index.get(ips) {
        Some(i) => *i,
        None => {
            let i = table.stacks.len();
            table.stacks.push((ips.into(), Stats::default()));
            table.index.insert(ips.into(), i);
            i
        }
    };
    let s = &mut table.stacks[i].1;
    s.alloc_objects += 1;
    s.alloc_bytes += size;
    s.inuse_objects += 1;
    s.inuse_bytes += size;
    if let Some((old, old_size)) = table.live.insert(addr, (i, size)) {
        // Freed while the profiler was busy on this thread: forget the old record.
        let s = &mut table.stacks[old].1;
        s.inuse_objects -= 1;
        s.inuse_bytes -= old_size;
    } else {
        filter_slot(addr).fetch_add(1, Ordering::Relaxed);
    }
}

fn untrack(ptr: *mut u8) {
    let slot = filter_slot(ptr as usize);
    if slot.load(Ordering::Relaxed) == 0 {
        return;
    }
    guarded(|| {
        let mut guard = TABLE.lock().unwrap_or_else(|e| e.into_inner());
        let Some(table) = guard.as_mut() else { return };
        if let Some((i, size)) = table.live.remove(&(ptr as usize)) {
            let s = &mut table.stacks[i].1;
            s.inuse_objects -= 1;
            s.inuse_bytes -= size;
            slot.fetch_sub(1, Ordering::Relaxed);
        }
    });
}

// SAFETY: every method forwards to the wrapped allocator with the caller's arguments;
// the bookkeeping never touches the memory handed out.
#[allow(unsafe_code)]
unsafe impl<A: GlobalAlloc> GlobalAlloc for Sampling<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc(layout) };
        maybe_sample(p, layout.size());
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { self.0.alloc_zeroed(layout) };
        maybe_sample(p, layout.size());
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // Before the free: once freed, another thread may be handed the address.
        if ENABLED.load(Ordering::Relaxed) {
            untrack(ptr);
        }
        unsafe { self.0.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !ENABLED.load(Ordering::Relaxed) {
            return unsafe { self.0.realloc(ptr, layout, new_size) };
        }
        untrack(ptr);
        let p = unsafe { self.0.realloc(ptr, layout, new_size) };
        maybe_sample(p, new_size);
        p
    }
}

/// The heap profile as Go writes it (sample types alloc_objects, alloc_space,
/// inuse_objects, inuse_space; period 512 KiB of space), values scaled from the
/// samples to estimates of the whole heap. Resolving its addresses fills the symbol
/// cache; the caller drops it (`profiling` does, after each profile).
pub fn profile() -> Result<Vec<u8>, String> {
    use pprof::protos::{self, Message};
    let stacks: Vec<(Box<[usize]>, Stats)> = guarded(|| {
        let guard = TABLE.lock().unwrap_or_else(|e| e.into_inner());
        guard.as_ref().map(|t| t.stacks.clone()).unwrap_or_default()
    })
    .ok_or("heap profile requested from inside the allocator")?;

    let mut strings = Strings::default();
    strings.id("");
    let value_type = |s: &mut Strings, ty: &str, unit: &str| protos::ValueType {
        ty: s.id(ty),
        unit: s.id(unit),
        ..Default::default()
    };
    let mut profile = protos::Profile {
        sample_type: vec![
            value_type(&mut strings, "alloc_objects", "count"),
            value_type(&mut strings, "alloc_space", "bytes"),
            value_type(&mut strings, "inuse_objects", "count"),
            value_type(&mut strings, "inuse_space", "bytes"),
        ],
        period_type: protobuf::MessageField::some(value_type(&mut strings, "space", "bytes")),
        period: RATE as i64,
        time_nanos: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0),
        ..Default::default()
    };
    profile.default_sample_type = strings.id("inuse_space");
    let mut locations: HashMap<usize, Option<u64>> = HashMap::new();
    let mut functions: HashMap<String, u64> = HashMap::new();
    for (ips, stats) in stacks {
        let ids: Vec<u64> = ips
            .iter()
            .filter_map(|ip| {
                *locations
                    .entry(*ip)
                    .or_insert_with(|| location(*ip, &mut profile, &mut strings, &mut functions))
            })
            .collect();
        // Drop the unwinder's, the profiler's and the allocator shim's own frames.
        let cut = ids
            .iter()
            .rposition(|id| {
                location_names(&profile, &strings, *id)
                    .iter()
                    .any(|n| is_allocator_frame(n))
            })
            .map_or(0, |i| i + 1);
        let location_id = ids[cut..].to_vec();
        if location_id.is_empty() {
            continue;
        }
        profile.sample.push(protos::Sample {
            location_id,
            value: scaled(stats),
            ..Default::default()
        });
    }
    profile.string_table = strings.table;
    profile.write_to_bytes().map_err(|e| chain(&e).to_string())
}

fn is_allocator_frame(name: &str) -> bool {
    ["heap_profile", "__rust_alloc", "__rust_realloc", "__rg_"]
        .iter()
        .any(|p| name.contains(p))
}

/// Go's `scaleHeapSample`: each sampled object stood for 1/(1-e^(-size/rate)) objects.
fn scaled(s: Stats) -> Vec<i64> {
    let scale = |count: u64, bytes: u64| -> (i64, i64) {
        if count == 0 || bytes == 0 {
            return (0, 0);
        }
        let avg = bytes as f64 / count as f64;
        let k = 1.0 / (1.0 - (-avg / RATE as f64).exp());
        ((count as f64 * k) as i64, (bytes as f64 * k) as i64)
    };
    let (ao, ab) = scale(s.alloc_objects, s.alloc_bytes);
    let (io, ib) = scale(s.inuse_objects, s.inuse_bytes);
    vec![ao, ab, io, ib]
}

/// Adds the location (and its functions, inlined frames included) for `ip`.
fn location(
    ip: usize,
    profile: &mut pprof::protos::Profile,
    strings: &mut Strings,
    functions: &mut HashMap<String, u64>,
) -> Option<u64> {
    let mut lines = Vec::new();
    // Return addresses point after the call; look up the call itself.
    backtrace::resolve((ip.saturating_sub(1)) as *mut std::ffi::c_void, |symbol| {
        let name = symbol
            .name()
            .map(|n| format!("{n:#}"))
            .unwrap_or_else(|| format!("{ip:#x}"));
        let file = symbol
            .filename()
            .map(|f| f.display().to_string())
            .unwrap_or_default();
        let next = functions.len() as u64 + 1;
        let function_id = *functions.entry(name.clone()).or_insert_with(|| {
            profile.function.push(pprof::protos::Function {
                id: next,
                name: strings.id(&name),
                system_name: strings.id(&name),
                filename: strings.id(&file),
                ..Default::default()
            });
            next
        });
        lines.push(pprof::protos::Line {
            function_id,
            line: i64::from(symbol.lineno().unwrap_or(0)),
            ..Default::default()
        });
    });
    if lines.is_empty() {
        return None;
    }
    let id = profile.location.len() as u64 + 1;
    profile.location.push(pprof::protos::Location {
        id,
        address: ip as u64,
        line: lines,
        ..Default::default()
    });
    Some(id)
}

fn location_names<'a>(
    profile: &'a pprof::protos::Profile,
    strings: &'a Strings,
    id: u64,
) -> Vec<&'a str> {
    let loc = &profile.location[(id - 1) as usize];
    loc.line
        .iter()
        .map(|l| {
            let f = &profile.function[(l.function_id - 1) as usize];
            strings.table[f.name as usize].as_str()
        })
        .collect()
}

/// A pprof string table under construction (index 0 is "").
#[derive(Default)]
pub(crate) struct Strings {
    pub(crate) table: Vec<String>,
    ids: HashMap<String, i64>,
}

impl Strings {
    /// The index of `s`, added when new.
    pub(crate) fn id(&mut self, s: &str) -> i64 {
        if let Some(i) = self.ids.get(s) {
            return *i;
        }
        let i = self.table.len() as i64;
        self.table.push(s.to_string());
        self.ids.insert(s.to_string(), i);
        i
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaling_follows_go() {
        // A 512 KiB object is sampled with probability 1 - 1/e.
        let v = scaled(Stats {
            alloc_objects: 1,
            alloc_bytes: RATE,
            inuse_objects: 1,
            inuse_bytes: RATE,
        });
        assert_eq!(v[0], 1);
        assert!((v[1] - (RATE as f64 / (1.0 - (-1f64).exp())) as i64).abs() <= 1);
        // Huge objects count once.
        let v = scaled(Stats {
            alloc_objects: 2,
            alloc_bytes: 200 * RATE,
            ..Default::default()
        });
        assert_eq!((v[0], v[2]), (2, 0));
    }

    #[test]
    fn intervals_average_the_rate() {
        let n = 20_000;
        let mean = (0..n).map(|_| next_interval() as f64).sum::<f64>() / n as f64;
        assert!((mean / RATE as f64 - 1.0).abs() < 0.05, "{mean}");
    }
}

//! What `/proc` says about a process: its CPU time, its memory, its children.

/// `/proc/PID/stat` fields after the command name (which may hold spaces).
pub(crate) fn stat_fields(pid: u32) -> Vec<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

/// User plus system CPU seconds of `pid` (clock ticks are 1/100 s on Linux).
pub(crate) fn cpu_seconds(pid: u32) -> f64 {
    let f = stat_fields(pid);
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Fields 14 and 15 of stat(5), counted from the state field (3).
    (ticks(11) + ticks(12)) / 100.0
}

/// `pids` and every process below them.
pub(crate) fn with_descendants(pids: &[u32]) -> Vec<u32> {
    let mut all = pids.to_vec();
    let procs: Vec<(u32, u32)> = std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(|pid| Some((pid, stat_fields(pid).get(1)?.parse().ok()?)))
                .collect()
        })
        .unwrap_or_default();
    let mut i = 0;
    while i < all.len() {
        let parent = all[i];
        all.extend(
            procs
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    all
}

/// One field of `/proc/PID/status` (kB there), in MiB.
pub(crate) fn status_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

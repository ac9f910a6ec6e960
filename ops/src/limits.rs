//! Process resource limits: the open-file limit raised to what the host allows at
//! start-up, as every Go program (upstream's server and agent among them) does since Go
//! 1.19, so a drop-in replacement does not stop accepting agents at the 1,024
//! descriptors a systemd unit or a container runtime may leave as the soft limit.

use std::io;

/// The open-file limit before and after [`raise_open_files`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFiles {
    /// The soft limit found at start-up.
    pub was: u64,
    /// The soft limit now.
    pub now: u64,
    /// The hard limit (what an unprivileged process may raise its soft limit to).
    pub hard: u64,
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (capped at `fs.nr_open`, the most
/// the kernel accepts, when the hard limit is unlimited).
pub fn raise_open_files() -> io::Result<OpenFiles> {
    let (was, hard) = get()?;
    let want = target(was, hard, nr_open());
    if want > was {
        set(want, hard)?;
    }
    let (now, hard) = get()?;
    Ok(OpenFiles { was, now, hard })
}

/// The open-file soft limit the process has now.
pub fn open_file_limit() -> io::Result<u64> {
    Ok(get()?.0)
}

/// The soft limit to ask for: the hard limit, or `nr_open` if that is lower.
fn target(soft: u64, hard: u64, nr_open: Option<u64>) -> u64 {
    let most = nr_open.map_or(hard, |n| hard.min(n));
    most.max(soft)
}

fn nr_open() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[allow(unsafe_code)]
fn get() -> io::Result<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((lim.rlim_cur, lim.rlim_max))
}

#[allow(unsafe_code)]
fn set(soft: u64, hard: u64) -> io::Result<()> {
    let lim = libc::rlimit {
        rlim_cur: soft,
        rlim_max: hard,
    };
    // SAFETY: setrlimit only reads the struct we pass.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_goes_to_the_hard_limit_within_what_the_kernel_accepts() {
        assert_eq!(target(1024, 524_288, Some(1_048_576)), 524_288);
        // An unlimited hard limit: the kernel refuses more than fs.nr_open.
        assert_eq!(
            target(1024, libc::RLIM_INFINITY, Some(1_048_576)),
            1_048_576
        );
        assert_eq!(target(1024, 4096, None), 4096);
        // Never lowered.
        assert_eq!(target(8192, 8192, Some(1_048_576)), 8192);
        assert_eq!(
            target(2_000_000, libc::RLIM_INFINITY, Some(1_048_576)),
            2_000_000
        );
    }

    #[test]
    fn raising_reports_the_limits_the_process_has() {
        let limits = raise_open_files().unwrap();
        assert_eq!((limits.now, limits.hard), get().unwrap());
        assert!(limits.now >= limits.was);
    }
}

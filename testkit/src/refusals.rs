//! Counting the connections an address refuses (its SYN answered by a reset) while
//! it moves between holders: a thread inside a node's namespace connecting every few
//! milliseconds. A dropped SYN is sent again by the client; a reset fails it at once.

use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A running count of refused connections to one address (see [`Refusals::start`]).
pub struct Refusals {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<std::io::Result<(usize, Vec<Duration>)>>,
}

impl Refusals {
    /// Connects to `addr` from network namespace `ns` (a name under /var/run/netns)
    /// every 5 ms, each given 100 ms, until [`Refusals::finish`].
    pub fn start(ns: &str, addr: SocketAddr) -> Refusals {
        let stop = Arc::new(AtomicBool::new(false));
        let (s, ns) = (stop.clone(), ns.to_string());
        let thread = std::thread::spawn(move || {
            crate::netns::enter(&ns)?;
            let start = Instant::now();
            let (mut tries, mut refused) = (0, Vec::new());
            while !s.load(Ordering::Relaxed) {
                let at = Instant::now();
                tries += 1;
                if let Err(e) = TcpStream::connect_timeout(&addr, Duration::from_millis(100)) {
                    if e.kind() == std::io::ErrorKind::ConnectionRefused {
                        refused.push(start.elapsed());
                    }
                }
                // Pacing, not synchronisation.
                std::thread::sleep(Duration::from_millis(5).saturating_sub(at.elapsed()));
            }
            Ok((tries, refused))
        });
        Refusals { stop, thread }
    }

    /// Stops: how many connections were tried, and when (since the start) each refused
    /// one was.
    pub fn finish(self) -> (usize, Vec<Duration>) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .expect("the refusal counter's thread")
            .unwrap_or_else(|e| panic!("cannot enter the client's namespace: {e}"))
    }
}

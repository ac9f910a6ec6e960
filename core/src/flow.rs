//! Per-connection flow control on the agent link: send credit ([`Credit`]) and the
//! receive window ([`Window`]) of one tunnelled connection.
//!
//! Between two Tether peers (negotiated with the `tether-flow-window` header) every
//! connection starts with the peer's advertised window as send credit; the receiver
//! returns credit with WINDOW_UPDATE as bytes leave its queue, so a connection whose
//! reader stalls stops only itself, and at most one window is ever queued for it. With
//! an upstream peer there is no credit: the receiver's queue is capped instead, and a
//! connection whose queue stays full past the stall timeout is closed with an error
//! (upstream would block the whole stream for as long as the reader sleeps).
//!
//! [`ConnFlow`] is both halves for one connection, the same type at the server and at
//! the agent.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

pub use tether_proto::link::{DEFAULT_WINDOW, WINDOW_RANGE};

/// Queue cap per connection when the peer is upstream (no credit).
pub const FALLBACK_QUEUE: i64 = 4 << 20;

/// Default for `--stalled-reader-timeout`.
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How much one connection may still send. One task waits on it (the connection's
/// reader); WINDOW_UPDATE handlers add to it.
#[derive(Debug)]
pub struct Credit {
    avail: AtomicI64,
    closed: AtomicBool,
    notify: Notify,
}

impl Credit {
    /// Credit of `initial` bytes.
    pub fn new(initial: u32) -> Self {
        Credit {
            avail: AtomicI64::new(initial as i64),
            closed: AtomicBool::new(false),
            notify: Notify::new(),
        }
    }

    /// Waits until some credit is left; false once the connection is closed.
    pub async fn ready(&self) -> bool {
        loop {
            if self.closed.load(Ordering::Acquire) {
                return false;
            }
            if self.avail.load(Ordering::Acquire) > 0 {
                return true;
            }
            // notify_one stores a permit, so a grant between the check and here is
            // not lost.
            self.notify.notified().await;
        }
    }

    /// Takes `n` bytes (the last packet may overdraw; the next waits).
    pub fn spend(&self, n: usize) {
        self.avail.fetch_sub(n as i64, Ordering::AcqRel);
    }

    /// Adds `n` bytes of credit.
    pub fn grant(&self, n: i64) {
        if n > 0 {
            self.avail.fetch_add(n, Ordering::AcqRel);
            self.notify.notify_one();
        }
    }

    /// Wakes the waiter for good: the connection is gone.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.notify.notify_one();
    }

    /// Credit left (negative when overdrawn).
    pub fn available(&self) -> i64 {
        self.avail.load(Ordering::Acquire)
    }
}

/// What happened to DATA offered to a [`Window`].
#[derive(Debug, PartialEq, Eq)]
pub enum Admit {
    /// Queue it.
    Ok,
    /// A credit-based peer sent more than the window it was given: a protocol
    /// violation; close the connection.
    Overrun,
    /// No credit (upstream peer) and the queue stayed full for the stall timeout.
    Stalled,
    /// The connection was closed meanwhile; drop the data.
    Closed,
}

/// The receive side of one connection: bytes queued towards its reader, and credit
/// consumed but not yet returned.
#[derive(Debug)]
pub struct Window {
    /// The peer counts on credit (Tether) rather than on us blocking (upstream).
    credit_based: bool,
    size: i64,
    queued: AtomicI64,
    unreturned: AtomicI64,
    closed: AtomicBool,
    space: Notify,
}

impl Window {
    /// A window of `size` bytes; `credit_based` when the peer obeys WINDOW_UPDATE.
    pub fn new(size: u32, credit_based: bool) -> Self {
        Window {
            credit_based,
            size: size as i64,
            queued: AtomicI64::new(0),
            unreturned: AtomicI64::new(0),
            closed: AtomicBool::new(false),
            space: Notify::new(),
        }
    }

    /// The receive side for a peer: credit-based with our default window, or capped at
    /// [`FALLBACK_QUEUE`] for an upstream peer.
    pub fn for_peer(credit_based: bool) -> Self {
        if credit_based {
            Window::new(DEFAULT_WINDOW, true)
        } else {
            Window::new(FALLBACK_QUEUE as u32, false)
        }
    }

    /// Does the peer obey WINDOW_UPDATE?
    pub fn credit_based(&self) -> bool {
        self.credit_based
    }

    /// Bytes queued and not yet consumed.
    pub fn queued(&self) -> i64 {
        self.queued.load(Ordering::Acquire)
    }

    /// Would [`Window::admit`] wait (no credit and the queue full)?
    pub fn is_full(&self) -> bool {
        !self.credit_based && self.queued() >= self.size
    }

    /// Accounts `n` bytes arriving for the queue. A credit-based peer must stay within
    /// the window (plus the packet that overdrew it); an upstream peer is
    /// held (the caller blocks, like upstream) while the queue is full, for at most
    /// `stall`.
    pub async fn admit(&self, n: usize, stall: Duration) -> Admit {
        if self.credit_based {
            let queued = self.queued.fetch_add(n as i64, Ordering::AcqRel) + n as i64;
            // The sender may overdraw by its last packet; twice the window is
            // beyond any honest peer.
            if queued > 2 * self.size {
                return Admit::Overrun;
            }
            return Admit::Ok;
        }
        if self.queued() >= self.size {
            let wait = async {
                loop {
                    let space = self.space.notified();
                    if self.queued() < self.size || self.closed.load(Ordering::Acquire) {
                        return;
                    }
                    space.await;
                }
            };
            if tokio::time::timeout(stall, wait).await.is_err() {
                return Admit::Stalled;
            }
            if self.closed.load(Ordering::Acquire) {
                return Admit::Closed;
            }
        }
        self.queued.fetch_add(n as i64, Ordering::AcqRel);
        Admit::Ok
    }

    /// The connection is gone: a held [`Window::admit`] returns `Closed` at once.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.space.notify_waiters();
    }

    /// Accounts `n` bytes leaving the queue (written to the reader). Returns the credit
    /// to send back in a WINDOW_UPDATE once a quarter window has accumulated (only for
    /// a credit-based peer).
    pub fn consumed(&self, n: usize) -> Option<i64> {
        self.queued.fetch_sub(n as i64, Ordering::AcqRel);
        if !self.credit_based {
            self.space.notify_waiters();
            return None;
        }
        let due = self.unreturned.fetch_add(n as i64, Ordering::AcqRel) + n as i64;
        if due >= self.size / 4 {
            let grant = self.unreturned.swap(0, Ordering::AcqRel);
            return (grant > 0).then_some(grant);
        }
        None
    }
}

/// Why DATA offered to a connection was refused; the connection is then closed with
/// this as its error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// A credit-based peer sent more than the window it was given.
    #[error("the peer exceeded the flow-control window")]
    Overrun,
    /// No credit (upstream peer) and the reader left the queue full this long.
    #[error("the reader did not read for {0:?}; connection closed")]
    Stalled(Duration),
}

/// Flow control of one tunnelled connection at one end of the link: credit for the
/// DATA it sends, the window for the DATA it receives.
#[derive(Debug)]
pub struct ConnFlow {
    credit: Option<Credit>,
    window: Window,
}

impl ConnFlow {
    /// Flow control towards a peer that advertised `peer_window` (`None`: an upstream
    /// peer, no credit, a capped queue).
    pub fn new(peer_window: Option<u32>) -> Self {
        ConnFlow {
            credit: peer_window.map(Credit::new),
            window: Window::for_peer(peer_window.is_some()),
        }
    }

    /// Credit for sending, when the peer gives it.
    pub fn credit(&self) -> Option<&Credit> {
        self.credit.as_ref()
    }

    /// The receive window.
    pub fn window(&self) -> &Window {
        &self.window
    }

    /// Waits for credit and takes `n` bytes of it; false once the connection is closed.
    pub async fn reserve(&self, n: usize) -> bool {
        let Some(credit) = &self.credit else {
            return true;
        };
        if !credit.ready().await {
            return false;
        }
        credit.spend(n);
        true
    }

    /// A WINDOW_UPDATE from the peer.
    pub fn grant(&self, bytes: i64) {
        if let Some(credit) = &self.credit {
            credit.grant(bytes);
        }
    }

    /// `n` bytes of DATA arrived for the reader: `Ok(true)` queue them, `Ok(false)` drop
    /// them (the connection closed meanwhile), `Err` close the connection with it.
    /// Holds the caller while an upstream peer's queue is full, for at most `stall`.
    pub async fn admit(&self, n: usize, stall: Duration) -> Result<bool, Refused> {
        match self.window.admit(n, stall).await {
            Admit::Ok => Ok(true),
            Admit::Closed => Ok(false),
            Admit::Overrun => Err(Refused::Overrun),
            Admit::Stalled => Err(Refused::Stalled(stall)),
        }
    }

    /// The connection is gone: wake whoever waits on its credit or window.
    pub fn close(&self) {
        if let Some(credit) = &self.credit {
            credit.close();
        }
        self.window.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn credit_blocks_at_zero_and_resumes_on_grant() {
        let credit = std::sync::Arc::new(Credit::new(10));
        assert!(credit.ready().await);
        credit.spend(16);
        let waiter = {
            let credit = credit.clone();
            tokio::spawn(async move { credit.ready().await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        credit.grant(10);
        assert!(waiter.await.unwrap());
        assert_eq!(credit.available(), 4);
        credit.close();
        assert!(!credit.ready().await);
    }

    #[tokio::test]
    async fn credit_window_detects_overrun_and_returns_quarters() {
        let w = Window::new(64 << 10, true);
        let stall = Duration::from_secs(1);
        assert_eq!(w.admit(64 << 10, stall).await, Admit::Ok);
        assert_eq!(w.consumed(8 << 10), None);
        assert_eq!(w.consumed(8 << 10), Some(16 << 10));
        assert_eq!(
            w.admit(16 << 10, stall).await,
            Admit::Ok,
            "within window again"
        );
        assert_eq!(w.admit(64 << 10, stall).await, Admit::Ok, "overdraw");
        assert_eq!(w.admit(1, stall).await, Admit::Overrun);
    }

    #[tokio::test(start_paused = true)]
    async fn conn_flow_refuses_with_the_reason_and_wakes_on_close() {
        let tether = std::sync::Arc::new(ConnFlow::new(Some(64 << 10)));
        assert!(tether.reserve(64 << 10).await);
        let sender = {
            let f = tether.clone();
            tokio::spawn(async move { f.reserve(1).await })
        };
        tokio::task::yield_now().await;
        assert!(!sender.is_finished(), "no credit left");
        tether.close();
        assert!(!sender.await.unwrap(), "closing wakes the sender");
        let stall = Duration::from_secs(3);
        let beyond = 2 * DEFAULT_WINDOW as usize + 1;
        assert_eq!(tether.admit(beyond, stall).await, Err(Refused::Overrun));
        let upstream = ConnFlow::new(None);
        assert!(upstream.reserve(1 << 30).await, "no credit with upstream");
        assert_eq!(
            upstream.admit(FALLBACK_QUEUE as usize, stall).await,
            Ok(true)
        );
        assert_eq!(upstream.admit(1, stall).await, Err(Refused::Stalled(stall)));
    }

    #[tokio::test(start_paused = true)]
    async fn upstream_window_holds_then_reports_stall() {
        let w = std::sync::Arc::new(Window::new(100, false));
        assert_eq!(w.admit(100, Duration::from_secs(5)).await, Admit::Ok);
        // Full: admission waits; consumption lets it through.
        let held = {
            let w = w.clone();
            tokio::spawn(async move { w.admit(10, Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        assert!(!held.is_finished());
        assert_eq!(w.consumed(50), None);
        assert_eq!(held.await.unwrap(), Admit::Ok);
        // Full again and nobody reads: stalled after the timeout.
        assert_eq!(w.admit(100, Duration::from_secs(5)).await, Admit::Ok);
        assert_eq!(w.admit(1, Duration::from_secs(5)).await, Admit::Stalled);
    }
}

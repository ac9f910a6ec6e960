//! Graceful drain as a primitive: the process keeps a [`Signal`], every piece of work
//! that a drain must wait for (a tunnel, a pending dial) holds a [`Watch`], and
//! [`Signal::drain`] tells the watches and resolves when the last one is dropped. The
//! number of live watches is also what the process reports as its open work, so no
//! metric ever steers control flow.
//!
//! The vocabulary is the same everywhere: *drain* is graceful (finish what is open,
//! take nothing new), *hard stop* ends everything at once.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{watch, Notify};

/// The process side: hands out watches and drains them.
#[derive(Debug)]
pub struct Signal {
    tx: watch::Sender<bool>,
    /// Wakes whoever waits on it each time a watch is handed out (work starts).
    started: Arc<Notify>,
}

/// Held by one piece of open work; dropping it tells the signal the work is done.
#[derive(Debug, Clone)]
pub struct Watch {
    rx: watch::Receiver<bool>,
}

impl Default for Signal {
    fn default() -> Self {
        Signal::new()
    }
}

impl Signal {
    /// A signal with no watches.
    pub fn new() -> Self {
        Signal {
            tx: watch::Sender::new(false),
            started: Arc::new(Notify::new()),
        }
    }

    /// A watch for one more piece of open work.
    pub fn watch(&self) -> Watch {
        self.started.notify_waiters();
        Watch {
            rx: self.tx.subscribe(),
        }
    }

    /// Notified (`notify_waiters`: only tasks already waiting) whenever work starts,
    /// for a task that sleeps long while the process is idle.
    pub fn started(&self) -> Arc<Notify> {
        self.started.clone()
    }

    /// How many watches are held: the open work.
    pub fn open(&self) -> usize {
        self.tx.receiver_count()
    }

    /// Has draining started?
    pub fn is_draining(&self) -> bool {
        *self.tx.borrow()
    }

    /// Tells every watch that draining started, and resolves once no watch is left
    /// (at once when none is held). Work taken on meanwhile holds a watch too and is
    /// waited for as well.
    pub fn drain(&self) -> impl Future<Output = ()> + Send + '_ {
        self.tx.send_replace(true);
        self.idle()
    }

    /// Resolves once no watch is held, without starting to drain.
    pub async fn idle(&self) {
        self.tx.closed().await
    }
}

impl Watch {
    /// Has draining started?
    pub fn is_draining(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves when draining starts (at once if it has). The work should then finish
    /// what it has and take nothing new.
    pub async fn draining(&mut self) {
        // The sender outlives every watch while it can drain; if it is gone, so is the
        // process' interest in this work.
        let _ = self.rx.wait_for(|d| *d).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn drain_waits_for_the_last_watch() {
        let signal = Signal::new();
        signal.drain().await;
        let a = signal.watch();
        let mut b = a.clone();
        assert_eq!(signal.open(), 2);
        let waiter = tokio::spawn(async move { b.draining().await });
        let drained = signal.drain();
        tokio::pin!(drained);
        waiter.await.unwrap();
        assert!(a.is_draining() && signal.is_draining());
        assert!(futures::poll!(drained.as_mut()).is_pending());
        drop(a);
        drained.await;
        assert_eq!(signal.open(), 0);
    }
}

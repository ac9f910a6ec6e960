//! A small unbounded multi-producer, single-consumer queue for per-connection packet
//! queues. It allocates nothing until the first item and gives its storage back each
//! time it is drained, so an idle tunnel's queue holds no heap at all; tokio's channel
//! allocates a 32-slot block per channel up front, kilobytes per idle tunnel. What
//! bounds a queue is the connection's flow-control window (`crate::flow`), not the
//! queue.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use futures::task::AtomicWaker;
use futures::Stream;

struct State<T> {
    items: VecDeque<T>,
    senders: usize,
    receiver_alive: bool,
}

struct Shared<T> {
    state: Mutex<State<T>>,
    waker: AtomicWaker,
}

impl<T> Shared<T> {
    fn state(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Creates a queue.
pub fn queue<T>() -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared {
        state: Mutex::new(State {
            items: VecDeque::new(),
            senders: 1,
            receiver_alive: true,
        }),
        waker: AtomicWaker::new(),
    });
    (Sender(shared.clone()), Receiver(shared))
}

/// The sending side; cloneable. The queue ends when every sender is gone.
pub struct Sender<T>(Arc<Shared<T>>);

impl<T> Sender<T> {
    /// Queues `item`; gives it back when the receiver is gone.
    pub fn send(&self, item: T) -> Result<(), T> {
        {
            let mut state = self.0.state();
            if !state.receiver_alive {
                return Err(item);
            }
            state.items.push_back(item);
        }
        self.0.waker.wake();
        Ok(())
    }

    /// Is the receiver gone?
    pub fn is_closed(&self) -> bool {
        !self.0.state().receiver_alive
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        self.0.state().senders += 1;
        Sender(self.0.clone())
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let last = {
            let mut state = self.0.state();
            state.senders -= 1;
            state.senders == 0
        };
        if last {
            self.0.waker.wake();
        }
    }
}

/// The receiving side: a `Stream` of the items in order, ending when every sender is
/// gone and the queue is empty.
pub struct Receiver<T>(Arc<Shared<T>>);

impl<T> Receiver<T> {
    /// The next item if one is queued now.
    pub fn try_recv(&self) -> Option<T> {
        self.try_next().flatten()
    }

    /// `Some(Some(item))`, `Some(None)` at the end, `None` when empty for now.
    fn try_next(&self) -> Option<Option<T>> {
        let mut state = self.0.state();
        match state.items.pop_front() {
            Some(item) => {
                // Drained: give the storage back. Most tunnels are idle most of the time
                // (the server's 10,000-tunnel figure fell by 3 MiB), and one small
                // allocation per burst is nothing beside the packets it carries.
                if state.items.is_empty() {
                    state.items = VecDeque::new();
                }
                Some(Some(item))
            }
            None if state.senders == 0 => Some(None),
            None => None,
        }
    }
}

impl<T> Stream for Receiver<T> {
    type Item = T;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        if let Some(next) = self.try_next() {
            return Poll::Ready(next);
        }
        self.0.waker.register(cx.waker());
        // A send between the first look and the registration must not be missed.
        match self.try_next() {
            Some(next) => Poll::Ready(next),
            None => Poll::Pending,
        }
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.receiver_alive = false;
        state.items.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    #[tokio::test]
    async fn items_in_order_then_end_when_senders_are_gone() {
        let (tx, mut rx) = queue();
        let tx2 = tx.clone();
        let producer = tokio::spawn(async move {
            for i in 0..1000 {
                tx2.send(i).unwrap();
                if i % 100 == 0 {
                    tokio::task::yield_now().await;
                }
            }
        });
        producer.await.unwrap();
        drop(tx);
        let got: Vec<i32> = (&mut rx).collect().await;
        assert_eq!(got, (0..1000).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn send_fails_once_the_receiver_is_gone() {
        let (tx, rx) = queue::<u8>();
        assert!(!tx.is_closed());
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(tx.send(1), Err(1));
    }

    #[tokio::test]
    async fn a_drained_queue_holds_no_storage() {
        let (tx, mut rx) = queue();
        assert_eq!(rx.0.state().items.capacity(), 0);
        for i in 0..3 {
            tx.send(i).unwrap();
        }
        assert!(rx.0.state().items.capacity() > 0);
        for i in 0..3 {
            assert_eq!(rx.next().await, Some(i));
        }
        assert_eq!(rx.0.state().items.capacity(), 0);
    }

    #[tokio::test]
    async fn a_waiting_receiver_is_woken() {
        let (tx, mut rx) = queue();
        let waiter = tokio::spawn(async move { rx.next().await });
        tokio::task::yield_now().await;
        tx.send("x").unwrap();
        assert_eq!(waiter.await.unwrap(), Some("x"));
    }
}

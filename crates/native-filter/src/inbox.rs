//! A worker root's inbox: what the store thread's courier received for that root's store
//! streams, held until the root's worker drains it (at a wake-up, or at its next request).
//!
//! The store thread cannot run the root (it lives on its worker), so it leaves the event here
//! and wakes the worker by committing the scheduler of one of the worker's live requests that
//! asked to be woken. Wakers are added and removed on the worker and used under the inbox's
//! lock, so once `remove_waker` returns the courier never commits that request's scheduler
//! again: the request may go.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::ticker::Wake;

/// What a store stream said, as proxy-wasm hands it to a root context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    InitialMetadata {
        token: u32,
        headers: Vec<(String, Vec<u8>)>,
    },
    Message {
        token: u32,
        message: Vec<u8>,
    },
    /// The stream is over (by the store, Envoy, a failed open, or the configuration's end).
    Closed {
        token: u32,
        status: u32,
    },
    /// Not a stream's: the main thread's root answers this worker's request `context_id`,
    /// whose detached write it ran.
    Reply(Box<Reply>),
}

/// An answer for a worker's request, as the main thread's root sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub context_id: u32,
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    pub trailers: Vec<(String, Vec<u8>)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct WakerId(u64);

#[derive(Default)]
struct Held {
    events: VecDeque<StreamEvent>,
    wakers: BTreeMap<WakerId, Arc<dyn Wake>>,
    next_waker: u64,
    /// The waker committed since the last drain (None: none is on its way).
    woken: Option<WakerId>,
}

impl Held {
    /// Commits the oldest waker unless one is already on its way.
    fn wake_one(&mut self) {
        if self.woken.is_some() || self.events.is_empty() {
            return;
        }
        if let Some((id, waker)) = self.wakers.iter().next() {
            waker.wake();
            self.woken = Some(*id);
        }
    }
}

#[derive(Default)]
pub struct Inbox {
    held: Mutex<Held>,
}

impl Inbox {
    fn lock(&self) -> MutexGuard<'_, Held> {
        // Whole between statements: usable after a panic elsewhere.
        self.held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// From any thread: leaves `event` and wakes the worker if a request there can carry it.
    pub fn deliver(&self, event: StreamEvent) {
        let mut held = self.lock();
        held.events.push_back(event);
        held.wake_one();
    }

    /// On the worker: everything delivered so far, in order.
    pub fn take_all(&self) -> Vec<StreamEvent> {
        let mut held = self.lock();
        held.woken = None;
        held.events.drain(..).collect()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().events.is_empty()
    }

    /// On the worker: a live request whose scheduled event drains this inbox.
    pub fn add_waker(&self, waker: Arc<dyn Wake>) -> WakerId {
        let mut held = self.lock();
        held.next_waker += 1;
        let id = WakerId(held.next_waker);
        held.wakers.insert(id, waker);
        // Events that came while no request could carry them go now.
        held.wake_one();
        id
    }

    /// On the worker, before the request goes. If its wake was the one on its way (and may
    /// now be dropped with the request), another request is woken instead.
    pub fn remove_waker(&self, id: WakerId) {
        let mut held = self.lock();
        held.wakers.remove(&id);
        if held.woken == Some(id) {
            held.woken = None;
            held.wake_one();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    use crate::ticker::CountWakes as Count;

    fn closed(token: u32) -> StreamEvent {
        StreamEvent::Closed { token, status: 14 }
    }

    #[test]
    fn one_wake_per_drain_and_events_in_order() {
        let inbox = Inbox::default();
        let a = Arc::new(Count::default());
        inbox.add_waker(a.clone());
        inbox.deliver(closed(1));
        inbox.deliver(closed(2));
        assert_eq!(a.0.load(Ordering::SeqCst), 1, "one wake carries both");
        assert_eq!(inbox.take_all(), vec![closed(1), closed(2)]);
        inbox.deliver(closed(3));
        assert_eq!(a.0.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_worker_with_no_waker_keeps_events_until_a_request_comes() {
        let inbox = Inbox::default();
        inbox.deliver(closed(1));
        assert!(!inbox.is_empty());
        let a = Arc::new(Count::default());
        inbox.add_waker(a.clone());
        assert_eq!(
            a.0.load(Ordering::SeqCst),
            1,
            "the new waker is woken for them"
        );
    }

    #[test]
    fn a_woken_request_that_goes_passes_the_wake_on() {
        let inbox = Inbox::default();
        let (a, b) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let first = inbox.add_waker(a.clone());
        inbox.add_waker(b.clone());
        inbox.deliver(closed(1));
        assert_eq!(
            (a.0.load(Ordering::SeqCst), b.0.load(Ordering::SeqCst)),
            (1, 0)
        );
        inbox.remove_waker(first);
        assert_eq!(b.0.load(Ordering::SeqCst), 1, "its wake may die with it");
        inbox.remove_waker(first);
        assert_eq!(b.0.load(Ordering::SeqCst), 1);
    }
}

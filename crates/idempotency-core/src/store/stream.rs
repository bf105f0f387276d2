//! One long-lived gRPC stream per worker to the store: which calls are outstanding on it,
//! when a call has waited too long, when the stream is reopened, and which waiting request
//! each answer or failure belongs to. Host-free: the root context opens, sends and closes
//! through the host and feeds what happens back in here.
//!
//! What Envoy 1.40 does to such a stream decides the shape (see
//! `../shared/notes/envoy-proxy-wasm.md`): sends always succeed and are buffered, so the
//! number of outstanding calls is bounded here; a killed store closes the stream (every
//! outstanding call fails at once), but a frozen one says nothing, so each call carries a
//! deadline checked on the tick; a down store closes new streams at once, so reopening
//! waits out a backoff that grows until an answer arrives.

use std::collections::HashMap;

use idempotency_protocol::stream::{self, CallOp, DecodeError, Reply};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamLimits {
    /// Calls sent and not yet answered; beyond it a call is refused (the rule's failure
    /// policy applies), never queued without bound.
    pub max_outstanding: usize,
    /// First wait before reopening a stream that closed; doubled after each close that saw
    /// no answer, up to `max_backoff_ms`.
    pub min_backoff_ms: u64,
    pub max_backoff_ms: u64,
}

impl Default for StreamLimits {
    fn default() -> Self {
        StreamLimits {
            max_outstanding: 4096,
            min_backoff_ms: 100,
            max_backoff_ms: 5_000,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// No stream; try to open one from `reopen_at_ms` on.
    Closed {
        reopen_at_ms: u64,
    },
    Open {
        handle: u32,
    },
}

/// Why a call was not sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotSent {
    /// No stream is open (the store is down or the stream is being reopened).
    NoStream,
    /// `max_outstanding` calls are already waiting.
    TooManyOutstanding,
}

/// A call to send on the open stream `handle`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub handle: u32,
    pub id: u64,
    pub message: Vec<u8>,
}

#[derive(Debug)]
struct Outstanding<W> {
    waiter: W,
    sent_at_ms: u64,
    deadline_ms: u64,
}

/// Calls whose deadline passed, and whether the stream looks frozen: nothing at all was
/// answered since the oldest of them was sent, so the caller should close and reopen it.
#[derive(Debug)]
pub struct Expired<W> {
    pub waiters: Vec<W>,
    pub stream_frozen: bool,
}

/// The stream and its outstanding calls; `W` is whatever identifies a waiting request.
#[derive(Debug)]
pub struct StoreStream<W> {
    limits: StreamLimits,
    link: Link,
    /// Closes in a row without an answer in between; sets the backoff.
    failures: u32,
    next_id: u64,
    outstanding: HashMap<u64, Outstanding<W>>,
    last_answer_ms: u64,
    /// When a stream was last opened or tried.
    last_attempt_ms: u64,
}

impl<W> StoreStream<W> {
    pub fn new(limits: StreamLimits) -> Self {
        StoreStream {
            limits,
            link: Link::Closed { reopen_at_ms: 0 },
            failures: 0,
            next_id: 1,
            outstanding: HashMap::new(),
            last_answer_ms: 0,
            last_attempt_ms: 0,
        }
    }

    /// Whether the root should open a stream now.
    pub fn due_to_open(&self, now_ms: u64) -> bool {
        matches!(self.link, Link::Closed { reopen_at_ms } if now_ms >= reopen_at_ms)
    }

    pub fn opened(&mut self, now_ms: u64, handle: u32) {
        self.last_attempt_ms = now_ms;
        self.link = Link::Open { handle };
    }

    /// The host refused to open a stream (the cluster is unknown, say): try again later.
    pub fn open_failed(&mut self, now_ms: u64) {
        self.last_attempt_ms = now_ms;
        self.back_off(now_ms);
    }

    pub fn handle(&self) -> Option<u32> {
        match self.link {
            Link::Open { handle } => Some(handle),
            Link::Closed { .. } => None,
        }
    }

    pub fn outstanding(&self) -> usize {
        self.outstanding.len()
    }

    /// A fresh call id.
    pub fn next_call_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        id
    }

    /// Whether a call waiting for a stream may open one now, ahead of the backoff: no
    /// stream is open and the last attempt is at least `min_backoff_ms` old. Traffic then
    /// finds a store that is back at once, and a down store sees a few attempts a second.
    pub fn due_on_demand(&self, now_ms: u64) -> bool {
        matches!(self.link, Link::Closed { .. })
            && now_ms
                >= self
                    .last_attempt_ms
                    .saturating_add(self.limits.min_backoff_ms)
    }

    /// The message carrying `op` on the open stream, under the call id `id`. Once the host
    /// has sent it, `track` the call; a call the host refused is simply never tracked.
    pub fn prepare(&mut self, id: u64, op: &CallOp) -> Result<Outgoing, NotSent> {
        let Link::Open { handle } = self.link else {
            return Err(NotSent::NoStream);
        };
        if self.outstanding.len() >= self.limits.max_outstanding {
            return Err(NotSent::TooManyOutstanding);
        }
        Ok(Outgoing {
            handle,
            id,
            message: stream::encode_call_parts(id, op),
        })
    }

    /// The call `id` was sent for `waiter`; it must be answered by `now_ms + timeout_ms`.
    pub fn track(&mut self, id: u64, now_ms: u64, waiter: W, timeout_ms: u64) {
        self.outstanding.insert(
            id,
            Outstanding {
                waiter,
                sent_at_ms: now_ms,
                deadline_ms: now_ms.saturating_add(timeout_ms),
            },
        );
    }

    /// Takes back a call nobody waits for any more.
    pub fn forget(&mut self, id: u64) -> Option<W> {
        self.outstanding.remove(&id).map(|o| o.waiter)
    }

    /// An answer arrived. None for an answer nobody waits for any more (its deadline
    /// passed, or the stream was reopened since).
    pub fn on_message(
        &mut self,
        now_ms: u64,
        bytes: &[u8],
    ) -> Result<Option<(W, Reply)>, DecodeError> {
        let answer = stream::decode_answer(bytes)?;
        self.failures = 0;
        self.last_answer_ms = now_ms;
        Ok(self
            .outstanding
            .remove(&answer.id)
            .map(|o| (o.waiter, answer.reply)))
    }

    /// The stream closed (the store went away, or the caller closed a frozen stream): every
    /// outstanding call failed, and the next stream opens after the backoff.
    pub fn on_close(&mut self, now_ms: u64) -> Vec<W> {
        self.back_off(now_ms);
        std::mem::take(&mut self.outstanding)
            .into_values()
            .map(|o| o.waiter)
            .collect()
    }

    /// Calls whose deadline has passed by `now_ms` (checked on the tick).
    pub fn expire(&mut self, now_ms: u64) -> Expired<W> {
        let due: Vec<u64> = self
            .outstanding
            .iter()
            .filter(|(_, o)| o.deadline_ms <= now_ms)
            .map(|(&id, _)| id)
            .collect();
        let mut stream_frozen = false;
        let mut waiters = Vec::with_capacity(due.len());
        for id in due {
            if let Some(o) = self.outstanding.remove(&id) {
                stream_frozen |= self.last_answer_ms <= o.sent_at_ms;
                waiters.push(o.waiter);
            }
        }
        Expired {
            waiters,
            stream_frozen,
        }
    }

    fn back_off(&mut self, now_ms: u64) {
        let doubling = 1u64.checked_shl(self.failures.min(20)).unwrap_or(u64::MAX);
        let wait = self
            .limits
            .min_backoff_ms
            .saturating_mul(doubling)
            .min(self.limits.max_backoff_ms);
        self.failures = self.failures.saturating_add(1);
        self.link = Link::Closed {
            reopen_at_ms: now_ms.saturating_add(wait),
        };
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use idempotency_protocol::stream::{encode_answer, Answer};

    const HEX: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn claim() -> CallOp {
        CallOp::Claim {
            key: HEX.into(),
            fingerprint: HEX.into(),
            lease_ms: 1_000,
            owner: "ab".into(),
        }
    }

    fn answer(id: u64) -> Vec<u8> {
        encode_answer(&Answer {
            id,
            reply: Reply::InFlight { retry_after_ms: 5 },
        })
    }

    /// Prepares and tracks a call, as the root does once the host has sent it.
    fn submit<W>(
        s: &mut StoreStream<W>,
        now: u64,
        waiter: W,
        timeout: u64,
    ) -> Result<Outgoing, NotSent> {
        let id = s.next_call_id();
        let out = s.prepare(id, &claim())?;
        s.track(out.id, now, waiter, timeout);
        Ok(out)
    }

    fn limits() -> StreamLimits {
        StreamLimits {
            max_outstanding: 3,
            min_backoff_ms: 100,
            max_backoff_ms: 1_000,
        }
    }

    fn open() -> StoreStream<&'static str> {
        let mut s = StoreStream::new(limits());
        assert!(s.due_to_open(0));
        s.opened(0, 9);
        s
    }

    #[test]
    fn answers_reach_the_request_that_sent_the_call_in_any_order() {
        let mut s = open();
        let a = submit(&mut s, 0, "a", 250).unwrap();
        let b = submit(&mut s, 0, "b", 250).unwrap();
        assert_eq!((a.handle, b.handle), (9, 9));
        assert_ne!(a.id, b.id);
        assert_eq!(stream::decode_call(&a.message).unwrap().op, claim());

        let (waiter, reply) = s.on_message(10, &answer(b.id)).unwrap().unwrap();
        assert_eq!(
            (waiter, reply),
            ("b", Reply::InFlight { retry_after_ms: 5 })
        );
        assert_eq!(s.on_message(11, &answer(a.id)).unwrap().unwrap().0, "a");
        // Answered once: a duplicate or a late answer finds nobody.
        assert!(s.on_message(12, &answer(a.id)).unwrap().is_none());
        assert!(s.on_message(12, b"\x08").is_err());
        assert_eq!(s.outstanding(), 0);
    }

    #[test]
    fn calls_beyond_the_bound_or_without_a_stream_are_refused_not_queued() {
        let mut s: StoreStream<&str> = StoreStream::new(limits());
        assert_eq!(submit(&mut s, 0, "x", 250), Err(NotSent::NoStream));
        s.opened(0, 1);
        for w in ["a", "b", "c"] {
            assert!(submit(&mut s, 0, w, 250).is_ok());
        }
        assert_eq!(
            submit(&mut s, 0, "d", 250),
            Err(NotSent::TooManyOutstanding)
        );
        // A call taken back frees its place; one prepared but never sent takes none.
        let mut t = open();
        let c = submit(&mut t, 0, "c", 250).unwrap();
        assert_eq!(t.forget(c.id), Some("c"));
        let id = t.next_call_id();
        t.prepare(id, &claim()).unwrap();
        assert_eq!(t.outstanding(), 0);
    }

    #[test]
    fn a_close_fails_every_outstanding_call_and_reopens_after_a_growing_backoff() {
        let mut s = open();
        submit(&mut s, 0, "a", 250).unwrap();
        submit(&mut s, 0, "b", 250).unwrap();
        let mut failed = s.on_close(1_000);
        failed.sort_unstable();
        assert_eq!(failed, vec!["a", "b"]);
        assert_eq!(s.handle(), None);
        assert!(!s.due_to_open(1_099) && s.due_to_open(1_100));

        // A store that closes every new stream at once: 200, 400, 800, then the cap.
        let mut now = 1_100;
        for wait in [200, 400, 800, 1_000, 1_000] {
            s.opened(0, 2);
            s.on_close(now);
            assert!(
                !s.due_to_open(now + wait - 1) && s.due_to_open(now + wait),
                "{wait}"
            );
            now += wait;
        }
        // One answer resets the backoff.
        s.opened(0, 3);
        let c = submit(&mut s, now, "c", 250).unwrap();
        s.on_message(now, &answer(c.id)).unwrap();
        s.on_close(now);
        assert!(s.due_to_open(now + 100));
    }

    #[test]
    fn calls_waiting_for_a_stream_may_open_one_ahead_of_the_backoff_but_not_in_a_loop() {
        let mut s: StoreStream<&str> = StoreStream::new(limits());
        // A store that keeps closing streams: the idle backoff grows to its cap...
        let mut now = 0;
        for _ in 0..6 {
            s.opened(now, 1);
            s.on_close(now);
            now += 10;
        }
        assert!(!s.due_to_open(now));
        // ...but a waiting call may try again once the last attempt is min_backoff old.
        assert!(!s.due_on_demand(now - 10 + 99));
        assert!(s.due_on_demand(now - 10 + 100));
        s.opened(now, 2);
        assert!(!s.due_on_demand(now + 1_000), "a stream is open");
    }

    #[test]
    fn a_frozen_store_is_caught_by_deadlines_and_a_slow_answer_is_not_mistaken_for_one() {
        let mut s = open();
        let a = submit(&mut s, 0, "a", 250).unwrap();
        submit(&mut s, 100, "b", 250).unwrap();
        let none = s.expire(249);
        assert!(none.waiters.is_empty() && !none.stream_frozen);
        let first = s.expire(250);
        assert_eq!(first.waiters, vec!["a"]);
        assert!(first.stream_frozen, "nothing answered since it was sent");
        // Its answer after the deadline is dropped.
        assert!(s.on_message(300, &answer(a.id)).unwrap().is_none());
        // An answer came after b was sent: the stream is alive, b is merely slow.
        let second = s.expire(350);
        assert_eq!(second.waiters, vec!["b"]);
        assert!(!second.stream_frozen);
    }
}

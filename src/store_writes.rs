//! Completions and releases sent to the store from the root context.
//!
//! Why the root: when a client disconnects, Envoy destroys the request's context and cancels
//! its pending callouts, and the record would be lost. A request instead hands its write to
//! this queue and wakes the root through a shared queue; the root sends it, and retries with
//! backoff on its tick when the store is unavailable.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use idempotency_core::burst_log::BurstLog;
use idempotency_core::config::StoreConfig;
use idempotency_core::outcome::Outcome;
use idempotency_core::store_client::{read_write_answer, WriteAnswer, WriteKind};

use crate::host;
use crate::metrics::Metrics;
use crate::store_calls::{self, StoreOp};

/// Attempts per write before it is given up (the store's lease then decides).
const MAX_ATTEMPTS: u32 = 6;
const FIRST_BACKOFF_MS: u64 = 100;
/// A best-effort release answered "not the owner" is tried this often: the claim it undoes may
/// still be on its way through the store.
const BEST_EFFORT_NOT_OWNER_ATTEMPTS: u32 = 3;

pub struct PendingWrite {
    pub rule: usize,
    pub store: Rc<StoreConfig>,
    pub op: StoreOp,
    pub body: Vec<u8>,
    /// Writes to a claim whose answer was lost: best effort, so failures are logged but not
    /// counted as store errors (the failed claim already was).
    best_effort: bool,
    attempts: u32,
    not_before_ms: u64,
}

impl PendingWrite {
    pub fn new(rule: usize, store: Rc<StoreConfig>, op: StoreOp, body: Vec<u8>) -> PendingWrite {
        PendingWrite {
            rule,
            store,
            op,
            body,
            best_effort: false,
            attempts: 0,
            not_before_ms: 0,
        }
    }

    /// A write to a claim the store may never have applied: failures are not store errors.
    pub fn best_effort(self) -> PendingWrite {
        PendingWrite {
            best_effort: true,
            ..self
        }
    }
}

/// Writes waiting for a retry, at most: beyond it (a long store outage at high traffic) new
/// failures are given up at once, so memory and the tick's scan stay bounded.
const MAX_RETRYING: usize = 20_000;

pub struct StoreWrites {
    /// Submitted by requests and not sent yet: sent on the next wake-up.
    fresh: RefCell<VecDeque<PendingWrite>>,
    /// Failed once or more: scanned only on the tick, not on every wake-up.
    retrying: RefCell<VecDeque<PendingWrite>>,
    sent: RefCell<HashMap<u32, PendingWrite>>,
    wake_queue: Option<u32>,
    failures: RefCell<BurstLog>,
}

impl StoreWrites {
    pub fn new(queue_name: &str) -> StoreWrites {
        let wake_queue = match host::register_shared_queue(queue_name) {
            Ok(id) => Some(id),
            Err(status) => {
                log::warn!("store write queue not registered ({status}); writes wait for the tick");
                None
            }
        };
        StoreWrites {
            fresh: RefCell::new(VecDeque::new()),
            retrying: RefCell::new(VecDeque::new()),
            sent: RefCell::new(HashMap::new()),
            wake_queue,
            failures: RefCell::new(BurstLog::new(10_000)),
        }
    }

    pub fn is_wake_queue(&self, queue_id: u32) -> bool {
        self.wake_queue == Some(queue_id)
    }

    /// Called from a request's context: queue the write and wake the root.
    pub fn submit(&self, write: PendingWrite) {
        self.fresh.borrow_mut().push_back(write);
        if let Some(queue) = self.wake_queue {
            if let Err(status) = host::enqueue_shared_queue(queue, b"") {
                log::debug!("wake-up not queued ({status}); the tick will send the write");
            }
        }
    }

    /// Called from the root: empty the wake-up queue, then send what is due.
    pub fn on_wake(&self, metrics: &Metrics) {
        if let Some(queue) = self.wake_queue {
            // Bounded: the queue only holds one empty message per submitted write.
            for _ in 0..10_000 {
                match host::dequeue_shared_queue(queue) {
                    Ok(Some(_)) => continue,
                    _ => break,
                }
            }
        }
        let fresh: Vec<PendingWrite> = self.fresh.borrow_mut().drain(..).collect();
        self.send(fresh, metrics);
    }

    /// Called from the root on its tick: new writes a wake-up missed, and retries now due.
    pub fn on_tick(&self, metrics: &Metrics) {
        let now = host::now_ms();
        let mut due: Vec<PendingWrite> = self.fresh.borrow_mut().drain(..).collect();
        {
            let mut retrying = self.retrying.borrow_mut();
            let (ready, later): (VecDeque<_>, VecDeque<_>) =
                retrying.drain(..).partition(|w| w.not_before_ms <= now);
            *retrying = later;
            due.extend(ready);
        }
        self.send(due, metrics);
    }

    fn send(&self, due: Vec<PendingWrite>, metrics: &Metrics) {
        for write in due {
            match store_calls::send(&write.store, write.op, &write.body) {
                Ok(token) => {
                    self.sent.borrow_mut().insert(token, write);
                }
                Err(status) => {
                    self.retry_later(write, &format!("callout refused: {status}"), metrics)
                }
            }
        }
    }

    /// Called from the root when a store answer arrives; false if the token is not ours.
    pub fn on_answer(
        &self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        metrics: &Metrics,
    ) -> bool {
        let Some(write) = self.sent.borrow_mut().remove(&token) else {
            return false;
        };
        let (status, body) = store_calls::read_answer(num_headers, body_size);
        let kind = match write.op {
            StoreOp::Release => WriteKind::Release,
            _ => WriteKind::Complete,
        };
        if write.best_effort
            && write.op == StoreOp::Release
            && status == Some(409)
            && write.attempts + 1 < BEST_EFFORT_NOT_OWNER_ATTEMPTS
        {
            self.retry_later(
                write,
                "the claim to release has not reached the store yet",
                metrics,
            );
            return true;
        }
        match read_write_answer(kind, status, &body) {
            WriteAnswer::Done => {}
            WriteAnswer::Refused(why) => {
                if !write.best_effort {
                    metrics.count(write.rule, Outcome::StoreError);
                }
                log::warn!("store {:?} refused: {why}", write.op);
            }
            WriteAnswer::Retry(why) => self.retry_later(write, &why, metrics),
        }
        true
    }

    fn retry_later(&self, mut write: PendingWrite, why: &str, metrics: &Metrics) {
        if !write.best_effort {
            metrics.count(write.rule, Outcome::StoreError);
        }
        write.attempts += 1;
        let now = host::now_ms();
        if let Some(suppressed) = self.failures.borrow_mut().admit(now) {
            log::warn!(
                "store {:?} failed (attempt {}): {why} ({suppressed} similar failures not logged)",
                write.op,
                write.attempts
            );
        }
        if write.attempts >= MAX_ATTEMPTS {
            log::error!(
                "store {:?} given up after {} attempts; the store's lease decides what a retry gets",
                write.op,
                write.attempts
            );
            return;
        }
        if self.retrying.borrow().len() >= MAX_RETRYING {
            log::error!(
                "store {:?} given up: {MAX_RETRYING} writes already wait for the store",
                write.op
            );
            return;
        }
        write.not_before_ms = now.saturating_add(FIRST_BACKOFF_MS << write.attempts.min(10));
        self.retrying.borrow_mut().push_back(write);
    }
}

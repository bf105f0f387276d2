//! Duplicates held while the first request with their key runs (a rule's
//! `on_in_flight: "wait"`), as one worker keeps them. The first request may run on any
//! worker of the process, so its completion is seen where every worker records it: the local
//! table. The root's tick looks at each waited key there once, however many duplicates wait
//! for it, and hands each waiter its end; a waiter whose client left is dropped unseen.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use crate::host::Host;
use crate::rule_handle::RuleHandle;
use crate::store::client::{read_claim_reply, StoreClaim, StoreFailure};
use crate::table::{Claim, Table};
use idempotency_protocol::naming::Digest;
use idempotency_protocol::record::RecordedResponse;
use idempotency_protocol::stream::Reply;

/// Duplicates one worker holds at most, in its local table and on the store together; beyond,
/// a duplicate gets its 409 at once. Far below the 4096 calls a store stream may have
/// outstanding, so waits on the store never crowd out the claims that need it.
pub const MAX_WAITERS: usize = 1024;
/// Bytes of held requests one worker keeps at most: Envoy holds each held request, its body
/// buffered, so a flood of large duplicates must not turn into gigabytes held for `wait_ms`.
pub const MAX_HELD_BYTES: usize = 64 << 20;
/// How often the root looks at the waited keys: the most a replay waits beyond the first
/// request's completion.
pub const WAIT_TICK_MS: u32 = 20;

/// A held duplicate.
pub struct Waiter {
    pub rule: Rc<RuleHandle>,
    pub key: Digest,
    pub fingerprint: Digest,
    pub deadline_ms: u64,
    /// The host's id of the waiter's context, to answer it in.
    pub context_id: u32,
    /// Its place in the worker's budget, given back when the waiter is dropped.
    pub ticket: HoldTicket,
}

/// How a wait ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitEnd {
    /// The first request completed: replay this.
    Completed(RecordedResponse),
    /// The first request's claim was released or lapsed: nothing to replay.
    Released,
    /// The key now holds another payload (the first was released and another claimed it).
    Mismatch,
    /// `wait_ms` passed with the first still running.
    TimedOut,
}

#[derive(Default)]
pub struct Waits {
    waiters: RefCell<Vec<Waiter>>,
    budget: Rc<HoldBudget>,
}

/// What the worker's held duplicates cost, wherever they wait.
#[derive(Default)]
struct HoldBudget {
    held: Cell<usize>,
    bytes: Cell<usize>,
}

/// One held duplicate's place in the worker's budget (its request's bytes), given back when
/// it is dropped, however its wait ends or its request goes.
pub struct HoldTicket {
    budget: Rc<HoldBudget>,
    bytes: usize,
}

impl Drop for HoldTicket {
    fn drop(&mut self) {
        let b = &self.budget;
        b.held.set(b.held.get().saturating_sub(1));
        b.bytes.set(b.bytes.get().saturating_sub(self.bytes));
    }
}

impl Waits {
    /// A place for one more held duplicate whose request Envoy holds with `request_bytes`;
    /// None when the worker holds `MAX_WAITERS` or that many bytes would pass `MAX_HELD_BYTES`.
    pub fn ticket(&self, request_bytes: usize) -> Option<HoldTicket> {
        let b = &self.budget;
        let bytes = b.bytes.get().saturating_add(request_bytes);
        if b.held.get() >= MAX_WAITERS || bytes > MAX_HELD_BYTES {
            return None;
        }
        b.held.set(b.held.get() + 1);
        b.bytes.set(bytes);
        Some(HoldTicket {
            budget: Rc::clone(&self.budget),
            bytes: request_bytes,
        })
    }

    /// Holds `waiter` among the duplicates that wait in the local table.
    pub fn hold(&self, waiter: Waiter) {
        self.waiters.borrow_mut().push(waiter);
    }

    /// Duplicates held now, and the bytes of their requests.
    pub fn held(&self) -> (usize, usize) {
        (self.budget.held.get(), self.budget.bytes.get())
    }

    /// The client of `context_id` left: forget its wait.
    pub fn withdraw(&self, context_id: u32) {
        self.waiters
            .borrow_mut()
            .retain(|w| w.context_id != context_id);
    }

    /// The waiters whose wait is over, with how it ended; the rest keep waiting. Each waited
    /// key is looked up once. A host error looking one up leaves its waiters to their
    /// deadline.
    /// `is_live` says whether a waiter's request is still there.
    pub fn due(
        &self,
        host: &impl Host,
        table: &Table,
        is_live: impl Fn(u32) -> bool,
    ) -> Vec<(Waiter, WaitEnd)> {
        let now = host.now_ms();
        let waiters = std::mem::take(&mut *self.waiters.borrow_mut());
        let mut seen: Vec<(Digest, Digest, Option<WaitEnd>)> = Vec::new();
        let mut over = Vec::new();
        let mut waiting = Vec::new();
        for waiter in waiters {
            if !is_live(waiter.context_id) {
                continue; // its request is gone
            }
            let known = seen
                .iter()
                .find(|(k, f, _)| *k == waiter.key && *f == waiter.fingerprint)
                .map(|(_, _, end)| end.clone());
            let end = match known {
                Some(end) => end,
                None => {
                    let end = look(host, table, &waiter.key, &waiter.fingerprint, now);
                    seen.push((waiter.key, waiter.fingerprint, end.clone()));
                    end
                }
            };
            match end {
                Some(end) => over.push((waiter, end)),
                None if now >= waiter.deadline_ms => over.push((waiter, WaitEnd::TimedOut)),
                None => waiting.push(waiter),
            }
        }
        // Requests that arrived while the root delivered stay too.
        self.waiters.borrow_mut().extend(waiting);
        over
    }
}

/// The end of a wait for `key`, if it has come. A completion whose response is no longer
/// held in full replays its status with the body-omitted marker.
fn look(
    host: &impl Host,
    table: &Table,
    key: &Digest,
    fingerprint: &Digest,
    now_ms: u64,
) -> Option<WaitEnd> {
    match table.peek(host, key, fingerprint, now_ms) {
        Ok(None) => Some(WaitEnd::Released),
        Ok(Some(Claim::InFlight { .. } | Claim::Full { .. })) => None,
        Ok(Some(Claim::Mismatch)) => Some(WaitEnd::Mismatch),
        Ok(Some(Claim::Completed {
            slot,
            owner,
            status,
            ..
        })) => {
            let recorded = table
                .load_response(host, slot, owner)
                .ok()
                .flatten()
                .unwrap_or_else(|| RecordedResponse::status_only(status));
            Some(WaitEnd::Completed(recorded))
        }
        Ok(Some(Claim::Claimed(_))) => None,
        Err(e) => {
            log::debug!("a waited key could not be read: {}", e.0);
            None
        }
    }
}

/// How a wait on the store ended, from its answer; a failure (or garbage) counts as the
/// first request still running, which a 409 tells the client.
pub fn read_wait_reply(reply: Result<Reply, StoreFailure>) -> WaitEnd {
    match reply {
        Ok(Reply::Released) => WaitEnd::Released,
        Ok(reply) => match read_claim_reply(reply) {
            Ok(StoreClaim::Completed(recorded)) => WaitEnd::Completed(recorded),
            Ok(StoreClaim::Mismatch) => WaitEnd::Mismatch,
            Ok(StoreClaim::InFlight | StoreClaim::Claimed { .. }) | Err(_) => WaitEnd::TimedOut,
        },
        Err(_) => WaitEnd::TimedOut,
    }
}

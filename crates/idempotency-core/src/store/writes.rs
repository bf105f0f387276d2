//! Completions, releases and lease renewals sent to the store from the root context.
//!
//! Why the root: when a client disconnects, Envoy destroys the request's context and cancels
//! its pending callouts, and the record would be lost. A request instead hands its write to
//! this queue and wakes the root through a shared queue; the root sends it, and retries with
//! backoff on its tick while the store is unavailable.
//!
//! How long: a write is retried for as long as it can still matter, until its deadline (the
//! record's TTL for a completion, the claim's lease for a release), so a store outage of
//! minutes loses nothing. What bounds memory instead is a byte budget: over it, a completion
//! is kept without its response body (a replay then carries the omitted-body marker, which is
//! better than a second execution), and only then are writes dropped, counted and logged.

use std::cell::{Cell, RefCell};
use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;

use idempotency_protocol::stream::{encode_call_parts, CallOp, Reply};

use crate::burst_log::BurstLog;
use crate::config::StoreTransport;
use crate::host::{HandedOffWrite, Host, OnLanded};
use crate::outcome::Outcome;
use crate::rule_handle::RuleHandle;
use crate::store::calls;
use crate::store::client::{
    http_body, read_write_answer, read_write_reply, renew_calls, WriteAnswer, WriteKind,
};
use crate::store::link::{StoreLink, Waiter};
pub use crate::store::pending_write::{LeanRecord, PendingWrite};
use crate::table::Table;

const FIRST_BACKOFF_MS: u64 = 100;
/// Longest wait between two attempts of one write: once the store is back, a queued
/// completion lands within this (plus a tick) even if nothing else reaches the store.
const MAX_BACKOFF_MS: u64 = 2_000;
/// A best-effort release answered "not the owner" is tried this often: the claim it undoes may
/// still be on its way through the store.
const BEST_EFFORT_NOT_OWNER_ATTEMPTS: u32 = 3;
/// Bytes of store writes in flight to the store or waiting for a retry, per worker VM (all its
/// configurations). A completion's body is at most the store's request limit (4 MiB by
/// default), so this holds a few of the largest and tens of thousands of ordinary ones.
pub const RETRY_BUDGET_BYTES: usize = 16 * 1024 * 1024;
/// Writes sent per tick: after an outage the backlog reaches the store in steady batches
/// rather than as one burst of callouts.
const MAX_SENDS_PER_TICK: usize = 500;

/// Bytes of writes in flight or waiting for a retry across every root context of this VM: a
/// configuration a push retired keeps its writes until they land, so the budget must not
/// multiply with pushes; and a slow store that still answers must not let sent writes pile up
/// in the heap unbounded either.
mod write_bytes_in_vm {
    use std::cell::Cell;

    thread_local! {
        static BYTES: Cell<usize> = const { Cell::new(0) };
    }

    pub fn get() -> usize {
        BYTES.with(Cell::get)
    }

    pub fn take(bytes: usize) {
        BYTES.with(|b| b.set(b.get().saturating_add(bytes)));
    }

    pub fn release(bytes: usize) {
        BYTES.with(|b| b.set(b.get().saturating_sub(bytes)));
    }
}

/// What the store made of a settle whose sender waits for the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleAnswer {
    /// Replaced or removed: the store held exactly the record the settle named.
    Applied,
    /// The store holds another record by now; nothing changed.
    HoldsAnother,
    /// No answer will come: refused, or given up (its deadline, the byte budget). It may
    /// have been applied by an attempt whose answer was lost.
    Undelivered,
}

/// A write waiting for its next attempt, ordered by when it is due (then by arrival).
struct Waiting {
    not_before_ms: u64,
    seq: u64,
    write: PendingWrite,
}

impl PartialEq for Waiting {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Waiting {}
impl PartialOrd for Waiting {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Waiting {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.not_before_ms, self.seq).cmp(&(other.not_before_ms, other.seq))
    }
}

pub struct StoreWrites {
    /// Submitted by requests and not sent yet: sent on the next wake-up.
    fresh: RefCell<VecDeque<PendingWrite>>,
    /// Failed once or more, soonest due first: looked at only on the tick.
    retrying: RefCell<BinaryHeap<Reverse<Waiting>>>,
    next_seq: Cell<u64>,
    /// The store answered since the last failure: send what waits without its backoff.
    store_is_back: Cell<bool>,
    sent: RefCell<HashMap<u32, PendingWrite>>,
    /// Writes out on a store stream, awaiting their answer there.
    on_stream: Cell<usize>,
    wake_queue: Option<u32>,
    failures: RefCell<BurstLog>,
    drops: RefCell<BurstLog>,
    /// What these writes hold of the VM's write budget, given back should the configuration
    /// go with some still held.
    charged: Cell<usize>,
    /// Leases (key, owner) the store said another request took over, for `Leases` to stop
    /// renewing.
    lost_leases: RefCell<Vec<(String, String)>>,
    lost_log: RefCell<BurstLog>,
    /// The final answers of settles sent `reporting_to` an id, for their senders to take.
    settle_answers: RefCell<Vec<(u64, SettleAnswer)>>,
    /// The id the next completion or release is handed off to the host under.
    next_handoff_id: Cell<u64>,
    handoff_refusals: RefCell<BurstLog>,
}

impl Drop for StoreWrites {
    fn drop(&mut self) {
        write_bytes_in_vm::release(self.charged.get());
    }
}

impl StoreWrites {
    pub fn new(host: &impl Host, queue_name: &str) -> StoreWrites {
        let wake_queue = match host.register_queue(queue_name) {
            Ok(id) => Some(id),
            Err(e) => {
                log::warn!(
                    "store write queue not registered ({}); writes wait for the tick",
                    e.0
                );
                None
            }
        };
        StoreWrites {
            fresh: RefCell::new(VecDeque::new()),
            retrying: RefCell::new(BinaryHeap::new()),
            next_seq: Cell::new(0),
            store_is_back: Cell::new(false),
            sent: RefCell::new(HashMap::new()),
            on_stream: Cell::new(0),
            wake_queue,
            failures: RefCell::new(BurstLog::new(10_000)),
            drops: RefCell::new(BurstLog::new(10_000)),
            charged: Cell::new(0),
            lost_leases: RefCell::new(Vec::new()),
            lost_log: RefCell::new(BurstLog::new(10_000)),
            settle_answers: RefCell::new(Vec::new()),
            next_handoff_id: Cell::new(1),
            handoff_refusals: RefCell::new(BurstLog::new(10_000)),
        }
    }

    /// The leases the store reported lost since the last call.
    pub fn take_lost_leases(&self) -> Vec<(String, String)> {
        std::mem::take(&mut *self.lost_leases.borrow_mut())
    }

    /// The answers to settles sent `reporting_to` an id since the last call.
    pub fn take_settle_answers(&self) -> Vec<(u64, SettleAnswer)> {
        std::mem::take(&mut *self.settle_answers.borrow_mut())
    }

    fn report(&self, write: &PendingWrite, answer: SettleAnswer) {
        if let Some(id) = write.reports_to {
            self.settle_answers.borrow_mut().push((id, answer));
        }
    }

    /// Writes not yet taken by the store: submitted, waiting for a retry, or awaiting an
    /// answer.
    pub fn pending(&self) -> usize {
        self.fresh.borrow().len()
            + self.retrying.borrow().len()
            + self.sent.borrow().len()
            + self.on_stream.get()
    }

    /// Whether writes were submitted since the root last sent (a host whose root is not woken
    /// by its queue sends them at once with `PluginRoot::send_fresh_writes`).
    pub fn has_fresh(&self) -> bool {
        !self.fresh.borrow().is_empty()
    }

    /// Whether a write is ready to go: submitted, or due for its retry (or hurried).
    pub fn due(&self, now_ms: u64) -> bool {
        !self.fresh.borrow().is_empty()
            || self
                .retrying
                .borrow()
                .peek()
                .is_some_and(|Reverse(w)| self.store_is_back.get() || w.not_before_ms <= now_ms)
    }

    pub fn wake_queue(&self) -> Option<u32> {
        self.wake_queue
    }

    pub fn is_wake_queue(&self, queue_id: u32) -> bool {
        self.wake_queue == Some(queue_id)
    }

    /// Reports a completion or release to the host as it is submitted: the writes whose
    /// loss could let a write run twice, which a host whose root may not run soon can land
    /// itself (docs/how-it-works.md, the native build's write handoff).
    fn hand_off(&self, host: &impl Host, write: &mut PendingWrite) {
        // Either transport: the host lands it on the store's stream (the store serves both).
        if write.rule.store.is_none()
            || !matches!(write.kind(), WriteKind::Complete | WriteKind::Release)
        {
            return;
        }
        let id = self.next_handoff_id.get();
        self.next_handoff_id.set(id.wrapping_add(1));
        write.handoff_id = Some(id);
        self.report_handoff(host, write);
    }

    /// (Re)reports `write` under its handoff id: at submission, and whenever its bytes change,
    /// so whoever lands it sends exactly what the root would (a completion is idempotent for
    /// the same bytes only).
    fn report_handoff(&self, host: &impl Host, write: &PendingWrite) {
        let (Some(id), Some(store)) = (write.handoff_id, write.rule.store.as_ref()) else {
            return;
        };
        let authorization = store.token.as_ref().map(|t| format!("Bearer {t}"));
        let on_landed = write
            .marks_in_store
            .clone()
            .map(|mark| mark as Arc<dyn OnLanded>);
        let handed = HandedOffWrite {
            id,
            cluster: &store.cluster,
            authority: &store.authority,
            authorization: authorization.as_deref(),
            call: encode_call_parts(0, &write.call),
            deadline_ms: write.deadline_ms,
            settles_within_ms: store.timeout_ms.saturating_add(FIRST_BACKOFF_MS),
            http: (store.transport == StoreTransport::Http)
                .then(|| (calls::path(store, write.op()), http_body(&write.call))),
            on_landed: on_landed.as_ref(),
        };
        if let Err(e) = host.hand_off_write(&handed) {
            if let Some(suppressed) = self.handoff_refusals.borrow_mut().admit(host.now_ms()) {
                log::warn!(
                    "store {:?} not handed off ({}); only this worker sends it \
                     ({suppressed} similar not logged)",
                    write.op(),
                    e.0
                );
            }
        }
    }

    /// Swaps `write`'s record for its lean form, telling the host the new bytes.
    fn slim_down(&self, host: &impl Host, write: &mut PendingWrite) -> bool {
        let slimmed = write.slim_down();
        if slimmed {
            self.report_handoff(host, write);
        }
        slimmed
    }

    fn settled(&self, host: &impl Host, write: &PendingWrite) {
        if let Some(id) = write.handoff_id {
            host.write_settled(id);
        }
    }

    /// Called from the request whose context is `context_id`: a write for a store whose
    /// stream is open goes on it at once (sent as the root; the answer comes to the root
    /// even if the request is gone by then), saving the root's wake-up; any other is queued.
    pub fn submit_from(
        &self,
        host: &impl Host,
        links: &Links<'_>,
        context_id: u32,
        mut write: PendingWrite,
    ) {
        self.hand_off(host, &mut write);
        let open = write
            .rule
            .store
            .as_ref()
            .and_then(|s| links.find(s))
            .is_some_and(|link| link.handle().is_some());
        if context_id != 0 && open {
            self.send_on_stream(host, links, context_id, write);
        } else {
            self.enqueue(host, write);
        }
    }

    /// From the root's tick: renews the store leases of `rule`'s live requests (key and
    /// owner, in hex), in as few calls as the store's batch bound allows. Best effort: a
    /// renewal that fails is retried until the next one would go anyway.
    pub fn submit_renewals(
        &self,
        host: &impl Host,
        links: &Links<'_>,
        rule: &Rc<RuleHandle>,
        leases: Vec<(String, String)>,
        now_ms: u64,
    ) {
        let lease_ms = rule.rule.lease_ms;
        let deadline = now_ms.saturating_add(renew_every_ms(lease_ms));
        let due = renew_calls(lease_ms, leases)
            .into_iter()
            .map(|call| PendingWrite::new(Rc::clone(rule), call, deadline).best_effort())
            .collect();
        self.send(host, links, due);
    }

    /// Called from a request's context: queue the write and wake the root.
    pub fn submit(&self, host: &impl Host, mut write: PendingWrite) {
        self.hand_off(host, &mut write);
        self.enqueue(host, write);
    }

    fn enqueue(&self, host: &impl Host, write: PendingWrite) {
        self.fresh.borrow_mut().push_back(write);
        self.wake_root(host);
    }

    /// Wakes the root (`on_wake`) soon after the current callback; without a wake-up
    /// queue, its tick does the same work later.
    pub fn wake_root(&self, host: &impl Host) {
        if let Some(queue) = self.wake_queue {
            if let Err(e) = host.enqueue(queue, b"") {
                log::debug!("wake-up not queued ({}); the tick does the work", e.0);
            }
        }
    }

    /// A request's claim got a real answer from the store: writes waiting out an outage go
    /// on the next tick instead of at the end of their backoff, so a retry arriving through
    /// another replica finds the first attempt's record rather than its lapsed lease.
    pub fn store_answered(&self) {
        if !self.store_is_back.get() && !self.retrying.borrow().is_empty() {
            self.store_is_back.set(true);
        }
    }

    /// Called from the root: empty the wake-up queue, then send what is due.
    pub fn on_wake(&self, host: &impl Host, links: &Links<'_>) {
        if let Some(queue) = self.wake_queue {
            // Bounded: the queue only holds one empty message per submitted write.
            for _ in 0..10_000 {
                match host.dequeue(queue) {
                    Ok(Some(_)) => continue,
                    _ => break,
                }
            }
        }
        let fresh: Vec<PendingWrite> = self.fresh.borrow_mut().drain(..).collect();
        self.send(host, links, fresh);
    }

    /// Called from the root on its tick: new writes a wake-up missed, and retries now due.
    pub fn on_tick(&self, host: &impl Host, links: &Links<'_>) {
        let now = host.now_ms();
        let mut due: Vec<PendingWrite> = self.fresh.borrow_mut().drain(..).collect();
        {
            let mut retrying = self.retrying.borrow_mut();
            let hurry = self.store_is_back.get();
            while due.len() < MAX_SENDS_PER_TICK {
                let ready = retrying
                    .peek()
                    .is_some_and(|Reverse(w)| hurry || w.not_before_ms <= now);
                if !ready {
                    break;
                }
                let Some(Reverse(waiting)) = retrying.pop() else {
                    break;
                };
                self.uncharge(waiting.write.bytes());
                if now >= waiting.write.deadline_ms {
                    self.drop_write(host, &waiting.write, "its deadline passed");
                } else {
                    due.push(waiting.write);
                }
            }
            if retrying.is_empty() {
                self.store_is_back.set(false);
            }
        }
        self.send(host, links, due);
    }

    fn send(&self, host: &impl Host, links: &Links<'_>, due: Vec<PendingWrite>) {
        for write in due {
            let Some(store) = write.rule.store.clone() else {
                continue;
            };
            match store.transport {
                StoreTransport::Http => {
                    let mut write = write;
                    if !self.admit(host, &mut write) {
                        continue;
                    }
                    let body = http_body(&write.call);
                    match calls::send(host, &store, write.op(), &body) {
                        Ok(token) => {
                            self.sent.borrow_mut().insert(token, write);
                        }
                        Err(e) => {
                            self.uncharge(write.bytes());
                            self.retry_later(host, write, &format!("callout refused: {}", e.0))
                        }
                    }
                }
                StoreTransport::Grpc => self.send_on_stream(host, links, links.root_context, write),
            }
        }
    }

    /// Sends `write` on its store's stream from `from_context` (the root, or a request).
    fn send_on_stream(
        &self,
        host: &impl Host,
        links: &Links<'_>,
        from_context: u32,
        mut write: PendingWrite,
    ) {
        let Some(link) = write.rule.store.as_ref().and_then(|s| links.find(s)) else {
            self.drop_write(host, &write, "no stream serves its store");
            return;
        };
        if write.bytes() > link.max_message_bytes() && !self.slim_down(host, &mut write) {
            self.drop_write(host, &write, "it is larger than a stream message may be");
            return;
        }
        if !self.admit(host, &mut write) {
            return;
        }
        let bytes = write.bytes();
        match link.send(host, links.root_context, from_context, Waiter::Write(write)) {
            Ok(_) => self.on_stream.set(self.on_stream.get().saturating_add(1)),
            Err(unsent) => {
                self.uncharge(bytes);
                let unsent = *unsent;
                if let Waiter::Write(write) = unsent.waiter {
                    self.retry_later(host, write, &unsent.why);
                }
            }
        }
    }

    fn charge(&self, bytes: usize) {
        write_bytes_in_vm::take(bytes);
        self.charged.set(self.charged.get().saturating_add(bytes));
    }

    fn uncharge(&self, bytes: usize) {
        write_bytes_in_vm::release(bytes);
        self.charged.set(self.charged.get().saturating_sub(bytes));
    }

    /// Charges `write` to the VM's write budget as it goes out: without its response body
    /// when it does not fit, given up (counted, logged) when even that does not. Released when
    /// its answer (or failure) comes back.
    fn admit(&self, host: &impl Host, write: &mut PendingWrite) -> bool {
        let fits = |w: &PendingWrite| {
            write_bytes_in_vm::get().saturating_add(w.bytes()) <= RETRY_BUDGET_BYTES
        };
        if !fits(write) && self.slim_down(host, write) {
            log::warn!(
                "store {:?} sent without its response body: the worker's store writes hold \
                 their byte budget",
                write.op()
            );
        }
        if !fits(write) {
            self.drop_write_over_budget(host, write, "the byte budget of store writes is spent");
            return false;
        }
        self.charge(write.bytes());
        true
    }

    /// Called from the root when a write's answer arrives on a stream.
    pub fn on_stream_answer(
        &self,
        host: &impl Host,
        table: &Table,
        write: PendingWrite,
        reply: &Reply,
    ) {
        self.on_stream.set(self.on_stream.get().saturating_sub(1));
        self.uncharge(write.bytes());
        // The claim a release undoes, or the unknown outcome a settle replaces, may still be
        // on its way to the store (a write retried through an outage): asked again a few times.
        let may_be_behind = matches!(write.kind(), WriteKind::Release | WriteKind::Settle);
        if write.best_effort
            && may_be_behind
            && *reply == Reply::NotOwner
            && write.attempts.saturating_add(1) < BEST_EFFORT_NOT_OWNER_ATTEMPTS
        {
            self.retry_later(
                host,
                write,
                "the record it changes has not reached the store yet",
            );
            return;
        }
        let answer = read_write_reply(write.kind(), reply);
        self.settle(host, table, write, answer);
    }

    /// Called from the root when a write's stream closed or its deadline passed.
    pub fn on_stream_failure(&self, host: &impl Host, write: PendingWrite) {
        self.on_stream.set(self.on_stream.get().saturating_sub(1));
        self.uncharge(write.bytes());
        self.retry_later(host, write, "store stream closed or timed out");
    }

    fn settle(&self, host: &impl Host, table: &Table, write: PendingWrite, answer: WriteAnswer) {
        let goes_again = match &answer {
            WriteAnswer::Retry(_) => true,
            WriteAnswer::Refused(_) => write.lean.is_some(),
            _ => false,
        };
        if !goes_again {
            self.settled(host, &write);
        }
        match answer {
            WriteAnswer::Done => {
                self.store_answered();
                self.report(&write, SettleAnswer::Applied);
                mark_in_store(host, &write);
            }
            WriteAnswer::Superseded => {
                self.store_answered();
                // The store holds a record of the key (another request's): it answers for it.
                mark_in_store(host, &write);
                // The late first attempt of a key another request took over: docs/operations.md's
                // not_recorded. Its local copy would replay a response the store does not.
                write.rule.count(host, Outcome::NotRecorded);
                log::warn!(
                    "rule {}: response not recorded: its lease had passed and another request \
                     took the key over; the store keeps that request's response",
                    write.rule.rule.name
                );
                // Only a claim the store had confirmed was taken over. A best-effort completion
                // is a fail_open run the store never confirmed: it did run here, and its local
                // record goes on answering this proxy's retries (the store's refusal may be
                // another replica's claim in flight, released later).
                if let (Some(held), false) = (&write.local, write.best_effort) {
                    if let Err(e) = table.forget_recorded(host, held) {
                        log::error!("superseded local record not dropped: {e}");
                    }
                }
            }
            WriteAnswer::Refused(why) if write.lean.is_some() => {
                // Most likely too large for the store (its limit may be below the one this
                // filter knows): the same completion without its response body goes instead,
                // so the write is still recorded.
                let mut write = write;
                self.slim_down(host, &mut write);
                log::warn!(
                    "store {:?} refused ({why}); sent again without its response body",
                    write.op()
                );
                self.fresh.borrow_mut().push_back(write);
                self.wake_root(host);
            }
            WriteAnswer::NotSettled => {
                self.store_answered();
                self.report(&write, SettleAnswer::HoldsAnother);
            }
            WriteAnswer::Refused(why) => {
                self.report(&write, SettleAnswer::Undelivered);
                if !write.best_effort {
                    write.rule.count(host, Outcome::StoreError);
                }
                log::warn!("store {:?} refused: {why}", write.op());
            }
            WriteAnswer::Retry(why) => self.retry_later(host, write, &why),
            WriteAnswer::LeasesLost(lost) => {
                self.store_answered();
                for _ in 0..lost.len() {
                    write.rule.count(host, Outcome::LeaseLost);
                }
                if let Some(suppressed) = self.lost_log.borrow_mut().admit(host.now_ms()) {
                    log::warn!(
                        "rule {}: {} running request(s) lost their store lease: another request \
                         took the key over before a renewal landed ({suppressed} similar not \
                         logged)",
                        write.rule.rule.name,
                        lost.len()
                    );
                }
                if let CallOp::Renew { leases, .. } = &write.call {
                    let mut gone = self.lost_leases.borrow_mut();
                    for index in lost {
                        let lease = usize::try_from(index).ok().and_then(|i| leases.get(i));
                        if let Some(lease) = lease {
                            gone.push(lease.clone());
                        }
                    }
                }
            }
        }
    }

    /// Called from the root when a store answer arrives; false if the token is not ours.
    pub fn on_answer(
        &self,
        host: &impl Host,
        table: &Table,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) -> bool {
        let Some(write) = self.sent.borrow_mut().remove(&token) else {
            return false;
        };
        self.uncharge(write.bytes());
        let calls::StoreAnswer { status, body } = calls::read_answer(host, num_headers, body_size);
        let kind = write.kind();
        if write.best_effort
            && matches!(kind, WriteKind::Release | WriteKind::Settle)
            && status == Some(409)
            && write.attempts.saturating_add(1) < BEST_EFFORT_NOT_OWNER_ATTEMPTS
        {
            self.retry_later(
                host,
                write,
                "the claim to release has not reached the store yet",
            );
            return true;
        }
        let answer = read_write_answer(kind, status, &body);
        self.settle(host, table, write, answer);
        true
    }

    fn retry_later(&self, host: &impl Host, mut write: PendingWrite, why: &str) {
        // Failures end the hurry: the store is (again) not answering.
        self.store_is_back.set(false);
        if !write.best_effort {
            write.rule.count(host, Outcome::StoreError);
        }
        write.attempts = write.attempts.saturating_add(1);
        let now = host.now_ms();
        if let Some(suppressed) = self.failures.borrow_mut().admit(now) {
            log::warn!(
                "store {:?} failed (attempt {}): {why}; retried until its deadline \
                 ({suppressed} similar failures not logged)",
                write.op(),
                write.attempts
            );
        }
        if now >= write.deadline_ms {
            self.drop_write(host, &write, "its deadline passed");
            return;
        }
        if write_bytes_in_vm::get().saturating_add(write.bytes()) > RETRY_BUDGET_BYTES
            && self.slim_down(host, &mut write)
        {
            log::warn!(
                "store {:?} kept without its response body: the retry buffer is full",
                write.op()
            );
        }
        let bytes = write.bytes();
        if write_bytes_in_vm::get().saturating_add(bytes) > RETRY_BUDGET_BYTES {
            self.drop_write_over_budget(host, &write, "the retry buffer's byte budget is spent");
            return;
        }
        let backoff = FIRST_BACKOFF_MS
            .saturating_mul(1 << write.attempts.min(16))
            .min(MAX_BACKOFF_MS);
        let seq = self.next_seq.get();
        self.next_seq.set(seq.wrapping_add(1));
        self.charge(bytes);
        self.retrying.borrow_mut().push(Reverse(Waiting {
            not_before_ms: now.saturating_add(backoff).min(write.deadline_ms),
            seq,
            write,
        }));
    }

    fn drop_write(&self, host: &impl Host, write: &PendingWrite, why: &str) {
        self.settled(host, write);
        self.give_up(host, write, why);
    }

    /// Given up for want of memory here, not because it no longer matters: a host that took
    /// it ([`Host::hand_off_write`], its own budget) may still land it, so it is not settled.
    fn drop_write_over_budget(&self, host: &impl Host, write: &PendingWrite, why: &str) {
        self.give_up(host, write, why);
    }

    fn give_up(&self, host: &impl Host, write: &PendingWrite, why: &str) {
        self.report(write, SettleAnswer::Undelivered);
        write.rule.count(host, Outcome::StoreWriteDropped);
        if let Some(suppressed) = self.drops.borrow_mut().admit(host.now_ms()) {
            log::error!(
                "store {:?} given up after {} attempt(s): {why}; the store's lease decides what \
                 a retry gets ({suppressed} similar drops not logged)",
                write.op(),
                write.attempts
            );
        }
    }
}

/// The streams writes go out on, and the root context that owns them.
pub struct Links<'a> {
    pub links: &'a [StoreLink],
    pub root_context: u32,
}

impl Links<'_> {
    /// The stream to `store` (rules that share a store share its stream).
    pub fn find(&self, store: &crate::config::StoreConfig) -> Option<&StoreLink> {
        self.links.iter().find(|l| *l.store == *store)
    }
}

/// How often a live lease is renewed: three times a lease, so that one lost renewal (a store
/// that did not answer in time) still leaves a third of the lease for the next.
pub fn renew_every_ms(lease_ms: u64) -> u64 {
    (lease_ms / 3).max(1)
}

/// Marks the local record a completion carried as in the store (see `InStoreMark`).
fn mark_in_store(host: &impl Host, write: &PendingWrite) {
    if let Some(mark) = &write.marks_in_store {
        if let Err(e) = mark.apply(host) {
            // The record stays kept from eviction, and an unknown outcome's retries keep
            // answering 409 and sending it again.
            log::warn!("local record not marked as in the store: {e}");
        }
    }
}

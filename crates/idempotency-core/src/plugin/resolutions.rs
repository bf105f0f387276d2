//! The unknown outcomes a worker is resolving (`resolve`): each waits until its rule's settle
//! time has passed, then the root looks it up at the service as a callout (Envoy cancels a
//! request's own callouts when its client leaves; the root's outlive it), and the answer
//! settles the key in the table. A lookup that settles nothing is asked again after a backoff
//! that doubles, up to the rule's `max_attempts`; then the key is left for an operator.
//!
//! A worker resolves the unknown outcomes it recorded itself (and, in cluster mode, overdue
//! ones the store let it take on), so no two workers ask about one key. They live in the
//! root, like store writes: a configuration push keeps a retired root until its resolutions
//! end.
//!
//! Cluster mode: the store's record is the lease on the resolution. Its due time says when
//! another proxy may take the resolution on (`Resolve::adopt_after_ms` past it), so every
//! lookup that settles nothing moves it on to the next lookup's time, and a lookup goes out
//! only shortly after the due time the store took from this proxy; later (an outage, or a
//! resolution taken on from another proxy), the resolution first claims it anew by moving
//! the due time to now. Each move is a settle, which the store applies only while it holds
//! exactly the record this proxy last had it take: `NotOwner` means another proxy holds the
//! resolution (or an operator settled it), and this one stops asking. So one proxy at a time
//! asks about a key, and what it settles, counts and keeps locally is what the store took.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use crate::capture::ResponseCapture;
use crate::config::Rule;
use crate::grpc::frame::{framing, Framing};
use crate::host::{status_of, Callout, Host};
use crate::outcome::Outcome;
use crate::resolve::lookup::LookupRequest;
use crate::resolve::settings::{Resolve, Verdict, ADOPT_SLACK_MS};
use crate::rule_handle::RuleHandle;
use crate::store::client::settle_call;
use crate::store::writes::{Links, PendingWrite, SettleAnswer, StoreWrites};
use crate::table::{Completion, Held, Settlement, Table};
use idempotency_protocol::grpc_status;
use idempotency_protocol::naming::short_hash;
use idempotency_protocol::record::{key_expires_value, RecordedResponse, UnknownOutcome};

/// Unknown outcomes one worker resolves at once at most; beyond, the next is left unknown
/// (and logged), as without `resolve`.
pub const MAX_RESOLUTIONS: usize = 4096;
/// Bytes of lookups one worker holds at most.
pub const MAX_RESOLUTION_BYTES: usize = 8 << 20;
/// A root that resolves for others holds at most this many workers' budgets.
pub const MAX_SERVED_ROOTS: usize = 4;
/// What a resolution costs beyond its lookup's bytes.
const RESOLUTION_OVERHEAD_BYTES: usize = 512;
/// Envoy answers every callout by its timeout; one unanswered this long after is a failed
/// lookup, so that a lost answer cannot hold a resolution forever.
const OVERDUE_GRACE_MS: u64 = 10_000;
/// Cluster mode: how long past the due time the store holds a lookup may still go out
/// without claiming the resolution anew. Other proxies take it on `timeout_ms` + 5 s past
/// that due time, so a lookup sent within half the slack has its answer (or its timeout)
/// before any of them may ask, ticks and the store's way included.
const LEASE_SLACK_MS: u64 = ADOPT_SLACK_MS / 2;
pub use idempotency_protocol::record::RESOLVED_HEADER;

/// One unknown outcome being resolved.
pub struct Resolution {
    pub rule: Rc<RuleHandle>,
    /// The claim that recorded the unknown outcome: only its record is settled.
    pub held: Held,
    pub lookup: LookupRequest,
    /// What Envoy reported, kept in the record while the resolution lasts.
    pub unknown: UnknownOutcome,
    /// Cluster mode: the unknown outcome's record as the store holds it, as far as this
    /// resolution knows (as this proxy sent it, read it, or last had the store take it),
    /// which the store settles only while it still holds exactly that.
    pub store_record: Option<Vec<u8>>,
    /// Cluster mode: the due time `store_record` says, which the lease runs from.
    store_due_ms: u64,
    /// When the service is next asked.
    pub due_ms: u64,
    /// Lookups made so far.
    pub attempts: u32,
    sent_ms: u64,
    bytes: usize,
}

impl Resolution {
    pub fn new(
        rule: Rc<RuleHandle>,
        held: Held,
        lookup: LookupRequest,
        unknown: UnknownOutcome,
        due_ms: u64,
    ) -> Resolution {
        let store_record = rule
            .store
            .is_some()
            .then(|| RecordedResponse::unknown_outcome(unknown.clone()).encode());
        let bytes = lookup
            .bytes()
            .saturating_add(store_record.as_ref().map_or(0, Vec::len))
            .saturating_add(RESOLUTION_OVERHEAD_BYTES);
        let store_due_ms = unknown.resolution_due_ms.unwrap_or(due_ms);
        Resolution {
            rule,
            held,
            lookup,
            unknown,
            store_record,
            store_due_ms,
            due_ms,
            attempts: 0,
            sent_ms: 0,
            bytes,
        }
    }

    /// As plain data, for another root; `adopted` as `PortableResolution` says.
    fn portable(self, adopted: bool) -> PortableResolution {
        let store = self.store_record.map(|record| (record, self.store_due_ms));
        PortableResolution {
            rule: self.rule.rule.clone(),
            held: self.held,
            lookup: self.lookup,
            unknown: self.unknown,
            due_ms: self.due_ms,
            adopted,
            store,
        }
    }

    fn settings(&self) -> Option<&Resolve> {
        self.rule.rule.resolve.as_ref()
    }

    /// Whether a lookup may go out now: single-proxy mode, or the store's record still
    /// keeps other proxies from asking until its answer is in.
    fn holds_lease(&self, now: u64) -> bool {
        self.store_record.is_none() || now < self.store_due_ms.saturating_add(LEASE_SLACK_MS)
    }
}

/// A resolution on its way to the root that resolves for this worker's (see
/// `Resolutions::resolve_elsewhere`): plain data, which that root pairs with its own handle
/// of the same rule.
#[derive(Debug, Clone)]
pub struct PortableResolution {
    pub rule: Rule,
    pub held: Held,
    pub lookup: LookupRequest,
    pub unknown: UnknownOutcome,
    pub due_ms: u64,
    /// Taken on from the store (overdue there) rather than recorded here: one that cannot
    /// be held is left for the next overdue retry, not marked unresolved.
    pub adopted: bool,
    /// Cluster mode, for one a root gives up (its configuration went): the store's record
    /// as that root last had it take it, and its due time, which the next root's settles
    /// must name.
    pub store: Option<(Vec<u8>, u64)>,
}

impl PortableResolution {
    /// The resolution, for the root holding `rule` (a handle of `self.rule`).
    pub fn into_resolution(self, rule: Rc<RuleHandle>) -> (Resolution, bool) {
        let mut resolution =
            Resolution::new(rule, self.held, self.lookup, self.unknown, self.due_ms);
        if let (Some((record, due_ms)), true) = (self.store, resolution.store_record.is_some()) {
            resolution.store_record = Some(record);
            resolution.store_due_ms = due_ms;
        }
        (resolution, self.adopted)
    }

    /// Whether `resolution` resolves the same unknown outcome.
    fn same_outcome(&self, resolution: &Resolution) -> bool {
        resolution.held.key == self.held.key && resolution.unknown == self.unknown
    }
}

/// How a lookup settled its key.
enum Resolved {
    TookEffect(RecordedResponse),
    NeverRan,
}

impl Resolved {
    /// The local table's settlement, a record kept `ttl_ms` from now, then `tombstone_ms` as
    /// its tombstone.
    fn settlement(&self, ttl_ms: u64, tombstone_ms: u64) -> Settlement<'_> {
        match self {
            Resolved::TookEffect(response) => Settlement::Record {
                response,
                ttl_ms: Some(ttl_ms),
                tombstone_ms,
            },
            Resolved::NeverRan => Settlement::Free,
        }
    }

    /// The counter and the log's words.
    fn outcome(&self) -> (Outcome, &'static str) {
        match self {
            Resolved::TookEffect(_) => (
                Outcome::ResolvedTookEffect,
                "it took effect: retries replay the service's answer",
            ),
            Resolved::NeverRan => (
                Outcome::ResolvedNeverRan,
                "it never ran: the key is freed and the next retry executes",
            ),
        }
    }
}

/// Cluster mode: the settle a resolution waits for the store to answer, and what follows.
enum StoreStep {
    /// The record moved on to `record`, due `due_ms` (the next lookup's time; now, to claim
    /// the resolution; none: given up, left for an operator).
    Move {
        record: Vec<u8>,
        due_ms: Option<u64>,
        look_up_now: bool,
    },
    /// The key settled as the service said (answered `status`): counted, and the local
    /// table follows, once the store took it.
    Settle { resolved: Resolved, status: u16 },
}

/// Where a resolution settles its key: the local table, and in cluster mode the store.
pub struct Settlers<'a> {
    pub table: &'a Table,
    pub writes: &'a StoreWrites,
    pub links: Links<'a>,
}

#[derive(Default)]
pub struct Resolutions {
    /// Another root resolves for this one (the native build's main thread, which runs when
    /// this worker has no request): what this root would take on waits in `outgoing`.
    elsewhere: Cell<bool>,
    outgoing: RefCell<Vec<PortableResolution>>,
    /// How many roots' budgets this one holds (`resolve_for`; 0 and 1: its own).
    scale: Cell<usize>,
    waiting: RefCell<Vec<Resolution>>,
    in_flight: RefCell<HashMap<u32, Resolution>>,
    /// Cluster mode: waiting for the store's answer to a settle, by the id it is reported
    /// under.
    awaiting_store: RefCell<HashMap<u64, (Resolution, StoreStep)>>,
    next_settle_id: Cell<u64>,
    bytes: Cell<usize>,
}

impl Resolutions {
    /// From now on, resolutions go to `outgoing` for the host to carry to the root that
    /// resolves for this one.
    pub fn resolve_elsewhere(&self) {
        self.elsewhere.set(true);
    }

    /// This root resolves for `roots` others: its budget is theirs together, up to
    /// `MAX_SERVED_ROOTS` times a worker's.
    pub fn resolve_for(&self, roots: usize) {
        self.scale.set(roots.clamp(1, MAX_SERVED_ROOTS));
    }

    /// Every resolution this root holds, as plain data, for another root to go on with (its
    /// configuration is going); a lookup in flight is asked again there.
    pub fn surrender(&self) -> Vec<PortableResolution> {
        let mut all: Vec<Resolution> = self.waiting.borrow_mut().drain(..).collect();
        all.extend(self.in_flight.borrow_mut().drain().map(|(_, r)| r));
        all.extend(
            self.awaiting_store
                .borrow_mut()
                .drain()
                .map(|(_, (r, _))| r),
        );
        let mut portable = self.take_outgoing();
        for resolution in all {
            self.finish(&resolution);
            // In cluster mode the store's record says who asks: the next root claims it anew.
            let adopted = resolution.store_record.is_some();
            portable.push(resolution.portable(adopted));
        }
        portable
    }

    /// Gives back what the host could not carry: kept for the next carry while there is
    /// room, else not resolved (a recorded one is marked so).
    pub fn keep_to_carry(&self, host: &impl Host, table: &Table, refused: Vec<PortableResolution>) {
        for portable in refused {
            let mut outgoing = self.outgoing.borrow_mut();
            if outgoing.len() < MAX_RESOLUTIONS {
                outgoing.push(portable);
                continue;
            }
            drop(outgoing);
            give_up_portable(host, table, &portable, "this worker cannot carry more");
        }
    }

    /// Whether this root resolves exactly this unknown outcome already.
    pub fn resolving_outcome(&self, portable: &PortableResolution) -> bool {
        self.waiting
            .borrow()
            .iter()
            .any(|r| portable.same_outcome(r))
            || self
                .in_flight
                .borrow()
                .values()
                .any(|r| portable.same_outcome(r))
            || self
                .awaiting_store
                .borrow()
                .values()
                .any(|(r, _)| portable.same_outcome(r))
    }

    /// What waits to be carried to the root that resolves for this one.
    pub fn take_outgoing(&self) -> Vec<PortableResolution> {
        std::mem::take(&mut *self.outgoing.borrow_mut())
    }

    pub fn has_outgoing(&self) -> bool {
        !self.outgoing.borrow().is_empty()
    }

    /// Takes on a resolution: one this worker recorded, or (`adopted`) one overdue in the
    /// store that a retry found. Where another root resolves for this one, it goes there. One
    /// that cannot be held is not resolved: a recorded one is marked so in the local table
    /// (its Retry-After would not clear), an adopted one stays for the next overdue retry.
    pub fn take_on(&self, host: &impl Host, table: &Table, resolution: Resolution, adopted: bool) {
        let name = resolution.rule.rule.name.clone();
        if self.elsewhere.get() {
            let mut outgoing = self.outgoing.borrow_mut();
            // Carried out after every hook, so this bound is never near unless the carrier
            // stopped.
            if outgoing.len() < MAX_RESOLUTIONS {
                outgoing.push(resolution.portable(adopted));
                return;
            }
            drop(outgoing);
            self.not_held(host, table, &resolution, adopted);
            return;
        }
        let overdue_s = resolution
            .unknown
            .resolution_due_ms
            .map_or(0, |due| host.now_ms().saturating_sub(due) / 1000);
        match self.schedule(resolution) {
            Ok(()) if adopted => log::warn!(
                "rule {name}: an unknown outcome's resolution was due {overdue_s} s ago and is \
                 not settled in the store; this proxy claims it"
            ),
            Ok(()) => {}
            Err(refused) => self.not_held(host, table, &refused, adopted),
        }
    }

    /// A resolution no root could hold.
    fn not_held(&self, host: &impl Host, table: &Table, refused: &Resolution, adopted: bool) {
        let name = &refused.rule.rule.name;
        if adopted {
            log::warn!(
                "rule {name}: an overdue resolution not taken on: this worker holds as many as \
                 it can"
            );
            return;
        }
        log::warn!(
            "rule {name}: this worker resolves as many unknown outcomes as it can hold; this \
             one is not resolved (Retry-After will not clear)"
        );
        mark_unresolved(host, table, &refused.held, &refused.unknown);
    }

    /// Takes `resolution` on, or gives it back when the worker holds its budget already.
    fn schedule(&self, resolution: Resolution) -> Result<(), Box<Resolution>> {
        let scale = self.scale.get().max(1);
        let fits = self.len() < MAX_RESOLUTIONS.saturating_mul(scale)
            && self.bytes.get().saturating_add(resolution.bytes)
                <= MAX_RESOLUTION_BYTES.saturating_mul(scale);
        if !fits {
            return Err(Box::new(resolution));
        }
        self.bytes
            .set(self.bytes.get().saturating_add(resolution.bytes));
        self.waiting.borrow_mut().push(resolution);
        Ok(())
    }

    /// Whether this worker is resolving `key` already.
    pub fn resolving(&self, key: &idempotency_protocol::naming::Digest) -> bool {
        self.outgoing.borrow().iter().any(|r| r.held.key == *key)
            || self.waiting.borrow().iter().any(|r| r.held.key == *key)
            || self.in_flight.borrow().values().any(|r| r.held.key == *key)
            || self
                .awaiting_store
                .borrow()
                .values()
                .any(|(r, _)| r.held.key == *key)
    }

    /// Resolutions waiting, asking, or waiting for the store: a retired configuration's root
    /// stays for them.
    pub fn len(&self) -> usize {
        self.waiting.borrow().len()
            + self.in_flight.borrow().len()
            + self.awaiting_store.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// From the root's tick: asks the service about every resolution that is due, and ends
    /// the lookups Envoy never answered as failed.
    pub fn on_tick(&self, host: &impl Host, to: &Settlers<'_>) {
        self.on_store_answers(host, to);
        let now = host.now_ms();
        let overdue: Vec<Resolution> = {
            let mut in_flight = self.in_flight.borrow_mut();
            let tokens: Vec<u32> = in_flight
                .iter()
                .filter(|(_, r)| {
                    now >= r
                        .sent_ms
                        .saturating_add(r.lookup.timeout_ms)
                        .saturating_add(OVERDUE_GRACE_MS)
                })
                .map(|(token, _)| *token)
                .collect();
            tokens
                .into_iter()
                .filter_map(|t| in_flight.remove(&t))
                .collect()
        };
        for resolution in overdue {
            self.unsettled(host, to, resolution, "Envoy never answered the lookup");
        }
        let due: Vec<Resolution> = {
            let mut waiting = self.waiting.borrow_mut();
            let (due, later): (Vec<Resolution>, Vec<Resolution>) =
                waiting.drain(..).partition(|r| r.due_ms <= now);
            *waiting = later;
            due
        };
        for resolution in due {
            if resolution.holds_lease(now) {
                self.look_up(host, to, resolution);
            } else {
                // The store's due time is past (a resolution taken on from another proxy,
                // or an answer from the store that came late): another proxy may be taking
                // it on; claim it before asking.
                self.move_in_store(host, to, resolution, Some(now), true);
            }
        }
    }

    /// Asks the service about `resolution`'s write.
    fn look_up(&self, host: &impl Host, to: &Settlers<'_>, mut resolution: Resolution) {
        let lookup = &resolution.lookup;
        let headers: Vec<(&str, &str)> = lookup
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let sent = host.dispatch_callout(&Callout {
            cluster: &lookup.cluster,
            headers,
            body: &lookup.body,
            trailers: Vec::new(),
            timeout_ms: lookup.timeout_ms,
        });
        resolution.attempts = resolution.attempts.saturating_add(1);
        match sent {
            Ok(token) => {
                resolution.sent_ms = host.now_ms();
                self.in_flight.borrow_mut().insert(token, resolution);
            }
            Err(e) => {
                let why = format!(
                    "Envoy refused the lookup to cluster '{}': {}",
                    resolution.lookup.cluster, e.0
                );
                self.unsettled(host, to, resolution, &why);
            }
        }
    }

    /// The store answered settles sent for resolutions (or gave them up): each goes on,
    /// ends, or is counted as the answer says.
    pub fn on_store_answers(&self, host: &impl Host, to: &Settlers<'_>) {
        for (id, answer) in to.writes.take_settle_answers() {
            let Some((resolution, step)) = self.awaiting_store.borrow_mut().remove(&id) else {
                continue;
            };
            self.on_store_answer(host, to, resolution, step, answer);
        }
    }

    fn on_store_answer(
        &self,
        host: &impl Host,
        to: &Settlers<'_>,
        mut resolution: Resolution,
        step: StoreStep,
        answer: SettleAnswer,
    ) {
        let rule = Rc::clone(&resolution.rule);
        let name = &rule.rule.name;
        let key = short_hash(&resolution.held.key);
        if let (SettleAnswer::Applied, StoreStep::Move { .. }) = (&answer, &step) {
            // The store held this proxy's record and now holds the one its local copy was
            // settled to before the move went: it is in the store, whether or not the worker
            // that recorded it ever takes its completion's answer (an idle native worker).
            if let Err(e) = to.table.mark_in_store(host, &resolution.held) {
                log::warn!("rule {name}: a moved unknown outcome not marked as in the store: {e}");
            }
        }
        match (answer, step) {
            (
                SettleAnswer::Applied,
                StoreStep::Move {
                    record,
                    due_ms: Some(due_ms),
                    look_up_now,
                },
            ) => {
                resolution.store_record = Some(record);
                resolution.store_due_ms = due_ms;
                if look_up_now {
                    log::info!(
                        "rule {name}, key {key}: the store holds this proxy's claim on the \
                         unknown outcome's resolution; asking the service"
                    );
                    self.look_up(host, to, resolution);
                } else {
                    self.waiting.borrow_mut().push(resolution);
                }
            }
            (SettleAnswer::Applied, StoreStep::Move { due_ms: None, .. }) => {
                rule.count(host, Outcome::ResolutionGaveUp);
                log::error!(
                    "rule {name}, key {key}: {} lookup(s) of an unknown outcome settled nothing; \
                     it stays unknown until its TTL or an operator settles it",
                    resolution.attempts
                );
                self.finish(&resolution);
            }
            (SettleAnswer::Applied, StoreStep::Settle { resolved, status }) => {
                self.finish(&resolution);
                // Replays from here need not ask the store again.
                let settlement = resolved.settlement(rule.rule.ttl_ms, rule.rule.tombstone_ms);
                if let Err(e) =
                    to.table
                        .settle_unknown(host, &resolution.held, settlement, host.now_ms())
                {
                    log::warn!("rule {name}: a resolution settled in the store, not here: {e}");
                }
                let (outcome, what) = resolved.outcome();
                rule.count(host, outcome);
                log::info!(
                    "rule {name}, key {key}: unknown outcome resolved after {} lookup(s) (the \
                     service answered {status}): {what}; the store took it",
                    resolution.attempts
                );
            }
            (SettleAnswer::HoldsAnother, _) => {
                log::info!(
                    "rule {name}, key {key}: the store holds another record for this key (another \
                     proxy took the resolution on, or an operator settled it); this proxy stops \
                     asking"
                );
                self.finish(&resolution);
            }
            (SettleAnswer::Undelivered, _) => {
                log::warn!(
                    "rule {name}, key {key}: the store did not take this resolution's settle; it \
                     is left to a retry once overdue (any replica takes it on), or an operator"
                );
                self.finish(&resolution);
            }
        }
    }

    /// A callout answered: true when it was a lookup (settled, or asked again later).
    pub fn on_answer(
        &self,
        host: &impl Host,
        to: &Settlers<'_>,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) -> bool {
        let Some(resolution) = self.in_flight.borrow_mut().remove(&token) else {
            return false;
        };
        let Some(settings) = resolution.settings() else {
            self.finish(&resolution);
            return true;
        };
        let headers = if num_headers == 0 {
            Vec::new()
        } else {
            host.callout_response_headers().unwrap_or_else(|e| {
                log::warn!("lookup's answer unreadable: {}", e.0);
                Vec::new()
            })
        };
        let Some(status) = status_of(&headers) else {
            self.unsettled(
                host,
                to,
                resolution,
                "the lookup got no answer (reset or timeout)",
            );
            return true;
        };
        if settings.grpc {
            self.on_grpc_answer(host, to, resolution, &headers, status, body_size);
            return true;
        }
        match settings.verdict(status) {
            Verdict::TookEffect => {
                let rule = &resolution.rule.rule;
                let mut capture = ResponseCapture::start(
                    rule,
                    settings.record_status.unwrap_or(status),
                    headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())),
                );
                if body_size > 0 && capture.wants_body() {
                    match host.callout_response_body(body_size) {
                        Ok(body) => capture.push_body(&body),
                        Err(e) => {
                            log::warn!("lookup's body unreadable: {}; recorded without it", e.0);
                            capture.omit_body();
                        }
                    }
                }
                let resolved = Resolved::TookEffect(resolved_record(host, rule, capture));
                self.settle(host, to, resolution, resolved, status);
            }
            Verdict::NeverRan => self.settle(host, to, resolution, Resolved::NeverRan, status),
            Verdict::Unsettled => {
                let why = format!("the service answered the lookup with {status}");
                self.unsettled(host, to, resolution, &why);
            }
        }
        true
    }

    /// A gRPC lookup's answer: the call's status decides, `OK` with its message and trailers
    /// becoming the call's record, `NOT_FOUND` freeing the key. A host that hands no callout
    /// trailers over (the native build) shows the status only for a trailers-only answer
    /// (`NOT_FOUND` is one); an answer with one whole message and no status seen is taken as
    /// `OK`, as gRPC's servers send a unary call's message only with it. Anything else asks
    /// again later.
    fn on_grpc_answer(
        &self,
        host: &impl Host,
        to: &Settlers<'_>,
        resolution: Resolution,
        headers: &[(String, Vec<u8>)],
        status: u16,
        body_size: usize,
    ) {
        if status != 200 {
            let why = format!("the service answered the gRPC lookup with HTTP {status}");
            return self.unsettled(host, to, resolution, &why);
        }
        let body = match body_size {
            0 => Ok(Vec::new()),
            size => host.callout_response_body(size),
        };
        let Ok(body) = body else {
            return self.unsettled(host, to, resolution, "the gRPC lookup's message unreadable");
        };
        let trailers = host.callout_response_trailers().unwrap_or_else(|e| {
            log::warn!("gRPC lookup's trailers unreadable: {}", e.0);
            Vec::new()
        });
        match grpc_lookup_verdict(&resolution.lookup, headers, &body, &trailers) {
            GrpcLookup::TookEffect => {
                let rule = &resolution.rule.rule;
                let mut capture = ResponseCapture::start(
                    rule,
                    200,
                    headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())),
                );
                capture.push_body(&body);
                let ok = [("grpc-status".to_string(), b"0".to_vec())];
                let trailers = if trailers.is_empty() {
                    &ok[..]
                } else {
                    &trailers[..]
                };
                capture.set_trailers(rule, trailers);
                let resolved = Resolved::TookEffect(resolved_record(host, rule, capture));
                self.settle(host, to, resolution, resolved, status);
            }
            GrpcLookup::NeverRan => self.settle(host, to, resolution, Resolved::NeverRan, status),
            GrpcLookup::Unsettled(why) => self.unsettled(host, to, resolution, &why),
        }
    }

    /// The lookup said how the write ended: the key's record says so now (cluster mode: once
    /// the store took it).
    fn settle(
        &self,
        host: &impl Host,
        to: &Settlers<'_>,
        mut resolution: Resolution,
        resolved: Resolved,
        status: u16,
    ) {
        let rule = Rc::clone(&resolution.rule);
        if resolution.store_record.is_some() {
            // Cluster mode: the store's record settles the key for every replica, whatever
            // became of this proxy's local copy (evicted, say). Counted, and kept here, only
            // if the store still held this resolution's record.
            let (record, ttl_ms, tombstone_ms) = match &resolved {
                Resolved::TookEffect(response) => (
                    Some(response.encode()),
                    rule.rule.ttl_ms,
                    rule.rule.tombstone_ms,
                ),
                Resolved::NeverRan => (None, 0, 0),
            };
            // The answer is held until the store's comes: its bytes count.
            let record_bytes = record.as_ref().map_or(0, Vec::len);
            self.bytes
                .set(self.bytes.get().saturating_add(record_bytes));
            resolution.bytes = resolution.bytes.saturating_add(record_bytes);
            let kept = (ttl_ms, tombstone_ms);
            let id = self.settle_in_store(host, to, &resolution, record, kept);
            let step = StoreStep::Settle { resolved, status };
            self.awaiting_store
                .borrow_mut()
                .insert(id, (resolution, step));
            return;
        }
        self.finish(&resolution);
        let settlement = resolved.settlement(rule.rule.ttl_ms, rule.rule.tombstone_ms);
        let (outcome, what) = resolved.outcome();
        let key = short_hash(&resolution.held.key);
        let local = to
            .table
            .settle_unknown(host, &resolution.held, settlement, host.now_ms());
        match local {
            Ok(Completion::Recorded | Completion::RecordedWithoutBody) => {
                rule.count(host, outcome);
                log::info!(
                    "rule {}, key {key}: unknown outcome resolved after {} lookup(s) (the \
                     service answered {status}): {what}",
                    rule.rule.name,
                    resolution.attempts
                );
            }
            Ok(Completion::LostOwnership | Completion::NotHeld) => log::info!(
                "rule {}: an unknown outcome's lookup answered, but its record had already \
                 changed (evicted or settled); nothing overwritten",
                rule.rule.name
            ),
            Err(e) => log::error!(
                "rule {}: an unknown outcome's resolution could not be recorded: {e}; it stays \
                 unknown",
                rule.rule.name
            ),
        }
    }

    /// The lookup settled nothing: asked again after the backoff, or, once the attempts are
    /// spent, left for an operator. Either way the record says so.
    fn unsettled(
        &self,
        host: &impl Host,
        to: &Settlers<'_>,
        mut resolution: Resolution,
        why: &str,
    ) {
        let now = host.now_ms();
        let Some(settings) = resolution.settings() else {
            self.finish(&resolution);
            return;
        };
        let rule = Rc::clone(&resolution.rule);
        let name = &rule.rule.name;
        let key = short_hash(&resolution.held.key);
        let gave_up = resolution.attempts >= settings.max_attempts;
        let next =
            (!gave_up).then(|| now.saturating_add(settings.backoff_after(resolution.attempts)));
        let unknown = UnknownOutcome {
            resolution_due_ms: next,
            ..resolution.unknown.clone()
        };
        let record = RecordedResponse::unknown_outcome(unknown);
        let settlement = Settlement::Record {
            response: &record,
            ttl_ms: None,
            tombstone_ms: 0,
        };
        let kept = to
            .table
            .settle_unknown(host, &resolution.held, settlement, now);
        let in_store = resolution.store_record.is_some();
        if !in_store && !matches!(kept, Ok(Completion::Recorded)) {
            // Evicted, or settled by someone else: nothing left to resolve.
            log::info!(
                "rule {name}: an unknown outcome's record changed while resolving it; dropped"
            );
            self.finish(&resolution);
            return;
        }
        match next {
            Some(due) => {
                rule.count(host, Outcome::ResolutionRetried);
                log::warn!(
                    "rule {name}, key {key}: lookup {} of an unknown outcome settled nothing \
                     ({why}); asking again in {} s",
                    resolution.attempts,
                    due.saturating_sub(now) / 1000
                );
                resolution.due_ms = due;
                if in_store {
                    // The store's record says when the next lookup goes, so that no other
                    // proxy takes the resolution on meanwhile, and every replica's retries
                    // are told when.
                    self.move_in_store(host, to, resolution, next, false);
                } else {
                    self.waiting.borrow_mut().push(resolution);
                }
            }
            None if in_store => {
                // Given up once the store takes it (every replica's retries lose their
                // Retry-After too): counted then.
                log::warn!(
                    "rule {name}, key {key}: lookup {} of an unknown outcome settled nothing \
                     ({why}); no attempt left",
                    resolution.attempts
                );
                self.move_in_store(host, to, resolution, None, false);
            }
            None => {
                rule.count(host, Outcome::ResolutionGaveUp);
                log::error!(
                    "rule {name}, key {key}: {} lookup(s) of an unknown outcome settled nothing \
                     (last: {why}); it stays unknown until its TTL or an operator settles it",
                    resolution.attempts
                );
                self.finish(&resolution);
            }
        }
    }

    /// Cluster mode: moves the store's record of `resolution` on to be due `due_ms` (None:
    /// given up); the resolution waits for the store's answer, then looks the write up at
    /// once when `look_up_now` (a claim), or when it is due.
    fn move_in_store(
        &self,
        host: &impl Host,
        to: &Settlers<'_>,
        resolution: Resolution,
        due_ms: Option<u64>,
        look_up_now: bool,
    ) {
        let unknown = UnknownOutcome {
            resolution_due_ms: due_ms,
            ..resolution.unknown.clone()
        };
        let record = RecordedResponse::unknown_outcome(unknown).encode();
        let id = self.settle_in_store(host, to, &resolution, Some(record.clone()), (0, 0));
        let step = StoreStep::Move {
            record,
            due_ms,
            look_up_now,
        };
        self.awaiting_store
            .borrow_mut()
            .insert(id, (resolution, step));
    }

    /// Hands the store its settle of `resolution`'s record, sent and retried from the root
    /// like a completion, for as long as the record lives: kept `ttl_ms` (0: as long as the
    /// unknown outcome), then `tombstone_ms` as its tombstone. Its answer comes back to
    /// `on_store_answers` under the id returned.
    fn settle_in_store(
        &self,
        host: &impl Host,
        to: &Settlers<'_>,
        resolution: &Resolution,
        record: Option<Vec<u8>>,
        (ttl_ms, tombstone_ms): (u64, u64),
    ) -> u64 {
        let id = self.next_settle_id.get();
        self.next_settle_id.set(id.wrapping_add(1));
        let current = resolution.store_record.clone().unwrap_or_default();
        let rule = &resolution.rule;
        let call = settle_call(&resolution.held.key, current, record, ttl_ms, tombstone_ms);
        let deadline = host.now_ms().saturating_add(rule.rule.ttl_ms);
        let write = PendingWrite::new(Rc::clone(rule), call, deadline)
            .best_effort()
            .reporting_to(id);
        to.writes
            .submit_from(host, &to.links, to.links.root_context, write);
        id
    }

    fn finish(&self, resolution: &Resolution) {
        self.bytes
            .set(self.bytes.get().saturating_sub(resolution.bytes));
    }
}

/// Marks a recorded unknown outcome as not being resolved, so a retry is not told to come
/// back for a lookup nobody will make.
fn mark_unresolved(host: &impl Host, table: &Table, held: &Held, unknown: &UnknownOutcome) {
    let unresolved = RecordedResponse::unknown_outcome(UnknownOutcome {
        resolution_due_ms: None,
        ..unknown.clone()
    });
    let settlement = Settlement::Record {
        response: &unresolved,
        ttl_ms: None,
        tombstone_ms: 0,
    };
    if let Err(e) = table.settle_unknown(host, held, settlement, host.now_ms()) {
        log::error!("unresolved outcome not marked so: {e}");
    }
}

/// A carried resolution no root takes on: a recorded one is marked unresolved, an adopted
/// one is left for the next overdue retry.
pub fn give_up_portable(host: &impl Host, table: &Table, portable: &PortableResolution, why: &str) {
    let name = &portable.rule.name;
    let key = short_hash(&portable.held.key);
    if portable.adopted {
        log::warn!("rule {name}, key {key}: an overdue resolution not taken on ({why})");
        return;
    }
    log::warn!(
        "rule {name}, key {key}: an unknown outcome is not resolved ({why}); Retry-After will \
         not clear"
    );
    mark_unresolved(host, table, &portable.held, &portable.unknown);
}

/// What a gRPC lookup's answer says, read strictly: only the service's lookup method may
/// free a key. So a `NOT_FOUND` counts only when the answer echoes the key's metadata as the
/// lookup sent it (a proxy's own `NOT_FOUND`, a route a mesh lacks, does not), and an answer
/// that is not well-formed gRPC (another content type, a status twice or in both places, a
/// status in the headers of an answer with a message, trailers without a status) settles
/// nothing. `OK` takes one whole message; a host that hands no trailers over shows no status
/// for it, and one whole message is then taken as `OK`.
fn grpc_lookup_verdict(
    lookup: &LookupRequest,
    headers: &[(String, Vec<u8>)],
    body: &[u8],
    trailers: &[(String, Vec<u8>)],
) -> GrpcLookup {
    let is_grpc = headers
        .iter()
        .find(|(n, _)| n == "content-type")
        .is_some_and(|(_, v)| v.starts_with(b"application/grpc"));
    let statuses =
        |list: &[(String, Vec<u8>)]| list.iter().filter(|(n, _)| n == "grpc-status").count();
    let (in_headers, in_trailers) = (statuses(headers), statuses(trailers));
    let one_message = matches!(framing(body), Framing::Messages(1));
    // A status in the headers is a trailers-only answer's: no message beside it.
    let status_placed = match (in_headers, in_trailers) {
        (0, 0) => trailers.is_empty(),
        (0, 1) => true,
        (1, 0) => body.is_empty(),
        _ => false,
    };
    if !(is_grpc && status_placed) {
        let why = "the gRPC lookup's answer is not well-formed gRPC";
        return GrpcLookup::Unsettled(why.to_string());
    }
    let code = grpc_status::status_in(headers).or_else(|| grpc_status::status_in(trailers));
    match code {
        Some(Some(grpc_status::OK)) | None if one_message => GrpcLookup::TookEffect,
        Some(Some(grpc_status::NOT_FOUND)) if echoes_the_key(lookup, headers, trailers) => {
            GrpcLookup::NeverRan
        }
        Some(Some(grpc_status::NOT_FOUND)) => {
            GrpcLookup::Unsettled("the gRPC lookup's NOT_FOUND does not echo the key".to_string())
        }
        Some(Some(code)) => GrpcLookup::Unsettled(format!(
            "the service answered the gRPC lookup with {} ({} message)",
            grpc_status::name(code),
            if one_message { "one" } else { "not one" }
        )),
        _ => GrpcLookup::Unsettled("the gRPC lookup's answer carried no usable status".to_string()),
    }
}

/// What a gRPC lookup's answer says; unsettled, why.
enum GrpcLookup {
    TookEffect,
    NeverRan,
    Unsettled(String),
}

/// Whether the answer carries every key metadata the lookup sent, with its value.
fn echoes_the_key(
    lookup: &LookupRequest,
    headers: &[(String, Vec<u8>)],
    trailers: &[(String, Vec<u8>)],
) -> bool {
    let mut keys = lookup.key_metadata.iter().peekable();
    keys.peek().is_some()
        && keys.all(|(name, value)| {
            headers
                .iter()
                .chain(trailers)
                .any(|(n, v)| n == name && v == value.as_bytes())
        })
}

/// The record a lookup that took effect leaves: kept as the upstream's own answer would be,
/// for the TTL, then (if the rule keeps them) as its tombstone, which the key's expiry counts
/// in; marked as resolved, never as a replay of the upstream's own.
fn resolved_record(
    host: &impl Host,
    rule: &Rule,
    mut capture: ResponseCapture,
) -> RecordedResponse {
    let kept_ms = rule.ttl_ms.saturating_add(rule.tombstone_ms);
    capture.set_key_expiry(&key_expires_value(host.now_ms().saturating_add(kept_ms)));
    let mut response = capture.finish();
    response
        .headers
        .retain(|(n, _)| n != RESOLVED_HEADER && *n != rule.replay_header);
    response
        .headers
        .push((RESOLVED_HEADER.to_string(), b"true".to_vec()));
    response
}

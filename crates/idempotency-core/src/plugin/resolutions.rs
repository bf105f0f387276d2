//! The unknown outcomes a worker is resolving (`resolve`): each waits until its rule's settle
//! time has passed, then the root looks it up at the service as a callout (Envoy cancels a
//! request's own callouts when its client leaves; the root's outlive it), and the answer
//! settles the key in the table. A lookup that settles nothing is asked again after a backoff
//! that doubles, up to the rule's `max_attempts`; then the key is left for an operator.
//!
//! A worker resolves the unknown outcomes it recorded itself, so no two workers ask about one
//! key. They live in the root, like store writes: a configuration push keeps a retired root
//! until its resolutions end.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use crate::capture::ResponseCapture;
use crate::host::{status_of, Callout, Host};
use crate::outcome::Outcome;
use crate::resolve::lookup::LookupRequest;
use crate::resolve::settings::{Resolve, Verdict};
use crate::rule_handle::RuleHandle;
use crate::store::client::settle_call;
use crate::store::writes::{Links, PendingWrite, StoreWrites};
use crate::table::{Completion, Held, Settlement, Table};
use idempotency_protocol::naming::short_hash;
use idempotency_protocol::record::{key_expires_value, RecordedResponse, UnknownOutcome};

/// Unknown outcomes one worker resolves at once at most; beyond, the next is left unknown
/// (and logged), as without `resolve`.
pub const MAX_RESOLUTIONS: usize = 4096;
/// Bytes of lookups one worker holds at most.
pub const MAX_RESOLUTION_BYTES: usize = 8 << 20;
/// What a resolution costs beyond its lookup's bytes.
const RESOLUTION_OVERHEAD_BYTES: usize = 512;
/// Envoy answers every callout by its timeout; one unanswered this long after is a failed
/// lookup, so that a lost answer cannot hold a resolution forever.
const OVERDUE_GRACE_MS: u64 = 10_000;
pub use idempotency_protocol::record::RESOLVED_HEADER;

/// One unknown outcome being resolved.
pub struct Resolution {
    pub rule: Rc<RuleHandle>,
    /// The claim that recorded the unknown outcome: only its record is settled.
    pub held: Held,
    pub lookup: LookupRequest,
    /// What Envoy reported, kept in the record while the resolution lasts.
    pub unknown: UnknownOutcome,
    /// Cluster mode: the unknown outcome's record as this proxy sent it to the store, which
    /// the store settles only while it still holds exactly that.
    pub store_record: Option<Vec<u8>>,
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
        Resolution {
            rule,
            held,
            lookup,
            unknown,
            store_record,
            due_ms,
            attempts: 0,
            sent_ms: 0,
            bytes,
        }
    }

    fn settings(&self) -> Option<&Resolve> {
        self.rule.rule.resolve.as_ref()
    }
}

/// Where a resolution settles its key: the local table, and in cluster mode the store.
pub struct Settlers<'a> {
    pub table: &'a Table,
    pub writes: &'a StoreWrites,
    pub links: Links<'a>,
}

#[derive(Default)]
pub struct Resolutions {
    waiting: RefCell<Vec<Resolution>>,
    in_flight: RefCell<HashMap<u32, Resolution>>,
    bytes: Cell<usize>,
}

impl Resolutions {
    /// Takes `resolution` on, or gives it back when the worker holds its budget already.
    pub fn schedule(&self, resolution: Resolution) -> Result<(), Box<Resolution>> {
        let fits = self.len() < MAX_RESOLUTIONS
            && self.bytes.get().saturating_add(resolution.bytes) <= MAX_RESOLUTION_BYTES;
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
        self.waiting.borrow().iter().any(|r| r.held.key == *key)
            || self.in_flight.borrow().values().any(|r| r.held.key == *key)
    }

    /// Resolutions waiting or asking: a retired configuration's root stays for them.
    pub fn len(&self) -> usize {
        self.waiting.borrow().len() + self.in_flight.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// From the root's tick: asks the service about every resolution that is due, and ends
    /// the lookups Envoy never answered as failed.
    pub fn on_tick(&self, host: &impl Host, to: &Settlers<'_>) {
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
        for mut resolution in due {
            let lookup = &resolution.lookup;
            let headers: Vec<(&str, &str)> = lookup
                .headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_str()))
                .collect();
            let sent = host.dispatch_callout(&Callout {
                cluster: &lookup.cluster,
                headers,
                body: &[],
                trailers: Vec::new(),
                timeout_ms: lookup.timeout_ms,
            });
            resolution.attempts = resolution.attempts.saturating_add(1);
            match sent {
                Ok(token) => {
                    resolution.sent_ms = now;
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
                // Kept as the upstream's own answer would be: for the TTL, then (if the rule
                // keeps them) as its tombstone, which the key's expiry counts in.
                let tombstone_ms = rule.tombstone_ms;
                let kept_ms = rule.ttl_ms.saturating_add(tombstone_ms);
                capture.set_key_expiry(&key_expires_value(host.now_ms().saturating_add(kept_ms)));
                let mut response = capture.finish();
                response
                    .headers
                    .retain(|(n, _)| n != RESOLVED_HEADER && *n != rule.replay_header);
                response
                    .headers
                    .push((RESOLVED_HEADER.to_string(), b"true".to_vec()));
                let settlement = Settlement::Record {
                    response: &response,
                    ttl_ms: Some(rule.ttl_ms),
                    tombstone_ms,
                };
                self.settle(host, to, &resolution, settlement, status);
            }
            Verdict::NeverRan => self.settle(host, to, &resolution, Settlement::Free, status),
            Verdict::Unsettled => {
                let why = format!("the service answered the lookup with {status}");
                self.unsettled(host, to, resolution, &why);
            }
        }
        true
    }

    /// The lookup said how the write ended: the key's record says so now.
    fn settle(
        &self,
        host: &impl Host,
        to: &Settlers<'_>,
        resolution: &Resolution,
        settlement: Settlement<'_>,
        status: u16,
    ) {
        self.finish(resolution);
        let rule = &resolution.rule;
        if resolution.store_record.is_some() {
            // Cluster mode: the store's record settles the key for every replica, whatever
            // became of this proxy's local copy (evicted, say).
            let (record, ttl_ms, tombstone_ms) = match settlement {
                Settlement::Record {
                    response,
                    ttl_ms,
                    tombstone_ms,
                } => (Some(response.encode()), ttl_ms.unwrap_or(0), tombstone_ms),
                Settlement::Free => (None, 0, 0),
            };
            self.settle_in_store(host, to, resolution, record, (ttl_ms, tombstone_ms));
        }
        let (outcome, what) = match settlement {
            Settlement::Record { .. } => (
                Outcome::ResolvedTookEffect,
                "it took effect: retries replay the service's answer",
            ),
            Settlement::Free => (
                Outcome::ResolvedNeverRan,
                "it never ran: the key is freed and the next retry executes",
            ),
        };
        let key = short_hash(&resolution.held.key);
        let local = to
            .table
            .settle_unknown(host, &resolution.held, settlement, host.now_ms());
        let settled = matches!(
            local,
            Ok(Completion::Recorded | Completion::RecordedWithoutBody)
        );
        if resolution.store_record.is_some() && !settled {
            rule.count(host, outcome);
            log::info!(
                "rule {}, key {key}: unknown outcome resolved after {} lookup(s) (the service \
                 answered {status}): {what}; sent to the store",
                rule.rule.name,
                resolution.attempts
            );
            return;
        }
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
        if next.is_none() && resolution.store_record.is_some() {
            // Given up: every replica's retries lose their Retry-After too. (While lookups
            // are retried the store keeps the first due time; a retry past it is told the
            // backoff.)
            self.settle_in_store(host, to, &resolution, Some(record.encode()), (0, 0));
        }
        let local_gone = !matches!(kept, Ok(Completion::Recorded));
        if local_gone && resolution.store_record.is_none() {
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
                self.waiting.borrow_mut().push(resolution);
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

    /// Hands the store its settle of `resolution`'s record, sent and retried from the root
    /// like a completion, for as long as the record lives: kept `ttl_ms` (0: as long as the
    /// unknown outcome), then `tombstone_ms` as its tombstone.
    fn settle_in_store(
        &self,
        host: &impl Host,
        to: &Settlers<'_>,
        resolution: &Resolution,
        record: Option<Vec<u8>>,
        (ttl_ms, tombstone_ms): (u64, u64),
    ) {
        let Some(current) = resolution.store_record.clone() else {
            return;
        };
        let rule = &resolution.rule;
        let call = settle_call(&resolution.held.key, current, record, ttl_ms, tombstone_ms);
        let deadline = host.now_ms().saturating_add(rule.rule.ttl_ms);
        let write = PendingWrite::new(Rc::clone(rule), call, deadline).best_effort();
        to.writes
            .submit_from(host, &to.links, to.links.root_context, write);
    }

    fn finish(&self, resolution: &Resolution) {
        self.bytes
            .set(self.bytes.get().saturating_sub(resolution.bytes));
    }
}

//! One worker root's ledger of handed-off store writes (docs/native-host.md, "The write
//! handoff"): the completions and releases core reported (`Host::hand_off_write`) and has not
//! settled yet. The root writes it on its worker; the courier reads it on the store thread and
//! lands an entry its root leaves unsettled for too long (an idle worker cannot run its
//! root), so a lock guards it. It holds owned bytes and plain table marks only (core's
//! `OnLanded`), never a root or a request.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use idempotency_core::burst_log::BurstLog;
use idempotency_core::host::{HandedOffWrite, OnLanded};
use idempotency_core::store::writes::RETRY_BUDGET_BYTES;

use idempotency_protocol::stream::{decode_call, CallOp};

use crate::shared_data::SharedMap;
use crate::store_streams::StreamTarget;

/// The courier's retries of one entry: from this to `MAX_BACKOFF_MS`, doubling.
const FIRST_BACKOFF_MS: u64 = 100;
const MAX_BACKOFF_MS: u64 = 2_000;
/// A release answered "not the owner" is sent this many times in all (core's figure for its
/// own releases).
const RELEASE_NOT_OWNER_ATTEMPTS: u32 = 3;
/// What an entry costs beyond its call's bytes (its target, its bookkeeping).
const ENTRY_OVERHEAD_BYTES: usize = 256;

struct Entry {
    /// The store call's name, for the log.
    what: &'static str,
    target: StreamTarget,
    call: Vec<u8>,
    deadline_ms: u64,
    /// The courier may send it from this time on (the root's grace, then each backoff).
    due_ms: u64,
    /// How long an attempt may go unanswered before it counts as failed.
    answer_within_ms: u64,
    attempts: u32,
    /// Sent by the courier at this time and not answered yet.
    in_flight_since: Option<u64>,
    /// What the table owes the store's taking it (core's `HandedOffWrite::on_landed`).
    on_landed: Option<Arc<dyn OnLanded>>,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.call.len().saturating_add(ENTRY_OVERHEAD_BYTES)
    }
}

struct Entries {
    by_id: HashMap<u64, Entry>,
    bytes: usize,
    drops: BurstLog,
    dropped: u64,
    failures: BurstLog,
    landings: BurstLog,
}

/// A write the courier is to send now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueWrite {
    pub id: u64,
    pub target: StreamTarget,
    /// Encoded with call id 0: the courier gives it one of its stream's.
    pub call: Vec<u8>,
    /// Unanswered for this long, the attempt counts as failed.
    pub answer_within_ms: u64,
}

pub struct Ledger {
    entries: Mutex<Entries>,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger {
            entries: Mutex::new(Entries {
                by_id: HashMap::new(),
                bytes: 0,
                drops: BurstLog::new(10_000),
                dropped: 0,
                failures: BurstLog::new(10_000),
                landings: BurstLog::new(10_000),
            }),
        }
    }
}

/// The target a handed-off write's stream goes to, as the root's own stream's.
pub fn target_of(write: &HandedOffWrite<'_>) -> StreamTarget {
    StreamTarget {
        cluster: write.cluster.to_owned(),
        authority: write.authority.to_owned(),
        path: format!(
            "/{}/{}",
            idempotency_core::store::link::SERVICE,
            idempotency_core::store::link::METHOD
        ),
        metadata: write
            .authorization
            .map(|a| ("authorization".to_owned(), a.as_bytes().to_vec()))
            .into_iter()
            .collect(),
    }
}

/// The clock core's writes are handed off with (the native host's `now_ms`).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Ledger {
    fn lock(&self) -> MutexGuard<'_, Entries> {
        // Whole between statements: usable after a panic elsewhere.
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// From the root: keeps `write` (replacing an entry of the same id, whose bytes changed),
    /// due for the courier once the root had `settles_within_ms` to settle it. Over the
    /// byte budget (core's write budget figure) it is not kept: counted and logged.
    pub fn record(&self, write: &HandedOffWrite<'_>, now_ms: u64) -> Result<(), String> {
        let what = match decode_call(&write.call).map(|c| c.op) {
            Ok(CallOp::Complete { .. }) => "Complete",
            Ok(CallOp::Release { .. }) => "Release",
            _ => "write",
        };
        let entry = Entry {
            what,
            target: target_of(write),
            call: write.call.clone(),
            deadline_ms: write.deadline_ms,
            due_ms: now_ms.saturating_add(write.settles_within_ms),
            answer_within_ms: write.settles_within_ms.max(FIRST_BACKOFF_MS),
            attempts: 0,
            in_flight_since: None,
            on_landed: write.on_landed.cloned(),
        };
        let mut entries = self.lock();
        let replaced = entries.by_id.remove(&write.id);
        let freed = replaced.as_ref().map_or(0, Entry::bytes);
        entries.bytes = entries.bytes.saturating_sub(freed);
        if entries.bytes.saturating_add(entry.bytes()) > RETRY_BUDGET_BYTES {
            entries.dropped = entries.dropped.saturating_add(1);
            if let Some(suppressed) = entries.drops.admit(now_ms) {
                log::error!(
                    "store write not handed off: the worker's ledger holds its byte budget; only \
                     its worker sends it ({suppressed} similar not logged)"
                );
            }
            return Err("the handoff ledger's byte budget is spent".into());
        }
        entries.bytes = entries.bytes.saturating_add(entry.bytes());
        entries.by_id.insert(write.id, entry);
        Ok(())
    }

    /// From the root: it settled the write (or gave it up at its deadline).
    pub fn settle(&self, id: u64) {
        let mut entries = self.lock();
        if let Some(entry) = entries.by_id.remove(&id) {
            entries.bytes = entries.bytes.saturating_sub(entry.bytes());
        }
    }

    /// From the courier: the entries due now, marked in flight; those past their deadline
    /// are given up (logged). The courier fails an unanswered attempt by resetting its
    /// stream; one in flight far longer than that (its stream lost without an event) is due
    /// again.
    pub fn take_due(&self, now_ms: u64) -> Vec<DueWrite> {
        let mut entries = self.lock();
        let expired: Vec<u64> = entries
            .by_id
            .iter()
            .filter(|(_, e)| now_ms >= e.deadline_ms)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            if let Some(entry) = entries.by_id.remove(&id) {
                entries.bytes = entries.bytes.saturating_sub(entry.bytes());
                entries.dropped = entries.dropped.saturating_add(1);
                if let Some(suppressed) = entries.drops.admit(now_ms) {
                    log::error!(
                        "handed-off store write given up after {} attempt(s) by the main \
                         thread: its deadline passed ({suppressed} similar not logged)",
                        entry.attempts
                    );
                }
            }
        }
        let mut due = Vec::new();
        for (id, entry) in entries.by_id.iter_mut() {
            let unanswered = entry.in_flight_since.is_some_and(|sent| {
                now_ms >= sent.saturating_add(entry.answer_within_ms.saturating_mul(4))
            });
            if (entry.in_flight_since.is_none() || unanswered) && now_ms >= entry.due_ms {
                entry.in_flight_since = Some(now_ms);
                entry.attempts = entry.attempts.saturating_add(1);
                due.push(DueWrite {
                    id: *id,
                    target: entry.target.clone(),
                    call: entry.call.clone(),
                    answer_within_ms: entry.answer_within_ms,
                });
            }
        }
        due
    }

    /// From the courier: the store recorded completion `id` (or already held those bytes):
    /// settled here, and its record marked as the store's in the table now, as its root
    /// would mark it; an idle root may not run again for long, and until then every
    /// worker's retry of an unknown outcome would answer 409 even after the store settled it.
    pub fn recorded(&self, id: u64, now_ms: u64) {
        if let Some(on_landed) = self.finish(id, now_ms) {
            on_landed.on_landed(SharedMap::process());
        }
    }

    /// From the courier: the store answered entry `id` for good (released, or refused for
    /// good): it is settled here; the root settles its own copy when it runs.
    pub fn landed(&self, id: u64, now_ms: u64) {
        self.finish(id, now_ms);
    }

    fn finish(&self, id: u64, now_ms: u64) -> Option<Arc<dyn OnLanded>> {
        let mut entries = self.lock();
        let entry = entries.by_id.remove(&id)?;
        entries.bytes = entries.bytes.saturating_sub(entry.bytes());
        if let Some(suppressed) = entries.landings.admit(now_ms) {
            log::info!(
                "store {} of an idle worker landed by the store thread after {} attempt(s) \
                 ({suppressed} similar not logged)",
                entry.what,
                entry.attempts
            );
        }
        entry.on_landed
    }

    /// From the courier: the store says "not the owner". Final for a completion (another
    /// record holds the key); a release is asked again a few times, as core asks its own: the
    /// claim it undoes may still be on its way on the worker's stream, which the courier's
    /// stream can overtake.
    pub fn not_owner(&self, id: u64, now_ms: u64) {
        let claim_may_be_behind = self
            .lock()
            .by_id
            .get(&id)
            .is_some_and(|e| e.what == "Release" && e.attempts < RELEASE_NOT_OWNER_ATTEMPTS);
        if claim_may_be_behind {
            self.failed(
                id,
                now_ms,
                "the claim it releases has not reached the store yet",
            );
        } else {
            self.landed(id, now_ms);
        }
    }

    /// From the courier: the attempt failed (stream closed, store busy): due again after a
    /// backoff.
    pub fn failed(&self, id: u64, now_ms: u64, why: &str) {
        let mut entries = self.lock();
        let Some(entry) = entries.by_id.get_mut(&id) else {
            return;
        };
        entry.in_flight_since = None;
        let backoff = FIRST_BACKOFF_MS
            .saturating_mul(1 << entry.attempts.min(16))
            .min(MAX_BACKOFF_MS);
        entry.due_ms = now_ms.saturating_add(backoff);
        let (what, attempts) = (entry.what, entry.attempts);
        if let Some(suppressed) = entries.failures.admit(now_ms) {
            log::warn!(
                "store {what} of an idle worker failed on the store thread (attempt \
                 {attempts}): {why}; retried until its deadline ({suppressed} similar not logged)"
            );
        }
    }

    pub fn is_empty(&self) -> bool {
        self.lock().by_id.is_empty()
    }

    /// Entries held, their bytes, and writes not kept or given up so far.
    #[cfg(test)]
    pub fn census(&self) -> (usize, usize, u64) {
        let entries = self.lock();
        (entries.by_id.len(), entries.bytes, entries.dropped)
    }
}

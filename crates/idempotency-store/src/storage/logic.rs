//! The record state machine for backends that keep records themselves
//! (memory, embedded). Pure functions over "what is stored now", so both
//! backends share one implementation and only differ in how they make the
//! read-decide-write step atomic. The redis backend mirrors this in Lua.

use super::{
    ClaimOutcome, CompleteOutcome, Digest, OwnerToken, RecordState, RecordView, ReleaseOutcome,
};

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoredBody {
    InFlight { owner: OwnerToken },
    Completed { record: Vec<u8> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredRecord {
    pub fingerprint: Digest,
    /// Lease end for in-flight records, TTL end for completed ones.
    pub expires_at_ms: u64,
    pub body: StoredBody,
}

impl StoredRecord {
    pub fn is_live(&self, now_ms: u64) -> bool {
        now_ms < self.expires_at_ms
    }
}

/// What the backend must do to its stored copy, plus the answer to give.
#[derive(Debug)]
pub(crate) enum Decision<T> {
    Keep(T),
    Put(StoredRecord, T),
    Delete(T),
}

pub(crate) fn claim(
    existing: Option<&StoredRecord>,
    fingerprint: &Digest,
    lease_ms: u64,
    now_ms: u64,
    owner: &OwnerToken,
) -> Decision<ClaimOutcome> {
    if let Some(rec) = existing.filter(|r| r.is_live(now_ms)) {
        if rec.fingerprint != *fingerprint {
            return Decision::Keep(ClaimOutcome::Mismatch);
        }
        return Decision::Keep(match &rec.body {
            StoredBody::InFlight { .. } => ClaimOutcome::InFlight {
                retry_after_ms: rec.expires_at_ms.saturating_sub(now_ms).max(1),
            },
            StoredBody::Completed { record } => ClaimOutcome::Completed {
                record: record.clone(),
            },
        });
    }
    // Absent, expired completion, or lapsed lease (takeover): a new claim.
    let lease_expires_at_ms = now_ms.saturating_add(lease_ms);
    let rec = StoredRecord {
        fingerprint: fingerprint.clone(),
        expires_at_ms: lease_expires_at_ms,
        body: StoredBody::InFlight {
            owner: owner.clone(),
        },
    };
    Decision::Put(
        rec,
        ClaimOutcome::Claimed {
            owner: owner.clone(),
            lease_expires_at_ms,
        },
    )
}

fn owned_in_flight<'a>(
    existing: Option<&'a StoredRecord>,
    owner: &OwnerToken,
) -> Option<&'a StoredRecord> {
    // A lapsed lease still belongs to its owner until someone takes it over
    // (or the sweeper removes it): the work may well have succeeded late.
    existing.filter(|r| matches!(&r.body, StoredBody::InFlight { owner: o } if o == owner))
}

pub(crate) fn complete(
    existing: Option<&StoredRecord>,
    owner: &OwnerToken,
    ttl_ms: u64,
    record: Vec<u8>,
    now_ms: u64,
    fingerprint: Option<&Digest>,
) -> Decision<CompleteOutcome> {
    if let Some(rec) = owned_in_flight(existing, owner) {
        return Decision::Put(
            StoredRecord {
                fingerprint: rec.fingerprint.clone(),
                expires_at_ms: now_ms.saturating_add(ttl_ms),
                body: StoredBody::Completed { record },
            },
            CompleteOutcome::Completed,
        );
    }
    // A retried complete (the client resent it after losing the answer) finds
    // its own bytes already stored: confirm without touching the record, TTL
    // included. Other bytes are never written over a completion.
    let already_done = existing.filter(|r| r.is_live(now_ms)).is_some_and(
        |r| matches!(&r.body, StoredBody::Completed { record: stored } if *stored == record),
    );
    if already_done {
        return Decision::Keep(CompleteOutcome::Completed);
    }
    // Nothing live holds the key: the claim lapsed and went while the completion waited
    // out an outage. Recording it is what a retry needs; a live record of anyone else is
    // never touched.
    if let Some(fingerprint) = fingerprint {
        if existing.is_none_or(|r| !r.is_live(now_ms)) {
            return Decision::Put(
                StoredRecord {
                    fingerprint: fingerprint.clone(),
                    expires_at_ms: now_ms.saturating_add(ttl_ms),
                    body: StoredBody::Completed { record },
                },
                CompleteOutcome::Completed,
            );
        }
    }
    Decision::Keep(CompleteOutcome::NotOwner)
}

pub(crate) fn release(
    existing: Option<&StoredRecord>,
    owner: &OwnerToken,
) -> Decision<ReleaseOutcome> {
    match owned_in_flight(existing, owner) {
        Some(_) => Decision::Delete(ReleaseOutcome::Released),
        None => Decision::Keep(ReleaseOutcome::NotOwner),
    }
}

pub(crate) fn view(existing: Option<&StoredRecord>, now_ms: u64) -> Option<RecordView> {
    let rec = existing.filter(|r| r.is_live(now_ms))?;
    let (state, record) = match &rec.body {
        StoredBody::InFlight { .. } => (RecordState::InFlight, None),
        StoredBody::Completed { record } => (RecordState::Completed, Some(record.clone())),
    };
    Some(RecordView {
        state,
        fingerprint: rec.fingerprint.clone(),
        expires_at_ms: rec.expires_at_ms,
        record,
    })
}

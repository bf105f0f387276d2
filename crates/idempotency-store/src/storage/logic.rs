//! The record state machine for backends that keep records themselves
//! (memory, embedded): `idempotency_protocol::decision` decides, these
//! functions turn its decision into what to store and what to answer. Pure
//! over "what is stored now", so both backends share one implementation and
//! only differ in how they make the read-decide-write step atomic. The redis
//! backend runs the same decisions in Lua.

use idempotency_protocol::decision::{
    self, ClaimDecision, CompleteDecision, Completion, ReleaseDecision, RenewDecision,
};

use super::{
    ClaimOutcome, CompleteOutcome, Digest, OwnerToken, RecordState, RecordView, ReleaseOutcome,
    RenewOutcome, Replacement, SettleOutcome,
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
    /// When it was claimed or completed; None for a record stored before that was kept.
    pub written_at_ms: Option<u64>,
    /// Completed records with a tombstone period: from `expires_at_ms` until this, the record
    /// is kept (and answered) without its body. The sweeper rewrites it so at
    /// `expires_at_ms`; until then a read strips the body itself.
    pub tombstone_until_ms: Option<u64>,
    pub body: StoredBody,
}

impl StoredRecord {
    /// The record as the protocol's decisions see it: a completed record lives until its
    /// tombstone's end.
    fn as_decided(&self) -> decision::Record<'_, Digest, OwnerToken> {
        match &self.body {
            StoredBody::InFlight { owner } => decision::Record::InFlight {
                fingerprint: &self.fingerprint,
                owner,
                lease_ends_at_ms: self.expires_at_ms,
            },
            StoredBody::Completed { record } => decision::Record::Completed {
                fingerprint: &self.fingerprint,
                expires_at_ms: self.live_until_ms(),
                record: Some(record),
            },
        }
    }

    /// The end of the whole record's life, tombstone included.
    pub fn live_until_ms(&self) -> u64 {
        self.tombstone_until_ms
            .map_or(self.expires_at_ms, |t| t.max(self.expires_at_ms))
    }

    pub fn is_live(&self, now_ms: u64) -> bool {
        self.as_decided().is_live(now_ms)
    }

    /// The recorded bytes a reader gets at `now_ms`: the whole record, or past its TTL its
    /// tombstone.
    pub fn answered_record(&self, now_ms: u64) -> Option<Vec<u8>> {
        let StoredBody::Completed { record } = &self.body else {
            return None;
        };
        if self.tombstone_until_ms.is_some() && now_ms >= self.expires_at_ms {
            return Some(tombstone_of(record));
        }
        Some(record.clone())
    }

    /// What the sweeper makes of a record at `expires_at_ms`: its tombstone, kept until the
    /// tombstone's end; None when the record is to go.
    pub fn into_tombstone(self, now_ms: u64) -> Option<StoredRecord> {
        let until = self.tombstone_until_ms.filter(|&t| t > now_ms)?;
        let StoredBody::Completed { record } = &self.body else {
            return None;
        };
        Some(StoredRecord {
            expires_at_ms: until,
            tombstone_until_ms: None,
            body: StoredBody::Completed {
                record: tombstone_of(record),
            },
            ..self
        })
    }
}

/// A recorded response without its body, marked as omitted (`RecordedResponse::without_body`).
/// Bytes the store cannot read as a recorded response stay as they are.
pub(crate) fn tombstone_of(record: &[u8]) -> Vec<u8> {
    use idempotency_protocol::record::RecordedResponse;
    match RecordedResponse::decode(record) {
        Some(response) => response.without_body().encode(),
        None => record.to_vec(),
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
    let current = existing.map(StoredRecord::as_decided);
    match decision::claim(current, fingerprint, Some(owner), now_ms) {
        ClaimDecision::Mismatch => Decision::Keep(ClaimOutcome::Mismatch),
        ClaimDecision::AlreadyClaimed { lease_ends_at_ms } => {
            Decision::Keep(ClaimOutcome::Claimed {
                owner: owner.clone(),
                lease_expires_at_ms: lease_ends_at_ms,
            })
        }
        ClaimDecision::InFlight { retry_after_ms } => {
            Decision::Keep(ClaimOutcome::InFlight { retry_after_ms })
        }
        ClaimDecision::Replay => match existing.and_then(|r| r.answered_record(now_ms)) {
            Some(record) => Decision::Keep(ClaimOutcome::Completed { record }),
            // Replay is only ever decided for a completed record; answer as if
            // the key were busy rather than invent a record.
            _ => Decision::Keep(ClaimOutcome::InFlight { retry_after_ms: 1 }),
        },
        ClaimDecision::Claim | ClaimDecision::TakeOver => {
            let lease_expires_at_ms = now_ms.saturating_add(lease_ms);
            let rec = StoredRecord {
                fingerprint: fingerprint.clone(),
                expires_at_ms: lease_expires_at_ms,
                written_at_ms: Some(now_ms),
                tombstone_until_ms: None,
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
    }
}

pub(crate) fn complete(
    existing: Option<&StoredRecord>,
    owner: &OwnerToken,
    ttl_ms: u64,
    tombstone_ms: u64,
    record: Vec<u8>,
    now_ms: u64,
    fingerprint: Option<&Digest>,
) -> Decision<CompleteOutcome> {
    let asked = Completion {
        owner,
        record: &record,
        fingerprint,
    };
    let decided = match decision::complete(existing.map(StoredRecord::as_decided), &asked, now_ms) {
        // The sweeper has turned this very completion into its tombstone: a retry of it is
        // still answered as recorded, as on Redis, not as somebody else's.
        CompleteDecision::NotOwner
            if tombstone_ms > 0 && holds_tombstone_of(existing, &record, now_ms) =>
        {
            CompleteDecision::AlreadyRecorded
        }
        decided => decided,
    };
    // The record keeps the claim's fingerprint; a fresh one takes the caller's.
    let recorded_under = match decided {
        CompleteDecision::Record => existing.map(|r| &r.fingerprint),
        CompleteDecision::RecordAfresh => fingerprint,
        CompleteDecision::AlreadyRecorded => return Decision::Keep(CompleteOutcome::Completed),
        CompleteDecision::NotOwner => return Decision::Keep(CompleteOutcome::NotOwner),
    };
    match recorded_under {
        Some(fingerprint) => Decision::Put(
            StoredRecord {
                fingerprint: fingerprint.clone(),
                expires_at_ms: now_ms.saturating_add(ttl_ms),
                written_at_ms: Some(now_ms),
                tombstone_until_ms: (tombstone_ms > 0)
                    .then(|| now_ms.saturating_add(ttl_ms).saturating_add(tombstone_ms)),
                body: StoredBody::Completed { record },
            },
            CompleteOutcome::Completed,
        ),
        // Both decisions above come with a fingerprint; refuse rather than guess one.
        None => Decision::Keep(CompleteOutcome::NotOwner),
    }
}

/// Whether `existing` is a live completed record holding exactly `record`'s tombstone.
fn holds_tombstone_of(existing: Option<&StoredRecord>, record: &[u8], now_ms: u64) -> bool {
    match existing {
        Some(
            stored @ StoredRecord {
                body: StoredBody::Completed { record: kept },
                ..
            },
        ) => stored.is_live(now_ms) && *kept == tombstone_of(record),
        _ => false,
    }
}

pub(crate) fn release(
    existing: Option<&StoredRecord>,
    owner: &OwnerToken,
) -> Decision<ReleaseOutcome> {
    match decision::release(existing.map(StoredRecord::as_decided), owner) {
        ReleaseDecision::Release => Decision::Delete(ReleaseOutcome::Released),
        ReleaseDecision::NotOwner => Decision::Keep(ReleaseOutcome::NotOwner),
    }
}

/// The claim keeps everything but its lease end (its `written_at_ms` stays the claim's time).
pub(crate) fn renew(
    existing: Option<&StoredRecord>,
    owner: &OwnerToken,
    lease_ms: u64,
    now_ms: u64,
) -> Decision<RenewOutcome> {
    let decided = decision::renew(
        existing.map(StoredRecord::as_decided),
        owner,
        lease_ms,
        now_ms,
    );
    match (decided, existing) {
        (RenewDecision::Renew { lease_ends_at_ms }, Some(claim)) => {
            let renewed = RenewOutcome::Renewed {
                lease_expires_at_ms: lease_ends_at_ms,
            };
            if lease_ends_at_ms == claim.expires_at_ms {
                return Decision::Keep(renewed);
            }
            let record = StoredRecord {
                expires_at_ms: lease_ends_at_ms,
                ..claim.clone()
            };
            Decision::Put(record, renewed)
        }
        // Renew is only ever decided for a stored claim; with nothing stored there is
        // nothing to renew.
        (RenewDecision::Renew { .. }, None) | (RenewDecision::NotOwner, _) => {
            Decision::Keep(RenewOutcome::NotOwner)
        }
    }
}

/// See `Storage::settle`: the record keeps its fingerprint, and its expiry unless the
/// replacement gives a TTL.
pub(crate) fn settle(
    existing: Option<&StoredRecord>,
    current: &[u8],
    replacement: Option<Replacement>,
    now_ms: u64,
) -> Decision<SettleOutcome> {
    let Some(rec) = existing.filter(|r| r.is_live(now_ms)) else {
        return Decision::Keep(SettleOutcome::NotFound);
    };
    match &rec.body {
        StoredBody::Completed { record } if record.as_slice() == current => {}
        _ => return Decision::Keep(SettleOutcome::NotFound),
    }
    match replacement {
        None => Decision::Delete(SettleOutcome::Removed),
        Some(Replacement {
            record,
            ttl_ms,
            tombstone_ms,
        }) => {
            let expires_at_ms = ttl_ms.map_or(rec.expires_at_ms, |ttl| now_ms.saturating_add(ttl));
            Decision::Put(
                StoredRecord {
                    fingerprint: rec.fingerprint.clone(),
                    expires_at_ms,
                    written_at_ms: Some(now_ms),
                    // As `complete` keeps one: from the TTL's end, for `tombstone_ms`.
                    tombstone_until_ms: (tombstone_ms > 0)
                        .then(|| expires_at_ms.saturating_add(tombstone_ms)),
                    body: StoredBody::Completed { record },
                },
                SettleOutcome::Replaced,
            )
        }
    }
}

pub(crate) fn view(existing: Option<&StoredRecord>, now_ms: u64) -> Option<RecordView> {
    let rec = existing.filter(|r| r.is_live(now_ms))?;
    let (state, record, owner) = match &rec.body {
        StoredBody::InFlight { owner } => (RecordState::InFlight, None, Some(owner.clone())),
        StoredBody::Completed { .. } => (RecordState::Completed, rec.answered_record(now_ms), None),
    };
    Some(RecordView {
        state,
        fingerprint: rec.fingerprint.clone(),
        expires_at_ms: rec.live_until_ms(),
        record,
        owner,
        written_at_ms: rec.written_at_ms,
        now_ms,
    })
}

/// Whatever is stored goes; the answer is the live record it was, if it was live.
pub(crate) fn purge(existing: Option<&StoredRecord>, now_ms: u64) -> Decision<Option<RecordView>> {
    match existing {
        Some(rec) => Decision::Delete(view(Some(rec), now_ms)),
        None => Decision::Keep(None),
    }
}

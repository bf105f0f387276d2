//! What a claim, a complete, a release or a renew does, given what the key holds now. Written once so
//! that the store's backends and the filter's local table cannot drift apart; each keeps its
//! own storage and makes its read-decide-write step atomic its own way. (The store's Redis
//! backend runs the same decisions as Lua scripts on the server, documented against these
//! functions.)
//!
//! Generic over how a fingerprint and an owner are held (hex text and a token in the store,
//! bytes and a number in the local table): the decisions only compare them.

/// What a key holds, as a decision needs to see it. An expired record is given as it is,
/// not left out: whether a lease has passed matters (a takeover; a late completion by the
/// lease's own owner).
#[derive(Debug, PartialEq, Eq)]
pub enum Record<'a, F, O> {
    InFlight {
        fingerprint: &'a F,
        owner: &'a O,
        lease_ends_at_ms: u64,
    },
    Completed {
        fingerprint: &'a F,
        expires_at_ms: u64,
        /// The recorded bytes, where they are kept with the record (the store); `None` where
        /// they live elsewhere (the local table keeps them under a key of their own).
        record: Option<&'a [u8]>,
    },
}

impl<F, O> Record<'_, F, O> {
    /// Lease end for an in-flight record, TTL end for a completed one.
    pub fn expires_at_ms(&self) -> u64 {
        match self {
            Self::InFlight {
                lease_ends_at_ms, ..
            } => *lease_ends_at_ms,
            Self::Completed { expires_at_ms, .. } => *expires_at_ms,
        }
    }

    /// A record is live while `now < expires_at_ms`; every read treats an expired one as
    /// absent, whether or not it has been removed yet.
    pub fn is_live(&self, now_ms: u64) -> bool {
        now_ms < self.expires_at_ms()
    }

    fn fingerprint(&self) -> &F {
        match self {
            Self::InFlight { fingerprint, .. } | Self::Completed { fingerprint, .. } => fingerprint,
        }
    }
}

/// What a claim of a key does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimDecision {
    /// Nothing live holds the key (never claimed, released, or its completion expired):
    /// write a new in-flight record, lease from now.
    Claim,
    /// The key holds an in-flight claim whose lease has passed: its owner is presumed gone,
    /// and the new in-flight record replaces it.
    TakeOver,
    /// A live claim for the same payload is still running; nothing changes.
    InFlight { retry_after_ms: u64 },
    /// The caller's own live claim (same owner, same payload), asked for again because the
    /// answer to its claim was lost: it is the caller's; nothing changes, its lease included.
    AlreadyClaimed { lease_ends_at_ms: u64 },
    /// A live completion for the same payload: replay it; nothing changes.
    Replay,
    /// A live record holds the key for another payload; nothing changes.
    Mismatch,
}

impl ClaimDecision {
    /// Whether the caller now writes its own in-flight record.
    pub fn claims(self) -> bool {
        matches!(self, Self::Claim | Self::TakeOver)
    }
}

/// The claim rule: a live record answers for the key (mismatch before anything else, so that
/// no payload learns about another's progress); otherwise the key is claimed. `owner` is the
/// caller's own token when it chose one: its own live claim is answered as claimed again.
pub fn claim<F: PartialEq, O: PartialEq>(
    existing: Option<Record<'_, F, O>>,
    fingerprint: &F,
    owner: Option<&O>,
    now_ms: u64,
) -> ClaimDecision {
    let Some(current) = existing else {
        return ClaimDecision::Claim;
    };
    if !current.is_live(now_ms) {
        return match current {
            Record::InFlight { .. } => ClaimDecision::TakeOver,
            Record::Completed { .. } => ClaimDecision::Claim,
        };
    }
    if current.fingerprint() != fingerprint {
        return ClaimDecision::Mismatch;
    }
    match current {
        Record::InFlight {
            owner: holder,
            lease_ends_at_ms,
            ..
        } if owner == Some(holder) => ClaimDecision::AlreadyClaimed { lease_ends_at_ms },
        Record::InFlight {
            lease_ends_at_ms, ..
        } => ClaimDecision::InFlight {
            // Never 0: a client told to retry at once would spin while the lease runs.
            retry_after_ms: lease_ends_at_ms.saturating_sub(now_ms).max(1),
        },
        Record::Completed { .. } => ClaimDecision::Replay,
    }
}

/// A completion as its caller asks for it.
#[derive(Debug, Clone, Copy)]
pub struct Completion<'a, F, O> {
    pub owner: &'a O,
    /// The bytes to record. A live completion holding exactly these confirms a resent
    /// complete.
    pub record: &'a [u8],
    /// The claim's fingerprint, when the caller wants a key that holds nothing live (its
    /// claim lapsed and went while the completion waited) recorded rather than refused.
    pub fingerprint: Option<&'a F>,
}

/// What a complete of a key does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompleteDecision {
    /// The caller's own in-flight claim (its lease may have passed, as long as nobody took
    /// over): record the bytes under the claim's fingerprint, TTL from now.
    Record,
    /// A live completion of exactly these bytes: a resent complete whose answer was lost.
    /// Confirm it and change nothing, its TTL included.
    AlreadyRecorded,
    /// Nothing live holds the key and the caller named its claim's fingerprint: the write
    /// did execute, so record the bytes under that fingerprint, TTL from now.
    RecordAfresh,
    /// Anything else: another owner's claim, another completion, or nothing (without a
    /// fingerprint). Nothing changes; in particular a completion is never overwritten.
    NotOwner,
}

impl CompleteDecision {
    /// Whether the caller gets a success answer.
    pub fn completes(self) -> bool {
        !matches!(self, Self::NotOwner)
    }
}

pub fn complete<F, O: PartialEq>(
    existing: Option<Record<'_, F, O>>,
    request: &Completion<'_, F, O>,
    now_ms: u64,
) -> CompleteDecision {
    if owns(existing.as_ref(), request.owner) {
        return CompleteDecision::Record;
    }
    let live = existing.filter(|r| r.is_live(now_ms));
    match live {
        Some(Record::Completed {
            record: Some(stored),
            ..
        }) if stored == request.record => CompleteDecision::AlreadyRecorded,
        None if request.fingerprint.is_some() => CompleteDecision::RecordAfresh,
        _ => CompleteDecision::NotOwner,
    }
}

/// What a release of a key does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseDecision {
    /// The caller's own in-flight claim (lease passed or not): remove it so that a retry
    /// executes at once.
    Release,
    /// Not the caller's claim, or no claim at all: nothing changes.
    NotOwner,
}

pub fn release<F, O: PartialEq>(existing: Option<Record<'_, F, O>>, owner: &O) -> ReleaseDecision {
    if owns(existing.as_ref(), owner) {
        ReleaseDecision::Release
    } else {
        ReleaseDecision::NotOwner
    }
}

/// What a renew of a claim's lease does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenewDecision {
    /// The caller's own in-flight claim (lease passed or not, as long as nobody took over):
    /// its lease now ends at `lease_ends_at_ms`, which is never earlier than before.
    Renew { lease_ends_at_ms: u64 },
    /// Another owner's claim, a completion, or nothing: nothing changes. A renew never
    /// creates a record and never touches a completed one.
    NotOwner,
}

/// The renew rule: the caller's claim runs until `now + lease_ms`, or its current lease end
/// if that is later (a renew with a shorter lease must not cut short a longer one).
pub fn renew<F, O: PartialEq>(
    existing: Option<Record<'_, F, O>>,
    owner: &O,
    lease_ms: u64,
    now_ms: u64,
) -> RenewDecision {
    match owned_lease_end(existing.as_ref(), owner) {
        Some(lease_ends_at_ms) => RenewDecision::Renew {
            lease_ends_at_ms: lease_ends_at_ms.max(now_ms.saturating_add(lease_ms)),
        },
        None => RenewDecision::NotOwner,
    }
}

/// Complete, release and renew all start from ownership. A lapsed lease still belongs to its
/// owner until someone takes it over (or it is removed): the work may well have succeeded late.
fn owns<F, O: PartialEq>(existing: Option<&Record<'_, F, O>>, owner: &O) -> bool {
    owned_lease_end(existing, owner).is_some()
}

/// The lease end of `owner`'s in-flight claim, if the key holds one.
fn owned_lease_end<F, O: PartialEq>(existing: Option<&Record<'_, F, O>>, owner: &O) -> Option<u64> {
    match existing {
        Some(Record::InFlight {
            owner: held,
            lease_ends_at_ms,
            ..
        }) if *held == owner => Some(*lease_ends_at_ms),
        _ => None,
    }
}

#[cfg(test)]
mod tests;

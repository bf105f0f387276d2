//! The local claim table: a fixed set of bucket keys in Envoy's shared data, each holding a
//! few slots, updated only with compare-and-swap.
//!
//! Why fixed buckets: the host's CAS does not protect the creation of a key (a write to an
//! absent key always succeeds), so every bucket is created before traffic and claims only
//! ever CAS an existing bucket. Memory is bounded by the capacity; a slot is reused once its
//! record has expired; an in-flight slot is never evicted. Every operation touches one bucket,
//! so its cost does not grow with the table.

use std::cell::RefCell;

use idempotency_protocol::decision::{self, ClaimDecision, CompleteDecision, ReleaseDecision};

use crate::key::Digest;
use crate::record::RecordedResponse;
use crate::wire::Reader;

/// Slots per bucket. Each claim copies one bucket (8 × 83 bytes), and a key is refused only
/// when all slots of its bucket hold live records: with 8 slots that stays rare (about 0.1 %
/// of new keys) while a quarter of the table is live, where 4 slots refused about 2 % in the
/// million-key benchmark.
pub const WAYS: usize = 8;
const SLOT_BYTES: usize = 1 + 32 + 32 + 8 + 8 + 2;
/// CAS retries before giving up on one bucket (only other workers' writes cause retries).
const MAX_CAS_ATTEMPTS: usize = 32;
/// How long a completing claim is kept live while its response is written: far longer than
/// the few host calls between its ownership CAS and the write, which run without yielding.
const RECORDING_GRACE_MS: u64 = 5_000;
/// A cas that no real entry carries yet: writing with it creates the key if absent and is
/// refused if another worker created it first.
const CREATE_IF_ABSENT_CAS: u32 = u32::MAX;

/// The host's shared data, as the table needs it.
pub trait SharedData {
    /// None when the key does not exist; otherwise its value (possibly empty) and cas.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError>;
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError>;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetOutcome {
    Stored,
    CasMismatch,
}

/// A host call failed with an unexpected status (named for the log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostError(pub String);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableError {
    Host(HostError),
    /// Other workers kept winning the CAS on this bucket.
    Contended,
}

impl From<HostError> for TableError {
    fn from(e: HostError) -> Self {
        TableError::Host(e)
    }
}

impl std::fmt::Display for TableError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TableError::Host(HostError(status)) => write!(f, "shared data call failed: {status}"),
            TableError::Contended => write!(f, "shared data bucket stayed contended"),
        }
    }
}

/// Where a record lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRef {
    /// 0: this table; n: its n-th predecessor (a table a capacity change replaced).
    pub generation: u8,
    pub bucket: u32,
    pub way: u8,
}

/// A claim this request holds until it completes or releases it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub slot: SlotRef,
    pub key: Digest,
    /// The payload the claim was made for (a late store completion recreates the record
    /// with it if the store's claim has lapsed and gone).
    pub fingerprint: Digest,
    pub owner: u64,
    /// The slot held an abandoned in-flight claim of the same key whose lease had passed.
    pub took_over: bool,
}

/// What a claim attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This request owns the key: execute it.
    Claimed(Held),
    /// Another request with this key and payload is still running.
    InFlight { retry_after_ms: u64 },
    /// A response is recorded for this key and payload: replay it.
    Completed {
        slot: SlotRef,
        owner: u64,
        status: u16,
    },
    /// The key is live with a different payload.
    Mismatch,
    /// No free or expired slot in the key's bucket.
    Full,
}

/// What completing a held claim did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    Recorded,
    /// The lease passed and another request took the key over; nothing was overwritten.
    LostOwnership,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free = 0,
    InFlight = 1,
    Completed = 2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    state: SlotState,
    key: Digest,
    fingerprint: Digest,
    owner: u64,
    expires_at_ms: u64,
    status: u16,
}

const FREE_SLOT: Slot = Slot {
    state: SlotState::Free,
    key: [0; 32],
    fingerprint: [0; 32],
    owner: 0,
    expires_at_ms: 0,
    status: 0,
};

impl Slot {
    /// What this slot holds for `key`, as the protocol's decisions see it. The response of a
    /// completed slot lives under its own key, so the decision never sees its bytes.
    fn record_for(&self, key: &Digest) -> Option<decision::Record<'_, Digest, u64>> {
        if self.key != *key {
            return None;
        }
        match self.state {
            SlotState::Free => None,
            SlotState::InFlight => Some(decision::Record::InFlight {
                fingerprint: &self.fingerprint,
                owner: &self.owner,
                lease_ends_at_ms: self.expires_at_ms,
            }),
            SlotState::Completed => Some(decision::Record::Completed {
                fingerprint: &self.fingerprint,
                expires_at_ms: self.expires_at_ms,
                record: None,
            }),
        }
    }

    fn live(&self, now_ms: u64) -> bool {
        self.record_for(&self.key)
            .is_some_and(|r| r.is_live(now_ms))
    }
}

/// Which write a held claim makes; both need the claim to be still its holder's.
#[derive(Debug, Clone, Copy)]
enum HeldWrite {
    Complete { now_ms: u64 },
    Release,
}

impl HeldWrite {
    fn allowed(self, current: Option<decision::Record<'_, Digest, u64>>, owner: &u64) -> bool {
        match self {
            HeldWrite::Complete { now_ms } => {
                // No bytes and no fingerprint: a held claim completes once (the table never
                // sees a resent complete), and a claim gone from its slot is not recorded
                // afresh (the slot may hold another key by then). Only `Record` remains.
                let asked = decision::Completion {
                    owner,
                    record: &[],
                    fingerprint: None,
                };
                decision::complete(current, &asked, now_ms) == CompleteDecision::Record
            }
            HeldWrite::Release => decision::release(current, owner) == ReleaseDecision::Release,
        }
    }
}

fn decode_bucket(bytes: &[u8]) -> [Slot; WAYS] {
    let mut slots = [FREE_SLOT; WAYS];
    let mut r = Reader::new(bytes);
    for slot in slots.iter_mut() {
        // A short or unreadable bucket leaves the remaining slots free.
        match decode_slot(&mut r) {
            Some(s) => *slot = s,
            None => break,
        }
    }
    slots
}

fn decode_slot(r: &mut Reader<'_>) -> Option<Slot> {
    let state = match r.u8()? {
        1 => SlotState::InFlight,
        2 => SlotState::Completed,
        _ => SlotState::Free,
    };
    Some(Slot {
        state,
        key: r.array()?,
        fingerprint: r.array()?,
        owner: r.u64()?,
        expires_at_ms: r.u64()?,
        status: r.u16()?,
    })
}

fn encode_bucket(slots: &[Slot; WAYS]) -> Vec<u8> {
    let mut out = Vec::with_capacity(SLOT_BYTES * WAYS);
    for s in slots {
        out.push(s.state as u8);
        out.extend_from_slice(&s.key);
        out.extend_from_slice(&s.fingerprint);
        out.extend_from_slice(&s.owner.to_be_bytes());
        out.extend_from_slice(&s.expires_at_ms.to_be_bytes());
        out.extend_from_slice(&s.status.to_be_bytes());
    }
    out
}

/// The table's answer to a claim of a key one of its records holds, wherever that record lives
/// (this table or a predecessor): 422 for another payload, a replay once completed, 409 while
/// in flight. None when the protocol's decision is to claim the key.
fn answer(decided: ClaimDecision, slot: &Slot, at: SlotRef) -> Option<Claim> {
    match decided {
        ClaimDecision::Claim | ClaimDecision::TakeOver => None,
        ClaimDecision::InFlight { retry_after_ms } => Some(Claim::InFlight { retry_after_ms }),
        ClaimDecision::Replay => Some(Claim::Completed {
            slot: at,
            owner: slot.owner,
            status: slot.status,
        }),
        ClaimDecision::Mismatch => Some(Claim::Mismatch),
    }
}

/// The table's geometry and key names.
#[derive(Debug, Clone)]
pub struct Table {
    prefix: String,
    buckets: u32,
    /// Tables an earlier capacity replaced whose records may still be live, newest first:
    /// consulted (read only) for a key this table does not hold. Changes while the table is
    /// in use: Envoy may bring an older configuration's root context back without
    /// configuring it again (see `table_lineage::LineageWatch`).
    predecessors: RefCell<Vec<Table>>,
}

impl Table {
    /// `namespace` separates tables of plugins sharing one VM id (Istio sets none).
    pub fn new(namespace: &str, capacity: u32) -> Table {
        Table::with_buckets(namespace, capacity.div_ceil(WAYS as u32))
    }

    pub fn with_buckets(namespace: &str, buckets: u32) -> Table {
        let buckets = buckets.max(1);
        Table {
            prefix: format!("{namespace}/idempotency/v1/{buckets}x{WAYS}"),
            buckets,
            predecessors: RefCell::new(Vec::new()),
        }
    }

    pub fn set_predecessors(&self, predecessors: Vec<Table>) {
        *self.predecessors.borrow_mut() = predecessors;
    }

    /// Empties up to `count` buckets, from `first`, and their recorded responses, of a table
    /// no configuration uses any more (the host cannot delete keys: each stays, with an
    /// empty value). Returns where to go on, or None when the table is empty. In steps, so
    /// that emptying a large table never holds the process-wide shared-data lock for long.
    pub fn empty_buckets(
        &self,
        shared: &impl SharedData,
        first: u32,
        count: u32,
    ) -> Result<Option<u32>, HostError> {
        let end = first.saturating_add(count).min(self.buckets);
        for bucket in first..end {
            shared.set(&self.bucket_key(bucket), &[], None)?;
            for way in 0..WAYS as u8 {
                let slot = SlotRef {
                    generation: 0,
                    bucket,
                    way,
                };
                shared.set(&self.response_key(slot), &[], None)?;
            }
        }
        Ok((end < self.buckets).then_some(end))
    }

    /// What a predecessor holds for `key`: a live record stops a new claim in this table.
    fn claim_in_predecessors(
        &self,
        shared: &impl SharedData,
        key: &Digest,
        fingerprint: &Digest,
        now_ms: u64,
    ) -> Result<Option<Claim>, HostError> {
        let predecessors = self.predecessors.borrow();
        for (n, old) in predecessors.iter().enumerate() {
            let bucket = old.bucket_of(key);
            let Some((bytes, _)) = shared.get(&old.bucket_key(bucket))? else {
                continue;
            };
            let slots = decode_bucket(&bytes);
            let found = slots
                .iter()
                .enumerate()
                .find(|(_, s)| s.state != SlotState::Free && s.key == *key && s.live(now_ms));
            let Some((way, slot)) = found else {
                continue;
            };
            let at = SlotRef {
                generation: u8::try_from(n + 1).unwrap_or(u8::MAX),
                bucket,
                way: way as u8,
            };
            let decided = decision::claim(slot.record_for(key), fingerprint, now_ms);
            if let Some(found) = answer(decided, slot, at) {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }

    pub fn bucket_count(&self) -> u32 {
        self.buckets
    }

    /// Upper bound of records the table holds.
    pub fn capacity(&self) -> u64 {
        u64::from(self.buckets) * WAYS as u64
    }

    fn bucket_key(&self, bucket: u32) -> String {
        format!("{}/b/{bucket}", self.prefix)
    }

    fn response_key(&self, slot: SlotRef) -> String {
        format!("{}/r/{}/{}", self.prefix, slot.bucket, slot.way)
    }

    fn bucket_of(&self, key: &Digest) -> u32 {
        let mut head = [0u8; 8];
        for (dst, src) in head.iter_mut().zip(key.iter()) {
            *dst = *src;
        }
        (u64::from_be_bytes(head) % u64::from(self.buckets)) as u32
    }

    /// Creates every bucket that does not exist yet; safe to run from every worker at once.
    pub fn create_buckets(&self, shared: &impl SharedData) -> Result<(), HostError> {
        for bucket in 0..self.buckets {
            self.create_bucket(shared, bucket)?;
        }
        Ok(())
    }

    fn create_bucket(&self, shared: &impl SharedData, bucket: u32) -> Result<(), HostError> {
        let key = self.bucket_key(bucket);
        // Every configure (each Istio push) runs this over live buckets: an existing bucket is
        // never written, since the host's cas is a wrapping counter and a bucket whose cas
        // happens to equal CREATE_IF_ABSENT_CAS would otherwise be replaced by an empty one.
        if shared.get(&key)?.is_some() {
            return Ok(());
        }
        // Refused (CasMismatch) when another worker created it since: that is the point.
        shared
            .set(&key, &[], Some(CREATE_IF_ABSENT_CAS))
            .map(|_| ())
    }

    fn read_bucket(
        &self,
        shared: &impl SharedData,
        bucket: u32,
    ) -> Result<([Slot; WAYS], u32), HostError> {
        let key = self.bucket_key(bucket);
        for _ in 0..2 {
            if let Some((bytes, cas)) = shared.get(&key)? {
                return Ok((decode_bucket(&bytes), cas));
            }
            // Missing only if creation at configure time failed; create it now, race-free.
            self.create_bucket(shared, bucket)?;
        }
        Err(HostError("bucket could not be created".to_string()))
    }

    /// Claims `key` for a request with payload `fingerprint`, or reports who holds it.
    pub fn claim(
        &self,
        shared: &impl SharedData,
        key: &Digest,
        fingerprint: &Digest,
        owner: u64,
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<Claim, TableError> {
        let bucket = self.bucket_of(key);
        for _ in 0..MAX_CAS_ATTEMPTS {
            let (mut slots, cas) = self.read_bucket(shared, bucket)?;
            let same_key = slots
                .iter()
                .position(|s| s.state != SlotState::Free && s.key == *key);
            let mut took_over = false;
            if let Some((way, slot)) = same_key.and_then(|w| Some((w, slots.get(w)?))) {
                let decided = decision::claim(slot.record_for(key), fingerprint, now_ms);
                let at = SlotRef {
                    generation: 0,
                    bucket,
                    way: way as u8,
                };
                if let Some(found) = answer(decided, slot, at) {
                    return Ok(found);
                }
                took_over = decided == ClaimDecision::TakeOver;
            }
            if same_key.is_none() && !self.predecessors.borrow().is_empty() {
                if let Some(found) = self.claim_in_predecessors(shared, key, fingerprint, now_ms)? {
                    return Ok(found);
                }
            }
            let way = same_key.or_else(|| slots.iter().position(|s| !s.live(now_ms)));
            let Some(way) = way else {
                return Ok(Claim::Full);
            };
            let Some(slot) = slots.get_mut(way) else {
                return Ok(Claim::Full);
            };
            *slot = Slot {
                state: SlotState::InFlight,
                key: *key,
                fingerprint: *fingerprint,
                owner,
                expires_at_ms: now_ms.saturating_add(lease_ms),
                status: 0,
            };
            let bucket_key = self.bucket_key(bucket);
            if shared.set(&bucket_key, &encode_bucket(&slots), Some(cas))? == SetOutcome::Stored {
                return Ok(Claim::Claimed(Held {
                    slot: SlotRef {
                        generation: 0,
                        bucket,
                        way: way as u8,
                    },
                    key: *key,
                    fingerprint: *fingerprint,
                    owner,
                    took_over,
                }));
            }
        }
        Err(TableError::Contended)
    }

    /// Records `response` for a held claim and keeps it for `ttl_ms`.
    pub fn complete(
        &self,
        shared: &impl SharedData,
        held: &Held,
        response: &RecordedResponse,
        now_ms: u64,
        ttl_ms: u64,
    ) -> Result<Completion, TableError> {
        // The response key is written without a cas (a slot's previous response may be
        // megabytes; reading it for its cas would copy it into the VM). So first prove
        // ownership on a claim that stays live for a moment: a late finisher whose lease has
        // passed can then never overwrite the response of a request that took its slot over,
        // because that takeover either happened before the proof or cannot happen until
        // after the write below. A claim with more than the grace left needs only a read
        // (nobody can take it over before it expires); a claim closer to its end is renewed
        // by a CAS.
        let write = HeldWrite::Complete { now_ms };
        let renewed = self.update_held(shared, held, write, |slot| {
            let live_long_enough = now_ms.saturating_add(RECORDING_GRACE_MS);
            if slot.expires_at_ms >= live_long_enough {
                return Ok(false);
            }
            slot.expires_at_ms = live_long_enough;
            Ok(true)
        })?;
        if renewed == Completion::LostOwnership {
            return Ok(Completion::LostOwnership);
        }
        // Written before the slot flips to completed, so a reader that sees "completed" finds
        // the response; the owner inside ties it to this claim.
        let encoded = RecordedResponse {
            owner: held.owner,
            ..response.clone()
        }
        .encode();
        shared.set(&self.response_key(held.slot), &encoded, None)?;
        self.update_held(shared, held, write, |slot| {
            slot.state = SlotState::Completed;
            slot.expires_at_ms = now_ms.saturating_add(ttl_ms);
            slot.status = response.status;
            Ok(true)
        })
    }

    /// Frees a held claim so that a retry executes again.
    pub fn release(&self, shared: &impl SharedData, held: &Held) -> Result<Completion, TableError> {
        self.update_held(shared, held, HeldWrite::Release, |slot| {
            *slot = FREE_SLOT;
            Ok(true)
        })
    }

    fn update_held(
        &self,
        shared: &impl SharedData,
        held: &Held,
        write: HeldWrite,
        mut change: impl FnMut(&mut Slot) -> Result<bool, HostError>,
    ) -> Result<Completion, TableError> {
        for _ in 0..MAX_CAS_ATTEMPTS {
            let (mut slots, cas) = self.read_bucket(shared, held.slot.bucket)?;
            let Some(slot) = slots.get_mut(usize::from(held.slot.way)) else {
                return Ok(Completion::LostOwnership);
            };
            if !write.allowed(slot.record_for(&held.key), &held.owner) {
                return Ok(Completion::LostOwnership);
            }
            if !change(slot)? {
                // Nothing to write: ownership was proven by the read.
                return Ok(Completion::Recorded);
            }
            let key = self.bucket_key(held.slot.bucket);
            if shared.set(&key, &encode_bucket(&slots), Some(cas))? == SetOutcome::Stored {
                return Ok(Completion::Recorded);
            }
        }
        Err(TableError::Contended)
    }

    /// The response recorded by claim `owner` in `slot`, if it is still there intact.
    pub fn load_response(
        &self,
        shared: &impl SharedData,
        slot: SlotRef,
        owner: u64,
    ) -> Result<Option<RecordedResponse>, HostError> {
        let key = match slot.generation {
            0 => self.response_key(slot),
            n => match self.predecessors.borrow().get(usize::from(n) - 1) {
                Some(old) => old.response_key(slot),
                None => return Ok(None),
            },
        };
        Ok(shared
            .get(&key)?
            .and_then(|(bytes, _)| RecordedResponse::decode(&bytes))
            .filter(|r| r.owner == owner))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake_shared::FakeShared;
    use std::cell::RefCell;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn digest(n: u8) -> Digest {
        [n; 32]
    }

    fn response(status: u16) -> RecordedResponse {
        RecordedResponse {
            owner: 0,
            status,
            headers: vec![("content-type".into(), b"text/plain".to_vec())],
            body: b"done".to_vec(),
            body_omitted: false,
        }
    }

    fn table(shared: &FakeShared, capacity: u32) -> Table {
        let t = Table::new("test", capacity);
        t.create_buckets(shared).unwrap();
        t
    }

    fn held(c: Claim) -> Held {
        match c {
            Claim::Claimed(h) => h,
            other => panic!("expected a claim, got {other:?}"),
        }
    }

    #[test]
    fn first_claim_executes_then_duplicates_wait_then_replay() {
        let s = FakeShared::default();
        let t = table(&s, 64);
        let (k, fp) = (digest(1), digest(2));
        let h = held(t.claim(&s, &k, &fp, 7, 1_000, 60_000).unwrap());
        assert!(!h.took_over);
        assert_eq!(
            t.claim(&s, &k, &fp, 8, 1_500, 60_000).unwrap(),
            Claim::InFlight {
                retry_after_ms: 59_500
            }
        );
        assert_eq!(
            t.complete(&s, &h, &response(201), 2_000, 10_000).unwrap(),
            Completion::Recorded
        );
        let Claim::Completed {
            slot,
            owner,
            status,
        } = t.claim(&s, &k, &fp, 9, 3_000, 60_000).unwrap()
        else {
            panic!("expected completed");
        };
        assert_eq!((owner, status), (7, 201));
        let replay = t.load_response(&s, slot, owner).unwrap().unwrap();
        assert_eq!(replay.body, b"done");
        assert_eq!(replay.status, 201);
    }

    #[test]
    fn different_payload_is_a_mismatch_and_leaves_the_record_intact() {
        let s = FakeShared::default();
        let t = table(&s, 64);
        let k = digest(1);
        let h = held(t.claim(&s, &k, &digest(2), 7, 0, 1_000).unwrap());
        assert_eq!(
            t.claim(&s, &k, &digest(3), 8, 1, 1_000).unwrap(),
            Claim::Mismatch
        );
        t.complete(&s, &h, &response(200), 2, 10_000).unwrap();
        assert_eq!(
            t.claim(&s, &k, &digest(3), 8, 3, 1_000).unwrap(),
            Claim::Mismatch
        );
        assert!(matches!(
            t.claim(&s, &k, &digest(2), 9, 4, 1_000).unwrap(),
            Claim::Completed { owner: 7, .. }
        ));
    }

    #[test]
    fn expired_records_are_claimed_again() {
        let s = FakeShared::default();
        let t = table(&s, 64);
        let (k, fp) = (digest(1), digest(2));
        let h = held(t.claim(&s, &k, &fp, 7, 0, 1_000).unwrap());
        t.complete(&s, &h, &response(200), 10, 5_000).unwrap();
        assert!(matches!(
            t.claim(&s, &k, &fp, 8, 5_009, 1_000).unwrap(),
            Claim::Completed { .. }
        ));
        let again = held(t.claim(&s, &k, &fp, 8, 5_010, 1_000).unwrap());
        assert!(!again.took_over);
    }

    #[test]
    fn abandoned_in_flight_claim_is_taken_over_and_the_late_owner_cannot_record() {
        let s = FakeShared::default();
        let t = table(&s, 64);
        let (k, fp) = (digest(1), digest(2));
        let first = held(t.claim(&s, &k, &fp, 7, 0, 1_000).unwrap());
        let second = held(t.claim(&s, &k, &fp, 8, 1_000, 1_000).unwrap());
        assert!(second.took_over);
        assert_eq!(
            t.complete(&s, &first, &response(200), 1_100, 5_000)
                .unwrap(),
            Completion::LostOwnership
        );
        assert_eq!(t.release(&s, &first).unwrap(), Completion::LostOwnership);
        assert_eq!(
            t.complete(&s, &second, &response(201), 1_200, 5_000)
                .unwrap(),
            Completion::Recorded
        );
        let Claim::Completed {
            slot,
            owner,
            status,
        } = t.claim(&s, &k, &fp, 9, 1_300, 1_000).unwrap()
        else {
            panic!("expected completed");
        };
        assert_eq!((owner, status), (8, 201));
        assert_eq!(
            t.load_response(&s, slot, owner).unwrap().unwrap().status,
            201
        );
    }

    #[test]
    fn release_lets_a_retry_execute() {
        let s = FakeShared::default();
        let t = table(&s, 64);
        let (k, fp) = (digest(1), digest(2));
        let h = held(t.claim(&s, &k, &fp, 7, 0, 1_000).unwrap());
        assert_eq!(t.release(&s, &h).unwrap(), Completion::Recorded);
        assert!(matches!(
            t.claim(&s, &k, &fp, 8, 1, 1_000).unwrap(),
            Claim::Claimed(_)
        ));
    }

    #[test]
    fn a_full_bucket_reports_full_and_never_evicts_live_records() {
        let s = FakeShared::default();
        let t = table(&s, 1); // one bucket of WAYS slots
        assert_eq!(t.bucket_count(), 1);
        for n in 0..WAYS as u8 {
            held(
                t.claim(&s, &digest(10 + n), &digest(0), u64::from(n), 0, 1_000)
                    .unwrap(),
            );
        }
        assert_eq!(
            t.claim(&s, &digest(99), &digest(0), 50, 10, 1_000).unwrap(),
            Claim::Full
        );
        // Every earlier claim is still in flight.
        for n in 0..WAYS as u8 {
            assert!(matches!(
                t.claim(&s, &digest(10 + n), &digest(0), 60, 20, 1_000)
                    .unwrap(),
                Claim::InFlight { .. }
            ));
        }
        // Once leases pass, slots are reused.
        assert!(matches!(
            t.claim(&s, &digest(99), &digest(0), 50, 1_000, 1_000)
                .unwrap(),
            Claim::Claimed(_)
        ));
    }

    #[test]
    fn creating_buckets_never_clobbers_a_claim() {
        let s = FakeShared::default();
        let t = table(&s, 4);
        let (k, fp) = (digest(1), digest(2));
        held(t.claim(&s, &k, &fp, 7, 0, 1_000).unwrap());
        // Another worker configures later.
        t.create_buckets(&s).unwrap();
        assert!(matches!(
            t.claim(&s, &k, &fp, 8, 1, 1_000).unwrap(),
            Claim::InFlight { .. }
        ));
    }

    #[test]
    fn a_stale_cas_makes_the_claim_retry_instead_of_overwriting() {
        // A shared data whose first write always loses, as if another worker wrote in between.
        struct Racing {
            inner: FakeShared,
            lose_next: RefCell<bool>,
        }
        impl SharedData for Racing {
            fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
                self.inner.get(key)
            }
            fn set(
                &self,
                key: &str,
                value: &[u8],
                cas: Option<u32>,
            ) -> Result<SetOutcome, HostError> {
                if cas.is_some() && self.lose_next.replace(false) {
                    // The rival claims the same key first.
                    let t = Table::new("test", 4);
                    let rival = t
                        .claim(&self.inner, &digest(1), &digest(2), 99, 0, 1_000)
                        .unwrap();
                    assert!(matches!(rival, Claim::Claimed(_)));
                    return Ok(SetOutcome::CasMismatch);
                }
                self.inner.set(key, value, cas)
            }
        }
        let s = Racing {
            inner: FakeShared::default(),
            lose_next: RefCell::new(false),
        };
        let t = table(&s.inner, 4);
        *s.lose_next.borrow_mut() = true;
        assert!(matches!(
            t.claim(&s, &digest(1), &digest(2), 7, 1, 1_000).unwrap(),
            Claim::InFlight { .. }
        ));
    }

    #[test]
    fn a_configure_keeps_a_bucket_whose_cas_equals_the_create_marker() {
        let s = FakeShared::default();
        let t = table(&s, 8);
        let (k, fp) = (digest(1), digest(2));
        // The host's cas counter has wrapped around to the marker's value for this claim.
        *s.next_cas.borrow_mut() = CREATE_IF_ABSENT_CAS - 1;
        held(t.claim(&s, &k, &fp, 7, 0, 60_000).unwrap());
        assert_eq!(
            s.get(&t.bucket_key(0)).unwrap().map(|(_, cas)| cas),
            Some(CREATE_IF_ABSENT_CAS)
        );
        // An Istio push re-runs configure on every worker.
        t.create_buckets(&s).unwrap();
        assert!(matches!(
            t.claim(&s, &k, &fp, 8, 1, 60_000).unwrap(),
            Claim::InFlight { .. }
        ));
    }

    /// What another worker does, given the shared data.
    type Rival<'a> = Box<dyn FnOnce(&FakeShared) + 'a>;

    /// Shared data that lets another worker act right after a chosen read.
    struct Interleaved<'a> {
        inner: &'a FakeShared,
        reads_before_rival: RefCell<usize>,
        rival: RefCell<Option<Rival<'a>>>,
    }

    impl SharedData for Interleaved<'_> {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
            let seen = self.inner.get(key);
            let mut left = self.reads_before_rival.borrow_mut();
            if *left == 1 {
                if let Some(rival) = self.rival.borrow_mut().take() {
                    rival(self.inner);
                }
            }
            *left = left.saturating_sub(1);
            seen
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError> {
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn a_late_finisher_never_overwrites_the_response_of_the_request_that_took_over() {
        let s = FakeShared::default();
        let t = table(&s, 8);
        let (k, fp) = (digest(1), digest(2));
        let late = held(t.claim(&s, &k, &fp, 7, 0, 1_000).unwrap());
        // Its lease has passed. Right after the late finisher reads the bucket and sees its
        // claim, another worker takes the key over, executes and records its own response.
        let rival_table = t.clone();
        let interleaved = Interleaved {
            inner: &s,
            reads_before_rival: RefCell::new(1),
            rival: RefCell::new(Some(Box::new(move |shared: &FakeShared| {
                let taker = held(rival_table.claim(shared, &k, &fp, 8, 2_000, 1_000).unwrap());
                assert!(taker.took_over);
                let mut theirs = response(201);
                theirs.body = b"the new owner's body".to_vec();
                assert_eq!(
                    rival_table
                        .complete(shared, &taker, &theirs, 2_001, 60_000)
                        .unwrap(),
                    Completion::Recorded
                );
            }))),
        };
        let mut mine = response(200);
        mine.body = b"the late finisher's body".to_vec();
        assert_eq!(
            t.complete(&interleaved, &late, &mine, 2_000, 60_000)
                .unwrap(),
            Completion::LostOwnership
        );
        let Claim::Completed { slot, owner, .. } = t.claim(&s, &k, &fp, 9, 3_000, 1_000).unwrap()
        else {
            panic!("expected the new owner's record");
        };
        assert_eq!(owner, 8);
        let replay = t.load_response(&s, slot, owner).unwrap().unwrap();
        assert_eq!(replay.body, b"the new owner's body");
    }

    #[test]
    fn a_claim_with_time_left_completes_with_one_bucket_write() {
        let s = FakeShared::default();
        let t = table(&s, 8);
        let (k, fp) = (digest(1), digest(2));
        let writes = || *s.next_cas.borrow();
        let h = held(t.claim(&s, &k, &fp, 7, 0, 60_000).unwrap());
        let before = writes();
        t.complete(&s, &h, &response(201), 1_000, 60_000).unwrap();
        // The response and the flip to completed; no renewal.
        assert_eq!(writes() - before, 2);
        // Near the end of its lease a claim is renewed first.
        let h = held(t.claim(&s, &digest(3), &fp, 8, 0, 6_000).unwrap());
        let before = writes();
        t.complete(&s, &h, &response(201), 2_000, 60_000).unwrap();
        assert_eq!(writes() - before, 3);
    }

    #[test]
    fn corrupt_buckets_read_as_free() {
        assert_eq!(decode_bucket(b"junk"), [FREE_SLOT; WAYS]);
        let mut slots = [FREE_SLOT; WAYS];
        slots[0].state = SlotState::Completed;
        slots[0].owner = 5;
        assert_eq!(decode_bucket(&encode_bucket(&slots)), slots);
    }
}

//! The local claim table: a fixed set of bucket keys in Envoy's shared data, each holding a
//! few slots, updated only with compare-and-swap; and the recorded responses, each under its
//! slot's key or, when larger, in a page of a size class (see `table_layout`).
//!
//! Why fixed buckets: the host's CAS does not protect the creation of a key (a write to an
//! absent key always succeeds), so every bucket is created before traffic and claims only
//! ever CAS an existing bucket. Memory is bounded by the layout's byte budget. A new key
//! takes a free or expired slot of its bucket, else the slot of the bucket's oldest
//! completed record (a cache under pressure keeps records for less time, it does not refuse
//! writes); an in-flight slot is never evicted. Every claim touches one bucket, so its cost
//! does not grow with the table.

use std::cell::RefCell;

use idempotency_protocol::decision::{self, ClaimDecision, CompleteDecision, ReleaseDecision};

#[cfg(test)]
pub(crate) mod fake_shared;
mod in_store_mark;
pub mod layout;
pub mod lineage;
#[cfg(all(test, not(target_arch = "wasm32")))]
mod properties;

use crate::host::{HostError, SetOutcome, SharedData};
pub use crate::table::in_store_mark::InStoreMark;
use crate::table::layout::{Layout, PAGE_HEADER_BYTES};
pub use crate::table::layout::{SLOT_BYTES, WAYS};
use idempotency_protocol::naming::Digest;
use idempotency_protocol::record::reader::Reader;
use idempotency_protocol::record::RecordedResponse;

/// A slot's response key holding, instead of the response, where in the pages it is.
const PAGE_POINTER_MAGIC: &[u8; 4] = b"IDP1";
/// CAS retries before giving up on one bucket (only other workers' writes cause retries).
const MAX_CAS_ATTEMPTS: usize = 32;
/// How long a completing claim is kept live while its response is written: far longer than
/// the few host calls between its ownership CAS and the write, which run without yielding.
const RECORDING_GRACE_MS: u64 = 5_000;
/// A cas that no real entry carries yet: writing with it creates the key if absent and is
/// refused if another worker created it first.
const CREATE_IF_ABSENT_CAS: u32 = u32::MAX;
/// The status an unknown outcome's slot is written with while its record has not reached the
/// store (an unknown outcome has no status of its own, 0). No HTTP status is 1, and a reader
/// of an earlier release still sees a completed slot and reads its record, as before.
const UNKNOWN_AWAITING_STORE_STATUS: u16 = 1;
/// Set in a response's status bytes while its record has not reached the store (no HTTP
/// status reaches it).
const AWAITING_STORE_BIT: u16 = 0x8000;

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
    /// None: the table holds nothing for this request (cluster mode, every slot of the
    /// key's bucket in flight: the store's claim alone guards the key).
    pub slot: Option<SlotRef>,
    pub key: Digest,
    /// The payload the claim was made for (a late store completion recreates the record
    /// with it if the store's claim has lapsed and gone).
    pub fingerprint: Digest,
    pub owner: u64,
    /// The slot held an abandoned in-flight claim of the same key whose lease had passed.
    pub took_over: bool,
    /// The slot held another key's completed record, evicted before its TTL for this claim.
    pub evicted: Option<Evicted>,
    /// Unheld only: the local table knows the key completed with this status, but no
    /// longer has its body; what to replay if the store cannot be asked.
    pub completed_status: Option<u16>,
    /// Unheld only (cluster mode): an unknown outcome this proxy recorded whose record has
    /// not reached the store, so the store's "free" says nothing about it.
    pub unlanded: Option<Box<Unlanded>>,
}

/// An unknown outcome recorded here whose completion has not reached the store: what the
/// table holds of it, and where, so that a retry can send it on and see it marked landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unlanded {
    pub record: RecordedResponse,
    /// The claim that recorded it (its slot and owner), as `mark_in_store` needs it.
    pub recorded_by: Held,
}

impl Held {
    /// A claim the table does not hold (see `slot`).
    pub fn unheld(key: Digest, fingerprint: Digest, owner: u64) -> Held {
        Held {
            slot: None,
            key,
            fingerprint,
            owner,
            took_over: false,
            evicted: None,
            completed_status: None,
            unlanded: None,
        }
    }
}

impl Unlanded {
    /// `record` of `key`, kept in `slot` by the claim `recorded_by`.
    pub fn new(
        record: RecordedResponse,
        key: Digest,
        fingerprint: Digest,
        slot: SlotRef,
        recorded_by: u64,
    ) -> Box<Unlanded> {
        let recorded_by = Held {
            slot: Some(slot),
            ..Held::unheld(key, fingerprint, recorded_by)
        };
        Box::new(Unlanded {
            record,
            recorded_by,
        })
    }
}

/// A completed record a new claim displaced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evicted {
    /// How long it had been recorded: the retention the table achieved for it.
    pub age_ms: u64,
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
        /// When it was recorded: past the rule's TTL, only its tombstone is answered.
        recorded_at_ms: u64,
        /// An unknown outcome whose record has not reached the store yet (cluster mode).
        awaiting_store: bool,
    },
    /// The key is live with a different payload.
    Mismatch,
    /// Every slot of the key's bucket holds a claim in flight, or a record on its way to the
    /// store (`kept_for_store`: some do), which eviction leaves alone.
    Full { kept_for_store: bool },
}

/// What completing (or releasing) a held claim did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completion {
    Recorded,
    /// Recorded, but the body fit no page of the budget: a retry gets the status and headers
    /// with the body-omitted marker.
    RecordedWithoutBody,
    /// The table keeps no record for this request: it held no claim (`Held::slot` is None),
    /// or the body fit no page and `OversizedBody::LeaveToStore` freed the slot.
    NotHeld,
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
    /// When the response was recorded (completed slots): eviction takes the oldest.
    recorded_at_ms: u64,
    status: u16,
    /// A completed record that has not reached the store yet (cluster mode), which eviction
    /// leaves alone; kept in the status bytes (`UNKNOWN_AWAITING_STORE_STATUS` for an unknown
    /// outcome, `AWAITING_STORE_BIT` for a response).
    awaiting_store: bool,
}

const FREE_SLOT: Slot = Slot {
    state: SlotState::Free,
    key: [0; 32],
    fingerprint: [0; 32],
    owner: 0,
    expires_at_ms: 0,
    recorded_at_ms: 0,
    status: 0,
    awaiting_store: false,
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
    Complete {
        now_ms: u64,
    },
    Release,
    /// Extending the lease of a claim whose request still runs.
    Renew,
    /// Dropping a completed record: the change itself checks that the record is the holder's.
    Forget,
    /// Settling an unknown outcome the holder recorded: the change checks that it still is.
    Settle,
    /// Noting that the holder's record reached the store: the change checks that it is there.
    MarkInStore,
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
            HeldWrite::Renew => matches!(
                current,
                Some(decision::Record::InFlight { owner: holder, .. }) if holder == owner
            ),
            HeldWrite::Forget | HeldWrite::Settle | HeldWrite::MarkInStore => current.is_some(),
        }
    }
}

/// A bucket's slots and the cas they were read under.
type BucketRead = ([Slot; WAYS], u32);

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
    let key = r.array()?;
    let fingerprint = r.array()?;
    let owner = r.u64()?;
    let expires_at_ms = r.u64()?;
    let recorded_at_ms = r.u64()?;
    let status = r.u16()?;
    let completed = state == SlotState::Completed;
    let unknown_awaiting = completed && status == UNKNOWN_AWAITING_STORE_STATUS;
    // The bit beside a status of its own (bytes nobody wrote read back as they are).
    let response_awaiting =
        completed && status & AWAITING_STORE_BIT != 0 && status & !AWAITING_STORE_BIT != 0;
    Some(Slot {
        state,
        key,
        fingerprint,
        owner,
        expires_at_ms,
        recorded_at_ms,
        status: match (unknown_awaiting, response_awaiting) {
            (true, _) => 0,
            (_, true) => status & !AWAITING_STORE_BIT,
            _ => status,
        },
        awaiting_store: unknown_awaiting || response_awaiting,
    })
}

/// A slot's status as its bytes hold it.
fn stored_status(slot: &Slot) -> u16 {
    match (slot.state, slot.awaiting_store, slot.status) {
        (SlotState::Completed, true, 0) => UNKNOWN_AWAITING_STORE_STATUS,
        (SlotState::Completed, true, status) => status | AWAITING_STORE_BIT,
        (_, _, status) => status,
    }
}

fn encode_bucket(slots: &[Slot; WAYS]) -> Vec<u8> {
    let mut out = Vec::with_capacity(SLOT_BYTES * WAYS);
    for s in slots {
        out.push(s.state as u8);
        out.extend_from_slice(&s.key);
        out.extend_from_slice(&s.fingerprint);
        out.extend_from_slice(&s.owner.to_be_bytes());
        out.extend_from_slice(&s.expires_at_ms.to_be_bytes());
        out.extend_from_slice(&s.recorded_at_ms.to_be_bytes());
        out.extend_from_slice(&stored_status(s).to_be_bytes());
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
        // Never decided here: every request claims with an owner of its own (None below),
        // so an owner asking again is a request we have not seen; treat it as busy.
        ClaimDecision::AlreadyClaimed { .. } => Some(Claim::InFlight { retry_after_ms: 1 }),
        ClaimDecision::Replay => Some(Claim::Completed {
            slot: at,
            owner: slot.owner,
            status: slot.status,
            recorded_at_ms: slot.recorded_at_ms,
            awaiting_store: slot.awaiting_store,
        }),
        ClaimDecision::Mismatch => Some(Claim::Mismatch),
    }
}

/// What `Table::find` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    None,
    InFlight {
        retry_after_ms: u64,
    },
    Completed {
        slot: SlotRef,
        owner: u64,
        status: u16,
        expires_at_ms: u64,
        recorded_at_ms: u64,
    },
}

/// How `Table::settle_unknown` settles an unknown outcome.
#[derive(Debug, Clone, Copy)]
pub enum Settlement<'a> {
    /// Recorded in its place, kept `ttl_ms` from now (None: until the unknown outcome
    /// would have expired), then `tombstone_ms` more for its tombstone, as a completed
    /// response is kept (the rule answers only the tombstone past its TTL).
    Record {
        response: &'a RecordedResponse,
        ttl_ms: Option<u64>,
        tombstone_ms: u64,
    },
    /// The key is freed.
    Free,
}

/// What `complete` does with a response whose body fits no page of the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OversizedBody {
    /// Record the status and headers; a retry gets the body-omitted marker.
    RecordWithoutIt,
    /// Free the slot: the store holds the whole response and answers the retries (cluster
    /// mode). A record the store does not hold yet (`StoreCopy::Awaited`) is kept without it.
    LeaveToStore,
}

/// Whether the record `complete` writes has reached the store: until it has, eviction leaves
/// it alone (it alone answers its retries), and a retry of an unknown outcome takes the
/// store's "free" for "not there yet".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreCopy {
    /// The store holds it, or there is no store.
    NotAwaited,
    /// Cluster mode: its completion is on its way, or was never sent. Every worker's retry
    /// then takes the store's "free" for "not there yet" until `mark_in_store`.
    Awaited,
}

/// The table's layout and key names.
#[derive(Debug, Clone)]
pub struct Table {
    prefix: String,
    layout: Layout,
    /// Mixed into the bucket choice, so a client cannot compute which keys share a bucket
    /// and fill one with claims in flight (see `bucket_salt`).
    salt: u64,
    /// Tables an earlier layout replaced whose records may still be live, newest first:
    /// consulted (read only) for a key this table does not hold. Changes while the table is
    /// in use: Envoy may bring an older configuration's root context back without
    /// configuring it again (see `table_lineage::LineageWatch`).
    predecessors: RefCell<Vec<Table>>,
}

/// The process's bucket salt: created once (the first configure's `seed`, any later one
/// finds it), kept across configurations so that every table of the process agrees.
pub fn bucket_salt(shared: &impl SharedData, namespace: &str, seed: u64) -> Result<u64, HostError> {
    let key = format!("{namespace}/idempotency/v2/salt");
    for _ in 0..2 {
        if let Some((bytes, _)) = shared.get(&key)? {
            let mut r = Reader::new(&bytes);
            if let Some(salt) = r.u64() {
                return Ok(salt);
            }
        }
        // Refused when another worker created it first; the next read finds theirs.
        shared.set(&key, &mix(seed).to_be_bytes(), Some(CREATE_IF_ABSENT_CAS))?;
    }
    Err(HostError("bucket salt could not be created".to_string()))
}

/// A bijective 64-bit mixer (SplitMix64's finalizer).
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Where a response too large to keep inline was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PagePointer {
    class: u8,
    seq: u64,
    owner: u64,
}

impl PagePointer {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + 1 + 8 + 8);
        out.extend_from_slice(PAGE_POINTER_MAGIC);
        out.push(self.class);
        out.extend_from_slice(&self.seq.to_be_bytes());
        out.extend_from_slice(&self.owner.to_be_bytes());
        out
    }

    fn decode(bytes: &[u8]) -> Option<PagePointer> {
        let mut r = Reader::new(bytes);
        if r.take(4)? != PAGE_POINTER_MAGIC {
            return None;
        }
        let pointer = PagePointer {
            class: r.u8()?,
            seq: r.u64()?,
            owner: r.u64()?,
        };
        r.is_empty().then_some(pointer)
    }
}

/// The values the table keeps in shared data, as bytes in and bytes out. Public only so that
/// the fuzz targets (`crates/fuzz-checks`) can reach the codecs; nothing else should use it.
#[doc(hidden)]
pub mod codec {
    use super::{decode_bucket, encode_bucket, PagePointer, SLOT_BYTES, WAYS};

    /// Length of every bucket value the table writes.
    pub const BUCKET_BYTES: usize = SLOT_BYTES * WAYS;

    /// A bucket value as the table reads it and writes it back: decoded, then encoded.
    pub fn reencode_bucket(bytes: &[u8]) -> Vec<u8> {
        encode_bucket(&decode_bucket(bytes))
    }

    /// A slot's response key holding a page pointer: `(class, seq, owner)`.
    pub fn encode_page_pointer(class: u8, seq: u64, owner: u64) -> Vec<u8> {
        PagePointer { class, seq, owner }.encode()
    }

    /// None for anything but a whole page pointer.
    pub fn decode_page_pointer(bytes: &[u8]) -> Option<(u8, u64, u64)> {
        PagePointer::decode(bytes).map(|p| (p.class, p.seq, p.owner))
    }
}

impl Table {
    /// `namespace` separates tables of plugins sharing one VM id (Istio sets none).
    pub fn new(namespace: &str, layout: Layout, salt: u64) -> Table {
        let layout = Layout {
            buckets: layout.buckets.max(1),
            ..layout
        };
        Table {
            prefix: format!("{namespace}/idempotency/v2/{}", layout.tag()),
            layout,
            salt,
            predecessors: RefCell::new(Vec::new()),
        }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn salt(&self) -> u64 {
        self.salt
    }

    pub fn set_predecessors(&self, predecessors: Vec<Table>) {
        *self.predecessors.borrow_mut() = predecessors;
    }

    /// Units `empty_buckets` goes through: the buckets, then the pages of every class.
    fn units(&self) -> u64 {
        let pages: u64 = self.layout.classes.iter().map(|c| u64::from(c.pages)).sum();
        u64::from(self.layout.buckets) + pages
    }

    /// Empties up to `count` units, from `first`, of a table no configuration uses any more
    /// (a bucket with its slots' responses, or one page; the host cannot delete keys: each
    /// stays, with an empty value). Returns where to go on, or None when the table is empty.
    /// In steps, so that emptying a large table never holds the process-wide shared-data
    /// lock for long.
    pub fn empty_buckets(
        &self,
        shared: &impl SharedData,
        first: u32,
        count: u32,
    ) -> Result<Option<u32>, HostError> {
        let units = self.units();
        let end = u64::from(first.saturating_add(count)).min(units);
        for unit in u64::from(first)..end {
            match u32::try_from(unit)
                .ok()
                .filter(|&b| b < self.layout.buckets)
            {
                Some(bucket) => {
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
                None => {
                    if let Some(key) = self.nth_page_key(unit - u64::from(self.layout.buckets)) {
                        shared.set(&key, &[], None)?;
                    }
                }
            }
        }
        if end < units {
            return Ok(u32::try_from(end).ok());
        }
        for class in 0..self.layout.classes.len() {
            shared.set(&self.cursor_key(class as u8), &[], None)?;
        }
        Ok(None)
    }

    /// The page key of the `n`-th page counting across classes.
    fn nth_page_key(&self, mut n: u64) -> Option<String> {
        for (class, c) in self.layout.classes.iter().enumerate() {
            if n < u64::from(c.pages) {
                return Some(self.page_key(class as u8, n));
            }
            n -= u64::from(c.pages);
        }
        None
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
            let decided = decision::claim(slot.record_for(key), fingerprint, None, now_ms);
            if let Some(found) = answer(decided, slot, at) {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }

    pub fn bucket_count(&self) -> u32 {
        self.layout.buckets
    }

    /// Upper bound of records the table holds.
    pub fn capacity(&self) -> u64 {
        self.layout.slots()
    }

    // The two keys every request names, built without the formatting machinery.
    fn bucket_key(&self, bucket: u32) -> String {
        let mut key = String::with_capacity(self.prefix.len() + 13);
        key.push_str(&self.prefix);
        key.push_str("/b/");
        key.push_str(itoa::Buffer::new().format(bucket));
        key
    }

    fn response_key(&self, slot: SlotRef) -> String {
        let mut key = String::with_capacity(self.prefix.len() + 17);
        key.push_str(&self.prefix);
        key.push_str("/r/");
        key.push_str(itoa::Buffer::new().format(slot.bucket));
        key.push('/');
        key.push_str(itoa::Buffer::new().format(slot.way));
        key
    }

    fn page_key(&self, class: u8, page: u64) -> String {
        format!("{}/p{class}/{page}", self.prefix)
    }

    /// The sequence number of the next page written in `class`.
    fn cursor_key(&self, class: u8) -> String {
        format!("{}/p{class}/next", self.prefix)
    }

    fn bucket_of(&self, key: &Digest) -> u32 {
        let mut head = [0u8; 8];
        for (dst, src) in head.iter_mut().zip(key.iter()) {
            *dst = *src;
        }
        let mixed = mix(u64::from_be_bytes(head) ^ self.salt);
        (mixed % u64::from(self.layout.buckets)) as u32
    }

    /// Creates every bucket and page cursor that does not exist yet; safe to run from every
    /// worker at once.
    pub fn create_buckets(&self, shared: &impl SharedData) -> Result<(), HostError> {
        for bucket in 0..self.layout.buckets {
            self.create_if_absent(shared, &self.bucket_key(bucket))?;
        }
        for class in 0..self.layout.classes.len() {
            self.create_if_absent(shared, &self.cursor_key(class as u8))?;
        }
        Ok(())
    }

    fn create_if_absent(&self, shared: &impl SharedData, key: &str) -> Result<(), HostError> {
        // Every configure (each Istio push) runs this over live keys: an existing key is
        // never written, since the host's cas is a wrapping counter and a key whose cas
        // happens to equal CREATE_IF_ABSENT_CAS would otherwise be replaced by an empty one.
        if shared.get(key)?.is_some() {
            return Ok(());
        }
        // Refused (CasMismatch) when another worker created it since: that is the point.
        shared.set(key, &[], Some(CREATE_IF_ABSENT_CAS)).map(|_| ())
    }

    /// A key created before traffic: (value, cas), creating it now, race-free, if creation
    /// at configure time failed.
    fn read_created(
        &self,
        shared: &impl SharedData,
        key: &str,
    ) -> Result<(Vec<u8>, u32), HostError> {
        for _ in 0..2 {
            if let Some(found) = shared.get(key)? {
                return Ok(found);
            }
            self.create_if_absent(shared, key)?;
        }
        Err(HostError(format!("{key} could not be created")))
    }

    fn read_bucket(&self, shared: &impl SharedData, bucket: u32) -> Result<BucketRead, HostError> {
        let (bytes, cas) = self.read_created(shared, &self.bucket_key(bucket))?;
        Ok((decode_bucket(&bytes), cas))
    }

    /// Claims `key` for a request with payload `fingerprint`, or reports who holds it.
    ///
    /// `catch_up` runs once, before any other table is consulted, when this table's bucket
    /// lacks `key`: the caller's moment to learn of tables another configuration registered
    /// since. Those only matter to a key this table lacks; a record it holds answers on its
    /// own, so a replay, a 409 or a 422 reads nothing more.
    #[allow(clippy::too_many_arguments)]
    pub fn claim(
        &self,
        shared: &impl SharedData,
        key: &Digest,
        fingerprint: &Digest,
        owner: u64,
        now_ms: u64,
        lease_ms: u64,
        catch_up: impl FnOnce(),
    ) -> Result<Claim, TableError> {
        let bucket = self.bucket_of(key);
        let mut catch_up = Some(catch_up);
        for _ in 0..MAX_CAS_ATTEMPTS {
            let (mut slots, cas) = self.read_bucket(shared, bucket)?;
            let same_key = slots
                .iter()
                .position(|s| s.state != SlotState::Free && s.key == *key);
            let mut took_over = false;
            if let Some((way, slot)) = same_key.and_then(|w| Some((w, slots.get(w)?))) {
                let decided = decision::claim(slot.record_for(key), fingerprint, None, now_ms);
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
            if same_key.is_none() {
                if let Some(catch_up) = catch_up.take() {
                    catch_up();
                }
            }
            if same_key.is_none() && !self.predecessors.borrow().is_empty() {
                if let Some(found) = self.claim_in_predecessors(shared, key, fingerprint, now_ms)? {
                    return Ok(found);
                }
            }
            let mut evicted = None;
            let way = match same_key.or_else(|| slots.iter().position(|s| !s.live(now_ms))) {
                Some(way) => way,
                None => match oldest_completed(&slots) {
                    Some(way) => {
                        evicted = slots.get(way).map(|s| Evicted {
                            age_ms: now_ms.saturating_sub(s.recorded_at_ms),
                        });
                        way
                    }
                    None => {
                        let kept_for_store = slots
                            .iter()
                            .any(|s| s.state == SlotState::Completed && s.awaiting_store);
                        return Ok(Claim::Full { kept_for_store });
                    }
                },
            };
            let Some(slot) = slots.get_mut(way) else {
                return Ok(Claim::Full {
                    kept_for_store: false,
                });
            };
            *slot = Slot {
                state: SlotState::InFlight,
                key: *key,
                fingerprint: *fingerprint,
                owner,
                expires_at_ms: now_ms.saturating_add(lease_ms),
                recorded_at_ms: 0,
                status: 0,
                awaiting_store: false,
            };
            let bucket_key = self.bucket_key(bucket);
            if shared.set(&bucket_key, &encode_bucket(&slots), Some(cas))? == SetOutcome::Stored {
                return Ok(Claim::Claimed(Held {
                    slot: Some(SlotRef {
                        generation: 0,
                        bucket,
                        way: way as u8,
                    }),
                    key: *key,
                    fingerprint: *fingerprint,
                    owner,
                    took_over,
                    evicted,
                    completed_status: None,
                    unlanded: None,
                }));
            }
        }
        Err(TableError::Contended)
    }

    /// What a claim of `key` would find, without claiming: how a held duplicate sees the
    /// first request. None when nothing live holds the key any more (released, its lease
    /// lapsed, or its record expired).
    pub fn peek(
        &self,
        shared: &impl SharedData,
        key: &Digest,
        fingerprint: &Digest,
        now_ms: u64,
    ) -> Result<Option<Claim>, HostError> {
        let bucket = self.bucket_of(key);
        let (slots, _) = self.read_bucket(shared, bucket)?;
        let found = slots
            .iter()
            .enumerate()
            .find(|(_, s)| s.state != SlotState::Free && s.key == *key);
        if let Some((way, slot)) = found {
            let decided = decision::claim(slot.record_for(key), fingerprint, None, now_ms);
            let at = SlotRef {
                generation: 0,
                bucket,
                way: way as u8,
            };
            return Ok(answer(decided, slot, at));
        }
        self.claim_in_predecessors(shared, key, fingerprint, now_ms)
    }

    /// What this table holds for `key`, changing nothing (a caller's lookup route): a live
    /// claim, a live record with where its response is, or nothing.
    pub fn find(
        &self,
        shared: &impl SharedData,
        key: &Digest,
        now_ms: u64,
    ) -> Result<Kept, HostError> {
        let bucket = self.bucket_of(key);
        let (slots, _) = self.read_bucket(shared, bucket)?;
        let found = slots
            .iter()
            .enumerate()
            .find(|(_, s)| s.state != SlotState::Free && s.key == *key && s.live(now_ms));
        Ok(match found {
            None => Kept::None,
            Some((_, slot)) if slot.state == SlotState::InFlight => Kept::InFlight {
                retry_after_ms: slot.expires_at_ms.saturating_sub(now_ms).max(1),
            },
            Some((way, slot)) => Kept::Completed {
                slot: SlotRef {
                    generation: 0,
                    bucket,
                    way: way as u8,
                },
                owner: slot.owner,
                status: slot.status,
                expires_at_ms: slot.expires_at_ms,
                recorded_at_ms: slot.recorded_at_ms,
            },
        })
    }

    /// Records `response` for a held claim and keeps it for `ttl_ms`.
    pub fn complete(
        &self,
        shared: &impl SharedData,
        held: &Held,
        response: &RecordedResponse,
        now_ms: u64,
        ttl_ms: u64,
        oversized: OversizedBody,
    ) -> Result<Completion, TableError> {
        let store_copy = StoreCopy::NotAwaited;
        self.complete_with_store_copy(
            shared, held, response, now_ms, ttl_ms, oversized, store_copy,
        )
    }

    /// `complete`, saying whether the store has the record yet (see `StoreCopy`).
    #[allow(clippy::too_many_arguments)]
    pub fn complete_with_store_copy(
        &self,
        shared: &impl SharedData,
        held: &Held,
        response: &RecordedResponse,
        now_ms: u64,
        ttl_ms: u64,
        oversized: OversizedBody,
        store_copy: StoreCopy,
    ) -> Result<Completion, TableError> {
        let Some(at) = held.slot else {
            return Ok(Completion::NotHeld);
        };
        // The response is written without a cas (a slot's previous response may be large;
        // reading it for its cas would copy it into the VM). So first prove ownership on a
        // claim that stays live for a moment: a late finisher whose lease has passed can
        // then never overwrite the response of a request that took its slot over, because
        // that takeover either happened before the proof or cannot happen until after the
        // write below. A claim with more than the grace left needs only a read (nobody can
        // take it over before it expires); a claim closer to its end is renewed by a CAS.
        let write = HeldWrite::Complete { now_ms };
        let (renewed, proven) = self.update_held(shared, held, at, write, None, |slot| {
            let live_long_enough = now_ms.saturating_add(RECORDING_GRACE_MS);
            if slot.expires_at_ms >= live_long_enough {
                return false;
            }
            slot.expires_at_ms = live_long_enough;
            true
        })?;
        if renewed == Completion::LostOwnership {
            return Ok(Completion::LostOwnership);
        }
        // Written before the slot flips to completed, so a reader that sees "completed" finds
        // the response; the owner inside ties it to this claim.
        let (value, kept_body) = self.store_response(shared, held.owner, response)?;
        // A record the store holds may be left to it; one on its way there is kept here
        // without its body until it lands, or a retry meanwhile would run the write again.
        if !kept_body
            && oversized == OversizedBody::LeaveToStore
            && store_copy == StoreCopy::NotAwaited
        {
            return Ok(match self.release(shared, held)? {
                Completion::LostOwnership => Completion::LostOwnership,
                _ => Completion::NotHeld,
            });
        }
        shared.set(&self.response_key(at), &value, None)?;
        // The bucket as the proof read it: when nobody has written it since, the flip needs
        // no second read (its CAS says so); otherwise it reads again.
        let (flipped, _) = self.update_held(shared, held, at, write, proven, |slot| {
            slot.state = SlotState::Completed;
            slot.expires_at_ms = now_ms.saturating_add(ttl_ms);
            slot.recorded_at_ms = now_ms;
            slot.status = response.status;
            slot.awaiting_store = store_copy == StoreCopy::Awaited;
            true
        })?;
        Ok(match flipped {
            Completion::Recorded if !kept_body => Completion::RecordedWithoutBody,
            other => other,
        })
    }

    /// What the slot's response key holds for `response`: the response itself when it fits
    /// inline, else a pointer to the page it was written to, else the response without its
    /// body. True when the body was kept.
    fn store_response(
        &self,
        shared: &impl SharedData,
        owner: u64,
        response: &RecordedResponse,
    ) -> Result<(Vec<u8>, bool), HostError> {
        let encoded = response.encode_as(owner);
        let inline = self.layout.inline_bytes as usize;
        if encoded.len() <= inline {
            return Ok((encoded, true));
        }
        if let Some(class) = self.layout.class_for(encoded.len()) {
            if let Some(seq) = self.next_page(shared, class)? {
                let mut page = Vec::with_capacity(PAGE_HEADER_BYTES + encoded.len());
                page.extend_from_slice(&seq.to_be_bytes());
                page.extend_from_slice(&encoded);
                shared.set(&self.page_key(class, self.page_of(class, seq)), &page, None)?;
                return Ok((PagePointer { class, seq, owner }.encode(), true));
            }
        }
        let mut without_body = RecordedResponse {
            owner,
            status: response.status,
            headers: response.headers.clone(),
            body: Vec::new(),
            trailers: response.trailers.clone(),
            body_omitted: true,
            unknown: response.unknown.clone(),
        };
        let mut encoded = without_body.encode();
        if encoded.len() > inline {
            // Headers alone too large: the status is all a retry gets back.
            without_body.headers.clear();
            encoded = without_body.encode();
        }
        Ok((encoded, false))
    }

    fn page_of(&self, class: u8, seq: u64) -> u64 {
        let pages = self
            .layout
            .classes
            .get(usize::from(class))
            .map_or(1, |c| u64::from(c.pages).max(1));
        seq % pages
    }

    /// Takes the next sequence number of `class`; its page is the ring's oldest. None when
    /// other workers kept winning the cursor (the body is then not kept).
    fn next_page(&self, shared: &impl SharedData, class: u8) -> Result<Option<u64>, HostError> {
        let key = self.cursor_key(class);
        for _ in 0..MAX_CAS_ATTEMPTS {
            let (bytes, cas) = self.read_created(shared, &key)?;
            let seq = Reader::new(&bytes).u64().unwrap_or(0);
            let next = seq.wrapping_add(1);
            if shared.set(&key, &next.to_be_bytes(), Some(cas))? == SetOutcome::Stored {
                return Ok(Some(seq));
            }
        }
        Ok(None)
    }

    /// Frees a held claim so that a retry executes again.
    pub fn release(&self, shared: &impl SharedData, held: &Held) -> Result<Completion, TableError> {
        let Some(at) = held.slot else {
            return Ok(Completion::NotHeld);
        };
        self.update_held(shared, held, at, HeldWrite::Release, None, |slot| {
            *slot = FREE_SLOT;
            true
        })
        .map(|(completion, _)| completion)
    }

    /// Extends a held claim's lease to `now_ms + lease_ms` (never shortens it) while its
    /// request still runs, so that no other request takes a live write over. The claim's
    /// lease may have passed, as long as nobody took the key over.
    pub fn renew(
        &self,
        shared: &impl SharedData,
        held: &Held,
        now_ms: u64,
        lease_ms: u64,
    ) -> Result<Completion, TableError> {
        let Some(at) = held.slot else {
            return Ok(Completion::NotHeld);
        };
        let until = now_ms.saturating_add(lease_ms);
        self.update_held(shared, held, at, HeldWrite::Renew, None, |slot| {
            if slot.expires_at_ms >= until {
                return false;
            }
            slot.expires_at_ms = until;
            true
        })
        .map(|(completion, _)| completion)
    }

    /// Drops the record `held` completed, if its slot still holds it: the store kept another
    /// request's response for the key, so this copy must not be replayed (a retry asks the
    /// store instead, and caches what it answers).
    pub fn forget_recorded(
        &self,
        shared: &impl SharedData,
        held: &Held,
    ) -> Result<Completion, TableError> {
        self.update_own_record(shared, held, HeldWrite::Forget, |slot| {
            *slot = FREE_SLOT;
            true
        })
    }

    /// Changes the record `held` completed by `change`, if its slot (in this table) still
    /// holds it; a slot replaced since is left alone.
    fn update_own_record(
        &self,
        shared: &impl SharedData,
        held: &Held,
        write: HeldWrite,
        mut change: impl FnMut(&mut Slot) -> bool,
    ) -> Result<Completion, TableError> {
        let Some(at) = held.slot.filter(|s| s.generation == 0) else {
            return Ok(Completion::NotHeld);
        };
        self.update_held(shared, held, at, write, None, |slot| {
            let ours = slot.state == SlotState::Completed && slot.owner == held.owner;
            ours && change(slot)
        })
        .map(|(completion, _)| completion)
    }

    /// Settles the unknown outcome `held` recorded, if its slot still holds it (nobody
    /// evicted it, and no operator or earlier settlement replaced it): `Record` puts a response
    /// in its place (the write took effect, or the same unknown outcome with its next
    /// resolution time), `Free` frees the key so that the next retry executes (it never ran).
    /// `LostOwnership` when the slot holds anything else: nothing is overwritten.
    pub fn settle_unknown(
        &self,
        shared: &impl SharedData,
        held: &Held,
        settlement: Settlement<'_>,
        now_ms: u64,
    ) -> Result<Completion, TableError> {
        let Some(at) = held.slot.filter(|s| s.generation == 0) else {
            return Ok(Completion::NotHeld);
        };
        let still_unknown = |slot: &Slot| {
            slot.state == SlotState::Completed && slot.owner == held.owner && slot.status == 0
        };
        let ours = std::cell::Cell::new(false);
        let kept_until = std::cell::Cell::new(0u64);
        let store_copy = std::cell::Cell::new(StoreCopy::NotAwaited);
        let (flipped, _) = self.update_held(shared, held, at, HeldWrite::Settle, None, |slot| {
            ours.set(still_unknown(slot));
            if !ours.get() {
                return false;
            }
            match settlement {
                Settlement::Free => *slot = FREE_SLOT,
                Settlement::Record { .. } => {
                    // In flight again, under the same owner, until the record would have
                    // expired: a retry meanwhile gets 409, never an execution, and eviction
                    // leaves it alone. `complete` then records the response as for any claim.
                    kept_until.set(slot.expires_at_ms);
                    if slot.awaiting_store {
                        // A new unknown outcome in its place is no more in the store.
                        store_copy.set(StoreCopy::Awaited);
                    }
                    slot.awaiting_store = false;
                    slot.state = SlotState::InFlight;
                    slot.expires_at_ms = slot
                        .expires_at_ms
                        .max(now_ms.saturating_add(RECORDING_GRACE_MS));
                }
            }
            true
        })?;
        if flipped == Completion::LostOwnership || !ours.get() {
            return Ok(Completion::LostOwnership);
        }
        match settlement {
            Settlement::Free => Ok(Completion::Recorded),
            Settlement::Record {
                response,
                ttl_ms,
                tombstone_ms,
            } => {
                let ttl_ms = ttl_ms
                    .unwrap_or_else(|| kept_until.get().saturating_sub(now_ms))
                    .max(1);
                self.complete_with_store_copy(
                    shared,
                    held,
                    response,
                    now_ms,
                    ttl_ms.saturating_add(tombstone_ms),
                    OversizedBody::RecordWithoutIt,
                    store_copy.get(),
                )
            }
        }
    }

    /// Notes that the unknown outcome `held` recorded has reached the store (its completion
    /// landed), if its slot still holds it: from then on the store's word on the key counts.
    pub fn mark_in_store(
        &self,
        shared: &impl SharedData,
        held: &Held,
    ) -> Result<Completion, TableError> {
        self.update_own_record(shared, held, HeldWrite::MarkInStore, |slot| {
            let marked = slot.awaiting_store;
            slot.awaiting_store = false;
            marked
        })
    }

    /// Changes a held claim's slot by CAS on its bucket, starting from `known` (a bucket and
    /// cas read earlier) instead of a read when given. Also returns the bucket as read when
    /// `change` left it as it was, for a later call to start from.
    fn update_held(
        &self,
        shared: &impl SharedData,
        held: &Held,
        at: SlotRef,
        write: HeldWrite,
        mut known: Option<BucketRead>,
        mut change: impl FnMut(&mut Slot) -> bool,
    ) -> Result<(Completion, Option<BucketRead>), TableError> {
        for _ in 0..MAX_CAS_ATTEMPTS {
            let from_known = known.is_some();
            let (mut slots, cas) = match known.take() {
                Some(bucket) => bucket,
                None => self.read_bucket(shared, at.bucket)?,
            };
            let unchanged = slots;
            let Some(slot) = slots.get_mut(usize::from(at.way)) else {
                return Ok((Completion::LostOwnership, None));
            };
            if !write.allowed(slot.record_for(&held.key), &held.owner) {
                if from_known {
                    continue; // judge ownership on a fresh read, never on an old one
                }
                return Ok((Completion::LostOwnership, None));
            }
            if !change(slot) {
                // Nothing to write: ownership was proven by the read.
                return Ok((Completion::Recorded, Some((unchanged, cas))));
            }
            let key = self.bucket_key(at.bucket);
            if shared.set(&key, &encode_bucket(&slots), Some(cas))? == SetOutcome::Stored {
                return Ok((Completion::Recorded, None));
            }
        }
        Err(TableError::Contended)
    }

    /// The response recorded by claim `owner` in `slot`, if it is still there intact (a
    /// page is reused once its ring has come round: its sequence number tells).
    pub fn load_response(
        &self,
        shared: &impl SharedData,
        slot: SlotRef,
        owner: u64,
    ) -> Result<Option<RecordedResponse>, HostError> {
        match slot.generation {
            0 => self.load_own_response(shared, slot, owner),
            n => match self.predecessors.borrow().get(usize::from(n) - 1) {
                Some(old) => old.load_own_response(shared, slot, owner),
                None => Ok(None),
            },
        }
    }

    fn load_own_response(
        &self,
        shared: &impl SharedData,
        slot: SlotRef,
        owner: u64,
    ) -> Result<Option<RecordedResponse>, HostError> {
        let Some((bytes, _)) = shared.get(&self.response_key(slot))? else {
            return Ok(None);
        };
        let encoded = match PagePointer::decode(&bytes) {
            Some(pointer) if pointer.owner == owner => {
                let key = self.page_key(pointer.class, self.page_of(pointer.class, pointer.seq));
                let Some((page, _)) = shared.get(&key)? else {
                    return Ok(None);
                };
                let (seq, encoded) = page.split_at(PAGE_HEADER_BYTES.min(page.len()));
                if Reader::new(seq).u64() != Some(pointer.seq) {
                    return Ok(None);
                }
                encoded.to_vec()
            }
            Some(_) => return Ok(None),
            None => bytes,
        };
        Ok(RecordedResponse::decode(&encoded).filter(|r| r.owner == owner))
    }
}

/// The way of the bucket's oldest completed record, if any slot holds one.
/// The slot eviction takes: the oldest completed record the store holds. One on its way to
/// the store is all that answers its retries until it lands, so it is never evicted.
fn oldest_completed(slots: &[Slot; WAYS]) -> Option<usize> {
    slots
        .iter()
        .enumerate()
        .filter(|(_, s)| s.state == SlotState::Completed && !s.awaiting_store)
        .min_by_key(|(_, s)| s.recorded_at_ms)
        .map(|(way, _)| way)
}

#[cfg(test)]
mod tests;

//! Default backend: a single-node redb file.
//!
//! Writes are group-committed. One writer thread owns every write
//! transaction: it takes the first queued operation plus whatever else is
//! already waiting (up to [`MAX_BATCH`]), applies them in arrival order inside
//! one transaction, commits once (one fsync for the whole batch), and only
//! then answers each of them. Each operation still reads, decides and writes
//! as one atomic step, sees the effects of the operations before it in the
//! batch, and is durable by the time it is answered; if the commit fails,
//! every operation of the batch gets the backend error and none of its writes
//! is visible. Lookups use their own read transactions on tokio's blocking
//! pool; they see committed state only.
//!
//! Records past their TTL that keep a tombstone move to a table of their own (see
//! [`tombstones`]); a key is in one table at most, and every write but the sweeper's goes to
//! the record table.
//!
//! Every record also has an entry in an expiry index, `(expires_at_ms, key)`,
//! written in the same transaction as the record itself. The sweeper walks
//! that index from its oldest end and deletes in small chunks, one write
//! transaction each, so writes queued meanwhile go in between chunks instead
//! of waiting for a whole sweep.
//!
//! The file may be bounded ([`EmbeddedOptions::max_file_bytes`], `--max-db-bytes`): once a
//! commit has grown it to the bound, new claims are taken only into the room that deletions
//! (sweeps, releases, purges) have freed since, and refused with [`StorageError::Full`]
//! otherwise. Completions, releases and renews are never refused: a claim the store took is
//! always recorded, so no key it guards is left unknown. See [`Space`].

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable, Table, TableDefinition, TableHandle};
use tokio::sync::{mpsc, oneshot};
use tombstones::TOMBSTONES;

use super::logic::{self, Decision, StoredBody, StoredRecord};
use super::{
    ClaimOutcome, CompleteOutcome, Digest, KeyPrefix, OwnerToken, PrefixMatches, RecordView,
    ReleaseOutcome, RenewOutcome, Replacement, SettleOutcome, Storage, StorageError,
};
use crate::clock::Clock;
use crate::metrics::BatchMetrics;

/// key (64 lowercase hex) -> encoded `StoredRecord`.
const RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("records_v1");

/// (expires_at_ms, key) -> nothing: one entry per record, so the sweeper
/// finds expired records without reading the live ones.
const EXPIRY: TableDefinition<(u64, &str), ()> = TableDefinition::new("expiry_v1");

pub const DB_FILE_NAME: &str = "idempotency.redb";

/// Most operations one write transaction carries. Bounds how long the first
/// operation of a batch waits behind the others, and the transaction's size.
pub const MAX_BATCH: usize = 256;

/// Operations waiting for the writer; a full queue makes callers wait to
/// enqueue rather than grow memory without bound.
const QUEUE_CAPACITY: usize = 4 * MAX_BATCH;

/// Most records one sweep transaction deletes, and most time it spends
/// deleting. Either bound ends the chunk; the writes queued behind it then
/// wait for this much work plus one commit, not for the whole sweep. Keys are
/// digests, so each deleted record dirties a page of its own and the commit
/// (fsync) cost grows with the chunk: on a 2-core VM disk 1024 records
/// made a claim wait up to 157 ms, 128 up to 74 ms (about 14 ms typically).
pub const SWEEP_CHUNK_RECORDS: usize = 128;
const SWEEP_CHUNK_TIME: Duration = Duration::from_millis(4);

/// Expiry index entries read per step of a sweep chunk (the index cannot be
/// changed while a range over it is open).
const SWEEP_STEP: usize = 32;

/// The tables every write transaction works on, and the room for new records as the
/// batch's writes so far have left it.
struct Tables<'txn> {
    records: Table<'txn, &'static str, &'static [u8]>,
    tombstones: Table<'txn, &'static [u8; 32], &'static [u8]>,
    expiry: Table<'txn, (u64, &'static str), ()>,
    room: Room,
}

/// Which table holds a key's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Records,
    Tombstones,
}

/// What the file holds under a key before a write: its expiry (to move its index entry), the
/// length of its encoded record (to count what the write adds or frees) and its table.
#[derive(Debug, Clone, Copy)]
struct Held {
    expires_at_ms: u64,
    len: usize,
    place: Place,
}

impl Held {
    fn footprint(&self) -> i64 {
        footprint(self.place, self.len)
    }
}

/// The bytes a record of `len` encoded bytes takes in the tables as the room counts them:
/// its key and record, and its expiry index entry (the key as text and the expiry).
fn footprint(place: Place, len: usize) -> i64 {
    let key = match place {
        Place::Records => Digest::HEX_LEN,
        Place::Tombstones => Digest::HEX_LEN / 2,
    };
    let bytes = key
        .saturating_add(Digest::HEX_LEN)
        .saturating_add(len)
        .saturating_add(8);
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// A record as read: None when there is none; its decoding's error when its bytes are corrupt.
type Fetched = Result<Option<(StoredRecord, Held)>, StorageError>;

/// The record under `key`, from whichever table holds it (`Err`: redb failed).
fn fetch(
    records: &impl ReadableTable<&'static str, &'static [u8]>,
    tombstones: &impl ReadableTable<&'static [u8; 32], &'static [u8]>,
    key: &Digest,
) -> Result<Fetched, StorageError> {
    if let Some(guard) = records
        .get(key.as_str())
        .map_err(|e| backend_err("get", e))?
    {
        let bytes = guard.value();
        return Ok(decode(bytes).map(|rec| {
            let held = Held {
                expires_at_ms: rec.expires_at_ms,
                len: bytes.len(),
                place: Place::Records,
            };
            Some((rec, held))
        }));
    }
    let key_bytes = key_bytes(key)?;
    let Some(guard) = tombstones
        .get(&key_bytes)
        .map_err(|e| backend_err("get tombstone", e))?
    else {
        return Ok(Ok(None));
    };
    let bytes = guard.value();
    Ok(tombstones::decode(bytes).map_err(corrupt).map(|rec| {
        let held = Held {
            expires_at_ms: rec.expires_at_ms,
            len: bytes.len(),
            place: Place::Tombstones,
        };
        Some((rec, held))
    }))
}

/// A key as the tombstone table keys it.
fn key_bytes(key: &Digest) -> Result<[u8; 32], StorageError> {
    key.to_bytes()
        .ok_or_else(|| StorageError::Backend(format!("record key {} is not hex", key.as_str())))
}

impl Tables<'_> {
    /// Stores `rec` under `key` and moves its expiry index entry from that of `old` (the
    /// record it replaces, if any).
    #[cfg(test)]
    fn put(
        &mut self,
        key: &Digest,
        old: Option<Held>,
        rec: &StoredRecord,
    ) -> Result<(), BatchFailure> {
        self.put_encoded(key, old, rec.expires_at_ms, &encode(rec))
    }

    /// [`Self::put`] of a record already encoded, into the record table.
    fn put_encoded(
        &mut self,
        key: &Digest,
        old: Option<Held>,
        expires_at_ms: u64,
        bytes: &[u8],
    ) -> Result<(), BatchFailure> {
        self.take_out_of(key, old, Place::Records)?;
        self.records
            .insert(key.as_str(), bytes)
            .map_err(|e| backend_err("insert", e))?;
        self.reindex(key, old, expires_at_ms)?;
        self.room
            .wrote(footprint(Place::Records, bytes.len()) - old.map_or(0, |o| o.footprint()));
        Ok(())
    }

    /// Replaces the whole record under `key` (`old`) with `tombstone`, in the tombstone table;
    /// in the record table if it cannot be kept there (its written time unknown, which only a
    /// format 1 record has, and the sweeper converts only format 3: kept for safety).
    fn put_tombstone(
        &mut self,
        key: &Digest,
        old: Held,
        tombstone: &StoredRecord,
    ) -> Result<(), BatchFailure> {
        let Some(bytes) = tombstones::encode(tombstone) else {
            return self.put_encoded(key, Some(old), tombstone.expires_at_ms, &encode(tombstone));
        };
        self.take_out_of(key, Some(old), Place::Tombstones)?;
        self.tombstones
            .insert(&key_bytes(key)?, bytes.as_slice())
            .map_err(|e| backend_err("insert tombstone", e))?;
        self.reindex(key, Some(old), tombstone.expires_at_ms)?;
        self.room
            .wrote(footprint(Place::Tombstones, bytes.len()) - old.footprint());
        Ok(())
    }

    /// Removes `old` from its table unless it is `staying` there (where the write replaces it).
    fn take_out_of(
        &mut self,
        key: &Digest,
        old: Option<Held>,
        staying: Place,
    ) -> Result<(), BatchFailure> {
        match old {
            Some(old) if old.place != staying => self.remove(key, old.place),
            _ => Ok(()),
        }
    }

    /// Removes the record under `key` from the table `place`, leaving its index entry.
    fn remove(&mut self, key: &Digest, place: Place) -> Result<(), BatchFailure> {
        match place {
            Place::Records => self
                .records
                .remove(key.as_str())
                .map(drop)
                .map_err(|e| backend_err("remove", e)),
            Place::Tombstones => self
                .tombstones
                .remove(&key_bytes(key)?)
                .map(drop)
                .map_err(|e| backend_err("remove tombstone", e)),
        }
    }

    /// Moves the expiry index entry of `key` from `old`'s expiry to `expires_at_ms`.
    fn reindex(
        &mut self,
        key: &Digest,
        old: Option<Held>,
        expires_at_ms: u64,
    ) -> Result<(), BatchFailure> {
        let old_exp = old.map(|o| o.expires_at_ms);
        if old_exp == Some(expires_at_ms) {
            return Ok(());
        }
        if let Some(old) = old_exp {
            self.expiry
                .remove((old, key.as_str()))
                .map_err(|e| backend_err("unindex", e))?;
        }
        self.expiry
            .insert((expires_at_ms, key.as_str()), ())
            .map_err(|e| backend_err("index", e))?;
        Ok(())
    }

    /// The sweeper's work on an expired index entry `(exp, key)`, already removed from the
    /// index: the record it describes is deleted, or turned into its tombstone. Only a record
    /// this entry really describes goes; an undecodable one is kept (and reported by every
    /// access to it) rather than silently destroyed by housekeeping. Answers whether it went.
    fn sweep(&mut self, exp: u64, key: &str, now_ms: u64) -> Result<bool, BatchFailure> {
        let Ok(key) = Digest::parse(key) else {
            return Ok(false);
        };
        let whole = self
            .records
            .get(key.as_str())
            .map_err(|e| backend_err("sweep get", e))?
            .map(|guard| {
                let bytes = guard.value();
                // Only a record with a tombstone to turn into is decoded.
                let tombstone = (bytes.first() == Some(&FORMAT_V3))
                    .then(|| decode(bytes).ok())
                    .flatten()
                    .and_then(|rec| rec.into_tombstone(now_ms));
                (expires_at_ms(bytes), bytes.len(), tombstone)
            });
        let (held, tombstone) = match whole {
            Some((stored_exp, len, tombstone)) => {
                let held = Held {
                    expires_at_ms: exp,
                    len,
                    place: Place::Records,
                };
                (stored_exp.filter(|&e| e == exp).map(|_| held), tombstone)
            }
            None => {
                let held = self
                    .tombstones
                    .get(&key_bytes(&key)?)
                    .map_err(|e| backend_err("sweep get tombstone", e))?
                    .and_then(|guard| {
                        let bytes = guard.value();
                        tombstones::expires_at_ms(bytes)
                            .filter(|&e| e == exp)
                            .map(|_| Held {
                                expires_at_ms: exp,
                                len: bytes.len(),
                                place: Place::Tombstones,
                            })
                    });
                (held, None)
            }
        };
        let Some(held) = held else {
            return Ok(false);
        };
        match tombstone {
            // Its index entry is gone already: removing it again in the move is a no-op.
            Some(rec) => self.put_tombstone(&key, held, &rec)?,
            None => {
                self.remove(&key, held.place)?;
                self.room.wrote(-held.footprint());
            }
        }
        Ok(true)
    }

    /// Deletes the record under `key` (`old`, if there is one) and its expiry index entry.
    fn delete(&mut self, key: &Digest, old: Option<Held>) -> Result<(), BatchFailure> {
        let Some(old) = old else {
            return Ok(());
        };
        self.remove(key, old.place)?;
        self.expiry
            .remove((old.expires_at_ms, key.as_str()))
            .map_err(|e| backend_err("unindex", e))?;
        self.room.wrote(-old.footprint());
        Ok(())
    }
}

/// The room a batch has for new records (see [`Space`]).
#[derive(Debug, Clone, Copy)]
struct Room {
    /// `None`: every write is taken (no bound, the file is below it, or it has not grown
    /// since the store opened). `Some(bytes)`: the file has grown to its bound, and this is
    /// what deletions have freed since, less what writes have added (may be negative).
    bytes: Option<i64>,
    /// For a refusal's message: the file's size after the last commit, and its bound.
    file_bytes: u64,
    max_file_bytes: Option<u64>,
}

impl Room {
    fn unbounded() -> Self {
        Self {
            bytes: None,
            file_bytes: 0,
            max_file_bytes: None,
        }
    }

    /// Whether a new claim that adds `growth` bytes may be written.
    fn admits(&self, growth: i64) -> bool {
        growth <= 0 || self.bytes.is_none_or(|room| room >= growth)
    }

    fn wrote(&mut self, growth: i64) {
        if let Some(room) = &mut self.bytes {
            *room = room.saturating_sub(growth);
        }
    }

    fn refusal(&self) -> StorageError {
        StorageError::Full(format!(
            "the embedded store's file takes {} bytes and has reached its bound \
             (--max-db-bytes {}): new claims are refused until the sweeper has removed \
             expired records; nothing was recorded for this one, and claims already taken \
             are still completed",
            self.file_bytes,
            self.max_file_bytes.unwrap_or(u64::MAX)
        ))
    }
}

/// The file's size and bound, kept by the writer thread across batches.
///
/// Size is what the file takes on disk (allocated blocks, as `du` counts them): redb grows
/// the file's length ahead of use, in steps of up to a 4 GiB region, but blocks are taken
/// only as pages are written. redb reuses the pages that deletions free, so a file that has
/// reached its bound can keep taking records as long as records leave; it never shrinks much
/// (only a free tail is cut). Hence the rule: while the file is below the bound every write is
/// taken; a commit that grows it at or past the bound closes the room (to minus the bytes it
/// grew past); from then on deletions open it and writes close it, and a new claim is taken
/// only while the room holds it. Completions are always taken, the room may go negative.
struct Space {
    path: PathBuf,
    max_file_bytes: Option<u64>,
    file_bytes: u64,
    room: Option<i64>,
    metrics: BatchMetrics,
}

impl Space {
    fn new(path: PathBuf, max_file_bytes: Option<u64>, metrics: BatchMetrics) -> Self {
        let file_bytes = file_bytes_on_disk(&path).unwrap_or(0);
        metrics.set_file_bytes(file_bytes);
        if let Some(max) = max_file_bytes {
            metrics.set_max_file_bytes(max);
            if file_bytes >= max {
                tracing::warn!(
                    file_bytes,
                    max_file_bytes = max,
                    path = %path.display(),
                    "the embedded store's file is already at its bound (--max-db-bytes): \
                     new claims are refused whenever taking them would grow it"
                );
            }
        }
        Self {
            path,
            max_file_bytes,
            file_bytes,
            room: None,
            metrics,
        }
    }

    fn room(&self) -> Room {
        Room {
            bytes: self.room,
            file_bytes: self.file_bytes,
            max_file_bytes: self.max_file_bytes,
        }
    }

    /// After a batch committed, leaving `room`.
    fn committed(&mut self, room: Room) {
        self.room = room.bytes;
        let before = self.file_bytes;
        let Some(now) = file_bytes_on_disk(&self.path) else {
            return;
        };
        self.file_bytes = now;
        self.metrics.set_file_bytes(now);
        let Some(max) = self.max_file_bytes else {
            return;
        };
        if now < max {
            self.room = None;
        } else if now > before {
            let past = i64::try_from(now - before.max(max)).unwrap_or(i64::MAX);
            if self.room.is_none() {
                tracing::warn!(
                    file_bytes = now,
                    max_file_bytes = max,
                    "the embedded store's file has reached its bound (--max-db-bytes): new \
                     claims are taken only as expired records are swept, and refused (503) \
                     otherwise"
                );
            }
            self.room = Some(self.room.unwrap_or(0).min(0).saturating_sub(past));
        }
    }
}

/// What the file at `path` takes on disk; its length where blocks are not reported.
fn file_bytes_on_disk(path: &Path) -> Option<u64> {
    let meta = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt as _;
        Some(meta.blocks().saturating_mul(512))
    }
    #[cfg(not(unix))]
    {
        Some(meta.len())
    }
}

/// Why a batch was abandoned; every operation in it is answered with this.
type BatchFailure = StorageError;

/// One operation for the writer thread.
trait Job: Send {
    /// Applies the operation inside the batch's write transaction and keeps
    /// its answer until the batch's fate is known. An error that concerns
    /// only this operation (a corrupt record it read, before writing
    /// anything) becomes its answer and the batch goes on. `Err` means the
    /// transaction itself failed: the whole batch is abandoned.
    fn apply(&mut self, tables: &mut Tables<'_>, now_ms: u64) -> Result<(), BatchFailure>;

    /// Sends the kept answer once the batch is committed, or the batch's
    /// error if it was not.
    fn finish(self: Box<Self>, batch: Result<(), &BatchFailure>);
}

/// A claim/complete/release/renew: read one record, let the pure decision function
/// choose, write that choice.
struct KeyedJob<T, F> {
    key: Digest,
    /// A new claim: refused when the file has no room for it (see [`Space`]).
    refusable: bool,
    decide: Option<F>,
    answer: Option<Result<T, StorageError>>,
    reply: oneshot::Sender<Result<T, StorageError>>,
}

impl<T, F> Job for KeyedJob<T, F>
where
    T: Send,
    F: FnOnce(Option<&StoredRecord>, u64) -> Decision<T> + Send,
{
    fn apply(&mut self, tables: &mut Tables<'_>, now_ms: u64) -> Result<(), BatchFailure> {
        let Some(decide) = self.decide.take() else {
            return Ok(());
        };
        let key = &self.key;
        let current = match fetch(&tables.records, &tables.tombstones, key)? {
            Ok(current) => current,
            Err(e) => {
                self.answer = Some(Err(e));
                return Ok(());
            }
        };
        let old = current.as_ref().map(|(_, held)| *held);
        let out = match decide(current.as_ref().map(|(rec, _)| rec), now_ms) {
            Decision::Keep(out) => out,
            Decision::Put(rec, out) => {
                let bytes = encode(&rec);
                let growth =
                    footprint(Place::Records, bytes.len()) - old.map_or(0, |o| o.footprint());
                if self.refusable && !tables.room.admits(growth) {
                    self.answer = Some(Err(tables.room.refusal()));
                    return Ok(());
                }
                tables.put_encoded(key, old, rec.expires_at_ms, &bytes)?;
                out
            }
            Decision::Delete(out) => {
                tables.delete(key, old)?;
                out
            }
        };
        self.answer = Some(Ok(out));
        Ok(())
    }

    fn finish(self: Box<Self>, batch: Result<(), &BatchFailure>) {
        let answer = match batch {
            Ok(()) => self.answer.unwrap_or_else(|| {
                Err(StorageError::Backend(
                    "embedded writer skipped an operation".to_owned(),
                ))
            }),
            Err(e) => Err(e.clone()),
        };
        // The caller may have gone away; its operation stands regardless.
        let _ = self.reply.send(answer);
    }
}

/// One chunk of a sweep: deletes expired records, oldest expiry first, until
/// none is left or a chunk bound is reached (in the writer, since redb allows
/// one write transaction at a time).
struct SweepChunkJob {
    /// The sweep's start: records expiring later are left for the next
    /// sweep, so a sweep ends even while new records keep expiring.
    cutoff_ms: u64,
    removed: u64,
    /// Whether expired records may remain (a bound ended the chunk).
    more: bool,
    reply: oneshot::Sender<Result<(u64, bool), StorageError>>,
}

impl Job for SweepChunkJob {
    fn apply(&mut self, tables: &mut Tables<'_>, now_ms: u64) -> Result<(), BatchFailure> {
        let started = Instant::now();
        // Live while now < expires_at_ms, so expired means expires_at_ms <= bound.
        let below = self.cutoff_ms.min(now_ms).saturating_add(1);
        let (mut removed, mut seen) = (0u64, 0usize);
        loop {
            let step: Vec<(u64, String)> = tables
                .expiry
                .range::<(u64, &str)>(..(below, ""))
                .map_err(|e| backend_err("sweep range", e))?
                .take(SWEEP_STEP.min(SWEEP_CHUNK_RECORDS.saturating_sub(seen)))
                .map(|entry| {
                    entry
                        .map(|(k, _)| {
                            let (exp, key) = k.value();
                            (exp, key.to_owned())
                        })
                        .map_err(|e| backend_err("sweep read", e))
                })
                .collect::<Result<_, _>>()?;
            let exhausted = step.len() < SWEEP_STEP;
            for (exp, key) in &step {
                tables
                    .expiry
                    .remove((*exp, key.as_str()))
                    .map_err(|e| backend_err("sweep unindex", e))?;
                if tables.sweep(*exp, key, now_ms)? {
                    removed = removed.saturating_add(1);
                }
            }
            seen = seen.saturating_add(step.len());
            if exhausted {
                self.more = false;
                break;
            }
            if seen >= SWEEP_CHUNK_RECORDS || started.elapsed() >= SWEEP_CHUNK_TIME {
                self.more = true;
                break;
            }
        }
        self.removed = removed;
        Ok(())
    }

    fn finish(self: Box<Self>, batch: Result<(), &BatchFailure>) {
        let _ = self.reply.send(match batch {
            Ok(()) => Ok((self.removed, self.more)),
            Err(e) => Err(e.clone()),
        });
    }
}

/// The writer thread's loop: batch, apply, commit, answer; until every
/// sender is gone and the queue is empty.
fn run_writer(
    db: Arc<Database>,
    clock: Arc<dyn Clock>,
    mut queue: mpsc::Receiver<Box<dyn Job>>,
    stats: BatchMetrics,
    mut space: Space,
    quick_repair: bool,
) {
    let mut batch: Vec<Box<dyn Job>> = Vec::with_capacity(MAX_BATCH);
    while let Some(first) = queue.blocking_recv() {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        // Where panics unwind (the release profile aborts instead), a panic
        // (in redb, say) must not take the writer down and leave every later
        // write unanswerable: it fails this batch only. The transaction was
        // dropped, hence aborted, while unwinding.
        let room = space.room();
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
            commit_batch(&db, clock.as_ref(), &mut batch, room, quick_repair)
        }))
        .unwrap_or_else(|_| {
            Err(StorageError::Backend(
                "embedded write batch panicked".to_owned(),
            ))
        });
        stats.record_batch(batch.len(), outcome.is_ok());
        // A batch that failed wrote nothing: the room stays as it was.
        if let Ok(room) = &outcome {
            space.committed(*room);
        }
        if let Err(e) = &outcome {
            tracing::warn!(error = %e, ops = batch.len(), "embedded write batch failed");
        }
        for job in batch.drain(..) {
            job.finish(outcome.as_ref().map(|_| ()));
        }
    }
}

/// Applies `batch` in order inside one write transaction, starting from `room`, and commits
/// it; answers the room the batch left.
fn commit_batch(
    db: &Database,
    clock: &dyn Clock,
    batch: &mut [Box<dyn Job>],
    room: Room,
    quick_repair: bool,
) -> Result<Room, BatchFailure> {
    let mut txn = db.begin_write().map_err(|e| backend_err("begin", e))?;
    txn.set_quick_repair(quick_repair);
    let applied = open_tables(&txn, room).and_then(|mut tables| {
        batch.iter_mut().try_for_each(|job| {
            // Read the clock inside the transaction, per operation, so
            // each decision and the time it is based on are serialised
            // together.
            job.apply(&mut tables, clock.now_ms())
        })?;
        Ok(tables.room)
    });
    match applied {
        Ok(room) => txn
            .commit()
            .map(|()| room)
            .map_err(|e| backend_err("commit", e)),
        Err(e) => {
            if let Err(abort) = txn.abort() {
                tracing::warn!(error = %abort, "aborting a failed embedded write batch failed");
            }
            Err(e)
        }
    }
}

fn open_tables(txn: &redb::WriteTransaction, room: Room) -> Result<Tables<'_>, BatchFailure> {
    Ok(Tables {
        room,
        records: txn
            .open_table(RECORDS)
            .map_err(|e| backend_err("open table", e))?,
        tombstones: txn
            .open_table(TOMBSTONES)
            .map_err(|e| backend_err("open tombstones", e))?,
        expiry: txn
            .open_table(EXPIRY)
            .map_err(|e| backend_err("open index", e))?,
    })
}

/// Creates every table, so read transactions never meet a missing one, and
/// indexes the records of a file written before the expiry index existed
/// (once: afterwards the index is kept with every write).
fn prepare(db: &Database) -> Result<(), StorageError> {
    let txn = db.begin_write().map_err(|e| backend_err("begin", e))?;
    let indexed = txn
        .list_tables()
        .map_err(|e| backend_err("list tables", e))?
        .any(|t| t.name() == EXPIRY.name());
    {
        let mut tables = open_tables(&txn, Room::unbounded())?;
        if !indexed {
            let mut added = 0u64;
            for entry in tables
                .records
                .iter()
                .map_err(|e| backend_err("index rebuild", e))?
            {
                let (key, value) = entry.map_err(|e| backend_err("index rebuild", e))?;
                if let Some(exp) = expires_at_ms(value.value()) {
                    tables
                        .expiry
                        .insert((exp, key.value()), ())
                        .map_err(|e| backend_err("index rebuild", e))?;
                    added = added.saturating_add(1);
                }
            }
            if added > 0 {
                tracing::info!(
                    records = added,
                    "built the expiry index of an older store file"
                );
            }
        }
    }
    txn.commit().map_err(|e| backend_err("commit", e))
}

pub struct EmbeddedStorage {
    db: Arc<Database>,
    clock: Arc<dyn Clock>,
    path: PathBuf,
    /// `None` only while dropping (closing the queue stops the writer).
    queue: Option<mpsc::Sender<Box<dyn Job>>>,
    writer: Option<JoinHandle<()>>,
    batches: BatchMetrics,
}

fn backend_err(context: &str, e: impl Into<redb::Error>) -> StorageError {
    StorageError::Backend(format!("redb {context}: {}", e.into()))
}

fn writer_gone() -> StorageError {
    StorageError::Backend("embedded writer has stopped".to_owned())
}

/// How the embedded store is run.
#[derive(Debug, Clone, Copy, Default)]
pub struct EmbeddedOptions {
    /// The file's bound, in bytes it takes on disk (`--max-db-bytes`); `None`: no bound. See
    /// [`Space`] for what it refuses and when.
    pub max_file_bytes: Option<u64>,
    /// redb's quick repair (`--quick-repair`): every commit also saves the allocator state
    /// (a two-phase commit), so that opening the file after a crash need not rebuild it from
    /// every page. Measured: commits cost about a third of the claims per second, a restart
    /// after a crash about 0.6 instead of 0.8 s per million records (docs/operations.md).
    pub quick_repair: bool,
}

impl EmbeddedStorage {
    /// Opens (or creates) `dir/idempotency.redb`, creating `dir` if needed,
    /// and starts its writer thread. The file is not bounded.
    pub fn open(dir: &Path, clock: Arc<dyn Clock>) -> Result<Self, StorageError> {
        Self::open_with(dir, clock, EmbeddedOptions::default())
    }

    /// [`Self::open`] with `options`.
    pub fn open_with(
        dir: &Path,
        clock: Arc<dyn Clock>,
        options: EmbeddedOptions,
    ) -> Result<Self, StorageError> {
        std::fs::create_dir_all(dir).map_err(|e| {
            StorageError::Backend(format!("cannot create data dir {}: {e}", dir.display()))
        })?;
        let path = dir.join(DB_FILE_NAME);
        let db = Database::create(&path).map_err(|e| backend_err("open", e))?;
        prepare(&db)?;
        let db = Arc::new(db);
        let batches = BatchMetrics::default();
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let space = Space::new(path.clone(), options.max_file_bytes, batches.clone());
        let quick_repair = options.quick_repair;
        let writer = {
            let (db, clock, batches) = (Arc::clone(&db), Arc::clone(&clock), batches.clone());
            std::thread::Builder::new()
                .name("redb-writer".to_owned())
                .spawn(move || run_writer(db, clock, rx, batches, space, quick_repair))
                .map_err(|e| {
                    StorageError::Backend(format!("cannot start the embedded writer thread: {e}"))
                })?
        };
        Ok(Self {
            db,
            clock,
            path,
            queue: Some(tx),
            writer: Some(writer),
            batches,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Group-commit statistics, for `/metrics` and tests.
    pub fn batch_metrics(&self) -> &BatchMetrics {
        &self.batches
    }

    /// Queues `job` for the writer and waits for the answer it sends once
    /// its batch is committed (or has failed).
    async fn submit<T>(
        &self,
        job: Box<dyn Job>,
        answer: oneshot::Receiver<Result<T, StorageError>>,
    ) -> Result<T, StorageError> {
        let queue = self.queue.as_ref().ok_or_else(writer_gone)?;
        queue.send(job).await.map_err(|_| writer_gone())?;
        answer.await.map_err(|_| writer_gone())?
    }

    /// One atomic step in the writer: read the current record, let `decide`
    /// choose, write the choice; answered after the batch commits.
    async fn apply<T: Send + 'static>(
        &self,
        key: &Digest,
        decide: impl FnOnce(Option<&StoredRecord>, u64) -> Decision<T> + Send + 'static,
    ) -> Result<T, StorageError> {
        self.apply_job(key, false, decide).await
    }

    /// [`Self::apply`]; `refusable` for a new claim, which the file's bound may refuse.
    async fn apply_job<T: Send + 'static>(
        &self,
        key: &Digest,
        refusable: bool,
        decide: impl FnOnce(Option<&StoredRecord>, u64) -> Decision<T> + Send + 'static,
    ) -> Result<T, StorageError> {
        let (reply, answer) = oneshot::channel();
        let job = KeyedJob {
            key: key.clone(),
            refusable,
            decide: Some(decide),
            answer: None,
            reply,
        };
        self.submit(Box::new(job), answer).await
    }

    /// Operations waiting for the writer (not yet taken into a batch).
    #[cfg(test)]
    fn queued(&self) -> usize {
        self.queue
            .as_ref()
            .map_or(0, |q| q.max_capacity().saturating_sub(q.capacity()))
    }
}

impl Drop for EmbeddedStorage {
    /// Closes the queue and waits for the writer to finish what is queued,
    /// so the database file is closed (and can be reopened) once this returns.
    fn drop(&mut self) {
        drop(self.queue.take());
        if let Some(writer) = self.writer.take() {
            if writer.join().is_err() {
                tracing::error!("the embedded writer thread panicked");
            }
        }
    }
}

/// The live records with `prefix` among `rows` (a table's keys, in order, from the lowest
/// with the prefix), each a key (None if it is not one) and whether it is live: up to one more
/// than `limit`, so a merge can tell whether it was truncated.
fn live_matches(
    rows: impl Iterator<Item = Result<(Option<Digest>, bool), StorageError>>,
    prefix: &KeyPrefix,
    limit: usize,
) -> Result<PrefixMatches, StorageError> {
    let candidates = rows
        .filter_map(|row| match row {
            Ok((key, live)) => key.map(|key| Ok((key, live))),
            Err(e) => Some(Err(e)),
        })
        .take_while(|row| row.as_ref().map_or(true, |(key, _)| prefix.matches(key)));
    PrefixMatches::of_candidates(candidates, limit.saturating_add(1))
}

async fn run_blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StorageError> + Send + 'static,
) -> Result<T, StorageError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StorageError::Backend(format!("blocking task failed: {e}")))?
}

#[async_trait]
impl Storage for EmbeddedStorage {
    fn backend_name(&self) -> &'static str {
        "embedded"
    }

    async fn claim(
        &self,
        key: &Digest,
        fingerprint: &Digest,
        lease_ms: u64,
        owner: &OwnerToken,
    ) -> Result<ClaimOutcome, StorageError> {
        let fingerprint = fingerprint.clone();
        let owner = owner.clone();
        let claimed = self
            .apply_job(key, true, move |cur, now| {
                logic::claim(cur, &fingerprint, lease_ms, now, &owner)
            })
            .await;
        if matches!(claimed, Err(StorageError::Full(_))) {
            self.batches.claim_refused();
        }
        claimed
    }

    async fn complete_or_create(
        &self,
        key: &Digest,
        owner: &OwnerToken,
        ttl_ms: u64,
        tombstone_ms: u64,
        record: Vec<u8>,
        fingerprint: Option<&Digest>,
    ) -> Result<CompleteOutcome, StorageError> {
        let owner = owner.clone();
        let fingerprint = fingerprint.cloned();
        self.apply(key, move |cur, now| {
            logic::complete(
                cur,
                &owner,
                ttl_ms,
                tombstone_ms,
                record,
                now,
                fingerprint.as_ref(),
            )
        })
        .await
    }

    async fn release(
        &self,
        key: &Digest,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, StorageError> {
        let owner = owner.clone();
        self.apply(key, move |cur, _| logic::release(cur, &owner))
            .await
    }

    async fn settle_exactly(
        &self,
        key: &Digest,
        current: &[u8],
        replacement: Option<Replacement>,
    ) -> Result<SettleOutcome, StorageError> {
        let current = current.to_vec();
        self.apply(key, move |cur, now| {
            logic::settle(cur, &current, replacement, now)
        })
        .await
    }

    async fn renew(
        &self,
        key: &Digest,
        owner: &OwnerToken,
        lease_ms: u64,
    ) -> Result<RenewOutcome, StorageError> {
        let owner = owner.clone();
        self.apply(key, move |cur, now| {
            logic::renew(cur, &owner, lease_ms, now)
        })
        .await
    }

    async fn lookup(&self, key: &Digest) -> Result<Option<RecordView>, StorageError> {
        let db = Arc::clone(&self.db);
        let clock = Arc::clone(&self.clock);
        let key = key.clone();
        run_blocking(move || {
            let txn = db.begin_read().map_err(|e| backend_err("begin read", e))?;
            let records = txn
                .open_table(RECORDS)
                .map_err(|e| backend_err("open table", e))?;
            let tombstones = txn
                .open_table(TOMBSTONES)
                .map_err(|e| backend_err("open tombstones", e))?;
            let current = fetch(&records, &tombstones, &key)??;
            Ok(logic::view(
                current.as_ref().map(|(rec, _)| rec),
                clock.now_ms(),
            ))
        })
        .await
    }

    async fn purge(&self, key: &Digest) -> Result<Option<RecordView>, StorageError> {
        self.apply(key, logic::purge).await
    }

    async fn find_by_prefix(
        &self,
        prefix: &KeyPrefix,
        limit: usize,
    ) -> Result<PrefixMatches, StorageError> {
        let db = Arc::clone(&self.db);
        let clock = Arc::clone(&self.clock);
        let prefix = prefix.clone();
        run_blocking(move || {
            let mut found = PrefixMatches {
                exhaustive: true,
                ..PrefixMatches::default()
            };
            let Some(lowest) = prefix.lowest_key() else {
                return Ok(found);
            };
            let txn = db.begin_read().map_err(|e| backend_err("begin read", e))?;
            let records = txn
                .open_table(RECORDS)
                .map_err(|e| backend_err("open table", e))?;
            let tombstones = txn
                .open_table(TOMBSTONES)
                .map_err(|e| backend_err("open tombstones", e))?;
            let now = clock.now_ms();
            // Both tables order keys as their bytes (the hex text orders alike): the matches
            // are one run from the lowest of them in each. An undecodable row is left to
            // lookups, which report it.
            let whole = records
                .range::<&str>(lowest.as_str()..)
                .map_err(|e| backend_err("prefix range", e))?
                .map(|entry| {
                    let (key, value) = entry.map_err(|e| backend_err("prefix read", e))?;
                    let live = decode(value.value()).is_ok_and(|rec| rec.is_live(now));
                    Ok((Digest::parse(key.value()).ok(), live))
                });
            let whole = live_matches(whole, &prefix, limit)?;
            let kept = tombstones
                .range::<&[u8; 32]>(&key_bytes(&lowest)?..)
                .map_err(|e| backend_err("prefix range", e))?
                .map(|entry| {
                    let (key, value) = entry.map_err(|e| backend_err("prefix read", e))?;
                    let live = tombstones::decode(value.value()).is_ok_and(|r| r.is_live(now));
                    Ok((Some(Digest::from(key.value())), live))
                });
            let kept = live_matches(kept, &prefix, limit)?;
            found.exhaustive = whole.exhaustive && kept.exhaustive;
            let mut keys = whole.keys;
            keys.extend(kept.keys);
            keys.sort_unstable();
            for key in keys {
                if !found.offer(key, limit) {
                    break;
                }
            }
            Ok(found)
        })
        .await
    }

    async fn sweep_expired(&self) -> Result<u64, StorageError> {
        let cutoff_ms = self.clock.now_ms();
        let mut removed = 0u64;
        loop {
            let (reply, answer) = oneshot::channel();
            let chunk = SweepChunkJob {
                cutoff_ms,
                removed: 0,
                more: false,
                reply,
            };
            let (n, more) = self.submit(Box::new(chunk), answer).await?;
            removed = removed.saturating_add(n);
            if !more {
                return Ok(removed);
            }
            // The next chunk queues behind the writes that arrived meanwhile.
            tokio::task::yield_now().await;
        }
    }
}

// On-disk layout of one record, version 2 (what this release writes):
//   [0]      format version (2)
//   [1]      state: 0 = in flight, 1 = completed
//   [2..10]  expires_at_ms, big endian
//   [10..18] written_at_ms (claimed or completed), big endian
//   [18..82] fingerprint, 64 lowercase hex ASCII
//   [82..]   in flight: owner token ASCII; completed: the recorded bytes
// Version 1, written by releases that did not keep the time, is the same without
// written_at_ms. It is still read (the time is then unknown) and becomes version 2 at the
// key's next write. An older release cannot read version 2: no downgrade past this one.
// Version 3 is version 2 with, after written_at_ms, the end of the record's tombstone
// (8 bytes, big endian): written only for a completed record that has one, until the
// sweeper turns it into its tombstone, which moves to the tombstone table (see
// [`tombstones`]). A release before tombstones cannot read either.
const FORMAT_V1: u8 = 1;
const FORMAT_V2: u8 = 2;
const FORMAT_V3: u8 = 3;
const STATE_IN_FLIGHT: u8 = 0;
const STATE_COMPLETED: u8 = 1;

fn encode(rec: &StoredRecord) -> Vec<u8> {
    let (state, tail): (u8, &[u8]) = match &rec.body {
        StoredBody::InFlight { owner } => (STATE_IN_FLIGHT, owner.as_str().as_bytes()),
        StoredBody::Completed { record } => (STATE_COMPLETED, record.as_slice()),
    };
    let mut out = Vec::with_capacity(2 + 8 + 8 + 8 + Digest::HEX_LEN + tail.len());
    // A record whose time is unknown (read from version 1) keeps the format that says so.
    let written = rec.written_at_ms.map(|at| (at, rec.tombstone_until_ms));
    out.push(match written {
        None => FORMAT_V1,
        Some((_, None)) => FORMAT_V2,
        Some((_, Some(_))) => FORMAT_V3,
    });
    out.push(state);
    out.extend_from_slice(&rec.expires_at_ms.to_be_bytes());
    if let Some((at, tombstone_until)) = written {
        out.extend_from_slice(&at.to_be_bytes());
        if let Some(until) = tombstone_until {
            out.extend_from_slice(&until.to_be_bytes());
        }
    }
    out.extend_from_slice(rec.fingerprint.as_str().as_bytes());
    out.extend_from_slice(tail);
    out
}

fn corrupt(why: &str) -> StorageError {
    StorageError::Backend(format!("corrupt record in redb: {why}"))
}

fn split_header(bytes: &[u8]) -> Option<(u8, u8, u64, &[u8])> {
    let (&version, rest) = bytes.split_first()?;
    let (&state, rest) = rest.split_first()?;
    let (exp, rest) = rest.split_first_chunk::<8>()?;
    Some((version, state, u64::from_be_bytes(*exp), rest))
}

/// Both versions keep the expiry in the same place, so the sweeper and the index rebuild
/// read it alike.
fn expires_at_ms(bytes: &[u8]) -> Option<u64> {
    split_header(bytes)
        .filter(|(version, ..)| matches!(*version, FORMAT_V1 | FORMAT_V2 | FORMAT_V3))
        .map(|(_, _, exp, _)| exp)
}

fn decode(bytes: &[u8]) -> Result<StoredRecord, StorageError> {
    let (version, state, expires_at_ms, rest) =
        split_header(bytes).ok_or_else(|| corrupt("truncated header"))?;
    let (written_at_ms, tombstone_until_ms, rest) = match version {
        FORMAT_V1 => (None, None, rest),
        FORMAT_V2 | FORMAT_V3 => {
            let (written, rest) = rest
                .split_first_chunk::<8>()
                .ok_or_else(|| corrupt("truncated header"))?;
            let (until, rest) = if version == FORMAT_V3 {
                let (until, rest) = rest
                    .split_first_chunk::<8>()
                    .ok_or_else(|| corrupt("truncated header"))?;
                (Some(u64::from_be_bytes(*until)), rest)
            } else {
                (None, rest)
            };
            (Some(u64::from_be_bytes(*written)), until, rest)
        }
        _ => return Err(corrupt("unknown format version")),
    };
    let (fp, tail) = rest
        .split_at_checked(Digest::HEX_LEN)
        .ok_or_else(|| corrupt("truncated fingerprint"))?;
    let fingerprint = std::str::from_utf8(fp)
        .ok()
        .and_then(|s| Digest::parse(s).ok())
        .ok_or_else(|| corrupt("bad fingerprint"))?;
    let body = match state {
        STATE_IN_FLIGHT => {
            let owner = std::str::from_utf8(tail)
                .ok()
                .and_then(|s| OwnerToken::parse(s).ok())
                .ok_or_else(|| corrupt("bad owner"))?;
            StoredBody::InFlight { owner }
        }
        STATE_COMPLETED => StoredBody::Completed {
            record: tail.to_vec(),
        },
        _ => return Err(corrupt("unknown state")),
    };
    Ok(StoredRecord {
        fingerprint,
        expires_at_ms,
        written_at_ms,
        tombstone_until_ms,
        body,
    })
}

mod tombstones;

#[cfg(test)]
mod tests;

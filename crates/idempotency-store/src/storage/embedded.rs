//! Default backend: a single-node redb file. Every operation is one write
//! transaction, so read-decide-write is atomic and a committed completion
//! survives a restart. redb is blocking, so work runs on tokio's blocking pool.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use super::logic::{self, Decision, StoredBody, StoredRecord};
use super::{
    ClaimOutcome, CompleteOutcome, Digest, OwnerToken, RecordView, ReleaseOutcome, Storage,
    StorageError,
};
use crate::clock::Clock;

/// key (64 lowercase hex) -> encoded `StoredRecord`.
const RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("records_v1");

pub const DB_FILE_NAME: &str = "idempotency.redb";

pub struct EmbeddedStorage {
    db: Arc<Database>,
    clock: Arc<dyn Clock>,
    path: PathBuf,
}

fn backend_err(context: &str, e: impl Into<redb::Error>) -> StorageError {
    StorageError::Backend(format!("redb {context}: {}", e.into()))
}

impl EmbeddedStorage {
    /// Opens (or creates) `dir/idempotency.redb`, creating `dir` if needed.
    pub fn open(dir: &Path, clock: Arc<dyn Clock>) -> Result<Self, StorageError> {
        std::fs::create_dir_all(dir).map_err(|e| {
            StorageError::Backend(format!("cannot create data dir {}: {e}", dir.display()))
        })?;
        let path = dir.join(DB_FILE_NAME);
        let db = Database::create(&path).map_err(|e| backend_err("open", e))?;
        // Create the table up front so read transactions never meet a missing table.
        let txn = db.begin_write().map_err(|e| backend_err("begin", e))?;
        txn.open_table(RECORDS)
            .map_err(|e| backend_err("open table", e))?;
        txn.commit().map_err(|e| backend_err("commit", e))?;
        Ok(Self {
            db: Arc::new(db),
            clock,
            path,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One write transaction: read the current record, let `decide` choose,
    /// write the choice, commit.
    async fn apply<T: Send + 'static>(
        &self,
        key: &Digest,
        decide: impl FnOnce(Option<&StoredRecord>, u64) -> Decision<T> + Send + 'static,
    ) -> Result<T, StorageError> {
        let db = Arc::clone(&self.db);
        let clock = Arc::clone(&self.clock);
        let key = key.as_str().to_owned();
        run_blocking(move || {
            let txn = db.begin_write().map_err(|e| backend_err("begin", e))?;
            let out = {
                let mut table = txn
                    .open_table(RECORDS)
                    .map_err(|e| backend_err("open table", e))?;
                let current = match table.get(key.as_str()).map_err(|e| backend_err("get", e))? {
                    Some(guard) => Some(decode(guard.value())?),
                    None => None,
                };
                // Read the clock inside the transaction so the decision and
                // the time it is based on are serialised together.
                match decide(current.as_ref(), clock.now_ms()) {
                    Decision::Keep(out) => out,
                    Decision::Put(rec, out) => {
                        table
                            .insert(key.as_str(), encode(&rec).as_slice())
                            .map_err(|e| backend_err("insert", e))?;
                        out
                    }
                    Decision::Delete(out) => {
                        table
                            .remove(key.as_str())
                            .map_err(|e| backend_err("remove", e))?;
                        out
                    }
                }
            };
            txn.commit().map_err(|e| backend_err("commit", e))?;
            Ok(out)
        })
        .await
    }
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
        self.apply(key, move |cur, now| {
            logic::claim(cur, &fingerprint, lease_ms, now, &owner)
        })
        .await
    }

    async fn complete(
        &self,
        key: &Digest,
        owner: &OwnerToken,
        ttl_ms: u64,
        record: Vec<u8>,
    ) -> Result<CompleteOutcome, StorageError> {
        let owner = owner.clone();
        self.apply(key, move |cur, now| {
            logic::complete(cur, &owner, ttl_ms, record, now)
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

    async fn lookup(&self, key: &Digest) -> Result<Option<RecordView>, StorageError> {
        let db = Arc::clone(&self.db);
        let clock = Arc::clone(&self.clock);
        let key = key.as_str().to_owned();
        run_blocking(move || {
            let txn = db.begin_read().map_err(|e| backend_err("begin read", e))?;
            let table = txn
                .open_table(RECORDS)
                .map_err(|e| backend_err("open table", e))?;
            let current = match table.get(key.as_str()).map_err(|e| backend_err("get", e))? {
                Some(guard) => Some(decode(guard.value())?),
                None => None,
            };
            Ok(logic::view(current.as_ref(), clock.now_ms()))
        })
        .await
    }

    async fn sweep_expired(&self) -> Result<u64, StorageError> {
        let db = Arc::clone(&self.db);
        let clock = Arc::clone(&self.clock);
        run_blocking(move || {
            let now = clock.now_ms();
            let txn = db.begin_write().map_err(|e| backend_err("begin", e))?;
            let mut removed = 0u64;
            {
                let mut table = txn
                    .open_table(RECORDS)
                    .map_err(|e| backend_err("open table", e))?;
                // Undecodable rows are kept (and reported by every access to
                // them) rather than silently destroyed by housekeeping.
                table
                    .retain(|_, value| {
                        let keep = expires_at_ms(value).is_none_or(|exp| now < exp);
                        if !keep {
                            removed = removed.saturating_add(1);
                        }
                        keep
                    })
                    .map_err(|e| backend_err("sweep", e))?;
            }
            txn.commit().map_err(|e| backend_err("commit", e))?;
            Ok(removed)
        })
        .await
    }
}

// On-disk layout of one record (version 1):
//   [0]      format version (1)
//   [1]      state: 0 = in flight, 1 = completed
//   [2..10]  expires_at_ms, big endian
//   [10..74] fingerprint, 64 lowercase hex ASCII
//   [74..]   in flight: owner token ASCII; completed: the recorded bytes
const FORMAT_V1: u8 = 1;
const STATE_IN_FLIGHT: u8 = 0;
const STATE_COMPLETED: u8 = 1;

fn encode(rec: &StoredRecord) -> Vec<u8> {
    let (state, tail): (u8, &[u8]) = match &rec.body {
        StoredBody::InFlight { owner } => (STATE_IN_FLIGHT, owner.as_str().as_bytes()),
        StoredBody::Completed { record } => (STATE_COMPLETED, record.as_slice()),
    };
    let mut out = Vec::with_capacity(2 + 8 + Digest::HEX_LEN + tail.len());
    out.push(FORMAT_V1);
    out.push(state);
    out.extend_from_slice(&rec.expires_at_ms.to_be_bytes());
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

fn expires_at_ms(bytes: &[u8]) -> Option<u64> {
    split_header(bytes)
        .filter(|(version, ..)| *version == FORMAT_V1)
        .map(|(_, _, exp, _)| exp)
}

fn decode(bytes: &[u8]) -> Result<StoredRecord, StorageError> {
    let (version, state, expires_at_ms, rest) =
        split_header(bytes).ok_or_else(|| corrupt("truncated header"))?;
    if version != FORMAT_V1 {
        return Err(corrupt("unknown format version"));
    }
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
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_round_trips() {
        let fp = Digest::parse(&"ab".repeat(32)).unwrap();
        for body in [
            StoredBody::InFlight {
                owner: OwnerToken::parse("00ff").unwrap(),
            },
            StoredBody::Completed {
                record: vec![0, 1, 2, 255],
            },
            StoredBody::Completed { record: vec![] },
        ] {
            let rec = StoredRecord {
                fingerprint: fp.clone(),
                expires_at_ms: 1_700_000_000_123,
                body,
            };
            assert_eq!(decode(&encode(&rec)).unwrap(), rec);
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in [
            &[][..],
            &[1],
            &[1, 0, 0],
            &[2; 80],
            &[1, 9, 0, 0, 0, 0, 0, 0, 0, 0],
        ] {
            assert!(decode(bad).is_err());
        }
    }
}

//! In-process backend for tests and throwaway demos: nothing survives a
//! restart and nothing is shared between replicas.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;

use super::logic::{self, Decision, StoredRecord};
use super::{
    ClaimOutcome, CompleteOutcome, Digest, OwnerToken, RecordView, ReleaseOutcome, Storage,
    StorageError,
};
use crate::clock::Clock;

pub struct MemoryStorage {
    records: Mutex<HashMap<Digest, StoredRecord>>,
    clock: Arc<dyn Clock>,
}

impl MemoryStorage {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            records: Mutex::new(HashMap::new()),
            clock,
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, HashMap<Digest, StoredRecord>>, StorageError> {
        // Nothing panics while the lock is held, but if something ever did,
        // answer 503 rather than serve a map left half-updated.
        self.records
            .lock()
            .map_err(|_| StorageError::Backend("memory store lock poisoned".into()))
    }

    fn apply<T>(
        &self,
        key: &Digest,
        decide: impl FnOnce(Option<&StoredRecord>, u64) -> Decision<T>,
    ) -> Result<T, StorageError> {
        let mut map = self.lock()?;
        let now = self.clock.now_ms();
        Ok(match decide(map.get(key), now) {
            Decision::Keep(out) => out,
            Decision::Put(rec, out) => {
                map.insert(key.clone(), rec);
                out
            }
            Decision::Delete(out) => {
                map.remove(key);
                out
            }
        })
    }
}

#[async_trait]
impl Storage for MemoryStorage {
    fn backend_name(&self) -> &'static str {
        "memory"
    }

    async fn claim(
        &self,
        key: &Digest,
        fingerprint: &Digest,
        lease_ms: u64,
        owner: &OwnerToken,
    ) -> Result<ClaimOutcome, StorageError> {
        self.apply(key, |cur, now| {
            logic::claim(cur, fingerprint, lease_ms, now, owner)
        })
    }

    async fn complete(
        &self,
        key: &Digest,
        owner: &OwnerToken,
        ttl_ms: u64,
        record: Vec<u8>,
    ) -> Result<CompleteOutcome, StorageError> {
        self.apply(key, |cur, now| {
            logic::complete(cur, owner, ttl_ms, record, now)
        })
    }

    async fn release(
        &self,
        key: &Digest,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, StorageError> {
        self.apply(key, |cur, _| logic::release(cur, owner))
    }

    async fn lookup(&self, key: &Digest) -> Result<Option<RecordView>, StorageError> {
        let map = self.lock()?;
        Ok(logic::view(map.get(key), self.clock.now_ms()))
    }

    async fn sweep_expired(&self) -> Result<u64, StorageError> {
        let mut map = self.lock()?;
        let now = self.clock.now_ms();
        let before = map.len();
        map.retain(|_, rec| rec.is_live(now));
        Ok(u64::try_from(before.saturating_sub(map.len())).unwrap_or(u64::MAX))
    }
}

//! In-process backend for tests and throwaway demos: nothing survives a
//! restart and nothing is shared between replicas.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;

use super::logic::{self, Decision, StoredRecord};
use super::{
    ClaimOutcome, CompleteOutcome, Digest, KeyPrefix, OwnerToken, PrefixMatches, RecordView,
    ReleaseOutcome, RenewOutcome, Replacement, SettleOutcome, Storage, StorageError,
};
use crate::clock::Clock;

/// Most records one sweep step removes while holding the lock, so claims
/// never wait behind a sweep of the whole map.
pub const SWEEP_CHUNK_RECORDS: usize = 1024;

#[derive(Default)]
struct Records {
    /// Ordered, so a prefix search reads only the keys with that prefix.
    by_key: BTreeMap<Digest, StoredRecord>,
    /// (expires_at_ms, key) of every record, so a sweep visits only what
    /// has expired.
    expiry: BTreeSet<(u64, Digest)>,
}

pub struct MemoryStorage {
    records: Mutex<Records>,
    clock: Arc<dyn Clock>,
}

impl MemoryStorage {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            records: Mutex::new(Records::default()),
            clock,
        }
    }

    fn lock(&self) -> Result<MutexGuard<'_, Records>, StorageError> {
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
        let mut guard = self.lock()?;
        let map = &mut *guard;
        let now = self.clock.now_ms();
        let old_exp = map.by_key.get(key).map(|r| r.expires_at_ms);
        Ok(match decide(map.by_key.get(key), now) {
            Decision::Keep(out) => out,
            Decision::Put(rec, out) => {
                if let Some(old) = old_exp {
                    map.expiry.remove(&(old, key.clone()));
                }
                map.expiry.insert((rec.expires_at_ms, key.clone()));
                map.by_key.insert(key.clone(), rec);
                out
            }
            Decision::Delete(out) => {
                if let Some(old) = old_exp {
                    map.expiry.remove(&(old, key.clone()));
                }
                map.by_key.remove(key);
                out
            }
        })
    }

    /// Removes up to [`SWEEP_CHUNK_RECORDS`] records that expired at or
    /// before `bound`; returns how many, and whether any may remain.
    fn sweep_chunk(&self, bound: u64) -> Result<(u64, bool), StorageError> {
        let mut guard = self.lock()?;
        let map = &mut *guard;
        let mut removed = 0u64;
        for _ in 0..SWEEP_CHUNK_RECORDS {
            match map.expiry.first() {
                Some((exp, _)) if *exp <= bound => {}
                _ => return Ok((removed, false)),
            }
            if let Some((_, key)) = map.expiry.pop_first() {
                let tombstone = map
                    .by_key
                    .remove(&key)
                    .and_then(|rec| rec.into_tombstone(bound));
                if let Some(rec) = tombstone {
                    map.expiry.insert((rec.expires_at_ms, key.clone()));
                    map.by_key.insert(key, rec);
                }
                removed = removed.saturating_add(1);
            }
        }
        Ok((removed, true))
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

    async fn complete_or_create(
        &self,
        key: &Digest,
        owner: &OwnerToken,
        ttl_ms: u64,
        tombstone_ms: u64,
        record: Vec<u8>,
        fingerprint: Option<&Digest>,
    ) -> Result<CompleteOutcome, StorageError> {
        self.apply(key, |cur, now| {
            logic::complete(cur, owner, ttl_ms, tombstone_ms, record, now, fingerprint)
        })
    }

    async fn release(
        &self,
        key: &Digest,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, StorageError> {
        self.apply(key, |cur, _| logic::release(cur, owner))
    }

    async fn settle_exactly(
        &self,
        key: &Digest,
        current: &[u8],
        replacement: Option<Replacement>,
    ) -> Result<SettleOutcome, StorageError> {
        self.apply(key, |cur, now| {
            logic::settle(cur, current, replacement, now)
        })
    }

    async fn renew(
        &self,
        key: &Digest,
        owner: &OwnerToken,
        lease_ms: u64,
    ) -> Result<RenewOutcome, StorageError> {
        self.apply(key, |cur, now| logic::renew(cur, owner, lease_ms, now))
    }

    async fn lookup(&self, key: &Digest) -> Result<Option<RecordView>, StorageError> {
        let map = self.lock()?;
        Ok(logic::view(map.by_key.get(key), self.clock.now_ms()))
    }

    async fn purge(&self, key: &Digest) -> Result<Option<RecordView>, StorageError> {
        self.apply(key, logic::purge)
    }

    async fn find_by_prefix(
        &self,
        prefix: &KeyPrefix,
        limit: usize,
    ) -> Result<PrefixMatches, StorageError> {
        let map = self.lock()?;
        let now = self.clock.now_ms();
        let Some(lowest) = prefix.lowest_key() else {
            return Ok(PrefixMatches {
                exhaustive: true,
                ..PrefixMatches::default()
            });
        };
        let candidates = map
            .by_key
            .range(lowest..)
            .take_while(|(key, _)| prefix.matches(key))
            .map(|(key, rec)| Ok((key.clone(), rec.is_live(now))));
        PrefixMatches::of_candidates(candidates, limit)
    }

    async fn sweep_expired(&self) -> Result<u64, StorageError> {
        // Expired means now >= expires_at_ms. Only what had expired when the
        // sweep began, so it ends even while records keep expiring.
        let bound = self.clock.now_ms();
        let mut removed = 0u64;
        loop {
            let (n, more) = self.sweep_chunk(bound)?;
            removed = removed.saturating_add(n);
            if !more {
                return Ok(removed);
            }
            // Let the claims waiting for the lock go first.
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn digest(n: usize) -> Digest {
        Digest::parse(&format!("{n:064x}")).unwrap()
    }

    #[tokio::test]
    async fn the_index_follows_writes_and_a_sweep_takes_chunks() {
        let clock = Arc::new(ManualClock::new(1_000));
        let s = MemoryStorage::new(clock.clone());
        let n = 2 * SWEEP_CHUNK_RECORDS + 5;
        let me = OwnerToken::parse("01").unwrap();
        for i in 0..n {
            s.claim(&digest(i), &digest(0), 10 + i as u64 % 7, &me)
                .await
                .unwrap();
        }
        // Replaced (completed with a longer TTL) and deleted records leave no
        // stale index entries behind.
        s.complete(&digest(0), &me, 100_000, vec![]).await.unwrap();
        s.release(&digest(1), &me).await.unwrap();
        {
            let map = s.lock().unwrap();
            assert_eq!(map.expiry.len(), map.by_key.len());
            assert!(map
                .expiry
                .iter()
                .all(|(exp, k)| map.by_key.get(k).map(|r| r.expires_at_ms) == Some(*exp)));
        }
        clock.advance_ms(100);
        assert_eq!(
            s.sweep_chunk(clock.now_ms()).unwrap(),
            (SWEEP_CHUNK_RECORDS as u64, true)
        );
        assert_eq!(
            s.sweep_expired().await.unwrap(),
            (n - 2 - SWEEP_CHUNK_RECORDS) as u64
        );
        let map = s.lock().unwrap();
        assert_eq!(map.by_key.len(), 1);
        assert_eq!(map.expiry.len(), 1);
    }
}

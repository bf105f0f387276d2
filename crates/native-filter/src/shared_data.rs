//! The process's shared data: what Envoy's shared data is to the Wasm build (every worker's
//! table claims race on it with compare-and-swap), in the module's own memory.
//!
//! Sharded by the key's hash, each shard behind its own mutex held only to copy a value in or
//! out, so workers claiming different keys rarely meet. The semantics are Envoy's: a value's
//! cas changes on every write; a write naming a cas that is no longer the value's is refused
//! (`CasMismatch`), and a write without one (or to a key not there yet) always lands.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use idempotency_core::host::{HostError, SetOutcome, SharedData};

/// Enough shards that two workers (or sixteen) rarely wait on one another.
const SHARDS: usize = 64;

struct Entry {
    value: Vec<u8>,
    cas: u32,
}

pub struct SharedMap {
    shards: Vec<Mutex<HashMap<String, Entry>>>,
    hasher: RandomState,
    next_cas: AtomicU32,
}

impl Default for SharedMap {
    fn default() -> SharedMap {
        SharedMap {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            next_cas: AtomicU32::new(1),
        }
    }
}

impl SharedMap {
    /// The one map of the process, as Envoy keeps one per `vm_id`.
    pub fn process() -> &'static SharedMap {
        static MAP: OnceLock<SharedMap> = OnceLock::new();
        MAP.get_or_init(SharedMap::default)
    }

    fn shard(&self, key: &str) -> Option<MutexGuard<'_, HashMap<String, Entry>>> {
        let index = (self.hasher.hash_one(key) as usize) % SHARDS;
        // A shard whose holder panicked holds whole entries still (every write replaces one
        // entry in one step), so it stays in use.
        self.shards.get(index).map(|shard| {
            shard
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        })
    }

    /// The value and its cas, None when the key is not there.
    pub fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        let shard = self.shard(key)?;
        shard.get(key).map(|entry| (entry.value.clone(), entry.cas))
    }

    pub fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> SetOutcome {
        let Some(mut shard) = self.shard(key) else {
            return SetOutcome::CasMismatch;
        };
        let next = self.fresh_cas();
        match shard.get_mut(key) {
            Some(entry) => {
                if cas.is_some_and(|expected| expected != entry.cas) {
                    return SetOutcome::CasMismatch;
                }
                // A value holds exactly its own bytes, as the layout counts it (its
                // `ENTRY_OVERHEAD_BYTES` are the map's, not spare room): a value of the same
                // length reuses the allocation, any other gets one of its own size. Growing
                // the old one in place (`clear` then `extend_from_slice`) doubles its
                // capacity whenever a value is a byte longer than the last (a response's
                // headers vary), and the capacity never shrinks: the memory run measured
                // 43 MiB of such slack over a 64 MiB table, half the entries at twice their
                // length.
                if entry.value.len() == value.len() {
                    entry.value.copy_from_slice(value);
                } else {
                    entry.value = value.to_vec();
                }
                entry.cas = next;
            }
            None => {
                shard.insert(
                    key.to_string(),
                    Entry {
                        value: value.to_vec(),
                        cas: next,
                    },
                );
            }
        }
        SetOutcome::Stored
    }

    /// Never 0, which reads as "no cas" at the ABI the Wasm build speaks.
    fn fresh_cas(&self) -> u32 {
        loop {
            let cas = self.next_cas.fetch_add(1, Ordering::Relaxed);
            if cas != 0 {
                return cas;
            }
        }
    }
}

/// As core's table sees it from any thread (the main thread landing a worker's write).
impl SharedData for SharedMap {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        Ok(SharedMap::get(self, key))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError> {
        Ok(SharedMap::set(self, key, value, cas))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_write_with_a_stale_cas_is_refused_and_changes_nothing() {
        let map = SharedMap::default();
        assert_eq!(map.set("k", b"one", None), SetOutcome::Stored);
        let (_, cas) = map.get("k").unwrap();
        assert_eq!(map.set("k", b"two", Some(cas)), SetOutcome::Stored);
        assert_eq!(map.set("k", b"three", Some(cas)), SetOutcome::CasMismatch);
        assert_eq!(map.get("k").unwrap().0, b"two");
    }

    #[test]
    fn a_value_keeps_no_room_beyond_its_length() {
        let map = SharedMap::default();
        let stored = |map: &SharedMap| {
            let shard = map.shard("k").unwrap();
            let value = &shard.get("k").unwrap().value;
            (value.len(), value.capacity())
        };
        // A response of 1,357 bytes, then one a byte longer, then a page pointer, then the
        // response again: each write leaves exactly its own bytes allocated.
        for len in [1_357, 1_358, 21, 1_358, 1_357] {
            assert_eq!(map.set("k", &vec![7; len], None), SetOutcome::Stored);
            assert_eq!(stored(&map), (len, len));
            assert_eq!(map.get("k").unwrap().0, vec![7; len]);
        }
    }

    #[test]
    fn a_key_not_there_yet_takes_any_write() {
        let map = SharedMap::default();
        assert!(map.get("new").is_none());
        assert_eq!(map.set("new", b"v", Some(77)), SetOutcome::Stored);
        assert_eq!(map.get("new").unwrap().0, b"v");
    }

    #[test]
    fn of_threads_racing_to_claim_one_key_exactly_one_wins() {
        let map = Arc::new(SharedMap::default());
        map.set("slot", b"free", None);
        let (_, cas) = map.get("slot").unwrap();
        let winners: usize = (0..8)
            .map(|i| {
                let map = Arc::clone(&map);
                std::thread::spawn(move || {
                    map.set("slot", format!("claimed by {i}").as_bytes(), Some(cas))
                        == SetOutcome::Stored
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| usize::from(t.join().unwrap()))
            .sum();
        assert_eq!(winners, 1);
    }
}

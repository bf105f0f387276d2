//! The process's records, shared by every worker: a digest's claim or its recorded response.
//! Sharded by the digest's first byte (SHA-256: uniform), each shard behind a mutex held
//! only for one lookup-and-claim or one write, the native counterpart of the Wasm floor's
//! shared data with compare-and-swap. Nothing is ever evicted (a bench tool's run is short).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

const SHARDS: usize = 64;

/// A recorded response; shared by the replays that answer with it.
pub struct Recorded {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

enum Slot {
    InFlight,
    Done(Arc<Recorded>),
}

struct Entry {
    fingerprint: [u8; 32],
    slot: Slot,
}

/// What a claim found.
pub enum Lookup {
    /// Nothing was there: this request holds the digest now.
    Claimed,
    /// Another request with this digest is still running.
    InFlight,
    /// The digest's request had another body.
    Mismatch,
    Recorded(Arc<Recorded>),
}

pub struct Records {
    shards: Vec<Mutex<HashMap<[u8; 32], Entry>>>,
}

impl Records {
    /// The one map of the process.
    pub fn process() -> &'static Records {
        static RECORDS: OnceLock<Records> = OnceLock::new();
        RECORDS.get_or_init(|| Records {
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
        })
    }

    fn shard(&self, digest: &[u8; 32]) -> Option<MutexGuard<'_, HashMap<[u8; 32], Entry>>> {
        let index = usize::from(digest[0]) % SHARDS;
        // Every write replaces or adds one entry in one step: a poisoned shard is whole.
        self.shards.get(index).map(|shard| {
            shard
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        })
    }

    /// Looks `digest` up and claims it when it is not there, in one step.
    pub fn claim(&self, digest: [u8; 32], fingerprint: [u8; 32]) -> Lookup {
        let Some(mut shard) = self.shard(&digest) else {
            return Lookup::InFlight;
        };
        match shard.get(&digest) {
            Some(entry) if entry.fingerprint != fingerprint => Lookup::Mismatch,
            Some(Entry {
                slot: Slot::InFlight,
                ..
            }) => Lookup::InFlight,
            Some(Entry {
                slot: Slot::Done(recorded),
                ..
            }) => Lookup::Recorded(Arc::clone(recorded)),
            None => {
                shard.insert(
                    digest,
                    Entry {
                        fingerprint,
                        slot: Slot::InFlight,
                    },
                );
                Lookup::Claimed
            }
        }
    }

    /// Records the response of the request that claimed `digest`.
    pub fn record(&self, digest: [u8; 32], fingerprint: [u8; 32], recorded: Recorded) {
        if let Some(mut shard) = self.shard(&digest) {
            shard.insert(
                digest,
                Entry {
                    fingerprint,
                    slot: Slot::Done(Arc::new(recorded)),
                },
            );
        }
    }
}

//! Long-polled waits for a key in flight: a filter holding a duplicate (a rule's
//! `on_in_flight: "wait"`) asks the store to answer once the first request with that key has
//! ended, instead of spinning on claims.
//!
//! A wait ends when the key's record completes (its record is the answer), is released or
//! lapses, holds another payload, or the wait's bound passes (still in flight). Completions
//! and releases made through this store instance wake the waits for their key at once. One
//! made through another instance sharing the backend (several stores on one Redis) is seen
//! by looking the key up again every `poll`; a wait also looks again when the in-flight
//! record's lease ends. Waits are bounded in number: beyond `max_waits` a wait is answered
//! at once as still in flight, and the filter gives its client the 409 it would have had.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency_protocol::wire::RecordState;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::storage::{Digest, Storage, StorageError};

/// How a wait ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitOutcome {
    /// The first request completed: replay this record.
    Completed { record: Vec<u8> },
    /// Nothing live holds the key: the first was released, or its lease lapsed.
    Released,
    /// A live record holds the key for another payload.
    Mismatch,
    /// Still in flight when the wait's bound passed (or too many waits were held).
    InFlight { retry_after_ms: u64 },
}

impl WaitOutcome {
    /// The outcome's metrics label.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Completed { .. } => "completed",
            Self::Released => "released",
            Self::Mismatch => "mismatch",
            Self::InFlight { .. } => "in_flight",
        }
    }
}

/// The waits this store instance holds.
pub struct WaitRoom {
    keys: Mutex<HashMap<Digest, Arc<Notify>>>,
    holding: AtomicUsize,
    max_waits: usize,
    poll: Duration,
}

/// Default bound on waits one store instance holds.
pub const DEFAULT_MAX_WAITS: usize = 10_000;
/// The longest wait the store accepts (the filter's `wait_ms` is at most 60 s).
pub const MAX_WAIT_MS: u64 = 60_000;

impl WaitRoom {
    /// `poll`: how often a wait looks at its key again when nothing woke it (the backend may
    /// be written by other store instances); `None` for a backend only this instance writes.
    pub fn new(max_waits: usize, poll: Option<Duration>) -> Self {
        Self {
            keys: Mutex::new(HashMap::new()),
            holding: AtomicUsize::new(0),
            max_waits,
            // Without other writers, looking again only guards against a missed wake-up.
            poll: poll.unwrap_or(Duration::from_secs(1)),
        }
    }

    /// Waits held now.
    pub fn holding(&self) -> usize {
        self.holding.load(Ordering::Relaxed)
    }

    /// `key` was completed or released through this instance: its waits look again now.
    pub fn settled(&self, key: &Digest) {
        let keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(notify) = keys.get(key) {
            notify.notify_waiters();
        }
    }

    /// Takes one of the room's places for a wait on `key`, or None when `max_waits` are held
    /// already (the caller answers "still in flight" at once). Taken before the wait's task is
    /// spawned, so that a refused wait costs no task; the place is given back when the
    /// returned guard is dropped.
    pub fn hold(self: &Arc<Self>, key: &Digest) -> Option<HeldWait> {
        let mut keys = self.keys.lock().unwrap_or_else(PoisonError::into_inner);
        if self.holding.load(Ordering::Relaxed) >= self.max_waits {
            return None;
        }
        self.holding.fetch_add(1, Ordering::Relaxed);
        let notify = Arc::clone(keys.entry(key.clone()).or_default());
        Some(HeldWait {
            room: Arc::clone(self),
            key: key.clone(),
            notify,
        })
    }

    /// Waits up to `wait` for the record of `key` (claimed for `fingerprint`) to leave the
    /// in-flight state, holding a place for it meanwhile ([`Self::hold`]).
    pub async fn wait(
        self: &Arc<Self>,
        storage: &dyn Storage,
        key: &Digest,
        fingerprint: &Digest,
        wait: Duration,
    ) -> Result<WaitOutcome, StorageError> {
        match self.hold(key) {
            Some(held) => held.wait(storage, fingerprint, wait).await,
            None => Ok(WaitOutcome::InFlight { retry_after_ms: 1 }),
        }
    }
}

/// One wait's place in its room, counted while it lasts; the last wait of a key removes its
/// entry.
pub struct HeldWait {
    room: Arc<WaitRoom>,
    key: Digest,
    notify: Arc<Notify>,
}

impl HeldWait {
    /// Waits up to `wait` for the record of this wait's key (claimed for `fingerprint`) to
    /// leave the in-flight state. The bound is measured on the monotonic clock; the lease's
    /// end only on the backend's, which is the clock that ends it.
    pub async fn wait(
        &self,
        storage: &dyn Storage,
        fingerprint: &Digest,
        wait: Duration,
    ) -> Result<WaitOutcome, StorageError> {
        let deadline = Instant::now() + wait.min(Duration::from_millis(MAX_WAIT_MS));
        let key = &self.key;
        loop {
            // Registered before the lookup, so a completion between the two still wakes it.
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let lease_left_ms = match storage.lookup(key).await? {
                None => return Ok(WaitOutcome::Released),
                Some(view) if view.fingerprint != *fingerprint => return Ok(WaitOutcome::Mismatch),
                Some(view) if view.state == RecordState::Completed => {
                    return Ok(WaitOutcome::Completed {
                        record: view.record.unwrap_or_default(),
                    })
                }
                // On the backend's clock, which is the one that ends the lease.
                Some(view) => view.expires_at_ms.saturating_sub(view.now_ms),
            };
            let now = Instant::now();
            if now >= deadline {
                return Ok(WaitOutcome::InFlight {
                    retry_after_ms: lease_left_ms.max(1),
                });
            }
            // Look again when woken, when the lease ends, at the poll, or at the deadline.
            let until_lease_end = Duration::from_millis(lease_left_ms.saturating_add(1));
            let nap = (deadline - now).min(until_lease_end).min(self.room.poll);
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep(nap) => {}
            }
        }
    }
}

impl Drop for HeldWait {
    fn drop(&mut self) {
        let mut keys = self
            .room
            .keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.room.holding.fetch_sub(1, Ordering::Relaxed);
        // Clones are only made under this lock: two references are the map's and this one.
        if Arc::strong_count(&self.notify) == 2 {
            keys.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;
    use crate::storage::memory::MemoryStorage;
    use crate::storage::OwnerToken;

    fn digest(c: char) -> Digest {
        Digest::parse(&c.to_string().repeat(64)).unwrap()
    }

    struct Fixture {
        storage: Arc<MemoryStorage>,
        room: Arc<WaitRoom>,
        key: Digest,
        fp: Digest,
        owner: OwnerToken,
    }

    /// A key claimed for `lease_ms`, and a room with the given poll.
    async fn claimed(lease_ms: u64, poll: Option<Duration>) -> Fixture {
        let storage = Arc::new(MemoryStorage::new(Arc::new(SystemClock)));
        let (key, fp) = (digest('a'), digest('f'));
        let owner = OwnerToken::parse("0123abcd").unwrap();
        storage.claim(&key, &fp, lease_ms, &owner).await.unwrap();
        Fixture {
            storage,
            room: Arc::new(WaitRoom::new(4, poll)),
            key,
            fp,
            owner,
        }
    }

    fn spawn_wait(f: &Fixture, wait_ms: u64) -> tokio::task::JoinHandle<WaitOutcome> {
        let (storage, room) = (Arc::clone(&f.storage), Arc::clone(&f.room));
        let (key, fp) = (f.key.clone(), f.fp.clone());
        tokio::spawn(async move {
            room.wait(storage.as_ref(), &key, &fp, Duration::from_millis(wait_ms))
                .await
                .unwrap()
        })
    }

    async fn until_held(room: &WaitRoom, n: usize) {
        for _ in 0..500 {
            if room.holding() == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("{n} waits never held");
    }

    #[tokio::test]
    async fn a_completion_through_this_instance_ends_every_wait_at_once_with_the_record() {
        // No poll worth speaking of: only the wake-up can end the waits in time.
        let f = claimed(60_000, Some(Duration::from_secs(30))).await;
        let waits: Vec<_> = (0..3).map(|_| spawn_wait(&f, 20_000)).collect();
        until_held(&f.room, 3).await;
        let started = std::time::Instant::now();
        f.storage
            .complete(&f.key, &f.owner, 60_000, b"the response".to_vec())
            .await
            .unwrap();
        f.room.settled(&f.key);
        for wait in waits {
            let outcome = wait.await.unwrap();
            assert_eq!(
                outcome,
                WaitOutcome::Completed {
                    record: b"the response".to_vec()
                }
            );
        }
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(f.room.holding(), 0);
        assert!(
            f.room.keys.lock().unwrap().is_empty(),
            "no entry left behind"
        );
    }

    #[tokio::test]
    async fn a_release_ends_the_wait_as_released_and_a_lapsed_lease_too() {
        let f = claimed(60_000, Some(Duration::from_secs(30))).await;
        let wait = spawn_wait(&f, 20_000);
        until_held(&f.room, 1).await;
        f.storage.release(&f.key, &f.owner).await.unwrap();
        f.room.settled(&f.key);
        assert_eq!(wait.await.unwrap(), WaitOutcome::Released);

        // Nobody completes or releases: the lease's end is looked at all the same.
        let f = claimed(300, Some(Duration::from_secs(30))).await;
        assert_eq!(spawn_wait(&f, 20_000).await.unwrap(), WaitOutcome::Released);
    }

    #[tokio::test]
    async fn a_completion_through_another_instance_is_seen_at_the_next_poll() {
        let f = claimed(60_000, Some(Duration::from_millis(50))).await;
        let wait = spawn_wait(&f, 20_000);
        until_held(&f.room, 1).await;
        // Written as another store instance would: nothing tells this room.
        f.storage
            .complete(&f.key, &f.owner, 60_000, b"r".to_vec())
            .await
            .unwrap();
        let outcome = tokio::time::timeout(Duration::from_secs(5), wait).await;
        assert_eq!(
            outcome.unwrap().unwrap(),
            WaitOutcome::Completed {
                record: b"r".to_vec()
            }
        );
    }

    #[tokio::test]
    async fn a_wait_ends_in_flight_at_its_bound_and_beyond_max_waits_at_once() {
        let f = claimed(60_000, None).await;
        let outcome = spawn_wait(&f, 100).await.unwrap();
        assert!(
            matches!(outcome, WaitOutcome::InFlight { retry_after_ms } if retry_after_ms > 50_000)
        );
        let held: Vec<_> = (0..4).map(|_| spawn_wait(&f, 20_000)).collect();
        until_held(&f.room, 4).await;
        let started = std::time::Instant::now();
        assert_eq!(
            spawn_wait(&f, 20_000).await.unwrap(),
            WaitOutcome::InFlight { retry_after_ms: 1 }
        );
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "refused at once"
        );
        for h in held {
            h.abort();
        }
    }

    #[tokio::test]
    async fn a_wait_for_another_payload_is_a_mismatch_and_for_nothing_released() {
        let f = claimed(60_000, None).await;
        let (storage, room) = (Arc::clone(&f.storage), Arc::clone(&f.room));
        let other = digest('e');
        let outcome = room
            .wait(storage.as_ref(), &f.key, &other, Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(outcome, WaitOutcome::Mismatch);
        let outcome = room
            .wait(
                storage.as_ref(),
                &digest('b'),
                &f.fp,
                Duration::from_secs(1),
            )
            .await
            .unwrap();
        assert_eq!(outcome, WaitOutcome::Released);
    }
}

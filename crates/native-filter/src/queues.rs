//! The process's shared queues, by name, as Envoy's are to the Wasm build. Nothing wakes a
//! root when one fills: its tick takes what is queued (the Wasm build's `on_queue_ready` only
//! makes that sooner). Single-proxy mode queues nothing; they exist so the same core runs.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard, OnceLock};

#[derive(Default)]
struct Queues {
    ids: HashMap<String, u32>,
    queues: HashMap<u32, VecDeque<Vec<u8>>>,
    /// The last id given: ids are never reused, even once a queue is removed.
    last: u32,
}

fn queues() -> MutexGuard<'static, Queues> {
    static QUEUES: OnceLock<Mutex<Queues>> = OnceLock::new();
    QUEUES
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The queue's id; the same name gives the same queue on every worker.
pub fn register(name: &str) -> u32 {
    let mut all = queues();
    if let Some(id) = all.ids.get(name) {
        return *id;
    }
    // Zero is proxy-wasm's "none"; a wrap after 4 billion registrations skips it.
    all.last = all.last.wrapping_add(1).max(1);
    let id = all.last;
    all.ids.insert(name.to_string(), id);
    all.queues.insert(id, VecDeque::new());
    id
}

/// Removes queue `id` (its root is gone); its name may be registered again.
pub fn unregister(id: u32) {
    let mut all = queues();
    all.queues.remove(&id);
    all.ids.retain(|_, queue| *queue != id);
}

/// False when no queue has that id.
pub fn enqueue(id: u32, value: &[u8]) -> bool {
    match queues().queues.get_mut(&id) {
        Some(queue) => {
            queue.push_back(value.to_vec());
            true
        }
        None => false,
    }
}

pub fn dequeue(id: u32) -> Option<Vec<u8>> {
    queues().queues.get_mut(&id).and_then(VecDeque::pop_front)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    /// Every push builds new roots, each registering a queue of its own: a root's queue goes
    /// with it, and an id is never given to another queue.
    #[test]
    fn a_removed_queue_frees_its_name_and_its_id_is_never_reused() {
        let (a, b) = (register("test/queues/a"), register("test/queues/b"));
        assert_eq!(register("test/queues/a"), a);
        assert!(enqueue(a, b"x"));
        unregister(a);
        assert!(!enqueue(a, b"y"), "gone");
        assert_eq!(dequeue(a), None);
        let again = register("test/queues/a");
        assert!(again != a && again != b);
        assert!(enqueue(b, b"z") && dequeue(b) == Some(b"z".to_vec()));
        unregister(again);
        unregister(b);
        assert!(!queues()
            .ids
            .keys()
            .any(|name| name.starts_with("test/queues/")));
    }
}

//! The process's shared queues, by name, as Envoy's are to the Wasm build. Nothing wakes a
//! root when one fills: its tick takes what is queued (the Wasm build's `on_queue_ready` only
//! makes that sooner). Single-proxy mode queues nothing; they exist so the same core runs.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard, OnceLock};

#[derive(Default)]
struct Queues {
    ids: HashMap<String, u32>,
    queues: HashMap<u32, VecDeque<Vec<u8>>>,
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
    let id = u32::try_from(all.ids.len())
        .unwrap_or(u32::MAX)
        .saturating_add(1);
    all.ids.insert(name.to_string(), id);
    all.queues.insert(id, VecDeque::new());
    id
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

//! What each worker thread holds of the module: its live requests' and roots' context ids,
//! and, per configuration, its root (see docs/how-it-works.md, "The
//! native build"). All of it is thread-local: a worker's state is touched only on that worker.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;

thread_local! {
    /// Context ids, as proxy-wasm numbers a VM's contexts: one sequence per worker.
    static NEXT_CONTEXT_ID: Cell<u32> = const { Cell::new(1) };
    /// The context ids of this worker's live requests.
    static LIVE: RefCell<HashSet<u32>> = RefCell::new(HashSet::new());
}

thread_local! {
    /// The context ids of this worker's roots: core may switch a request's host to its root.
    static ROOT_IDS: RefCell<HashSet<u32>> = RefCell::new(HashSet::new());
}

pub fn new_root_context_id() -> u32 {
    let id = new_context_id();
    ROOT_IDS.with(|roots| roots.borrow_mut().insert(id));
    id
}

/// A root of this worker is gone. (Nothing to forget once the worker itself is ending: its
/// roots go with its thread-locals, in no set order.)
pub fn forget_root(context_id: u32) {
    let _ = ROOT_IDS.try_with(|roots| roots.borrow_mut().remove(&context_id));
}

pub fn is_root_context(context_id: u32) -> bool {
    ROOT_IDS.with(|roots| roots.borrow().contains(&context_id))
}

pub fn new_context_id() -> u32 {
    NEXT_CONTEXT_ID.with(|next| loop {
        let id = next.get();
        // Zero is never an id (the Wasm ABI's "none"). After a wrap (weeks of a busy worker)
        // an id still in use, a root's or a live request's, is skipped, as Envoy's are.
        next.set(id.checked_add(1).unwrap_or(1));
        let in_use = is_root_context(id) || LIVE.with(|live| live.borrow().contains(&id));
        if id != 0 && !in_use {
            return id;
        }
    })
}

/// A request Envoy created on this worker: its id is in use until `forget`.
pub fn register(context_id: u32) {
    LIVE.with(|live| live.borrow_mut().insert(context_id));
}

/// Called from the request's destroy hook, before Envoy frees it.
pub fn forget(context_id: u32) {
    LIVE.with(|live| live.borrow_mut().remove(&context_id));
}

/// The roots of this worker, one per configuration (by the configuration's id, never reused
/// in the process's life).
pub struct Roots<T> {
    roots: RefCell<HashMap<u64, Rc<T>>>,
}

impl<T> Default for Roots<T> {
    fn default() -> Self {
        Roots {
            roots: RefCell::new(HashMap::new()),
        }
    }
}

impl<T> Roots<T> {
    pub fn get_or_insert_with(&self, config: u64, build: impl FnOnce() -> T) -> Rc<T> {
        if let Some(root) = self.roots.borrow().get(&config) {
            return Rc::clone(root);
        }
        let root = Rc::new(build());
        self.roots.borrow_mut().insert(config, Rc::clone(&root));
        root
    }

    /// Keeps the roots `keep` says to; a dropped one lives on in the requests holding it.
    pub fn retain(&self, keep: impl Fn(&T) -> bool) {
        self.roots.borrow_mut().retain(|_, root| keep(root));
    }
}

//! What each worker thread holds of the module: its live requests by context id, the request
//! host calls act on now, and, per configuration, its root (see docs/how-it-works.md, "The
//! native build"). All of it is thread-local: a worker's state is touched only on that worker.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use crate::abi::FilterHandle as RawFilter;

thread_local! {
    /// Context ids, as proxy-wasm numbers a VM's contexts: one sequence per worker.
    static NEXT_CONTEXT_ID: Cell<u32> = const { Cell::new(1) };
    /// The live requests of this worker, by context id.
    static LIVE: RefCell<HashMap<u32, RawFilter>> = RefCell::new(HashMap::new());
    /// The request host calls act on; None while a root works outside any request.
    static EFFECTIVE: Cell<Option<RawFilter>> = const { Cell::new(None) };
}

thread_local! {
    /// The context ids of this worker's roots: switching to one acts on no request.
    static ROOT_IDS: RefCell<std::collections::HashSet<u32>> =
        RefCell::new(std::collections::HashSet::new());
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
        let in_use = is_root_context(id) || LIVE.with(|live| live.borrow().contains_key(&id));
        if id != 0 && !in_use {
            return id;
        }
    })
}

/// A request Envoy created on this worker: reachable by its id until `forget`.
pub fn register(context_id: u32, filter: RawFilter) {
    LIVE.with(|live| live.borrow_mut().insert(context_id, filter));
}

/// Called from the request's destroy hook, before Envoy frees it.
pub fn forget(context_id: u32) {
    let gone = LIVE.with(|live| live.borrow_mut().remove(&context_id));
    if let Some(filter) = gone {
        crate::abi::forget_stand_in(filter);
    }
    EFFECTIVE.with(|effective| {
        if gone.is_some() && effective.get() == gone {
            effective.set(None);
        }
    });
}

/// Host calls act on this request from now on (its own hook is running).
pub fn act_on(filter: RawFilter) {
    crate::abi::end_stand_in();
    EFFECTIVE.with(|effective| effective.set(Some(filter)));
}

/// Host calls act on no request (a root's own work).
pub fn act_on_none() {
    crate::abi::end_stand_in();
    EFFECTIVE.with(|effective| effective.set(None));
}

/// Host calls act on the root, at core's word (`set_effective_context`): the calls held for
/// a request the root acts on stay held, since core may be mid-step on it (it sends to the
/// store from the root's context, then comes back).
pub fn act_on_root() {
    EFFECTIVE.with(|effective| effective.set(None));
}

/// Host calls act on the live request `context_id`, from outside its hooks (a root delivers
/// to it); false when it is gone. Its local reply or resume waits until the host acts on
/// another request, or the root's work ends (`act_on_none`): core has stepped its journey
/// by then, and Envoy may run the request's hooks inside either (its stream's end; a
/// router's own reply).
pub fn act_on_context(context_id: u32) -> bool {
    let live = |id: u32| LIVE.with(|live| live.borrow().get(&id).copied());
    if let Some(filter) = live(context_id).filter(|f| crate::abi::is_standing_in_for(*f)) {
        EFFECTIVE.with(|effective| effective.set(Some(filter)));
        return true;
    }
    // The calls held for the request acted on before are made first: Envoy may end a
    // request inside them, so the registry is read after.
    crate::abi::end_stand_in();
    match live(context_id) {
        Some(filter) => {
            crate::abi::stand_in_for(filter);
            EFFECTIVE.with(|effective| effective.set(Some(filter)));
            true
        }
        None => false,
    }
}

pub fn effective() -> Option<RawFilter> {
    EFFECTIVE.with(Cell::get)
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

//! The journeys of one configuration, by the host's id of their request's context, as Envoy
//! addresses requests: the root hands a journey what arrives for it (a store answer, a
//! wait's end, a detached write's answer) by that id, and the books it keeps (waits, stream
//! calls, detached writes) hold only ids.
//!
//! A request's filter owns its journey; the registry only finds it while it lives. A journey
//! whose detached write is out is kept alive here until the root hands it the answer, since
//! its key must be recorded or freed even after its client left.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::{Rc, Weak};

use super::RequestJourney;

/// The registry looks for journeys gone once it holds this many entries, then at twice as
/// many as are live: its size stays within twice the requests in flight.
const FIRST_PRUNE_AT: usize = 64;

#[derive(Default)]
pub struct Journeys {
    live: RefCell<HashMap<u32, Weak<RefCell<RequestJourney>>>>,
    kept: RefCell<HashMap<u32, Rc<RefCell<RequestJourney>>>>,
    prune_at: std::cell::Cell<usize>,
}

impl Journeys {
    /// A new request's journey, findable by `context_id` while its filter holds it.
    pub(super) fn register(&self, context_id: u32, journey: &Rc<RefCell<RequestJourney>>) {
        let Ok(mut live) = self.live.try_borrow_mut() else {
            return;
        };
        if live.len() >= self.prune_at.get().max(FIRST_PRUNE_AT) {
            live.retain(|_, j| j.strong_count() > 0);
            self.prune_at.set(live.len().saturating_mul(2));
        }
        live.insert(context_id, Rc::downgrade(journey));
    }

    /// The journey of `context_id`, if its request (or a detached write) still holds it.
    pub fn find(&self, context_id: u32) -> Option<Rc<RefCell<RequestJourney>>> {
        let kept = self
            .kept
            .try_borrow()
            .ok()
            .and_then(|k| k.get(&context_id).cloned());
        if kept.is_some() {
            return kept;
        }
        // The borrow ends before the upgrade: a journey dropped here runs no code of ours,
        // but keep the registry unborrowed whatever it does.
        let weak = self.live.try_borrow().ok()?.get(&context_id).cloned();
        weak.and_then(|w| w.upgrade())
    }

    /// Whether the request of `context_id` is still there (or kept for its detached write).
    pub fn is_live(&self, context_id: u32) -> bool {
        self.find(context_id).is_some()
    }

    /// Keeps the journey of `context_id` alive until [`Journeys::release`], whatever its
    /// client does: its detached write is out.
    pub(super) fn keep(&self, context_id: u32) -> bool {
        let Some(journey) = self.find(context_id) else {
            return false;
        };
        match self.kept.try_borrow_mut() {
            Ok(mut kept) => {
                kept.insert(context_id, journey);
                true
            }
            Err(_) => false,
        }
    }

    /// The detached write of `context_id` was answered: its journey lives as long as its
    /// request does, no longer.
    pub fn release(&self, context_id: u32) {
        let released = self
            .kept
            .try_borrow_mut()
            .ok()
            .and_then(|mut kept| kept.remove(&context_id));
        drop(released); // after the borrow: the journey may end here
    }

    /// Entries the registry holds, journeys gone and not yet pruned included.
    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.live.try_borrow().map_or(0, |l| l.len())
    }

    /// Journeys kept for their detached writes.
    pub fn kept(&self) -> usize {
        self.kept.try_borrow().map_or(0, |k| k.len())
    }
}

//! A local record's "it reached the store" mark, taken to whoever sees the completion land:
//! the root that sent it, or (native build) the main thread landing an idle worker's
//! handed-off writes, which must not wait for that worker's next request. Until then the
//! record is kept from eviction, and an unknown outcome's retries do not take the store's
//! "free" for "never ran".

use std::cell::RefCell;

use super::layout::Layout;
use super::{Completion, Held, Table, TableError};
use crate::host::{OnLanded, SharedData};

/// Marks the record a claim recorded as in the store, from any thread: the table
/// that holds it (by name and layout; not the tables it replaced) and the claim. Plain data,
/// so it may cross threads with a handed-off write.
#[derive(Debug, Clone)]
pub struct InStoreMark {
    prefix: String,
    layout: Layout,
    salt: u64,
    recorded_by: Held,
}

impl InStoreMark {
    /// From then on every worker's retry takes the store's word on the key (an operator's or
    /// a resolution's "never ran" frees it). Changes nothing unless the slot still holds that
    /// claim's record awaiting the store.
    pub fn apply(&self, shared: &impl SharedData) -> Result<Completion, TableError> {
        let table = Table {
            prefix: self.prefix.clone(),
            layout: self.layout.clone(),
            salt: self.salt,
            predecessors: RefCell::new(Vec::new()),
        };
        table.mark_in_store(shared, &self.recorded_by)
    }
}

impl OnLanded for InStoreMark {
    fn on_landed(&self, shared: &dyn SharedData) {
        if let Err(e) = self.apply(&shared) {
            // Retries of the key keep answering 409 until its root takes the store's answer.
            log::warn!("local record not marked as in the store: {e}");
        }
    }
}

impl Table {
    /// The mark for the record `held` completed, if it is in this table (a replaced table's
    /// records are never marked, as `mark_in_store` does not).
    pub fn in_store_mark(&self, held: &Held) -> Option<InStoreMark> {
        held.slot.filter(|s| s.generation == 0)?;
        Some(InStoreMark {
            prefix: self.prefix.clone(),
            layout: self.layout.clone(),
            salt: self.salt,
            recorded_by: Held {
                evicted: None,
                unlanded: None,
                ..held.clone()
            },
        })
    }
}

//! One completion, release, renewal or settle the root delivers to the store for a request,
//! until the store takes it or its deadline passes: what the stream link holds while the
//! call is out, and what the store writes queue and retry.

use std::rc::Rc;
use std::sync::Arc;

use idempotency_protocol::stream::CallOp;

use crate::rule_handle::RuleHandle;
use crate::store::calls::StoreOp;
use crate::store::client::{call_bytes, WriteKind};
use crate::table::{Held, InStoreMark};

/// Builds the record without its response body, for a completion that cannot keep it.
pub type LeanRecord = Box<dyn FnOnce() -> Vec<u8>>;

pub struct PendingWrite {
    /// The rule whose store takes the write and whose counters count its failures.
    pub rule: Rc<RuleHandle>,
    /// A completion or a release.
    pub call: CallOp,
    /// A completion with a response body: its record without the body.
    pub(super) lean: Option<LeanRecord>,
    /// Writes to a claim whose answer was lost: best effort, so failures are logged but not
    /// counted as store errors (the failed claim already was).
    pub(super) best_effort: bool,
    pub(super) attempts: u32,
    /// After this the write cannot matter any more: the record would have expired (complete)
    /// or the claim's lease has passed and another request may take it over (release).
    pub(super) deadline_ms: u64,
    /// A completion: the local claim it completes, whose record is dropped should the store
    /// say another request's record superseded it.
    pub(super) local: Option<Held>,
    /// A completion of an unknown outcome: its local record is marked as in the store once
    /// the store takes it (until then no worker takes the store's "free" for a settlement).
    pub(super) marks_in_store: Option<Arc<InStoreMark>>,
    /// A settle whose answer its sender waits for: reported under this id
    /// (`StoreWrites::take_settle_answers`).
    pub(super) reports_to: Option<u64>,
    /// A completion or release reported to the host ([`crate::host::Host::hand_off_write`])
    /// under this id, to be reported settled.
    pub(super) handoff_id: Option<u64>,
}

impl PendingWrite {
    pub fn new(rule: Rc<RuleHandle>, call: CallOp, deadline_ms: u64) -> PendingWrite {
        PendingWrite {
            rule,
            call,
            lean: None,
            best_effort: false,
            attempts: 0,
            deadline_ms,
            local: None,
            marks_in_store: None,
            reports_to: None,
            handoff_id: None,
        }
    }

    /// A write to a claim the store may never have applied: failures are not store errors.
    pub fn best_effort(self) -> PendingWrite {
        PendingWrite {
            best_effort: true,
            ..self
        }
    }

    /// The record to send instead when the retry budget or the stream cannot hold it.
    pub fn with_lean_record(self, lean: LeanRecord) -> PendingWrite {
        PendingWrite {
            lean: Some(lean),
            ..self
        }
    }

    /// The local claim this completion completes.
    pub fn with_local_claim(self, held: Held) -> PendingWrite {
        PendingWrite {
            local: Some(held),
            ..self
        }
    }

    /// Marks the local claim's record as in the store once the store takes this completion
    /// (None: the record is not in this root's table, so nothing is marked).
    pub fn marking_in_store(self, mark: Option<InStoreMark>) -> PendingWrite {
        PendingWrite {
            marks_in_store: mark.map(Arc::new),
            ..self
        }
    }

    /// Reports the store's final answer to this settle under `id`.
    pub fn reporting_to(self, id: u64) -> PendingWrite {
        PendingWrite {
            reports_to: Some(id),
            ..self
        }
    }

    /// Swaps the record for its lean form; false when there is none.
    pub(super) fn slim_down(&mut self) -> bool {
        match (self.lean.take(), &mut self.call) {
            (Some(lean), CallOp::Complete { record, .. }) => {
                *record = lean();
                true
            }
            _ => false,
        }
    }

    pub(super) fn bytes(&self) -> usize {
        call_bytes(&self.call)
    }

    pub(super) fn op(&self) -> StoreOp {
        match self.call {
            // A write is never a claim or a wait; named for completeness.
            CallOp::Claim { .. } | CallOp::Wait { .. } | CallOp::Lookup { .. } => StoreOp::Claim,
            CallOp::Complete { .. } => StoreOp::Complete,
            CallOp::Release { .. } => StoreOp::Release,
            CallOp::Renew { .. } => StoreOp::Renew,
            CallOp::Settle { .. } => StoreOp::Settle,
        }
    }

    pub(super) fn kind(&self) -> WriteKind {
        match self.call {
            CallOp::Release { .. } => WriteKind::Release,
            CallOp::Renew { .. } => WriteKind::Renew,
            CallOp::Settle { .. } => WriteKind::Settle,
            _ => WriteKind::Complete,
        }
    }
}

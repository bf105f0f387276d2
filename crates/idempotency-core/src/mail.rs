//! An event the root has for a request whose hook is not running, as a host that runs each
//! request only in its own hooks takes it (Envoy's dynamic modules): the root leaves it in
//! [`PluginRoot::take_mail`](crate::root::PluginRoot::take_mail), the host puts it in that
//! request's mailbox and wakes the request, which takes it in its own hook
//! ([`PluginRoot::deliver_mail`](crate::root::PluginRoot::deliver_mail)). proxy-wasm's root
//! switches to the request's context instead, and runs the event at once.
//!
//! A letter the request can no longer take is never dropped: its claim, if the store may
//! hold it, is released ([`PluginRoot::undelivered`](crate::root::PluginRoot::undelivered)),
//! as for an answer whose request had gone before it came.

use crate::journey::Event;
use crate::store::link::ClaimWaiter;

pub struct Mail {
    pub(crate) context_id: u32,
    pub(crate) event: Event,
    /// A claim's answer: the claim, to release should its request be gone.
    pub(crate) claim: Option<ClaimWaiter>,
}

impl Mail {
    pub(crate) fn new(context_id: u32, event: Event) -> Mail {
        Mail {
            context_id,
            event,
            claim: None,
        }
    }

    /// A claim's answer, which carries its claim in case nobody takes it.
    pub(crate) fn for_claim(context_id: u32, event: Event, claim: ClaimWaiter) -> Mail {
        Mail {
            context_id,
            event,
            claim: Some(claim),
        }
    }

    /// The request this is for.
    pub fn context_id(&self) -> u32 {
        self.context_id
    }
}

impl std::fmt::Debug for Mail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mail")
            .field("context_id", &self.context_id)
            .field("event", &self.event)
            .finish_non_exhaustive()
    }
}

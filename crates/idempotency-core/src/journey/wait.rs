//! A duplicate held while the first request with its key runs (`on_in_flight: "wait"`),
//! and how its wait ends: the first's response replayed, 409 when `wait_ms` passes, a
//! retry-able 503 when the first was released, 422 when another payload took the key.
//!
//! A duplicate waits where the first request's end will show: in the local table when the
//! key is in flight there (a request of this Envoy, on any worker), on the store when the
//! store says it is in flight (cluster mode, a request of another replica). In cluster mode a
//! local claim may only be a request confirming with the store, which lets it go when the
//! store answers; a local wait that sees the key released then waits on the store instead.

use std::rc::Rc;

use super::{HeldDuplicate, Journey, RequestJourney, Step, StoreCall, Verdict};
use crate::config::{InFlightPolicy, StoreTransport};
use crate::host::Host;
use crate::outcome::Outcome;
use crate::plugin::waits::{HoldTicket, WaitEnd, Waiter};
use crate::problem::Problem;
use crate::rule_handle::RuleHandle;
use crate::store::client as store_client;
use idempotency_protocol::naming::Digest;

/// Where a duplicate waits for the first request's end to show.
#[derive(Clone, Copy)]
enum WaitPlace {
    LocalTable,
    Store,
}

/// A duplicate about to be held: what it waits for, and until when.
struct Duplicate {
    rule: Rc<RuleHandle>,
    key: Digest,
    fingerprint: Digest,
    deadline_ms: u64,
}

impl RequestJourney {
    /// The key is in flight in the local table: 409 now, or (wait mode) hold this request
    /// until the first ends.
    pub(super) fn on_in_flight(
        &self,
        host: &impl Host,
        rule: Rc<RuleHandle>,
        key: Digest,
        fingerprint: Digest,
    ) -> Step {
        self.hold_or_conflict(host, rule, key, fingerprint, WaitPlace::LocalTable)
    }

    /// Cluster mode: the store says another request with the key is in flight (it runs on
    /// another replica). 409 now, or (wait mode) wait on the store for it to end.
    pub(super) fn on_store_in_flight(
        &self,
        host: &impl Host,
        rule: Rc<RuleHandle>,
        key: Digest,
        fingerprint: Digest,
    ) -> Step {
        self.hold_or_conflict(host, rule, key, fingerprint, WaitPlace::Store)
    }

    fn hold_or_conflict(
        &self,
        host: &impl Host,
        rule: Rc<RuleHandle>,
        key: Digest,
        fingerprint: Digest,
        place: WaitPlace,
    ) -> Step {
        if let Some(duplicate) = self.may_hold(host, &rule, key, fingerprint) {
            let held = match place {
                WaitPlace::LocalTable => self.wait_locally(duplicate),
                WaitPlace::Store => self.wait_on_store(host, duplicate),
            };
            if let Some(step) = held {
                self.note(host, &rule, Outcome::Waited);
                return step;
            }
        }
        self.note(host, &rule, Outcome::Conflict);
        self.answer_problem(host, &rule, &Problem::in_flight())
    }

    /// A duplicate to hold, if its rule waits and the root can reach this request.
    fn may_hold(
        &self,
        host: &impl Host,
        rule: &Rc<RuleHandle>,
        key: Digest,
        fingerprint: Digest,
    ) -> Option<Duplicate> {
        let waits = rule.rule.on_in_flight == InFlightPolicy::Wait
            && self.journeys.is_live(self.context_id);
        waits.then(|| Duplicate {
            rule: Rc::clone(rule),
            key,
            fingerprint,
            deadline_ms: host.now_ms().saturating_add(rule.rule.wait_ms),
        })
    }

    /// Holds the duplicate among the worker's local waits; None when the worker's budget for
    /// held duplicates is spent.
    fn wait_locally(&self, d: Duplicate) -> Option<Step> {
        let ticket = self.hold_ticket(&d)?;
        let waiter = Waiter {
            rule: Rc::clone(&d.rule),
            key: d.key,
            fingerprint: d.fingerprint,
            deadline_ms: d.deadline_ms,
            context_id: self.context_id,
            ticket,
        };
        self.plugin.waits.hold(waiter);
        Some(self.held(d, None))
    }

    /// A place among the worker's held duplicates for this request.
    fn hold_ticket(&self, d: &Duplicate) -> Option<HoldTicket> {
        let ticket = self.plugin.waits.ticket(self.held_bytes.get());
        if ticket.is_none() {
            log::debug!(
                "rule {}: the worker holds as many duplicates as it may; answering 409",
                d.rule.rule.name
            );
        }
        ticket
    }

    /// Sends the duplicate's wait to the store, for what is left of its time; None when the
    /// rule has no store stream, the worker's store waits are full, or the send failed.
    fn wait_on_store(&self, host: &impl Host, d: Duplicate) -> Option<Step> {
        let over_stream = d
            .rule
            .store
            .as_ref()
            .is_some_and(|s| s.transport == StoreTransport::Grpc);
        let left_ms = d.deadline_ms.saturating_sub(host.now_ms());
        if !over_stream || left_ms == 0 {
            return None;
        }
        let ticket = self.hold_ticket(&d)?;
        let call = store_client::wait_call(&d.key, &d.fingerprint, left_ms);
        match self.send_on_stream(host, &d.rule, call) {
            Ok(StoreCall::Stream(id)) => Some(self.held(d, Some((id, ticket)))),
            Ok(StoreCall::Callout(_)) | Err(_) => None,
        }
    }

    fn held(&self, d: Duplicate, store_wait: Option<(u64, HoldTicket)>) -> Step {
        let held = HeldDuplicate {
            rule: d.rule,
            key: d.key,
            fingerprint: d.fingerprint,
            deadline_ms: d.deadline_ms,
            store_wait,
        };
        (Journey::Waiting(held), Verdict::Pause)
    }

    /// The client of a held duplicate left: nothing is answered, nothing kept.
    pub(super) fn abandon_wait(&self, held: HeldDuplicate) -> Step {
        match &held.store_wait {
            Some((id, _)) => {
                if let Some(link) = self.plugin.link_for(&held.rule) {
                    link.forget(*id);
                }
            }
            None => self.plugin.waits.withdraw(self.context_id),
        }
        (Journey::Finished, Verdict::Continue)
    }

    pub(super) fn on_wait_over(&self, host: &impl Host, held: HeldDuplicate, end: WaitEnd) -> Step {
        let rule = Rc::clone(&held.rule);
        match end {
            WaitEnd::Completed(recorded) => {
                self.replay(host, &rule, &recorded, Outcome::ReplayedAfterWait)
            }
            WaitEnd::TimedOut => {
                self.note(host, &rule, Outcome::WaitTimedOut);
                self.answer_problem(host, &rule, &Problem::in_flight())
            }
            // Cluster mode, a local wait: the local claim may have been a request that only
            // confirmed with the store, not the first. The store knows.
            WaitEnd::Released if held.store_wait.is_none() && rule.store.is_some() => {
                let duplicate = Duplicate {
                    rule: Rc::clone(&rule),
                    key: held.key,
                    fingerprint: held.fingerprint,
                    deadline_ms: held.deadline_ms,
                };
                match self.wait_on_store(host, duplicate) {
                    Some(step) => step,
                    None => self.on_wait_over(host, held, WaitEnd::TimedOut),
                }
            }
            WaitEnd::Released => {
                self.note(host, &rule, Outcome::WaitReleased);
                self.answer_problem(host, &rule, &Problem::first_attempt_released())
            }
            WaitEnd::Mismatch => {
                self.note(host, &rule, Outcome::Mismatch);
                self.answer_problem(host, &rule, &Problem::key_reused(&rule.key_label()))
            }
        }
    }
}

//! A duplicate held while the first request with its key runs (`on_in_flight: "wait"`),
//! and how its wait ends: the first's response replayed, 409 when `wait_ms` passes, a
//! retry-able 503 when the first was released, 422 when another payload took the key.

use std::rc::Rc;

use super::claim::send_replay;
use super::{Journey, RequestJourney, Step, Verdict};
use crate::config::InFlightPolicy;
use crate::host::Host;
use crate::key::Digest;
use crate::outcome::Outcome;
use crate::plugin::rule_handle::RuleHandle;
use crate::plugin::waits::{WaitEnd, Waiter};
use crate::problem::Problem;

impl RequestJourney {
    /// The key is in flight: 409 now, or (wait mode) hold this request until the first ends.
    pub(super) fn on_in_flight(
        &self,
        host: &impl Host,
        rule: Rc<RuleHandle>,
        key: Digest,
        fingerprint: Digest,
    ) -> Step {
        if rule.rule.on_in_flight == InFlightPolicy::Wait && self.me.strong_count() > 0 {
            let waiter = Waiter {
                rule: Rc::clone(&rule),
                key,
                fingerprint,
                deadline_ms: host.now_ms().saturating_add(rule.rule.wait_ms),
                context_id: self.context_id,
                journey: self.me.clone(),
            };
            match self.plugin.waits.hold(waiter) {
                Ok(()) => {
                    self.note(host, &rule, Outcome::Waited);
                    return (Journey::Waiting(rule), Verdict::Pause);
                }
                Err(_) => log::debug!(
                    "rule {}: too many held duplicates on this worker; answering 409",
                    rule.rule.name
                ),
            }
        }
        self.note(host, &rule, Outcome::Conflict);
        self.answer_problem(host, &rule, &Problem::in_flight())
    }

    pub(super) fn on_wait_over(&self, host: &impl Host, rule: &RuleHandle, end: WaitEnd) -> Step {
        match end {
            WaitEnd::Completed(recorded) => {
                self.note(host, rule, Outcome::ReplayedAfterWait);
                send_replay(host, rule, &recorded)
            }
            WaitEnd::TimedOut => {
                self.note(host, rule, Outcome::WaitTimedOut);
                self.answer_problem(host, rule, &Problem::in_flight())
            }
            WaitEnd::Released => {
                self.note(host, rule, Outcome::WaitReleased);
                self.answer_problem(host, rule, &Problem::first_attempt_released())
            }
            WaitEnd::Mismatch => {
                self.note(host, rule, Outcome::Mismatch);
                self.answer_problem(host, rule, &Problem::key_reused(&rule.key_label()))
            }
        }
    }
}

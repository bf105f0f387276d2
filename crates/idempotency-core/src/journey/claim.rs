//! Claiming the key, locally and (cluster mode) in the store, and acting on the answer:
//! execute, replay, or answer 409, 422 or 503.

use std::rc::Rc;

use idempotency_protocol::stream::CallOp;

use super::NO_ROUTER_RETRIES;
use super::{
    access_log, pass, running_claim, send_response, Execution, Journey, RequestJourney, Step,
    StoreCall, StoreOwner, StoreWait, Verdict,
};
use crate::config::{OverloadPolicy, StoreErrorPolicy, StoreTransport};
use crate::host::Host;
use crate::outcome::Outcome;
use crate::plugin::resolutions::Resolution;
use crate::problem::Problem;
use crate::rule_handle::RuleHandle;
use crate::store::calls::{self, StoreAnswer, StoreOp};
use crate::store::client::{self as store_client, read_claim, StoreClaim, StoreFailure};
use crate::store::link::{ClaimWaiter, Waiter};
use crate::table::{Claim, Held, OversizedBody, SlotRef, Unlanded};
use idempotency_protocol::naming::Digest;
use idempotency_protocol::record::{RecordedResponse, UnknownOutcome};

impl RequestJourney {
    /// The key and payload are known: claim the key and act on the answer.
    pub(super) fn claim(
        &self,
        host: &impl Host,
        rule: Rc<RuleHandle>,
        key: Digest,
        fingerprint: Digest,
    ) -> Step {
        let plugin = &self.plugin;
        if plugin.config.access_log_fields {
            access_log::publish_key(host, &key);
        }
        let owner = plugin.owners.next();
        let now = host.now_ms();
        let name = &rule.rule.name;
        if now == 0 {
            // The host's clock failed: a claim made now would be born expired (and so would
            // its record), free for the next retry to run again. Refuse instead.
            log::error!("rule {name}: the host clock is unavailable; claim refused");
            self.note(host, &rule, Outcome::TableError);
            let problem = Problem::unavailable("the proxy's clock is unavailable");
            return self.answer_problem(host, &rule, &problem);
        }
        let catch_up = || plugin.upkeep.before_new_claim(host, &plugin.table, now);
        match plugin.table.claim(
            host,
            &key,
            &fingerprint,
            owner,
            now,
            rule.rule.lease_ms,
            catch_up,
        ) {
            Ok(Claim::Claimed(held)) => {
                if held.took_over {
                    log::warn!("rule {name}: took over a claim whose lease had passed");
                    self.note(host, &rule, Outcome::TakenOver);
                }
                if let Some(evicted) = held.evicted {
                    self.note(host, &rule, Outcome::Evicted);
                    plugin.retention.on_eviction(host, now, evicted.age_ms);
                }
                self.confirm_or_execute(host, rule, held)
            }
            // Cluster mode: the local table is only a cache of the store, so when it cannot
            // take the claim (every slot of the bucket in flight, or a host error) the
            // store's claim alone guards the key: no 503 for local pressure.
            Ok(Claim::Full { kept_for_store }) if rule.store.is_some() => {
                self.note(host, &rule, Outcome::TableFull);
                if kept_for_store {
                    self.note(host, &rule, Outcome::KeptForStore);
                }
                let held = Held::unheld(key, fingerprint, owner);
                self.confirm_or_execute(host, rule, held)
            }
            Err(e) if rule.store.is_some() => {
                log::warn!("rule {name}: local claim failed, the store alone guards the key: {e}");
                self.note(host, &rule, Outcome::TableError);
                let held = Held::unheld(key, fingerprint, owner);
                self.confirm_or_execute(host, rule, held)
            }
            Ok(Claim::InFlight { .. }) => self.on_in_flight(host, rule, key, fingerprint),
            Ok(Claim::Mismatch) => {
                self.note(host, &rule, Outcome::Mismatch);
                self.answer_problem(host, &rule, &Problem::key_reused(&rule.key_label()))
            }
            Ok(Claim::Completed {
                slot,
                owner: recorded_by,
                status,
                recorded_at_ms,
                awaiting_store,
            }) => match self.load_recorded(host, &rule, slot, recorded_by) {
                // Cluster mode: an unknown outcome here is only this proxy's copy, and the
                // store may have settled it since (a resolution, an operator): ask the store,
                // unless the store never got it, which its answer must not be taken for.
                Some(recorded) if recorded.unknown.is_some() && rule.store.is_some() => {
                    let unlanded = awaiting_store
                        .then(|| Unlanded::new(recorded, key, fingerprint, slot, recorded_by));
                    let held = Held {
                        completed_status: Some(0),
                        unlanded,
                        ..Held::unheld(key, fingerprint, owner)
                    };
                    self.confirm_or_execute(host, rule, held)
                }
                Some(recorded) if rule.rule.only_tombstone_at(&recorded, recorded_at_ms, now) => {
                    // Past the TTL the record is only kept as its tombstone.
                    let tombstone = recorded.without_body();
                    self.replay(host, &rule, &tombstone, Outcome::ReplayedTombstone)
                }
                // Cluster mode: kept here without its body only until the store held it
                // (it fit no page); the store has the whole response.
                Some(recorded)
                    if recorded.body_omitted && rule.store.is_some() && !awaiting_store =>
                {
                    let held = Held {
                        completed_status: Some(status),
                        ..Held::unheld(key, fingerprint, owner)
                    };
                    self.confirm_or_execute(host, rule, held)
                }
                Some(recorded) => self.replay(host, &rule, &recorded, Outcome::Replayed),
                // Cluster mode: the local copy is gone (its page was reused), the store
                // still has the whole response.
                None if rule.store.is_some() => {
                    // An unknown outcome's mark (status 0); a response's is told by its status.
                    let unlanded = (awaiting_store && status == 0).then(|| {
                        // Only the mark survived: what goes to the store in its place still
                        // says it is to be resolved (from now), so that a replica's retry can
                        // take it on once overdue; the worker that made it cannot settle it
                        // any more (its bytes differ).
                        let due = rule.rule.resolve.is_some().then_some(now);
                        let record = RecordedResponse::unknown_outcome(UnknownOutcome {
                            resolution_due_ms: due,
                            ..UnknownOutcome::default()
                        });
                        Unlanded::new(record, key, fingerprint, slot, recorded_by)
                    });
                    let held = Held {
                        completed_status: Some(status),
                        unlanded,
                        ..Held::unheld(key, fingerprint, owner)
                    };
                    self.confirm_or_execute(host, rule, held)
                }
                None => {
                    // Only the status survived: replay it with the omitted-body marker
                    // rather than execute again.
                    let recorded = RecordedResponse::status_only(status);
                    self.replay(host, &rule, &recorded, Outcome::Replayed)
                }
            },
            Ok(Claim::Full { .. }) => {
                // Logged once per burst: a full table means heavy load already.
                if let Some(suppressed) = plugin.table_full_log.borrow_mut().admit(now) {
                    log::warn!(
                        "rule {name}: local table has no free slot for a new key \
                         ({suppressed} similar rejections not logged)"
                    );
                }
                self.note(host, &rule, Outcome::TableFull);
                self.overloaded(host, &rule, Problem::table_full())
            }
            Err(e) => {
                log::error!("rule {name}: claim failed: {e}");
                self.note(host, &rule, Outcome::TableError);
                let problem = Problem::unavailable("the proxy's idempotency table is unavailable");
                self.overloaded(host, &rule, problem)
            }
        }
    }

    /// Cluster mode: asks the store to confirm the claim; otherwise executes.
    fn confirm_or_execute(&self, host: &impl Host, rule: Rc<RuleHandle>, held: Held) -> Step {
        let Some(store) = rule.store.clone() else {
            return self.execute(host, rule, held, None);
        };
        let owner = store_client::store_owner(held.owner, host.now_nanos());
        let call =
            store_client::claim_call(&held.key, &held.fingerprint, rule.rule.lease_ms, &owner);
        let sent = match store.transport {
            StoreTransport::Grpc => self.send_on_stream(host, &rule, call),
            StoreTransport::Http => {
                let body = store_client::http_body(&call);
                calls::send(host, &store, StoreOp::Claim, &body)
                    .map(StoreCall::Callout)
                    .map_err(|e| e.0)
            }
        };
        match sent {
            // Resumed (or answered) when the store replies.
            Ok(call) => (
                Journey::AwaitingStore(StoreWait {
                    rule,
                    held,
                    call,
                    owner,
                }),
                Verdict::Pause,
            ),
            Err(why) => {
                let failure = StoreFailure::NotSent(why);
                self.store_failed(host, rule, held, None, &failure)
            }
        }
    }

    /// Sends the claim on the worker's stream to the store; the root hands this request the
    /// answer (or the failure) when it comes.
    pub(super) fn send_on_stream(
        &self,
        host: &impl Host,
        rule: &Rc<RuleHandle>,
        call: CallOp,
    ) -> Result<StoreCall, String> {
        let plugin = &self.plugin;
        let link = plugin
            .link_for(rule)
            .ok_or_else(|| "no stream serves this rule's store".to_string())?;
        let waiter = Waiter::Claim(ClaimWaiter {
            call_id: 0,
            context_id: self.context_id,
            rule: Rc::clone(rule),
            call,
        });
        let sent = link.send(host, plugin.root_context.get(), self.context_id, waiter);
        if link.has_waiting() {
            // The claim waits for a stream: the root opens one when it wakes.
            plugin.writes.wake_root(host);
        }
        sent.map(StoreCall::Stream).map_err(|unsent| unsent.why)
    }

    /// A claim callout's answer, read.
    pub(super) fn read_callout_claim(
        &self,
        host: &impl Host,
        num_headers: usize,
        body_size: usize,
    ) -> Result<StoreClaim, StoreFailure> {
        let StoreAnswer { status, body } = calls::read_answer(host, num_headers, body_size);
        read_claim(status, &body)
    }

    /// The store answered the claim (or failed to).
    pub(super) fn on_store_claim(
        &self,
        host: &impl Host,
        wait: StoreWait,
        answer: Result<StoreClaim, StoreFailure>,
    ) -> Step {
        let StoreWait {
            rule, held, owner, ..
        } = wait;
        if answer.is_ok() {
            self.plugin.writes.store_answered();
        }
        match answer {
            Ok(StoreClaim::Claimed { owner }) => {
                let confirmed = StoreOwner {
                    token: owner,
                    confirmed: true,
                };
                if let Some(unlanded) = &held.unlanded {
                    // The key is free in the store because this proxy's unknown outcome never
                    // reached it (its completion waits out an outage on some worker, was
                    // dropped, or was never sent): the write may have run, so it never runs
                    // again. Told as before, and recorded in the store under this claim.
                    let Unlanded {
                        record,
                        recorded_by,
                    } = &**unlanded;
                    self.submit_unlanded(host, &rule, recorded_by, &confirmed, record);
                    return self.replay(host, &rule, record, Outcome::Replayed);
                }
                // An unknown outcome this proxy recorded, whose record the store took, and
                // the key is free there now: settled as never run, purged, or expired. The
                // store decides, as it does for every replica.
                let freed_in_store = held.completed_status == Some(0);
                if let (Some(status), false) = (held.completed_status, freed_in_store) {
                    // This proxy recorded the write itself (only its body is gone here, or it
                    // is an unknown outcome), and its completion has not reached the store yet
                    // while the store's claim lapsed: never run it again. Replay what it kept,
                    // and record that in the store under the claim it just got.
                    let kept = RecordedResponse::status_only(status);
                    self.submit_store_completion(host, &rule, &held, &confirmed, &kept);
                    return self.replay(host, &rule, &kept, Outcome::Replayed);
                }
                self.execute(host, rule, held, Some(confirmed))
            }
            Ok(StoreClaim::InFlight) => {
                self.release_local(host, &held);
                self.on_store_in_flight(host, rule, held.key, held.fingerprint)
            }
            Ok(StoreClaim::Mismatch) => {
                self.release_local(host, &held);
                self.note(host, &rule, Outcome::Mismatch);
                self.answer_problem(host, &rule, &Problem::key_reused(&rule.key_label()))
            }
            Ok(StoreClaim::Completed(recorded)) if recorded.unknown.is_some() => {
                // An unknown outcome: the store may settle it (a proxy resolving it, an
                // operator), and a local copy would go on answering 409 here after that, so
                // none is kept: the next retry asks the store again.
                self.release_local(host, &held);
                self.adopt_resolution(host, &rule, &held, &recorded);
                self.replay(host, &rule, &recorded, Outcome::Replayed)
            }
            Ok(StoreClaim::Completed(recorded)) => {
                // Keep a local copy so this proxy's next retry replays without a callout.
                if let Err(e) = self.plugin.table.complete(
                    host,
                    &held,
                    &recorded,
                    host.now_ms(),
                    rule.rule.ttl_ms,
                    OversizedBody::LeaveToStore,
                ) {
                    log::warn!(
                        "rule {}: store record not cached locally: {e}",
                        rule.rule.name
                    );
                }
                self.replay(host, &rule, &recorded, Outcome::Replayed)
            }
            Err(failure) => {
                let sent = failure.may_have_been_applied().then_some(owner);
                self.store_failed(host, rule, held, sent, &failure)
            }
        }
    }

    /// The client left while the store was confirming: free the key here and (should the
    /// store have applied it) in the store.
    pub(super) fn abandon_store_wait(&self, host: &impl Host, wait: StoreWait) -> Step {
        if let StoreCall::Stream(id) = wait.call {
            // Nobody is left to take the answer.
            if let Some(link) = self.plugin.link_for(&wait.rule) {
                link.forget(id);
            }
        }
        self.release_local(host, &wait.held);
        let call = store_client::release_call(&wait.held.key, &wait.owner);
        self.submit_store_release(host, &wait.rule, false, call);
        (Journey::Finished, Verdict::Continue)
    }

    /// The store could not confirm the claim: the rule's policy decides. `sent_owner` is the
    /// owner of a claim the store may have applied although its answer was lost.
    fn store_failed(
        &self,
        host: &impl Host,
        rule: Rc<RuleHandle>,
        held: Held,
        sent_owner: Option<String>,
        failure: &StoreFailure,
    ) -> Step {
        self.note(host, &rule, Outcome::StoreError);
        let policy = rule.rule.on_store_error;
        if let Some(suppressed) = self.plugin.store_failures.borrow_mut().admit(host.now_ms()) {
            log::warn!(
                "store unavailable for a claim: {failure}; applying {policy:?} \
                 ({suppressed} similar failures not logged)"
            );
        }
        if let Some(status) = held.completed_status {
            // This proxy recorded the write itself: replay what it kept, whatever the
            // policy, rather than run it again or refuse it.
            let recorded = RecordedResponse::status_only(status);
            return self.replay(host, &rule, &recorded, Outcome::Replayed);
        }
        if let StoreFailure::UnreadableRecord(_) = failure {
            // The key is taken in the store, by a record this proxy cannot read: whatever
            // the policy, the write must not run on it again.
            self.release_local(host, &held);
            let problem =
                Problem::unavailable("the idempotency store holds a record this proxy cannot read");
            return self.answer_problem(host, &rule, &problem);
        }
        // Fail-open runs the write on the local claim alone; without one (every slot of
        // its bucket in flight) the table-full policy decides instead.
        let table_full_rejects = held.slot.is_none()
            && policy == StoreErrorPolicy::FailOpen
            && rule.rule.on_table_full == OverloadPolicy::Reject;
        let policy = if table_full_rejects {
            StoreErrorPolicy::FailClosed
        } else {
            policy
        };
        match policy {
            StoreErrorPolicy::FailClosed => {
                self.release_local(host, &held);
                if let Some(owner) = sent_owner {
                    // The store may have applied the claim after the timeout: release it, or
                    // the key would answer 409 everywhere until the lease ends.
                    let call = store_client::release_call(&held.key, &owner);
                    self.submit_store_release(host, &rule, false, call);
                }
                let problem = if table_full_rejects {
                    Problem::table_full()
                } else {
                    Problem::unavailable("the idempotency store could not be reached")
                };
                self.answer_problem(host, &rule, &problem)
            }
            StoreErrorPolicy::FailOpen => {
                // The local claim still guards this proxy's own retries; if the store did
                // apply the claim, completing it with the same owner records it cluster-wide.
                // A claim never sent still completes, under an owner the store never saw: once
                // the store is back, the record lands there if the key is still free, so
                // other replicas see it, and this proxy's record may give way to eviction.
                self.note(host, &rule, Outcome::StoreFailOpen);
                let token = sent_owner
                    .unwrap_or_else(|| store_client::store_owner(held.owner, host.now_nanos()));
                let owner = StoreOwner {
                    token,
                    confirmed: false,
                };
                self.execute(host, rule, held, Some(owner))
            }
        }
    }

    /// Sends the request upstream holding the claim.
    fn execute(
        &self,
        host: &impl Host,
        rule: Rc<RuleHandle>,
        held: Held,
        store_owner: Option<StoreOwner>,
    ) -> Step {
        self.note(host, &rule, Outcome::Executed);
        let store_claim = store_owner
            .as_ref()
            .filter(|o| o.confirmed)
            .map(|o| o.token.clone());
        let run = Execution {
            rule: Rc::clone(&rule),
            held: held.clone(),
            store_owner,
            capture: None,
            started_ms: host.now_ms(),
            proxy_words: None,
        };
        let step = if rule.rule.detached.is_some() {
            self.detach(host, run)
        } else {
            cap_router_retries(host, &rule);
            (Journey::Executing(run), Verdict::Continue)
        };
        // Leased only once it runs: a detached write refused for lack of room never does,
        // and its freed key must not be renewed (nor counted lost) afterwards.
        if running_claim(&step.0).is_some() {
            self.plugin
                .leases
                .begin(&rule, &held, store_claim, host.now_ms());
        }
        step
    }

    pub(super) fn release_local(&self, host: &impl Host, held: &Held) {
        if let Err(e) = self.plugin.table.release(host, held) {
            log::error!("local claim not released, it expires with its lease: {e}");
        }
    }

    /// Answers a retry from what the first request left: its recorded response (counted as
    /// `outcome`), or, when its outcome is unknown, the problem that says so.
    pub(super) fn replay(
        &self,
        host: &impl Host,
        rule: &Rc<RuleHandle>,
        recorded: &RecordedResponse,
        outcome: Outcome,
    ) -> Step {
        if let Some(unknown) = &recorded.unknown {
            self.note(host, rule, Outcome::OutcomeUnknownAnswered);
            let problem = match (unknown.resolution_due_ms, &rule.rule.resolve) {
                (Some(due_ms), Some(resolve)) => {
                    // Before the lookup is due, until then; once it is being asked (or asked
                    // again), after the shortest backoff.
                    let wait_ms = match due_ms.checked_sub(host.now_ms()) {
                        Some(left) if left > 0 => left,
                        _ => resolve.backoff_ms,
                    };
                    Problem::outcome_being_resolved(wait_ms.div_ceil(1000))
                }
                _ => Problem::outcome_unknown(),
            };
            return self.answer_problem(host, rule, &problem);
        }
        self.note(host, rule, outcome);
        if rule.rule.grpc.is_some() {
            return self.replay_grpc(host, rule, recorded);
        }
        send_response(host, rule, recorded, true)
    }

    /// An unknown outcome whose resolution is overdue in the store (the proxy resolving it
    /// died or restarted, or lost the store): this proxy takes it on, once the store lets it
    /// (the resolution first claims the record, `plugin::resolutions`, so one proxy asks at a
    /// time), with the lookup this retry carries, which is the first attempt's: its path and
    /// host come only from the key and the scope headers (`resolve::settings` refuses anything
    /// else), and the record this retry met is named by a hash of exactly those.
    fn adopt_resolution(
        &self,
        host: &impl Host,
        rule: &Rc<RuleHandle>,
        held: &Held,
        recorded: &RecordedResponse,
    ) {
        let (Some(resolve), Some(unknown)) = (&rule.rule.resolve, &recorded.unknown) else {
            return;
        };
        let Some(due_ms) = unknown.resolution_due_ms else {
            return;
        };
        let now = host.now_ms();
        let resolutions = &self.plugin.resolutions;
        if now < due_ms.saturating_add(resolve.adopt_after_ms()) || resolutions.resolving(&held.key)
        {
            return;
        }
        let Some(lookup) = self.lookup.borrow_mut().take() else {
            return;
        };
        let resolution = Resolution::new(
            Rc::clone(rule),
            held.clone(),
            lookup,
            (**unknown).clone(),
            now,
        );
        resolutions.take_on(host, &self.plugin.table, resolution, true);
    }

    /// The local table cannot take the claim: reject with `problem`, or pass unprotected.
    fn overloaded(&self, host: &impl Host, rule: &RuleHandle, problem: Problem) -> Step {
        match rule.rule.on_table_full {
            OverloadPolicy::Reject => self.answer_problem(host, rule, &problem),
            OverloadPolicy::PassThrough => {
                self.note(host, rule, Outcome::PassedThrough);
                pass()
            }
        }
    }

    /// The response recorded in `slot`; None when it is gone (a host error, the slot
    /// rewritten between reads, or its page reused by newer responses).
    fn load_recorded(
        &self,
        host: &impl Host,
        rule: &RuleHandle,
        slot: SlotRef,
        recorded_by: u64,
    ) -> Option<RecordedResponse> {
        match self.plugin.table.load_response(host, slot, recorded_by) {
            Ok(found) => found,
            Err(e) => {
                log::error!(
                    "rule {}: recorded response unreadable: {}",
                    rule.rule.name,
                    e.0
                );
                None
            }
        }
    }
}

/// A protected write goes upstream once: the router must not resend one that may have
/// reached the upstream (a per-try timeout, a reset); its retries are this filter's to
/// answer. The header caps the route's retry policy (a filter-set `x-envoy-retry-on` would
/// only add conditions). Set only on the way upstream: a replay or a refusal never needs it.
/// The request is still held here, so its headers can still be changed.
fn cap_router_retries(host: &impl Host, rule: &RuleHandle) {
    if let Err(e) = host.replace_request_header(NO_ROUTER_RETRIES, b"0") {
        log::warn!(
            "rule {}: {NO_ROUTER_RETRIES} not set ({}); a route retry policy may resend the write",
            rule.rule.name,
            e.0
        );
    }
}

//! Claiming the key, locally and (cluster mode) in the store, and acting on the answer:
//! execute, replay, or answer 409, 422 or 503.

use std::rc::Rc;

use idempotency_core::config::{OverloadPolicy, Rule, StoreErrorPolicy};
use idempotency_core::key::Digest;
use idempotency_core::outcome::Outcome;
use idempotency_core::problem::Problem;
use idempotency_core::record::RecordedResponse;
use idempotency_core::store_client::{self, read_claim, StoreClaim, StoreFailure};
use idempotency_core::table::{Claim, Held, SlotRef};
use proxy_wasm::types::Action;

use crate::host;
use crate::http_filter::{key_label, Journey, RequestFilter, StoreOwner};
use crate::shared_table::EnvoySharedData;
use crate::store_calls::{self, StoreOp};

impl RequestFilter {
    /// The key and payload are known: claim the key and act on the answer.
    pub(crate) fn claim(&mut self, rule_index: usize, key: Digest, fingerprint: Digest) -> Action {
        let state = Rc::clone(&self.state);
        let Some(rule) = state.config.rules.get(rule_index) else {
            return Action::Continue;
        };
        let owner = state.owners.next();
        let now = host::now_ms();
        state.upkeep.before_claim(&state.table, now);
        match state.table.claim(
            &EnvoySharedData,
            &key,
            &fingerprint,
            owner,
            now,
            rule.lease_ms,
        ) {
            Ok(Claim::Claimed(held)) => {
                if held.took_over {
                    log::warn!(
                        "rule {}: took over a claim whose lease had passed",
                        rule.name
                    );
                    self.count(rule_index, Outcome::TakenOver);
                }
                match state.stores.get(rule_index).and_then(Option::as_ref) {
                    Some(store) => {
                        let owner = store_client::store_owner(held.owner, host::now_nanos(), &key);
                        let body =
                            store_client::claim_body(&key, &fingerprint, rule.lease_ms, &owner);
                        match store_calls::send(store, StoreOp::Claim, &body) {
                            Ok(token) => {
                                self.journey = Journey::AwaitingStore {
                                    rule: rule_index,
                                    held,
                                    token,
                                    owner,
                                };
                                // Resumed (or answered) when the store replies.
                                Action::Pause
                            }
                            Err(status) => self.store_failed(
                                rule_index,
                                held,
                                None,
                                &StoreFailure::NotSent(status.to_string()),
                            ),
                        }
                    }
                    None => self.execute(rule_index, held, None),
                }
            }
            Ok(Claim::InFlight { .. }) => {
                self.count(rule_index, Outcome::Conflict);
                self.answer_problem(rule_index, &Problem::in_flight())
            }
            Ok(Claim::Mismatch) => {
                self.count(rule_index, Outcome::Mismatch);
                self.answer_problem(rule_index, &Problem::key_reused(&key_label(rule)))
            }
            Ok(Claim::Completed {
                slot,
                owner,
                status,
            }) => {
                self.count(rule_index, Outcome::Replayed);
                self.replay(rule, slot, owner, status)
            }
            Ok(Claim::Full) => {
                // Logged once per burst: a full table means heavy load already.
                if let Some(suppressed) = state.table_full_log.borrow_mut().admit(now) {
                    log::warn!(
                        "rule {}: local table has no free slot for a new key \
                         ({suppressed} similar rejections not logged)",
                        rule.name
                    );
                }
                self.count(rule_index, Outcome::TableFull);
                self.overloaded(rule_index, rule.on_table_full, Problem::table_full())
            }
            Err(e) => {
                log::error!("rule {}: claim failed: {e}", rule.name);
                self.count(rule_index, Outcome::TableError);
                let problem = Problem::unavailable("the proxy's idempotency table is unavailable");
                self.overloaded(rule_index, rule.on_table_full, problem)
            }
        }
    }

    /// Sends the request upstream holding the claim.
    fn execute(
        &mut self,
        rule_index: usize,
        held: Held,
        store_owner: Option<StoreOwner>,
    ) -> Action {
        self.count(rule_index, Outcome::Executed);
        self.journey = Journey::Executing {
            rule: rule_index,
            held,
            store_owner,
            capture: None,
        };
        Action::Continue
    }

    /// The store answered a claim (or failed to).
    pub(crate) fn on_store_claim_answer(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) {
        let Journey::AwaitingStore {
            rule,
            held,
            token: expected,
            owner: sent_owner,
        } = std::mem::replace(&mut self.journey, Journey::Untouched)
        else {
            return;
        };
        if token != expected {
            self.journey = Journey::AwaitingStore {
                rule,
                held,
                token: expected,
                owner: sent_owner,
            };
            return;
        }
        let (status, body) = store_calls::read_answer(num_headers, body_size);
        let state = Rc::clone(&self.state);
        let Some(rule_config) = state.config.rules.get(rule) else {
            return;
        };
        let answer = read_claim(status, &body);
        if answer.is_ok() {
            state.writes.store_answered();
        }
        let action = match answer {
            Ok(StoreClaim::Claimed { owner }) => self.execute(
                rule,
                held,
                Some(StoreOwner {
                    token: owner,
                    confirmed: true,
                }),
            ),
            Ok(StoreClaim::InFlight) => {
                self.release_local(&held);
                self.count(rule, Outcome::Conflict);
                self.answer_problem(rule, &Problem::in_flight())
            }
            Ok(StoreClaim::Mismatch) => {
                self.release_local(&held);
                self.count(rule, Outcome::Mismatch);
                self.answer_problem(rule, &Problem::key_reused(&key_label(rule_config)))
            }
            Ok(StoreClaim::Completed(recorded)) => {
                // Keep a local copy so this proxy's next retry replays without a callout.
                if let Err(e) = state.table.complete(
                    &EnvoySharedData,
                    &held,
                    &recorded,
                    host::now_ms(),
                    rule_config.ttl_ms,
                ) {
                    log::warn!(
                        "rule {}: store record not cached locally: {e}",
                        rule_config.name
                    );
                }
                self.count(rule, Outcome::Replayed);
                self.send_replay(rule_config, &recorded)
            }
            Err(failure) => {
                // Without an answer (timeout, reset) or with a server error the store may have
                // applied the claim; a 4xx means it refused it.
                let sent = failure.may_have_been_applied().then_some(sent_owner);
                self.store_failed(rule, held, sent, &failure)
            }
        };
        if action == Action::Continue {
            if let Err(status) = host::resume_request() {
                log::error!("request could not be resumed: {status}");
            }
        }
    }

    /// The store could not confirm the claim: the rule's policy decides. `sent_owner` is the
    /// owner of a claim the store may have applied although its answer was lost.
    fn store_failed(
        &mut self,
        rule_index: usize,
        held: Held,
        sent_owner: Option<String>,
        failure: &StoreFailure,
    ) -> Action {
        self.count(rule_index, Outcome::StoreError);
        let policy = self
            .rule(rule_index)
            .map(|r| r.on_store_error)
            .unwrap_or_default();
        if let Some(suppressed) = self.state.store_failures.borrow_mut().admit(host::now_ms()) {
            log::warn!(
                "store unavailable for a claim: {failure}; applying {policy:?} \
                 ({suppressed} similar failures not logged)"
            );
        }
        match policy {
            StoreErrorPolicy::FailClosed => {
                self.release_local(&held);
                if let Some(owner) = sent_owner {
                    // The store may have applied the claim after the timeout: release it, or
                    // the key would answer 409 everywhere until the lease ends.
                    let body = store_client::release_body(&held.key, &owner);
                    self.submit_store_release(rule_index, false, body);
                }
                self.answer_problem(
                    rule_index,
                    &Problem::unavailable("the idempotency store could not be reached"),
                )
            }
            StoreErrorPolicy::FailOpen => {
                // The local claim still guards this proxy's own retries; if the store did
                // apply the claim, completing it with the same owner records it cluster-wide.
                self.count(rule_index, Outcome::StoreFailOpen);
                let owner = sent_owner.map(|token| StoreOwner {
                    token,
                    confirmed: false,
                });
                self.execute(rule_index, held, owner)
            }
        }
    }

    pub(crate) fn release_local(&self, held: &Held) {
        if let Err(e) = self.state.table.release(&EnvoySharedData, held) {
            log::error!("local claim not released, it expires with its lease: {e}");
        }
    }

    /// The local table cannot take the claim: reject with `problem`, or pass unprotected.
    fn overloaded(
        &mut self,
        rule_index: usize,
        policy: OverloadPolicy,
        problem: Problem,
    ) -> Action {
        match policy {
            OverloadPolicy::Reject => self.answer_problem(rule_index, &problem),
            OverloadPolicy::PassThrough => {
                self.count(rule_index, Outcome::PassedThrough);
                self.journey = Journey::Untouched;
                Action::Continue
            }
        }
    }

    fn replay(&mut self, rule: &Rule, slot: SlotRef, owner: u64, status: u16) -> Action {
        let recorded = match self
            .state
            .table
            .load_response(&EnvoySharedData, slot, owner)
        {
            Ok(Some(r)) => r,
            other => {
                // Only the status survived (a host error, or the slot was rewritten between
                // reads): replay it with the omitted-body marker rather than execute again.
                if let Err(e) = other {
                    log::error!("rule {}: recorded response unreadable: {}", rule.name, e.0);
                }
                RecordedResponse {
                    status,
                    body_omitted: true,
                    ..RecordedResponse::default()
                }
            }
        };
        self.send_replay(rule, &recorded)
    }

    fn send_replay(&mut self, rule: &Rule, recorded: &RecordedResponse) -> Action {
        let mut headers: Vec<(&str, &[u8])> = recorded
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_slice()))
            .collect();
        headers.push((rule.replay_header.as_str(), b"true"));
        if recorded.body_omitted {
            headers.push((rule.body_omitted_header.as_str(), b"true"));
        }
        let action = self.send_local(u32::from(recorded.status), &headers, &recorded.body);
        if recorded.body.is_empty() && action == Action::Pause {
            // Envoy drops content-type from a local reply without a body; the reply passes
            // back through this filter, which puts it back (see response_recording.rs).
            let restore: Vec<(String, Vec<u8>)> = recorded
                .headers
                .iter()
                .filter(|(n, _)| n == "content-type")
                .cloned()
                .collect();
            if !restore.is_empty() {
                self.journey = Journey::Replaying { restore };
            }
        }
        action
    }
}

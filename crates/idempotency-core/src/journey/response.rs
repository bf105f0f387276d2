//! The answer to a request that went upstream. Who gave it decides (`who_answered`): the
//! upstream's own releasing status frees the claim, any other answer of the upstream is
//! copied as it streams to the client and recorded at its end (locally, and through the
//! root's store writes in the store); Envoy's answer to a request that never reached the
//! upstream frees the claim; anything else (a timeout, a reset after the request was sent,
//! a client that left) is an unknown outcome, recorded so that no retry runs it again.

use super::NO_ROUTER_RETRIES;
use super::{Execution, Journey, RequestJourney, Step, StoreOwner, Verdict};
use crate::capture::ResponseCapture;
use crate::config::{GatewayErrorPolicy, UnknownOutcomePolicy};
use crate::gave_up::{self, Judgement};
use crate::host::{status_of, Host};
use crate::outcome::Outcome;
use crate::rule_handle::RuleHandle;
use idempotency_protocol::stream::CallOp;

use crate::plugin::resolutions::Resolution;
use crate::store::client as store_client;
use crate::store::writes::{LeanRecord, PendingWrite};
use crate::table::{Completion, Held, OversizedBody, StoreCopy};
use crate::who_answered::{flag_names, Answerer, EnvoyReport};
use idempotency_protocol::record::{key_expires_value, RecordedResponse, KEY_EXPIRES_HEADER};

use std::rc::Rc;

impl RequestJourney {
    pub(super) fn on_response_headers(
        &self,
        host: &impl Host,
        run: Execution,
        end_of_stream: bool,
    ) -> Step {
        let rule = &run.rule;
        let headers = match host.response_headers() {
            Ok(h) => h,
            Err(e) => {
                log::error!(
                    "rule {}: response headers unreadable: {}",
                    rule.rule.name,
                    e.0
                );
                // Who answered is still known to Envoy; what the status was is not.
                let report = EnvoyReport::read(host, 0);
                return match report.answerer() {
                    Answerer::NeverReached => self.never_reached(host, run, &report),
                    Answerer::Upstream { .. } | Answerer::Unknown => {
                        self.unknown_outcome(host, run, &report)
                    }
                };
            }
        };
        let status = status_of(&headers).unwrap_or(0);
        let report = EnvoyReport::read(host, status);
        let mut proxy_words = None;
        match report.answerer() {
            Answerer::Upstream { resent } => {
                if resent {
                    self.note_resent(host, rule, &report);
                }
                if !resent
                    && status != 0
                    && !report.is_direct_response()
                    && judges_gateway_errors(rule, &headers)
                {
                    let judged = grpc_status_in_headers(rule, status, &headers)
                        .or_else(|| gave_up::of_headers(status, &headers))
                        .or_else(|| end_of_stream.then(|| gave_up::of_words(status, b"", true))?);
                    match judged {
                        Some(Judgement::GaveUp(reason)) => {
                            let report = report.gave_up_behind(reason);
                            return self.unknown_outcome(host, run, &report);
                        }
                        Some(Judgement::NeverSent | Judgement::ServiceAnswer) => {}
                        // Judged once the proxy's words are in; the key stays held meanwhile.
                        None => proxy_words = Some(Vec::new()),
                    }
                }
                if proxy_words.is_some() {
                    // Neither released nor recorded yet: the words decide at the body's end.
                } else if status == 0 || rule.rule.release.releases(status) {
                    // A failure the upstream reports releases the claim, unless the router
                    // sent the request more than once: an earlier attempt may have run it.
                    return if resent {
                        self.unknown_outcome(host, run, &report)
                    } else {
                        self.release(host, run)
                    };
                }
            }
            Answerer::NeverReached => return self.never_reached(host, run, &report),
            Answerer::Unknown => return self.unknown_outcome(host, run, &report),
        }
        let replay_header = &rule.rule.replay_header;
        if headers.iter().any(|(n, _)| n == replay_header) {
            // Only replays carry the marker; an upstream's own copy would mislead clients.
            if let Err(e) = host.remove_response_header(replay_header) {
                log::warn!("could not remove upstream {replay_header}: {}", e.0);
            }
        }
        let mut capture = ResponseCapture::start(
            &rule.rule,
            status,
            headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())),
        );
        // Dated from when the write went upstream (no clock read here): the record is kept
        // from its completion, a little later, so the key lives at least this long (its
        // tombstone included: a retry until then never executes).
        let remembered_ms = rule.rule.ttl_ms.saturating_add(rule.rule.tombstone_ms);
        let expires = key_expires_value(run.started_ms.saturating_add(remembered_ms));
        // An answer still being judged may free the key: the client is not told it is kept.
        if proxy_words.is_none() {
            if let Err(e) = host.replace_response_header(KEY_EXPIRES_HEADER, expires.as_bytes()) {
                log::warn!("{KEY_EXPIRES_HEADER} not set: {}", e.0);
            }
        }
        capture.set_key_expiry(&expires);
        let is_grpc = rule.rule.grpc.is_some();
        let run = Execution {
            capture: Some(capture),
            proxy_words,
            ..run
        };
        if end_of_stream && is_grpc {
            // Trailers-only: the call's status is in its headers.
            let code = crate::grpc::status::status_in(&headers);
            return self.on_grpc_status(host, run, &headers, false, code);
        }
        if end_of_stream {
            return self.record(host, run);
        }
        (Journey::Executing(run), Verdict::Continue)
    }

    pub(super) fn on_response_body(
        &self,
        host: &impl Host,
        mut run: Execution,
        size: usize,
        end_of_stream: bool,
    ) -> Step {
        let wants_words = run.proxy_words.is_some();
        if let Some(capture) = run.capture.as_mut() {
            if size > 0 && (capture.wants_body() || wants_words) {
                match host.response_body(size) {
                    Ok(chunk) => {
                        capture.push_body(&chunk);
                        if let Some(words) = run.proxy_words.as_mut() {
                            let room = (gave_up::TEXT_BYTES + 1).saturating_sub(words.len());
                            words.extend(chunk.iter().take(room));
                        }
                    }
                    Err(e) => {
                        log::error!("response body unreadable: {}; recording it as omitted", e.0);
                        capture.omit_body();
                        if wants_words {
                            // The proxy's words, if they were, cannot be read.
                            let judged = Judgement::GaveUp("unreadable_words");
                            return self.apply_judgement(host, run, judged, BodyAt::Middle);
                        }
                    }
                }
            }
        }
        if let Some(words) = &run.proxy_words {
            let status = run.capture.as_ref().map_or(0, ResponseCapture::status);
            if let Some(judged) = gave_up::of_words(status, words, end_of_stream) {
                let at = if end_of_stream {
                    BodyAt::End
                } else {
                    BodyAt::Middle
                };
                return self.apply_judgement(host, run, judged, at);
            }
        }
        if end_of_stream && awaits_grpc_status(&run) {
            // A gRPC response ends with its status in trailers: without them, how the call
            // ended is unknown.
            let report = EnvoyReport::read(host, 200);
            return self.unknown_outcome(host, run, &report);
        }
        if end_of_stream {
            return self.record(host, run);
        }
        (Journey::Executing(run), Verdict::Continue)
    }

    /// The stream ended (client or upstream gone) before the response did. After response
    /// headers that did not release the claim, what passed is recorded without its body, so a
    /// retry gets the status and headers instead of a second execution. Before any, the
    /// upstream may have run the write unless the router never sent it.
    pub(super) fn on_cut_short(&self, host: &impl Host, mut run: Execution) -> Step {
        if let Some(words) = &run.proxy_words {
            // A gateway error cut short: its words so far decide if they can, else nothing
            // proves it never ran.
            let status = run.capture.as_ref().map_or(0, ResponseCapture::status);
            let judged =
                gave_up::of_words(status, words, false).unwrap_or(Judgement::GaveUp("cut_short"));
            return self.apply_judgement(host, run, judged, BodyAt::CutShort);
        }
        if awaits_grpc_status(&run) {
            // A gRPC call's status comes last: without it, how the call ended is unknown.
            let report = EnvoyReport::read(host, 200);
            return self.unknown_outcome(host, run, &report);
        }
        match run.capture.as_mut() {
            Some(capture) => {
                capture.omit_body();
                self.record(host, run)
            }
            None => {
                let report = EnvoyReport::read(host, 0);
                match report.answerer() {
                    Answerer::NeverReached => self.never_reached(host, run, &report),
                    Answerer::Upstream { .. } | Answerer::Unknown => {
                        self.unknown_outcome(host, run, &report)
                    }
                }
            }
        }
    }

    /// The judgement of an upstream's `502` or `503`, made from its first body bytes `at`
    /// some point of it: a proxy's words that say it gave up after sending make it an unknown
    /// outcome; otherwise the rule's release policy decides, as for any answer of the
    /// upstream's (a record still being copied goes on being copied).
    pub(super) fn apply_judgement(
        &self,
        host: &impl Host,
        mut run: Execution,
        judged: Judgement,
        at: BodyAt,
    ) -> Step {
        run.proxy_words = None;
        let status = run.capture.as_ref().map_or(0, ResponseCapture::status);
        let report = EnvoyReport::read(host, status);
        let releases = run.rule.rule.release.releases(status);
        match (judged, at) {
            (Judgement::GaveUp(reason), _) => {
                self.unknown_outcome(host, run, &report.gave_up_behind(reason))
            }
            (Judgement::NeverSent, _) if releases => self.never_reached(host, run, &report),
            (Judgement::NeverSent | Judgement::ServiceAnswer, _) if releases => {
                self.release(host, run)
            }
            (_, BodyAt::Middle) => (Journey::Executing(run), Verdict::Continue),
            (_, BodyAt::End) => self.record(host, run),
            (_, BodyAt::CutShort) => {
                if let Some(capture) = run.capture.as_mut() {
                    capture.omit_body();
                }
                self.record(host, run)
            }
        }
    }

    /// Envoy answered a request that provably never reached the upstream (no host, no
    /// connection, a circuit breaker, a stream the upstream refused): the write did not run,
    /// so its key is freed and the retry runs it.
    pub(super) fn never_reached(
        &self,
        host: &impl Host,
        run: Execution,
        report: &EnvoyReport,
    ) -> Step {
        let admitted = self
            .plugin
            .never_reached_log
            .borrow_mut()
            .admit(host.now_ms());
        if let Some(suppressed) = admitted {
            log::info!(
                "rule {}: released: the request never reached the upstream ({report}); its \
                 retry runs ({suppressed} similar not logged)",
                run.rule.rule.name,
            );
        }
        self.release(host, run)
    }

    /// The request may have reached the upstream and no answer of the upstream's came back:
    /// the write may have happened. Recorded as such (a retry is told, never run), or, for
    /// rules whose upstream rolls a write back when its caller leaves, released.
    pub(super) fn unknown_outcome(
        &self,
        host: &impl Host,
        run: Execution,
        report: &EnvoyReport,
    ) -> Step {
        let rule = Rc::clone(&run.rule);
        self.note(host, &rule, Outcome::OutcomeUnknown);
        let release = rule.rule.on_unknown_outcome == UnknownOutcomePolicy::Release;
        let admitted = self
            .plugin
            .unknown_outcome_log
            .borrow_mut()
            .admit(host.now_ms());
        if let Some(suppressed) = admitted {
            log::warn!(
                "rule {}: outcome unknown ({report}); {} ({suppressed} similar not logged)",
                rule.rule.name,
                if release {
                    "key released (on_unknown_outcome: release)"
                } else {
                    "key kept until its TTL"
                }
            );
        }
        if release {
            return self.release(host, run);
        }
        let Execution {
            rule,
            held,
            store_owner,
            ..
        } = run;
        let mut unknown = report.as_unknown_outcome(rule.rule.retention());
        let lookup = rule
            .rule
            .resolve
            .as_ref()
            .zip(self.lookup.borrow_mut().take());
        let Some((resolve, lookup)) = lookup else {
            let response = RecordedResponse::unknown_outcome(unknown);
            return self.keep(host, rule, held, store_owner, response);
        };
        // Resolved by asking the service once its settle time has passed; the record says
        // when, so that a retry meanwhile is told when to come back.
        let due_ms = host.now_ms().saturating_add(resolve.settle_ms);
        unknown.resolution_due_ms = Some(due_ms);
        let response = RecordedResponse::unknown_outcome(unknown.clone());
        // Cluster mode: the store's record is the one every replica reads, whatever became
        // of the local copy (no slot for it, say).
        let in_store = store_owner.is_some();
        let (step, kept) =
            self.keep_recording(host, Rc::clone(&rule), held.clone(), store_owner, response);
        if kept == Some(Completion::Recorded) || in_store {
            let resolution = Resolution::new(rule, held, lookup, unknown, due_ms);
            self.plugin
                .resolutions
                .take_on(host, &self.plugin.table, resolution, false);
        }
        step
    }

    /// The router sent the request more than once: counted and logged, since the write may
    /// have run more than once before the filter could tell.
    fn note_resent(&self, host: &impl Host, rule: &RuleHandle, report: &EnvoyReport) {
        self.note(host, rule, Outcome::Resent);
        log::warn!(
            "rule {}: the router sent a protected request {} times (flags {}); \
             is {NO_ROUTER_RETRIES} stripped or overridden?",
            rule.rule.name,
            report.attempts.unwrap_or(0),
            flag_names(report.flags),
        );
    }

    pub(super) fn release(&self, host: &impl Host, run: Execution) -> Step {
        let Execution {
            rule,
            held,
            store_owner,
            ..
        } = run;
        self.note(host, &rule, Outcome::Released);
        if let Some(owner) = store_owner {
            let call = store_client::release_call(&held.key, &owner.token);
            self.submit_store_release(host, &rule, owner.confirmed, call);
        }
        match self.plugin.table.release(host, &held) {
            Ok(Completion::Recorded | Completion::RecordedWithoutBody | Completion::NotHeld) => {}
            Ok(Completion::LostOwnership) => {
                log::warn!("release skipped: the claim had been taken over");
            }
            Err(e) => {
                log::error!("release failed, the key stays claimed until its lease ends: {e}")
            }
        }
        (Journey::Finished, Verdict::Continue)
    }

    /// The response is complete: record it for replays.
    pub(super) fn record(&self, host: &impl Host, run: Execution) -> Step {
        let Execution {
            rule,
            held,
            store_owner,
            capture: Some(capture),
            ..
        } = run
        else {
            return (Journey::Finished, Verdict::Continue);
        };
        let response = capture.finish();
        self.keep(host, rule, held, store_owner, response)
    }

    /// Records `response` for the held claim, locally and (cluster mode) in the store.
    fn keep(
        &self,
        host: &impl Host,
        rule: Rc<RuleHandle>,
        held: Held,
        store_owner: Option<StoreOwner>,
        response: RecordedResponse,
    ) -> Step {
        self.keep_recording(host, rule, held, store_owner, response)
            .0
    }

    /// `keep`, and what the local table did with the record (None: a host error).
    fn keep_recording(
        &self,
        host: &impl Host,
        rule: Rc<RuleHandle>,
        held: Held,
        store_owner: Option<StoreOwner>,
        response: RecordedResponse,
    ) -> (Step, Option<Completion>) {
        // A response is kept past its TTL as its tombstone; an unknown outcome keeps its own
        // rules (it is settled or expires).
        let ttl_ms = rule
            .rule
            .ttl_ms
            .saturating_add(rule.rule.tombstone_ms_for(&response));
        // Cluster mode: not in the store until its completion lands (or never, when the claim
        // was never sent); every worker's retry must know that of an unknown outcome.
        let store_copy = match rule.store {
            Some(_) => StoreCopy::Awaited,
            None => StoreCopy::NotAwaited,
        };
        let completed = self.plugin.table.complete_with_store_copy(
            host,
            &held,
            &response,
            host.now_ms(),
            ttl_ms,
            oversized(&rule),
            store_copy,
        );
        let kept = completed.as_ref().ok().copied();
        if let Some(owner) = store_owner {
            // Queued after the local record is written: whoever sees the store take it
            // (the native build's main thread, on another thread at once) marks that record
            // as in the store, and a mark that came first would find nothing to mark.
            self.submit_store_completion(host, &rule, &held, &owner, &response);
        }
        match completed {
            Ok(Completion::Recorded | Completion::NotHeld) => {
                if response.body_omitted {
                    self.note(host, &rule, Outcome::BodyOmitted);
                }
            }
            Ok(Completion::RecordedWithoutBody) => self.note(host, &rule, Outcome::BodyOmitted),
            Ok(Completion::LostOwnership) => {
                log::warn!(
                    "rule {}: response not recorded: the lease passed and another request took the key over",
                    rule.rule.name
                );
                self.note(host, &rule, Outcome::NotRecorded);
            }
            Err(e) => {
                log::error!("rule {}: response not recorded: {e}", rule.rule.name);
                self.note(host, &rule, Outcome::NotRecorded);
            }
        }
        ((Journey::Finished, Verdict::Continue), kept)
    }

    /// Hands a store release to the root, which sends and retries it even after this
    /// request is gone, until the claim's lease has passed.
    pub(super) fn submit_store_release(
        &self,
        host: &impl Host,
        rule: &Rc<RuleHandle>,
        confirmed: bool,
        call: CallOp,
    ) {
        let deadline = host.now_ms().saturating_add(rule.rule.lease_ms);
        let write = PendingWrite::new(Rc::clone(rule), call, deadline);
        self.submit(host, write, confirmed);
    }

    /// Hands a store completion to the root, retried until the record's TTL has passed; the
    /// same completion without the response body is sent instead should the retry buffer run
    /// short during a long outage.
    pub(super) fn submit_store_completion(
        &self,
        host: &impl Host,
        rule: &Rc<RuleHandle>,
        held: &Held,
        owner: &StoreOwner,
        response: &RecordedResponse,
    ) {
        let ttl_ms = rule.rule.ttl_ms;
        let call = store_client::complete_call(
            &held.key,
            &held.fingerprint,
            &owner.token,
            ttl_ms,
            rule.rule.tombstone_ms_for(response),
            response,
        );
        let deadline = host.now_ms().saturating_add(ttl_ms);
        // Once the store holds a record of the key, the local one is no longer all that
        // answers its retries: it may be evicted, and an unknown outcome follows the store.
        let mut write = PendingWrite::new(Rc::clone(rule), call, deadline)
            .with_local_claim(held.clone())
            .marking_in_store(self.plugin.table.in_store_mark(held));
        if !response.body.is_empty() {
            let without_body = response.without_body();
            let lean: LeanRecord = Box::new(move || without_body.encode());
            write = write.with_lean_record(lean);
        }
        self.submit(host, write, owner.confirmed);
    }

    /// Sends on an unknown outcome `recorded_by` recorded here and the store never got, under
    /// a retry's store claim, as this proxy first sent it (so a resolution's settle, which
    /// names those bytes, still matches).
    pub(super) fn submit_unlanded(
        &self,
        host: &impl Host,
        rule: &Rc<RuleHandle>,
        recorded_by: &Held,
        owner: &StoreOwner,
        record: &RecordedResponse,
    ) {
        let as_first_sent = RecordedResponse {
            owner: 0,
            ..record.clone()
        };
        self.submit_store_completion(host, rule, recorded_by, owner, &as_first_sent);
    }

    fn submit(&self, host: &impl Host, write: PendingWrite, confirmed: bool) {
        let write = if confirmed {
            write
        } else {
            write.best_effort()
        };
        let plugin = &self.plugin;
        plugin
            .writes
            .submit_from(host, &plugin.links(), self.acting_context(), write);
    }
}

/// A gRPC rule's response that is a gRPC response (HTTP 200) and so owes its status in
/// trailers; any other status (a proxy in between answered) is recorded as HTTP.
fn awaits_grpc_status(run: &Execution) -> bool {
    run.rule.rule.grpc.is_some() && run.capture.as_ref().is_some_and(|c| c.status() == 200)
}

/// A body the local budget cannot keep: recorded without it, unless the store keeps it.
pub(super) fn oversized(rule: &RuleHandle) -> OversizedBody {
    match rule.store {
        Some(_) => OversizedBody::LeaveToStore,
        None => OversizedBody::RecordWithoutIt,
    }
}

/// Whether the rule treats a gateway error in this answer as an unknown outcome: by default,
/// unless the service marked the answer `true` in the rule's `never_ran_header`.
pub(super) fn judges_gateway_errors(rule: &RuleHandle, metadata: &[(String, Vec<u8>)]) -> bool {
    rule.rule.on_gateway_error == GatewayErrorPolicy::UnknownOutcome
        && rule.rule.never_ran_header.as_ref().is_none_or(|name| {
            !metadata
                .iter()
                .any(|(n, v)| n == name && v.trim_ascii().eq_ignore_ascii_case(b"true"))
        })
}

/// Where in a response's body its judgement was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyAt {
    Middle,
    End,
    CutShort,
}

/// A gRPC rule's answer that is not HTTP 200 but carries a call status in its headers (a
/// proxy's trailers-only answer with another HTTP status): judged by that status.
fn grpc_status_in_headers(
    rule: &RuleHandle,
    status: u16,
    headers: &[(String, Vec<u8>)],
) -> Option<Judgement> {
    if rule.rule.grpc.is_none() || status == 200 {
        return None;
    }
    let code = crate::grpc::status::status_in(headers)??;
    match gave_up::of_grpc(code, headers) {
        gave_up @ Judgement::GaveUp(_) => Some(gave_up),
        _ => None,
    }
}

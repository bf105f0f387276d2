//! One request's journey through the filter.
//!
//! Request headers: pick the rule, parse and scope the key (answer 400 here when it is
//! missing or malformed). End of request: fingerprint the payload and claim the key; then
//! execute (continue upstream), replay the recorded response, or answer 409/422/503.
//! Response: release the claim on a releasing status, otherwise capture the response as it
//! streams to the client and record it at its end.

use std::rc::Rc;

use idempotency_core::capture::ResponseCapture;
use idempotency_core::config::{OverloadPolicy, Rule, StoreErrorPolicy};
use idempotency_core::fingerprint::request_fingerprint;
use idempotency_core::key::{parse_key, storage_key, Digest};
use idempotency_core::outcome::Outcome;
use idempotency_core::problem::Problem;
use idempotency_core::record::RecordedResponse;
use idempotency_core::rule_select::{path_without_query, RequestFacts, Selection};
use idempotency_core::store_client::{self, read_claim, StoreClaim, StoreFailure};
use idempotency_core::table::{Claim, Completion, Held, SlotRef, TableError};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use crate::host;
use crate::root::FilterState;
use crate::shared_table::EnvoySharedData;
use crate::store_calls::{self, StoreOp};
use crate::store_writes::PendingWrite;

/// Where the request is on its way.
enum Journey {
    /// Not protected by any rule (or already decided to pass).
    Untouched,
    /// Key accepted; waiting for the end of the body to fingerprint it.
    AwaitingBody {
        rule: usize,
        key: Digest,
        method: Vec<u8>,
        path: Vec<u8>,
    },
    /// Cluster mode: the local claim is held; the store is confirming it.
    AwaitingStore {
        rule: usize,
        held: Held,
        token: u32,
    },
    /// This request holds the claim and went upstream.
    Executing {
        rule: usize,
        held: Held,
        /// The store's owner token in cluster mode (None: local claim only).
        store_owner: Option<String>,
        capture: Option<ResponseCapture>,
    },
    /// The filter answered itself; its own reply must not be recorded.
    AnsweredLocally,
    Finished,
}

pub struct RequestFilter {
    state: Rc<FilterState>,
    journey: Journey,
}

impl RequestFilter {
    pub fn new(state: Rc<FilterState>) -> RequestFilter {
        RequestFilter {
            state,
            journey: Journey::Untouched,
        }
    }

    fn rule(&self, index: usize) -> Option<&Rule> {
        self.state.config.rules.get(index)
    }

    fn count(&self, rule: usize, outcome: Outcome) {
        self.state.metrics.count(rule, outcome);
    }

    /// Sends a problem+json reply and stops the request here.
    fn answer_problem(&mut self, rule: usize, problem: &Problem) -> Action {
        let rule_name = self.rule(rule).map(|r| r.name.as_str()).unwrap_or("");
        let body = problem.body(rule_name);
        let headers = problem.headers();
        let pairs: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
        self.send_local(u32::from(problem.status), &pairs, &body)
    }

    fn send_local(&mut self, status: u32, headers: &[(&str, &[u8])], body: &[u8]) -> Action {
        self.journey = Journey::AnsweredLocally;
        match host::send_local_response(status, headers, body) {
            Ok(()) => Action::Pause,
            Err(status) => {
                // Nothing was sent; letting the request on is the only way to answer at all.
                log::error!("local reply refused by the host: {status}");
                self.journey = Journey::Untouched;
                Action::Continue
            }
        }
    }

    fn on_request_headers(&mut self, end_of_stream: bool) -> Action {
        let headers = match host::get_header_pairs(MapType::HttpRequestHeaders) {
            Ok(h) => h,
            Err(status) => {
                log::warn!("request headers unreadable ({status}); request passes unprotected");
                return Action::Continue;
            }
        };
        let find = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_slice())
        };
        let text = |name: &str| {
            find(name)
                .and_then(|v| std::str::from_utf8(v).ok())
                .unwrap_or("")
        };
        let config = &self.state.config;
        let route_name = if config.needs_route_name() {
            property_string(&["xds", "route_name"])
        } else {
            None
        };
        let metadata_rule = config.route_metadata_namespace.as_deref().and_then(|ns| {
            property_string(&["xds", "route_metadata", "filter_metadata", ns, "rule"])
        });
        let method = text(":method");
        let path = text(":path");
        let facts = RequestFacts {
            method,
            path: path_without_query(path),
            authority: text(":authority"),
            route_name: route_name.as_deref(),
            metadata_rule: metadata_rule.as_deref(),
        };
        let (rule_index, rule) = match config.select(&facts) {
            Selection::Rule(i, r) => (i, r),
            Selection::UnknownMetadataRule => {
                log::warn!(
                    "route metadata names rule '{}', which is not configured; request passes",
                    metadata_rule.as_deref().unwrap_or("")
                );
                return Action::Continue;
            }
            Selection::MethodNotCovered | Selection::NoRule => return Action::Continue,
        };
        let key = match find(&rule.key_header) {
            None if rule.key_required => {
                let problem = Problem::missing_key(&rule.key_header);
                self.count(rule_index, Outcome::MissingKey);
                return self.answer_problem(rule_index, &problem);
            }
            None => {
                self.count(rule_index, Outcome::PassedThrough);
                return Action::Continue;
            }
            Some(raw) => match parse_key(raw) {
                Ok(k) => k,
                Err(why) => {
                    let problem = Problem::invalid_key(&rule.key_header, why);
                    self.count(rule_index, Outcome::InvalidKey);
                    return self.answer_problem(rule_index, &problem);
                }
            },
        };
        let scope: Vec<Option<&[u8]>> = rule.scope_headers.iter().map(|h| find(h)).collect();
        let storage = storage_key(&rule.name, &scope, &key);
        let method = method.as_bytes().to_vec();
        let path = path.as_bytes().to_vec();
        if end_of_stream {
            return self.claim(rule_index, storage, &method, &path, &[]);
        }
        self.journey = Journey::AwaitingBody {
            rule: rule_index,
            key: storage,
            method,
            path,
        };
        // Hold the headers until the whole body is here to be fingerprinted.
        Action::Pause
    }

    /// The whole request is known: fingerprint it, claim its key and act on the answer.
    fn claim(
        &mut self,
        rule_index: usize,
        key: Digest,
        method: &[u8],
        path: &[u8],
        body: &[u8],
    ) -> Action {
        let state = Rc::clone(&self.state);
        let Some(rule) = state.config.rules.get(rule_index) else {
            return Action::Continue;
        };
        let fingerprint = request_fingerprint(method, path, body);
        let owner = state.owners.next();
        let now = host::now_ms();
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
                        let body = store_client::claim_body(&key, &fingerprint, rule.lease_ms);
                        match store_calls::send(store, StoreOp::Claim, &body) {
                            Ok(token) => {
                                self.journey = Journey::AwaitingStore {
                                    rule: rule_index,
                                    held,
                                    token,
                                };
                                // Resumed (or answered) when the store replies.
                                Action::Pause
                            }
                            Err(status) => self.store_failed(
                                rule_index,
                                held,
                                &StoreFailure(format!("callout refused: {status}")),
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
                self.answer_problem(rule_index, &Problem::key_reused(&rule.key_header))
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
                log::warn!(
                    "rule {}: local table has no free slot for a new key",
                    rule.name
                );
                self.count(rule_index, Outcome::TableFull);
                self.overloaded(
                    rule_index,
                    rule.on_table_full,
                    "the proxy's idempotency table is full",
                )
            }
            Err(e) => {
                log::error!("rule {}: claim failed: {e}", rule.name);
                self.count(rule_index, Outcome::TableError);
                self.overloaded(
                    rule_index,
                    rule.on_table_full,
                    "the proxy's idempotency table is unavailable",
                )
            }
        }
    }

    /// Sends the request upstream holding the claim.
    fn execute(&mut self, rule_index: usize, held: Held, store_owner: Option<String>) -> Action {
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
    fn on_store_claim_answer(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let Journey::AwaitingStore {
            rule,
            held,
            token: expected,
        } = std::mem::replace(&mut self.journey, Journey::Untouched)
        else {
            return;
        };
        if token != expected {
            self.journey = Journey::AwaitingStore {
                rule,
                held,
                token: expected,
            };
            return;
        }
        let (status, body) = store_calls::read_answer(num_headers, body_size);
        let state = Rc::clone(&self.state);
        let Some(rule_config) = state.config.rules.get(rule) else {
            return;
        };
        let action = match read_claim(status, &body) {
            Ok(StoreClaim::Claimed { owner }) => self.execute(rule, held, Some(owner)),
            Ok(StoreClaim::InFlight) => {
                self.release_local(&held);
                self.count(rule, Outcome::Conflict);
                self.answer_problem(rule, &Problem::in_flight())
            }
            Ok(StoreClaim::Mismatch) => {
                self.release_local(&held);
                self.count(rule, Outcome::Mismatch);
                self.answer_problem(rule, &Problem::key_reused(&rule_config.key_header))
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
            Err(failure) => self.store_failed(rule, held, &failure),
        };
        if action == Action::Continue {
            if let Err(status) = host::resume_request() {
                log::error!("request could not be resumed: {status}");
            }
        }
    }

    /// The store could not confirm the claim: the rule's policy decides.
    fn store_failed(&mut self, rule_index: usize, held: Held, failure: &StoreFailure) -> Action {
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
                self.answer_problem(
                    rule_index,
                    &Problem::unavailable("the idempotency store could not be reached"),
                )
            }
            StoreErrorPolicy::FailOpen => {
                // The local claim still guards this proxy's own retries.
                self.count(rule_index, Outcome::StoreFailOpen);
                self.execute(rule_index, held, None)
            }
        }
    }

    fn release_local(&self, held: &Held) {
        if let Err(e) = self.state.table.release(&EnvoySharedData, held) {
            log::error!("local claim not released, it expires with its lease: {e}");
        }
    }

    fn overloaded(&mut self, rule_index: usize, policy: OverloadPolicy, why: &str) -> Action {
        match policy {
            OverloadPolicy::Reject => {
                let problem = if why.contains("full") {
                    Problem::table_full()
                } else {
                    Problem::unavailable(why)
                };
                self.answer_problem(rule_index, &problem)
            }
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
        self.send_local(u32::from(recorded.status), &headers, &recorded.body)
    }

    fn on_response_headers(&mut self, end_of_stream: bool) {
        let Journey::Executing {
            rule,
            held,
            store_owner,
            ..
        } = &self.journey
        else {
            return;
        };
        let (rule_index, held, store_owner) = (*rule, held.clone(), store_owner.clone());
        let state = Rc::clone(&self.state);
        let Some(rule) = state.config.rules.get(rule_index) else {
            return;
        };
        let headers = match host::get_header_pairs(MapType::HttpResponseHeaders) {
            Ok(h) => h,
            Err(status) => {
                log::error!("rule {}: response headers unreadable: {status}", rule.name);
                self.release(rule_index, &held, store_owner);
                return;
            }
        };
        let status = headers
            .iter()
            .find(|(n, _)| n == ":status")
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        if status == 0 || rule.release.releases(status) {
            self.release(rule_index, &held, store_owner);
            return;
        }
        if headers.iter().any(|(n, _)| *n == rule.replay_header) {
            // Only replays carry the marker; an upstream's own copy would mislead clients.
            if let Err(s) = host::remove_header(MapType::HttpResponseHeaders, &rule.replay_header) {
                log::warn!("could not remove upstream {}: {s}", rule.replay_header);
            }
        }
        let capture = ResponseCapture::start(
            rule,
            status,
            headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())),
        );
        self.journey = Journey::Executing {
            rule: rule_index,
            held,
            store_owner,
            capture: Some(capture),
        };
        if end_of_stream {
            self.record();
        }
    }

    fn on_response_body(&mut self, body_size: usize, end_of_stream: bool) {
        let Journey::Executing {
            capture: Some(capture),
            ..
        } = &mut self.journey
        else {
            return;
        };
        if body_size > 0 && capture.wants_body() {
            match host::get_buffer(BufferType::HttpResponseBody, 0, body_size) {
                Ok(chunk) => capture.push_body(&chunk.unwrap_or_default()),
                Err(status) => {
                    log::error!("response body unreadable: {status}; recording it as omitted");
                    capture.omit_body();
                }
            }
        }
        if end_of_stream {
            self.record();
        }
    }

    fn release(&mut self, rule_index: usize, held: &Held, store_owner: Option<String>) {
        self.journey = Journey::Finished;
        self.count(rule_index, Outcome::Released);
        if let (Some(owner), Some(store)) = (
            store_owner,
            self.state.stores.get(rule_index).and_then(Option::as_ref),
        ) {
            let body = store_client::release_body(&held.key, &owner);
            self.state.writes.submit(PendingWrite::new(
                rule_index,
                Rc::clone(store),
                StoreOp::Release,
                body,
            ));
        }
        match self.state.table.release(&EnvoySharedData, held) {
            Ok(Completion::Recorded) => {}
            Ok(Completion::LostOwnership) => {
                log::warn!("release skipped: the claim had been taken over");
            }
            Err(e) => {
                log::error!("release failed, the key stays claimed until its lease ends: {e}")
            }
        }
    }

    /// The response is complete: record it for replays.
    fn record(&mut self) {
        let journey = std::mem::replace(&mut self.journey, Journey::Finished);
        let Journey::Executing {
            rule: rule_index,
            held,
            store_owner,
            capture: Some(capture),
        } = journey
        else {
            return;
        };
        let state = Rc::clone(&self.state);
        let Some(rule) = state.config.rules.get(rule_index) else {
            return;
        };
        let response = capture.finish();
        if let (Some(owner), Some(store)) = (
            store_owner,
            state.stores.get(rule_index).and_then(Option::as_ref),
        ) {
            // The cluster-wide record matters most: queue it first, from the root context.
            let body = store_client::complete_body(&held.key, &owner, rule.ttl_ms, &response);
            state.writes.submit(PendingWrite::new(
                rule_index,
                Rc::clone(store),
                StoreOp::Complete,
                body,
            ));
        }
        match state.table.complete(
            &EnvoySharedData,
            &held,
            &response,
            host::now_ms(),
            rule.ttl_ms,
        ) {
            Ok(Completion::Recorded) => {}
            Ok(Completion::LostOwnership) => {
                log::warn!(
                    "rule {}: response not recorded: the lease passed and another request took the key over",
                    rule.name
                );
                self.count(rule_index, Outcome::NotRecorded);
            }
            Err(TableError::Host(e)) => {
                log::error!("rule {}: response not recorded: {}", rule.name, e.0);
                self.count(rule_index, Outcome::NotRecorded);
            }
            Err(e) => {
                log::error!("rule {}: response not recorded: {e}", rule.name);
                self.count(rule_index, Outcome::NotRecorded);
            }
        }
    }
}

/// A string property, or None when absent or unreadable.
fn property_string(path: &[&str]) -> Option<String> {
    match host::get_property(path) {
        Ok(Some(bytes)) => String::from_utf8(bytes).ok().filter(|s| !s.is_empty()),
        Ok(None) => None,
        Err(status) => {
            log::debug!("property {} unreadable: {status}", path.join("."));
            None
        }
    }
}

impl Context for RequestFilter {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        self.on_store_claim_answer(token_id, num_headers, body_size);
    }
}

impl HttpContext for RequestFilter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.on_request_headers(end_of_stream)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !matches!(self.journey, Journey::AwaitingBody { .. }) {
            return Action::Continue;
        }
        if !end_of_stream {
            // Keep buffering: the fingerprint covers the whole body.
            return Action::Pause;
        }
        self.decide_with_buffered_body(body_size)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if !matches!(self.journey, Journey::AwaitingBody { .. }) {
            return Action::Continue;
        }
        self.decide_with_buffered_body(usize::MAX)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.on_response_headers(end_of_stream);
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.on_response_body(body_size, end_of_stream);
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.record();
        Action::Continue
    }
}

impl RequestFilter {
    fn decide_with_buffered_body(&mut self, body_size: usize) -> Action {
        let Journey::AwaitingBody {
            rule,
            key,
            method,
            path,
        } = std::mem::replace(&mut self.journey, Journey::Untouched)
        else {
            return Action::Continue;
        };
        let body = match host::get_buffer(BufferType::HttpRequestBody, 0, body_size) {
            Ok(b) => b.unwrap_or_default(),
            Err(status) => {
                log::error!("request body unreadable: {status}");
                let problem = Problem::unavailable("the request body could not be read");
                return self.answer_problem(rule, &problem);
            }
        };
        self.claim(rule, key, &method, &path, &body)
    }
}

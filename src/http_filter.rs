//! One request's journey through the filter.
//!
//! Request headers: pick the rule, parse and scope the key (answer 400 here when it is
//! missing or malformed). End of request: fingerprint the payload and claim the key; then
//! execute (continue upstream), replay the recorded response, or answer 409/422/503.
//! Response: release the claim on a releasing status, otherwise capture the response as it
//! streams to the client and record it at its end.

use std::rc::Rc;

use idempotency_core::capture::ResponseCapture;
use idempotency_core::config::{OverloadPolicy, Rule};
use idempotency_core::fingerprint::request_fingerprint;
use idempotency_core::key::{parse_key, storage_key, Digest};
use idempotency_core::outcome::Outcome;
use idempotency_core::problem::Problem;
use idempotency_core::record::RecordedResponse;
use idempotency_core::rule_select::{path_without_query, RequestFacts, Selection};
use idempotency_core::table::{Claim, Completion, Held, SlotRef, TableError};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use crate::host;
use crate::root::FilterState;
use crate::shared_table::EnvoySharedData;

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
    /// This request holds the claim and went upstream.
    Executing {
        rule: usize,
        held: Held,
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
                self.count(rule_index, Outcome::Executed);
                self.journey = Journey::Executing {
                    rule: rule_index,
                    held,
                    capture: None,
                };
                Action::Continue
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
        let Journey::Executing { rule, held, .. } = &self.journey else {
            return;
        };
        let (rule_index, held) = (*rule, held.clone());
        let state = Rc::clone(&self.state);
        let Some(rule) = state.config.rules.get(rule_index) else {
            return;
        };
        let headers = match host::get_header_pairs(MapType::HttpResponseHeaders) {
            Ok(h) => h,
            Err(status) => {
                log::error!("rule {}: response headers unreadable: {status}", rule.name);
                self.release(rule_index, &held);
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
            self.release(rule_index, &held);
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

    fn release(&mut self, rule_index: usize, held: &Held) {
        self.journey = Journey::Finished;
        self.count(rule_index, Outcome::Released);
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

impl Context for RequestFilter {}

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

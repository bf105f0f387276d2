//! One request's journey through the filter, as a small state machine.
//!
//! `request_intake.rs`: pick the rule, read the key (headers, query, body fields) and
//! fingerprint the payload. `claim_flow.rs`: claim the key locally and in the store, then
//! execute, replay, or answer 409/422/503. `response_recording.rs`: release the claim on a
//! releasing status, or record the response as it streams to the client.

use std::rc::Rc;

use idempotency_core::capture::ResponseCapture;
use idempotency_core::config::Rule;
use idempotency_core::outcome::Outcome;
use idempotency_core::problem::Problem;
use idempotency_core::table::Held;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use crate::host;
use crate::root::FilterState;
use crate::store_calls::StoreOp;
use crate::store_writes::{LeanBody, PendingWrite};

/// Where the request is on its way.
pub(crate) enum Journey {
    /// Not protected by any rule (or already decided to pass).
    Untouched,
    /// Rule chosen and header-borne key parts read; waiting for the whole body.
    AwaitingBody(Box<PendingRequest>),
    /// Cluster mode: the local claim is held; the store is confirming it.
    AwaitingStore {
        rule: usize,
        held: Held,
        token: u32,
        /// The owner this proxy claimed with (it chooses it, so it can release it).
        owner: String,
    },
    /// This request holds the claim and went upstream.
    Executing {
        rule: usize,
        held: Held,
        /// The store claim in cluster mode (None: local claim only).
        store_owner: Option<StoreOwner>,
        capture: Option<ResponseCapture>,
    },
    /// The filter answered itself; its own reply must not be recorded.
    AnsweredLocally,
    /// A replay with an empty body was sent; these recorded headers, which Envoy strips from
    /// bodiless local replies, are restored when the reply passes back through the filter.
    Replaying {
        restore: Vec<(String, Vec<u8>)>,
    },
    Finished,
}

/// This request's claim in the store.
#[derive(Clone)]
pub(crate) struct StoreOwner {
    pub token: String,
    /// False when the store's answer was lost (fail_open): the claim may not exist, so
    /// writing to it is best effort and not counted as a store error.
    pub confirmed: bool,
}

/// What is kept from the request headers (they are gone once the body arrives).
pub(crate) struct PendingRequest {
    pub rule: usize,
    pub method: String,
    pub path: String,
    pub content_type: String,
    /// Key parts read from headers and query; None for body sources.
    pub key_parts: Vec<Option<Vec<u8>>>,
    pub scope: Vec<Option<Vec<u8>>>,
}

pub struct RequestFilter {
    pub(crate) state: Rc<FilterState>,
    pub(crate) journey: Journey,
}

/// How problem details name where a rule's key comes from.
pub(crate) fn key_label(rule: &Rule) -> String {
    match rule.key_sources.as_slice() {
        [one] => one.describe(),
        many => format!(
            "combined key ({})",
            many.iter()
                .map(|s| s.describe())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

impl RequestFilter {
    pub fn new(state: Rc<FilterState>) -> RequestFilter {
        RequestFilter {
            state,
            journey: Journey::Untouched,
        }
    }

    pub(crate) fn rule(&self, index: usize) -> Option<&Rule> {
        self.state.config.rules.get(index)
    }

    pub(crate) fn count(&self, rule: usize, outcome: Outcome) {
        self.state.metrics.count(rule, outcome);
    }

    /// Sends a problem+json reply and stops the request here.
    pub(crate) fn answer_problem(&mut self, rule: usize, problem: &Problem) -> Action {
        let rule_name = self.rule(rule).map(|r| r.name.as_str()).unwrap_or("");
        let body = problem.body(rule_name);
        let headers = problem.headers();
        let pairs: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
        self.send_local(u32::from(problem.status), &pairs, &body)
    }

    pub(crate) fn send_local(
        &mut self,
        status: u32,
        headers: &[(&str, &[u8])],
        body: &[u8],
    ) -> Action {
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
}

impl RequestFilter {
    /// Hands a store release to the root context, which sends and retries it even after
    /// this request is gone, until the claim's lease has passed. Does nothing for rules
    /// without a store.
    pub(crate) fn submit_store_release(&self, rule: usize, confirmed: bool, body: Vec<u8>) {
        let lease_ms = self.rule(rule).map_or(0, |r| r.lease_ms);
        self.submit_store_write(rule, StoreOp::Release, confirmed, body, lease_ms, None);
    }

    /// Hands a store completion to the root context, retried until the record's TTL has
    /// passed; `lean` builds the same completion without the response body, sent instead
    /// should the retry buffer run short during a long outage.
    pub(crate) fn submit_store_completion(
        &self,
        rule: usize,
        confirmed: bool,
        body: Vec<u8>,
        lean: Option<LeanBody>,
    ) {
        let ttl_ms = self.rule(rule).map_or(0, |r| r.ttl_ms);
        self.submit_store_write(rule, StoreOp::Complete, confirmed, body, ttl_ms, lean);
    }

    fn submit_store_write(
        &self,
        rule: usize,
        op: StoreOp,
        confirmed: bool,
        body: Vec<u8>,
        matters_for_ms: u64,
        lean: Option<LeanBody>,
    ) {
        let Some(store) = self.state.stores.get(rule).and_then(Option::as_ref) else {
            return;
        };
        let deadline = host::now_ms().saturating_add(matters_for_ms);
        let mut write = PendingWrite::new(rule, Rc::clone(store), op, body, deadline);
        if let Some(lean) = lean {
            write = write.with_lean_body(lean);
        }
        if !confirmed {
            write = write.best_effort();
        }
        self.state.writes.submit(write);
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
        self.on_request_body(body_size, end_of_stream)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.on_request_trailers()
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

    fn on_log(&mut self) {
        self.on_stream_end();
    }
}

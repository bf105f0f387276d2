//! The request side: choose the rule, read the key from its sources, hold the request until
//! the body (if the key or the fingerprint needs it) has arrived, then hand the storage key
//! and fingerprint to the claim.

use idempotency_core::config::Rule;
use idempotency_core::fingerprint::fingerprint;
use idempotency_core::key::{request_scope, storage_key};
use idempotency_core::key_source::{complete_key, header_parts, SourceFailure};
use idempotency_core::outcome::Outcome;
use idempotency_core::problem::Problem;
use idempotency_core::request_fields::RequestBody;
use idempotency_core::rule_select::{path_without_query, RequestFacts, Selection};
use proxy_wasm::types::{Action, BufferType, MapType};

use crate::host;
use crate::http_filter::{Journey, PendingRequest, RequestFilter};

/// Where in the request a key source failed: header-borne keys the client chose to send are
/// always checked; body-borne ones only matter when the rule requires a key.
#[derive(Clone, Copy, PartialEq, Eq)]
enum FailedAt {
    Headers,
    Body,
}

fn needs_body(rule: &Rule) -> bool {
    rule.fingerprint.needs_body() || rule.key_sources.iter().any(|s| s.in_body())
}

impl RequestFilter {
    pub(crate) fn on_request_headers(&mut self, end_of_stream: bool) -> Action {
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
        let route_name = config
            .needs_route_name()
            .then(|| property_string(&["xds", "route_name"]))
            .flatten();
        let virtual_host = config
            .needs_virtual_host()
            .then(|| property_string(&["xds", "virtual_host_name"]))
            .flatten();
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
            virtual_host: virtual_host.as_deref(),
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
        let key_parts = match header_parts(&rule.key_sources, find, path) {
            Ok(parts) => parts,
            Err(failure) => return self.key_failed(rule_index, &failure, FailedAt::Headers),
        };
        // Every value of a repeated scope header counts, not only the first.
        let all_values = |name: &str| {
            headers
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.as_slice())
                .collect()
        };
        let scope = match request_scope(&rule.scope_headers, rule.scope_required, all_values) {
            Ok(scope) => scope,
            Err(header) => {
                self.count(rule_index, Outcome::MissingScope);
                return self.answer_problem(rule_index, &Problem::missing_scope(header));
            }
        };
        let pending = PendingRequest {
            rule: rule_index,
            method: method.to_string(),
            path: path.to_string(),
            content_type: text("content-type").to_string(),
            key_parts,
            scope,
        };
        if end_of_stream || !needs_body(rule) {
            // Nothing to wait for: claim now, and let any body stream through.
            return self.claim_request(pending, &[]);
        }
        self.journey = Journey::AwaitingBody(Box::new(pending));
        // Hold the headers until the whole body is here.
        Action::Pause
    }

    pub(crate) fn on_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.holds_for_store() {
            return Action::Pause;
        }
        let Journey::AwaitingBody(pending) = &self.journey else {
            return Action::Continue;
        };
        let limit = self
            .rule(pending.rule)
            .map_or(usize::MAX, |r| r.max_request_bytes);
        if body_size > limit {
            return self.body_too_large(limit);
        }
        if !end_of_stream {
            // Keep buffering: Envoy holds the body until the decision.
            return Action::Pause;
        }
        self.decide_with_buffered_body(body_size)
    }

    pub(crate) fn on_request_trailers(&mut self) -> Action {
        if self.holds_for_store() {
            return Action::Pause;
        }
        if !matches!(self.journey, Journey::AwaitingBody(_)) {
            return Action::Continue;
        }
        self.decide_with_buffered_body(usize::MAX)
    }

    /// A claim sent at request headers (the rule never reads the body) is still awaiting the
    /// store: the body and trailers that arrive meanwhile must stay in Envoy's buffer, since
    /// returning Continue here would send the request upstream before the store has decided.
    /// The store's answer resumes (or answers) the request with everything buffered.
    fn holds_for_store(&self) -> bool {
        matches!(self.journey, Journey::AwaitingStore { .. })
    }

    fn body_too_large(&mut self, limit: usize) -> Action {
        let Journey::AwaitingBody(pending) =
            std::mem::replace(&mut self.journey, Journey::Untouched)
        else {
            return Action::Continue;
        };
        let rule = pending.rule;
        if self.rule(rule).is_some_and(|r| r.key_required) {
            self.count(rule, Outcome::InvalidKey);
            return self.answer_problem(rule, &Problem::request_too_large(limit));
        }
        self.count(rule, Outcome::PassedThrough);
        Action::Continue
    }

    fn decide_with_buffered_body(&mut self, body_size: usize) -> Action {
        let Journey::AwaitingBody(pending) =
            std::mem::replace(&mut self.journey, Journey::Untouched)
        else {
            return Action::Continue;
        };
        let body = match host::get_buffer(BufferType::HttpRequestBody, 0, body_size) {
            Ok(b) => b.unwrap_or_default(),
            Err(status) => {
                log::error!("request body unreadable: {status}");
                let problem = Problem::unavailable("the request body could not be read");
                return self.answer_problem(pending.rule, &problem);
            }
        };
        self.claim_request(*pending, &body)
    }

    /// Completes the key with the body's fields, fingerprints the payload and claims.
    fn claim_request(&mut self, pending: PendingRequest, body: &[u8]) -> Action {
        let state = std::rc::Rc::clone(&self.state);
        let Some(rule) = state.config.rules.get(pending.rule) else {
            return Action::Continue;
        };
        let mut parsed = RequestBody::new(&pending.content_type, body);
        let key = match complete_key(&rule.key_sources, pending.key_parts, &mut parsed) {
            Ok(k) => k,
            Err(failure) => return self.key_failed(pending.rule, &failure, FailedAt::Body),
        };
        let fingerprint = match fingerprint(
            &rule.fingerprint,
            &pending.method,
            &pending.path,
            &mut parsed,
            body,
        ) {
            Ok(f) => f,
            Err(failure) => return self.key_failed(pending.rule, &failure, FailedAt::Body),
        };
        let scope: Vec<Option<&[u8]>> = pending.scope.iter().map(|v| v.as_deref()).collect();
        let storage = storage_key(&rule.name, &scope, &key);
        self.claim(pending.rule, storage, fingerprint)
    }

    fn key_failed(&mut self, rule_index: usize, failure: &SourceFailure, at: FailedAt) -> Action {
        let required = self.rule(rule_index).is_some_and(|r| r.key_required);
        if !required && (failure.is_missing() || at == FailedAt::Body) {
            self.count(rule_index, Outcome::PassedThrough);
            self.journey = Journey::Untouched;
            return Action::Continue;
        }
        if failure.is_missing() {
            self.count(rule_index, Outcome::MissingKey);
            self.answer_problem(rule_index, &Problem::missing_key(failure.source()))
        } else {
            self.count(rule_index, Outcome::InvalidKey);
            self.answer_problem(
                rule_index,
                &Problem::invalid_key(failure.source(), failure.why()),
            )
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

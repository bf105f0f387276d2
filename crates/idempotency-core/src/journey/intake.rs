//! The request side: choose the rule, read the key from its sources, hold the request until
//! the body (if the key or the fingerprint needs it) has arrived, then hand the storage key
//! and fingerprint to the claim.

use std::rc::Rc;

use super::detached::{self, DetachedIntake};
use super::grpc::{call_shape, sent_key_metadata, CallShape};
use super::{access_log, pass, Journey, PendingRequest, RequestJourney, Step, Verdict};
use crate::fingerprint::{fingerprint, FingerprintMode, Protocol};
use crate::host::{HeaderPairs, Host};
use crate::outcome::Outcome;
use crate::plugin::detached::ForwardedRequest;
use crate::problem::Problem;
use crate::resolve::lookup::{LookupParts, LookupRequest, NoLookup};
use crate::resolve::template::LookupInput;
use crate::rule_handle::RuleHandle;
use crate::rule_select::{select, RequestFacts, Selection};
use idempotency_protocol::naming::fields::path_without_query;
use idempotency_protocol::naming::fields::RequestBody;
use idempotency_protocol::naming::source::{
    combine, header_parts, key_values, FieldSource, SourceFailure,
};
use idempotency_protocol::naming::{request_scope, storage_key};

/// Where in the request a key source failed: header-borne keys the client chose to send are
/// always checked; body-borne ones only matter when the rule requires a key.
#[derive(Clone, Copy, PartialEq, Eq)]
enum FailedAt {
    Headers,
    Body,
}

/// The rule the route's metadata names, if the configuration looks for one.
fn route_metadata_rule(host: &impl Host, config: &crate::config::Config) -> Option<String> {
    let ns = config.route_metadata_namespace.as_deref()?;
    property_string(
        host,
        &["xds", "route_metadata", "filter_metadata", ns, "rule"],
    )
}

/// What a request costs Envoy beyond its body while it is held (headers, stream state).
const REQUEST_OVERHEAD_BYTES: usize = 2048;

/// A detached rule always holds the whole body: it sends the request's copy itself.
fn needs_body(rule: &RuleHandle) -> bool {
    rule.rule.detached.is_some()
        || rule.rule.grpc.is_some()
        || rule.rule.fingerprint.needs_body()
        || rule.rule.key_sources.iter().any(|s| s.in_body())
}

impl RequestJourney {
    pub(super) fn on_request_headers(&self, host: &impl Host, end_of_stream: bool) -> Step {
        let headers = match host.request_headers() {
            Ok(h) => h,
            Err(e) => {
                log::warn!(
                    "request headers unreadable ({}); request passes unprotected",
                    e.0
                );
                return pass();
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
        let method = text(":method");
        let path = text(":path");
        let config = &self.plugin.config;
        // Most requests of a mesh (its reads, other routes) are no rule's business: told
        // from the method and path before any property is read (each read is a crossing
        // that costs about as much as the header map itself).
        let prefilter = &self.plugin.prefilter;
        if !prefilter.method_may_match(method.as_bytes()) {
            // (Only when `on` could not tell it by `:method` alone: a lookup route, say.)
            return pass();
        }
        let mut metadata_rule = None;
        if !prefilter.path_may_match(path_without_query(path).as_bytes()) {
            // Only a rule the route's metadata names may still apply, whatever the path.
            metadata_rule = route_metadata_rule(host, config);
            if metadata_rule.is_none() {
                return pass();
            }
        } else if let Some(rule) = self.lookup_rule(method, path_without_query(path)) {
            return self.on_lookup(host, rule, &headers, path);
        }
        let route_name = config
            .needs_route_name()
            .then(|| property_string(host, &["xds", "route_name"]))
            .flatten();
        let virtual_host = config
            .needs_virtual_host()
            .then(|| property_string(host, &["xds", "virtual_host_name"]))
            .flatten();
        // A route (named or not) but no virtual host name: an Envoy whose dynamic modules do
        // not give it.
        let virtual_host_unknown = config.needs_virtual_host()
            && virtual_host.is_none()
            && (route_name.is_some()
                || matches!(host.property(&["xds", "route_name"]), Ok(Some(_))));
        let metadata_rule = metadata_rule.or_else(|| route_metadata_rule(host, config));
        let facts = RequestFacts {
            method,
            path: path_without_query(path),
            authority: text(":authority"),
            route_name: route_name.as_deref(),
            virtual_host: virtual_host.as_deref(),
            virtual_host_unknown,
            metadata_rule: metadata_rule.as_deref(),
        };
        let rule = match select(&self.plugin.rules, &facts) {
            Selection::Rule(rule) => Rc::clone(rule),
            Selection::UnknownMetadataRule => {
                log::warn!(
                    "route metadata names rule '{}', which is not configured; request passes",
                    metadata_rule.as_deref().unwrap_or("")
                );
                return pass();
            }
            Selection::VirtualHostUnknown(rule) => {
                // A gRPC rule and a plain HTTP request (or the reverse): not this rule's.
                let Some(rule) = self.rule_for_call(host, Rc::clone(rule), text("content-type"))
                else {
                    return pass();
                };
                log::debug!(
                    "rule '{}' matches by virtual host, and Envoy names none for this routed \
                     request (Envoy 1.39's dynamic modules do not): answered 503",
                    rule.rule.name
                );
                return self.answer_problem(
                    host,
                    &rule,
                    &Problem::unavailable("the filter cannot tell this request's virtual host"),
                );
            }
            Selection::MethodNotCovered | Selection::NoRule => return pass(),
        };
        if self.plugin.config.access_log_fields {
            access_log::publish_rule(host, &rule.rule.name);
        }
        let Some(rule) = self.rule_for_call(host, rule, text("content-type")) else {
            return pass();
        };
        let is_grpc = rule.rule.grpc.is_some();
        let key_metadata = is_grpc
            .then(|| sent_key_metadata(&rule.rule.key_sources, find))
            .flatten();
        // A gRPC call's refusal waits for its body: a streaming call passes whatever its
        // metadata, and only the body tells it from a unary one.
        let mut deferred = None;
        let key_parts = match header_parts(&rule.rule.key_sources, find, path) {
            Ok(parts) => parts,
            Err(failure) if is_grpc => match self.key_refusal(&rule, &failure, FailedAt::Headers) {
                Some(refusal) => {
                    deferred = Some(refusal);
                    Vec::new()
                }
                None => {
                    self.note(host, &rule, Outcome::PassedThrough);
                    return pass();
                }
            },
            Err(failure) => return self.key_failed(host, &rule, &failure, FailedAt::Headers),
        };
        let scope = match scope_of(&rule, &headers) {
            Ok(scope) => scope,
            Err(header) if is_grpc => {
                deferred.get_or_insert((Outcome::MissingScope, Problem::missing_scope(header)));
                Vec::new()
            }
            Err(header) => {
                self.note(host, &rule, Outcome::MissingScope);
                return self.answer_problem(host, &rule, &Problem::missing_scope(header));
            }
        };
        if let Some(upstream) = &rule.rule.detached {
            // Copied now: only the request's own callbacks can read its headers.
            let request_headers = match detached::forwarded_headers(&headers) {
                Ok(kept) => kept,
                Err(name) => {
                    self.note(host, &rule, Outcome::InvalidKey);
                    return self.answer_problem(host, &rule, &Problem::unforwardable_header(&name));
                }
            };
            let route_cluster = match upstream.cluster {
                Some(_) => None,
                None => property_string(host, &["xds", "cluster_name"]),
            };
            *self.detached_intake.borrow_mut() = Some(DetachedIntake {
                request: ForwardedRequest {
                    headers: request_headers,
                    ..ForwardedRequest::default()
                },
                route_cluster,
            });
        }
        let lookup = rule.rule.resolve.as_ref().map(|resolve| {
            let route_cluster = match resolve.cluster {
                Some(_) => None,
                None => property_string(host, &["xds", "cluster_name"]),
            };
            Box::new(LookupParts::read(resolve, &headers, route_cluster))
        });
        let wants_body = needs_body(&rule);
        let pending = PendingRequest {
            rule,
            method: method.to_string(),
            path: path.to_string(),
            content_type: text("content-type").to_string(),
            key_parts,
            scope,
            deferred,
            key_metadata,
            lookup,
        };
        if end_of_stream || !wants_body {
            // Nothing to wait for: claim now, and let any body stream through (held with the
            // request, should it wait, up to what the rule would buffer).
            let streamed = if end_of_stream {
                0
            } else {
                pending.rule.rule.max_request_bytes
            };
            self.held_bytes
                .set(REQUEST_OVERHEAD_BYTES.saturating_add(streamed));
            return self.claim_request(host, pending, &[]);
        }
        // Hold the headers until the whole body is here.
        (Journey::AwaitingBody(Box::new(pending)), Verdict::Pause)
    }

    pub(super) fn on_request_body(
        &self,
        host: &impl Host,
        pending: Box<PendingRequest>,
        size: usize,
        end_of_stream: bool,
    ) -> Step {
        if !end_of_stream
            && pending.rule.rule.grpc.is_some()
            && self.is_streaming_so_far(host, size)
        {
            // Before the size check: a stream's messages add up, a unary call's is one.
            return self.on_several_messages(host, &pending.rule, pending.key_metadata.as_deref());
        }
        let limit = pending.rule.rule.max_request_bytes;
        if size > limit {
            let rule = &pending.rule;
            // A request that sent its key (a gRPC call's metadata, or the header and query
            // parts, all here or it would have passed at its headers) asked for protection,
            // optional key or not: let through, it and each retry of it would run unprotected.
            // Only a key that may be in the body, unread, leaves an optional rule nothing to go on.
            let sent_a_key =
                pending.key_metadata.is_some() || pending.key_parts.iter().any(Option::is_some);
            if rule.rule.key_required || sent_a_key {
                self.note(host, rule, Outcome::InvalidKey);
                return self.answer_problem(host, rule, &Problem::request_too_large(limit));
            }
            self.note(host, rule, Outcome::PassedThrough);
            return pass();
        }
        if !end_of_stream {
            // Keep buffering: Envoy holds the body until the decision.
            return (Journey::AwaitingBody(pending), Verdict::Pause);
        }
        self.with_whole_body(host, *pending, size)
    }

    /// The request's trailers arrived, so its body is complete: a detached rule keeps them
    /// to send with it.
    pub(super) fn on_request_trailers(&self, host: &impl Host, pending: PendingRequest) -> Step {
        if let Some(intake) = self.detached_intake.borrow_mut().as_mut() {
            match host
                .request_trailers()
                .map(|t| detached::forwarded_trailers(&t))
            {
                Ok(Ok(trailers)) => intake.request.trailers = trailers,
                Ok(Err(name)) => {
                    let problem = Problem::unforwardable_header(&name);
                    return self.answer_problem(host, &pending.rule, &problem);
                }
                Err(e) => {
                    log::error!("request trailers unreadable: {}", e.0);
                    let problem = Problem::unavailable("the request trailers could not be read");
                    return self.answer_problem(host, &pending.rule, &problem);
                }
            }
        }
        self.with_whole_body(host, pending, usize::MAX)
    }

    /// The body is complete (its end, or trailers): read it and claim.
    pub(super) fn with_whole_body(
        &self,
        host: &impl Host,
        pending: PendingRequest,
        size: usize,
    ) -> Step {
        match host.request_body(size) {
            Ok(body) => {
                self.held_bytes
                    .set(REQUEST_OVERHEAD_BYTES.saturating_add(body.len()));
                let body: Rc<[u8]> = body.into();
                if let Some(intake) = self.detached_intake.borrow_mut().as_mut() {
                    intake.request.body = Rc::clone(&body);
                }
                self.claim_request(host, pending, &body)
            }
            Err(e) => {
                log::error!("request body unreadable: {}", e.0);
                let problem = Problem::unavailable("the request body could not be read");
                self.answer_problem(host, &pending.rule, &problem)
            }
        }
    }

    /// Completes the key with the body's fields, fingerprints the payload and claims.
    fn claim_request(&self, host: &impl Host, pending: PendingRequest, body: &[u8]) -> Step {
        let rule = pending.rule;
        if rule.rule.grpc.is_some() {
            match call_shape(body) {
                CallShape::Unary => {
                    if let Some((outcome, problem)) = pending.deferred {
                        self.note(host, &rule, outcome);
                        return self.answer_problem(host, &rule, &problem);
                    }
                }
                CallShape::NoMessage => return self.pass_streaming(host, &rule),
                CallShape::SeveralMessages => {
                    let key_metadata = pending.key_metadata.as_deref();
                    return self.on_several_messages(host, &rule, key_metadata);
                }
                CallShape::Malformed => {
                    self.note(host, &rule, Outcome::InvalidKey);
                    return self.answer_problem(host, &rule, &Problem::malformed_grpc());
                }
            }
        }
        let mut parsed = RequestBody::new(&pending.content_type, body);
        // One pass over a JSON body finds the key's fields and the fingerprint's together.
        let fingerprint_fields = match &rule.rule.fingerprint {
            FingerprintMode::Fields(fields) => fields.as_slice(),
            FingerprintMode::Body | FingerprintMode::None => &[],
        };
        parsed.will_read_json(
            rule.rule
                .key_sources
                .iter()
                .filter_map(FieldSource::json_pointer),
            fingerprint_fields
                .iter()
                .filter_map(FieldSource::json_pointer),
        );
        let key_values = match key_values(&rule.rule.key_sources, pending.key_parts, &mut parsed) {
            Ok(values) => values,
            Err(failure) => return self.key_failed(host, &rule, &failure, FailedAt::Body),
        };
        if let (Some(resolve), Some(parts)) = (&rule.rule.resolve, &pending.lookup) {
            match LookupRequest::build(resolve, parts, &key_values) {
                Ok(lookup) => *self.lookup.borrow_mut() = Some(lookup),
                Err(NoLookup::Unfit(unfit)) => {
                    let what = match &unfit.input {
                        LookupInput::KeySource(i) => match rule.rule.key_sources.get(*i) {
                            Some(source) => {
                                format!("idempotency key from the {}", source.describe())
                            }
                            None => "idempotency key".to_string(),
                        },
                        LookupInput::Header(name) => format!("header '{name}'"),
                    };
                    self.note(host, &rule, Outcome::InvalidKey);
                    let problem = Problem::unfit_for_lookup(&what, &unfit.why);
                    return self.answer_problem(host, &rule, &problem);
                }
                Err(NoLookup::NoCluster) => log::warn!(
                    "rule {}: no lookup for this request (the route's cluster is unknown and \
                     the rule names none); should its outcome be unknown, it stays so",
                    rule.rule.name
                ),
            }
        }
        let key = combine(key_values);
        let fingerprint = match fingerprint(
            &rule.rule.fingerprint,
            &pending.method,
            &pending.path,
            &mut parsed,
            body,
            if rule.rule.grpc.is_some() {
                Protocol::Grpc
            } else {
                Protocol::Http
            },
        ) {
            Ok(f) => f,
            Err(failure) => return self.key_failed(host, &rule, &failure, FailedAt::Body),
        };
        let scope: Vec<Option<&[u8]>> = pending.scope.iter().map(|v| v.as_deref()).collect();
        let storage = storage_key(&rule.rule.name, &scope, &key);
        self.claim(host, rule, storage, fingerprint)
    }

    fn key_failed(
        &self,
        host: &impl Host,
        rule: &RuleHandle,
        failure: &SourceFailure,
        at: FailedAt,
    ) -> Step {
        match self.key_refusal(rule, failure, at) {
            Some((outcome, problem)) => {
                self.note(host, rule, outcome);
                self.answer_problem(host, rule, &problem)
            }
            None => {
                self.note(host, rule, Outcome::PassedThrough);
                pass()
            }
        }
    }

    /// What a key source's failure answers; None: the request passes unprotected (the key
    /// is optional and absent, or a body source of an optional key failed).
    fn key_refusal(
        &self,
        rule: &RuleHandle,
        failure: &SourceFailure,
        at: FailedAt,
    ) -> Option<(Outcome, Problem)> {
        if !rule.rule.key_required && (failure.is_missing() || at == FailedAt::Body) {
            return None;
        }
        Some(refusal_for(failure))
    }
}

/// What a key source's failure answers, and how it is counted: absent, or present but unusable.
pub(super) fn refusal_for(failure: &SourceFailure) -> (Outcome, Problem) {
    match failure {
        SourceFailure::Missing { source } => (Outcome::MissingKey, Problem::missing_key(source)),
        SourceFailure::Invalid { source, why } => {
            (Outcome::InvalidKey, Problem::invalid_key(source, why))
        }
    }
}

/// The request's scope under `rule`, or the scope header it lacks. Every value of a repeated
/// scope header counts, not only the first.
pub(super) fn scope_of<'r>(
    rule: &'r RuleHandle,
    headers: &HeaderPairs,
) -> Result<Vec<Option<Vec<u8>>>, &'r str> {
    let all_values = |name: &str| {
        headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
            .collect()
    };
    request_scope(
        &rule.rule.scope_headers,
        rule.rule.scope_required,
        all_values,
    )
}

/// A string property, or None when absent or unreadable.
fn property_string(host: &impl Host, path: &[&str]) -> Option<String> {
    match host.property(path) {
        Ok(Some(bytes)) => String::from_utf8(bytes).ok().filter(|s| !s.is_empty()),
        Ok(None) => None,
        Err(e) => {
            log::debug!("property {} unreadable: {}", path.join("."), e.0);
            None
        }
    }
}

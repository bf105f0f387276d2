//! A caller's lookup route (`lookup`): a `GET` of the rule's lookup path asks what the filter
//! holds for the caller's own key. Answered from the local table in single-proxy mode, from
//! the store in cluster mode (the local table is only its cache); nothing is ever claimed or
//! executed.

use std::rc::Rc;

use super::intake::{refusal_for, scope_of};
use super::{send_local, Journey, RequestJourney, Step, StoreCall, Verdict};
use crate::config::StoreTransport;
use crate::host::{HeaderPairs, Host};
use crate::lookup_route::{answer, found_in_http, Found};
use crate::outcome::Outcome;
use crate::problem::Problem;
use crate::rule_handle::RuleHandle;
use crate::store::calls::{self, StoreOp};
use crate::store::client::StoreFailure;
use crate::table::Kept;
use idempotency_protocol::naming::fields::RequestBody;
use idempotency_protocol::naming::source::{combine, header_parts, key_values};
use idempotency_protocol::naming::{storage_key, to_hex};
use idempotency_protocol::record::RecordedResponse;
use idempotency_protocol::stream::CallOp;
use idempotency_protocol::wire::LookupBody;

impl RequestJourney {
    /// The rule whose lookup route `method` and `path` (without its query) are, if any.
    pub(super) fn lookup_rule(&self, method: &str, path: &str) -> Option<Rc<RuleHandle>> {
        if !self.plugin.has_lookup_routes || !(method == "GET" || method == "HEAD") {
            return None;
        }
        self.plugin
            .rules
            .iter()
            .find(|r| r.rule.lookup_route.as_ref().is_some_and(|l| l.path == path))
            .cloned()
    }

    /// A lookup: the caller's key and scope, as its writes carry them, name the record.
    pub(super) fn on_lookup(
        &self,
        host: &impl Host,
        rule: Rc<RuleHandle>,
        headers: &HeaderPairs,
        path_with_query: &str,
    ) -> Step {
        self.note(host, &rule, Outcome::LookedUp);
        let find = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_slice())
        };
        let parts = match header_parts(&rule.rule.key_sources, find, path_with_query) {
            Ok(parts) => parts,
            Err(failure) => return self.answer_problem(host, &rule, &refusal_for(&failure).1),
        };
        let scope = match scope_of(&rule, headers) {
            Ok(scope) => scope,
            Err(header) => {
                return self.answer_problem(host, &rule, &Problem::missing_scope(header))
            }
        };
        let mut no_body = RequestBody::new("", &[]);
        let key = match key_values(&rule.rule.key_sources, parts, &mut no_body) {
            Ok(values) => combine(values),
            Err(failure) => return self.answer_problem(host, &rule, &refusal_for(&failure).1),
        };
        let scope: Vec<Option<&[u8]>> = scope.iter().map(|v| v.as_deref()).collect();
        let key = storage_key(&rule.rule.name, &scope, &key);
        if let Some(store) = rule.store.clone() {
            let sent = match store.transport {
                StoreTransport::Grpc => {
                    self.send_on_stream(host, &rule, CallOp::Lookup { key: to_hex(&key) })
                }
                StoreTransport::Http => {
                    let body =
                        serde_json::to_vec(&LookupBody { key: to_hex(&key) }).unwrap_or_default();
                    calls::send(host, &store, StoreOp::Lookup, &body)
                        .map(StoreCall::Callout)
                        .map_err(|e| e.0)
                }
            };
            return match sent {
                Ok(call) => (Journey::LookingUp { rule, call }, Verdict::Pause),
                Err(why) => self.lookup_answer(host, &rule, Err(StoreFailure::NotSent(why))),
            };
        }
        let now = host.now_ms();
        let found = match self.plugin.table.find(host, &key, now) {
            Ok(Kept::None) => Found::None,
            Ok(Kept::InFlight { retry_after_ms }) => Found::InFlight { retry_after_ms },
            Ok(Kept::Completed {
                slot,
                owner,
                status,
                expires_at_ms,
                recorded_at_ms,
            }) => {
                let mut response = self
                    .plugin
                    .table
                    .load_response(host, slot, owner)
                    .ok()
                    .flatten()
                    .unwrap_or_else(|| RecordedResponse::status_only(status));
                if rule.rule.only_tombstone_at(&response, recorded_at_ms, now) {
                    // What a retry would get now: the tombstone.
                    response = response.without_body();
                }
                Found::Completed {
                    response: Box::new(response),
                    expires_at_ms: Some(expires_at_ms),
                }
            }
            Err(e) => {
                log::error!("rule {}: lookup failed: {}", rule.rule.name, e.0);
                let problem = Problem::unavailable("the proxy's idempotency table is unavailable");
                return self.answer_problem(host, &rule, &problem);
            }
        };
        self.lookup_answer(host, &rule, Ok(found))
    }

    /// The store answered a lookup (or failed to).
    pub(super) fn lookup_answer(
        &self,
        host: &impl Host,
        rule: &RuleHandle,
        found: Result<Found, StoreFailure>,
    ) -> Step {
        let found = match found {
            Ok(found) => found,
            Err(failure) => {
                log::warn!(
                    "rule {}: a lookup's store call failed: {failure}",
                    rule.rule.name
                );
                let problem = Problem::unavailable("the idempotency store could not be reached");
                return self.answer_problem(host, rule, &problem);
            }
        };
        let include = rule
            .rule
            .lookup_route
            .as_ref()
            .is_some_and(|l| l.include_response);
        let (status, body) = answer(&found, include, host.now_ms());
        let headers: [(&str, &[u8]); 2] = [
            ("content-type", b"application/json"),
            ("cache-control", b"no-store"),
        ];
        send_local(host, &rule.rule.name, status, &headers, &body)
    }

    /// The client left before the store answered its lookup.
    pub(super) fn abandon_lookup(&self, rule: &RuleHandle, call: StoreCall) -> Step {
        if let (StoreCall::Stream(id), Some(link)) = (call, self.plugin.link_for(rule)) {
            link.forget(id);
        }
        (Journey::Finished, Verdict::Continue)
    }

    /// The store's answer to a lookup sent as a callout.
    pub(super) fn lookup_callout_answer(
        &self,
        host: &impl Host,
        rule: &RuleHandle,
        num_headers: usize,
        body_size: usize,
    ) -> Step {
        let calls::StoreAnswer { status, body } = calls::read_answer(host, num_headers, body_size);
        self.lookup_answer(host, rule, found_in_http(status, &body))
    }
}

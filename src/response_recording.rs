//! The upstream's answer: release the claim on a releasing status, otherwise copy the
//! response as it streams to the client and record it at its end (locally, and through the
//! root context in the store).

use std::rc::Rc;

use idempotency_core::capture::ResponseCapture;
use idempotency_core::outcome::Outcome;
use idempotency_core::record::RecordedResponse;
use idempotency_core::store_client;
use idempotency_core::table::{Completion, Held};
use proxy_wasm::types::{BufferType, MapType};

use crate::host;
use crate::http_filter::{Journey, RequestFilter, StoreOwner};
use crate::shared_table::EnvoySharedData;
use crate::store_writes::LeanBody;

impl RequestFilter {
    pub(crate) fn on_response_headers(&mut self, end_of_stream: bool) {
        if let Journey::Replaying { restore } = &self.journey {
            for (name, value) in restore {
                if let Err(status) = host::replace_header(MapType::HttpResponseHeaders, name, value)
                {
                    log::warn!("replayed {name} not restored: {status}");
                }
            }
            self.journey = Journey::AnsweredLocally;
            return;
        }
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
        let status = host::status_of(&headers).unwrap_or(0);
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

    pub(crate) fn on_response_body(&mut self, body_size: usize, end_of_stream: bool) {
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

    fn release(&mut self, rule_index: usize, held: &Held, store_owner: Option<StoreOwner>) {
        self.journey = Journey::Finished;
        self.count(rule_index, Outcome::Released);
        if let Some(owner) = store_owner {
            let body = store_client::release_body(&held.key, &owner.token);
            self.submit_store_release(rule_index, owner.confirmed, body);
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

    /// The stream ended (client or upstream gone) after response headers that did not release
    /// the claim: record what passed without its body, so a retry gets the status and headers
    /// instead of a second execution. Before any response headers, the claim stays in flight
    /// until its lease ends: whether the upstream acted is unknowable here.
    pub(crate) fn on_stream_end(&mut self) {
        match &mut self.journey {
            Journey::Executing {
                capture: Some(capture),
                ..
            } => {
                capture.omit_body();
                self.record();
            }
            Journey::AwaitingStore { .. } => {
                // The client left while the store was confirming: nothing went upstream, so
                // free the key here and (should the store have applied it) in the store.
                if let Journey::AwaitingStore {
                    rule, held, owner, ..
                } = std::mem::replace(&mut self.journey, Journey::Finished)
                {
                    self.release_local(&held);
                    let body = store_client::release_body(&held.key, &owner);
                    self.submit_store_release(rule, false, body);
                }
            }
            _ => {}
        }
    }

    /// The response is complete: record it for replays.
    pub(crate) fn record(&mut self) {
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
        if let Some(owner) = store_owner {
            // The cluster-wide record matters most: queue it first, from the root context.
            let body = store_client::complete_body(
                &held.key,
                &held.fingerprint,
                &owner.token,
                rule.ttl_ms,
                &response,
            );
            let lean = (!response.body.is_empty()).then(|| {
                let (key, fingerprint) = (held.key, held.fingerprint);
                let (token, ttl_ms) = (owner.token.clone(), rule.ttl_ms);
                let without_body = RecordedResponse {
                    owner: response.owner,
                    status: response.status,
                    headers: response.headers.clone(),
                    body: Vec::new(),
                    body_omitted: true,
                };
                Box::new(move || {
                    store_client::complete_body(&key, &fingerprint, &token, ttl_ms, &without_body)
                }) as LeanBody
            });
            self.submit_store_completion(rule_index, owner.confirmed, body, lean);
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
            Err(e) => {
                log::error!("rule {}: response not recorded: {e}", rule.name);
                self.count(rule_index, Outcome::NotRecorded);
            }
        }
    }
}

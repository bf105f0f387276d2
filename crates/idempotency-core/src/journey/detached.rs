//! A detached write (`execution: "detached"`): the request that holds the key is not let on
//! to Envoy's router; its copy goes upstream as a callout of the root context, which
//! outlives the client. Its answer is recorded (or releases the key, or is an unknown
//! outcome) as a routed answer would be, whether or not the client is still there, and goes
//! to the client if it is. See `plugin::detached` for the root's side.

use std::rc::Rc;

use super::response::judges_gateway_errors;
use super::NO_ROUTER_RETRIES;
use super::{send_response, Execution, Journey, RequestJourney, Step, StoreOwner, Verdict};
use crate::capture::ResponseCapture;
use crate::gave_up::{self, Judgement};
use crate::host::{HeaderPairs, Host};
use crate::outcome::Outcome;
use crate::plugin::detached::{
    DetachedAnswer, DetachedCarry, DetachedWrite, ForwardedRequest, PortableDetached,
};
use crate::problem::Problem;
use crate::rule_handle::RuleHandle;
use crate::table::Completion;
use crate::who_answered::{Answerer, EnvoyReport};
use idempotency_protocol::record::{key_expires_value, RecordedResponse, KEY_EXPIRES_HEADER};

/// Headers of one connection, not of the request: never forwarded (Envoy frames the callout
/// itself, content-length included).
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "expect",
    "content-length",
];

/// Request headers that steer Envoy's router rather than describe the request. The callout
/// runs the router too, and it obeys them from anyone: a client Envoy treats as internal
/// could make it resend the write (`x-envoy-retry-on`, `x-envoy-max-retries`, hedging) or
/// lift the rule's timeout (`x-envoy-upstream-rq-timeout-ms: 0`). None reaches the copy;
/// the filter caps retries itself, and Envoy sets `x-envoy-internal` and
/// `x-envoy-expected-rq-timeout-ms` on every callout.
const ROUTER_CONTROL: [&str; 14] = [
    "x-envoy-retry-on",
    "x-envoy-retry-grpc-on",
    "x-envoy-max-retries",
    "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names",
    "x-envoy-upstream-rq-timeout-ms",
    "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-hedge-on-per-try-timeout",
    "x-envoy-upstream-rq-timeout-alt-response",
    "x-envoy-upstream-stream-duration-ms",
    "x-envoy-upstream-alt-stat-name",
    "x-envoy-expected-rq-timeout-ms",
    "x-envoy-attempt-count",
    ENVOY_INTERNAL,
];

const ENVOY_INTERNAL: &str = "x-envoy-internal";

/// Whether Envoy had marked the original request internal, on every copy, because Envoy's
/// callout sets `x-envoy-internal: true` on all of them whatever the client was
/// (proxy-wasm cannot ask it not to). An upstream that trusts `x-envoy-internal` puts this
/// value back in its place with an upstream filter on the cluster
/// (docs/detached-writes.md#what-the-upstream-receives).
pub const ORIGINAL_INTERNAL: &str = "x-idempotency-original-internal";

/// What a detached rule keeps of the request at intake, while its own callbacks can read it.
pub struct DetachedIntake {
    pub request: ForwardedRequest,
    /// The cluster the route chose (`xds.cluster_name`), when the rule names none.
    pub route_cluster: Option<String>,
}

/// A detached write in flight.
pub struct DetachedRun {
    pub run: Execution,
    /// False once the client left or Envoy answered it itself: the answer is only recorded.
    pub client_here: bool,
}

/// The request headers as the upstream receives them: the client's, without those of the
/// connection or the router, plus the retry cap and the original's internal mark; Err names
/// a header whose value is not text (the callout ABI carries values as UTF-8).
pub(super) fn forwarded_headers(headers: &HeaderPairs) -> Result<Vec<(String, String)>, String> {
    let internal = headers
        .iter()
        .rev()
        .find(|(name, _)| name == ENVOY_INTERNAL)
        .is_some_and(|(_, value)| value.as_slice() == b"true");
    let kept = headers.iter().filter(|(name, _)| {
        let name = name.as_str();
        !HOP_BY_HOP.contains(&name) && !ROUTER_CONTROL.contains(&name) && name != ORIGINAL_INTERNAL
    });
    let mut forwarded = as_text(kept)?;
    forwarded.push((NO_ROUTER_RETRIES.to_string(), "0".to_string()));
    let internal = if internal { "true" } else { "false" };
    forwarded.push((ORIGINAL_INTERNAL.to_string(), internal.to_string()));
    Ok(forwarded)
}

/// Trailers as the upstream would receive them (today Envoy's callout drops request
/// trailers; see docs/detached-writes.md).
pub(super) fn forwarded_trailers(trailers: &HeaderPairs) -> Result<Vec<(String, String)>, String> {
    as_text(trailers.iter())
}

/// The pairs as text; Err names the first whose value is not UTF-8.
fn as_text<'a>(
    pairs: impl Iterator<Item = &'a (String, Vec<u8>)>,
) -> Result<Vec<(String, String)>, String> {
    pairs
        .map(|(name, value)| match std::str::from_utf8(value) {
            Ok(text) => Ok((name.clone(), text.to_string())),
            Err(_) => Err(name.clone()),
        })
        .collect()
}

impl RequestJourney {
    /// The key is held: send the request from the root instead of letting it on. A request
    /// the filter has no copy of, or no cluster for (a route answered by Envoy itself), runs
    /// inline, as any other.
    pub(super) fn detach(&self, host: &impl Host, run: Execution) -> Step {
        let rule = Rc::clone(&run.rule);
        let Some(upstream) = rule.rule.detached.as_ref() else {
            return (Journey::Executing(run), Verdict::Continue);
        };
        let intake = self.detached_intake.borrow_mut().take();
        let reachable = self.journeys.is_live(self.context_id);
        let (Some(intake), true) = (intake, reachable) else {
            log::warn!(
                "rule {}: no copy of the request to detach; it runs inline",
                rule.rule.name
            );
            return (Journey::Executing(run), Verdict::Continue);
        };
        let Some(cluster) = upstream.cluster.clone().or(intake.route_cluster) else {
            if let Some(suppressed) = self.plugin.detached_log.borrow_mut().admit(host.now_ms()) {
                log::warn!(
                    "rule {}: the route has no cluster and the rule names no upstream_cluster; \
                     the request runs inline ({suppressed} similar not logged)",
                    rule.rule.name
                );
            }
            return (Journey::Executing(run), Verdict::Continue);
        };
        if self.plugin.detached.sent_elsewhere() {
            return self.detach_elsewhere(host, run, intake.request, cluster);
        }
        let Some(ticket) = self.plugin.detached.reserve(intake.request.bytes()) else {
            // Nothing was sent: free the key and let the client retry.
            if let Some(suppressed) = self.plugin.detached_log.borrow_mut().admit(host.now_ms()) {
                log::warn!(
                    "rule {}: the worker holds as many detached writes as it may; refused with \
                     503 ({suppressed} similar not logged)",
                    rule.rule.name
                );
            }
            let _released = self.release(host, run);
            let problem = Problem::unavailable("the proxy holds as many detached writes as it may");
            return self.answer_problem(host, &rule, &problem);
        };
        self.note(host, &rule, Outcome::Detached);
        // Kept alive for the root, which hands it the answer even after its client left.
        self.journeys.keep(self.context_id);
        self.plugin.detached.queue(DetachedWrite {
            context_id: self.context_id,
            rule: Rc::clone(&rule),
            cluster,
            request: intake.request,
            timeout_ms: upstream.timeout_ms,
            ticket,
        });
        self.plugin.writes.wake_root(host);
        let detached = DetachedRun {
            run,
            client_here: true,
        };
        (Journey::Detached(detached), Verdict::Pause)
    }

    /// Hands the write, with its claim, to the root that sends this worker's detached
    /// writes; this request waits for the answer the host brings back. Its lease is that
    /// root's to renew from now on.
    fn detach_elsewhere(
        &self,
        host: &impl Host,
        run: Execution,
        request: ForwardedRequest,
        cluster: String,
    ) -> Step {
        let rule = Rc::clone(&run.rule);
        self.note(host, &rule, Outcome::Detached);
        self.plugin.leases.end(run.held.owner);
        let timeout_ms = rule.rule.detached.as_ref().map_or(0, |d| d.timeout_ms);
        let ForwardedRequest {
            headers,
            body,
            trailers,
        } = request;
        self.plugin
            .detached
            .carry(DetachedCarry::Write(Box::new(PortableDetached {
                rule: rule.rule.clone(),
                held: run.held,
                store_owner: run.store_owner.map(|o| (o.token, o.confirmed)),
                started_ms: run.started_ms,
                cluster,
                headers,
                body: body.to_vec(),
                trailers,
                timeout_ms,
                origin: self.context_id,
                handed_ms: host.now_ms(),
            })));
        (Journey::DetachedElsewhere, Verdict::Pause)
    }

    /// On the root that sends other roots' detached writes: runs `write` as this journey
    /// (context `self.context_id`, which the host maps to the worker's request), holding its
    /// claim and lease, as `detach` does for a request of this root's own. A write this root
    /// has no room for frees its key and answers 503, as there.
    pub fn run_carried(&mut self, host: &impl Host, rule: Rc<RuleHandle>, write: PortableDetached) {
        let PortableDetached {
            held,
            store_owner,
            started_ms,
            cluster,
            headers,
            body,
            trailers,
            timeout_ms,
            handed_ms,
            ..
        } = write;
        let run = Execution {
            rule: Rc::clone(&rule),
            held,
            store_owner: store_owner.map(|(token, confirmed)| StoreOwner { token, confirmed }),
            capture: None,
            started_ms,
            proxy_words: None,
        };
        let request = ForwardedRequest {
            headers,
            body: body.into(),
            trailers,
        };
        // Nobody renewed the claim's lease since the worker handed it over: a write that took
        // too long to get here, or whose claim is no longer held, is not sent (its claim may
        // have lapsed, and a retry may have taken the key and run it). Nothing ran: the key is
        // freed and the client may retry.
        let now = host.now_ms();
        let lease_ms = rule.rule.lease_ms;
        let fresh = now < handed_ms.saturating_add(lease_ms / 4);
        let held = fresh
            && !matches!(
                self.plugin.table.renew(host, &run.held, now, lease_ms),
                Ok(Completion::LostOwnership) | Err(_)
            );
        if !held {
            log::warn!(
                "rule {}: a detached write reached the root that sends it {} ms after its \
                 request handed it over, or its claim is gone; not sent (503)",
                rule.rule.name,
                now.saturating_sub(handed_ms)
            );
            let _released = self.release(host, run);
            let problem = Problem::unavailable("the proxy could not send it to the service");
            self.journey = self.answer_problem(host, &rule, &problem).0;
            return;
        }
        let Some(ticket) = self.plugin.detached.reserve(request.bytes()) else {
            log::warn!(
                "rule {}: the proxy holds as many detached writes as it may; refused with 503",
                rule.rule.name
            );
            let _released = self.release(host, run);
            let problem = Problem::unavailable("the proxy holds as many detached writes as it may");
            self.journey = self.answer_problem(host, &rule, &problem).0;
            return;
        };
        // Renewed by this root from now on: the worker's may not run while the write does.
        // Only a claim the store confirmed is renewed there (as `execute` does): the store
        // would call an unconfirmed one lost, and the lease would stop being renewed here too.
        let store_lease = run
            .store_owner
            .as_ref()
            .filter(|o| o.confirmed)
            .map(|o| o.token.clone());
        self.plugin.leases.begin(&rule, &run.held, store_lease, now);
        // The store's copy of the lease at once too (the caller renews what is due).
        self.plugin.leases.renew_soon(run.held.owner);
        self.journeys.keep(self.context_id);
        self.plugin.detached.queue(DetachedWrite {
            context_id: self.context_id,
            rule,
            cluster,
            request,
            timeout_ms,
            ticket,
        });
        self.journey = Journey::Detached(DetachedRun {
            run,
            client_here: true,
        });
    }

    /// The detached write's answer (delivered by the root): recorded, released or an unknown
    /// outcome, by the same rules as a routed answer; then sent to the client if it is there.
    pub(super) fn on_detached_answer(
        &self,
        host: &impl Host,
        detached: DetachedRun,
        answer: DetachedAnswer,
    ) -> Step {
        let DetachedRun { run, client_here } = detached;
        let rule = Rc::clone(&run.rule);
        let name = &rule.rule.name;
        let DetachedAnswer::Response {
            status,
            headers,
            body,
            body_omitted,
            elapsed_ms,
            timeout_ms,
        } = answer
        else {
            if let DetachedAnswer::NotSent(why) = &answer {
                log::error!("rule {name}: detached write not sent: {why}");
            }
            let _released = self.release(host, run);
            if !client_here {
                return (Journey::Finished, Verdict::Continue);
            }
            let problem = Problem::unavailable("the proxy could not send it to the service");
            return self.answer_problem(host, &rule, &problem);
        };
        let (mut answerer, mut report) =
            EnvoyReport::of_detached(status, &body, elapsed_ms, timeout_ms);
        if answerer == (Answerer::Upstream { resent: false })
            && judges_gateway_errors(&rule, &headers)
        {
            if let Judgement::GaveUp(reason) = gave_up::of_answer(status, &headers, &body) {
                answerer = Answerer::Unknown;
                report = report.gave_up_behind(reason);
            }
        }
        let expires = key_expires_value(run.started_ms.saturating_add(rule.rule.ttl_ms));
        let releases = match answerer {
            Answerer::Upstream { .. } => rule.rule.release.releases(status),
            Answerer::NeverReached => true,
            Answerer::Unknown => false,
        };
        let _recorded = if answerer == Answerer::Unknown {
            self.unknown_outcome(host, run, &report)
        } else if answerer == Answerer::NeverReached {
            self.never_reached(host, run, &report)
        } else if releases {
            self.release(host, run)
        } else {
            let mut capture = ResponseCapture::start(
                &rule.rule,
                status,
                headers.iter().map(|(n, v)| (n.as_str(), v.as_slice())),
            );
            if body_omitted {
                capture.omit_body();
            } else {
                capture.push_body(&body);
            }
            capture.set_key_expiry(&expires);
            self.record(
                host,
                Execution {
                    capture: Some(capture),
                    ..run
                },
            )
        };
        if !client_here {
            if answerer != Answerer::Unknown && !releases {
                self.note(host, &rule, Outcome::CompletedAfterClientLeft);
            }
            return (Journey::Finished, Verdict::Continue);
        }
        if status == 0 {
            return self.answer_problem(host, &rule, &Problem::outcome_unknown());
        }
        // The client gets the upstream's whole response (its cookies too), not the replay's
        // filtered copy; only a replay carries the replay marker.
        let mut forwarded: Vec<(String, Vec<u8>)> = headers
            .into_iter()
            .filter(|(n, _)| {
                !n.starts_with(':')
                    && !HOP_BY_HOP.contains(&n.as_str())
                    && *n != rule.rule.replay_header
                    && n != KEY_EXPIRES_HEADER
            })
            .collect();
        if !releases {
            forwarded.push((KEY_EXPIRES_HEADER.to_string(), expires.into_bytes()));
        }
        let response = RecordedResponse {
            owner: 0,
            status,
            headers: forwarded,
            body,
            trailers: Vec::new(),
            body_omitted,
            unknown: None,
        };
        send_response(host, &rule, &response, false)
    }
}

//! Who answered a request that went upstream, and what its retry gets: the upstream's own
//! answer follows `release_on_status`; Envoy's answer to a request that never reached the
//! upstream frees the key; every other answer (a timeout, a reset after the request was
//! sent, a router that sent it twice) is an unknown outcome, kept until the TTL. Live leases
//! are renewed by the root, so a write that outlives its lease is never taken over.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::cell::RefCell;

use super::*;
use crate::journey::NO_ROUTER_RETRIES;
use crate::outcome::Outcome;
use crate::root::PluginRoot;
use crate::who_answered::flag;

const UT: u64 = flag::UPSTREAM_REQUEST_TIMEOUT;
const URX: u64 = flag::UPSTREAM_RETRY_LIMIT_EXCEEDED;
const UR: u64 = flag::UPSTREAM_REMOTE_RESET;

/// Envoy answers `status` itself (or the upstream does, with details `via_upstream`).
fn answered(
    host: &FakeHost,
    request: &mut RequestJourney,
    status: u16,
    details: &str,
    flags: u64,
    attempts: i64,
) {
    envoy_reports(host, details, flags, attempts);
    respond(host, request, status, b"");
}

/// What a retry of `k1` gets: executed (None) or the status and problem type of the reply.
pub(super) fn retry(host: &FakeHost, plugin: &Rc<Plugin>) -> Option<(u16, String)> {
    let _ = host.take_effects();
    let (request, verdict) = post(host, plugin, "k1", b"{}");
    if verdict == Verdict::Continue {
        assert!(is_executing(&request));
        return None;
    }
    let (status, _, body) = the_reply(&host.take_effects());
    let kind = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["type"].as_str().map(str::to_string))
        .unwrap_or_default();
    Some((status, kind))
}

/// A root context (id 1) configured with `config`, the effective context.
fn configured_root(host: &FakeHost, config: &[u8]) -> PluginRoot {
    *host.configuration.borrow_mut() = config.to_vec();
    host.effective_context.set(1);
    let mut root = PluginRoot::new(1);
    assert!(root.on_configure(host));
    root
}

pub(super) fn is_unknown(answer: &Option<(u16, String)>) -> bool {
    matches!(answer, Some((409, kind)) if kind.ends_with("outcome-unknown"))
}

#[test]
fn every_protected_request_that_goes_upstream_asks_the_router_not_to_retry_it() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    post(&host, &plugin, "k1", b"{}");
    assert_eq!(
        host.request_header_edits.borrow().as_slice(),
        &[(NO_ROUTER_RETRIES.to_string(), b"0".to_vec())]
    );
    // A request no rule covers is left as it is, and so is one the filter answers itself.
    host.request_header_edits.borrow_mut().clear();
    send(&host, &plugin, &post_headers("/other", Some("k2")), b"{}");
    assert!(host.request_header_edits.borrow().is_empty());
    post(&host, &plugin, "k1", b"{}");
    assert_eq!(the_reply(&host.take_effects()).0, 409, "still in flight");
    assert!(
        host.request_header_edits.borrow().is_empty(),
        "never going upstream"
    );
}

#[test]
fn envoys_timeouts_and_resets_after_sending_are_unknown_outcomes_kept_past_the_lease() {
    for (status, details, flags, attempts) in [
        (504, "response_timeout", UT, 1),
        (504, "upstream_per_try_timeout", UT | URX, 1),
        (
            503,
            "upstream_reset_before_response_started{connection_termination}",
            0x40,
            1,
        ),
        (
            503,
            "upstream_reset_before_response_started{remote_reset}",
            0x10,
            1,
        ),
        (
            502,
            "upstream_reset_before_response_started{protocol_error}",
            0x80_0000,
            1,
        ),
        // The router resent it despite the header, and the last attempt was refused.
        (
            503,
            "upstream_reset_before_response_started{remote_connection_failure}",
            0x20 | URX,
            2,
        ),
        (503, REFUSED_STREAM, UR | URX, 2),
    ] {
        let host = FakeHost::default();
        let plugin = plugin(&host, ORDERS);
        let (mut first, _) = post(&host, &plugin, "k1", b"{}");
        answered(&host, &mut first, status, details, flags, attempts);
        assert_eq!(
            host.counter("orders", Outcome::OutcomeUnknown),
            1,
            "{details}"
        );
        assert_eq!(host.counter("orders", Outcome::Released), 0, "{details}");
        assert!(is_unknown(&retry(&host, &plugin)), "{details}");
        // Not a lease: the key stays taken until the record's TTL.
        host.advance_ms(3_600_000);
        assert!(is_unknown(&retry(&host, &plugin)), "{details}");
        host.advance_ms(86_400_000);
        assert_eq!(retry(&host, &plugin), None, "{details}: after the TTL");
    }
}

#[test]
fn envoys_answers_to_a_request_that_never_reached_the_upstream_free_the_key() {
    for (details, flags, attempts) in [
        (
            "upstream_reset_before_response_started{remote_connection_failure}",
            0x20,
            1,
        ),
        (
            "upstream_reset_before_response_started{remote_connection_failure}",
            0x20 | URX,
            1,
        ),
        ("no_healthy_upstream", flag::NO_HEALTHY_UPSTREAM, 1),
        (
            "upstream_reset_before_response_started{overflow}",
            flag::UPSTREAM_OVERFLOW,
            1,
        ),
        ("cluster_not_found", flag::NO_CLUSTER_FOUND, 0),
        // An HTTP/2 upstream refused the stream (above its stream limit, or going away).
        (REFUSED_STREAM, UR, 1),
        (REFUSED_STREAM, UR | URX, 1),
    ] {
        let host = FakeHost::default();
        let plugin = plugin(&host, ORDERS);
        let (mut first, _) = post(&host, &plugin, "k1", b"{}");
        answered(&host, &mut first, 503, details, flags, attempts);
        assert_eq!(host.counter("orders", Outcome::Released), 1, "{details}");
        assert_eq!(retry(&host, &plugin), None, "{details}: the retry executes");
    }
}

#[test]
fn the_upstreams_own_answers_follow_release_on_status() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    answered(&host, &mut first, 500, "via_upstream", 0, 1);
    assert_eq!(host.counter("orders", Outcome::Released), 1);
    let (mut second, _) = post(&host, &plugin, "k1", b"{}");
    assert!(is_executing(&second));
    answered(&host, &mut second, 201, "via_upstream", 0, 1);
    let (status, _) = retry(&host, &plugin).unwrap();
    assert_eq!(status, 201, "replayed");
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 0);
}

#[test]
fn a_request_the_router_sent_twice_is_counted_and_its_failure_is_unknown() {
    for (status, then) in [(201, Some(201)), (500, Some(409))] {
        let host = FakeHost::default();
        let config = plugin(&host, ORDERS);
        let (mut first, _) = post(&host, &config, "k1", b"{}");
        answered(&host, &mut first, status, "via_upstream", URX, 3);
        assert_eq!(host.counter("orders", Outcome::Resent), 1);
        let answer = retry(&host, &config);
        // A success is recorded as the upstream gave it (the write may have run twice: the
        // counter says so); a failure after earlier attempts may hide one that did the write.
        assert_eq!(answer.as_ref().map(|a| a.0), then, "{status}");
        if status == 500 {
            assert!(is_unknown(&answer));
        }
    }
}

#[test]
fn on_unknown_outcome_release_frees_the_key_as_before() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
            "on_unknown_outcome":"release"}]}"#,
    );
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    answered(&host, &mut first, 504, "response_timeout", UT, 1);
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 1);
    assert_eq!(host.counter("orders", Outcome::Released), 1);
    assert_eq!(retry(&host, &plugin), None);
}

#[test]
fn a_held_duplicate_is_told_the_outcome_is_unknown() {
    let host = FakeHost::default();
    let mut root = configured_root(
        &host,
        br#"{"rules":[{"name":"orders",
        "match":{"path_prefixes":["/orders"]},"on_in_flight":"wait","wait_ms":2000}]}"#,
    );
    let (first, _) = post_in_context(&host, &root, 7, "k1");
    let (second, verdict) = post_in_context(&host, &root, 8, "k1");
    assert_eq!(verdict, Verdict::Pause);
    host.effective_context.set(7);
    envoy_reports(&host, "response_timeout", UT, 1);
    respond(&host, &mut first.borrow_mut(), 504, b"");
    let _ = host.take_effects();
    host.effective_context.set(1);
    root.on_tick(&host);
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(status, 409);
    assert!(problem_type(&body).ends_with("outcome-unknown"));
    assert_eq!(header(&headers, "retry-after"), None);
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknownAnswered), 1);
    drop::<Rc<RefCell<RequestJourney>>>(second);
}

#[test]
fn a_write_that_outlives_its_lease_is_renewed_and_never_taken_over() {
    let host = FakeHost::default();
    let mut root = configured_root(
        &host,
        br#"{"rules":[{"name":"orders",
        "match":{"path_prefixes":["/orders"]},"lease_seconds":3}]}"#,
    );
    // The tick comes often enough to renew a 3 s lease.
    assert!(host.tick_period_ms.get().unwrap() <= 750);
    let (first, _) = post_in_context(&host, &root, 7, "k1");
    assert!(is_executing(&first.borrow()));
    for _ in 0..40 {
        host.advance_ms(250);
        host.effective_context.set(1);
        root.on_tick(&host);
    }
    // Ten seconds on, past three leases: still in flight, not taken over.
    let (dup, verdict) = post_in_context(&host, &root, 8, "k1");
    assert_eq!(verdict, Verdict::Pause);
    assert!(!is_executing(&dup.borrow()));
    assert_eq!(the_reply(&host.take_effects()).0, 409);
    assert_eq!(host.counter("orders", Outcome::TakenOver), 0);
    // Once the request ends, nothing renews it: a cut-short end is an unknown outcome, and
    // a lease no longer matters.
    host.effective_context.set(7);
    envoy_reports(&host, "via_upstream", 0, 1);
    respond(&host, &mut first.borrow_mut(), 201, b"{}");
    assert_eq!(root.plugin().unwrap().leases.len(), 0);
}

#[test]
fn a_request_envoy_let_go_of_is_no_longer_renewed() {
    let host = FakeHost::default();
    let mut root = configured_root(
        &host,
        br#"{"rules":[{"name":"orders",
        "match":{"path_prefixes":["/orders"]},"lease_seconds":3}]}"#,
    );
    let (first, _) = post_in_context(&host, &root, 7, "k1");
    assert_eq!(root.plugin().unwrap().leases.len(), 1);
    drop(first);
    assert_eq!(root.plugin().unwrap().leases.len(), 0);
    for _ in 0..16 {
        host.advance_ms(250);
        host.effective_context.set(1);
        root.on_tick(&host);
    }
    // Its lease lapsed: the proxy-died window, where a takeover is what remains.
    let (retry, _) = post_in_context(&host, &root, 8, "k1");
    assert!(is_executing(&retry.borrow()));
    assert_eq!(host.counter("orders", Outcome::TakenOver), 1);
}

#[test]
fn a_live_request_renews_its_store_lease_in_one_call_per_rule_and_counts_a_lost_one() {
    let host = FakeHost::default();
    let mut root = configured_root(
        &host,
        br#"{"store":{"cluster":"store","transport":"http"},
        "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},"lease_seconds":3}]}"#,
    );
    let mut running = Vec::new();
    for (context, key) in [(7, "k1"), (8, "k2")] {
        let (journey, verdict) = post_in_context(&host, &root, context, key);
        assert_eq!(verdict, Verdict::Pause, "waits for the store");
        store_claims(&host, &journey, &format!("0{context}"));
        running.push(journey);
    }
    let _ = host.take_effects();
    // Nothing is due before a third of the lease.
    host.advance_ms(900);
    root.on_tick(&host);
    assert!(renewals(&host.take_effects()).is_empty());
    host.advance_ms(200);
    root.on_tick(&host);
    let sent = renewals(&host.take_effects());
    assert_eq!(sent.len(), 1, "one call for both: {sent:?}");
    let (token, body) = &sent[0];
    assert_eq!(body["lease_ms"], 3000);
    let owners: Vec<String> = body["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["owner"].as_str().unwrap().to_string())
        .collect();
    let mut sorted = owners.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, ["07", "08"]);
    // The store says the second of them was taken over meanwhile: counted, and renewed no
    // more.
    let answer = br#"{"outcome":"renewed","lost":[1]}"#;
    host.set_callout_answer(Some(200), answer);
    root.on_callout_answer(&host, *token, 1, answer.len());
    assert_eq!(host.counter("orders", Outcome::LeaseLost), 1);
    let _ = host.take_effects();
    host.advance_ms(1_100);
    root.on_tick(&host);
    let sent = renewals(&host.take_effects());
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].1["leases"].as_array().unwrap().len(), 1);
    assert_eq!(sent[0].1["leases"][0]["owner"], owners[0].as_str());
    // A request that ended is renewed no more either.
    let kept = if owners[0] == "07" { 0 } else { 1 };
    host.effective_context.set(if kept == 0 { 7 } else { 8 });
    envoy_reports(&host, "via_upstream", 0, 1);
    respond(&host, &mut running[kept].borrow_mut(), 201, b"{}");
    host.effective_context.set(1);
    let _ = host.take_effects();
    host.advance_ms(1_100);
    root.on_tick(&host);
    assert!(renewals(&host.take_effects()).is_empty());
    assert_eq!(
        host.counter("orders", Outcome::LeaseLost),
        1,
        "nothing else lost"
    );
}

#[test]
fn a_request_running_past_its_ttl_is_renewed_no_more() {
    let host = FakeHost::default();
    let mut root = configured_root(
        &host,
        br#"{"store":{"cluster":"store","transport":"http"},
        "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
                  "lease_seconds":3,"ttl_seconds":10}]}"#,
    );
    let (journey, _) = post_in_context(&host, &root, 7, "k1");
    store_claims(&host, &journey, "07");
    let mut renewed = 0;
    for _ in 0..12 {
        host.advance_ms(1_000);
        root.on_tick(&host);
        renewed += renewals(&host.take_effects()).len();
    }
    // A third of the lease is a second: renewed at 1 s to 9 s, and not once 10 s (the TTL)
    // have passed.
    assert_eq!(renewed, 9);
    host.advance_ms(5_000);
    root.on_tick(&host);
    assert!(renewals(&host.take_effects()).is_empty());
}

/// The store answers the claim callout `journey` sent: claimed for `owner`; it runs.
fn store_claims(host: &FakeHost, journey: &Rc<RefCell<RequestJourney>>, owner: &str) {
    let token = host
        .take_effects()
        .into_iter()
        .find_map(|e| match e {
            Effect::Callout { token, .. } => Some(token),
            _ => None,
        })
        .unwrap();
    let claimed = format!(r#"{{"outcome":"claimed","owner":"{owner}"}}"#);
    host.set_callout_answer(Some(200), claimed.as_bytes());
    journey.borrow_mut().on(
        host,
        Event::CalloutAnswer {
            token,
            num_headers: 1,
            body_size: claimed.len(),
        },
    );
    assert!(is_executing(&journey.borrow()));
}

/// The renewal callouts among `effects`: token and JSON body.
fn renewals(effects: &[Effect]) -> Vec<(u32, serde_json::Value)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Callout {
                token, path, body, ..
            } if path.ends_with("/renew") => Some((*token, serde_json::from_slice(body).unwrap())),
            _ => None,
        })
        .collect()
}

#[test]
fn a_running_write_whose_step_faulted_is_an_unknown_outcome_never_run_again() {
    // The native build catches a panic in a step, which may have taken the state with it:
    // the write may have run, so it must be kept as an unknown outcome, not freed.
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    assert!(is_executing(&first));
    first.after_fault(&host);
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 1);
    assert!(matches!(first.state(), Journey::Finished));
    assert!(is_unknown(&retry(&host, &plugin)));
    host.advance_ms(3_600_000);
    assert!(is_unknown(&retry(&host, &plugin)));
}

#[test]
fn a_request_whose_step_faulted_before_it_ran_leaves_no_outcome() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut refused, _) = post(&host, &plugin, "", b"{}");
    refused.after_fault(&host);
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 0);
    assert_eq!(retry(&host, &plugin), None, "the key is free");
}

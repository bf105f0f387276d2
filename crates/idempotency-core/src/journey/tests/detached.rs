//! Detached writes (`execution: "detached"`): the root sends the request's copy upstream,
//! the client gets the answer if it is still there, the answer is recorded either way, and a
//! retry replays it; a timeout is an unknown outcome; what never reached the upstream frees
//! the key.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::cell::RefCell;

use super::*;
use crate::fake_host::HostCall;
use crate::outcome::Outcome;
use crate::plugin::detached::{DetachedWrites, MAX_DETACHED_BYTES};
use crate::root::PluginRoot;

const ROOT: u32 = 1;
const DETACHED: &str = r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
    "execution":"detached","upstream_cluster":"orders-svc","upstream_timeout_ms":5000}]}"#;

fn root(host: &FakeHost, config: &str) -> PluginRoot {
    configured_root(host, config, ROOT)
}

fn tick(host: &FakeHost, root: &mut PluginRoot) {
    host.effective_context.set(ROOT);
    root.on_tick(host);
}

/// The detached callouts among `effects`: token, cluster, headers, body, trailers, timeout.
type SentCopy = (
    u32,
    String,
    Vec<(String, String)>,
    Vec<u8>,
    Vec<(String, String)>,
    u64,
);

fn detached_sent(effects: &[Effect]) -> Vec<SentCopy> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Callout {
                token,
                cluster,
                headers,
                body,
                trailers,
                timeout_ms,
                ..
            } if cluster != "store" => Some((
                *token,
                cluster.clone(),
                headers.clone(),
                body.clone(),
                trailers.clone(),
                *timeout_ms,
            )),
            _ => None,
        })
        .collect()
}

/// A POST in `context` that the root then sends; returns its journey and the callout token.
fn detached_post(
    host: &FakeHost,
    root: &mut PluginRoot,
    context: u32,
    key: &str,
) -> (Rc<RefCell<RequestJourney>>, u32) {
    let (journey, verdict) = post_in_context(host, root, context, key);
    assert_eq!(verdict, Verdict::Pause, "the request itself never goes on");
    let effects = host.take_effects();
    assert!(!effects.contains(&Effect::Resume));
    assert!(
        detached_sent(&effects).is_empty(),
        "sent by the root, not the request"
    );
    tick(host, root);
    let sent = detached_sent(&host.take_effects());
    assert_eq!(sent.len(), 1, "one copy sent");
    (journey, sent[0].0)
}

/// The upstream answers the detached write `token` (delivered to the root, as Envoy does).
fn upstream_answers(
    host: &FakeHost,
    root: &mut PluginRoot,
    token: u32,
    status: Option<u16>,
    body: &[u8],
) {
    host.set_callout_answer(status, body);
    host.effective_context.set(ROOT);
    root.on_callout_answer(host, token, usize::from(status.is_some()), body.len());
}

#[test]
fn the_root_sends_the_copy_and_the_client_gets_the_upstreams_answer() {
    let host = FakeHost::default();
    let mut root = root(&host, DETACHED);
    let (journey, verdict) = post_in_context(&host, &root, 2, "k1");
    assert_eq!(verdict, Verdict::Pause);
    assert!(matches!(journey.borrow().state(), Journey::Detached(_)));
    let _ = host.take_effects();
    tick(&host, &mut root);
    let sent = detached_sent(&host.take_effects());
    let (token, cluster, headers, body, _, timeout_ms) = sent[0].clone();
    assert_eq!(cluster, "orders-svc");
    assert_eq!(timeout_ms, 5000);
    assert_eq!(body, b"{}");
    let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
    for name in [
        ":method",
        ":path",
        ":authority",
        "idempotency-key",
        "content-type",
    ] {
        assert!(names.contains(&name), "{name} forwarded: {names:?}");
    }
    assert_eq!(host.counter("orders", Outcome::Detached), 1);

    upstream_answers(&host, &mut root, token, Some(201), br#"{"order":1}"#);
    let effects = host.take_effects();
    assert!(
        effects.contains(&Effect::Switched(2)),
        "answered in the request's context"
    );
    let (status, headers, body) = the_reply(&effects);
    assert_eq!(status, 201);
    assert_eq!(body, br#"{"order":1}"#);
    assert_eq!(
        header(&headers, "idempotent-replayed"),
        None,
        "the original, not a replay"
    );
    assert_eq!(effects.last(), Some(&Effect::Switched(ROOT)));
    assert!(matches!(journey.borrow().state(), Journey::AnsweredLocally));

    // The retry replays it.
    let (_, verdict) = post_in_context(&host, &root, 3, "k1");
    assert_eq!(verdict, Verdict::Pause);
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.as_slice()), (201, &br#"{"order":1}"#[..]));
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
}

#[test]
fn a_client_that_left_still_gets_its_write_recorded_and_its_retry_replays_it() {
    let host = FakeHost::default();
    let mut root = root(&host, DETACHED);
    let (journey, token) = detached_post(&host, &mut root, 2, "k1");
    // The client hangs up; Envoy ends the stream and destroys its context.
    host.effective_context.set(2);
    journey.borrow_mut().on(&host, Event::StreamEnd);
    drop(journey);
    host.gone_contexts.borrow_mut().insert(2);

    // A retry while the write still runs: 409, never a second copy.
    let (_, _) = post_in_context(&host, &root, 3, "k1");
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 409);
    assert!(problem_type(&body).ends_with("request-in-flight"));
    tick(&host, &mut root);
    assert!(detached_sent(&host.take_effects()).is_empty());

    upstream_answers(&host, &mut root, token, Some(201), br#"{"order":1}"#);
    assert!(replies(&host.take_effects()).is_empty(), "nobody to answer");
    assert_eq!(host.counter("orders", Outcome::CompletedAfterClientLeft), 1);
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 0);

    let (_, _) = post_in_context(&host, &root, 4, "k1");
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.as_slice()), (201, &br#"{"order":1}"#[..]));
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
}

#[test]
fn a_callout_past_its_timeout_is_an_unknown_outcome_never_run_again() {
    let host = FakeHost::default();
    let mut root = root(&host, DETACHED);
    let (_journey, token) = detached_post(&host, &mut root, 2, "k1");
    host.advance_ms(5000);
    upstream_answers(
        &host,
        &mut root,
        token,
        Some(504),
        b"upstream request timeout",
    );
    let (status, _, _) = the_reply(&host.take_effects());
    assert_eq!(
        status, 504,
        "the client gets Envoy's timeout, as a routed request would"
    );
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 1);

    let (_, _) = post_in_context(&host, &root, 3, "k1");
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 409);
    assert!(problem_type(&body).ends_with("outcome-unknown"));
    tick(&host, &mut root);
    assert!(
        detached_sent(&host.take_effects()).is_empty(),
        "never sent again"
    );
}

#[test]
fn an_exchange_lost_midway_is_an_unknown_outcome_and_the_client_is_told_so() {
    let host = FakeHost::default();
    let mut root = root(&host, DETACHED);
    let (_journey, token) = detached_post(&host, &mut root, 2, "k1");
    upstream_answers(&host, &mut root, token, None, b"");
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 409);
    assert!(problem_type(&body).ends_with("outcome-unknown"));
    let (_, _) = post_in_context(&host, &root, 3, "k1");
    let (_, _, body) = the_reply(&host.take_effects());
    assert!(problem_type(&body).ends_with("outcome-unknown"));
}

#[test]
fn what_never_reached_the_upstream_frees_the_key() {
    let refused = "upstream connect error or disconnect/reset before headers. reset reason: \
                   remote connection failure, transport failure reason: delayed connect error: 111";
    for (status, body) in [
        (503, refused),
        (503, "no healthy upstream"),
        (503, r#"{"busy":true}"#),
    ] {
        let host = FakeHost::default();
        let mut root = root(&host, DETACHED);
        let (_journey, token) = detached_post(&host, &mut root, 2, "k1");
        upstream_answers(&host, &mut root, token, Some(status), body.as_bytes());
        let (got, _, _) = the_reply(&host.take_effects());
        assert_eq!(got, status, "{body}");
        assert_eq!(host.counter("orders", Outcome::Released), 1, "{body}");
        // The retry runs.
        let (_journey, _) = detached_post(&host, &mut root, 3, "k1");
    }
}

#[test]
fn a_reset_after_sending_is_an_unknown_outcome() {
    let host = FakeHost::default();
    let mut root = root(&host, DETACHED);
    let (_journey, token) = detached_post(&host, &mut root, 2, "k1");
    let reset = "upstream connect error or disconnect/reset before headers. reset reason: \
                 connection termination";
    upstream_answers(&host, &mut root, token, Some(503), reset.as_bytes());
    let _ = host.take_effects();
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 1);
    assert_eq!(host.counter("orders", Outcome::Released), 0);
}

#[test]
fn a_proxy_behind_that_gives_up_is_an_unknown_outcome() {
    let nginx = "<html><head><title>504 Gateway Time-out</title></head></html>";
    for (status, body) in [(504, nginx), (502, "Bad Gateway")] {
        let host = FakeHost::default();
        let mut root = root(&host, DETACHED);
        let (_journey, token) = detached_post(&host, &mut root, 2, "k1");
        // Well within the callout's timeout: the upstream's answer, from a proxy behind it.
        upstream_answers(&host, &mut root, token, Some(status), body.as_bytes());
        let _ = host.take_effects();
        assert_eq!(
            host.counter("orders", Outcome::OutcomeUnknown),
            1,
            "{status}"
        );
        assert_eq!(host.counter("orders", Outcome::Released), 0, "{status}");
    }
}

#[test]
fn a_callout_envoy_refuses_frees_the_key_and_answers_503() {
    let host = FakeHost::default();
    let mut root = root(&host, DETACHED);
    let (_journey, _) = post_in_context(&host, &root, 2, "k1");
    let _ = host.take_effects();
    host.fail(HostCall::Callout);
    tick(&host, &mut root);
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 503);
    assert!(problem_type(&body).ends_with("idempotency-unavailable"));
    host.heal(HostCall::Callout);
    let (_journey, _) = detached_post(&host, &mut root, 3, "k1");
}

#[test]
fn without_a_cluster_in_the_rule_the_routes_is_used_and_without_either_it_runs_inline() {
    let config = r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "execution":"detached"}]}"#;
    let host = FakeHost::default();
    let mut root = root(&host, config);
    host.properties
        .borrow_mut()
        .insert("xds.cluster_name".into(), b"route-cluster".to_vec());
    let (_journey, _) = post_in_context(&host, &root, 2, "k1");
    let _ = host.take_effects();
    tick(&host, &mut root);
    let sent = detached_sent(&host.take_effects());
    assert_eq!(sent[0].1, "route-cluster");
    assert_eq!(sent[0].5, 15_000, "Envoy's own default route timeout");

    host.properties.borrow_mut().remove("xds.cluster_name");
    let (journey, verdict) = post_in_context(&host, &root, 3, "k2");
    assert_eq!(
        verdict,
        Verdict::Continue,
        "a route answered by Envoy itself runs inline"
    );
    assert!(matches!(journey.borrow().state(), Journey::Executing(_)));
}

/// The copy the root hands to Envoy of a POST with `extra` headers, and `trailers` after
/// its body when there are any.
fn copy_of(extra: &[(&str, &str)], trailers: &[(&str, &str)]) -> Option<SentCopy> {
    let host = FakeHost::default();
    let mut root = root(&host, DETACHED);
    host.effective_context.set(2);
    let mut headers = post_headers("/orders", Some("k1"));
    headers.extend_from_slice(extra);
    host.set_request(&headers, b"{}");
    *host.request_trailers.borrow_mut() = trailers
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    let journey = root.new_request(2).unwrap();
    journey.borrow_mut().on(
        &host,
        Event::RequestHeaders {
            end_of_stream: false,
        },
    );
    journey.borrow_mut().on(
        &host,
        Event::RequestBody {
            size: 2,
            end_of_stream: trailers.is_empty(),
        },
    );
    if !trailers.is_empty() {
        let verdict = journey.borrow_mut().on(&host, Event::RequestTrailers);
        assert_eq!(verdict, Verdict::Pause);
    }
    let _ = host.take_effects();
    tick(&host, &mut root);
    detached_sent(&host.take_effects()).into_iter().next()
}

fn copy_headers_of(extra: &[(&str, &str)]) -> Vec<(String, String)> {
    copy_of(extra, &[]).map(|copy| copy.2).unwrap_or_default()
}

#[test]
fn hop_by_hop_headers_stay_behind_and_trailers_are_handed_to_envoy() {
    let extra = [
        ("connection", "keep-alive"),
        ("transfer-encoding", "chunked"),
        ("x-request-id", "r-1"),
    ];
    let (_, _, headers, body, trailers, _) = copy_of(&extra, &[("x-checksum", "abc")]).unwrap();
    let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"x-request-id"));
    assert!(!names.contains(&"connection") && !names.contains(&"transfer-encoding"));
    assert_eq!(body, b"{}");
    assert_eq!(
        trailers,
        vec![("x-checksum".to_string(), "abc".to_string())]
    );
}

fn values<'a>(headers: &'a [(String, String)], name: &str) -> Vec<&'a str> {
    headers
        .iter()
        .filter(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
        .collect()
}

#[test]
fn the_copy_obeys_no_clients_router_headers_and_is_sent_once() {
    let copy = copy_headers_of(&[
        ("x-envoy-retry-on", "gateway-error,reset"),
        ("x-envoy-retry-grpc-on", "unavailable"),
        ("x-envoy-max-retries", "3"),
        ("x-envoy-upstream-rq-per-try-timeout-ms", "200"),
        ("x-envoy-upstream-rq-timeout-ms", "0"),
        ("x-envoy-hedge-on-per-try-timeout", "true"),
        ("x-envoy-retriable-status-codes", "409"),
        ("x-request-id", "r-1"),
    ]);
    assert!(!copy.is_empty(), "the write was sent");
    let envoy: Vec<&str> = copy
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| n.starts_with("x-envoy-"))
        .collect();
    assert_eq!(envoy, vec!["x-envoy-max-retries"], "{copy:?}");
    assert_eq!(values(&copy, "x-envoy-max-retries"), vec!["0"]);
    assert_eq!(
        values(&copy, "x-request-id"),
        vec!["r-1"],
        "other headers go on"
    );
}

#[test]
fn the_copy_says_whether_envoy_had_marked_the_request_internal() {
    let external = copy_headers_of(&[]);
    assert_eq!(
        values(&external, "x-idempotency-original-internal"),
        vec!["false"]
    );
    assert!(values(&external, "x-envoy-internal").is_empty());
    let internal = copy_headers_of(&[("x-envoy-internal", "true")]);
    assert_eq!(
        values(&internal, "x-idempotency-original-internal"),
        vec!["true"]
    );
    assert!(
        values(&internal, "x-envoy-internal").is_empty(),
        "Envoy's callout sets its own"
    );
    // A client cannot claim to be internal through the marker itself.
    let forged = copy_headers_of(&[("x-idempotency-original-internal", "true")]);
    assert_eq!(
        values(&forged, "x-idempotency-original-internal"),
        vec!["false"]
    );
}

#[test]
fn a_header_value_that_is_not_text_is_refused_with_400_before_the_claim() {
    let host = FakeHost::default();
    let root = root(&host, DETACHED);
    host.effective_context.set(2);
    host.set_request(&post_headers("/orders", Some("k1")), b"{}");
    host.request_headers
        .borrow_mut()
        .push(("x-name".into(), vec![0xff, 0xfe]));
    let journey = root.new_request(2).unwrap();
    journey.borrow_mut().on(
        &host,
        Event::RequestHeaders {
            end_of_stream: false,
        },
    );
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 400);
    assert!(problem_type(&body).ends_with("header-not-forwardable"));
    // Nothing was claimed: a clean retry runs.
    let mut root = root;
    let (_journey, _) = detached_post(&host, &mut root, 3, "k1");
}

#[test]
fn a_response_over_max_response_bytes_reaches_the_client_and_retries_without_its_body() {
    let config = r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "execution":"detached","upstream_cluster":"orders-svc","max_response_bytes":4}]}"#;
    let host = FakeHost::default();
    let mut root = root(&host, config);
    let (_journey, token) = detached_post(&host, &mut root, 2, "k1");
    upstream_answers(&host, &mut root, token, Some(201), b"0123456789");
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(status, 201);
    assert!(body.is_empty());
    assert_eq!(
        header(&headers, "idempotent-body-omitted"),
        Some(&b"true"[..])
    );
    let (_, _) = post_in_context(&host, &root, 3, "k1");
    let (status, headers, _) = the_reply(&host.take_effects());
    assert_eq!(status, 201);
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
}

#[test]
fn a_retired_configuration_stays_until_its_detached_writes_are_answered() {
    let host = FakeHost::default();
    let mut root = root(&host, DETACHED);
    let (_journey, token) = detached_post(&host, &mut root, 2, "k1");
    assert!(!root.on_done(), "kept: a write is in flight");
    upstream_answers(&host, &mut root, token, Some(201), b"{}");
    assert!(host.take_effects().contains(&Effect::Done));
}

#[test]
fn in_cluster_mode_the_answer_of_a_client_that_left_is_completed_in_the_store_as_the_root() {
    let config = r#"{"store":{"cluster":"store","transport":"http"},
        "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},"ttl_seconds":60,
        "execution":"detached","upstream_cluster":"orders-svc"}]}"#;
    let host = FakeHost::default();
    let mut root = root(&host, config);
    let (journey, _) = post_in_context(&host, &root, 2, "k1");
    let claim = host
        .take_effects()
        .into_iter()
        .find_map(|e| match e {
            Effect::Callout { token, path, .. } if path.ends_with("/claim") => Some(token),
            _ => None,
        })
        .expect("a claim callout");
    host.set_callout_answer(Some(200), br#"{"outcome":"claimed","owner":"o1"}"#);
    journey.borrow_mut().on(
        &host,
        Event::CalloutAnswer {
            token: claim,
            num_headers: 1,
            body_size: 34,
        },
    );
    journey.borrow_mut().on(&host, Event::StreamEnd);
    drop(journey);
    host.gone_contexts.borrow_mut().insert(2);
    tick(&host, &mut root);
    let sent = detached_sent(&host.take_effects());
    assert_eq!(sent.len(), 1);
    upstream_answers(&host, &mut root, sent[0].0, Some(201), b"{}");
    tick(&host, &mut root);
    let completions: Vec<Effect> = host
        .take_effects()
        .into_iter()
        .filter(|e| matches!(e, Effect::Callout { path, .. } if path.ends_with("/complete")))
        .collect();
    assert_eq!(completions.len(), 1, "recorded in the store");
}

#[test]
fn the_worker_holds_detached_writes_to_a_byte_budget() {
    let writes = DetachedWrites::default();
    let all = writes
        .reserve(MAX_DETACHED_BYTES)
        .expect("the whole budget");
    assert!(writes.reserve(1).is_none(), "nothing more while it is held");
    assert_eq!(writes.bytes(), MAX_DETACHED_BYTES);
    drop(all);
    assert_eq!(writes.bytes(), 0);
    assert!(writes.reserve(1).is_some());
}

#[test]
fn a_write_refused_for_lack_of_room_leaves_no_lease_behind() {
    let host = FakeHost::default();
    let mut root = root(&host, DETACHED);
    let plugin = root.plugin().unwrap();
    let budget = plugin.detached.reserve(MAX_DETACHED_BYTES).unwrap();
    let (_refused, verdict) = post_in_context(&host, &root, 2, "k1");
    assert_eq!(verdict, Verdict::Pause);
    let (status, _, _) = the_reply(&host.take_effects());
    assert_eq!(status, 503, "refused, nothing sent");
    assert_eq!(plugin.leases.len(), 0, "nothing runs, so nothing is leased");
    drop(budget);
    // The retry takes the freed key and runs; renewing never finds the refused one's
    // claim taken over.
    let (_retry, _) = detached_post(&host, &mut root, 3, "k1");
    for _ in 0..4 {
        host.advance_ms(5_000);
        tick(&host, &mut root);
    }
    assert_eq!(host.counter("orders", Outcome::LeaseLost), 0);
}

#[test]
fn a_write_envoy_never_answers_ends_as_an_unknown_outcome_not_a_key_held_forever() {
    let host = FakeHost::default();
    let mut root = root(&host, DETACHED);
    let (_journey, token) = detached_post(&host, &mut root, 2, "k1");
    host.advance_ms(5_000 + 9_000);
    tick(&host, &mut root);
    assert!(
        replies(&host.take_effects()).is_empty(),
        "not yet: within the grace period"
    );
    host.advance_ms(1_000);
    tick(&host, &mut root);
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 409);
    assert!(problem_type(&body).ends_with("outcome-unknown"));
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 1);
    assert!(root.on_done(), "nothing left in flight");
    // The answer arriving after all is ignored.
    upstream_answers(&host, &mut root, token, Some(201), b"{}");
    assert!(replies(&host.take_effects()).is_empty());
}

/// The native build: a worker's root hands its detached writes, claim and lease included, to
/// a root of the same configuration on Envoy's main thread (`send_detached_elsewhere`), which
/// sends each, records its answer whether or not the client is still there, and answers in a
/// context of its own that the host maps to the worker's request.
fn worker_and_sender(host: &FakeHost) -> (PluginRoot, PluginRoot) {
    let worker = root(host, DETACHED);
    worker.send_detached_elsewhere();
    let sender = configured_root(host, DETACHED, 50);
    (worker, sender)
}

/// The worker's request `context` detaches; the sender takes it on as its context `as_context`
/// and sends it: the callout's token.
fn carried_post(
    host: &FakeHost,
    worker: &PluginRoot,
    sender: &mut PluginRoot,
    context: u32,
    as_context: u32,
    key: &str,
) -> (Rc<RefCell<RequestJourney>>, u32) {
    let (journey, verdict) = post_in_context(host, worker, context, key);
    assert_eq!(verdict, Verdict::Pause, "the request waits for the answer");
    assert!(matches!(
        journey.borrow().state(),
        Journey::DetachedElsewhere
    ));
    assert!(
        detached_sent(&host.take_effects()).is_empty(),
        "not sent by the worker"
    );
    let carried = worker.detached_to_carry();
    assert_eq!(carried.len(), 1);
    let crate::plugin::detached::DetachedCarry::Write(write) = carried.into_iter().next().unwrap()
    else {
        panic!("a write")
    };
    assert_eq!(write.origin, context);
    host.effective_context.set(50);
    sender.take_detached(host, vec![(as_context, *write)]);
    let sent = detached_sent(&host.take_effects());
    assert_eq!(sent.len(), 1, "sent at once by the sender");
    (journey, sent[0].0)
}

fn sender_gets(host: &FakeHost, sender: &mut PluginRoot, token: u32, status: u16, body: &[u8]) {
    host.set_callout_answer(Some(status), body);
    host.effective_context.set(50);
    sender.on_callout_answer(host, token, 1, body.len());
}

#[test]
fn a_write_sent_elsewhere_answers_its_client_through_the_senders_context() {
    let host = FakeHost::default();
    let (worker, mut sender) = worker_and_sender(&host);
    let (_journey, token) = carried_post(&host, &worker, &mut sender, 2, 900, "e1");
    // A retry meanwhile: 409, never a second copy.
    let (_, _) = post_in_context(&host, &worker, 3, "e1");
    assert_eq!(the_reply(&host.take_effects()).0, 409);

    sender_gets(&host, &mut sender, token, 201, br#"{"order":7}"#);
    let effects = host.take_effects();
    assert!(
        effects.contains(&Effect::Switched(900)),
        "answered in the mapped context"
    );
    let (status, _, body) = the_reply(&effects);
    assert_eq!((status, body.as_slice()), (201, &br#"{"order":7}"#[..]));
    assert_eq!(
        host.counter("orders", Outcome::Detached),
        1,
        "counted once, by the worker"
    );

    let (_, _) = post_in_context(&host, &worker, 4, "e1");
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.as_slice()), (201, &br#"{"order":7}"#[..]));
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
}

#[test]
fn a_write_sent_elsewhere_whose_client_left_is_recorded_without_an_answer() {
    let host = FakeHost::default();
    let (worker, mut sender) = worker_and_sender(&host);
    let (journey, token) = carried_post(&host, &worker, &mut sender, 2, 901, "e2");
    host.effective_context.set(2);
    journey.borrow_mut().on(&host, Event::StreamEnd);
    let notices = worker.detached_to_carry();
    assert!(
        matches!(
            notices.as_slice(),
            [crate::plugin::detached::DetachedCarry::ClientLeft(2)]
        ),
        "the worker says its client left"
    );
    host.effective_context.set(50);
    sender.client_left(&host, 901);
    host.gone_contexts.borrow_mut().insert(901);

    sender_gets(&host, &mut sender, token, 201, br#"{"order":8}"#);
    assert!(replies(&host.take_effects()).is_empty(), "nobody to answer");
    assert_eq!(host.counter("orders", Outcome::CompletedAfterClientLeft), 1);
    let (_, _) = post_in_context(&host, &worker, 4, "e2");
    assert_eq!(
        the_reply(&host.take_effects()).0,
        201,
        "the retry replays it"
    );
}

/// The sender renews the claim's lease while the write runs (the worker's root, which may
/// not run at all, no longer does): a write longer than its lease is never taken over.
#[test]
fn the_sender_keeps_the_lease_of_a_write_it_runs() {
    let host = FakeHost::default();
    let config = r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "execution":"detached","upstream_cluster":"orders-svc","upstream_timeout_ms":60000,
        "lease_seconds":2}]}"#;
    let worker = configured_root(&host, config, ROOT);
    worker.send_detached_elsewhere();
    let mut sender = configured_root(&host, config, 50);
    let (_journey, _token) = carried_post(&host, &worker, &mut sender, 2, 902, "e3");
    for _ in 0..10 {
        host.advance_ms(1_000);
        host.effective_context.set(50);
        sender.on_tick(&host);
        let _ = host.take_effects();
    }
    let (_, verdict) = post_in_context(&host, &worker, 3, "e3");
    assert_eq!(verdict, Verdict::Pause, "not taken over after five leases");
    assert_eq!(the_reply(&host.take_effects()).0, 409);
}

/// Nobody renews a claim between the worker's handing it over and the sender's taking it: a
/// write that arrives later than a quarter of its lease is not sent (the claim may have
/// lapsed and a retry run it); its key is freed, as nothing ran, and its client told 503.
#[test]
fn a_write_handed_over_too_long_ago_is_not_sent() {
    let host = FakeHost::default();
    let config = r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "execution":"detached","upstream_cluster":"orders-svc","lease_seconds":2}]}"#;
    let worker = configured_root(&host, config, ROOT);
    worker.send_detached_elsewhere();
    let mut sender = configured_root(&host, config, 50);
    let (_journey, verdict) = post_in_context(&host, &worker, 2, "e4");
    assert_eq!(verdict, Verdict::Pause);
    let _ = host.take_effects();
    let carried = worker.detached_to_carry();
    let crate::plugin::detached::DetachedCarry::Write(write) = carried.into_iter().next().unwrap()
    else {
        panic!("a write")
    };
    host.advance_ms(600);
    host.effective_context.set(50);
    sender.take_detached(&host, vec![(903, *write)]);
    let effects = host.take_effects();
    assert!(detached_sent(&effects).is_empty(), "not sent");
    assert_eq!(the_reply(&effects).0, 503);
    let (_, verdict) = post_in_context(&host, &worker, 3, "e4");
    assert_eq!(verdict, Verdict::Pause);
    assert!(
        matches!(
            worker.detached_to_carry().as_slice(),
            [crate::plugin::detached::DetachedCarry::Write(_)]
        ),
        "the key was freed: the retry runs"
    );
}

//! Cluster mode over the store stream: claims go out as the root from the request's context,
//! answers come back through the root into the request's context, and a stream that closes,
//! freezes or is not open yet gives each waiting request its rule's policy, never a hang.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::cell::RefCell;

use idempotency_protocol::stream::{decode_call, encode_answer, Answer, CallOp, Reply};

use super::*;
use crate::fake_host::HostCall;
use crate::host::HeaderPairs;
use crate::outcome::Outcome;
use crate::root::PluginRoot;
use crate::store::link::MAX_MESSAGE_BYTES;
use idempotency_protocol::record::RecordedResponse;

pub(super) const ROOT: u32 = 1;
pub(super) const REQUEST: u32 = 7;

pub(super) fn config(policy: &str) -> String {
    format!(
        r#"{{"store":{{"cluster":"store","token":"s3cret","timeout_ms":250}},
            "access_log_fields":true,
            "rules":[{{"name":"orders","match":{{"path_prefixes":["/orders"]}},
            "on_store_error":"{policy}","max_response_bytes":8388608}}]}}"#
    )
}

/// A root configured as Envoy does it (the root's context is the effective one).
pub(super) fn root_with(host: &FakeHost, config: &str) -> PluginRoot {
    *host.configuration.borrow_mut() = config.as_bytes().to_vec();
    host.effective_context.set(ROOT);
    let mut root = PluginRoot::new(ROOT);
    assert!(root.on_configure(host));
    root
}

/// The streams opened and the calls sent (stream, sending context, call) among `effects`.
pub(super) fn opened(effects: &[Effect]) -> Vec<(u32, HeaderPairs)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::StreamOpened {
                stream, metadata, ..
            } => Some((*stream, metadata.clone())),
            _ => None,
        })
        .collect()
}

pub(super) fn calls(effects: &[Effect]) -> Vec<(u32, u32, idempotency_protocol::stream::Call)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::StreamMessage {
                stream,
                context,
                message,
            } => Some((*stream, *context, decode_call(message).unwrap())),
            _ => None,
        })
        .collect()
}

/// A request in its own context: headers and body of a POST to /orders with `key`.
pub(super) fn request(
    host: &FakeHost,
    root: &PluginRoot,
    key: &str,
) -> Rc<RefCell<RequestJourney>> {
    let (journey, verdict) = post_in_context(host, root, REQUEST, key);
    assert_eq!(verdict, Verdict::Pause, "held for the store");
    journey
}

/// The store's answer to call `id`, delivered to the root in the root's context.
pub(super) fn answer(host: &FakeHost, root: &mut PluginRoot, stream: u32, id: u64, reply: Reply) {
    host.effective_context.set(ROOT);
    let message = encode_answer(&Answer { id, reply });
    let size = message.len();
    *host.grpc_message.borrow_mut() = message;
    root.on_grpc_message(host, stream, size);
}

pub(super) fn claimed(owner: &str) -> Reply {
    Reply::Claimed {
        owner: owner.into(),
        lease_expires_at_ms: 1,
    }
}

/// The one claim among the calls sent since the last look: its id and owner.
pub(super) fn sent_claim(host: &FakeHost) -> (u64, String) {
    let sent = calls(&host.take_effects());
    match &sent[..] {
        [(_, _, call)] => match &call.op {
            CallOp::Claim { owner, .. } => (call.id, owner.clone()),
            other => panic!("not a claim: {other:?}"),
        },
        _ => panic!("expected one call, got {sent:?}"),
    }
}

/// A configured root whose stream opened: the host, the root and the stream.
fn connected(policy: &str) -> (FakeHost, PluginRoot, u32) {
    let host = FakeHost::default();
    let root = root_with(&host, &config(policy));
    let stream = opened(&host.take_effects())[0].0;
    (host, root, stream)
}

/// The write queue's wake-up, as Envoy delivers it to the root.
pub(super) fn wake(host: &FakeHost, root: &PluginRoot) {
    host.effective_context.set(ROOT);
    root.on_queue_ready(host, 1);
}

#[test]
fn a_claim_goes_out_as_the_root_and_its_answer_resumes_the_request_in_its_own_context() {
    let host = FakeHost::default();
    let mut root = root_with(&host, &config("fail_closed"));
    let streams = opened(&host.take_effects());
    assert_eq!(streams.len(), 1, "opened at configuration");
    let (stream, metadata) = streams.into_iter().next().unwrap();
    assert_eq!(
        metadata,
        vec![("authorization".to_string(), b"Bearer s3cret".to_vec())]
    );

    let journey = request(&host, &root, "k1");
    let effects = host.take_effects();
    let sent = calls(&effects);
    assert_eq!(sent.len(), 1);
    let (on, context, call) = sent.into_iter().next().unwrap();
    assert_eq!(
        (on, context),
        (stream, ROOT),
        "sent as the root, which owns the stream"
    );
    let CallOp::Claim { owner, .. } = call.op else {
        panic!("a claim: {:?}", call.op);
    };
    assert_eq!(host.effective_context.get(), REQUEST, "switched back");

    answer(&host, &mut root, stream, call.id, claimed(&owner));
    assert_eq!(
        host.take_effects(),
        vec![
            Effect::Switched(REQUEST),
            Effect::Resume,
            Effect::Switched(ROOT)
        ]
    );
    assert!(is_executing(&journey.borrow()));
    // The access log's outcome belongs to the request, though the root delivered it.
    let outcome = crate::journey::access_log::OUTCOME;
    assert_eq!(
        host.published_in(REQUEST, outcome).as_deref(),
        Some("executed")
    );
    assert_eq!(host.published_in(ROOT, outcome), None);

    // The response is recorded; its completion goes on the stream at once (as the root, no
    // wake-up of the root needed), and the request's context is restored.
    host.effective_context.set(REQUEST);
    respond(&host, &mut journey.borrow_mut(), 201, b"{\"id\":1}");
    assert_eq!(host.effective_context.get(), REQUEST);
    let sent = calls(&host.take_effects());
    assert_eq!(sent.len(), 1);
    let (_, context, complete) = sent.into_iter().next().unwrap();
    assert_eq!(context, ROOT);
    let CallOp::Complete {
        owner: completed_by,
        record,
        ..
    } = complete.op
    else {
        panic!("a completion: {:?}", complete.op);
    };
    assert_eq!(completed_by, owner);
    assert_eq!(
        RecordedResponse::decode(&record).unwrap().body,
        b"{\"id\":1}"
    );
    assert!(!root.on_done(), "the completion is still unanswered");
    answer(&host, &mut root, stream, complete.id, Reply::Recorded);
    assert_eq!(host.counter("orders", Outcome::StoreError), 0);
}

#[test]
fn the_store_saying_in_flight_or_completed_answers_the_request_in_its_context() {
    let (host, mut root, stream) = connected("fail_closed");

    let first = request(&host, &root, "busy");
    let id = calls(&host.take_effects())[0].2.id;
    answer(
        &host,
        &mut root,
        stream,
        id,
        Reply::InFlight { retry_after_ms: 5 },
    );
    let effects = host.take_effects();
    assert_eq!(the_reply(&effects).0, 409);
    assert_eq!(effects.first(), Some(&Effect::Switched(REQUEST)));
    assert!(matches!(first.borrow().state(), Journey::AnsweredLocally));

    let recorded = RecordedResponse {
        owner: 9,
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: b"{\"id\":2}".to_vec(),
        trailers: Vec::new(),
        body_omitted: false,
        unknown: None,
    };
    let _held_by_envoy = request(&host, &root, "done");
    let id = calls(&host.take_effects())[0].2.id;
    let record = recorded.encode();
    answer(&host, &mut root, stream, id, Reply::Completed { record });
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.as_slice()), (201, &b"{\"id\":2}"[..]));
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
}

#[test]
fn a_claim_made_before_the_stream_opens_waits_for_it() {
    let host = FakeHost::default();
    // The worker's cluster does not exist yet while it is configured.
    host.fail(HostCall::OpenStream);
    let mut root = root_with(&host, &config("fail_closed"));
    assert!(opened(&host.take_effects()).is_empty());
    host.heal(HostCall::OpenStream);

    let journey = request(&host, &root, "early");
    assert!(calls(&host.take_effects()).is_empty(), "no stream yet");
    // The claim woke the root, but the last attempt is too recent: the tick opens it.
    wake(&host, &root);
    assert!(opened(&host.take_effects()).is_empty());
    host.advance_ms(100);
    root.on_tick(&host);
    let effects = host.take_effects();
    let stream = opened(&effects)[0].0;
    let sent = calls(&effects);
    assert_eq!(sent.len(), 1, "sent once the stream opened");
    let CallOp::Claim { owner, .. } = &sent[0].2.op else {
        panic!("a claim");
    };
    answer(&host, &mut root, stream, sent[0].2.id, claimed(owner));
    assert!(is_executing(&journey.borrow()));
}

#[test]
fn a_claim_that_waits_too_long_for_a_stream_gets_the_failure_policy() {
    let host = FakeHost::default();
    host.fail(HostCall::OpenStream);
    let mut root = root_with(&host, &config("fail_closed"));
    let journey = request(&host, &root, "never");
    host.advance_ms(250);
    root.on_tick(&host);
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 503);
    assert!(problem_type(&body).ends_with("idempotency-unavailable"));
    assert!(matches!(journey.borrow().state(), Journey::AnsweredLocally));
    // Never sent: nothing to release.
    wake(&host, &root);
    assert!(calls(&host.take_effects()).is_empty());
    assert_eq!(host.counter("orders", Outcome::StoreError), 1);
}

#[test]
fn a_closed_stream_fails_its_claims_by_policy_and_releases_them_on_the_next_stream() {
    for policy in ["fail_closed", "fail_open"] {
        let host = FakeHost::default();
        let mut root = root_with(&host, &config(policy));
        let stream = opened(&host.take_effects())[0].0;
        let journey = request(&host, &root, "k1");
        let CallOp::Claim { owner, .. } = calls(&host.take_effects())[0].2.op.clone() else {
            panic!("a claim");
        };

        // The store was killed: Envoy closes the stream (UNAVAILABLE).
        host.effective_context.set(ROOT);
        root.on_grpc_close(&host, stream, 14);
        let effects = host.take_effects();
        assert!(effects.contains(&Effect::StreamClosed {
            stream,
            reset: false
        }));
        match policy {
            "fail_closed" => assert_eq!(the_reply(&effects).0, 503, "{policy}"),
            _ => {
                assert!(effects.contains(&Effect::Resume), "{policy}: {effects:?}");
                assert!(is_executing(&journey.borrow()), "{policy}");
            }
        }
        assert_eq!(host.counter("orders", Outcome::StoreError), 1, "{policy}");

        if policy == "fail_closed" {
            // The claim may have landed before the close: it is released on the next stream.
            wake(&host, &root);
            host.advance_ms(200);
            root.on_tick(&host);
            let effects = host.take_effects();
            let reopened = opened(&effects);
            assert_eq!(reopened.len(), 1, "{policy}: reopened after the backoff");
            let sent = calls(&effects);
            assert!(
                matches!(&sent[..], [(s, ROOT, c)] if *s == reopened[0].0
                    && matches!(&c.op, CallOp::Release { owner: o, .. } if *o == owner)),
                "{policy}: {sent:?}"
            );
        }
    }
}

#[test]
fn a_frozen_stream_is_reset_at_the_deadline_and_its_claims_fail_in_time() {
    let (host, mut root, stream) = connected("fail_closed");
    let _held_by_envoy = request(&host, &root, "k1");
    host.take_effects();
    host.advance_ms(249);
    root.on_tick(&host);
    assert!(replies(&host.take_effects()).is_empty(), "not yet");
    host.advance_ms(1);
    root.on_tick(&host);
    let effects = host.take_effects();
    assert!(effects.contains(&Effect::StreamClosed {
        stream,
        reset: true
    }));
    assert_eq!(the_reply(&effects).0, 503);
}

#[test]
fn a_request_that_leaves_withdraws_its_claim_and_a_late_answer_finds_nobody() {
    let (host, mut root, stream) = connected("fail_closed");
    let journey = request(&host, &root, "k1");
    let (claim_id, owner) = sent_claim(&host);
    // The client hangs up while the store decides.
    journey.borrow_mut().on(&host, Event::StreamEnd);
    drop(journey);
    host.gone_contexts.borrow_mut().insert(REQUEST);
    wake(&host, &root);
    let releases = calls(&host.take_effects());
    assert!(
        matches!(&releases[..], [(_, ROOT, c)] if matches!(&c.op, CallOp::Release { owner: o, .. } if *o == owner)),
        "{releases:?}"
    );
    // The claim's answer then arrives: nobody is switched to, nothing breaks.
    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    assert!(!host
        .take_effects()
        .iter()
        .any(|e| matches!(e, Effect::Switched(REQUEST) | Effect::Resume)));
}

#[test]
fn a_claim_answered_after_its_context_vanished_is_released() {
    let (host, mut root, stream) = connected("fail_closed");
    let journey = request(&host, &root, "k1");
    let (claim_id, owner) = sent_claim(&host);
    // Envoy destroyed the context without the stream end that withdraws the claim.
    host.gone_contexts.borrow_mut().insert(REQUEST);
    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    assert!(replies(&host.take_effects()).is_empty());
    wake(&host, &root);
    let sent = calls(&host.take_effects());
    assert!(
        matches!(&sent[..], [(_, _, c)] if matches!(&c.op, CallOp::Release { owner: o, .. } if *o == owner)),
        "{sent:?}"
    );
    drop(journey);
}

#[test]
fn a_completion_larger_than_a_stream_message_goes_without_its_body() {
    let (host, mut root, stream) = connected("fail_closed");
    let journey = request(&host, &root, "big");
    let (claim_id, owner) = sent_claim(&host);
    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    host.effective_context.set(REQUEST);
    let large = vec![b'x'; MAX_MESSAGE_BYTES + 1];
    respond(&host, &mut journey.borrow_mut(), 201, &large);
    wake(&host, &root);
    let sent = calls(&host.take_effects());
    let [(_, _, complete)] = &sent[..] else {
        panic!("one completion: {}", sent.len());
    };
    let CallOp::Complete { record, .. } = &complete.op else {
        panic!("a completion");
    };
    let recorded = RecordedResponse::decode(record).unwrap();
    assert_eq!(recorded.status, 201);
    assert!(recorded.body.is_empty() && recorded.body_omitted);
}

/// The one completion among the calls sent since the last look: its id and its record.
fn sent_completion(host: &FakeHost) -> (u64, RecordedResponse) {
    let sent = calls(&host.take_effects());
    let [(_, _, complete)] = &sent[..] else {
        panic!("one completion: {sent:?}");
    };
    let CallOp::Complete { record, .. } = &complete.op else {
        panic!("a completion");
    };
    (complete.id, RecordedResponse::decode(record).unwrap())
}

#[test]
fn a_completion_over_the_limit_the_store_announced_goes_without_its_body() {
    let (host, mut root, stream) = connected("fail_closed");
    // The store runs with --max-body-bytes 1 MiB and says so when the stream opens.
    *host.grpc_initial_metadata.borrow_mut() = vec![(
        crate::store::link::STORE_LIMIT_METADATA.into(),
        b"1048576".to_vec(),
    )];
    root.on_grpc_initial_metadata(&host, stream);
    let journey = request(&host, &root, "two-megabytes");
    let (claim_id, owner) = sent_claim(&host);
    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    host.effective_context.set(REQUEST);
    respond(&host, &mut journey.borrow_mut(), 201, &vec![b'x'; 2 << 20]);
    wake(&host, &root);
    // Before: sent whole, the store ended the stream, and it never landed.
    let (_, recorded) = sent_completion(&host);
    assert_eq!(recorded.status, 201);
    assert!(recorded.body.is_empty() && recorded.body_omitted);
}

#[test]
fn a_completion_the_store_refuses_as_malformed_is_sent_again_without_its_body() {
    let (host, mut root, stream) = connected("fail_closed");
    let journey = request(&host, &root, "refused");
    let (claim_id, owner) = sent_claim(&host);
    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    host.effective_context.set(REQUEST);
    respond(&host, &mut journey.borrow_mut(), 201, &vec![b'y'; 100_000]);
    let (id, whole) = sent_completion(&host);
    assert_eq!(whole.body.len(), 100_000);
    // A store whose limit is lower than this filter knows answers the call, not the stream.
    let too_large = Reply::Failure {
        kind: idempotency_protocol::stream::FailureKind::BadRequest,
        detail: "message of 100400 bytes is over the store's limit of 65536 bytes".into(),
    };
    answer(&host, &mut root, stream, id, too_large);
    wake(&host, &root);
    let (id, lean) = sent_completion(&host);
    assert!(lean.body.is_empty() && lean.body_omitted);
    answer(&host, &mut root, stream, id, Reply::Recorded);
    assert_eq!(host.counter("orders", Outcome::StoreWriteDropped), 0);
    assert_eq!(host.counter("orders", Outcome::StoreError), 0);
}

#[test]
fn a_completion_the_store_refuses_because_another_request_took_over_is_not_replayed_here() {
    // This request's lease ran out while it ran; another replica's retry took the key over
    // and the store holds that retry's response. This proxy must not keep replaying its own.
    let (host, mut root, stream) = connected("fail_closed");
    let journey = request(&host, &root, "k1");
    let (id, owner) = sent_claim(&host);
    answer(&host, &mut root, stream, id, claimed(&owner));
    let _ = host.take_effects();
    host.effective_context.set(REQUEST);
    respond(&host, &mut journey.borrow_mut(), 201, b"{\"run\":1}");
    let sent = calls(&host.take_effects());
    let (_, _, complete) = sent.into_iter().next().unwrap();
    answer(&host, &mut root, stream, complete.id, Reply::NotOwner);
    assert_eq!(host.counter("orders", Outcome::NotRecorded), 1);
    assert_eq!(
        host.counter("orders", Outcome::StoreError),
        0,
        "the store answered"
    );

    // The retry asks the store, which replays the response it kept.
    let retry = request(&host, &root, "k1");
    let effects = host.take_effects();
    assert!(replies(&effects).is_empty(), "no local replay: {effects:?}");
    let sent = calls(&effects);
    let (_, _, claim) = sent.into_iter().next().expect("a claim to the store");
    assert!(matches!(claim.op, CallOp::Claim { .. }));
    let kept = RecordedResponse {
        status: 201,
        body: b"{\"run\":2}".to_vec(),
        ..RecordedResponse::default()
    };
    answer(
        &host,
        &mut root,
        stream,
        claim.id,
        Reply::Completed {
            record: kept.encode(),
        },
    );
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.as_slice()), (201, &b"{\"run\":2}"[..]));
    drop(retry);
}

/// A wait-mode rule in cluster mode, its stream open.
fn connected_waiting() -> (FakeHost, PluginRoot, u32) {
    let host = FakeHost::default();
    let config = r#"{"store":{"cluster":"store","token":"s3cret","timeout_ms":250},
        "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "on_in_flight":"wait","wait_ms":5000}]}"#;
    let root = root_with(&host, config);
    let stream = opened(&host.take_effects())[0].0;
    (host, root, stream)
}

/// A request of a key the store says is in flight elsewhere: the wait call it then sends.
fn waiting_request(
    host: &FakeHost,
    root: &mut PluginRoot,
    stream: u32,
) -> (Rc<RefCell<RequestJourney>>, u64) {
    let journey = request(host, root, "k1");
    let (id, _) = sent_claim(host);
    answer(
        host,
        root,
        stream,
        id,
        Reply::InFlight {
            retry_after_ms: 900,
        },
    );
    let effects = host.take_effects();
    assert!(replies(&effects).is_empty(), "held, no 409: {effects:?}");
    let sent = calls(&effects);
    let [(_, context, call)] = &sent[..] else {
        panic!("one wait call, got {sent:?}");
    };
    assert_eq!(*context, ROOT, "sent as the root");
    let CallOp::Wait { wait_ms, .. } = call.op else {
        panic!("a wait: {:?}", call.op);
    };
    assert_eq!(wait_ms, 5000);
    assert_eq!(held_duplicates(root).0, 1);
    (journey, call.id)
}

#[test]
fn a_duplicate_of_a_request_on_another_replica_waits_on_the_store_for_its_response() {
    let (host, mut root, stream) = connected_waiting();
    let (_journey, wait) = waiting_request(&host, &mut root, stream);
    let recorded = RecordedResponse {
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: b"{\"order\":7}".to_vec(),
        ..RecordedResponse::default()
    };
    answer(
        &host,
        &mut root,
        stream,
        wait,
        Reply::Completed {
            record: recorded.encode(),
        },
    );
    let effects = host.take_effects();
    assert_eq!(effects.first(), Some(&Effect::Switched(REQUEST)));
    let (status, headers, body) = the_reply(&effects);
    assert_eq!((status, body.as_slice()), (201, &b"{\"order\":7}"[..]));
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
    assert_eq!(host.counter("orders", Outcome::Waited), 1);
    assert_eq!(host.counter("orders", Outcome::ReplayedAfterWait), 1);
    assert_eq!(host.counter("orders", Outcome::Conflict), 0);
    assert_eq!(held_duplicates(&root).0, 0);
}

#[test]
fn a_wait_on_the_store_ends_503_when_released_and_409_when_the_stream_fails() {
    let (host, mut root, stream) = connected_waiting();
    let (_first, wait) = waiting_request(&host, &mut root, stream);
    answer(&host, &mut root, stream, wait, Reply::Released);
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 503);
    assert!(problem_type(&body).ends_with("first-attempt-released"));
    assert_eq!(host.counter("orders", Outcome::WaitReleased), 1);

    let (_second, _) = waiting_request(&host, &mut root, stream);
    host.effective_context.set(ROOT);
    root.on_grpc_close(&host, stream, 14);
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 409, "the first presumably still runs");
    assert!(problem_type(&body).ends_with("request-in-flight"));
    assert_eq!(host.counter("orders", Outcome::WaitTimedOut), 1);
    assert_eq!(held_duplicates(&root).0, 0);
}

#[test]
fn a_duplicate_waiting_on_the_store_whose_client_leaves_is_forgotten() {
    let (host, mut root, stream) = connected_waiting();
    let (journey, wait) = waiting_request(&host, &mut root, stream);
    host.effective_context.set(REQUEST);
    journey.borrow_mut().on(&host, Event::StreamEnd);
    assert_eq!(held_duplicates(&root).0, 0);
    answer(&host, &mut root, stream, wait, Reply::Released);
    assert!(replies(&host.take_effects()).is_empty(), "nobody to answer");
}

#[test]
fn a_duplicate_held_behind_a_local_claim_that_only_confirmed_with_the_store_waits_on_the_store() {
    // Two duplicates on this replica of a request running on another: the first claims
    // locally and asks the store; the second finds that local claim and waits locally. The
    // store answers the first "in flight", so it lets its local claim go: the second must not
    // take that for the first request's failure.
    let (host, mut root, stream) = connected_waiting();
    let (_one, wait_one) = waiting_request(&host, &mut root, stream);
    // Another key: its first duplicate holds a local claim while it asks the store.
    let (_first, _) = post_in_context(&host, &root, 8, "k2");
    let (claim_id, _) = sent_claim(&host);
    let third = request(&host, &root, "k2");
    assert!(
        replies(&host.take_effects()).is_empty(),
        "held behind the local claim"
    );
    answer(
        &host,
        &mut root,
        stream,
        claim_id,
        Reply::InFlight {
            retry_after_ms: 900,
        },
    );
    let _ = host.take_effects(); // the first's wait call
    host.advance_ms(25);
    host.effective_context.set(ROOT);
    root.on_tick(&host);
    let effects = host.take_effects();
    assert!(replies(&effects).is_empty(), "no 503: {effects:?}");
    let sent = calls(&effects);
    assert!(
        matches!(&sent[..], [(_, _, call)] if matches!(call.op, CallOp::Wait { .. })),
        "the held duplicate now waits on the store: {sent:?}"
    );
    assert_eq!(host.counter("orders", Outcome::WaitReleased), 0);
    drop((third, wait_one));
}

/// The writes handed off to the host so far, decoded: id and call.
fn handed_off(host: &FakeHost) -> Vec<(u64, CallOp)> {
    host.handed_off
        .borrow()
        .iter()
        .map(|(id, call, _, _)| (*id, decode_call(call).unwrap().op))
        .collect()
}

#[test]
fn a_completion_is_handed_off_as_sent_and_settled_by_the_stores_answer() {
    let (host, mut root, stream) = connected("fail_closed");
    let journey = request(&host, &root, "handed");
    let (claim_id, owner) = sent_claim(&host);
    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    assert!(handed_off(&host).is_empty(), "a claim is never handed off");
    host.effective_context.set(REQUEST);
    respond(&host, &mut journey.borrow_mut(), 201, b"made");
    let sent = calls(&host.take_effects());
    let [(_, _, complete)] = &sent[..] else {
        panic!("one completion: {sent:?}");
    };
    let handed = handed_off(&host);
    let [(handoff_id, call)] = &handed[..] else {
        panic!("one handoff: {handed:?}");
    };
    assert_eq!(*call, complete.op, "the same bytes the root sends");
    let (_, _, deadline, settles_within) = host.handed_off.borrow()[0].clone();
    assert!(deadline > host.clock_ms.get());
    assert_eq!(
        settles_within,
        250 + 100,
        "store timeout plus the first backoff"
    );
    assert!(host.settled_writes.borrow().is_empty());
    answer(&host, &mut root, stream, complete.id, Reply::Recorded);
    assert_eq!(*host.settled_writes.borrow(), vec![*handoff_id]);
}

#[test]
fn a_completion_made_while_the_stream_is_down_is_handed_off_though_not_sent() {
    let (host, mut root, stream) = connected("fail_open");
    let journey = request(&host, &root, "down");
    let (claim_id, owner) = sent_claim(&host);
    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    // The store dies while the request runs upstream.
    host.effective_context.set(ROOT);
    root.on_grpc_close(&host, stream, 14);
    host.take_effects();
    host.effective_context.set(REQUEST);
    respond(&host, &mut journey.borrow_mut(), 201, b"made");
    assert!(
        calls(&host.take_effects()).is_empty(),
        "no stream: nothing sent"
    );
    let handed = handed_off(&host);
    assert!(
        matches!(&handed[..], [(_, CallOp::Complete { owner: o, .. })] if *o == owner),
        "{handed:?}"
    );
    // Failed attempts do not settle it: only an answer or its deadline does.
    for _ in 0..5 {
        host.advance_ms(2_000);
        host.effective_context.set(ROOT);
        root.on_tick(&host);
        for (s, _) in opened(&host.take_effects()) {
            root.on_grpc_close(&host, s, 14);
        }
    }
    assert!(host.settled_writes.borrow().is_empty());
}

#[test]
fn a_completion_sent_again_without_its_body_is_handed_off_again_under_its_id() {
    let (host, mut root, stream) = connected("fail_closed");
    let journey = request(&host, &root, "slimmed");
    let (claim_id, owner) = sent_claim(&host);
    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    host.effective_context.set(REQUEST);
    respond(&host, &mut journey.borrow_mut(), 201, &vec![b'y'; 100_000]);
    let (id, _) = sent_completion(&host);
    let too_large = Reply::Failure {
        kind: idempotency_protocol::stream::FailureKind::BadRequest,
        detail: "over the store's limit".into(),
    };
    answer(&host, &mut root, stream, id, too_large);
    assert!(host.settled_writes.borrow().is_empty(), "it goes again");
    wake(&host, &root);
    let (id, lean) = sent_completion(&host);
    let handed = handed_off(&host);
    let [(first, _), (again, CallOp::Complete { record, .. })] = &handed[..] else {
        panic!("handed off twice: {handed:?}");
    };
    assert_eq!(first, again);
    assert_eq!(RecordedResponse::decode(record).unwrap(), lean);
    answer(&host, &mut root, stream, id, Reply::Recorded);
    assert_eq!(*host.settled_writes.borrow(), vec![*first]);
}

#[test]
fn a_release_of_a_claim_whose_client_left_is_handed_off_and_settled() {
    let (host, mut root, stream) = connected("fail_closed");
    let journey = request(&host, &root, "left");
    let (_, owner) = sent_claim(&host);
    // The client hangs up while the store decides: the claim is released from the root.
    journey.borrow_mut().on(&host, Event::StreamEnd);
    drop(journey);
    host.gone_contexts.borrow_mut().insert(REQUEST);
    wake(&host, &root);
    let sent = calls(&host.take_effects());
    let [(_, ROOT, release)] = &sent[..] else {
        panic!("one release: {sent:?}");
    };
    let handed = handed_off(&host);
    let [(handoff_id, call)] = &handed[..] else {
        panic!("one release handed off: {handed:?}");
    };
    assert!(matches!(call, CallOp::Release { owner: o, .. } if *o == owner));
    assert_eq!(*call, release.op);
    // Unconfirmed, so "not the owner" is asked again (the claim may be behind it): not
    // settled yet; "released" settles it.
    answer(&host, &mut root, stream, release.id, Reply::NotOwner);
    assert!(host.settled_writes.borrow().is_empty());
    host.advance_ms(300);
    host.effective_context.set(ROOT);
    root.on_tick(&host);
    let again = calls(&host.take_effects());
    let [(_, ROOT, retried)] = &again[..] else {
        panic!("the release again: {again:?}");
    };
    answer(&host, &mut root, stream, retried.id, Reply::Released);
    assert_eq!(*host.settled_writes.borrow(), vec![*handoff_id]);
}

#[test]
fn a_checked_configuration_opens_no_store_stream_and_a_configured_one_does() {
    let host = FakeHost::default();
    *host.configuration.borrow_mut() = config("fail_closed").into_bytes();
    host.effective_context.set(ROOT);
    assert!(PluginRoot::new(ROOT).check_configuration(&host));
    assert!(opened(&host.take_effects()).is_empty());
    assert!(PluginRoot::new(ROOT).on_configure(&host));
    assert_eq!(opened(&host.take_effects()).len(), 1);
    // A bad configuration is refused all the same.
    *host.configuration.borrow_mut() =
        br#"{"rules":[{"name":"orders","match":{"path_prefixes":["orders"]}}]}"#.to_vec();
    assert!(!PluginRoot::new(ROOT).check_configuration(&host));
}

/// `fail_open`: a claim whose store answer was lost runs with an unconfirmed store owner. The
/// root that sends a carried detached write renews only a confirmed one in the store (as
/// `execute` does): the store would call the other lost, and the local lease would stop being
/// renewed while the write still runs, so a retry could take the key and run it again.
#[test]
fn a_carried_write_with_an_unconfirmed_store_owner_keeps_its_local_lease() {
    let cfg = r#"{"store":{"cluster":"store","token":"s3cret","timeout_ms":250},
        "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "on_store_error":"fail_open","execution":"detached","upstream_cluster":"orders-svc",
        "upstream_timeout_ms":60000,"lease_seconds":3}]}"#;
    let host = FakeHost::default();
    let mut worker = root_with(&host, cfg);
    worker.send_detached_elsewhere();
    let stream = opened(&host.take_effects())[0].0;
    let _journey = request(&host, &worker, "k1");
    let _claim = calls(&host.take_effects());
    // The store stream breaks before the claim's answer: fail_open lets the write go on.
    host.effective_context.set(ROOT);
    worker.on_grpc_close(&host, stream, 14);
    let _ = host.take_effects();
    let carried = worker.detached_to_carry();
    let Some(crate::plugin::detached::DetachedCarry::Write(write)) = carried.into_iter().next()
    else {
        panic!("a write")
    };
    assert!(matches!(write.store_owner, Some((_, false))), "unconfirmed");
    *host.configuration.borrow_mut() = cfg.as_bytes().to_vec();
    host.effective_context.set(50);
    let mut sender = PluginRoot::new(50);
    assert!(sender.on_configure(&host));
    let _ = host.take_effects();
    host.effective_context.set(50);
    sender.take_detached(&host, vec![(900, *write)]);
    for _ in 0..12 {
        let renewals = calls(&host.take_effects())
            .into_iter()
            .filter(|(_, _, c)| matches!(&c.op, CallOp::Renew { .. }))
            .count();
        assert_eq!(
            renewals, 0,
            "an unconfirmed claim is not renewed in the store"
        );
        host.advance_ms(500);
        host.effective_context.set(50);
        sender.on_tick(&host);
    }
    let _ = host.take_effects();
    // Six seconds on, twice the lease: the local claim is still renewed, so a retry is 409.
    let (_, _) = post_in_context(&host, &worker, 9, "k1");
    assert!(worker.detached_to_carry().is_empty(), "no second copy");
}

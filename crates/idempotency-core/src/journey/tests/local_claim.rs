//! Single-proxy claims: execute once, then 409, 422, replays, takeover and a full table.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use super::*;
use crate::fake_host::HostCall;
use crate::outcome::Outcome;

#[test]
fn the_first_request_executes_and_a_concurrent_retry_gets_409() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (first, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Continue);
    assert!(is_executing(&first));
    assert!(host.take_effects().is_empty());
    let (_, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Pause);
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(status, 409);
    assert_eq!(header(&headers, "retry-after"), Some(&b"1"[..]));
    assert!(problem_type(&body).ends_with("request-in-flight"));
    assert_eq!(host.counter("orders", Outcome::Executed), 1);
    assert_eq!(host.counter("orders", Outcome::Conflict), 1);
}

#[test]
fn a_retry_after_completion_gets_the_recorded_response_marked_as_a_replay() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    respond(&host, &mut first, 201, br#"{"order":1}"#);
    assert!(matches!(first.state(), Journey::Finished));
    let (_, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Pause);
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(status, 201);
    assert_eq!(body, br#"{"order":1}"#);
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
    assert_eq!(
        header(&headers, "content-type"),
        Some(&b"application/json"[..])
    );
    assert_eq!(host.counter("orders", Outcome::Replayed), 1);
    assert_eq!(host.counter("orders", Outcome::Executed), 1);
}

#[test]
fn the_same_key_with_another_payload_gets_422() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", br#"{"amount":1}"#);
    respond(&host, &mut first, 201, b"ok");
    let (_, verdict) = post(&host, &plugin, "k1", br#"{"amount":2}"#);
    assert_eq!(verdict, Verdict::Pause);
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 422);
    assert!(problem_type(&body).ends_with("key-reused"));
    assert_eq!(host.counter("orders", Outcome::Mismatch), 1);
}

#[test]
fn a_releasing_status_frees_the_key_for_the_next_attempt() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    respond(&host, &mut first, 503, b"busy");
    assert_eq!(host.counter("orders", Outcome::Released), 1);
    let (second, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Continue);
    assert!(is_executing(&second));
    assert_eq!(host.counter("orders", Outcome::Executed), 2);
}

#[test]
fn a_claim_past_its_lease_is_taken_over_and_the_late_first_is_not_recorded() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},"lease_seconds":2}]}"#,
    );
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    host.advance_ms(2_001);
    let (mut second, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Continue);
    assert_eq!(host.counter("orders", Outcome::TakenOver), 1);
    respond(&host, &mut first, 201, b"first");
    assert_eq!(host.counter("orders", Outcome::NotRecorded), 1);
    respond(&host, &mut second, 201, b"second");
    let _ = host.take_effects();
    post(&host, &plugin, "k1", b"{}");
    assert_eq!(the_reply(&host.take_effects()).2, b"second");
}

#[test]
fn a_full_table_answers_503_or_lets_requests_pass_by_policy() {
    for (policy, expect_reply) in [("reject", true), ("pass_through", false)] {
        let host = FakeHost::default();
        let config = format!(
            r#"{{"local_table":{{"capacity":1}},"rules":[{{"name":"orders",
                "match":{{"path_prefixes":["/orders"]}},"on_table_full":"{policy}"}}]}}"#
        );
        let plugin = plugin(&host, &config);
        // One bucket of eight slots, all in flight.
        let held: Vec<_> = (0..8)
            .map(|i| post(&host, &plugin, &format!("k{i}"), b"{}").0)
            .collect();
        assert!(held.iter().all(is_executing));
        let (request, verdict) = post(&host, &plugin, "one-too-many", b"{}");
        assert_eq!(host.counter("orders", Outcome::TableFull), 1);
        if expect_reply {
            assert_eq!(verdict, Verdict::Pause);
            let (status, headers, body) = the_reply(&host.take_effects());
            assert_eq!(status, 503);
            assert!(header(&headers, "retry-after").is_some());
            assert!(problem_type(&body).ends_with("capacity-exhausted"));
        } else {
            assert_eq!(verdict, Verdict::Continue);
            assert!(matches!(request.state(), Journey::Unprotected));
            assert_eq!(host.counter("orders", Outcome::PassedThrough), 1);
        }
    }
}

#[test]
fn shared_data_refusing_the_claim_is_a_table_error_under_the_full_table_policy() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    host.fail(HostCall::SharedData);
    let (_, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Pause);
    assert_eq!(the_reply(&host.take_effects()).0, 503);
    assert_eq!(host.counter("orders", Outcome::TableError), 1);
}

#[test]
fn a_replay_without_a_body_gets_its_content_type_back_on_the_way_out() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    respond(&host, &mut first, 204, b"");
    let (mut replay, _) = post(&host, &plugin, "k1", b"{}");
    assert!(matches!(replay.state(), Journey::Replaying { .. }));
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.len()), (204, 0));
    // Envoy passes the local reply back through the filter, without its content-type.
    host.set_response(&[(":status", "204")], b"");
    replay.on(
        &host,
        Event::ResponseHeaders {
            end_of_stream: true,
        },
    );
    assert_eq!(
        host.take_effects(),
        vec![Effect::ReplaceResponseHeader(
            "content-type".into(),
            b"application/json".to_vec()
        )]
    );
    assert!(matches!(replay.state(), Journey::AnsweredLocally));
}

#[test]
fn a_table_full_of_records_evicts_the_oldest_for_a_new_key_and_shows_its_age() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"local_table":{"capacity":1},"rules":[{"name":"orders",
            "match":{"path_prefixes":["/orders"]}}]}"#,
    );
    // One bucket of eight slots, each holding a record, one second apart.
    for i in 0..8 {
        let (mut request, _) = post(&host, &plugin, &format!("k{i}"), b"{}");
        respond(&host, &mut request, 201, format!("order {i}").as_bytes());
        host.advance_ms(1_000);
    }
    let _ = host.take_effects();
    let (mut request, verdict) = post(&host, &plugin, "k8", b"{}");
    assert_eq!(verdict, Verdict::Continue);
    assert!(is_executing(&request));
    assert_eq!(host.counter("orders", Outcome::Evicted), 1);
    assert_eq!(host.counter("orders", Outcome::TableFull), 0);
    assert_eq!(
        host.gauge(crate::plugin::retention::GAUGE_NAME),
        Some(8_000),
        "k0 was recorded 8 s before"
    );
    respond(&host, &mut request, 201, b"order 8");
    let _ = host.take_effects();
    // The seven younger records and the new one replay; the evicted key is new again.
    for i in 1..9 {
        post(&host, &plugin, &format!("k{i}"), b"{}");
        let (status, _, body) = the_reply(&host.take_effects());
        assert_eq!((status, body), (201, format!("order {i}").into_bytes()));
    }
    let (again, _) = post(&host, &plugin, "k0", b"{}");
    assert!(is_executing(&again));
}

#[test]
fn a_response_too_large_for_the_budget_replays_its_status_without_the_body() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"local_table":{"capacity":8,"max_bytes":1048576},"rules":[{"name":"orders",
            "match":{"path_prefixes":["/orders"]}}]}"#,
    );
    let big = vec![b'x'; 900_000];
    let (mut request, _) = post(&host, &plugin, "k1", b"{}");
    respond(&host, &mut request, 201, &big);
    assert_eq!(host.counter("orders", Outcome::BodyOmitted), 1);
    let _ = host.take_effects();
    post(&host, &plugin, "k1", b"{}");
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(status, 201);
    assert!(body.is_empty());
    assert_eq!(
        header(&headers, "idempotent-body-omitted"),
        Some(&b"true"[..])
    );
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
}

#[test]
fn a_claim_without_a_clock_is_refused_not_born_expired() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let now = host.clock_ms.get();
    // The host's clock call failed: the filter reads 0.
    host.clock_ms.set(0);
    let (request, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Pause);
    assert!(
        !is_executing(&request),
        "before: claimed with a lease ending in 1970"
    );
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 503);
    assert!(problem_type(&body).ends_with("idempotency-unavailable"));
    host.clock_ms.set(now);
    let (first, _) = post(&host, &plugin, "k1", b"{}");
    assert!(is_executing(&first));
}

/// A push that brings back an earlier `local_table` (2 MiB, then 4 MiB, then 2 MiB again on
/// a worker that never saw it configured again): the earlier configuration's first claim of a
/// key its own table lacks catches up with the registry and finds the newer table's record.
#[test]
fn a_configuration_brought_back_by_a_push_replays_what_the_newer_table_recorded() {
    const SMALL: &str = r#"{"local_table":{"max_bytes":2097152},
        "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]}}]}"#;
    const LARGE: &str = r#"{"local_table":{"max_bytes":4194304},
        "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]}}]}"#;
    let host = FakeHost::default();
    let small = plugin(&host, SMALL);
    let (mut before_push, _) = post(&host, &small, "k0", b"{}");
    respond(&host, &mut before_push, 201, b"made before the push");
    let large = plugin(&host, LARGE);
    let (mut first, _) = post(&host, &large, "k1", b"{}");
    assert!(is_executing(&first));
    respond(&host, &mut first, 201, b"made by the newer table");

    // The earlier configuration, still live on a worker: its own record answers at once...
    let (_, verdict) = post(&host, &small, "k0", b"{}");
    assert_eq!(verdict, Verdict::Pause);
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(
        (status, body.as_slice()),
        (201, &b"made before the push"[..])
    );
    // ... and a key only the newer table holds is found there, not run again.
    let (_, verdict) = post(&host, &small, "k1", b"{}");
    assert_eq!(verdict, Verdict::Pause);
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(
        (status, body.as_slice()),
        (201, &b"made by the newer table"[..])
    );
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
}

#[test]
fn past_its_ttl_a_record_answers_as_its_tombstone_until_that_ends_too() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
            "ttl_seconds":10,"lease_seconds":5,"tombstone_seconds":100}]}"#,
    );
    let (mut first, _) = post(&host, &plugin, "k1", br#"{"amount":1}"#);
    respond(&host, &mut first, 201, br#"{"order":1}"#);
    let _ = host.take_effects();
    // Within the TTL: the whole response.
    host.advance_ms(9_000);
    post(&host, &plugin, "k1", br#"{"amount":1}"#);
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.as_slice()), (201, &br#"{"order":1}"#[..]));
    // Past it: the status and headers, the body omitted and said so; never an execution.
    host.advance_ms(2_000);
    let (_, verdict) = post(&host, &plugin, "k1", br#"{"amount":1}"#);
    assert_eq!(verdict, Verdict::Pause);
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(status, 201);
    assert!(body.is_empty());
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
    assert_eq!(
        header(&headers, "idempotent-body-omitted"),
        Some(&b"true"[..])
    );
    assert_eq!(
        header(&headers, "content-type"),
        Some(&b"application/json"[..])
    );
    assert_eq!(host.counter("orders", Outcome::ReplayedTombstone), 1);
    // Another payload under the key is still refused.
    post(&host, &plugin, "k1", br#"{"amount":2}"#);
    assert_eq!(the_reply(&host.take_effects()).0, 422);
    // Once the tombstone has ended too, the key is free.
    host.advance_ms(100_000);
    let (again, verdict) = post(&host, &plugin, "k1", br#"{"amount":1}"#);
    assert_eq!(verdict, Verdict::Continue);
    assert!(is_executing(&again));
    assert_eq!(host.counter("orders", Outcome::Executed), 2);
}

#[test]
fn a_replay_says_the_key_is_remembered_through_its_tombstone() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
            "ttl_seconds":10,"lease_seconds":5,"tombstone_seconds":86400}]}"#,
    );
    let started = crate::host::Host::now_ms(&host);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    respond(&host, &mut first, 201, b"ok");
    let _ = host.take_effects();
    post(&host, &plugin, "k1", b"{}");
    let (_, headers, _) = the_reply(&host.take_effects());
    let want = idempotency_protocol::record::key_expires_value(started + 10_000 + 86_400_000);
    assert_eq!(
        header(&headers, "idempotency-key-expires"),
        Some(want.as_bytes())
    );
}

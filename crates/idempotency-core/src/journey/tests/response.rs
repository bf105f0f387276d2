//! The upstream's response: recorded as it streams, released on a releasing status, and
//! what a retry gets when the stream is cut short at each point.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use super::*;
use crate::fake_host::HostCall;
use crate::outcome::Outcome;

#[test]
fn an_upstream_copy_of_the_replay_header_is_removed() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut request, _) = post(&host, &plugin, "k1", b"{}");
    host.set_response(&[(":status", "200"), ("idempotent-replayed", "true")], b"");
    request.on(
        &host,
        Event::ResponseHeaders {
            end_of_stream: true,
        },
    );
    let effects = host.take_effects();
    assert_eq!(
        effects.first(),
        Some(&Effect::RemoveResponseHeader("idempotent-replayed".into()))
    );
    assert!(
        !effects.iter().any(
            |e| matches!(e, Effect::ReplaceResponseHeader(n, _) if n == "idempotent-replayed")
        ),
        "{effects:?}"
    );
}

#[test]
fn the_recorded_answer_and_every_replay_say_until_when_the_key_is_remembered() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},"ttl_seconds":3600}]}"#,
    );
    host.clock_ms.set(1_700_000_000_000); // 2023-11-14T22:13:20Z
    let (mut request, _) = post(&host, &plugin, "k1", b"{}");
    // The upstream's own copy would mislead: the filter's replaces it.
    host.set_response(
        &[(":status", "201"), ("idempotency-key-expires", "never")],
        b"",
    );
    request.on(
        &host,
        Event::ResponseHeaders {
            end_of_stream: true,
        },
    );
    let expected = b"Tue, 14 Nov 2023 23:13:20 GMT".to_vec();
    assert!(
        host.take_effects().contains(&Effect::ReplaceResponseHeader(
            "idempotency-key-expires".into(),
            expected.clone()
        )),
        "the first answer says it"
    );
    host.advance_ms(60_000);
    post(&host, &plugin, "k1", b"{}");
    let (status, headers, _) = the_reply(&host.take_effects());
    assert_eq!(status, 201);
    let values: Vec<&[u8]> = headers
        .iter()
        .filter(|(n, _)| n == "idempotency-key-expires")
        .map(|(_, v)| v.as_slice())
        .collect();
    assert_eq!(
        values,
        vec![expected.as_slice()],
        "the replay says the same, once"
    );
}

#[test]
fn a_released_answer_says_nothing_of_expiry() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut request, _) = post(&host, &plugin, "k1", b"{}");
    respond(&host, &mut request, 503, b"");
    assert!(!host.take_effects().iter().any(
        |e| matches!(e, Effect::ReplaceResponseHeader(n, _) if n == "idempotency-key-expires")
    ));
}

#[test]
fn a_body_in_chunks_is_recorded_whole_and_trailers_finish_the_record() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut request, _) = post(&host, &plugin, "k1", b"{}");
    host.set_response(&[(":status", "201")], b"");
    request.on(
        &host,
        Event::ResponseHeaders {
            end_of_stream: false,
        },
    );
    for chunk in [&b"part one, "[..], b"part two"] {
        *host.response_chunk.borrow_mut() = chunk.to_vec();
        let event = Event::ResponseBody {
            size: chunk.len(),
            end_of_stream: false,
        };
        assert_eq!(request.on(&host, event), Verdict::Continue);
    }
    // Not recorded yet: a retry now is still in flight.
    post(&host, &plugin, "k1", b"{}");
    assert_eq!(the_reply(&host.take_effects()).0, 409);
    request.on(&host, Event::ResponseTrailers);
    post(&host, &plugin, "k1", b"{}");
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!((status, body), (201, b"part one, part two".to_vec()));
}

#[test]
fn a_stream_cut_after_response_headers_replays_status_and_headers_without_the_body() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut request, _) = post(&host, &plugin, "k1", b"{}");
    host.set_response(&[(":status", "201"), ("location", "/orders/9")], b"");
    request.on(
        &host,
        Event::ResponseHeaders {
            end_of_stream: false,
        },
    );
    request.on(&host, Event::StreamEnd);
    post(&host, &plugin, "k1", b"{}");
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(status, 201);
    assert!(body.is_empty());
    assert_eq!(header(&headers, "location"), Some(&b"/orders/9"[..]));
    assert_eq!(
        header(&headers, "idempotent-body-omitted"),
        Some(&b"true"[..])
    );
}

#[test]
fn a_client_that_leaves_after_its_request_went_upstream_leaves_an_unknown_outcome() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},"lease_seconds":5}]}"#,
    );
    let (mut request, _) = post(&host, &plugin, "k1", b"{}");
    envoy_reports(&host, "downstream_remote_disconnect", 0x4000, 1);
    request.on(&host, Event::StreamEnd);
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 1);
    // Whether the upstream acted is unknown: no retry runs it again, even past the lease.
    host.advance_ms(60_000);
    let (_, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Pause);
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(status, 409);
    assert!(problem_type(&body).ends_with("outcome-unknown"));
    assert_eq!(header(&headers, "retry-after"), None);
    assert_eq!(header(&headers, "idempotent-replayed"), None);
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknownAnswered), 1);
    assert_eq!(host.counter("orders", Outcome::Executed), 1);
}

#[test]
fn a_client_that_leaves_before_the_router_made_an_attempt_frees_the_key() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut request, _) = post(&host, &plugin, "k1", b"{}");
    envoy_reports(&host, "downstream_remote_disconnect", 0x4000, 0);
    request.on(&host, Event::StreamEnd);
    assert_eq!(host.counter("orders", Outcome::Released), 1);
    let (retry, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Continue);
    assert!(is_executing(&retry));
}

#[test]
fn unreadable_response_headers_leave_an_unknown_outcome_unless_nothing_was_sent() {
    for (details, flags, attempts, retry_executes) in [
        ("response_timeout", 0x4, 1, false),
        ("no_healthy_upstream", 0x2, 1, true),
    ] {
        let host = FakeHost::default();
        let plugin = plugin(&host, ORDERS);
        let (mut request, _) = post(&host, &plugin, "k1", b"{}");
        envoy_reports(&host, details, flags, attempts);
        host.fail(HostCall::ResponseHeaders);
        request.on(
            &host,
            Event::ResponseHeaders {
                end_of_stream: true,
            },
        );
        host.heal(HostCall::ResponseHeaders);
        let (_, verdict) = post(&host, &plugin, "k1", b"{}");
        assert_eq!(verdict == Verdict::Continue, retry_executes, "{details}");
    }
}

#[test]
fn an_unreadable_response_body_is_recorded_as_omitted() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut request, _) = post(&host, &plugin, "k1", b"{}");
    host.fail(HostCall::ResponseBody);
    respond(&host, &mut request, 200, b"lost");
    host.heal(HostCall::ResponseBody);
    post(&host, &plugin, "k1", b"{}");
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.len()), (200, 0));
    assert_eq!(
        header(&headers, "idempotent-body-omitted"),
        Some(&b"true"[..])
    );
}

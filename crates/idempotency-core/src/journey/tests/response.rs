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
    assert_eq!(
        host.take_effects(),
        vec![Effect::RemoveResponseHeader("idempotent-replayed".into())]
    );
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
fn a_stream_cut_before_any_response_keeps_the_key_in_flight_until_its_lease_ends() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},"lease_seconds":5}]}"#,
    );
    let (mut request, _) = post(&host, &plugin, "k1", b"{}");
    request.on(&host, Event::StreamEnd);
    // Whether the upstream acted is unknown: a retry must not run it again now.
    post(&host, &plugin, "k1", b"{}");
    assert_eq!(the_reply(&host.take_effects()).0, 409);
    host.advance_ms(5_001);
    let (retry, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Continue);
    assert!(is_executing(&retry));
}

#[test]
fn unreadable_response_headers_release_the_claim() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut request, _) = post(&host, &plugin, "k1", b"{}");
    host.fail(HostCall::ResponseHeaders);
    request.on(
        &host,
        Event::ResponseHeaders {
            end_of_stream: true,
        },
    );
    host.heal(HostCall::ResponseHeaders);
    assert_eq!(host.counter("orders", Outcome::Released), 1);
    let (_, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Continue);
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

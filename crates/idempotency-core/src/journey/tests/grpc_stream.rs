//! A gRPC call that sends a second request message: let through as a stream when it carries
//! none of its rule's key metadata, refused with `INVALID_ARGUMENT` when it does (grpcio runs
//! a unary method on the first message, so letting it through would run a recorded key's
//! write again), before any of the call has gone upstream and without touching a record.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use super::grpc::{answer, call, frame, grpc_headers, value, ORDERS_GRPC, PLACE};
use super::*;
use crate::outcome::Outcome;

/// Each of `messages` framed, one after the other.
fn framed(messages: &[&[u8]]) -> Vec<u8> {
    messages.iter().flat_map(|m| frame(m)).collect()
}

/// Headers, then `body` in chunks ending at each of `chunk_ends` (bytes buffered so far, as
/// Envoy reports them), the last chunk ending the call when `closes`. The verdicts of the
/// body chunks.
fn send_stream(
    host: &FakeHost,
    plugin: &Rc<Plugin>,
    key: Option<&str>,
    body: &[u8],
    chunk_ends: &[usize],
    closes: bool,
) -> (RequestJourney, Vec<Verdict>) {
    host.set_request(&grpc_headers(PLACE, key), body);
    let mut request = RequestJourney::new(Rc::clone(plugin));
    let at_headers = request.on(
        host,
        Event::RequestHeaders {
            end_of_stream: false,
        },
    );
    assert_eq!(at_headers, Verdict::Pause, "held for its body");
    let last = chunk_ends.len().saturating_sub(1);
    let verdicts = chunk_ends
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            request.on(
                host,
                Event::RequestBody {
                    size,
                    end_of_stream: closes && i == last,
                },
            )
        })
        .collect();
    (request, verdicts)
}

/// The one answer among `host`'s effects is the refusal of a keyed stream, trailers-only.
fn assert_refused_as_keyed_stream(host: &FakeHost, request: &RequestJourney) {
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.len()), (200, 0), "trailers-only");
    assert_eq!(
        value(&headers, "grpc-status"),
        Some("3"),
        "INVALID_ARGUMENT"
    );
    assert!(value(&headers, "idempotency-problem-type")
        .is_some_and(|t| t.ends_with(":grpc-key-on-stream")));
    let message = value(&headers, "grpc-message").unwrap_or_default();
    assert!(
        message.contains("several request messages") && message.contains("'idempotency-key'"),
        "{message}"
    );
    assert!(matches!(request.state(), Journey::AnsweredLocally));
}

/// A unary call with `key` that ran and was recorded.
fn recorded(host: &FakeHost, plugin: &Rc<Plugin>, key: &str) {
    let (mut first, _) = call(host, plugin, Some(key), b"order");
    assert!(is_executing(&first));
    answer(host, &mut first, b"placed", &[("grpc-status", "0")]);
    host.take_effects();
}

#[test]
fn a_second_message_under_a_recorded_key_is_refused_before_any_of_the_call_goes_upstream() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    recorded(&host, &plugin, "k1");

    let body = framed(&[b"order", b"order"]);
    let first_message = frame(b"order").len();
    let (stream, verdicts) = send_stream(
        &host,
        &plugin,
        Some("k1"),
        &body,
        &[first_message, body.len()],
        false,
    );
    // Paused throughout: Envoy holds every byte, and the answer is the filter's.
    assert_eq!(verdicts, [Verdict::Pause, Verdict::Pause]);
    assert_refused_as_keyed_stream(&host, &stream);
    assert_eq!(host.counter("orders", Outcome::GrpcStreamWithKey), 1);
    assert_eq!(host.counter("orders", Outcome::GrpcStreaming), 0);

    // The record is as it was: a retry of the unary call is replayed.
    call(&host, &plugin, Some("k1"), b"order");
    assert_eq!(host.counter("orders", Outcome::Replayed), 1);
    assert_eq!(host.counter("orders", Outcome::Executed), 1);
}

#[test]
fn a_second_message_in_the_first_messages_chunk_is_refused_whether_or_not_the_call_ends_there() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let body = framed(&[b"order", b"order"]);
    for closes in [false, true] {
        let (stream, verdicts) =
            send_stream(&host, &plugin, Some("k1"), &body, &[body.len()], closes);
        assert_eq!(verdicts, [Verdict::Pause], "closes: {closes}");
        assert_refused_as_keyed_stream(&host, &stream);
    }
    assert_eq!(host.counter("orders", Outcome::GrpcStreamWithKey), 2);
    assert_eq!(host.counter("orders", Outcome::Executed), 0);
}

#[test]
fn an_empty_first_message_does_not_hide_the_second() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let body = framed(&[b"", b"order"]);
    let empty = frame(b"").len();
    // The first message whole, then only part of the second's prefix: already a second.
    let (stream, verdicts) = send_stream(
        &host,
        &plugin,
        Some("k1"),
        &body,
        &[empty, empty + 2],
        false,
    );
    assert_eq!(verdicts, [Verdict::Pause, Verdict::Pause]);
    assert_refused_as_keyed_stream(&host, &stream);

    // Two empty messages ending the call: two messages all the same.
    let body = framed(&[b"", b""]);
    let (stream, _) = send_stream(&host, &plugin, Some("k2"), &body, &[body.len()], true);
    assert_refused_as_keyed_stream(&host, &stream);

    // One empty message is a unary call, protected.
    let (unary, _) = call(&host, &plugin, Some("k3"), b"");
    assert!(is_executing(&unary));
    assert_eq!(host.counter("orders", Outcome::GrpcStreamWithKey), 2);
}

#[test]
fn a_keyed_call_is_held_after_its_first_message_and_a_reset_then_claims_nothing() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let body = frame(b"order");
    // A bidirectional call waiting for an answer before its second message, or a client
    // that resets here: held, nothing claimed, nothing sent.
    let (mut held, verdicts) = send_stream(&host, &plugin, Some("k1"), &body, &[body.len()], false);
    assert_eq!(verdicts, [Verdict::Pause]);
    assert!(host.take_effects().is_empty(), "{:?}", host.take_effects());
    held.on(&host, Event::StreamEnd);
    assert!(host.take_effects().is_empty());
    drop(held);
    for outcome in Outcome::ALL {
        assert_eq!(host.counter("orders", outcome), 0, "{outcome:?}");
    }
    // The key is free: its unary call runs.
    let (unary, _) = call(&host, &plugin, Some("k1"), b"order");
    assert!(is_executing(&unary));
}

#[test]
fn a_stream_without_a_key_still_passes_and_one_with_a_malformed_key_is_refused() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let body = framed(&[b"a", b"b"]);
    let (keyless, verdicts) = send_stream(&host, &plugin, None, &body, &[body.len()], false);
    assert_eq!(verdicts, [Verdict::Continue]);
    assert!(matches!(keyless.state(), Journey::Unprotected));
    assert!(host.take_effects().is_empty());
    assert_eq!(host.counter("orders", Outcome::GrpcStreaming), 1);

    // The client sent the key's metadata, unusable as it is: it meant the call protected.
    let (malformed, _) = send_stream(
        &host,
        &plugin,
        Some("\"unterminated"),
        &body,
        &[body.len()],
        false,
    );
    assert_refused_as_keyed_stream(&host, &malformed);
    assert_eq!(host.counter("orders", Outcome::GrpcStreamWithKey), 1);
    assert_eq!(host.counter("orders", Outcome::InvalidKey), 0);
}

#[test]
fn a_keyed_stream_is_refused_under_an_optional_key_an_http_rule_and_a_small_request_limit() {
    let body = framed(&[b"0123456789", b"0123456789"]);
    for config in [
        r#"{"rules":[{"name":"orders","match":{"grpc_services":["shop.v1.Orders"]},
            "key":{"required":false}}]}"#,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/shop.v1.Orders/"]}}]}"#,
        r#"{"rules":[{"name":"orders","match":{"grpc_services":["shop.v1.Orders"]},
            "max_request_bytes":16}]}"#,
    ] {
        let host = FakeHost::default();
        let plugin = plugin(&host, config);
        let (stream, _) = send_stream(&host, &plugin, Some("k1"), &body, &[body.len()], false);
        assert_refused_as_keyed_stream(&host, &stream);
        assert_eq!(
            host.counter("orders", Outcome::GrpcStreamWithKey),
            1,
            "{config}"
        );
        assert_eq!(
            host.counter("orders", Outcome::PassedThrough),
            0,
            "{config}"
        );
    }
}

#[test]
fn any_of_the_keys_metadata_makes_a_stream_keyed() {
    let host = FakeHost::default();
    let config = r#"{"rules":[{"name":"orders","match":{"grpc_services":["shop.v1.Orders"]},
        "key":{"sources":[{"header":"x-tenant"},{"header":"idempotency-key"}]}}]}"#;
    let plugin = plugin(&host, config);
    let body = framed(&[b"a", b"b"]);
    // Only the second source's metadata: the key is incomplete, and still the call is keyed.
    let (stream, _) = send_stream(&host, &plugin, Some("k1"), &body, &[body.len()], false);
    assert_refused_as_keyed_stream(&host, &stream);
}

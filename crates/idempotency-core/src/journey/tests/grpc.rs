//! gRPC rules: unary calls recorded with their trailers and replayed (through the echo hop
//! when they carry a message), released by status, keyless streaming calls let through
//! (keyed ones: grpc_stream.rs), and the filter's own answers as trailers-only statuses.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use super::*;
use crate::fake_host::HostCall;
use crate::grpc::{ECHO_MARKER, HOP_CONTENT_TYPE, REPLAY_PATH};
use crate::host::HeaderPairs;
use crate::host::SharedData as _;
use crate::outcome::Outcome;

pub(super) const ORDERS_GRPC: &str =
    r#"{"rules":[{"name":"orders","match":{"grpc_services":["shop.v1.Orders"]}}]}"#;
pub(super) const PLACE: &str = "/shop.v1.Orders/PlaceOrder";

pub(super) fn frame(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

pub(super) fn grpc_headers<'a>(path: &'a str, key: Option<&'a str>) -> Vec<(&'a str, &'a str)> {
    let mut headers = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", "shop.local"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ];
    if let Some(k) = key {
        headers.push(("idempotency-key", k));
    }
    headers
}

pub(super) fn call(
    host: &FakeHost,
    plugin: &Rc<Plugin>,
    key: Option<&str>,
    message: &[u8],
) -> (RequestJourney, Verdict) {
    send(host, plugin, &grpc_headers(PLACE, key), &frame(message))
}

/// The upstream's response begins: its headers, then `body` as one chunk unless it is
/// empty, that chunk ending the stream when `ends`.
fn upstream_sends(
    host: &FakeHost,
    request: &mut RequestJourney,
    headers: &[(&str, &str)],
    body: &[u8],
    ends: bool,
) {
    envoy_reports(host, "via_upstream", 0, 1);
    host.set_response(headers, body);
    request.on(
        host,
        Event::ResponseHeaders {
            end_of_stream: false,
        },
    );
    if !body.is_empty() {
        request.on(
            host,
            Event::ResponseBody {
                size: body.len(),
                end_of_stream: ends,
            },
        );
    }
}

/// The upstream answers with headers, one message and trailers.
pub(super) fn answer(
    host: &FakeHost,
    request: &mut RequestJourney,
    message: &[u8],
    trailers: &[(&str, &str)],
) {
    let headers = [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("x-order-id", "o-1"),
    ];
    upstream_sends(host, request, &headers, &frame(message), false);
    *host.response_trailers.borrow_mut() = trailers
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect();
    request.on(host, Event::ResponseTrailers);
    request.on(host, Event::StreamEnd);
}

/// The upstream answers trailers-only with `status`.
fn answer_trailers_only(host: &FakeHost, request: &mut RequestJourney, status: &str) {
    envoy_reports(host, "via_upstream", 0, 1);
    host.set_response(
        &[
            (":status", "200"),
            ("content-type", "application/grpc"),
            ("grpc-status", status),
            ("grpc-message", "no such customer"),
            ("x-reason", "r"),
        ],
        b"",
    );
    request.on(
        host,
        Event::ResponseHeaders {
            end_of_stream: true,
        },
    );
    request.on(host, Event::StreamEnd);
}

pub(super) fn value<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a str> {
    header(headers, name).and_then(|v| std::str::from_utf8(v).ok())
}

#[test]
fn a_retry_of_a_completed_call_is_replayed_through_the_hop_with_its_trailers() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let (mut first, verdict) = call(&host, &plugin, Some("k1"), b"order");
    assert_eq!(verdict, Verdict::Continue);
    assert!(is_executing(&first));
    answer(
        &host,
        &mut first,
        b"placed",
        &[
            ("grpc-status", "0"),
            ("x-trailer", "t"),
            ("grpc-status-details-bin", "AAEC"),
        ],
    );
    host.take_effects();

    // The retry goes on, rewritten into a hop to the echo with the recorded message.
    let (mut retry, verdict) = call(&host, &plugin, Some("k1"), b"order");
    assert_eq!(verdict, Verdict::Continue);
    let edits = host.request_header_edits.borrow().clone();
    assert!(edits.contains(&(":path".to_string(), REPLAY_PATH.as_bytes().to_vec())));
    assert!(edits.contains(&(
        "content-type".to_string(),
        HOP_CONTENT_TYPE.as_bytes().to_vec()
    )));
    assert!(host
        .take_effects()
        .contains(&Effect::RequestBodySet(frame(b"placed"))));
    assert_eq!(host.counter("orders", Outcome::Replayed), 1);

    // The echo's answer becomes the recorded response, marked, and the trailers follow.
    host.set_response(
        &[
            (":status", "200"),
            (ECHO_MARKER, "1"),
            ("content-length", "11"),
        ],
        &frame(b"placed"),
    );
    assert_eq!(
        retry.on(
            &host,
            Event::ResponseHeaders {
                end_of_stream: false
            }
        ),
        Verdict::Continue
    );
    assert_eq!(
        retry.on(
            &host,
            Event::ResponseBody {
                size: 11,
                end_of_stream: true
            }
        ),
        Verdict::Continue
    );
    let effects = host.take_effects();
    for wanted in [
        Effect::RemoveResponseHeader(ECHO_MARKER.into()),
        Effect::RemoveResponseHeader("content-length".into()),
        Effect::ReplaceResponseHeader("x-order-id".into(), b"o-1".to_vec()),
        Effect::ReplaceResponseHeader("content-type".into(), b"application/grpc".to_vec()),
        Effect::ReplaceResponseHeader("idempotent-replayed".into(), b"true".to_vec()),
        Effect::AddResponseTrailer("grpc-status".into(), b"0".to_vec()),
        Effect::AddResponseTrailer("x-trailer".into(), b"t".to_vec()),
        Effect::AddResponseTrailer("grpc-status-details-bin".into(), b"AAEC".to_vec()),
    ] {
        assert!(
            effects.contains(&wanted),
            "{wanted:?} missing from {effects:?}"
        );
    }
    assert_eq!(host.counter("orders", Outcome::Executed), 1);
}

#[test]
fn a_hop_that_does_not_reach_the_echo_answers_unavailable() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    answer(&host, &mut first, b"placed", &[("grpc-status", "0")]);
    let (mut retry, _) = call(&host, &plugin, Some("k1"), b"order");
    host.take_effects();
    host.set_response(&[(":status", "404")], b"");
    retry.on(
        &host,
        Event::ResponseHeaders {
            end_of_stream: true,
        },
    );
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.len()), (200, 0));
    assert_eq!(value(&headers, "grpc-status"), Some("14"));
    // On-call sees the missing route in a counter, not only in the client's UNAVAILABLE.
    assert_eq!(host.counter("orders", Outcome::ReplayEchoUnrouted), 1);
}

#[test]
fn a_trailers_only_answer_is_recorded_and_replayed_as_one() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    answer_trailers_only(&host, &mut first, "5");
    host.take_effects();
    let (_, verdict) = call(&host, &plugin, Some("k1"), b"order");
    assert_eq!(verdict, Verdict::Pause);
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.len()), (200, 0));
    assert_eq!(value(&headers, "grpc-status"), Some("5"));
    assert_eq!(value(&headers, "grpc-message"), Some("no such customer"));
    assert_eq!(value(&headers, "x-reason"), Some("r"));
    assert_eq!(value(&headers, "idempotent-replayed"), Some("true"));
    assert!(host
        .request_header_edits
        .borrow()
        .iter()
        .all(|(n, _)| n != ":path"));
}

#[test]
fn transient_statuses_release_the_claim_and_the_retry_executes() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    answer(
        &host,
        &mut first,
        b"",
        &[("grpc-status", "14"), ("grpc-message", "busy")],
    );
    assert_eq!(host.counter("orders", Outcome::Released), 1);
    let (mut second, verdict) = call(&host, &plugin, Some("k1"), b"order");
    assert_eq!(verdict, Verdict::Continue);
    assert!(is_executing(&second));
    answer_trailers_only(&host, &mut second, "13");
    assert_eq!(host.counter("orders", Outcome::Released), 2);
    // A status outside the list is recorded: FAILED_PRECONDITION.
    let (mut third, _) = call(&host, &plugin, Some("k1"), b"order");
    answer_trailers_only(&host, &mut third, "9");
    host.take_effects();
    call(&host, &plugin, Some("k1"), b"order");
    let (_, headers, _) = the_reply(&host.take_effects());
    assert_eq!(value(&headers, "grpc-status"), Some("9"));
    assert_eq!(host.counter("orders", Outcome::Executed), 3);
}

#[test]
fn a_call_whose_stream_the_upstream_refused_is_released_and_its_retry_executes() {
    for (attempts, retry_runs) in [(1, true), (2, false)] {
        let host = FakeHost::default();
        let plugin = plugin(&host, ORDERS_GRPC);
        let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
        // Envoy's own answer to the refused stream: trailers-only UNAVAILABLE.
        envoy_reports(
            &host,
            REFUSED_STREAM,
            crate::who_answered::flag::UPSTREAM_REMOTE_RESET,
            attempts,
        );
        host.set_response(
            &[
                (":status", "200"),
                ("content-type", "application/grpc"),
                ("grpc-status", "14"),
                ("grpc-message", "upstream connect error or disconnect/reset before headers. reset reason: remote refused stream reset"),
            ],
            b"",
        );
        first.on(
            &host,
            Event::ResponseHeaders {
                end_of_stream: true,
            },
        );
        first.on(&host, Event::StreamEnd);
        host.take_effects();
        let (second, verdict) = call(&host, &plugin, Some("k1"), b"order");
        if retry_runs {
            assert_eq!(host.counter("orders", Outcome::Released), 1);
            assert_eq!(verdict, Verdict::Continue);
            assert!(is_executing(&second));
        } else {
            // Refused after an earlier attempt that may have run it: FAILED_PRECONDITION.
            assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 1);
            let (_, headers, _) = the_reply(&host.take_effects());
            assert_eq!(value(&headers, "grpc-status"), Some("9"));
        }
    }
}

#[test]
fn a_rules_own_release_list_replaces_the_default() {
    let host = FakeHost::default();
    let config = r#"{"rules":[{"name":"orders","match":{"grpc_methods":["shop.v1.Orders/PlaceOrder"]},
        "grpc":{"release_on_status":["NOT_FOUND"]}}]}"#;
    let plugin = plugin(&host, config);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    answer_trailers_only(&host, &mut first, "5");
    assert_eq!(host.counter("orders", Outcome::Released), 1);
    let (mut second, _) = call(&host, &plugin, Some("k1"), b"order");
    answer_trailers_only(&host, &mut second, "14");
    assert_eq!(
        host.counter("orders", Outcome::Released),
        1,
        "UNAVAILABLE is recorded here"
    );
}

#[test]
fn the_filters_answers_are_trailers_only_statuses() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    call(&host, &plugin, None, b"order");
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.len()), (200, 0));
    assert_eq!(value(&headers, "content-type"), Some("application/grpc"));
    assert_eq!(value(&headers, "grpc-status"), Some("3"));
    assert!(value(&headers, "grpc-message").is_some_and(|m| m.contains("idempotency key")));

    let (_first, _) = call(&host, &plugin, Some("k1"), b"order");
    call(&host, &plugin, Some("k1"), b"order");
    let (_, headers, _) = the_reply(&host.take_effects());
    assert_eq!(
        value(&headers, "grpc-status"),
        Some("10"),
        "in flight: ABORTED"
    );
    assert_eq!(value(&headers, "grpc-retry-pushback-ms"), Some("1000"));

    call(&host, &plugin, Some("k1"), b"another order");
    let (_, headers, _) = the_reply(&host.take_effects());
    assert_eq!(
        value(&headers, "grpc-status"),
        Some("3"),
        "another message: INVALID_ARGUMENT"
    );
    assert!(value(&headers, "idempotency-problem-type").is_some_and(|t| t.ends_with("key-reused")));
}

#[test]
fn a_call_cut_short_before_its_status_is_never_run_again() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    let headers = [(":status", "200"), ("content-type", "application/grpc")];
    upstream_sends(&host, &mut first, &headers, b"", false);
    first.on(&host, Event::StreamEnd);
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 1);
    host.take_effects();
    call(&host, &plugin, Some("k1"), b"order");
    let (_, headers, _) = the_reply(&host.take_effects());
    assert_eq!(
        value(&headers, "grpc-status"),
        Some("9"),
        "FAILED_PRECONDITION"
    );
    assert_eq!(value(&headers, "grpc-retry-pushback-ms"), None);
}

#[test]
fn streaming_calls_pass_unprotected_and_are_counted() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let mut two = frame(b"a");
    two.extend_from_slice(&frame(b"b"));
    // Two messages in one chunk, still open, no key: let go at once.
    host.set_request(&grpc_headers("/shop.v1.Orders/Upload", None), &two);
    let mut upload = RequestJourney::new(Rc::clone(&plugin));
    assert_eq!(
        upload.on(
            &host,
            Event::RequestHeaders {
                end_of_stream: false
            }
        ),
        Verdict::Pause
    );
    assert_eq!(
        upload.on(
            &host,
            Event::RequestBody {
                size: two.len(),
                end_of_stream: false
            }
        ),
        Verdict::Continue
    );
    assert!(matches!(upload.state(), Journey::Unprotected));
    // No message at all, nothing a method could run on: passes even with a key.
    let (empty, verdict) = send(
        &host,
        &plugin,
        &grpc_headers("/shop.v1.Orders/Upload", Some("k2")),
        b"",
    );
    assert_eq!(verdict, Verdict::Continue);
    assert!(matches!(empty.state(), Journey::Unprotected));
    assert_eq!(host.counter("orders", Outcome::GrpcStreaming), 2);
    assert_eq!(host.counter("orders", Outcome::Executed), 0);
}

#[test]
fn a_body_that_is_not_grpc_framing_is_refused_and_grpc_web_is_not_this_rules() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    send(
        &host,
        &plugin,
        &grpc_headers(PLACE, Some("k1")),
        &[0, 0, 0, 0, 9, 1],
    );
    let (_, headers, _) = the_reply(&host.take_effects());
    assert_eq!(value(&headers, "grpc-status"), Some("3"));
    assert!(
        value(&headers, "idempotency-problem-type").is_some_and(|t| t.ends_with("grpc-malformed"))
    );

    let mut web = grpc_headers(PLACE, Some("k1"));
    web[3] = ("content-type", "application/grpc-web+proto");
    let (request, verdict) = send(&host, &plugin, &web, &frame(b"x"));
    assert_eq!(verdict, Verdict::Continue);
    assert!(matches!(request.state(), Journey::Unprotected));
}

#[test]
fn grpc_rules_refuse_what_they_cannot_honour() {
    let host = FakeHost::default();
    for (config, needle) in [
        (
            r#"{"rules":[{"name":"o","match":{"grpc_services":["shop v1"]}}]}"#,
            "grpc_services[0]",
        ),
        (
            r#"{"rules":[{"name":"o","match":{"grpc_methods":["shop.v1.Orders"]}}]}"#,
            "grpc_methods[0]",
        ),
        (
            r#"{"rules":[{"name":"o","grpc":{"release_on_status":["OK"]}}]}"#,
            "release_on_status[0]",
        ),
        (
            r#"{"rules":[{"name":"o","grpc":{"release_on_status":["NOPE"]}}]}"#,
            "release_on_status[0]",
        ),
        (
            r#"{"rules":[{"name":"o","grpc":{},"execution":"detached"}]}"#,
            "execution",
        ),
        (
            r#"{"rules":[{"name":"o","grpc":{},"match":{"methods":["PUT"]}}]}"#,
            "match.methods",
        ),
        (
            r#"{"grpc_replay_echo":true,"rules":[{"name":"o"}]}"#,
            "grpc_replay_echo",
        ),
    ] {
        let err = crate::plugin::Plugin::configure(&host, config.as_bytes())
            .err()
            .unwrap_or_else(|| panic!("{config} accepted"));
        assert!(err.to_string().contains(needle), "{config}: {err}");
    }
}

#[test]
fn the_echo_answers_a_hop_with_its_body_and_nothing_else() {
    let host = FakeHost::default();
    let plugin = plugin(&host, r#"{"grpc_replay_echo":true}"#);
    assert!(
        plugin.config.table_layout.bound_bytes() <= 1024 * 1024,
        "the echo keeps no table"
    );
    let body = frame(b"placed");
    host.set_request(
        &[
            (":method", "POST"),
            (":path", REPLAY_PATH),
            ("content-type", HOP_CONTENT_TYPE),
        ],
        &body,
    );
    let mut hop = RequestJourney::new(Rc::clone(&plugin));
    assert_eq!(
        hop.on(
            &host,
            Event::RequestHeaders {
                end_of_stream: false
            }
        ),
        Verdict::Pause
    );
    assert_eq!(
        hop.on(
            &host,
            Event::RequestBody {
                size: body.len(),
                end_of_stream: true
            }
        ),
        Verdict::Pause
    );
    let (status, headers, reply) = the_reply(&host.take_effects());
    assert_eq!((status, reply), (200, body));
    assert_eq!(value(&headers, ECHO_MARKER), Some("1"));

    host.set_request(
        &[(":method", "POST"), (":path", "/shop.v1.Orders/PlaceOrder")],
        b"",
    );
    let mut other = RequestJourney::new(Rc::clone(&plugin));
    other.on(
        &host,
        Event::RequestHeaders {
            end_of_stream: true,
        },
    );
    let (status, _, _) = the_reply(&host.take_effects());
    assert_eq!(status, 404);
}

#[test]
fn a_streaming_call_without_a_key_passes_and_a_unary_one_is_refused_once_its_body_is_in() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let mut two = frame(b"a");
    two.extend_from_slice(&frame(b"b"));
    let (upload, verdict) = send(
        &host,
        &plugin,
        &grpc_headers("/shop.v1.Orders/Upload", None),
        &two,
    );
    assert_eq!(verdict, Verdict::Continue);
    assert!(matches!(upload.state(), Journey::Unprotected));
    assert!(
        host.take_effects().is_empty(),
        "no refusal for a streaming call"
    );
    assert_eq!(host.counter("orders", Outcome::GrpcStreaming), 1);

    host.set_request(&grpc_headers(PLACE, None), &frame(b"order"));
    let mut unary = RequestJourney::new(Rc::clone(&plugin));
    assert_eq!(
        unary.on(
            &host,
            Event::RequestHeaders {
                end_of_stream: false
            }
        ),
        Verdict::Pause
    );
    assert!(
        host.take_effects().is_empty(),
        "the refusal waits for the body"
    );
    unary.on(
        &host,
        Event::RequestBody {
            size: 10,
            end_of_stream: true,
        },
    );
    let (_, headers, _) = the_reply(&host.take_effects());
    assert_eq!(value(&headers, "grpc-status"), Some("3"));
    assert_eq!(host.counter("orders", Outcome::MissingKey), 1);
}

#[test]
fn a_response_without_its_status_is_an_unknown_outcome_and_a_garbled_one_is_unknown() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    // The body ends the stream: no trailers, no status.
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    let headers = [(":status", "200"), ("content-type", "application/grpc")];
    upstream_sends(&host, &mut first, &headers, &frame(b"x"), true);
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 1);
    // Trailers without grpc-status.
    let (mut second, _) = call(&host, &plugin, Some("k2"), b"order");
    answer(&host, &mut second, b"x", &[("x-trailer", "t")]);
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 2);
    // A status that is not a number reads as UNKNOWN, which releases by default.
    let (mut third, _) = call(&host, &plugin, Some("k3"), b"order");
    answer(&host, &mut third, b"", &[("grpc-status", "fourteen")]);
    assert_eq!(host.counter("orders", Outcome::Released), 1);
    host.take_effects();
    call(&host, &plugin, Some("k1"), b"order");
    let (_, headers, _) = the_reply(&host.take_effects());
    assert_eq!(value(&headers, "grpc-status"), Some("9"));
}

#[test]
fn a_recorded_non_grpc_answer_is_replayed_with_its_http_status() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    let headers = [(":status", "404"), ("content-type", "text/html")];
    upstream_sends(&host, &mut first, &headers, b"<h1>no</h1>", true);
    host.take_effects();
    call(&host, &plugin, Some("k1"), b"order");
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.len()), (404, 0));
    assert_eq!(
        value(&headers, "content-type"),
        None,
        "Envoy makes it gRPC's"
    );
    assert_eq!(value(&headers, "idempotent-replayed"), Some("true"));
}

#[test]
fn the_hop_drops_the_clients_length_and_keeps_every_value_of_repeated_metadata() {
    let host = FakeHost::default();
    let config = r#"{"rules":[{"name":"orders","match":{"grpc_services":["shop.v1.Orders"]},
        "replay_skip_headers":["grpc-status","x-envoy-*"]}]}"#;
    let plugin = plugin(&host, config);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    let headers = [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("x-tag", "a"),
        ("x-tag", "b"),
    ];
    upstream_sends(&host, &mut first, &headers, &frame(b"placed"), false);
    *host.response_trailers.borrow_mut() = vec![("grpc-status".into(), b"0".to_vec())];
    first.on(&host, Event::ResponseTrailers);
    host.take_effects();

    let mut headers = grpc_headers(PLACE, Some("k1"));
    headers.push(("content-length", "10"));
    let (mut retry, _) = send(&host, &plugin, &headers, &frame(b"order"));
    assert!(host
        .take_effects()
        .contains(&Effect::RemoveRequestHeader("content-length".into())));
    host.set_response(&[(":status", "200"), (ECHO_MARKER, "1")], &frame(b"placed"));
    retry.on(
        &host,
        Event::ResponseHeaders {
            end_of_stream: false,
        },
    );
    retry.on(
        &host,
        Event::ResponseBody {
            size: 11,
            end_of_stream: true,
        },
    );
    let effects = host.take_effects();
    assert!(effects.contains(&Effect::ReplaceResponseHeader(
        "x-tag".into(),
        b"a".to_vec()
    )));
    assert!(effects.contains(&Effect::AddResponseHeader("x-tag".into(), b"b".to_vec())));
    // gRPC's own trailers survive a skip list that names them.
    assert!(effects.contains(&Effect::AddResponseTrailer(
        "grpc-status".into(),
        b"0".to_vec()
    )));
}

#[test]
fn a_stream_longer_than_max_request_bytes_passes_as_a_stream() {
    let host = FakeHost::default();
    let config = r#"{"rules":[{"name":"orders","match":{"grpc_services":["shop.v1.Orders"]},
        "max_request_bytes":16}]}"#;
    let plugin = plugin(&host, config);
    let mut stream = frame(b"0123456789");
    stream.extend_from_slice(&frame(b"0123456789"));
    host.set_request(&grpc_headers("/shop.v1.Orders/Upload", None), &stream);
    let mut upload = RequestJourney::new(Rc::clone(&plugin));
    upload.on(
        &host,
        Event::RequestHeaders {
            end_of_stream: false,
        },
    );
    let verdict = upload.on(
        &host,
        Event::RequestBody {
            size: stream.len(),
            end_of_stream: false,
        },
    );
    assert_eq!(verdict, Verdict::Continue);
    assert!(host.take_effects().is_empty(), "not refused as too large");
    assert_eq!(host.counter("orders", Outcome::GrpcStreaming), 1);
}

/// Duplicates are held while the first call runs.
const ORDERS_WAITING: &str = r#"{"rules":[{"name":"orders","match":{"grpc_services":["shop.v1.Orders"]},
    "on_in_flight":"wait","wait_ms":2000}]}"#;

#[test]
fn a_held_duplicate_is_replayed_through_the_hop_and_resumed_by_the_root() {
    let host = FakeHost::default();
    let mut root = configured_root(&host, ORDERS_WAITING, 1);
    let order = frame(b"order");
    let arrive = |context: u32| {
        request_in_context(
            &host,
            &root,
            context,
            &grpc_headers(PLACE, Some("k1")),
            &order,
        )
    };
    let (first, _) = arrive(7);
    let (held, verdict) = arrive(8);
    assert_eq!(verdict, Verdict::Pause);
    assert!(matches!(held.borrow().state(), Journey::Waiting(_)));
    host.effective_context.set(7);
    answer(
        &host,
        &mut first.borrow_mut(),
        b"placed",
        &[("grpc-status", "0")],
    );
    host.take_effects();
    host.effective_context.set(1);
    root.on_tick(&host);
    // The root delivered the record: the held request is rewritten into the hop and resumed
    // (the callback that paused it has long returned, so nothing else would let it go on).
    let effects = host.take_effects();
    assert!(
        effects.contains(&Effect::RequestBodySet(frame(b"placed"))),
        "{effects:?}"
    );
    assert!(effects.contains(&Effect::Resume), "{effects:?}");
    assert!(matches!(held.borrow().state(), Journey::ReplayHop(_)));
    assert_eq!(host.counter("orders", Outcome::ReplayedAfterWait), 1);
}

/// An HTTP rule matched by path prefix, as a new user writes one for a gRPC service.
const ORDERS_BY_PREFIX: &str =
    r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/shop.v1.Orders/"]}}]}"#;

#[test]
fn an_http_rule_gives_the_grpc_calls_it_matches_grpcs_semantics() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_BY_PREFIX);

    // A success is replayed through the hop (its message and trailers), not as a local
    // reply a client would read as UNKNOWN with the recorded frame as its message.
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    answer(&host, &mut first, b"placed", &[("grpc-status", "0")]);
    host.take_effects();
    let (_, verdict) = call(&host, &plugin, Some("k1"), b"order");
    assert_eq!(verdict, Verdict::Continue);
    assert!(host
        .request_header_edits
        .borrow()
        .contains(&(":path".to_string(), REPLAY_PATH.as_bytes().to_vec())));
    assert!(replies(&host.take_effects()).is_empty());
    assert_eq!(host.counter("orders", Outcome::Replayed), 1);

    // UNAVAILABLE in the trailers (HTTP 200) releases the claim: the retry runs.
    let (mut transient, _) = call(&host, &plugin, Some("k2"), b"order");
    answer(&host, &mut transient, b"", &[("grpc-status", "14")]);
    assert_eq!(host.counter("orders", Outcome::Released), 1);
    let (retry, verdict) = call(&host, &plugin, Some("k2"), b"order");
    assert_eq!(verdict, Verdict::Continue);
    assert!(is_executing(&retry));

    // The filter's own answers are gRPC statuses, not a 409 or a 400.
    host.take_effects();
    call(&host, &plugin, Some("k2"), b"order");
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.len()), (200, 0));
    assert_eq!(
        value(&headers, "grpc-status"),
        Some("10"),
        "in flight: ABORTED"
    );
    call(&host, &plugin, None, b"order");
    let (status, headers, _) = the_reply(&host.take_effects());
    assert_eq!(status, 200);
    assert_eq!(
        value(&headers, "grpc-status"),
        Some("3"),
        "no key: INVALID_ARGUMENT"
    );

    // The rule's HTTP requests keep HTTP's semantics.
    let (_, _) = send(
        &host,
        &plugin,
        &post_headers("/shop.v1.Orders/PlaceOrder", None),
        b"{}",
    );
    let (status, _, _) = the_reply(&host.take_effects());
    assert_eq!(status, 400);
    assert_eq!(host.counter("orders", Outcome::GrpcOnHttpRule), 0);
}

#[test]
fn grpc_calls_on_an_http_rule_that_reads_the_body_pass_unprotected_and_counted() {
    let host = FakeHost::default();
    let config = r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/shop.v1.Orders/"]},
        "key":{"sources":[{"json":"/id"}]}}]}"#;
    let plugin = plugin(&host, config);
    for key in ["k1", "k1"] {
        let (request, verdict) = call(&host, &plugin, Some(key), b"order");
        assert_eq!(verdict, Verdict::Continue);
        assert!(matches!(request.state(), Journey::Unprotected));
    }
    assert!(replies(&host.take_effects()).is_empty());
    assert_eq!(host.counter("orders", Outcome::GrpcOnHttpRule), 2);
    assert_eq!(host.counter("orders", Outcome::Executed), 0);

    // gRPC-Web carries its status in the body: never protected as HTTP, even by a rule
    // whose key a gRPC call could give.
    let host = FakeHost::default();
    let by_header = super::plugin(&host, ORDERS_BY_PREFIX);
    let mut web = grpc_headers(PLACE, Some("k1"));
    web[3] = ("content-type", "application/grpc-web+proto");
    let (request, _) = send(&host, &by_header, &web, &frame(b"x"));
    assert!(matches!(request.state(), Journey::Unprotected));
    assert!(replies(&host.take_effects()).is_empty());
    assert_eq!(host.counter("orders", Outcome::GrpcOnHttpRule), 1);
    assert_eq!(host.counter("orders", Outcome::Executed), 0);
}

#[test]
fn an_echo_sharing_the_filters_vm_id_is_refused_whichever_comes_first() {
    let host = FakeHost::default();
    let filter = configured_root(&host, ORDERS_GRPC, 1);
    let tables_key = format!("{}/idempotency/v2/tables", crate::plugin::NAMESPACE);
    let tables = host.get(&tables_key).unwrap();
    // Later than the mark's life: the filter's tick renews it.
    host.clock_ms.set(host.clock_ms.get() + 60_000);
    let mut filter = filter;
    filter.on_tick(&host);
    *host.configuration.borrow_mut() = br#"{"grpc_replay_echo":true}"#.to_vec();
    let mut echo = crate::root::PluginRoot::new(2);
    assert!(
        !echo.on_configure(&host),
        "the echo shares the filter's vm_id"
    );
    assert!(echo.new_request(3).is_none());
    assert_eq!(
        host.get(&tables_key).unwrap(),
        tables,
        "the refused echo laid out no table"
    );

    // Once the filter is gone (its mark no longer renewed) the echo may run there, and then a
    // filter may not.
    drop(filter);
    host.clock_ms.set(host.clock_ms.get() + 60_000);
    let _echo = configured_root(&host, r#"{"grpc_replay_echo":true}"#, 4);
    *host.configuration.borrow_mut() = ORDERS_GRPC.as_bytes().to_vec();
    let mut late_filter = crate::root::PluginRoot::new(5);
    assert!(!late_filter.on_configure(&host));
}

#[test]
fn an_echo_in_another_vm_with_the_filters_vm_id_leaves_its_table_alone() {
    // Same vm_id, other VM settings: Envoy starts two VMs, which share one shared-data map.
    let host = FakeHost::default();
    let tables_key = format!("{}/idempotency/v2/tables", crate::plugin::NAMESPACE);
    let _filter = plugin(&host, ORDERS_GRPC);
    let tables = host.get(&tables_key).unwrap();
    let _echo = plugin(&host, r#"{"grpc_replay_echo":true}"#);
    assert_eq!(host.get(&tables_key).unwrap(), tables);
}

#[test]
fn a_record_answers_only_the_protocol_that_made_it() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/shop.v1.Orders/"]},
            "fingerprint":"none"}]}"#,
    );
    // The call's headers as an HTTP client would send them: same host, path and key.
    let http = |key| {
        let mut headers = grpc_headers(PLACE, Some(key));
        headers.retain(|(name, _)| *name != "te");
        for (name, value) in headers.iter_mut() {
            if *name == "content-type" {
                *value = "application/json";
            }
        }
        headers
    };

    // A call's record is no answer to an HTTP request with its key: 422, never its frames.
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    answer(&host, &mut first, b"placed", &[("grpc-status", "0")]);
    host.take_effects();
    send(&host, &plugin, &http("k1"), b"{}");
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 422, "{}", String::from_utf8_lossy(&body));

    // Nor is an HTTP record an answer to a call: refused as a reused key, not replayed.
    let (mut first, _) = send(&host, &plugin, &http("k2"), b"{}");
    respond(&host, &mut first, 201, b"{\"id\":1}");
    host.take_effects();
    let (_, verdict) = call(&host, &plugin, Some("k2"), b"order");
    assert_eq!(verdict, Verdict::Pause);
    let (_, headers, _) = the_reply(&host.take_effects());
    assert_eq!(
        value(&headers, "grpc-status"),
        Some("3"),
        "INVALID_ARGUMENT: key reused"
    );
    assert_eq!(host.counter("orders", Outcome::Mismatch), 2);
    assert_eq!(host.counter("orders", Outcome::Replayed), 0);
}

// --------------------------------------------------------------------------
// a host that sends trailers itself (the native build): no hop
// --------------------------------------------------------------------------

/// The replies a host that sends trailers made: (status, headers, body, trailers).
fn replies_with_trailers(effects: &[Effect]) -> Vec<(u16, HeaderPairs, Vec<u8>, HeaderPairs)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::ReplyWithTrailers {
                status,
                headers,
                body,
                trailers,
            } => Some((*status, headers.clone(), body.clone(), trailers.clone())),
            _ => None,
        })
        .collect()
}

fn trailers_host() -> FakeHost {
    let host = FakeHost::default();
    host.sends_trailers.set(true);
    host
}

#[test]
fn a_host_that_sends_trailers_replays_the_message_itself_without_a_hop() {
    let host = trailers_host();
    let plugin = plugin(&host, ORDERS_GRPC);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    answer(
        &host,
        &mut first,
        b"placed",
        &[("grpc-status", "0"), ("x-trailer", "t")],
    );
    host.take_effects();
    host.request_header_edits.borrow_mut().clear();

    let (retry, verdict) = call(&host, &plugin, Some("k1"), b"order");
    // Answered here: the retry goes nowhere, not even to an echo.
    assert_eq!(verdict, Verdict::Pause);
    assert!(matches!(retry.state(), Journey::AnsweredLocally));
    assert!(host
        .request_header_edits
        .borrow()
        .iter()
        .all(|(n, _)| n != ":path" && n != "content-type"));
    let effects = host.take_effects();
    assert!(
        !effects
            .iter()
            .any(|e| matches!(e, Effect::RequestBodySet(_) | Effect::Resume)),
        "{effects:?}"
    );
    let sent = replies_with_trailers(&effects);
    assert_eq!(sent.len(), 1, "{effects:?}");
    let (status, headers, body, trailers) = &sent[0];
    assert_eq!(
        (*status, body.as_slice()),
        (200, frame(b"placed").as_slice())
    );
    assert_eq!(value(headers, "content-type"), Some("application/grpc"));
    assert_eq!(value(headers, "x-order-id"), Some("o-1"));
    assert_eq!(value(headers, "idempotent-replayed"), Some("true"));
    assert_eq!(value(trailers, "grpc-status"), Some("0"));
    assert_eq!(value(trailers, "x-trailer"), Some("t"));
    assert_eq!(host.counter("orders", Outcome::Replayed), 1);
    assert_eq!(host.counter("orders", Outcome::ReplayEchoUnrouted), 0);
}

#[test]
fn a_host_that_sends_trailers_still_replays_a_call_without_a_message_trailers_only() {
    let host = trailers_host();
    let plugin = plugin(&host, ORDERS_GRPC);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    answer_trailers_only(&host, &mut first, "5");
    host.take_effects();
    let (_, verdict) = call(&host, &plugin, Some("k1"), b"order");
    assert_eq!(verdict, Verdict::Pause);
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.len()), (200, 0));
    assert_eq!(value(&headers, "grpc-status"), Some("5"));
    assert_eq!(value(&headers, "idempotent-replayed"), Some("true"));
}

#[test]
fn a_replay_the_host_refuses_to_send_is_unavailable_and_runs_nothing() {
    let host = trailers_host();
    let plugin = plugin(&host, ORDERS_GRPC);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    answer(&host, &mut first, b"placed", &[("grpc-status", "0")]);
    host.take_effects();
    host.fail(HostCall::ReplyWithTrailers);
    let (retry, verdict) = call(&host, &plugin, Some("k1"), b"order");
    assert_eq!(verdict, Verdict::Pause);
    assert!(matches!(retry.state(), Journey::AnsweredLocally));
    let effects = host.take_effects();
    assert!(!effects.contains(&Effect::Resume), "{effects:?}");
    let (status, headers, _) = the_reply(&effects);
    assert_eq!(status, 200);
    assert_eq!(value(&headers, "grpc-status"), Some("14"));

    // Refused whole (the UNAVAILABLE too): held rather than let on, so the write does not
    // run again (Envoy's own timeouts end it).
    host.fail(HostCall::LocalReply);
    let (retry, verdict) = call(&host, &plugin, Some("k1"), b"order");
    host.heal(HostCall::LocalReply);
    assert_eq!(verdict, Verdict::Pause);
    assert!(matches!(retry.state(), Journey::AnsweredLocally));
    assert!(!host.take_effects().contains(&Effect::Resume));
    assert_eq!(host.counter("orders", Outcome::Executed), 1);
}

#[test]
fn a_held_duplicate_is_replayed_by_a_host_that_sends_trailers_and_not_resumed() {
    let host = trailers_host();
    let mut root = configured_root(&host, ORDERS_WAITING, 1);
    let order = frame(b"order");
    let arrive = |context: u32| {
        request_in_context(
            &host,
            &root,
            context,
            &grpc_headers(PLACE, Some("k1")),
            &order,
        )
    };
    let (first, _) = arrive(7);
    let (held, verdict) = arrive(8);
    assert_eq!(verdict, Verdict::Pause);
    host.effective_context.set(7);
    answer(
        &host,
        &mut first.borrow_mut(),
        b"placed",
        &[("grpc-status", "0")],
    );
    host.take_effects();
    host.effective_context.set(1);
    root.on_tick(&host);
    let effects = host.take_effects();
    // Answered whole; resuming it would send the duplicate upstream.
    assert_eq!(replies_with_trailers(&effects).len(), 1, "{effects:?}");
    assert!(!effects.contains(&Effect::Resume), "{effects:?}");
    assert!(matches!(held.borrow().state(), Journey::AnsweredLocally));
    assert_eq!(host.counter("orders", Outcome::ReplayedAfterWait), 1);
}

#[test]
fn a_keyed_call_over_max_request_bytes_is_refused_even_when_the_key_is_optional() {
    let host = FakeHost::default();
    let config = r#"{"rules":[{"name":"orders","match":{"grpc_services":["shop.v1.Orders"]},
        "key":{"required":false},"max_request_bytes":16}]}"#;
    let plugin = plugin(&host, config);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    answer(&host, &mut first, b"placed", &[("grpc-status", "0")]);
    host.take_effects();
    // Its key says the client wants it protected: too large to read, it is refused rather
    // than run unprotected (which would run the recorded call again).
    let (large, verdict) = call(&host, &plugin, Some("k1"), &[b'x'; 64]);
    assert_eq!(verdict, Verdict::Pause);
    let (_, headers, _) = the_reply(&host.take_effects());
    assert_eq!(
        value(&headers, "grpc-status"),
        Some("8"),
        "RESOURCE_EXHAUSTED"
    );
    assert!(matches!(large.state(), Journey::AnsweredLocally));
    // Without the key it passes, as an optional key lets it.
    let (keyless, verdict) = call(&host, &plugin, None, &[b'x'; 64]);
    assert_eq!(verdict, Verdict::Continue);
    assert!(matches!(keyless.state(), Journey::Unprotected));
    assert_eq!(host.counter("orders", Outcome::PassedThrough), 1);
    assert_eq!(host.counter("orders", Outcome::Executed), 1);
}

//! gRPC unary calls through the exported hooks over the mocked ABI, with the real core and
//! configuration: a replay goes out whole from the module (headers, message, trailers), with
//! no hop to an echo; the filter's answers are trailers-only statuses; and a
//! `grpc_replay_echo` configuration loads beside the filter's and answers hops.

use std::ffi::c_void;

use crate::abi::ffi;
use crate::abi::hooks::{self, *};
use crate::abi::mock_abi::{reset, with, Pairs, Part};

const REQ: u32 = ffi::HEADER_TYPE_REQUEST_HEADER;
const RESP: u32 = ffi::HEADER_TYPE_RESPONSE_HEADER;
const RESP_TRAILERS: u32 = ffi::HEADER_TYPE_RESPONSE_TRAILER;
const PLACE: &str = "/shop.v1.Orders/PlaceOrder";
const ORDERS: &[u8] = br#"{"rules":[{"name":"orders","match":{"grpc_methods":["shop.v1.Orders/PlaceOrder"]},"ttl_seconds":60}]}"#;

fn fake(n: usize) -> *mut c_void {
    n as *mut c_void
}

fn load(json: &[u8]) -> ffi::HttpFilterConfigModulePtr {
    hooks::new_config(crate::FACTORY_BUILDER, fake(9), b"idem", json)
}

fn loaded(json: &[u8]) -> ffi::HttpFilterConfigModulePtr {
    let config = load(json);
    assert!(
        !config.is_null(),
        "config refused: {:?}",
        with(|a| a.logs.clone())
    );
    config
}

fn pairs(list: &[(&str, &str)]) -> Pairs {
    list.iter()
        .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
        .collect()
}

fn frame(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0];
    out.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// The headers of a call to the unary method, with `key` if given.
fn call_headers(key: Option<&str>) -> Pairs {
    let mut headers = vec![
        (":method", "POST"),
        (":path", PLACE),
        (":authority", "shop"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ];
    if let Some(key) = key {
        headers.push(("idempotency-key", key));
    }
    pairs(&headers)
}

/// A unary call's headers (with `key` if given) and its one message, as Envoy delivers them:
/// headers, then the body ending the stream. The statuses Envoy gets back.
fn call(
    config: ffi::HttpFilterConfigModulePtr,
    ptr: usize,
    key: Option<&str>,
    body: &[u8],
) -> (ffi::HttpFilterModulePtr, u32) {
    with(|abi| {
        abi.maps.insert(REQ, call_headers(key));
        abi.bodies.clear();
        abi.bodies
            .insert(ffi::BODY_TYPE_RECEIVED_REQUEST_BODY, vec![body.to_vec()]);
    });
    let module = envoy_dynamic_module_on_http_filter_new(config, fake(ptr));
    assert!(!module.is_null());
    let headers_status =
        envoy_dynamic_module_on_http_filter_request_headers(fake(ptr), module, false);
    assert_eq!(
        headers_status,
        ffi::HEADERS_STOP_ITERATION,
        "held for its body"
    );
    let body_status = envoy_dynamic_module_on_http_filter_request_body(fake(ptr), module, true);
    (module, body_status)
}

/// The service answers: headers, `message` (if any), then trailers.
fn answer(ptr: usize, module: ffi::HttpFilterModulePtr, message: &[u8], trailers: &[(&str, &str)]) {
    with(|abi| {
        abi.maps.insert(
            RESP,
            pairs(&[
                (":status", "200"),
                ("content-type", "application/grpc"),
                ("x-order-id", "o-1"),
            ]),
        );
        abi.bodies.clear();
        abi.bodies.insert(
            ffi::BODY_TYPE_RECEIVED_RESPONSE_BODY,
            vec![message.to_vec()],
        );
        abi.maps.insert(RESP_TRAILERS, pairs(trailers));
    });
    envoy_dynamic_module_on_http_filter_response_headers(fake(ptr), module, false);
    if !message.is_empty() {
        envoy_dynamic_module_on_http_filter_response_body(fake(ptr), module, false);
    }
    envoy_dynamic_module_on_http_filter_response_trailers(fake(ptr), module);
}

fn end(ptr: usize, module: ffi::HttpFilterModulePtr) {
    envoy_dynamic_module_on_http_filter_stream_complete(fake(ptr), module);
    envoy_dynamic_module_on_http_filter_destroy(module);
}

fn parts_to(ptr: usize) -> Vec<Part> {
    with(|abi| {
        abi.parts
            .iter()
            .filter(|p| match p {
                Part::Headers(f, ..) | Part::Data(f, ..) | Part::Trailers(f, ..) => *f == ptr,
            })
            .cloned()
            .collect()
    })
}

fn value<'a>(headers: &'a Pairs, name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
}

/// The trailers-only answer sent to `ptr`: its headers (the status among them).
fn trailers_only_to(ptr: usize) -> Pairs {
    match parts_to(ptr).as_slice() {
        [Part::Headers(_, headers, true)] => headers.clone(),
        other => panic!("expected one trailers-only answer, got {other:?}"),
    }
}

#[test]
fn a_retry_gets_the_recorded_message_and_trailers_from_the_module_itself() {
    reset();
    let config = loaded(ORDERS);
    let (first, status) = call(config, 501, Some("native-grpc-replay"), &frame(b"order"));
    assert_eq!(status, ffi::BODY_CONTINUE, "the first call goes upstream");
    answer(
        501,
        first,
        &frame(b"placed"),
        &[("grpc-status", "0"), ("x-trailer", "done")],
    );
    end(501, first);

    let (retry, status) = call(config, 502, Some("native-grpc-replay"), &frame(b"order"));
    assert_eq!(status, ffi::BODY_STOP_ITERATION_AND_BUFFER, "answered here");
    // No hop: the retry's path and content type are its own still.
    with(|abi| {
        let request = abi.maps.get(&REQ).cloned().unwrap_or_default();
        assert_eq!(value(&request, ":path"), Some(PLACE));
        assert_eq!(value(&request, "content-type"), Some("application/grpc"));
        assert!(
            abi.responses.iter().all(|r| r.0 != 502),
            "not Envoy's local reply"
        );
    });
    match parts_to(502).as_slice() {
        [Part::Headers(_, headers, false), Part::Data(_, data, false), Part::Trailers(_, trailers)] =>
        {
            assert_eq!(value(headers, ":status"), Some("200"));
            assert_eq!(value(headers, "content-type"), Some("application/grpc"));
            assert_eq!(value(headers, "x-order-id"), Some("o-1"));
            assert_eq!(value(headers, "idempotent-replayed"), Some("true"));
            assert_eq!(value(headers, "content-length"), None);
            assert_eq!(data, &frame(b"placed"));
            assert_eq!(value(trailers, "grpc-status"), Some("0"));
            assert_eq!(value(trailers, "x-trailer"), Some("done"));
        }
        other => panic!("expected headers, message, trailers; got {other:?}"),
    }
    end(502, retry);
}

#[test]
fn an_error_is_replayed_trailers_only_and_the_filters_answers_are_statuses() {
    reset();
    let config = loaded(ORDERS);
    let (first, _) = call(config, 511, Some("native-grpc-error"), &frame(b"order"));
    // NOT_FOUND, trailers-only from the service.
    with(|abi| {
        abi.maps.insert(
            RESP,
            pairs(&[
                (":status", "200"),
                ("content-type", "application/grpc"),
                ("grpc-status", "5"),
                ("grpc-message", "no such customer"),
            ]),
        )
    });
    envoy_dynamic_module_on_http_filter_response_headers(fake(511), first, true);
    end(511, first);
    let (retry, _) = call(config, 512, Some("native-grpc-error"), &frame(b"order"));
    let replay = trailers_only_to(512);
    assert_eq!(value(&replay, "grpc-status"), Some("5"));
    assert_eq!(value(&replay, "grpc-message"), Some("no such customer"));
    assert_eq!(value(&replay, "idempotent-replayed"), Some("true"));
    assert_eq!(value(&replay, "content-type"), Some("application/grpc"));
    end(512, retry);

    // No key: INVALID_ARGUMENT, never an HTTP 400.
    let (bare, status) = call(config, 513, None, &frame(b"order"));
    assert_eq!(status, ffi::BODY_STOP_ITERATION_AND_BUFFER);
    let refused = trailers_only_to(513);
    assert_eq!(value(&refused, ":status"), Some("200"));
    assert_eq!(value(&refused, "grpc-status"), Some("3"));
    end(513, bare);

    // Another message under a recorded key: INVALID_ARGUMENT (HTTP's 422).
    let (other, _) = call(config, 514, Some("native-grpc-error"), &frame(b"other"));
    assert_eq!(value(&trailers_only_to(514), "grpc-status"), Some("3"));
    end(514, other);

    // Not gRPC framing: INVALID_ARGUMENT (HTTP's 400).
    let (garbled, _) = call(config, 515, Some("native-grpc-garbled"), b"\x00\x00\x00");
    assert_eq!(value(&trailers_only_to(515), "grpc-status"), Some("3"));
    end(515, garbled);
}

#[test]
fn a_duplicate_while_the_first_runs_is_aborted_with_pushback() {
    reset();
    let config = loaded(ORDERS);
    let (first, _) = call(config, 521, Some("native-grpc-busy"), &frame(b"order"));
    let (busy, _) = call(config, 522, Some("native-grpc-busy"), &frame(b"order"));
    let answer = trailers_only_to(522);
    assert_eq!(value(&answer, "grpc-status"), Some("10"));
    assert_eq!(value(&answer, "grpc-retry-pushback-ms"), Some("1000"));
    end(522, busy);
    end(521, first);
}

#[test]
fn the_echo_configuration_loads_beside_the_filters_and_answers_hops() {
    reset();
    // As Envoy's program init does: the module's log lines reach Envoy's log.
    crate::abi::install_logger();
    // Either order: the echo keeps no root, so it marks no role in the process's map.
    let filter = loaded(ORDERS);
    let echo = loaded(br#"{"grpc_replay_echo": true}"#);
    let filter_again = loaded(ORDERS);
    assert!(!filter.is_null() && !filter_again.is_null());
    assert!(
        with(|abi| abi
            .logs
            .iter()
            .any(|(_, l)| l.contains("grpc_replay_echo: the native build's filter replays"))),
        "the load says the native filter does not use the echo"
    );

    // A hop (from a Wasm build's filter) is answered with its body, marked.
    with(|abi| {
        abi.maps.insert(
            REQ,
            pairs(&[
                (":method", "POST"),
                (":path", "/idempotency.filter.v1.Replay/Echo"),
                ("content-type", "application/x-idempotency-replay"),
            ]),
        );
        abi.bodies.clear();
        abi.bodies
            .insert(ffi::BODY_TYPE_RECEIVED_REQUEST_BODY, vec![frame(b"placed")]);
    });
    let hop = envoy_dynamic_module_on_http_filter_new(echo, fake(531));
    envoy_dynamic_module_on_http_filter_request_headers(fake(531), hop, false);
    envoy_dynamic_module_on_http_filter_request_body(fake(531), hop, true);
    let (status, headers, body) = with(|abi| {
        abi.responses
            .iter()
            .find(|r| r.0 == 531)
            .map(|r| (r.1, r.2.clone(), r.3.clone()))
    })
    .unwrap();
    assert_eq!((status, body), (200, frame(b"placed")));
    assert_eq!(value(&headers, "x-idempotency-replay-echo"), Some("1"));
    end(531, hop);

    // Anything else: 404, nothing passes.
    with(|abi| {
        abi.maps
            .insert(REQ, pairs(&[(":method", "POST"), (":path", PLACE)]))
    });
    let stray = envoy_dynamic_module_on_http_filter_new(echo, fake(532));
    let status = envoy_dynamic_module_on_http_filter_request_headers(fake(532), stray, true);
    assert_eq!(status, ffi::HEADERS_STOP_ITERATION);
    assert!(with(|abi| abi
        .responses
        .iter()
        .any(|r| r.0 == 532 && r.1 == 404)));
    end(532, stray);
    for config in [filter, echo, filter_again] {
        envoy_dynamic_module_on_http_filter_config_destroy(config);
    }
}

/// A client that goes away at each step of its first call: before the call went upstream
/// nothing is claimed; once it went upstream (before any answer, or after the message but
/// before the status) its outcome is unknown and the retry is FAILED_PRECONDITION, never run
/// again. A replay whose client leaves loses nothing: the next retry is replayed too.
#[test]
fn a_client_that_resets_at_each_step_never_gets_its_write_run_twice() {
    reset();
    let config = loaded(ORDERS);

    // Gone while its message was still arriving: nothing claimed, the next call runs.
    let module = envoy_dynamic_module_on_http_filter_new(config, fake(541));
    with(|abi| {
        abi.maps.insert(
            REQ,
            pairs(&[
                (":method", "POST"),
                (":path", PLACE),
                ("content-type", "application/grpc"),
                ("idempotency-key", "native-grpc-reset-early"),
            ]),
        )
    });
    envoy_dynamic_module_on_http_filter_request_headers(fake(541), module, false);
    end(541, module);
    let (next, status) = call(
        config,
        542,
        Some("native-grpc-reset-early"),
        &frame(b"order"),
    );
    assert_eq!(status, ffi::BODY_CONTINUE, "nothing held the key");
    end(542, next);

    // Gone after the call went upstream, before any answer.
    let (running, status) = call(config, 543, Some("native-grpc-reset-running"), &frame(b"o"));
    assert_eq!(status, ffi::BODY_CONTINUE);
    end(543, running);
    let (retry, status) = call(config, 544, Some("native-grpc-reset-running"), &frame(b"o"));
    assert_eq!(status, ffi::BODY_STOP_ITERATION_AND_BUFFER, "not run again");
    assert_eq!(value(&trailers_only_to(544), "grpc-status"), Some("9"));
    end(544, retry);

    // Gone after the message, before the status.
    let (running, _) = call(config, 545, Some("native-grpc-reset-midway"), &frame(b"o"));
    with(|abi| {
        abi.maps.insert(
            RESP,
            pairs(&[(":status", "200"), ("content-type", "application/grpc")]),
        );
        abi.bodies.insert(
            ffi::BODY_TYPE_RECEIVED_RESPONSE_BODY,
            vec![frame(b"placed")],
        );
    });
    envoy_dynamic_module_on_http_filter_response_headers(fake(545), running, false);
    envoy_dynamic_module_on_http_filter_response_body(fake(545), running, false);
    end(545, running);
    let (retry, status) = call(config, 546, Some("native-grpc-reset-midway"), &frame(b"o"));
    assert_eq!(status, ffi::BODY_STOP_ITERATION_AND_BUFFER, "not run again");
    assert_eq!(value(&trailers_only_to(546), "grpc-status"), Some("9"));
    end(546, retry);

    // A replay whose client left: the record is still there for the next retry.
    let (first, _) = call(config, 547, Some("native-grpc-reset-replay"), &frame(b"o"));
    answer(547, first, &frame(b"placed"), &[("grpc-status", "0")]);
    end(547, first);
    let (replay, _) = call(config, 548, Some("native-grpc-reset-replay"), &frame(b"o"));
    envoy_dynamic_module_on_http_filter_destroy(replay);
    let (again, status) = call(config, 549, Some("native-grpc-reset-replay"), &frame(b"o"));
    assert_eq!(status, ffi::BODY_STOP_ITERATION_AND_BUFFER);
    assert!(
        matches!(parts_to(549).as_slice(), [Part::Headers(..), Part::Data(_, data, false), Part::Trailers(..)] if data == &frame(b"placed"))
    );
    end(549, again);
}

/// Trailers far larger than any a client accepts still go out as recorded, in one call (the
/// module adds no limit of its own; Envoy's codec and the client's apply, as on the first
/// call): the replay is the first call's answer, whatever happens to it on the way.
#[test]
fn huge_recorded_trailers_are_replayed_as_recorded() {
    reset();
    let config = loaded(ORDERS);
    let big = "t".repeat(256 * 1024);
    let (first, _) = call(config, 551, Some("native-grpc-huge-trailers"), &frame(b"o"));
    answer(
        551,
        first,
        &frame(b"placed"),
        &[("grpc-status", "0"), ("x-big", &big)],
    );
    end(551, first);
    let (retry, _) = call(config, 552, Some("native-grpc-huge-trailers"), &frame(b"o"));
    match parts_to(552).as_slice() {
        [Part::Headers(..), Part::Data(..), Part::Trailers(_, trailers)] => {
            assert_eq!(value(trailers, "x-big").map(str::len), Some(big.len()));
        }
        other => panic!("expected the whole replay, got {} parts", other.len()),
    }
    end(552, retry);
}

/// Headers with `key` (if given), then two messages in one chunk that does not end the call,
/// on the unary method: the body's status Envoy gets back.
fn two_messages(
    config: ffi::HttpFilterConfigModulePtr,
    ptr: usize,
    key: Option<&str>,
) -> (ffi::HttpFilterModulePtr, u32) {
    let mut body = frame(b"order");
    body.extend_from_slice(&frame(b"order"));
    with(|abi| {
        abi.maps.insert(REQ, call_headers(key));
        abi.bodies.clear();
        abi.bodies
            .insert(ffi::BODY_TYPE_RECEIVED_REQUEST_BODY, vec![body]);
    });
    let module = envoy_dynamic_module_on_http_filter_new(config, fake(ptr));
    assert!(!module.is_null());
    envoy_dynamic_module_on_http_filter_request_headers(fake(ptr), module, false);
    let status = envoy_dynamic_module_on_http_filter_request_body(fake(ptr), module, false);
    (module, status)
}

#[test]
fn a_second_message_under_a_key_is_refused_as_the_wasm_build_refuses_it() {
    reset();
    let config = loaded(ORDERS);
    let (first, _) = call(config, 561, Some("native-grpc-stream"), &frame(b"order"));
    answer(561, first, b"placed", &[("grpc-status", "0")]);
    end(561, first);

    // Held (nothing goes upstream) and answered trailers-only with INVALID_ARGUMENT.
    let (keyed, status) = two_messages(config, 562, Some("native-grpc-stream"));
    assert_eq!(status, ffi::BODY_STOP_ITERATION_AND_BUFFER);
    let refused = trailers_only_to(562);
    assert_eq!(value(&refused, ":status"), Some("200"));
    assert_eq!(value(&refused, "grpc-status"), Some("3"));
    assert!(value(&refused, "idempotency-problem-type")
        .is_some_and(|t| t.ends_with(":grpc-key-on-stream")));
    assert!(value(&refused, "grpc-message").is_some_and(|m| m.contains("several request messages")));
    end(562, keyed);

    // Without a key the call streams through, untouched.
    let (keyless, status) = two_messages(config, 563, None);
    assert_eq!(status, ffi::BODY_CONTINUE);
    assert!(parts_to(563).is_empty());
    end(563, keyless);

    // The record is as it was: the unary retry is replayed.
    let (retry, _) = call(config, 564, Some("native-grpc-stream"), &frame(b"order"));
    assert!(parts_to(564).iter().any(
        |p| matches!(p, Part::Headers(_, h, _) if value(h, "idempotent-replayed") == Some("true"))
    ));
    end(564, retry);
}

//! A proxy behind Envoy that gives up (a sidecar's or nginx's timeout, a reset after
//! sending): its answer reaches the filter as the upstream's own (`via_upstream`) `502`,
//! `503` or `504`, or a gRPC `UNAVAILABLE` or `DEADLINE_EXCEEDED`. By default it is an
//! unknown outcome; a proxy's words that prove it never sent the request, the service's own
//! `503`, `on_gateway_error: "release"` and a rule's `never_ran_header` release it.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use super::grpc::{call, frame, ORDERS_GRPC};
use super::unknown_outcome::{is_unknown, retry};
use super::*;
use crate::outcome::Outcome;

const ENVOY_TIMEOUT: &str = "upstream request timeout";
const NGINX_504: &str = "<html>\r\n<head><title>504 Gateway Time-out</title></head>\r\n<body>\r\n<center><h1>504 Gateway Time-out</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";
const NGINX_502: &str = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";
const RESET_AFTER_SENDING: &str = "upstream connect error or disconnect/reset before headers. reset reason: connection termination";
const REFUSED_CONNECTION: &str = "upstream connect error or disconnect/reset before headers. reset reason: connection failure, transport failure reason: delayed connect error: Connection refused";

/// The upstream (to Envoy) answers `status` with `headers` and `body`, in `chunks` pieces.
fn upstream_answers(
    host: &FakeHost,
    request: &mut RequestJourney,
    status: u16,
    headers: &[(&str, &str)],
    body: &[u8],
    chunks: usize,
) {
    envoy_reports(host, "via_upstream", 0, 1);
    let status = status.to_string();
    let mut all = vec![(":status", status.as_str()), ("content-type", "text/plain")];
    all.extend_from_slice(headers);
    host.set_response(&all, b"");
    request.on(
        host,
        Event::ResponseHeaders {
            end_of_stream: body.is_empty(),
        },
    );
    let size = body.len().div_ceil(chunks.max(1)).max(1);
    let pieces: Vec<&[u8]> = body.chunks(size).collect();
    for (i, piece) in pieces.iter().enumerate() {
        *host.response_chunk.borrow_mut() = piece.to_vec();
        request.on(
            host,
            Event::ResponseBody {
                size: piece.len(),
                end_of_stream: i + 1 == pieces.len(),
            },
        );
    }
    request.on(host, Event::StreamEnd);
}

/// The first request with `k1` under `config` gets `status` and `body` (in `chunks`); what
/// its retry gets.
fn first_then_retry(
    config: &str,
    status: u16,
    headers: &[(&str, &str)],
    body: &str,
    chunks: usize,
) -> (FakeHost, Option<(u16, String)>) {
    let host = FakeHost::default();
    let plugin = plugin(&host, config);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    upstream_answers(&host, &mut first, status, headers, body.as_bytes(), chunks);
    let answer = retry(&host, &plugin);
    (host, answer)
}

fn orders_with(fields: &str) -> String {
    format!(r#"{{"rules":[{{"name":"orders","match":{{"path_prefixes":["/orders"]}}{fields}}}]}}"#)
}

#[test]
fn a_proxys_timeout_or_reset_after_sending_is_an_unknown_outcome_never_run_again() {
    for (status, body, chunks) in [
        (504, ENVOY_TIMEOUT, 1),
        (504, NGINX_504, 3),
        (504, "", 1),
        (502, NGINX_502, 2),
        (502, "", 1),
        (503, RESET_AFTER_SENDING, 1),
        // The words arrive split across chunks: judged whole.
        (503, RESET_AFTER_SENDING, 4),
        (
            503,
            "upstream connect error or disconnect/reset before headers. retried and the latest reset reason: connection failure",
            1,
        ),
    ] {
        let (host, answer) = first_then_retry(ORDERS, status, &[], body, chunks);
        assert!(is_unknown(&answer), "{status} {body}: {answer:?}");
        assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 1);
        assert_eq!(host.counter("orders", Outcome::Released), 0);
    }
}

#[test]
fn a_proxys_words_that_prove_it_never_sent_and_the_services_own_503_release() {
    for (status, headers, body) in [
        (503, &[][..], REFUSED_CONNECTION),
        (502, &[][..], REFUSED_CONNECTION),
        (503, &[][..], "no healthy upstream"),
        (503, &[("retry-after", "2")][..], "{\"error\":\"busy\"}"),
        (503, &[][..], ""),
    ] {
        let (host, answer) = first_then_retry(ORDERS, status, headers, body, 1);
        assert_eq!(answer, None, "{status} {body}: the retry executes");
        assert_eq!(host.counter("orders", Outcome::Released), 1);
        assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 0);
    }
}

#[test]
fn a_judged_answer_does_not_tell_its_client_the_key_is_kept() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    let _ = host.take_effects();
    upstream_answers(&host, &mut first, 503, &[], b"{\"error\":\"busy\"}", 1);
    let effects = host.take_effects();
    assert!(
        !effects.iter().any(|e| matches!(
            e,
            Effect::ReplaceResponseHeader(name, _) if name == idempotency_protocol::record::KEY_EXPIRES_HEADER
        )),
        "{effects:?}"
    );
}

#[test]
fn a_gateway_errors_words_cut_short_leave_an_unknown_outcome() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    envoy_reports(&host, "via_upstream", 0, 1);
    host.set_response(&[(":status", "503")], b"");
    first.on(
        &host,
        Event::ResponseHeaders {
            end_of_stream: false,
        },
    );
    first.on(&host, Event::StreamEnd);
    assert!(is_unknown(&retry(&host, &plugin)));
}

#[test]
fn on_gateway_error_release_leaves_it_to_release_on_status() {
    let config = orders_with(r#","on_gateway_error":"release""#);
    for (status, body) in [
        (504, NGINX_504),
        (502, NGINX_502),
        (503, RESET_AFTER_SENDING),
    ] {
        let (host, answer) = first_then_retry(&config, status, &[], body, 1);
        assert_eq!(answer, None, "{status}: released, the retry executes");
        assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 0);
    }
}

#[test]
fn a_gateway_error_is_unknown_even_where_release_on_status_would_record_it() {
    // Before, `release_on_status: []` recorded the 504 and replayed it for the TTL.
    let config = orders_with(r#","release_on_status":[]"#);
    let (_, answer) = first_then_retry(&config, 504, &[], NGINX_504, 1);
    assert!(is_unknown(&answer), "{answer:?}");
    // The service's own 503 is then recorded and replayed, as the rule says.
    let (_, answer) = first_then_retry(&config, 503, &[], "busy", 1);
    assert_eq!(answer.map(|a| a.0), Some(503));
}

#[test]
fn the_services_never_ran_header_releases_a_gateway_error() {
    let config = orders_with(r#","never_ran_header":"X-Not-Processed""#);
    let (_, answer) = first_then_retry(&config, 504, &[("x-not-processed", "true")], "{}", 1);
    assert_eq!(answer, None, "the service says it did nothing: released");
    let (_, answer) = first_then_retry(&config, 504, &[("x-not-processed", "false")], "{}", 1);
    assert!(is_unknown(&answer), "not 'true': {answer:?}");
    let (_, answer) = first_then_retry(&config, 504, &[], NGINX_504, 1);
    assert!(is_unknown(&answer), "without it: {answer:?}");
}

#[test]
fn a_never_ran_header_must_be_a_plain_header_name() {
    for name in [
        "",
        ":status",
        "grpc-status",
        "bad name",
        "server",
        "x-envoy-upstream-service-time",
    ] {
        let config = orders_with(&format!(r#","never_ran_header":"{name}""#));
        assert!(
            crate::config::Config::parse(config.as_bytes()).is_err(),
            "{name}"
        );
    }
}

/// A gRPC call's answer: trailers-only when `trailers_only`, else a message and trailers.
fn grpc_answer(
    host: &FakeHost,
    request: &mut RequestJourney,
    status: &[(&str, &str)],
    trailers_only: bool,
) {
    envoy_reports(host, "via_upstream", 0, 1);
    let mut headers = vec![(":status", "200"), ("content-type", "application/grpc")];
    if trailers_only {
        headers.extend_from_slice(status);
    }
    host.set_response(&headers, b"");
    request.on(
        host,
        Event::ResponseHeaders {
            end_of_stream: trailers_only,
        },
    );
    if !trailers_only {
        let message = frame(b"partial");
        *host.response_chunk.borrow_mut() = message.clone();
        request.on(
            host,
            Event::ResponseBody {
                size: message.len(),
                end_of_stream: false,
            },
        );
        *host.response_trailers.borrow_mut() = status
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        request.on(host, Event::ResponseTrailers);
    }
    request.on(host, Event::StreamEnd);
}

/// What the retry of a gRPC call gets: None when it executes, else its `grpc-status`.
fn grpc_retry(host: &FakeHost, plugin: &Rc<Plugin>) -> Option<String> {
    let _ = host.take_effects();
    let (request, verdict) = call(host, plugin, Some("k1"), b"order");
    if verdict == Verdict::Continue && is_executing(&request) {
        return None;
    }
    let (_, headers, _) = the_reply(&host.take_effects());
    header(&headers, "grpc-status").map(|v| String::from_utf8_lossy(v).into_owned())
}

#[test]
fn a_grpc_deadline_or_a_proxys_unavailable_is_unknown_and_the_services_unavailable_releases() {
    for (status, trailers_only, unknown) in [
        (
            &[("grpc-status", "4"), ("grpc-message", "Deadline Exceeded")][..],
            false,
            true,
        ),
        (&[("grpc-status", "4")][..], true, true),
        (
            &[("grpc-status", "14"), ("grpc-message", ENVOY_TIMEOUT)][..],
            true,
            true,
        ),
        (
            &[("grpc-status", "14"), ("grpc-message", RESET_AFTER_SENDING)][..],
            true,
            true,
        ),
        (
            &[
                ("grpc-status", "14"),
                ("grpc-message", "upstream%20request%20timeout"),
            ][..],
            false,
            true,
        ),
        (
            &[("grpc-status", "14"), ("grpc-message", "busy")][..],
            false,
            false,
        ),
        (
            &[
                ("grpc-status", "14"),
                ("grpc-message", "no healthy upstream"),
            ][..],
            true,
            false,
        ),
    ] {
        let host = FakeHost::default();
        let plugin = plugin(&host, ORDERS_GRPC);
        let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
        grpc_answer(&host, &mut first, status, trailers_only);
        let answer = grpc_retry(&host, &plugin);
        if unknown {
            // FAILED_PRECONDITION: the outcome-unknown problem as a gRPC status.
            assert_eq!(answer.as_deref(), Some("9"), "{status:?}");
            assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 1);
        } else {
            assert_eq!(answer, None, "{status:?}: released, the retry executes");
        }
    }
}

#[test]
fn a_grpc_rules_never_ran_header_leaves_a_deadline_to_its_release_list() {
    let config = r#"{"rules":[{"name":"orders","match":{"grpc_services":["shop.v1.Orders"]},"never_ran_header":"x-not-processed"}]}"#;
    let host = FakeHost::default();
    let plugin = plugin(&host, config);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    let status = [
        ("grpc-status", "4"),
        ("grpc-message", "deadline"),
        ("x-not-processed", "True"),
    ];
    grpc_answer(&host, &mut first, &status, true);
    // DEADLINE_EXCEEDED is not in the default release list: recorded, never run again.
    assert_eq!(grpc_retry(&host, &plugin).as_deref(), Some("4"));
    assert_eq!(host.counter("orders", Outcome::OutcomeUnknown), 0);
}

#[test]
fn the_services_own_503_cut_short_after_its_words_ruled_envoy_out_is_released() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    envoy_reports(&host, "via_upstream", 0, 1);
    host.set_response(&[(":status", "503"), ("retry-after", "2")], b"");
    first.on(
        &host,
        Event::ResponseHeaders {
            end_of_stream: false,
        },
    );
    let page = vec![b'x'; 600];
    *host.response_chunk.borrow_mut() = page.clone();
    first.on(
        &host,
        Event::ResponseBody {
            size: page.len(),
            end_of_stream: false,
        },
    );
    first.on(&host, Event::StreamEnd);
    assert_eq!(retry(&host, &plugin), None, "released: the retry runs");
}

#[test]
fn envoys_words_compressed_or_unreadable_are_an_unknown_outcome() {
    let compressed = [("content-encoding", "gzip")];
    let (_, answer) = first_then_retry(ORDERS, 503, &compressed, "\u{1f}\u{8b}...", 1);
    assert!(is_unknown(&answer), "{answer:?}");
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    host.fail(crate::fake_host::HostCall::ResponseBody);
    upstream_answers(
        &host,
        &mut first,
        503,
        &[],
        RESET_AFTER_SENDING.as_bytes(),
        1,
    );
    assert!(is_unknown(&retry(&host, &plugin)));
}

#[test]
fn a_route_that_answers_a_504_itself_is_not_a_proxy_that_gave_up() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    envoy_reports(&host, "direct_response", 0, 0);
    respond(&host, &mut first, 504, b"maintenance");
    assert_eq!(retry(&host, &plugin), None, "nothing left Envoy: released");
}

#[test]
fn a_grpc_answer_with_another_http_status_is_judged_by_its_call_status() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS_GRPC);
    let (mut first, _) = call(&host, &plugin, Some("k1"), b"order");
    envoy_reports(&host, "via_upstream", 0, 1);
    host.set_response(
        &[
            (":status", "503"),
            ("content-type", "application/grpc"),
            ("grpc-status", "14"),
            ("grpc-message", "stream timeout"),
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
    assert_eq!(grpc_retry(&host, &plugin).as_deref(), Some("9"));
}

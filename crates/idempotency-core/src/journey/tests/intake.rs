//! Choosing the rule, reading the key and waiting for the body.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use super::*;
use crate::fake_host::HostCall;
use crate::outcome::Outcome;

const BODY_KEY: &str = r#"{"rules":[{"name":"pay","match":{"path_prefixes":["/pay"]},
    "key":{"sources":[{"json":"/payment_id"}]}}]}"#;

#[test]
fn a_request_no_rule_covers_passes_untouched() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (request, verdict) = send(&host, &plugin, &post_headers("/elsewhere", None), b"");
    assert_eq!(verdict, Verdict::Continue);
    assert!(matches!(request.state(), Journey::Unprotected));
    let (_, verdict) = send(
        &host,
        &plugin,
        &[(":method", "GET"), (":path", "/orders/1")],
        b"",
    );
    assert_eq!(verdict, Verdict::Continue);
    assert!(host.take_effects().is_empty());
    assert_eq!(host.counter("orders", Outcome::Executed), 0);
}

#[test]
fn route_metadata_naming_an_unknown_rule_lets_the_request_pass() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    host.properties.borrow_mut().insert(
        "xds.route_metadata.filter_metadata.idempotency.rule".into(),
        b"nonexistent".to_vec(),
    );
    let (_, verdict) = post(&host, &plugin, "k1", b"");
    assert_eq!(verdict, Verdict::Continue);
    assert!(host.take_effects().is_empty());
    assert_eq!(host.counter("orders", Outcome::Executed), 0);
}

#[test]
fn a_required_key_that_is_missing_gets_400_naming_the_header() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (request, verdict) = send(&host, &plugin, &post_headers("/orders", None), b"");
    assert_eq!(verdict, Verdict::Pause);
    assert!(matches!(request.state(), Journey::AnsweredLocally));
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(status, 400);
    assert_eq!(
        header(&headers, "content-type"),
        Some(&b"application/problem+json"[..])
    );
    assert!(problem_type(&body).ends_with("missing-key"));
    assert!(String::from_utf8_lossy(&body).contains("idempotency-key"));
    assert_eq!(host.counter("orders", Outcome::MissingKey), 1);
}

#[test]
fn an_optional_key_that_is_missing_passes_but_a_malformed_one_is_refused() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},"key":{"required":false}}]}"#,
    );
    let (_, verdict) = send(&host, &plugin, &post_headers("/orders", None), b"");
    assert_eq!(verdict, Verdict::Continue);
    assert_eq!(host.counter("orders", Outcome::PassedThrough), 1);
    let too_long = "k".repeat(300);
    let (_, verdict) = post(&host, &plugin, &too_long, b"");
    assert_eq!(verdict, Verdict::Pause);
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 400);
    assert!(problem_type(&body).ends_with("invalid-key"));
    assert_eq!(host.counter("orders", Outcome::InvalidKey), 1);
}

#[test]
fn a_required_scope_header_that_is_missing_gets_401() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
            "scope_headers":["x-caller"],"scope_required":true}]}"#,
    );
    let (_, verdict) = post(&host, &plugin, "k1", b"");
    assert_eq!(verdict, Verdict::Pause);
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 401);
    assert!(problem_type(&body).ends_with("missing-scope"));
    assert_eq!(host.counter("orders", Outcome::MissingScope), 1);
}

#[test]
fn a_body_key_holds_the_request_until_the_whole_body_is_here() {
    let host = FakeHost::default();
    let plugin = plugin(&host, BODY_KEY);
    let body = br#"{"payment_id":"p-1","amount":5}"#;
    host.set_request(&post_headers("/pay", None), body);
    let mut request = RequestJourney::new(Rc::clone(&plugin));
    let headers = Event::RequestHeaders {
        end_of_stream: false,
    };
    assert_eq!(request.on(&host, headers), Verdict::Pause);
    assert!(matches!(request.state(), Journey::AwaitingBody(_)));
    let partial = Event::RequestBody {
        size: 10,
        end_of_stream: false,
    };
    assert_eq!(request.on(&host, partial), Verdict::Pause);
    assert_eq!(host.counter("pay", Outcome::Executed), 0);
    let whole = Event::RequestBody {
        size: body.len(),
        end_of_stream: true,
    };
    assert_eq!(request.on(&host, whole), Verdict::Continue);
    assert!(is_executing(&request));
    assert_eq!(host.counter("pay", Outcome::Executed), 1);
    // The same payment id in another body is the same key with another payload.
    let (_, verdict) = send(
        &host,
        &plugin,
        &post_headers("/pay", None),
        br#"{"payment_id":"p-1","amount":6}"#,
    );
    assert_eq!(verdict, Verdict::Pause);
    assert_eq!(the_reply(&host.take_effects()).0, 422);
}

#[test]
fn a_body_key_and_fingerprint_fields_are_read_together() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"hook","match":{"path_prefixes":["/hook"]},
            "key":{"sources":[{"json":"/data/object/id"}]},
            "fingerprint":{"fields":[{"json":"/data/object"},{"json":"/type"}]}}]}"#,
    );
    let hook = |body: &[u8]| send(&host, &plugin, &post_headers("/hook", None), body);
    let (mut first, verdict) =
        hook(br#"{"id":"evt_1","type":"paid","data":{"object":{"id":"pi_1","amount":1200}}}"#);
    assert_eq!(verdict, Verdict::Continue);
    respond(&host, &mut first, 200, b"ok");
    // A redelivery: another event id, members in another order, the same fields.
    let (_, verdict) =
        hook(br#"{"data":{"object":{"amount":1200,"id":"pi_1"}},"type":"paid","id":"evt_2"}"#);
    assert_eq!(verdict, Verdict::Pause);
    let (status, headers, _) = the_reply(&host.take_effects());
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
    // Another amount, or another type, under the same key.
    for other in [
        &br#"{"type":"paid","data":{"object":{"id":"pi_1","amount":1300}}}"#[..],
        br#"{"type":"failed","data":{"object":{"id":"pi_1","amount":1200}}}"#,
    ] {
        let (_, verdict) = hook(other);
        assert_eq!(verdict, Verdict::Pause);
        assert_eq!(the_reply(&host.take_effects()).0, 422);
    }
    // The key's member given twice is refused, though the fingerprint's reading of it counts
    // both.
    let (_, verdict) = hook(br#"{"type":"paid","data":{"object":{"id":"pi_1","id":"pi_2"}}}"#);
    assert_eq!(verdict, Verdict::Pause);
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("appears more than once"));
    assert_eq!(host.counter("hook", Outcome::Replayed), 1);
    assert_eq!(host.counter("hook", Outcome::Mismatch), 2);
}

#[test]
fn trailers_end_a_body_that_is_waited_for() {
    let host = FakeHost::default();
    let plugin = plugin(&host, BODY_KEY);
    let body = br#"{"payment_id":"p-2"}"#;
    host.set_request(&post_headers("/pay", None), body);
    let mut request = RequestJourney::new(Rc::clone(&plugin));
    request.on(
        &host,
        Event::RequestHeaders {
            end_of_stream: false,
        },
    );
    request.on(
        &host,
        Event::RequestBody {
            size: body.len(),
            end_of_stream: false,
        },
    );
    assert_eq!(request.on(&host, Event::RequestTrailers), Verdict::Continue);
    assert!(is_executing(&request));
}

#[test]
fn a_body_over_the_limit_is_refused_when_the_key_is_required() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"pay","match":{"path_prefixes":["/pay"]},"max_request_bytes":16,
            "key":{"sources":[{"json":"/id"}]}},
          {"name":"opt","match":{"path_prefixes":["/opt"]},"max_request_bytes":16,
            "key":{"required":false,"sources":[{"json":"/id"}]}}]}"#,
    );
    let big = br#"{"id":"a","pad":"xxxxxxxxxxxxxxxxxxxxxxx"}"#;
    let (_, verdict) = send(&host, &plugin, &post_headers("/pay", None), big);
    assert_eq!(verdict, Verdict::Pause);
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 400);
    assert!(problem_type(&body).ends_with("body-too-large"));
    let (request, verdict) = send(&host, &plugin, &post_headers("/opt", None), big);
    assert_eq!(verdict, Verdict::Continue);
    assert!(matches!(request.state(), Journey::Unprotected));
    assert_eq!(host.counter("opt", Outcome::PassedThrough), 1);
}

#[test]
fn a_body_over_the_limit_is_refused_when_an_optional_key_was_sent_in_a_header() {
    // Let through, the request and every retry of it would run unprotected although the
    // client sent its key: each would run the write again.
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"opt","match":{"path_prefixes":["/opt"]},"max_request_bytes":16,
            "key":{"required":false}}]}"#,
    );
    let big = br#"{"id":"a","pad":"xxxxxxxxxxxxxxxxxxxxxxx"}"#;
    for _attempt in 0..2 {
        let (request, verdict) = send(&host, &plugin, &post_headers("/opt", Some("k-big")), big);
        assert_eq!(verdict, Verdict::Pause);
        assert!(!is_executing(&request));
        let (status, _, body) = the_reply(&host.take_effects());
        assert_eq!(status, 400);
        assert!(problem_type(&body).ends_with("body-too-large"));
    }
    assert_eq!(host.counter("opt", Outcome::PassedThrough), 0);
    // Without a key, the optional rule lets the same body through, as before.
    let (request, verdict) = send(&host, &plugin, &post_headers("/opt", None), big);
    assert_eq!(verdict, Verdict::Continue);
    assert!(matches!(request.state(), Journey::Unprotected));
}

#[test]
fn a_malformed_body_key_passes_when_optional_and_is_refused_when_required() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"pay","match":{"path_prefixes":["/pay"]},"key":{"sources":[{"json":"/id"}]}},
          {"name":"opt","match":{"path_prefixes":["/opt"]},"key":{"required":false,"sources":[{"json":"/id"}]}}]}"#,
    );
    let (_, verdict) = send(&host, &plugin, &post_headers("/opt", None), b"not json");
    assert_eq!(verdict, Verdict::Continue);
    assert_eq!(host.counter("opt", Outcome::PassedThrough), 1);
    let (_, verdict) = send(&host, &plugin, &post_headers("/pay", None), b"not json");
    assert_eq!(verdict, Verdict::Pause);
    assert_eq!(the_reply(&host.take_effects()).0, 400);
    assert_eq!(host.counter("pay", Outcome::InvalidKey), 1);
}

#[test]
fn unreadable_request_headers_let_the_request_pass_and_an_unreadable_body_gets_503() {
    let host = FakeHost::default();
    let plugin = plugin(&host, BODY_KEY);
    host.fail(HostCall::RequestHeaders);
    let (_, verdict) = send(&host, &plugin, &post_headers("/pay", None), b"{}");
    assert_eq!(verdict, Verdict::Continue);
    assert!(host.take_effects().is_empty());
    host.heal(HostCall::RequestHeaders);
    host.fail(HostCall::RequestBody);
    let (_, verdict) = send(&host, &plugin, &post_headers("/pay", None), b"{}");
    assert_eq!(verdict, Verdict::Pause);
    assert_eq!(the_reply(&host.take_effects()).0, 503);
}

#[test]
fn a_local_reply_the_host_refuses_holds_the_request_never_lets_it_on() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    host.fail(HostCall::LocalReply);
    let (request, verdict) = send(&host, &plugin, &post_headers("/orders", None), b"");
    // Before: the request went upstream unprotected. Now Envoy's own timeouts end it.
    assert_eq!(verdict, Verdict::Pause);
    assert!(matches!(request.state(), Journey::AnsweredLocally));
}

#[test]
fn a_replay_the_host_refuses_becomes_a_503_and_never_runs_the_write() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    respond(&host, &mut first, 201, b"{}");
    let _ = host.take_effects();
    host.refused_statuses.borrow_mut().push(201);
    let (retry, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Pause);
    assert!(!is_executing(&retry));
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 503);
    assert!(problem_type(&body).ends_with("idempotency-unavailable"));
}

#[test]
fn a_client_gone_before_its_body_arrived_leaves_nothing_claimed() {
    let host = FakeHost::default();
    let plugin = plugin(&host, BODY_KEY);
    host.set_request(&post_headers("/pay", None), b"");
    let mut request = RequestJourney::new(Rc::clone(&plugin));
    request.on(
        &host,
        Event::RequestHeaders {
            end_of_stream: false,
        },
    );
    assert_eq!(request.on(&host, Event::StreamEnd), Verdict::Continue);
    let (retry, verdict) = send(
        &host,
        &plugin,
        &post_headers("/pay", None),
        br#"{"payment_id":"p-3"}"#,
    );
    assert_eq!(verdict, Verdict::Continue);
    assert!(is_executing(&retry));
}

const BY_VIRTUAL_HOST: &str =
    r#"{"rules":[{"name":"partners","match":{"virtual_hosts":["partners"]}}]}"#;

const GRPC_BY_VIRTUAL_HOST: &str = r#"{"rules":[{"name":"charge","grpc":{},
    "match":{"virtual_hosts":["partners"],"grpc_methods":["shop.v1.Pay/Charge"]}}]}"#;

/// Envoy 1.39's dynamic modules name a routed request's route but not its virtual host: a
/// rule that matches by virtual host may take the request, so it is answered 503, never let
/// through unprotected. A request no route matched (no route name either: the router answers
/// it) passes as before; so does one the rule cannot be for (a plain POST on a gRPC rule).
#[test]
fn a_routed_request_whose_virtual_host_is_unknown_is_answered_503_by_a_rule_that_may_take_it() {
    let host = FakeHost::default();
    let plugin = plugin(&host, BY_VIRTUAL_HOST);
    let (_, verdict) = send(&host, &plugin, &post_headers("/anything", Some("k1")), b"");
    assert_eq!(
        verdict,
        Verdict::Continue,
        "no route: the router answers it"
    );
    assert!(host.take_effects().is_empty());

    host.properties
        .borrow_mut()
        .insert("xds.route_name".into(), b"orders-create".to_vec());
    let (request, verdict) = send(&host, &plugin, &post_headers("/anything", Some("k2")), b"");
    assert_eq!(verdict, Verdict::Pause);
    assert!(matches!(request.state(), Journey::AnsweredLocally));
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 503);
    assert!(problem_type(&body).ends_with("idempotency-unavailable"));

    let grpc_rule = super::plugin(&host, GRPC_BY_VIRTUAL_HOST);
    let (_, verdict) = send(
        &host,
        &grpc_rule,
        &post_headers("/shop.v1.Pay/Charge", Some("k3")),
        b"",
    );
    assert_eq!(
        verdict,
        Verdict::Continue,
        "a plain POST is not a gRPC rule's"
    );
    assert!(host.take_effects().is_empty());

    host.properties
        .borrow_mut()
        .insert("xds.virtual_host_name".into(), b"default".to_vec());
    let (_, verdict) = send(&host, &plugin, &post_headers("/anything", Some("k4")), b"");
    assert_eq!(verdict, Verdict::Continue, "a known other virtual host");
}

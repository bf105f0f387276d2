//! A caller's lookup route: the state of its own key, from the local table (single-proxy)
//! or the store (cluster mode), never an execution, never another caller's record.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use idempotency_protocol::stream::{decode_call, encode_answer, Answer, CallOp, Reply};

use super::*;
use crate::fake_host::Effect;
use crate::outcome::Outcome;
use crate::root::PluginRoot;
use idempotency_protocol::record::RecordedResponse;

const LOOKUP: &str = r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
    "lookup":{"path":"/orders/idempotency","include_response":true}}]}"#;

/// A GET of the lookup route with `key` as caller `who`; the reply's status and JSON.
fn look_up(
    host: &FakeHost,
    plugin: &Rc<Plugin>,
    key: Option<&str>,
    who: &str,
) -> (u16, serde_json::Value) {
    let _ = host.take_effects();
    let bearer = format!("Bearer {who}");
    let mut headers = vec![
        (":method", "GET"),
        (":path", "/orders/idempotency?x=1"),
        (":authority", "api.local"),
        ("authorization", bearer.as_str()),
    ];
    if let Some(key) = key {
        headers.push(("idempotency-key", key));
    }
    let (_, verdict) = send(host, plugin, &headers, b"");
    assert_eq!(verdict, Verdict::Pause, "answered by the filter");
    let (status, _, body) = the_reply(&host.take_effects());
    (status, serde_json::from_slice(&body).unwrap())
}

fn write_as(host: &FakeHost, plugin: &Rc<Plugin>, key: &str, who: &str) -> RequestJourney {
    let bearer = format!("Bearer {who}");
    let mut headers = post_headers("/orders", Some(key));
    headers.push(("authorization", &bearer));
    send(host, plugin, &headers, b"{}").0
}

#[test]
fn a_caller_learns_the_state_of_its_own_key_and_nothing_runs() {
    let host = FakeHost::default();
    let plugin = plugin(&host, LOOKUP);
    assert_eq!(
        look_up(&host, &plugin, Some("k1"), "alice"),
        (404, serde_json::json!({"state": "none"}))
    );
    let mut first = write_as(&host, &plugin, "k1", "alice");
    let (status, running) = look_up(&host, &plugin, Some("k1"), "alice");
    assert_eq!(
        (status, running["state"].as_str()),
        (200, Some("in_flight"))
    );
    respond(&host, &mut first, 201, br#"{"id":"o-1"}"#);
    let (status, done) = look_up(&host, &plugin, Some("k1"), "alice");
    assert_eq!(status, 200);
    assert_eq!(done["state"], "completed");
    assert_eq!(done["status"], 201);
    assert_eq!(done["response"]["body"], r#"{"id":"o-1"}"#);
    assert!(done["expires"].as_str().unwrap().ends_with("GMT"));
    // Another caller with the same key sees nothing of alice's.
    assert_eq!(look_up(&host, &plugin, Some("k1"), "mallory").0, 404);
    // A lookup without a key is refused as a write would be.
    assert_eq!(look_up(&host, &plugin, None, "alice").0, 400);
    assert_eq!(host.counter("orders", Outcome::Executed), 1);
    assert_eq!(host.counter("orders", Outcome::LookedUp), 5);
}

#[test]
fn an_unknown_outcome_says_whether_it_is_being_resolved() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "lookup":{"path":"/orders/idempotency"},
        "resolve":{"cluster":"orders","path":"/orders/by-key/{key}","settle_seconds":7}}]}"#,
    );
    let mut first = write_as(&host, &plugin, "k2", "alice");
    envoy_reports(
        &host,
        "response_timeout",
        crate::who_answered::flag::UPSTREAM_REQUEST_TIMEOUT,
        1,
    );
    respond(&host, &mut first, 504, b"");
    let (status, body) = look_up(&host, &plugin, Some("k2"), "alice");
    assert_eq!(status, 200);
    assert_eq!(body["state"], "unknown");
    assert_eq!(body["resolution"], "pending");
    assert_eq!(body["retry_after_seconds"], 7);
    assert!(body.get("response").is_none(), "not asked for");
}

#[test]
fn in_cluster_mode_the_store_is_asked_and_nothing_is_claimed() {
    let host = FakeHost::default();
    let config = r#"{"store":{"cluster":"store","timeout_ms":250},
        "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "lookup":{"path":"/orders/idempotency"}}]}"#;
    let mut root: PluginRoot = configured_root(&host, config, 1);
    let stream = host
        .take_effects()
        .iter()
        .find_map(|e| match e {
            Effect::StreamOpened { stream, .. } => Some(*stream),
            _ => None,
        })
        .unwrap();
    let recorded = RecordedResponse {
        status: 201,
        ..RecordedResponse::default()
    };
    for (reply, expected) in [
        (
            Reply::Completed {
                record: recorded.encode(),
            },
            200,
        ),
        (Reply::Released, 404),
    ] {
        let headers = [
            (":method", "GET"),
            (":path", "/orders/idempotency"),
            (":authority", "api.local"),
            ("idempotency-key", "k3"),
        ];
        let (_journey, verdict) = request_in_context(&host, &root, 7, &headers, b"");
        assert_eq!(verdict, Verdict::Pause);
        let sent: Vec<_> = host
            .take_effects()
            .into_iter()
            .filter_map(|e| match e {
                Effect::StreamMessage { message, .. } => Some(decode_call(&message).unwrap()),
                _ => None,
            })
            .collect();
        let [call] = sent.as_slice() else {
            panic!("one call: {sent:?}");
        };
        assert!(matches!(call.op, CallOp::Lookup { .. }), "{call:?}");
        host.effective_context.set(1);
        let message = encode_answer(&Answer { id: call.id, reply });
        *host.grpc_message.borrow_mut() = message.clone();
        root.on_grpc_message(&host, stream, message.len());
        let (status, _, _) = the_reply(&host.take_effects());
        assert_eq!(status, expected);
    }
}

#[test]
fn over_the_http_transport_the_store_is_asked_by_callout() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"store":{"cluster":"store","timeout_ms":250,"transport":"http"},
        "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "lookup":{"path":"/orders/idempotency"}}]}"#,
    );
    let headers = [
        (":method", "GET"),
        (":path", "/orders/idempotency"),
        (":authority", "api.local"),
        ("idempotency-key", "k4"),
    ];
    let (mut request, verdict) = send(&host, &plugin, &headers, b"");
    assert_eq!(verdict, Verdict::Pause);
    let token = host
        .take_effects()
        .into_iter()
        .find_map(|e| match e {
            Effect::Callout { token, path, .. } if path.ends_with("/lookup") => Some(token),
            _ => None,
        })
        .expect("a lookup callout");
    let record = idempotency_protocol::wire::encode_record(
        &RecordedResponse {
            status: 202,
            ..RecordedResponse::default()
        }
        .encode(),
    );
    let body = format!(
        r#"{{"state":"completed","fingerprint":"{}","expires_at_ms":1,"record":"{record}"}}"#,
        "a".repeat(64)
    );
    host.set_callout_answer(Some(200), body.as_bytes());
    request.on(
        &host,
        Event::CalloutAnswer {
            token,
            num_headers: 1,
            body_size: body.len(),
        },
    );
    let (status, _, reply) = the_reply(&host.take_effects());
    assert_eq!(status, 200);
    let doc: serde_json::Value = serde_json::from_slice(&reply).unwrap();
    assert_eq!(
        (doc["state"].as_str(), doc["status"].as_u64()),
        (Some("completed"), Some(202))
    );
}

#[test]
fn past_the_ttl_a_lookup_shows_the_tombstone_a_retry_would_get() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
            "ttl_seconds":10,"lease_seconds":5,"tombstone_seconds":100,
            "lookup":{"path":"/orders/idempotency","include_response":true}}]}"#,
    );
    let mut first = write_as(&host, &plugin, "k1", "alice");
    respond(&host, &mut first, 201, br#"{"id":"o-1"}"#);
    let (_, whole) = look_up(&host, &plugin, Some("k1"), "alice");
    assert_eq!(whole["response"]["body"], r#"{"id":"o-1"}"#);
    assert_eq!(whole["response"]["body_omitted"], false);
    host.advance_ms(11_000);
    let (status, tombstone) = look_up(&host, &plugin, Some("k1"), "alice");
    assert_eq!(
        (status, tombstone["state"].as_str()),
        (200, Some("completed"))
    );
    assert_eq!(tombstone["status"], 201);
    assert_eq!(tombstone["response"]["body"], "");
    assert_eq!(tombstone["response"]["body_omitted"], true);
    assert_eq!(host.counter("orders", Outcome::Executed), 1);
}

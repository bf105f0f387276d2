//! What each protected request publishes for Envoy's access log: its rule, every outcome in
//! order, and the short hash of its storage key (the same for every retry of one key, and
//! different for another key or another caller).

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use super::*;
use crate::journey::access_log::{KEY_HASH, KEY_HASH_HEX, OUTCOME, RULE};
use crate::outcome::Outcome;

/// ORDERS, publishing its fields.
const LOGGED: &str = r#"{"access_log_fields":true,
    "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]}}]}"#;

fn published(host: &FakeHost) -> (Option<String>, Option<String>, Option<String>) {
    (
        host.published(RULE),
        host.published(OUTCOME),
        host.published(KEY_HASH),
    )
}

#[test]
fn an_executed_write_then_its_replay_publish_the_rule_the_outcome_and_the_same_key_hash() {
    let host = FakeHost::default();
    let plugin = plugin(&host, LOGGED);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    let (rule, outcome, hash) = published(&host);
    assert_eq!(rule.as_deref(), Some("orders"));
    assert_eq!(outcome.as_deref(), Some("executed"));
    let hash = hash.expect("a key hash");
    assert_eq!(hash.len(), KEY_HASH_HEX);
    assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()));
    respond(&host, &mut first, 201, b"ok");

    post(&host, &plugin, "k1", b"{}");
    assert_eq!(host.published(OUTCOME).as_deref(), Some("replayed"));
    assert_eq!(host.published(KEY_HASH), Some(hash.clone()));

    post(&host, &plugin, "k1", b"{\"other\":1}");
    assert_eq!(host.published(OUTCOME).as_deref(), Some("mismatch"));
    assert_eq!(host.published(KEY_HASH), Some(hash.clone()));

    post(&host, &plugin, "k2", b"{}");
    assert_ne!(host.published(KEY_HASH), Some(hash.clone()), "another key");

    let mut headers = post_headers("/orders", Some("k1"));
    headers.push(("authorization", "Bearer another-caller"));
    send(&host, &plugin, &headers, b"{}");
    assert_eq!(host.published(OUTCOME).as_deref(), Some("executed"));
    assert_ne!(host.published(KEY_HASH), Some(hash), "another caller");
}

#[test]
fn every_outcome_of_a_request_is_published_in_order() {
    let host = FakeHost::default();
    let plugin = plugin(&host, LOGGED);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    post(&host, &plugin, "k1", b"{}");
    assert_eq!(host.published(OUTCOME).as_deref(), Some("conflict"));
    respond(&host, &mut first, 503, b"busy");
    assert_eq!(
        host.published(OUTCOME).as_deref(),
        Some("executed+released"),
        "the first request's whole story"
    );
}

#[test]
fn a_refused_request_publishes_its_rule_and_why_and_an_unprotected_one_nothing() {
    let host = FakeHost::default();
    let plugin = plugin(&host, LOGGED);
    send(&host, &plugin, &post_headers("/orders", None), b"{}");
    assert_eq!(
        published(&host),
        (Some("orders".into()), Some("missing_key".into()), None)
    );

    let host = FakeHost::default();
    let plugin = super::plugin(&host, LOGGED);
    send(
        &host,
        &plugin,
        &post_headers("/elsewhere", Some("k1")),
        b"{}",
    );
    assert_eq!(published(&host), (None, None, None));
}

#[test]
fn without_access_log_fields_a_request_publishes_nothing() {
    let host = FakeHost::default();
    let plugin = plugin(&host, ORDERS);
    let (mut first, _) = post(&host, &plugin, "k1", b"{}");
    respond(&host, &mut first, 201, b"ok");
    post(&host, &plugin, "k1", b"{}");
    send(&host, &plugin, &post_headers("/orders", None), b"{}");
    assert_eq!(published(&host), (None, None, None));
    assert_eq!(
        host.counter("orders", Outcome::Replayed),
        1,
        "the paths ran"
    );
}

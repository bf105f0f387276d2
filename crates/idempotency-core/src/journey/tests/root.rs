//! The root's side: configuring, and the store writes a request leaves behind, retried
//! through an outage and kept across a push until they are taken.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use super::*;
use crate::outcome::Outcome;
use crate::plugin::waits::WAIT_TICK_MS;
use crate::root::{PluginRoot, STORE_RETRY_TICK_MS, UPKEEP_TICK_MS};

const CLUSTER: &str = r#"{"store":{"cluster":"store","transport":"http"},
    "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},"ttl_seconds":60}]}"#;

fn configured(host: &FakeHost, config: &str) -> PluginRoot {
    *host.configuration.borrow_mut() = config.as_bytes().to_vec();
    let mut root = PluginRoot::new(1);
    assert!(root.on_configure(host));
    root
}

/// Runs a request to completion in cluster mode; the completion then waits in the root.
fn completed_request(host: &FakeHost, root: &PluginRoot) {
    completed_request_with(host, root, b"done");
}

fn completed_request_with(host: &FakeHost, root: &PluginRoot, response_body: &[u8]) {
    completed_request_key(host, root, "k1", response_body);
}

fn completed_request_key(host: &FakeHost, root: &PluginRoot, key: &str, response_body: &[u8]) {
    host.set_request(&post_headers("/orders", Some(key)), b"");
    let request = root.new_request(2).unwrap();
    let mut request = request.borrow_mut();
    request.on(
        host,
        Event::RequestHeaders {
            end_of_stream: true,
        },
    );
    let Some(Effect::Callout { token, .. }) = host.take_effects().into_iter().next() else {
        panic!("no claim callout");
    };
    host.set_callout_answer(Some(200), br#"{"outcome":"claimed","owner":"o1"}"#);
    request.on(
        host,
        Event::CalloutAnswer {
            token,
            num_headers: 1,
            body_size: 34,
        },
    );
    respond(host, &mut request, 201, response_body);
    let _ = host.take_effects();
}

/// The tokens of the completions the root sent since the last look.
fn completions_sent(host: &FakeHost) -> Vec<u32> {
    completion_bodies(host)
        .into_iter()
        .map(|(t, _)| t)
        .collect()
}

/// The completions the root sent since the last look, with their bodies.
fn completion_bodies(host: &FakeHost) -> Vec<(u32, Vec<u8>)> {
    host.take_effects()
        .into_iter()
        .filter_map(|e| match e {
            Effect::Callout {
                token, path, body, ..
            } if path.ends_with("/complete") => Some((token, body)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_bad_configuration_is_refused_and_a_good_one_sets_the_tick() {
    let host = FakeHost::default();
    *host.configuration.borrow_mut() = br#"{"rules":[{"name":""}]}"#.to_vec();
    let mut root = PluginRoot::new(1);
    assert!(!root.on_configure(&host));
    assert!(root.new_request(2).is_none());
    configured(&host, ORDERS);
    assert_eq!(host.tick_period_ms.get(), Some(UPKEEP_TICK_MS));
    configured(&host, CLUSTER);
    assert_eq!(host.tick_period_ms.get(), Some(STORE_RETRY_TICK_MS));
}

#[test]
fn a_completion_is_retried_through_an_outage_until_the_store_takes_it() {
    let host = FakeHost::default();
    let mut root = configured(&host, CLUSTER);
    completed_request(&host, &root);
    root.on_queue_ready(&host, 1);
    let first = completions_sent(&host);
    assert_eq!(first.len(), 1);
    // The store is down: no answer.
    host.set_callout_answer(None, b"");
    root.on_callout_answer(&host, first[0], 0, 0);
    assert_eq!(host.counter("orders", Outcome::StoreError), 1);
    // Not before its backoff...
    root.on_tick(&host);
    assert!(completions_sent(&host).is_empty());
    // ...then again, and again after each failure, for as long as the record could matter.
    let mut sent = 1;
    for _ in 0..20 {
        host.advance_ms(2_000);
        root.on_tick(&host);
        let again = completions_sent(&host);
        assert_eq!(again.len(), 1);
        sent += 1;
        root.on_callout_answer(&host, again[0], 0, 0);
    }
    assert!(sent > 20);
    host.advance_ms(2_000);
    root.on_tick(&host);
    let last = completions_sent(&host);
    host.set_callout_answer(Some(200), br#"{"outcome":"completed"}"#);
    root.on_callout_answer(&host, last[0], 1, 23);
    host.advance_ms(2_000);
    root.on_tick(&host);
    assert!(completions_sent(&host).is_empty());
    assert_eq!(host.counter("orders", Outcome::StoreWriteDropped), 0);
}

#[test]
fn a_completion_is_given_up_once_its_record_would_have_expired() {
    let host = FakeHost::default();
    let mut root = configured(&host, CLUSTER);
    completed_request(&host, &root);
    root.on_queue_ready(&host, 1);
    host.set_callout_answer(None, b"");
    let mut token = completions_sent(&host)[0];
    for _ in 0..40 {
        root.on_callout_answer(&host, token, 0, 0);
        host.advance_ms(2_000);
        root.on_tick(&host);
        match completions_sent(&host).first() {
            Some(t) => token = *t,
            None => break,
        }
    }
    // The TTL is 60 s: after it nothing more is sent, and the drop is counted.
    assert_eq!(host.counter("orders", Outcome::StoreWriteDropped), 1);
    host.advance_ms(10_000);
    root.on_tick(&host);
    assert!(completions_sent(&host).is_empty());
}

#[test]
fn a_retired_configuration_stays_until_its_waiting_writes_are_taken() {
    let host = FakeHost::default();
    let mut root = configured(&host, CLUSTER);
    completed_request(&host, &root);
    root.on_queue_ready(&host, 1);
    let token = completions_sent(&host)[0];
    // A push retires the configuration while the completion is unanswered.
    assert!(!root.on_done());
    host.set_callout_answer(Some(200), br#"{"outcome":"completed"}"#);
    root.on_callout_answer(&host, token, 1, 23);
    assert_eq!(host.take_effects(), vec![Effect::Done]);
    // Nothing waiting: done at once.
    let mut idle = configured(&host, CLUSTER);
    assert!(idle.on_done());
}

/// The record a completion callout carries.
fn sent_record(body: &[u8]) -> idempotency_protocol::record::RecordedResponse {
    use base64::engine::general_purpose::STANDARD as BASE64;
    use base64::Engine as _;
    let body: serde_json::Value = serde_json::from_slice(body).unwrap();
    let record = BASE64.decode(body["record"].as_str().unwrap()).unwrap();
    idempotency_protocol::record::RecordedResponse::decode(&record).unwrap()
}

#[test]
fn a_completion_larger_than_the_write_budget_goes_without_its_body() {
    use crate::store::writes::RETRY_BUDGET_BYTES;

    let host = FakeHost::default();
    let mut root = configured(
        &host,
        r#"{"store":{"cluster":"store","transport":"http"},"rules":[{"name":"orders",
            "match":{"path_prefixes":["/orders"]},"max_response_bytes":33554432}]}"#,
    );
    let large = vec![b'x'; RETRY_BUDGET_BYTES + 1];
    completed_request_with(&host, &root, &large);
    root.on_queue_ready(&host, 1);
    let sent = completion_bodies(&host);
    assert_eq!(sent.len(), 1);
    let recorded = sent_record(&sent[0].1);
    // A replay of this record carries the status and the omitted-body marker.
    assert_eq!(recorded.status, 201);
    assert!(recorded.body.is_empty() && recorded.body_omitted);
    // Through an outage it waits like any other.
    host.set_callout_answer(None, b"");
    root.on_callout_answer(&host, sent[0].0, 0, 0);
    host.advance_ms(2_000);
    root.on_tick(&host);
    assert_eq!(completion_bodies(&host).len(), 1);
    assert_eq!(host.counter("orders", Outcome::StoreWriteDropped), 0);
}

#[test]
fn completions_in_flight_to_a_slow_store_are_held_to_the_write_budget() {
    use crate::store::writes::RETRY_BUDGET_BYTES;

    let host = FakeHost::default();
    let root = configured(
        &host,
        r#"{"store":{"cluster":"store","transport":"http"},"rules":[{"name":"orders",
            "match":{"path_prefixes":["/orders"]},"max_response_bytes":2097152}]}"#,
    );
    // A store that answers, slowly: none of these completions has its answer yet.
    let response = vec![b'x'; 2 << 20];
    let mut in_flight = 0;
    let mut slimmed = 0;
    for i in 0..12 {
        completed_request_key(&host, &root, &format!("k{i}"), &response);
        root.on_queue_ready(&host, 1);
        for (_, body) in completion_bodies(&host) {
            let recorded = sent_record(&body);
            if recorded.body_omitted {
                slimmed += 1;
            } else {
                in_flight += recorded.body.len();
            }
        }
    }
    // Before: all 24 MiB of bodies sat in the heap waiting for their answers.
    assert!(
        in_flight <= RETRY_BUDGET_BYTES,
        "{in_flight} bytes in flight"
    );
    assert!(slimmed >= 4, "{slimmed} sent without their bodies");
    assert_eq!(host.counter("orders", Outcome::StoreWriteDropped), 0);
}

#[test]
fn a_retired_table_is_emptied_a_batch_a_second_however_often_the_root_ticks() {
    // Wait mode ticks every 20 ms and cluster mode every 100 ms; emptying a retired table
    // (nine shared-data writes a bucket, under Envoy's process-wide lock) must not speed up
    // with them.
    let host = FakeHost::default();
    let rule = r#""rules":[{"name":"orders","ttl_seconds":1,"lease_seconds":1,
        "on_in_flight":"wait","wait_ms":500}]"#;
    configured(
        &host,
        &format!(r#"{{"local_table":{{"capacity":8192}},{rule}}}"#),
    );
    let mut root = configured(
        &host,
        &format!(r#"{{"local_table":{{"capacity":16384}},{rule}}}"#),
    );
    assert_eq!(host.tick_period_ms.get(), Some(WAIT_TICK_MS));
    host.advance_ms(5_000); // the retired table's records have all expired
    let writes = || *host.shared.next_cas.borrow();
    let before = writes();
    root.on_tick(&host);
    // A batch: 64 buckets, each its bucket key and its eight slots' response keys.
    let batch = 64 * 9;
    assert!(
        writes() - before >= batch,
        "the first tick empties a batch (and takes the table off the registry)"
    );
    for _ in 0..49 {
        host.advance_ms(u64::from(WAIT_TICK_MS));
        let at = writes();
        root.on_tick(&host);
        assert_eq!(writes(), at, "no more within the second");
    }
    host.advance_ms(u64::from(WAIT_TICK_MS));
    let at = writes();
    root.on_tick(&host);
    // The batch, and the once-a-second renewal of the root's role mark (`vm_roles`).
    assert_eq!(writes() - at, batch + 1, "the next batch a second later");
}

/// A month of traffic passes through one root: the journeys it can find stay within twice
/// the requests in flight, however many have come and gone.
#[test]
fn the_root_tracks_no_more_journeys_than_twice_those_in_flight() {
    let host = FakeHost::default();
    let root = configured(&host, r#"{"rules":[{"name":"orders"}]}"#);
    let in_flight: Vec<_> = (0..100).filter_map(|id| root.new_request(id)).collect();
    for id in 100..100_000 {
        drop(root.new_request(id));
    }
    let tracked = root.journeys().tracked();
    assert!(tracked <= 2 * in_flight.len() + 64, "{tracked} tracked");
    for (id, journey) in (0..100).zip(&in_flight) {
        let found = root
            .journeys()
            .find(id)
            .expect("a request in flight is found");
        assert!(Rc::ptr_eq(&found, journey));
    }
    assert!(
        root.journeys().find(100_000 - 1).is_none(),
        "a request gone is not found"
    );
}

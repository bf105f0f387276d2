//! Cluster mode over the HTTP transport: the claim confirmed by the store over a callout, every kind of answer, and
//! the request held while the store decides.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;

use super::*;
use crate::fake_host::HostCall;
use crate::outcome::Outcome;
use idempotency_protocol::record::RecordedResponse;

fn cluster_config(policy: &str) -> String {
    format!(
        r#"{{"store":{{"cluster":"store","token":"s3cret","transport":"http"}},
            "rules":[{{"name":"orders","match":{{"path_prefixes":["/orders"]}},
            "on_store_error":"{policy}"}}]}}"#
    )
}

/// The callouts among `effects`: token, path and JSON body.
fn callouts(effects: &[Effect]) -> Vec<(u32, String, serde_json::Value)> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Callout {
                token, path, body, ..
            } => Some((
                *token,
                path.clone(),
                serde_json::from_slice(body).unwrap_or_default(),
            )),
            _ => None,
        })
        .collect()
}

/// Sends the store's answer to the request's pending claim callout.
fn answer(
    host: &FakeHost,
    request: &mut RequestJourney,
    token: u32,
    status: Option<u16>,
    body: &str,
) -> Verdict {
    host.set_callout_answer(status, body.as_bytes());
    request.on(
        host,
        Event::CalloutAnswer {
            token,
            num_headers: usize::from(status.is_some()),
            body_size: body.len(),
        },
    )
}

/// A POST whose claim went to the store; returns the request and the claim's callout.
fn claimed_at_store(
    host: &FakeHost,
    plugin: &Rc<Plugin>,
    key: &str,
) -> (RequestJourney, u32, serde_json::Value) {
    let (request, verdict) = post(host, plugin, key, b"{}");
    assert_eq!(verdict, Verdict::Pause);
    assert!(matches!(request.state(), Journey::AwaitingStore(_)));
    let calls = callouts(&host.take_effects());
    assert_eq!(calls.len(), 1, "{calls:?}");
    let (token, path, body) = calls.into_iter().next().unwrap();
    assert_eq!(path, "/v1/claim");
    (request, token, body)
}

#[test]
fn the_store_confirms_the_claim_and_the_request_resumes_upstream() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"store":{"cluster":"store","token":"s3cret","transport":"http"},"rules":[{"name":"orders",
            "match":{"path_prefixes":["/orders"]},"fingerprint":"none"}]}"#,
    );
    host.set_request(&post_headers("/orders", Some("k1")), b"");
    let mut request = RequestJourney::new(Rc::clone(&plugin));
    let verdict = request.on(
        &host,
        Event::RequestHeaders {
            end_of_stream: false,
        },
    );
    assert_eq!(verdict, Verdict::Pause);
    let effects = host.take_effects();
    let Some(Effect::Callout { token, headers, .. }) = effects.first() else {
        panic!("no callout: {effects:?}");
    };
    let auth = headers.iter().find(|(n, _)| n == "authorization");
    assert_eq!(auth.map(|(_, v)| v.as_str()), Some("Bearer s3cret"));
    // The rule never reads the body, but it must not go upstream before the store decides.
    let body = Event::RequestBody {
        size: 4096,
        end_of_stream: true,
    };
    assert_eq!(request.on(&host, body), Verdict::Pause);
    assert_eq!(request.on(&host, Event::RequestTrailers), Verdict::Pause);
    let owner = r#"{"outcome":"claimed","owner":"abc"}"#;
    assert_eq!(
        answer(&host, &mut request, *token, Some(200), owner),
        Verdict::Continue
    );
    assert_eq!(host.take_effects(), vec![Effect::Resume]);
    assert!(is_executing(&request));
    assert_eq!(host.counter("orders", Outcome::Executed), 1);
}

#[test]
fn an_answer_to_another_callout_leaves_the_request_waiting() {
    let host = FakeHost::default();
    let plugin = plugin(&host, &cluster_config("fail_closed"));
    let (mut request, token, _) = claimed_at_store(&host, &plugin, "k1");
    let verdict = answer(&host, &mut request, token + 100, Some(200), "{}");
    assert_eq!(verdict, Verdict::Pause);
    assert!(matches!(request.state(), Journey::AwaitingStore(_)));
    assert!(host.take_effects().is_empty());
}

#[test]
fn the_store_saying_in_flight_or_mismatch_answers_409_or_422_and_frees_the_local_claim() {
    for (outcome, status) in [("in_flight", 409), ("mismatch", 422)] {
        let host = FakeHost::default();
        let plugin = plugin(&host, &cluster_config("fail_closed"));
        let (mut request, token, _) = claimed_at_store(&host, &plugin, "k1");
        let body = format!(r#"{{"outcome":"{outcome}"}}"#);
        assert_eq!(
            answer(&host, &mut request, token, Some(200), &body),
            Verdict::Pause
        );
        assert_eq!(the_reply(&host.take_effects()).0, status);
        // The local claim is gone: the next attempt asks the store again.
        claimed_at_store(&host, &plugin, "k1");
    }
}

#[test]
fn a_record_from_the_store_is_replayed_and_kept_for_the_next_retry() {
    let host = FakeHost::default();
    let plugin = plugin(&host, &cluster_config("fail_closed"));
    let (mut request, token, _) = claimed_at_store(&host, &plugin, "k1");
    let recorded = RecordedResponse {
        owner: 7,
        status: 201,
        headers: vec![("content-type".into(), b"text/plain".to_vec())],
        body: b"made elsewhere".to_vec(),
        trailers: Vec::new(),
        body_omitted: false,
        unknown: None,
    };
    let body = format!(
        r#"{{"outcome":"completed","record":"{}"}}"#,
        BASE64.encode(recorded.encode())
    );
    assert_eq!(
        answer(&host, &mut request, token, Some(200), &body),
        Verdict::Pause
    );
    let (status, headers, reply) = the_reply(&host.take_effects());
    assert_eq!((status, reply.as_slice()), (201, &b"made elsewhere"[..]));
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
    // This proxy's next retry replays from its own table, without a callout.
    let (_, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Pause);
    let effects = host.take_effects();
    assert!(callouts(&effects).is_empty());
    assert_eq!(the_reply(&effects).2, b"made elsewhere");
    assert_eq!(host.counter("orders", Outcome::Replayed), 2);
}

#[test]
fn fail_closed_answers_503_and_undoes_a_claim_the_store_may_hold() {
    // (answer, whether the store may hold the claim)
    let cases: [(Option<u16>, &str, bool); 4] = [
        (None, "", true),
        (Some(503), "{}", true),
        (Some(401), "{}", false),
        (Some(200), "not json", false),
    ];
    for (status, body, may_hold) in cases {
        let host = FakeHost::default();
        let plugin = plugin(&host, &cluster_config("fail_closed"));
        let (mut request, token, claim) = claimed_at_store(&host, &plugin, "k1");
        assert_eq!(
            answer(&host, &mut request, token, status, body),
            Verdict::Pause
        );
        let effects = host.take_effects();
        assert_eq!(the_reply(&effects).0, 503, "{status:?}");
        assert_eq!(host.counter("orders", Outcome::StoreError), 1);
        // A release goes through the root's queue, then out on its wake-up.
        let root_host_queue = host.queued("envoy.filters.http.idempotency/store-writes/");
        assert_eq!(root_host_queue, usize::from(may_hold), "{status:?}");
        plugin.writes.on_wake(&host, &plugin.links());
        let releases = callouts(&host.take_effects());
        assert_eq!(releases.len(), usize::from(may_hold), "{status:?}");
        if let Some((_, path, release)) = releases.first() {
            assert_eq!(path, "/v1/release");
            assert_eq!(release["owner"], claim["owner"]);
        }
        // Nothing stays claimed locally: the next attempt asks the store again.
        claimed_at_store(&host, &plugin, "k1");
    }
}

#[test]
fn fail_open_executes_guarded_by_the_local_claim() {
    let host = FakeHost::default();
    let plugin = plugin(&host, &cluster_config("fail_open"));
    let (mut request, token, _) = claimed_at_store(&host, &plugin, "k1");
    assert_eq!(
        answer(&host, &mut request, token, None, ""),
        Verdict::Continue
    );
    assert_eq!(host.take_effects(), vec![Effect::Resume]);
    assert!(is_executing(&request));
    assert_eq!(host.counter("orders", Outcome::StoreFailOpen), 1);
    let (_, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Pause);
    assert_eq!(the_reply(&host.take_effects()).0, 409);
}

#[test]
fn a_callout_the_host_refuses_is_a_store_failure_with_nothing_to_undo() {
    let host = FakeHost::default();
    let plugin = plugin(&host, &cluster_config("fail_closed"));
    host.fail(HostCall::Callout);
    let (_, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(verdict, Verdict::Pause);
    assert_eq!(the_reply(&host.take_effects()).0, 503);
    assert_eq!(
        host.queued("envoy.filters.http.idempotency/store-writes/"),
        0
    );
}

#[test]
fn a_client_gone_while_the_store_decides_frees_the_key_here_and_there() {
    let host = FakeHost::default();
    let plugin = plugin(&host, &cluster_config("fail_closed"));
    let (mut request, _, claim) = claimed_at_store(&host, &plugin, "k1");
    assert_eq!(request.on(&host, Event::StreamEnd), Verdict::Continue);
    assert!(matches!(request.state(), Journey::Finished));
    plugin.writes.on_wake(&host, &plugin.links());
    let releases = callouts(&host.take_effects());
    assert_eq!(releases.len(), 1);
    assert_eq!(releases[0].1, "/v1/release");
    assert_eq!(releases[0].2["owner"], claim["owner"]);
    claimed_at_store(&host, &plugin, "k1");
}

#[test]
fn a_resume_the_host_refuses_is_logged_not_fatal() {
    let host = FakeHost::default();
    let plugin = plugin(&host, &cluster_config("fail_closed"));
    let (mut request, token, _) = claimed_at_store(&host, &plugin, "k1");
    host.fail(HostCall::Resume);
    let owner = r#"{"outcome":"claimed","owner":"abc"}"#;
    assert_eq!(
        answer(&host, &mut request, token, Some(200), owner),
        Verdict::Continue
    );
    assert!(is_executing(&request));
}

#[test]
fn the_completion_reaches_the_store_through_the_root_with_the_claims_owner() {
    let host = FakeHost::default();
    let plugin = plugin(&host, &cluster_config("fail_closed"));
    let (mut request, token, claim) = claimed_at_store(&host, &plugin, "k1");
    let owner = r#"{"outcome":"claimed","owner":"from-store"}"#;
    answer(&host, &mut request, token, Some(200), owner);
    respond(&host, &mut request, 201, b"created");
    let _ = host.take_effects();
    plugin.writes.on_wake(&host, &plugin.links());
    let writes = callouts(&host.take_effects());
    assert_eq!(writes.len(), 1);
    let (_, path, body) = &writes[0];
    assert_eq!(path, "/v1/complete");
    assert_eq!(body["owner"], "from-store");
    assert_eq!(body["key"], claim["key"]);
    assert_eq!(body["fingerprint"], claim["fingerprint"]);
    let record = BASE64.decode(body["record"].as_str().unwrap()).unwrap();
    let recorded = RecordedResponse::decode(&record).unwrap();
    assert_eq!((recorded.status, recorded.body), (201, b"created".to_vec()));
}

/// A request the store let through, answered by the upstream with `body`.
fn executed_via_store(host: &FakeHost, plugin: &Rc<Plugin>, key: &str, body: &[u8]) {
    let (mut request, token, _) = claimed_at_store(host, plugin, key);
    let claimed = r#"{"outcome":"claimed","owner":"o"}"#;
    assert_eq!(
        answer(host, &mut request, token, Some(200), claimed),
        Verdict::Continue
    );
    respond(host, &mut request, 201, body);
    let _ = host.take_effects();
}

#[test]
fn a_local_table_full_of_claims_in_flight_sends_new_keys_to_the_store_not_503() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"local_table":{"capacity":1},"store":{"cluster":"store","transport":"http"},
            "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]}}]}"#,
    );
    let mut in_flight = Vec::new();
    for i in 0..8 {
        let (mut request, token, _) = claimed_at_store(&host, &plugin, &format!("k{i}"));
        answer(
            &host,
            &mut request,
            token,
            Some(200),
            r#"{"outcome":"claimed","owner":"o"}"#,
        );
        in_flight.push(request);
    }
    let _ = host.take_effects();
    // The ninth key finds every local slot in flight: the store alone decides.
    let (mut request, token, _) = claimed_at_store(&host, &plugin, "k8");
    assert_eq!(host.counter("orders", Outcome::TableFull), 1);
    let claimed = r#"{"outcome":"claimed","owner":"o"}"#;
    assert_eq!(
        answer(&host, &mut request, token, Some(200), claimed),
        Verdict::Continue
    );
    respond(&host, &mut request, 201, b"stored");
    assert!(replies(&host.take_effects()).is_empty());
    // Its completion went to the store; nothing local holds it, so a retry asks the store.
    claimed_at_store(&host, &plugin, "k8");
}

#[test]
fn a_local_copy_whose_page_was_reused_is_fetched_again_from_the_store() {
    let host = FakeHost::default();
    let plugin = plugin(
        &host,
        r#"{"local_table":{"capacity":8,"max_bytes":1048576},"store":{"cluster":"store","transport":"http"},
            "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]}}]}"#,
    );
    let layout = &plugin.config.table_layout;
    let class = layout.class_for(100_100).expect("a page class for 100 kB");
    let pages = layout.classes[usize::from(class)].pages;
    for i in 0..=pages {
        executed_via_store(&host, &plugin, &format!("k{i}"), &vec![b'a'; 100_000]);
    }
    // The newest is still local: replayed without a callout.
    post(&host, &plugin, &format!("k{pages}"), b"{}");
    let effects = host.take_effects();
    assert!(callouts(&effects).is_empty());
    assert_eq!(the_reply(&effects).2.len(), 100_000);
    // The first one's page holds a newer response now: the store answers for it.
    claimed_at_store(&host, &plugin, "k0");

    // And when the store cannot answer, the status this proxy recorded is replayed: the
    // write is never run again nor refused for it.
    let (mut request, token, _) = claimed_at_store(&host, &plugin, "k0");
    assert_eq!(answer(&host, &mut request, token, None, ""), Verdict::Pause);
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.len()), (201, 0));
    assert_eq!(
        header(&headers, "idempotent-body-omitted"),
        Some(&b"true"[..])
    );
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));

    // Its completion never reached the store and the store's claim lapsed: the store lets the
    // retry claim the key. This proxy knows the write completed: it replays what it kept and
    // records that in the store, instead of running the write again.
    let (mut request, token, claim) = claimed_at_store(&host, &plugin, "k0");
    let claimed = r#"{"outcome":"claimed","owner":"retry"}"#;
    assert_eq!(
        answer(&host, &mut request, token, Some(200), claimed),
        Verdict::Pause
    );
    assert!(!is_executing(&request), "before: it executed again");
    let effects = host.take_effects();
    let (status, headers, _) = the_reply(&effects);
    assert_eq!(status, 201);
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
    plugin.writes.on_wake(&host, &plugin.links());
    let writes = callouts(&host.take_effects());
    let (_, path, body) = writes.last().expect("a completion");
    assert_eq!(path, "/v1/complete");
    assert_eq!(
        (&body["owner"], &body["key"]),
        (&"retry".into(), &claim["key"])
    );
    let record = BASE64.decode(body["record"].as_str().unwrap()).unwrap();
    let kept = RecordedResponse::decode(&record).unwrap();
    assert_eq!((kept.status, kept.body_omitted), (201, true));
}

#[test]
fn fail_open_without_a_local_claim_follows_the_table_full_policy() {
    let config = |on_table_full: &str| {
        format!(
            r#"{{"local_table":{{"capacity":1}},"store":{{"cluster":"store","transport":"http"}},
                "rules":[{{"name":"orders","match":{{"path_prefixes":["/orders"]}},
                           "on_store_error":"fail_open","on_table_full":"{on_table_full}"}}]}}"#
        )
    };
    for (policy, executes) in [("reject", false), ("pass_through", true)] {
        let host = FakeHost::default();
        let plugin = plugin(&host, &config(policy));
        let mut in_flight = Vec::new();
        for i in 0..8 {
            let (mut request, token, _) = claimed_at_store(&host, &plugin, &format!("k{i}"));
            let claimed = r#"{"outcome":"claimed","owner":"o"}"#;
            answer(&host, &mut request, token, Some(200), claimed);
            in_flight.push(request);
        }
        let _ = host.take_effects();
        // The ninth key has no local slot, and the store does not answer: fail-open would
        // run it unguarded on this proxy, so the table-full policy decides.
        let (mut request, token, _) = claimed_at_store(&host, &plugin, "k8");
        let verdict = answer(&host, &mut request, token, None, "");
        if executes {
            assert_eq!(verdict, Verdict::Continue, "{policy}");
        } else {
            assert_eq!(verdict, Verdict::Pause, "{policy}");
            let (status, _, body) = the_reply(&host.take_effects());
            assert_eq!(status, 503);
            assert!(
                problem_type(&body).ends_with("capacity-exhausted"),
                "{policy}"
            );
        }
    }
}

#[test]
fn an_unknown_outcome_is_recorded_in_the_store_so_no_replica_runs_it_again() {
    let host = FakeHost::default();
    let plugin = plugin(&host, &cluster_config("fail_closed"));
    let (mut request, token, claim) = claimed_at_store(&host, &plugin, "k1");
    let owner = r#"{"outcome":"claimed","owner":"from-store"}"#;
    answer(&host, &mut request, token, Some(200), owner);
    envoy_reports(&host, "response_timeout", 0x4, 1);
    respond(&host, &mut request, 504, b"");
    let _ = host.take_effects();
    plugin.writes.on_wake(&host, &plugin.links());
    let writes = callouts(&host.take_effects());
    assert_eq!(writes.len(), 1, "a completion, not a release: {writes:?}");
    let (_, path, body) = &writes[0];
    assert_eq!(path, "/v1/complete");
    assert_eq!(body["owner"], "from-store");
    assert_eq!(body["key"], claim["key"]);
    let record = BASE64.decode(body["record"].as_str().unwrap()).unwrap();
    let recorded = RecordedResponse::decode(&record).unwrap();
    let unknown = recorded.unknown.expect("an unknown outcome");
    assert_eq!(
        (
            unknown.proxy_status,
            unknown.response_flags,
            unknown.attempts
        ),
        (504, 0x4, 1)
    );
    assert_eq!(unknown.details, "response_timeout");
    // Another replica's retry gets that record from the store: it is told, not run.
    let other = FakeHost::default();
    let replica = super::plugin(&other, &cluster_config("fail_closed"));
    let (mut retry, token, _) = claimed_at_store(&other, &replica, "k1");
    let completed = format!(
        r#"{{"outcome":"completed","record":"{}"}}"#,
        BASE64.encode(&record)
    );
    assert_eq!(
        answer(&other, &mut retry, token, Some(200), &completed),
        Verdict::Pause
    );
    let (status, _, body) = the_reply(&other.take_effects());
    assert_eq!(status, 409);
    assert!(problem_type(&body).ends_with("outcome-unknown"));
}

/// The record a completion callout carries.
fn completion_record(body: &serde_json::Value) -> (Vec<u8>, RecordedResponse) {
    let record = BASE64.decode(body["record"].as_str().unwrap()).unwrap();
    let decoded = RecordedResponse::decode(&record).unwrap();
    (record, decoded)
}

/// The store takes the write callout `token` of `plugin`'s root.
fn store_takes(host: &FakeHost, plugin: &Rc<Plugin>, token: u32, answer: &str) {
    host.set_callout_answer(Some(200), answer.as_bytes());
    assert!(plugin
        .writes
        .on_answer(host, &plugin.table, token, 1, answer.len()));
}

/// An unknown outcome recorded by one worker whose completion has not reached the store
/// (an outage longer than the lease: the store's claim lapsed): a retry on another worker
/// of the same Envoy finds the key free in the store and still never runs the write.
#[test]
fn an_unknown_outcome_not_yet_in_the_store_is_never_run_again_by_another_worker() {
    let host = FakeHost::default();
    let first_worker = plugin(&host, &cluster_config("fail_closed"));
    let second_worker = plugin(&host, &cluster_config("fail_closed"));
    let (mut request, token, claim) = claimed_at_store(&host, &first_worker, "k1");
    let first = r#"{"outcome":"claimed","owner":"first"}"#;
    answer(&host, &mut request, token, Some(200), first);
    envoy_reports(&host, "response_timeout", 0x4, 1);
    respond(&host, &mut request, 504, b"");
    let _ = host.take_effects();
    // The first worker's completion waits in its root (the store is down).

    let (mut retry, token, _) = claimed_at_store(&host, &second_worker, "k1");
    let lapsed = r#"{"outcome":"claimed","owner":"retry"}"#;
    assert_eq!(
        answer(&host, &mut retry, token, Some(200), lapsed),
        Verdict::Pause
    );
    assert!(!is_executing(&retry), "the write ran a second time");
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 409);
    assert!(problem_type(&body).ends_with("outcome-unknown"));
    assert_eq!(host.counter("orders", Outcome::Executed), 1);

    // The retry sends the record on under its own claim, as the first worker sends it.
    second_worker.writes.on_wake(&host, &second_worker.links());
    let sent_on = callouts(&host.take_effects());
    let (sent_on_token, path, body) = sent_on.last().expect("the record sent on");
    assert_eq!(path, "/v1/complete");
    assert_eq!(
        (&body["owner"], &body["key"]),
        (&"retry".into(), &claim["key"])
    );
    let (sent_on_record, sent_on_decoded) = completion_record(body);
    assert_eq!(sent_on_decoded.unknown.unwrap().details, "response_timeout");
    first_worker.writes.on_wake(&host, &first_worker.links());
    let firsts = callouts(&host.take_effects());
    let (_, _, first_body) = firsts.last().expect("the first worker's completion");
    assert_eq!(completion_record(first_body).0, sent_on_record);

    // Until the store has taken it, every retry on either worker is told, never run.
    for worker in [&first_worker, &second_worker] {
        let (mut retry, token, _) = claimed_at_store(&host, worker, "k1");
        answer(&host, &mut retry, token, Some(200), lapsed);
        assert!(!is_executing(&retry), "the write ran a second time");
        assert_eq!(the_reply(&host.take_effects()).0, 409);
    }

    // Once the store took it, the store's word counts again: settled there as never run
    // (another replica's resolution, an operator), the next retry runs the write.
    store_takes(
        &host,
        &second_worker,
        *sent_on_token,
        r#"{"outcome":"completed"}"#,
    );
    let (mut retry, token, _) = claimed_at_store(&host, &first_worker, "k1");
    answer(&host, &mut retry, token, Some(200), lapsed);
    assert!(
        is_executing(&retry),
        "a key the store freed stays unknown here"
    );
}

/// `fail_open` during an outage runs the write with no store claim, so no completion is ever
/// sent: its unknown outcome reaches the store only through the next retry, never run.
#[test]
fn an_unknown_outcome_whose_claim_never_reached_the_store_is_not_run_again() {
    let host = FakeHost::default();
    let plugin = plugin(&host, &cluster_config("fail_open"));
    host.fail(HostCall::Callout);
    let (mut request, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(
        verdict,
        Verdict::Continue,
        "fail_open runs it on the local claim"
    );
    envoy_reports(&host, "response_timeout", 0x4, 1);
    respond(&host, &mut request, 504, b"");
    // Its completion, under an owner the store never saw, waits for the store.
    plugin.writes.on_wake(&host, &plugin.links());
    assert!(
        callouts(&host.take_effects()).is_empty(),
        "the store is down"
    );
    host.heal(HostCall::Callout);

    let (mut retry, token, _) = claimed_at_store(&host, &plugin, "k1");
    let free = r#"{"outcome":"claimed","owner":"retry"}"#;
    answer(&host, &mut retry, token, Some(200), free);
    assert!(!is_executing(&retry), "the write ran a second time");
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 409);
    assert!(problem_type(&body).ends_with("outcome-unknown"));
    plugin.writes.on_wake(&host, &plugin.links());
    let writes = callouts(&host.take_effects());
    let (_, path, body) = writes.last().expect("the record sent on");
    assert_eq!(
        (path.as_str(), &body["owner"]),
        ("/v1/complete", &"retry".into())
    );
    assert!(completion_record(body).1.unknown.is_some());
}

/// The soak's lost record: during a store outage a `fail_open` write ran on the local claim
/// alone, its response too large for the table's pages. Until its completion reaches the
/// store, its local record is all that answers the key: eviction pressure from the same
/// Envoy's other writes must not take it, nor its size, or a reuse of the key with another
/// payload runs (the store being down) and its record replaces the first one's.
#[test]
fn a_record_on_its_way_to_the_store_answers_its_key_through_eviction_and_its_size() {
    let config = r#"{"local_table":{"capacity":8,"max_bytes":1048576},
        "store":{"cluster":"store","transport":"http"},
        "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},"on_store_error":"fail_open"}]}"#;
    let host = FakeHost::default();
    let first_worker = plugin(&host, config);
    let second_worker = plugin(&host, config);
    host.fail(HostCall::Callout);
    let (mut first, verdict) = post(&host, &first_worker, "k1", b"{\"amount\":1}");
    assert_eq!(
        verdict,
        Verdict::Continue,
        "fail_open runs it on the local claim"
    );
    respond(&host, &mut first, 201, &vec![b'x'; 300_000]);
    host.heal(HostCall::Callout);
    let _ = host.take_effects();

    // The store is back for the other worker, whose writes land and then give way to newer
    // ones: far more than the table holds.
    for i in 0..40 {
        executed_via_store(&host, &second_worker, &format!("other-{i}"), b"{}");
        second_worker.writes.on_wake(&host, &second_worker.links());
        for (token, path, _) in callouts(&host.take_effects()) {
            assert_eq!(path, "/v1/complete");
            store_takes(&host, &second_worker, token, r#"{"outcome":"completed"}"#);
        }
    }
    assert!(
        host.counter("orders", Outcome::Evicted) > 0,
        "eviction pressure"
    );

    // The store down again: the first write's key still answers here.
    host.fail(HostCall::Callout);
    let (reuse, _) = post(&host, &first_worker, "k1", b"{\"amount\":2}");
    assert!(
        !is_executing(&reuse),
        "before: the reuse ran, and its record replaced the first"
    );
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!(status, 422);
    assert!(problem_type(&body).ends_with("key-reused"));
    let (retry, _) = post(&host, &first_worker, "k1", b"{\"amount\":1}");
    assert!(!is_executing(&retry));
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(
        (status, body.len()),
        (201, 0),
        "its status, its body not kept here"
    );
    assert_eq!(
        header(&headers, "idempotent-body-omitted"),
        Some(&b"true"[..])
    );

    // Once its completion lands, it is one record among others again.
    host.heal(HostCall::Callout);
    first_worker.writes.on_wake(&host, &first_worker.links());
    let sent = callouts(&host.take_effects());
    let (token, path, _) = sent.last().expect("the first write's completion");
    assert_eq!(path, "/v1/complete");
    store_takes(&host, &first_worker, *token, r#"{"outcome":"completed"}"#);
    // A retry now asks the store, which holds the whole response.
    let (retry, verdict) = post(&host, &first_worker, "k1", b"{\"amount\":1}");
    assert_eq!(verdict, Verdict::Pause);
    assert!(matches!(retry.state(), Journey::AwaitingStore(_)));
    let asked = callouts(&host.take_effects());
    assert_eq!(asked.first().map(|c| c.1.as_str()), Some("/v1/claim"));
}

/// A completed record this proxy cannot read (corrupt, or written by a newer build during a
/// rolling upgrade) still proves the key is taken: even `fail_open` never runs the write on
/// it.
#[test]
fn a_completed_record_the_proxy_cannot_read_never_runs_the_write_even_fail_open() {
    let host = FakeHost::default();
    let plugin = plugin(&host, &cluster_config("fail_open"));
    let (mut request, token, _) = claimed_at_store(&host, &plugin, "k1");
    let mut newer = RecordedResponse::status_only(201).encode();
    newer.extend_from_slice(&[0; 16]); // a section this build does not know
    let answer_body = format!(
        r#"{{"outcome":"completed","record":"{}"}}"#,
        BASE64.encode(&newer)
    );
    answer(&host, &mut request, token, Some(200), &answer_body);
    assert!(!is_executing(&request), "the write ran on a taken key");
    let (status, headers, _) = the_reply(&host.take_effects());
    assert_eq!(status, 503);
    assert!(header(&headers, "retry-after").is_some());
}

/// A `fail_open` write whose claim never reached the store completes there once it is back,
/// under an owner of its own. Should the store refuse it (another replica's claim of the key
/// in flight, released later), the write still ran here: its local record goes on answering
/// this proxy's retries, never letting one run it again.
#[test]
fn a_fail_open_write_the_store_refuses_still_answers_its_retries_here() {
    let host = FakeHost::default();
    let plugin = plugin(&host, &cluster_config("fail_open"));
    host.fail(HostCall::Callout);
    let (mut first, verdict) = post(&host, &plugin, "k1", b"{}");
    assert_eq!(
        verdict,
        Verdict::Continue,
        "fail_open runs it on the local claim"
    );
    respond(&host, &mut first, 201, b"{\"id\":1}");
    host.heal(HostCall::Callout);
    plugin.writes.on_wake(&host, &plugin.links());
    let sent = callouts(&host.take_effects());
    let (token, path, _) = sent.last().expect("its completion");
    assert_eq!(path, "/v1/complete");
    host.set_callout_answer(Some(409), b"{}");
    plugin.writes.on_answer(&host, &plugin.table, *token, 1, 2);
    let (retry, _) = post(&host, &plugin, "k1", b"{}");
    assert!(
        !is_executing(&retry),
        "before: the record was forgotten and the retry ran again"
    );
    let (status, _, body) = the_reply(&host.take_effects());
    assert_eq!((status, body.as_slice()), (201, &b"{\"id\":1}"[..]));
}

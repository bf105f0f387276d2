//! Unknown outcomes resolved by asking the service (`resolve`): after the settle time the
//! root looks the write up as the caller would, and the answer settles the key for every
//! retry: replayed as the service reported it, freed so the retry executes, or asked again
//! after a backoff and finally left for an operator. Until then a retry gets 409 with a
//! Retry-After that says when to come back.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use super::*;
use crate::outcome::Outcome;
use crate::root::PluginRoot;
use crate::who_answered::flag;
use idempotency_protocol::record::key_expires_value;

const RESOLVING: &str = r#"{"rules":[{"name":"pay","match":{"path_prefixes":["/payments"]},
    "resolve":{"cluster":"payments","path":"/payments/by-key/{key}","settle_seconds":5,
    "max_attempts":3,"backoff_seconds":2}}]}"#;

/// A payment with `key` as caller `who`, in context `context`, whose answer never comes (the
/// route timed out after it reached the service).
fn payment_timed_out(host: &FakeHost, root: &PluginRoot, context: u32, key: &str, who: &str) {
    let (journey, verdict) = pay(host, root, context, key, who);
    assert_eq!(
        verdict,
        Verdict::Continue,
        "the first attempt goes upstream"
    );
    envoy_reports(host, "response_timeout", flag::UPSTREAM_REQUEST_TIMEOUT, 1);
    respond(host, &mut journey.borrow_mut(), 504, b"");
    let _ = host.take_effects();
}

fn pay(
    host: &FakeHost,
    root: &PluginRoot,
    context: u32,
    key: &str,
    who: &str,
) -> (Rc<std::cell::RefCell<RequestJourney>>, Verdict) {
    let bearer = format!("Bearer {who}");
    let mut headers = post_headers("/payments", Some(key));
    headers.push(("authorization", &bearer));
    request_in_context(host, root, context, &headers, br#"{"amount":100}"#)
}

/// What a retry gets: None when it executes, else the reply.
fn retry(host: &FakeHost, root: &PluginRoot, context: u32, key: &str) -> Option<Reply> {
    let _ = host.take_effects();
    let (_journey, verdict) = pay(host, root, context, key, "alice");
    if verdict == Verdict::Continue {
        return None;
    }
    Some(the_reply(&host.take_effects()))
}

/// A lookup the root sent: its callout token, cluster, path and headers.
type Lookup = (u32, String, String, Vec<(String, String)>);

/// The root's tick; returns the lookups it sent.
fn tick(host: &FakeHost, root: &mut PluginRoot) -> Vec<Lookup> {
    host.effective_context.set(1);
    root.on_tick(host);
    host.take_effects()
        .into_iter()
        .filter_map(|e| match e {
            crate::fake_host::Effect::Callout {
                token,
                cluster,
                path,
                headers,
                ..
            } => Some((token, cluster, path, headers)),
            _ => None,
        })
        .collect()
}

/// The service answers the lookup `token` with `status` (None: no answer at all).
fn lookup_answers(
    host: &FakeHost,
    root: &mut PluginRoot,
    token: u32,
    status: Option<u16>,
    body: &[u8],
) {
    host.set_callout_answer(status, body);
    host.effective_context.set(1);
    let headers = usize::from(status.is_some());
    root.on_callout_answer(host, token, headers, body.len());
}

fn retry_after(reply: &Reply) -> Option<String> {
    header(&reply.1, "retry-after").map(|v| String::from_utf8_lossy(v).into_owned())
}

#[test]
fn a_payment_that_took_effect_is_replayed_once_the_service_says_so() {
    let host = FakeHost::default();
    let mut root = configured_root(&host, RESOLVING, 1);
    payment_timed_out(&host, &root, 7, "pay-1", "alice");
    // Before the settle time a retry is told to come back when the lookup is due.
    host.advance_ms(1_000);
    let early = retry(&host, &root, 8, "pay-1").expect("not executed");
    assert_eq!(early.0, 409);
    assert!(problem_type(&early.2).ends_with("outcome-unknown"));
    assert_eq!(retry_after(&early).as_deref(), Some("4"));
    assert!(
        tick(&host, &mut root).is_empty(),
        "nobody asks before the settle time"
    );

    host.advance_ms(4_000);
    let lookups = tick(&host, &mut root);
    assert_eq!(lookups.len(), 1);
    let (token, cluster, path, headers) = &lookups[0];
    assert_eq!(cluster, "payments");
    assert_eq!(path, "/payments/by-key/pay-1");
    let method = headers
        .iter()
        .find(|(n, _)| n == ":method")
        .map(|(_, v)| v.as_str());
    assert_eq!(method, Some("GET"));
    let auth = headers
        .iter()
        .find(|(n, _)| n == "authorization")
        .map(|(_, v)| v.as_str());
    assert_eq!(auth, Some("Bearer alice"), "the caller's scope goes along");

    lookup_answers(
        &host,
        &mut root,
        *token,
        Some(200),
        br#"{"id":"pay_1","status":"paid"}"#,
    );
    assert_eq!(host.counter("pay", Outcome::ResolvedTookEffect), 1);
    for context in [9, 10] {
        let replay = retry(&host, &root, context, "pay-1").expect("replayed, not executed");
        assert_eq!(replay.0, 200);
        assert_eq!(replay.2, br#"{"id":"pay_1","status":"paid"}"#);
        assert_eq!(header(&replay.1, "idempotent-replayed"), Some(&b"true"[..]));
        assert_eq!(header(&replay.1, "idempotent-resolved"), Some(&b"true"[..]));
        // Remembered for the rule's TTL from the resolution (2023-11-14T22:13:25Z + 1 day).
        assert_eq!(
            header(&replay.1, "idempotency-key-expires"),
            Some(&b"Wed, 15 Nov 2023 22:13:25 GMT"[..])
        );
    }
    assert!(tick(&host, &mut root).is_empty(), "asked once");
}

#[test]
fn a_payment_resolved_as_taken_effect_keeps_its_tombstone_past_the_ttl() {
    let host = FakeHost::default();
    let keeps_tombstones = r#"{"rules":[{"name":"pay","match":{"path_prefixes":["/payments"]},
        "ttl_seconds":60,"tombstone_seconds":300,
        "resolve":{"cluster":"payments","path":"/payments/by-key/{key}","settle_seconds":5}}]}"#;
    let mut root = configured_root(&host, keeps_tombstones, 1);
    payment_timed_out(&host, &root, 7, "pay-6", "alice");
    host.advance_ms(5_000);
    let lookups = tick(&host, &mut root);
    let resolved_at = crate::host::Host::now_ms(&host);
    lookup_answers(
        &host,
        &mut root,
        lookups[0].0,
        Some(200),
        br#"{"id":"pay_6"}"#,
    );
    let whole = retry(&host, &root, 8, "pay-6").expect("replayed, not executed");
    assert_eq!(
        (whole.0, whole.2.as_slice()),
        (200, &br#"{"id":"pay_6"}"#[..])
    );
    let remembered = key_expires_value(resolved_at + 60_000 + 300_000);
    assert_eq!(
        header(&whole.1, "idempotency-key-expires"),
        Some(remembered.as_bytes()),
        "the key is remembered through its tombstone"
    );
    // A late redelivery past the TTL gets the tombstone: the status, never a second charge.
    host.advance_ms(61_000);
    let late = retry(&host, &root, 9, "pay-6").expect("the tombstone, not an execution");
    assert_eq!((late.0, late.2.as_slice()), (200, &b""[..]));
    assert_eq!(
        header(&late.1, "idempotent-body-omitted"),
        Some(&b"true"[..])
    );
    assert_eq!(header(&late.1, "idempotent-resolved"), Some(&b"true"[..]));
    assert_eq!(host.counter("pay", Outcome::ReplayedTombstone), 1);
    // Once the tombstone has ended, the key is free.
    host.advance_ms(300_000);
    assert_eq!(retry(&host, &root, 10, "pay-6"), None);
}

#[test]
fn a_payment_that_never_ran_frees_its_key_and_the_retry_executes() {
    let host = FakeHost::default();
    let mut root = configured_root(&host, RESOLVING, 1);
    payment_timed_out(&host, &root, 7, "pay-2", "alice");
    host.advance_ms(5_000);
    let lookups = tick(&host, &mut root);
    lookup_answers(&host, &mut root, lookups[0].0, Some(404), b"");
    assert_eq!(host.counter("pay", Outcome::ResolvedNeverRan), 1);
    assert_eq!(retry(&host, &root, 8, "pay-2"), None, "the retry runs it");
}

#[test]
fn a_failing_lookup_is_asked_again_after_a_backoff_then_left_for_an_operator() {
    let host = FakeHost::default();
    let mut root = configured_root(&host, RESOLVING, 1);
    payment_timed_out(&host, &root, 7, "pay-3", "alice");
    host.advance_ms(5_000);
    let first = tick(&host, &mut root);
    lookup_answers(&host, &mut root, first[0].0, Some(503), b"");
    assert_eq!(host.counter("pay", Outcome::ResolutionRetried), 1);
    let waiting = retry(&host, &root, 8, "pay-3").expect("not executed");
    assert_eq!(
        (waiting.0, retry_after(&waiting).as_deref()),
        (409, Some("2"))
    );
    host.advance_ms(1_000);
    assert!(tick(&host, &mut root).is_empty(), "the backoff holds");
    host.advance_ms(1_000);
    let second = tick(&host, &mut root);
    assert_eq!(second.len(), 1);
    // No answer at all (a reset): another backoff, twice as long.
    lookup_answers(&host, &mut root, second[0].0, None, b"");
    host.advance_ms(3_000);
    assert!(tick(&host, &mut root).is_empty());
    host.advance_ms(1_000);
    let third = tick(&host, &mut root);
    lookup_answers(&host, &mut root, third[0].0, Some(500), b"");
    assert_eq!(host.counter("pay", Outcome::ResolutionGaveUp), 1);
    // Left unknown, in its permanent form: no Retry-After, never executed.
    let left = retry(&host, &root, 9, "pay-3").expect("not executed");
    assert_eq!((left.0, retry_after(&left)), (409, None));
    host.advance_ms(60_000);
    assert!(tick(&host, &mut root).is_empty(), "no more lookups");
}

#[test]
fn a_lookup_answered_after_the_record_changed_overwrites_nothing() {
    let host = FakeHost::default();
    let mut root = configured_root(&host, RESOLVING, 1);
    payment_timed_out(&host, &root, 7, "pay-4", "alice");
    host.advance_ms(5_000);
    let lookups = tick(&host, &mut root);
    // Meanwhile the record is gone and the key was used afresh: a lookup's late answer must
    // not touch the new claim.
    host.advance_ms(86_400_000);
    let (_second, verdict) = pay(&host, &root, 8, "pay-4", "alice");
    assert_eq!(verdict, Verdict::Continue, "expired: the key runs again");
    lookup_answers(&host, &mut root, lookups[0].0, Some(404), b"");
    assert_eq!(host.counter("pay", Outcome::ResolvedNeverRan), 0);
    let busy = retry(&host, &root, 9, "pay-4").expect("the new claim still holds");
    assert!(
        problem_type(&busy.2).ends_with("request-in-flight"),
        "{:?}",
        busy
    );
}

#[test]
fn without_resolve_an_unknown_outcome_keeps_its_permanent_answer() {
    let host = FakeHost::default();
    let mut root = configured_root(
        &host,
        r#"{"rules":[{"name":"pay","match":{"path_prefixes":["/payments"]}}]}"#,
        1,
    );
    payment_timed_out(&host, &root, 7, "pay-5", "alice");
    host.advance_ms(60_000);
    assert!(tick(&host, &mut root).is_empty());
    let left = retry(&host, &root, 8, "pay-5").expect("not executed");
    assert_eq!((left.0, retry_after(&left)), (409, None));
}

#[test]
fn a_key_the_lookup_cannot_name_is_refused_before_the_write_runs() {
    // "/payments/by-key/.." reaches a service that removes dot segments as "/payments/":
    // its 404 would free the key of a payment that went through, and the retry pay again.
    let host = FakeHost::default();
    let root = configured_root(&host, RESOLVING, 1);
    for (context, key, why) in [
        (7, "..", "would make '..' a segment of the lookup's path"),
        (8, ".", "would make '.' a segment of the lookup's path"),
        (9, "a/..", "holds '/'"),
        (10, "a%2Fb", "holds '%'"),
    ] {
        let _ = host.take_effects();
        let (_journey, verdict) = pay(&host, &root, context, key, "alice");
        assert_ne!(verdict, Verdict::Continue, "key {key:?} went upstream");
        let (status, _, body) = the_reply(&host.take_effects());
        assert_eq!(status, 400, "key {key:?}");
        assert!(
            problem_type(&body).ends_with("unfit-for-lookup"),
            "key {key:?}"
        );
        let detail = String::from_utf8_lossy(&body).into_owned();
        assert!(
            detail.contains("the idempotency key from the header 'idempotency-key'")
                && detail.contains(why),
            "key {key:?}: {detail}"
        );
    }
    assert_eq!(host.counter("pay", Outcome::InvalidKey), 4);
    assert_eq!(host.counter("pay", Outcome::Executed), 0);
    // A dot inside a key is only a dot.
    assert_eq!(retry(&host, &root, 11, "pay.2024-05.1"), None, "it runs");
}

#[test]
fn a_key_in_the_lookups_query_may_hold_anything_a_key_may() {
    let host = FakeHost::default();
    let by_query = RESOLVING.replace("/payments/by-key/{key}", "/payments/lookup?key={key}");
    let mut root = configured_root(&host, &by_query, 1);
    payment_timed_out(&host, &root, 7, "..", "alice");
    host.advance_ms(5_000);
    let lookups = tick(&host, &mut root);
    assert_eq!(lookups[0].2, "/payments/lookup?key=..");
}

mod cluster {
    //! Cluster mode: the store's record is settled for every replica, and a replica that did
    //! not record the unknown outcome keeps no copy of it, so its next retry asks the store.

    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use idempotency_protocol::stream::{decode_call, encode_answer, Answer, Call, CallOp, Reply};

    use super::super::*;
    use crate::fake_host::Effect;
    use crate::outcome::Outcome;
    use crate::root::PluginRoot;
    use crate::who_answered::flag;
    use idempotency_protocol::record::{RecordedResponse, UnknownOutcome};

    const CLUSTER: &str = r#"{"store":{"cluster":"store","timeout_ms":250},
        "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
        "resolve":{"cluster":"orders","path":"/orders/by-key/{key}","settle_seconds":5}}]}"#;

    fn calls(host: &FakeHost) -> Vec<Call> {
        host.take_effects()
            .iter()
            .filter_map(|e| match e {
                Effect::StreamMessage { message, .. } => Some(decode_call(message).unwrap()),
                _ => None,
            })
            .collect()
    }

    fn lookups(host: &FakeHost) -> Vec<u32> {
        host.take_effects()
            .iter()
            .filter_map(|e| match e {
                Effect::Callout { token, cluster, .. } if cluster == "orders" => Some(*token),
                _ => None,
            })
            .collect()
    }

    fn answer(host: &FakeHost, root: &mut PluginRoot, stream: u32, id: u64, reply: Reply) {
        host.effective_context.set(1);
        let message = encode_answer(&Answer { id, reply });
        let size = message.len();
        *host.grpc_message.borrow_mut() = message;
        root.on_grpc_message(host, stream, size);
    }

    pub(super) fn stream_of(effects: &[Effect]) -> u32 {
        effects
            .iter()
            .find_map(|e| match e {
                Effect::StreamOpened { stream, .. } => Some(*stream),
                _ => None,
            })
            .expect("a stream to the store")
    }

    /// A POST of `key` in `context` that asks the store, which answers the key is free (the
    /// claim is this request's).
    fn claimed_by_the_store(
        host: &FakeHost,
        root: &mut PluginRoot,
        stream: u32,
        context: u32,
        key: &str,
    ) -> Rc<std::cell::RefCell<RequestJourney>> {
        let (journey, verdict) = post_in_context(host, root, context, key);
        assert_eq!(verdict, Verdict::Pause, "it asks the store");
        let claim = calls(host).remove(0);
        let CallOp::Claim { owner, .. } = claim.op.clone() else {
            panic!("not a claim: {claim:?}");
        };
        let claimed = Reply::Claimed {
            owner,
            lease_expires_at_ms: 1,
        };
        answer(host, root, stream, claim.id, claimed);
        journey
    }

    /// A POST of `key` whose claim the store confirms and whose route then times out: the
    /// unknown outcome's completion, sent on the stream (its call id and record).
    fn timed_out_in_cluster(
        host: &FakeHost,
        root: &mut PluginRoot,
        stream: u32,
        key: &str,
    ) -> (u64, Vec<u8>) {
        let journey = claimed_by_the_store(host, root, stream, 7, key);
        host.effective_context.set(7);
        envoy_reports(host, "response_timeout", flag::UPSTREAM_REQUEST_TIMEOUT, 1);
        respond(host, &mut journey.borrow_mut(), 504, b"");
        host.effective_context.set(1);
        root.on_queue_ready(host, 1);
        calls(host)
            .into_iter()
            .find_map(|c| match c.op {
                CallOp::Complete { record, .. } => Some((c.id, record)),
                _ => None,
            })
            .expect("the unknown outcome goes to the store")
    }

    /// Under `config` (CLUSTER's rule, maybe with more fields), an unknown outcome resolved
    /// as taken effect: the root, its stream, the unknown outcome sent to the store, and the
    /// settle sent after it with its call id (not answered yet).
    fn settled_as_taken_effect(config: &str) -> (FakeHost, PluginRoot, u32, Vec<u8>, CallOp, u64) {
        let host = FakeHost::default();
        let mut root = configured_root(&host, config, 1);
        let stream = stream_of(&host.take_effects());
        let (complete, unknown) = timed_out_in_cluster(&host, &mut root, stream, "k1");
        answer(&host, &mut root, stream, complete, Reply::Recorded);
        let recorded = RecordedResponse::decode(&unknown).unwrap();
        assert!(
            recorded.unknown.unwrap().resolution_due_ms.is_some(),
            "it says it is resolving"
        );

        host.advance_ms(5_000);
        host.effective_context.set(1);
        root.on_tick(&host);
        let token = lookups(&host)[0];
        host.set_callout_answer(Some(200), br#"{"order":"o-1"}"#);
        root.on_callout_answer(&host, token, 1, 15);
        root.on_queue_ready(&host, 1);
        let (settle, id) = calls(&host)
            .into_iter()
            .find_map(|c| matches!(c.op, CallOp::Settle { .. }).then_some((c.op, c.id)))
            .expect("a settle on the stream");
        (host, root, stream, unknown, settle, id)
    }

    #[test]
    fn the_store_is_settled_with_what_the_service_said() {
        let (host, mut root, stream, unknown, settle, id) = settled_as_taken_effect(CLUSTER);
        let CallOp::Settle {
            current,
            record,
            ttl_ms,
            tombstone_ms,
            ..
        } = settle
        else {
            panic!("not a settle");
        };
        assert_eq!(current, unknown, "only the record it sent is replaced");
        let resolved = RecordedResponse::decode(&record).unwrap();
        assert_eq!(
            (resolved.status, resolved.body.as_slice()),
            (200, &br#"{"order":"o-1"}"#[..])
        );
        assert_eq!((ttl_ms, tombstone_ms), (86_400_000, 0));
        assert_eq!(host.counter("orders", Outcome::ResolvedTookEffect), 0);
        answer(&host, &mut root, stream, id, Reply::Recorded);
        assert_eq!(
            host.counter("orders", Outcome::ResolvedTookEffect),
            1,
            "counted once the store took it"
        );
    }

    #[test]
    fn the_store_keeps_the_rules_tombstone_of_what_the_service_said() {
        let keeps_tombstones = CLUSTER.replace(
            r#""resolve":"#,
            r#""ttl_seconds":60,"tombstone_seconds":300,"resolve":"#,
        );
        let (_, _, _, _, settle, _) = settled_as_taken_effect(&keeps_tombstones);
        assert!(
            matches!(
                settle,
                CallOp::Settle {
                    ttl_ms: 60_000,
                    tombstone_ms: 300_000,
                    ..
                }
            ),
            "kept as the service's answer would be, its tombstone included: {settle:?}"
        );
    }

    /// A root with a stream, and an unknown outcome recorded for `key` (no `resolve`): the
    /// completion carrying it is sent, and answered `Recorded` when `landed`.
    fn unknown_recorded(key: &str, landed: bool) -> (FakeHost, PluginRoot, u32) {
        let host = FakeHost::default();
        let plain = r#"{"store":{"cluster":"store","timeout_ms":250},
            "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]}}]}"#;
        let mut root = configured_root(&host, plain, 1);
        let stream = stream_of(&host.take_effects());
        let (complete, _) = timed_out_in_cluster(&host, &mut root, stream, key);
        if landed {
            answer(&host, &mut root, stream, complete, Reply::Recorded);
        }
        (host, root, stream)
    }

    /// A retry of `key` here finds its local unknown outcome and asks the store, which
    /// answers the key is free; returns the retry's verdict and local replies.
    fn retry_when_the_store_is_free(
        host: &FakeHost,
        root: &mut PluginRoot,
        stream: u32,
        key: &str,
    ) -> (
        Rc<std::cell::RefCell<RequestJourney>>,
        Vec<super::super::Reply>,
    ) {
        let journey = claimed_by_the_store(host, root, stream, 9, key);
        (journey, replies(&host.take_effects()))
    }

    /// A retry of `key` here, the key free in the store, runs the write.
    fn the_retry_runs_when_the_store_is_free(
        host: &FakeHost,
        root: &mut PluginRoot,
        stream: u32,
        key: &str,
    ) {
        let (journey, replies) = retry_when_the_store_is_free(host, root, stream, key);
        assert!(replies.is_empty(), "{replies:?}");
        assert!(
            is_executing(&journey.borrow()),
            "the store freed it: it runs"
        );
    }

    #[test]
    fn a_key_an_operator_freed_in_the_store_runs_again_here_too() {
        let (host, mut root, stream) = unknown_recorded("k3", true);
        the_retry_runs_when_the_store_is_free(&host, &mut root, stream, "k3");
    }

    /// The host lands the unknown outcome's completion the moment it is handed off (a native
    /// main thread may, on its own thread, before the submitting hook goes on): its mark
    /// must find the local record already written, or it marks nothing and this proxy's
    /// retries answer 409 after an operator freed the key, until the recording worker takes
    /// its own answer (on an idle native worker, never).
    #[test]
    fn a_completion_landed_as_it_is_handed_off_marks_the_record_as_the_stores() {
        let host = FakeHost::default();
        host.lands_handoffs_at_once.set(true);
        let plain = r#"{"store":{"cluster":"store","timeout_ms":250},
            "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]}}]}"#;
        let mut root = configured_root(&host, plain, 1);
        let stream = stream_of(&host.take_effects());
        let _ = timed_out_in_cluster(&host, &mut root, stream, "k9");
        // Its own answer never taken; an operator frees the key in the store.
        the_retry_runs_when_the_store_is_free(&host, &mut root, stream, "k9");
    }

    /// The recording worker never takes its completion's answer (idle, native build); the
    /// resolution's lookup settles nothing and its move of the store's record to the next
    /// lookup's time is applied, which proves the store held this proxy's record (a resend
    /// of the first completion would now be refused: the store holds the moved one). After
    /// an operator frees the key, a retry here runs the write, as on every other proxy.
    #[test]
    fn a_move_the_store_applied_marks_the_record_as_the_stores() {
        let host = FakeHost::default();
        let mut root = configured_root(&host, CLUSTER, 1);
        let stream = stream_of(&host.take_effects());
        let _ = timed_out_in_cluster(&host, &mut root, stream, "k8");
        host.advance_ms(5_000);
        host.effective_context.set(1);
        root.on_tick(&host);
        let token = lookups(&host)[0];
        host.set_callout_answer(Some(503), b"");
        root.on_callout_answer(&host, token, 1, 0);
        root.on_queue_ready(&host, 1);
        let (to, settle) = host
            .take_effects()
            .iter()
            .find_map(|e| match e {
                Effect::StreamMessage {
                    stream, message, ..
                } => {
                    let call = decode_call(message).unwrap();
                    matches!(call.op, CallOp::Settle { .. }).then_some((*stream, call))
                }
                _ => None,
            })
            .expect("the move goes to the store");
        answer(&host, &mut root, to, settle.id, Reply::Recorded);
        host.effective_context.set(1);
        root.on_tick(&host);
        let _ = host.take_effects();
        the_retry_runs_when_the_store_is_free(&host, &mut root, to, "k8");
    }

    #[test]
    fn a_key_whose_unknown_outcome_has_not_reached_the_store_is_never_run_again() {
        let (host, mut root, stream) = unknown_recorded("k4", false);
        let (journey, replies) = retry_when_the_store_is_free(&host, &mut root, stream, "k4");
        assert!(!is_executing(&journey.borrow()));
        let (status, _, body) = replies.into_iter().next().expect("answered");
        assert_eq!(status, 409);
        assert!(problem_type(&body).ends_with("outcome-unknown"));
    }

    /// A retry here meets, in the store, an unknown outcome whose resolution was due
    /// `overdue_ms` ago; returns the record as the store holds it.
    fn met_in_the_store(
        host: &FakeHost,
        root: &mut PluginRoot,
        key: &str,
        overdue_ms: u64,
    ) -> Vec<u8> {
        let stream = 1;
        let pending = RecordedResponse::unknown_outcome(UnknownOutcome {
            resolution_due_ms: Some(host.clock_ms.get() - overdue_ms),
            ..UnknownOutcome::default()
        })
        .encode();
        let (_journey, _) = post_in_context(host, root, 7, key);
        let claim = calls(host).remove(0);
        answer(
            host,
            root,
            stream,
            claim.id,
            Reply::Completed {
                record: pending.clone(),
            },
        );
        let (status, _, _) = the_reply(&host.take_effects());
        assert_eq!(status, 409);
        pending
    }

    #[test]
    fn an_overdue_resolution_is_taken_on_by_the_replica_a_retry_reaches() {
        let host = FakeHost::default();
        let mut root = configured_root(&host, CLUSTER, 1);
        assert_eq!(stream_of(&host.take_effects()), 1);
        // Due 2 s ago: the proxy resolving it may still be asking (its lookup times out after
        // 2 s); nobody else asks yet.
        met_in_the_store(&host, &mut root, "k6", 2_000);
        host.effective_context.set(1);
        root.on_tick(&host);
        assert!(lookups(&host).is_empty(), "not overdue yet");
        // Due 8 s ago and still unsettled: this replica asks, with the retry's own lookup.
        let pending = met_in_the_store(&host, &mut root, "k5", 8_000);
        // Another retry meanwhile does not start a second resolution of the same key.
        met_in_the_store(&host, &mut root, "k5", 8_000);
        host.effective_context.set(1);
        root.on_tick(&host);
        // It first claims the resolution: the store's record, due now, if the store still
        // holds the one the retry met.
        let settles = |host: &FakeHost| {
            calls(host)
                .into_iter()
                .find_map(|c| match c.op {
                    CallOp::Settle {
                        current, record, ..
                    } => Some((c.id, current, record)),
                    _ => None,
                })
                .expect("a settle on the stream")
        };
        let (id, current, claimed) = settles(&host);
        assert_eq!(current, pending, "claimed from the record the retry met");
        answer(&host, &mut root, 1, id, Reply::Recorded);
        let sent = lookups(&host);
        assert_eq!(sent.len(), 1, "one resolution per key");
        let token = sent[0];
        host.set_callout_answer(Some(404), b"");
        root.on_callout_answer(&host, token, 1, 0);
        root.on_queue_ready(&host, 1);
        let (id, current, record) = settles(&host);
        assert_eq!(
            (current, record),
            (claimed, Vec::new()),
            "the record it claimed, freed"
        );
        answer(&host, &mut root, 1, id, Reply::Released);
        assert_eq!(host.counter("orders", Outcome::ResolvedNeverRan), 1);
    }

    #[test]
    fn a_retry_cannot_choose_which_write_a_replica_taking_it_on_looks_up() {
        // x-tenant names the write at the service but not the record here: a retry of the same
        // key with another tenant would meet the record, take its resolution on, look up the
        // other tenant's write, get 404 and free a key whose payment went through.
        let host = FakeHost::default();
        let steerable = CLUSTER.replace(
            "/orders/by-key/{key}",
            "/tenants/{header.x-tenant}/orders/by-key/{key}",
        );
        let refused = match crate::plugin::Plugin::configure(&host, steerable.as_bytes()) {
            Ok(_) => panic!("a lookup a retry can steer was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(
            refused.contains("resolve.path")
                && refused.contains("'x-tenant' is not one of the rule's scope_headers"),
            "{refused}"
        );
        // In the scope, the tenant is part of the record's name: another tenant's retry is
        // another record, and one that meets this record carries this record's tenant.
        let scoped = steerable.replace(
            r#""name":"orders","#,
            r#""name":"orders","scope_headers":[":authority","x-tenant"],"#,
        );
        let mut root = configured_root(&host, &scoped, 1);
        let stream = stream_of(&host.take_effects());
        let mut claimed_keys = Vec::new();
        for (context, tenant) in [(7, "acme"), (8, "globex"), (9, "acme")] {
            let mut headers = post_headers("/orders", Some("k7"));
            headers.push(("x-tenant", tenant));
            let (_journey, verdict) =
                request_in_context(&host, &root, context, &headers, br#"{"n":1}"#);
            assert_eq!(verdict, Verdict::Pause, "it asks the store");
            let claim = calls(&host).remove(0);
            let CallOp::Claim { key, .. } = claim.op else {
                panic!("not a claim: {claim:?}");
            };
            claimed_keys.push(key);
            let busy = Reply::InFlight { retry_after_ms: 1 };
            answer(&host, &mut root, stream, claim.id, busy);
        }
        assert_ne!(
            claimed_keys[0], claimed_keys[1],
            "another tenant, another record"
        );
        assert_eq!(claimed_keys[0], claimed_keys[2]);
    }

    #[test]
    fn another_replicas_unknown_outcome_is_not_kept_here() {
        let host = FakeHost::default();
        let mut root = configured_root(&host, CLUSTER, 1);
        let stream = stream_of(&host.take_effects());
        let pending = RecordedResponse::unknown_outcome(UnknownOutcome {
            resolution_due_ms: Some(host.clock_ms.get() + 3_000),
            ..UnknownOutcome::default()
        });
        for attempt in 0..2 {
            let (_journey, verdict) = post_in_context(&host, &root, 7 + attempt, "k2");
            assert_eq!(verdict, Verdict::Pause, "attempt {attempt} asks the store");
            let claim = calls(&host).remove(0);
            assert!(matches!(claim.op, CallOp::Claim { .. }));
            answer(
                &host,
                &mut root,
                stream,
                claim.id,
                Reply::Completed {
                    record: pending.encode(),
                },
            );
            let (status, headers, _) = the_reply(&host.take_effects());
            assert_eq!(status, 409);
            assert_eq!(header(&headers, "retry-after"), Some(&b"3"[..]));
        }
    }
}

mod adoption {
    //! Cluster mode with more than one proxy able to resolve a key: the store's record is the
    //! lease on its resolution, so one proxy at a time asks the service, the proxy resolving
    //! it keeps it while it lives, and only what the store took is kept and counted. Each
    //! `Replica` is an Envoy (its own host: shared table, clock, counters) with one or more
    //! workers (a root each, with its stream); `Store` answers their calls as every backend
    //! does.

    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use std::cell::{Cell, RefCell};
    use std::collections::{HashMap, VecDeque};

    use idempotency_protocol::record::RecordedResponse;
    use idempotency_protocol::stream::{
        decode_call, encode_answer, Answer, Call, CallOp, FailureKind, Reply as StoreReply,
    };

    use super::super::*;
    use crate::fake_host::Effect;
    use crate::outcome::Outcome;
    use crate::root::PluginRoot;
    use crate::who_answered::flag;

    /// Settle time 5 s, lookups time out after 2 s: another proxy may take an unresolved key
    /// on 7 s past its due time. Backoff 2 s, doubling.
    fn config(max_attempts: u32) -> String {
        format!(
            r#"{{"store":{{"cluster":"store","timeout_ms":250}},
            "rules":[{{"name":"orders","match":{{"path_prefixes":["/orders"]}},
            "resolve":{{"cluster":"orders","path":"/orders/by-key/{{key}}","settle_seconds":5,
            "max_attempts":{max_attempts}}}}}]}}"#
        )
    }

    enum Kept {
        InFlight,
        Completed(Vec<u8>),
    }

    /// One key's record as every backend keeps it (`crates/idempotency-store/tests/contract.rs`):
    /// a claim takes a free key, a completion records, and a settle replaces or removes the
    /// record only while it holds exactly the settle's `current`.
    #[derive(Default)]
    struct Store {
        records: RefCell<HashMap<String, Kept>>,
    }

    impl Store {
        fn answer(&self, op: &CallOp) -> StoreReply {
            let mut records = self.records.borrow_mut();
            match op {
                CallOp::Claim { key, owner, .. } => match records.get(key) {
                    Some(Kept::Completed(record)) => StoreReply::Completed {
                        record: record.clone(),
                    },
                    Some(Kept::InFlight) => StoreReply::InFlight {
                        retry_after_ms: 1_000,
                    },
                    None => {
                        records.insert(key.clone(), Kept::InFlight);
                        StoreReply::Claimed {
                            owner: owner.clone(),
                            lease_expires_at_ms: 1,
                        }
                    }
                },
                CallOp::Complete { key, record, .. } => {
                    records.insert(key.clone(), Kept::Completed(record.clone()));
                    StoreReply::Recorded
                }
                CallOp::Settle {
                    key,
                    current,
                    record,
                    ..
                } => match records.get(key) {
                    Some(Kept::Completed(held)) if held == current => {
                        if record.is_empty() {
                            records.remove(key);
                            StoreReply::Released
                        } else {
                            records.insert(key.clone(), Kept::Completed(record.clone()));
                            StoreReply::Recorded
                        }
                    }
                    _ => StoreReply::NotOwner,
                },
                CallOp::Release { key, .. } => {
                    records.remove(key);
                    StoreReply::Released
                }
                CallOp::Renew { .. } => StoreReply::Renewed { lost: Vec::new() },
                CallOp::Wait { .. } | CallOp::Lookup { .. } => StoreReply::Failure {
                    kind: FailureKind::BadRequest,
                    detail: "not part of these tests".into(),
                },
            }
        }

        /// The record of the only key, decoded.
        fn record(&self) -> Option<RecordedResponse> {
            self.records.borrow().values().find_map(|kept| match kept {
                Kept::Completed(record) => RecordedResponse::decode(record),
                Kept::InFlight => None,
            })
        }

        /// When the store says the only key's resolution is due.
        fn due_ms(&self) -> Option<u64> {
            self.record()
                .and_then(|r| r.unknown)
                .and_then(|u| u.resolution_due_ms)
        }

        /// An operator frees every key (`record resolve` as never run).
        fn operator_frees(&self) {
            self.records.borrow_mut().clear();
        }
    }

    struct Worker {
        root: RefCell<PluginRoot>,
        root_id: u32,
        /// Its stream to the store (a new one once it gave the last up).
        stream: Cell<u32>,
    }

    /// What a replica did: the lookups each worker sent (worker, callout token) and the
    /// local replies.
    #[derive(Default)]
    struct Seen {
        lookups: Vec<(usize, u32)>,
        replies: Vec<Reply>,
    }

    impl Seen {
        fn reply(&self) -> &Reply {
            assert_eq!(self.replies.len(), 1, "one reply expected");
            &self.replies[0]
        }
    }

    /// A call to the store: the worker and stream it came from.
    type Sent = (usize, u32, Call);

    /// One Envoy.
    struct Replica {
        host: FakeHost,
        workers: Vec<Worker>,
        /// Cut off from the store: calls wait in `unsent` until `reconnect`.
        cut_off: Cell<bool>,
        unsent: RefCell<Vec<Sent>>,
        journeys: RefCell<Vec<Rc<std::cell::RefCell<RequestJourney>>>>,
        next_context: Cell<u32>,
    }

    impl Replica {
        fn new(config: &str, workers: u32) -> Replica {
            let host = FakeHost::default();
            let workers = (1..=workers)
                .map(|root_id| {
                    let root = configured_root(&host, config, root_id);
                    let stream = super::cluster::stream_of(&host.take_effects());
                    Worker {
                        root: RefCell::new(root),
                        root_id,
                        stream: Cell::new(stream),
                    }
                })
                .collect();
            Replica {
                host,
                workers,
                cut_off: Cell::new(false),
                unsent: RefCell::default(),
                journeys: RefCell::default(),
                next_context: Cell::new(100),
            }
        }

        /// Takes the host's effects as `worker`'s: calls to the store are queued for it (or
        /// held while cut off), lookups and replies are noted.
        fn collect(&self, worker: usize, seen: &mut Seen, calls: &mut VecDeque<Sent>) {
            for effect in self.host.take_effects() {
                match effect {
                    Effect::StreamOpened { stream, .. } => self.workers[worker].stream.set(stream),
                    Effect::StreamMessage {
                        stream, message, ..
                    } => {
                        let to = self
                            .workers
                            .iter()
                            .position(|w| w.stream.get() == stream)
                            .expect("a worker's stream");
                        let call = decode_call(&message).unwrap();
                        if self.cut_off.get() {
                            self.unsent.borrow_mut().push((to, stream, call));
                        } else {
                            calls.push_back((to, stream, call));
                        }
                    }
                    Effect::Callout { token, cluster, .. } if cluster == "orders" => {
                        seen.lookups.push((worker, token))
                    }
                    Effect::LocalReply {
                        status,
                        headers,
                        body,
                    } => seen.replies.push((status, headers, body)),
                    _ => {}
                }
            }
        }

        /// Lets `worker`'s effects (and what the store's answers set off) run their course.
        fn pump(&self, store: &Store, worker: usize) -> Seen {
            let mut seen = Seen::default();
            let mut calls = VecDeque::new();
            self.collect(worker, &mut seen, &mut calls);
            loop {
                for (index, w) in self.workers.iter().enumerate() {
                    self.host.effective_context.set(w.root_id);
                    w.root.borrow().on_queue_ready(&self.host, w.root_id);
                    self.collect(index, &mut seen, &mut calls);
                }
                let Some(sent) = calls.pop_front() else {
                    return seen;
                };
                let to = sent.0;
                self.answer(store, sent);
                self.collect(to, &mut seen, &mut calls);
            }
        }

        /// The store answers a call on the stream it came on.
        fn answer(&self, store: &Store, (to, stream, call): Sent) {
            let w = &self.workers[to];
            let reply = store.answer(&call.op);
            let message = encode_answer(&Answer { id: call.id, reply });
            let size = message.len();
            *self.host.grpc_message.borrow_mut() = message;
            self.host.effective_context.set(w.root_id);
            w.root
                .borrow_mut()
                .on_grpc_message(&self.host, stream, size);
        }

        fn tick(&self, store: &Store, worker: usize) -> Seen {
            let w = &self.workers[worker];
            self.host.effective_context.set(w.root_id);
            w.root.borrow_mut().on_tick(&self.host);
            self.pump(store, worker)
        }

        /// Every worker's tick; the lookups they sent.
        fn tick_all(&self, store: &Store) -> Vec<(usize, u32)> {
            (0..self.workers.len())
                .flat_map(|w| self.tick(store, w).lookups)
                .collect()
        }

        /// A POST of `key` through `worker`, as far as it goes without the upstream.
        fn post(&self, store: &Store, worker: usize, key: &str) -> Seen {
            let context = self.next_context.get();
            self.next_context.set(context + 1);
            let root = self.workers[worker].root.borrow();
            let (journey, _) = post_in_context(&self.host, &root, context, key);
            drop(root);
            self.journeys.borrow_mut().push(journey);
            self.pump(store, worker)
        }

        /// The first attempt of `key`: the store gives it the key, and Envoy's route times
        /// out after the write reached the service: an unknown outcome, in the store.
        fn timed_out(&self, store: &Store, worker: usize, key: &str) {
            let seen = self.post(store, worker, key);
            assert!(seen.replies.is_empty(), "the first attempt goes upstream");
            let journey = self.journeys.borrow().last().cloned().unwrap();
            self.host.effective_context.set(self.next_context.get() - 1);
            envoy_reports(
                &self.host,
                "response_timeout",
                flag::UPSTREAM_REQUEST_TIMEOUT,
                1,
            );
            respond(&self.host, &mut journey.borrow_mut(), 504, b"");
            self.pump(store, worker);
            assert!(
                store.due_ms().is_some(),
                "the unknown outcome is in the store"
            );
        }

        /// The service answers the lookup `token` of `worker` with `status` and `body`.
        fn lookup_answers(
            &self,
            store: &Store,
            (worker, token): (usize, u32),
            status: u16,
            body: &[u8],
        ) -> Seen {
            let w = &self.workers[worker];
            self.host.set_callout_answer(Some(status), body);
            self.host.effective_context.set(w.root_id);
            w.root
                .borrow_mut()
                .on_callout_answer(&self.host, token, 1, body.len());
            self.pump(store, worker)
        }

        /// The calls held while cut off reach the store now.
        fn reconnect(&self, store: &Store) {
            self.cut_off.set(false);
            let unsent = std::mem::take(&mut *self.unsent.borrow_mut());
            for sent in unsent {
                let to = sent.0;
                self.answer(store, sent);
                self.pump(store, to);
            }
        }

        fn count(&self, outcome: Outcome) -> u64 {
            self.host.counter("orders", outcome)
        }
    }

    fn advance(replicas: &[&Replica], ms: u64) {
        for replica in replicas {
            replica.host.advance_ms(ms);
        }
    }

    fn retry_after(reply: &Reply) -> Option<u64> {
        header(&reply.1, "retry-after").map(|v| String::from_utf8_lossy(v).parse().unwrap())
    }

    /// The proxy that recorded the unknown outcome is gone; overdue retries reach both
    /// workers of two other replicas at once: one of them takes the resolution on, and the
    /// service sees one lookup at a time until the key settles.
    #[test]
    fn overdue_retries_on_every_worker_of_every_replica_make_one_resolution_at_a_time() {
        let store = Store::default();
        let first = Replica::new(&config(8), 1);
        first.timed_out(&store, 0, "k1");
        drop(first); // the Envoy that recorded it dies
        let replicas = [Replica::new(&config(8), 2), Replica::new(&config(8), 2)];
        let all: Vec<&Replica> = replicas.iter().collect();
        advance(&all, 5_000 + 7_000 + 1_000);

        let mut asking: Vec<(usize, usize, u32)> = Vec::new(); // replica, worker, token
        let mut lookups = 0;
        let mut resolvers = Vec::new();
        for second in 0..20 {
            for (r, replica) in replicas.iter().enumerate() {
                for worker in 0..2 {
                    let seen = replica.post(&store, worker, "k1");
                    let (status, _, body) = seen.reply();
                    if asking.is_empty() && lookups == 3 {
                        continue; // resolved: the replay is checked below
                    }
                    assert_eq!(*status, 409, "second {second}");
                    assert!(problem_type(body).ends_with("outcome-unknown"));
                }
                for (worker, token) in replica.tick_all(&store) {
                    asking.push((r, worker, token));
                    lookups += 1;
                    resolvers.push((r, worker));
                }
            }
            assert!(asking.len() <= 1, "lookups at once: {asking:?}");
            if let Some((r, worker, token)) = asking.pop() {
                // The service fails twice, then knows the order.
                let (status, body) = if lookups < 3 {
                    (503, &b""[..])
                } else {
                    (200, &br#"{"order":"o-1"}"#[..])
                };
                replicas[r].lookup_answers(&store, (worker, token), status, body);
            }
            advance(&all, 1_000);
        }
        assert_eq!(lookups, 3, "one resolver's three lookups: {resolvers:?}");
        resolvers.dedup();
        assert_eq!(resolvers.len(), 1, "one resolver: {resolvers:?}");
        let resolved: u64 = replicas
            .iter()
            .map(|r| r.count(Outcome::ResolvedTookEffect))
            .sum();
        assert_eq!(resolved, 1);
        for replica in &replicas {
            for worker in 0..2 {
                let seen = replica.post(&store, worker, "k1");
                let (status, headers, body) = seen.reply();
                assert_eq!(
                    (*status, body.as_slice()),
                    (200, &br#"{"order":"o-1"}"#[..])
                );
                assert_eq!(header(headers, "idempotent-resolved"), Some(&b"true"[..]));
            }
        }
    }

    /// While the proxy that recorded the unknown outcome keeps asking (the service fails),
    /// the store's record says when it asks next, so retries through another replica are
    /// told so, and that replica never takes the resolution on.
    #[test]
    fn the_first_proxys_failing_lookups_keep_the_resolution_its_own() {
        let store = Store::default();
        let first = Replica::new(&config(8), 1);
        let other = Replica::new(&config(8), 2);
        let both = [&first, &other];
        first.timed_out(&store, 0, "k2");
        let due = store.due_ms().unwrap();
        advance(&both, 5_000);
        let mut first_lookups = 0;
        // Lookups at due, due + 2 s, + 6 s, + 14 s, + 30 s: each fails.
        for _ in 0..40 {
            for lookup in first.tick_all(&store) {
                first_lookups += 1;
                first.lookup_answers(&store, lookup, 503, b"");
            }
            for worker in 0..2 {
                let seen = other.post(&store, worker, "k2");
                let reply = seen.reply();
                assert_eq!(reply.0, 409);
                // Told when the next lookup goes (or, once it is due, the first backoff).
                let next = store.due_ms().unwrap();
                let now = other.host.clock_ms.get();
                let expected = if next > now {
                    (next - now).div_ceil(1000)
                } else {
                    2
                };
                assert_eq!(retry_after(reply), Some(expected));
            }
            assert!(
                other.tick_all(&store).is_empty(),
                "another replica asked while the first proxy still resolves it"
            );
            advance(&both, 1_000);
        }
        assert_eq!(first_lookups, 5);
        assert_eq!(store.due_ms(), Some(due + 30_000 + 32_000));
        assert_eq!(first.count(Outcome::ResolutionRetried), 5);
    }

    /// The first proxy loses the store while it resolves (its settles cannot land), so
    /// another replica takes the resolution on; the first proxy's lookups stop, and when
    /// its store link comes back its late give-up changes nothing: the other replica's
    /// later success is what every retry gets.
    #[test]
    fn an_adopters_later_success_is_kept_when_the_first_proxy_returns() {
        let store = Store::default();
        let first = Replica::new(&config(2), 1);
        let other = Replica::new(&config(2), 1);
        let both = [&first, &other];
        first.timed_out(&store, 0, "k3");
        advance(&both, 5_000);
        let lookup = first.tick_all(&store)[0];
        first.cut_off.set(true);
        first.lookup_answers(&store, lookup, 503, b"");
        // The first proxy goes on failing without the store (it gives up, before the fix).
        let mut first_lookups = 1;
        for _ in 0..8 {
            advance(&both, 1_000);
            for lookup in first.tick_all(&store) {
                first_lookups += 1;
                first.lookup_answers(&store, lookup, 503, b"");
            }
        }
        // 13 s past the due time: overdue; the other replica's retry takes it on.
        assert_eq!(other.post(&store, 0, "k3").reply().0, 409);
        let taken = other.tick_all(&store);
        assert_eq!(taken.len(), 1, "the other replica asks");
        first.reconnect(&store);
        for _ in 0..5 {
            advance(&both, 1_000);
            for lookup in first.tick_all(&store) {
                first_lookups += 1;
                first.lookup_answers(&store, lookup, 503, b"");
            }
        }
        other.lookup_answers(&store, taken[0], 200, br#"{"order":"o-3"}"#);
        for replica in both {
            let seen = replica.post(&store, 0, "k3");
            let (status, headers, body) = seen.reply();
            assert_eq!(
                (*status, body.as_slice()),
                (200, &br#"{"order":"o-3"}"#[..]),
                "the later success was lost"
            );
            assert_eq!(header(headers, "idempotent-resolved"), Some(&b"true"[..]));
        }
        assert_eq!(other.count(Outcome::ResolvedTookEffect), 1);
        assert_eq!(first.count(Outcome::ResolvedTookEffect), 0);
        assert_eq!(first.count(Outcome::ResolutionGaveUp), 0);
        assert_eq!(
            first_lookups, 1,
            "the first proxy asked again without the store"
        );
    }

    /// A lookup's answer counts, and is kept here, only once the store took it: settled
    /// meanwhile by an operator (as never run), the key is the operator's.
    #[test]
    fn a_resolution_counts_only_what_the_store_took() {
        let store = Store::default();
        let first = Replica::new(&config(8), 1);
        first.timed_out(&store, 0, "k4");
        advance(&[&first], 5_000);
        let lookup = first.tick_all(&store)[0];
        first.cut_off.set(true);
        first.lookup_answers(&store, lookup, 200, br#"{"order":"o-4"}"#);
        assert_eq!(
            first.count(Outcome::ResolvedTookEffect),
            0,
            "counted before the store answered"
        );
        store.operator_frees();
        first.reconnect(&store);
        // A settle answered not_owner is asked again a few times (its record may not have
        // reached the store yet).
        for _ in 0..5 {
            advance(&[&first], 1_000);
            first.tick_all(&store);
        }
        assert_eq!(first.count(Outcome::ResolvedTookEffect), 0);
        assert_eq!(first.count(Outcome::ResolvedNeverRan), 0);
        let seen = first.post(&store, 0, "k4");
        assert!(
            seen.replies.is_empty(),
            "the store freed the key, so the retry runs: {:?}",
            seen.replies
        );
    }

    /// The HTTP transport: the store's answers to a resolution's settles come back from
    /// callouts. A `409` (an operator settled the key meanwhile) counts nothing and keeps
    /// nothing here; a `200` counts, and this proxy's next retry replays without asking.
    #[test]
    fn over_http_a_resolution_counts_only_what_the_store_took() {
        let config = r#"{"store":{"cluster":"store","transport":"http"},
            "rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
            "resolve":{"cluster":"orders","path":"/orders/by-key/{key}","settle_seconds":5}}]}"#;
        for (answer, counted) in [(409, 0), (200, 1)] {
            let host = FakeHost::default();
            let mut root = configured_root(&host, config, 1);
            // (token, cluster, path) of each callout
            let callouts = |host: &FakeHost| -> Vec<(u32, String, String)> {
                host.take_effects()
                    .into_iter()
                    .filter_map(|e| match e {
                        Effect::Callout {
                            token,
                            cluster,
                            path,
                            ..
                        } => Some((token, cluster, path)),
                        _ => None,
                    })
                    .collect()
            };
            let store_answers = |root: &mut PluginRoot, token, status, body: &str| {
                host.set_callout_answer(Some(status), body.as_bytes());
                host.effective_context.set(1);
                root.on_callout_answer(&host, token, 1, body.len());
            };
            let _ = host.take_effects();
            let (journey, _) = post_in_context(&host, &root, 7, "k5");
            let (claim, _, path) = callouts(&host).remove(0);
            assert_eq!(path, "/v1/claim");
            let claimed = r#"{"outcome":"claimed","owner":"first"}"#;
            host.set_callout_answer(Some(200), claimed.as_bytes());
            let mut first = journey.borrow_mut();
            first.on(
                &host,
                Event::CalloutAnswer {
                    token: claim,
                    num_headers: 1,
                    body_size: claimed.len(),
                },
            );
            envoy_reports(&host, "response_timeout", flag::UPSTREAM_REQUEST_TIMEOUT, 1);
            respond(&host, &mut first, 504, b"");
            drop(first);
            host.effective_context.set(1);
            root.on_queue_ready(&host, 1);
            let (complete, _, path) = callouts(&host).remove(0);
            assert_eq!(path, "/v1/complete");
            store_answers(&mut root, complete, 200, r#"{"outcome":"completed"}"#);

            host.advance_ms(5_000);
            host.effective_context.set(1);
            root.on_tick(&host);
            let (lookup, cluster, _) = callouts(&host).remove(0);
            assert_eq!(cluster, "orders");
            let body = r#"{"order":"o-5"}"#;
            store_answers(&mut root, lookup, 200, body);
            root.on_queue_ready(&host, 1);
            let mut settles = 0;
            for _ in 0..10 {
                for (token, _, path) in callouts(&host) {
                    assert_eq!(path, "/v1/settle");
                    assert_eq!(host.counter("orders", Outcome::ResolvedTookEffect), 0);
                    settles += 1;
                    let said = if answer == 200 {
                        r#"{"outcome":"replaced"}"#
                    } else {
                        r#"{"type":"not-owner"}"#
                    };
                    store_answers(&mut root, token, answer, said);
                }
                host.advance_ms(1_000);
                host.effective_context.set(1);
                root.on_tick(&host);
            }
            assert!(settles >= 1);
            assert_eq!(
                host.counter("orders", Outcome::ResolvedTookEffect),
                counted,
                "store answered {answer}"
            );
            let (_, verdict) = post_in_context(&host, &root, 8, "k5");
            let effects = host.take_effects();
            if counted == 1 {
                assert_eq!(the_reply(&effects).2, body.as_bytes(), "replayed here");
            } else {
                assert_eq!(verdict, Verdict::Pause, "the store is asked, not this copy");
                assert!(replies(&effects).is_empty(), "{effects:?}");
            }
        }
    }

    /// An unknown outcome recorded by worker 0 whose completion has not reached the store (its
    /// link is down), whose store claim lapsed, and whose local page is gone (reused by newer
    /// responses; here: removed). A retry on worker 1 meets the "awaiting the store" mark and a
    /// free key: it answers 409 and sends on what it can, which must still say it is to be
    /// resolved: worker 0 can no longer settle it (its bytes differ), so only a retry's
    /// replica taking it on once overdue can. (Found by review: the blank record sent on
    /// before had no due time, and the key answered 409 for its whole TTL although the
    /// service knew the write took effect.)
    #[test]
    fn an_unlanded_record_whose_page_is_gone_is_sent_on_still_to_be_resolved() {
        let store = Store::default();
        let replica = Replica::new(&config(8), 2);
        let other = Replica::new(&config(8), 1);
        let seen = replica.post(&store, 0, "k9");
        assert!(seen.replies.is_empty(), "the first attempt goes upstream");
        // Worker 0 loses the store; the route times out: an unknown outcome, kept locally.
        replica.cut_off.set(true);
        let journey = replica.journeys.borrow().last().cloned().unwrap();
        replica
            .host
            .effective_context
            .set(replica.next_context.get() - 1);
        envoy_reports(
            &replica.host,
            "response_timeout",
            flag::UPSTREAM_REQUEST_TIMEOUT,
            1,
        );
        respond(&replica.host, &mut journey.borrow_mut(), 504, b"");
        replica.pump(&store, 0);
        let held_back = std::mem::take(&mut *replica.unsent.borrow_mut());
        assert!(!held_back.is_empty(), "worker 0's completion waits");
        replica.cut_off.set(false);
        // The store's claim lapsed in the outage; worker 0's page was reused meanwhile.
        store.operator_frees();
        replica
            .host
            .shared
            .map
            .borrow_mut()
            .retain(|k, _| !k.contains("/r/"));

        // A retry on worker 1: never run (the mark holds), the record sent on.
        let seen = replica.post(&store, 1, "k9");
        assert_eq!(seen.reply().0, 409, "the write ran again");
        assert_eq!(replica.count(Outcome::Executed), 1);
        let sent_on = store.record().expect("the retry sent the record on");
        let unknown = sent_on.unknown.expect("an unknown outcome");
        assert!(
            unknown.resolution_due_ms.is_some(),
            "sent on without a due time: nobody would ever resolve it"
        );

        // Worker 0 asks at its due time, but its settle names bytes the store no longer holds.
        advance(&[&replica, &other], 5_000);
        for lookup in replica.tick_all(&store) {
            replica.lookup_answers(&store, lookup, 200, br#"{"order":"o-9"}"#);
        }
        // Once overdue in the store, a retry's replica takes it on and settles it.
        advance(&[&replica, &other], 6_000);
        assert_eq!(other.post(&store, 0, "k9").reply().0, 409);
        let taken = other.tick_all(&store);
        assert_eq!(taken.len(), 1, "the other replica asks");
        other.lookup_answers(&store, taken[0], 200, br#"{"order":"o-9"}"#);
        let seen = other.post(&store, 0, "k9");
        assert_eq!(
            seen.reply().0,
            200,
            "the key stays unknown though the service answered"
        );
        assert_eq!(
            replica.count(Outcome::Executed) + other.count(Outcome::Executed),
            1
        );
    }
}

/// The native build: a worker's root hands its resolutions to a root of the same
/// configuration on Envoy's main thread, which runs whether or not the worker has requests.
#[test]
fn a_worker_that_resolves_elsewhere_carries_its_resolution_to_the_root_that_asks() {
    let host = FakeHost::default();
    let worker = configured_root(&host, RESOLVING, 1);
    worker.resolve_elsewhere();
    let mut main = configured_root(&host, RESOLVING, 2);
    payment_timed_out(&host, &worker, 7, "pay-c", "alice");
    assert!(worker.has_resolutions_to_carry());
    let carried = worker.resolutions_to_carry();
    assert_eq!(carried.len(), 1);
    assert!(!worker.has_resolutions_to_carry(), "carried once");
    host.effective_context.set(2);
    main.take_resolutions(&host, carried);

    let mut worker = worker;
    host.advance_ms(5_000);
    assert!(
        tick(&host, &mut worker).is_empty(),
        "the worker does not ask about what it handed on"
    );
    let lookups = tick(&host, &mut main);
    assert_eq!(lookups.len(), 1, "the root it went to asks");
    assert_eq!(lookups[0].2, "/payments/by-key/pay-c");
    lookup_answers(
        &host,
        &mut main,
        lookups[0].0,
        Some(200),
        br#"{"id":"pay_c"}"#,
    );
    assert_eq!(host.counter("pay", Outcome::ResolvedTookEffect), 1);
    let replay = retry(&host, &worker, 8, "pay-c").expect("replayed on the worker");
    assert_eq!(
        (replay.0, replay.2.as_slice()),
        (200, &br#"{"id":"pay_c"}"#[..])
    );
}

/// What the other root cannot match to a rule of its own is dropped, never resolved under
/// another rule's settings.
#[test]
fn a_carried_resolution_for_a_rule_the_root_lacks_is_dropped() {
    let host = FakeHost::default();
    let worker = configured_root(&host, RESOLVING, 1);
    worker.resolve_elsewhere();
    payment_timed_out(&host, &worker, 7, "pay-d", "alice");
    let mut carried = worker.resolutions_to_carry();
    carried[0].rule.name = "another".into();
    let other = r#"{"rules":[{"name":"pay","match":{"path_prefixes":["/payments"]},
        "resolve":{"cluster":"payments","path":"/payments/by-key/{key}","settle_seconds":5}}]}"#;
    let mut main = configured_root(&host, other, 2);
    main.take_resolutions(&host, carried);
    host.advance_ms(60_000);
    assert!(tick(&host, &mut main).is_empty());
}

/// A root whose configuration goes gives its resolutions up as plain data; a root of the next
/// configuration with the same rule goes on with them (the native build's orphanage).
#[test]
fn a_surrendered_resolution_is_asked_about_by_the_next_root() {
    let host = FakeHost::default();
    let worker = configured_root(&host, RESOLVING, 1);
    worker.resolve_elsewhere();
    let mut old_main = configured_root(&host, RESOLVING, 2);
    payment_timed_out(&host, &worker, 7, "pay-s", "alice");
    host.effective_context.set(2);
    old_main.take_resolutions(&host, worker.resolutions_to_carry());
    let surrendered = old_main.surrender_resolutions();
    assert_eq!(surrendered.len(), 1);
    host.advance_ms(5_000);
    assert!(
        tick(&host, &mut old_main).is_empty(),
        "given up by the old root"
    );

    let mut next_main = configured_root(&host, RESOLVING, 3);
    assert!(next_main.has_rule(&surrendered[0].rule));
    host.effective_context.set(3);
    next_main.take_resolutions(&host, surrendered);
    let lookups = tick(&host, &mut next_main);
    assert_eq!(lookups.len(), 1);
    lookup_answers(
        &host,
        &mut next_main,
        lookups[0].0,
        Some(200),
        br#"{"id":"pay_s"}"#,
    );
    let replay = retry(&host, &worker, 8, "pay-s").expect("replayed");
    assert_eq!(
        (replay.0, replay.2.as_slice()),
        (200, &br#"{"id":"pay_s"}"#[..])
    );
}

/// One no root can take on (its rule is gone) is marked unresolved: a retry is no longer told
/// to come back for a lookup nobody will make, and still never runs the write.
#[test]
fn a_carried_resolution_no_root_can_hold_stops_promising_a_retry_after() {
    let host = FakeHost::default();
    let worker = configured_root(&host, RESOLVING, 1);
    worker.resolve_elsewhere();
    payment_timed_out(&host, &worker, 7, "pay-g", "alice");
    let mut carried = worker.resolutions_to_carry();
    carried[0].rule.name = "renamed".into();
    let mut main = configured_root(&host, RESOLVING, 2);
    assert!(!main.has_rule(&carried[0].rule));
    host.effective_context.set(2);
    main.take_resolutions(&host, carried);
    host.advance_ms(1_000);
    let reply = retry(&host, &worker, 8, "pay-g").expect("never executed");
    assert_eq!(reply.0, 409);
    assert!(problem_type(&reply.2).ends_with("outcome-unknown"));
    assert_eq!(retry_after(&reply), None, "nobody will ask");
}

/// What the host could not carry stays with the worker for the next carry.
#[test]
fn resolutions_the_host_could_not_carry_are_carried_next_time() {
    let host = FakeHost::default();
    let worker = configured_root(&host, RESOLVING, 1);
    worker.resolve_elsewhere();
    payment_timed_out(&host, &worker, 7, "pay-k", "alice");
    let carried = worker.resolutions_to_carry();
    assert!(!worker.has_resolutions_to_carry());
    worker.keep_to_carry(&host, carried);
    assert_eq!(worker.resolutions_to_carry().len(), 1);
}

/// Overdue retries on several workers carry the same adopted resolution: taken on once. One
/// for another unknown outcome of the same key is not mistaken for it.
#[test]
fn an_adopted_resolution_is_taken_on_once_per_unknown_outcome() {
    let host = FakeHost::default();
    let worker = configured_root(&host, RESOLVING, 1);
    worker.resolve_elsewhere();
    let mut main = configured_root(&host, RESOLVING, 2);
    payment_timed_out(&host, &worker, 7, "pay-a", "alice");
    let mut first = worker.resolutions_to_carry();
    first[0].adopted = true;
    let again = first.clone();
    let mut other = first.clone();
    other[0].unknown.proxy_status = 503;
    host.effective_context.set(2);
    main.take_resolutions(&host, first);
    main.take_resolutions(&host, again);
    assert_eq!(
        main.plugin().unwrap().resolutions.len(),
        1,
        "the same one once"
    );
    main.take_resolutions(&host, other);
    assert_eq!(
        main.plugin().unwrap().resolutions.len(),
        2,
        "another outcome is its own"
    );
    let _ = tick(&host, &mut main);
}

const RESOLVING_CALLS: &str = r#"{"rules":[{"name":"orders","match":{"grpc_services":["shop.v1.Orders"]},
    "resolve":{"cluster":"orders","path":"/shop.v1.Orders/Lookup","settle_seconds":5,
    "max_attempts":20,"backoff_seconds":2}}]}"#;

fn owned(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    list.iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect()
}

/// A call with `key`, in context `context`, whose sidecar gave up after it reached the
/// service (`UNAVAILABLE`, Envoy's words for its timeout).
fn call_timed_out_behind(host: &FakeHost, root: &PluginRoot, context: u32, key: &str) {
    let headers = super::grpc::grpc_headers(super::grpc::PLACE, Some(key));
    let (journey, verdict) =
        request_in_context(host, root, context, &headers, &super::grpc::frame(b"order"));
    assert_eq!(verdict, Verdict::Continue);
    envoy_reports(host, "via_upstream", 0, 1);
    host.set_response(
        &[
            (":status", "200"),
            ("content-type", "application/grpc"),
            ("grpc-status", "14"),
            ("grpc-message", "upstream request timeout"),
        ],
        b"",
    );
    let mut journey = journey.borrow_mut();
    journey.on(
        host,
        Event::ResponseHeaders {
            end_of_stream: true,
        },
    );
    journey.on(host, Event::StreamEnd);
    let _ = host.take_effects();
}

/// What the retry of a call gets: None when it executes, else its `grpc-status` and reply.
fn call_retry(host: &FakeHost, root: &PluginRoot, context: u32, key: &str) -> Option<Reply> {
    let _ = host.take_effects();
    let headers = super::grpc::grpc_headers(super::grpc::PLACE, Some(key));
    let (_journey, verdict) =
        request_in_context(host, root, context, &headers, &super::grpc::frame(b"order"));
    if verdict == Verdict::Continue {
        return None;
    }
    let effects = host.take_effects();
    // A replay with a message comes with its trailers (the native build's way).
    let with_trailers = effects.iter().find_map(|e| match e {
        crate::fake_host::Effect::ReplyWithTrailers {
            status,
            headers,
            body,
            ..
        } => Some((*status, headers.clone(), body.clone())),
        _ => None,
    });
    Some(with_trailers.unwrap_or_else(|| the_reply(&effects)))
}

fn grpc_status_of(reply: &Reply) -> Option<String> {
    header(&reply.1, "grpc-status").map(|v| String::from_utf8_lossy(v).into_owned())
}

/// The gRPC lookup the root sends after the settle time: its token, checked for shape.
fn grpc_lookup_sent(host: &FakeHost, root: &mut PluginRoot, key: &str) -> u32 {
    grpc_lookup_sent_after(host, root, key, 5_000)
}

/// The gRPC lookup the root sends `after_ms` from now.
fn grpc_lookup_sent_after(host: &FakeHost, root: &mut PluginRoot, key: &str, after_ms: u64) -> u32 {
    host.advance_ms(after_ms);
    let mut sent = Vec::new();
    // Ticks a second apart until the lookup goes (its due time is the backoff's).
    for _ in 0..600 {
        host.effective_context.set(1);
        root.on_tick(host);
        sent = host
            .take_effects()
            .into_iter()
            .filter_map(|e| match e {
                crate::fake_host::Effect::Callout {
                    token,
                    path,
                    headers,
                    body,
                    ..
                } => Some((token, path, headers, body)),
                _ => None,
            })
            .collect();
        if !sent.is_empty() {
            break;
        }
        host.advance_ms(1_000);
    }
    assert_eq!(sent.len(), 1, "one lookup");
    let (token, path, headers, body) = &sent[0];
    assert_eq!(path, "/shop.v1.Orders/Lookup");
    let value = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(value(":method"), Some("POST"));
    assert_eq!(value("content-type"), Some("application/grpc"));
    assert_eq!(
        value("idempotency-key"),
        Some(key),
        "the key's metadata goes along"
    );
    assert_eq!(body.as_slice(), &[0u8; 5], "an empty request message");
    *token
}

#[test]
fn a_call_a_sidecar_gave_up_on_is_resolved_by_a_lookup_call() {
    for trailers_seen in [true, false] {
        let host = FakeHost::default();
        host.sends_trailers.set(true);
        let mut root = configured_root(&host, RESOLVING_CALLS, 1);
        call_timed_out_behind(&host, &root, 7, "k1");
        let early = call_retry(&host, &root, 8, "k1").expect("not executed");
        assert_eq!(
            grpc_status_of(&early).as_deref(),
            Some("9"),
            "FAILED_PRECONDITION"
        );
        let token = grpc_lookup_sent(&host, &mut root, "k1");
        // OK with the order: its message and trailers, or (a host that hands no callout
        // trailers over) the message alone.
        *host.callout_answer.borrow_mut() = (
            owned(&[(":status", "200"), ("content-type", "application/grpc")]),
            super::grpc::frame(b"order-k1"),
        );
        *host.callout_trailers.borrow_mut() = if trailers_seen {
            owned(&[("grpc-status", "0"), ("x-order-id", "o-1")])
        } else {
            Vec::new()
        };
        host.effective_context.set(1);
        root.on_callout_answer(&host, token, 2, 13);
        assert_eq!(host.counter("orders", Outcome::ResolvedTookEffect), 1);
        let replay = call_retry(&host, &root, 9, "k1").expect("replayed");
        assert_eq!(
            replay.2,
            super::grpc::frame(b"order-k1"),
            "the service's message"
        );
        assert_eq!(host.counter("orders", Outcome::Executed), 1);
    }
}

#[test]
fn a_call_the_lookup_says_never_ran_runs_on_its_retry_and_anything_else_asks_again() {
    let host = FakeHost::default();
    let mut root = configured_root(&host, RESOLVING_CALLS, 1);
    call_timed_out_behind(&host, &root, 7, "k1");
    // A status that says neither (UNAVAILABLE), then an answer with no status and no
    // message: asked again later, never freed.
    const GRPC: (&str, &str) = ("content-type", "application/grpc");
    for (attempt, (headers, body, trailers)) in [
        (
            vec![(":status", "200"), GRPC, ("grpc-status", "14")],
            vec![],
            vec![],
        ),
        (vec![(":status", "200"), GRPC], vec![], vec![]),
        // A proxy's own NOT_FOUND (a mesh without a route for the method): no echo of the key.
        (
            vec![(":status", "200"), GRPC, ("grpc-status", "5")],
            vec![],
            vec![],
        ),
        // Not gRPC, or not well-formed gRPC: nothing settles.
        (
            vec![(":status", "200"), ("content-type", "text/plain")],
            super::grpc::frame(b"x"),
            vec![],
        ),
        (
            vec![(":status", "200"), GRPC],
            super::grpc::frame(b"x"),
            vec![("grpc-status", "5"), ("grpc-status", "0")],
        ),
        (
            vec![(":status", "200"), GRPC, ("grpc-status", "0")],
            super::grpc::frame(b"x"),
            vec![],
        ),
        (
            vec![(":status", "200"), GRPC],
            super::grpc::frame(b"x"),
            vec![("x-other", "1")],
        ),
    ]
    .into_iter()
    .enumerate()
    {
        // The settle time, then each backoff (2 s, doubling).
        let after_ms = if attempt == 0 {
            5_000
        } else {
            2_000 << (attempt - 1)
        };
        let token = grpc_lookup_sent_after(&host, &mut root, "k1", after_ms);
        let size = body.len();
        *host.callout_answer.borrow_mut() = (owned(&headers), body);
        *host.callout_trailers.borrow_mut() = owned(&trailers);
        root.on_callout_answer(&host, token, headers.len(), size);
        let unknown = call_retry(&host, &root, 8, "k1").expect("still unknown");
        assert_eq!(
            grpc_status_of(&unknown).as_deref(),
            Some("9"),
            "{headers:?} {trailers:?}"
        );
    }
    assert_eq!(host.counter("orders", Outcome::ResolvedNeverRan), 0);
    assert_eq!(host.counter("orders", Outcome::ResolvedTookEffect), 0);
    host.callout_trailers.borrow_mut().clear();
    // NOT_FOUND from the lookup method, echoing the key: freed, and the retry runs.
    let token = grpc_lookup_sent(&host, &mut root, "k1");
    *host.callout_answer.borrow_mut() = (
        owned(&[
            (":status", "200"),
            GRPC,
            ("grpc-status", "5"),
            ("idempotency-key", "k1"),
        ]),
        Vec::new(),
    );
    root.on_callout_answer(&host, token, 4, 0);
    assert_eq!(host.counter("orders", Outcome::ResolvedNeverRan), 1);
    assert_eq!(call_retry(&host, &root, 9, "k1"), None, "the retry runs");
}

#[test]
fn a_grpc_rules_lookup_is_a_call_and_its_status_decides() {
    for (resolve, field) in [
        (r#"{"path":"/orders/{key}","settle_seconds":5}"#, "path"),
        (
            r#"{"path":"/shop.v1.Orders/Lookup","method":"GET","settle_seconds":5}"#,
            "method",
        ),
        (
            r#"{"path":"/shop.v1.Orders/Lookup","never_ran_statuses":[404],"settle_seconds":5}"#,
            "never_ran_statuses",
        ),
    ] {
        let config = format!(
            r#"{{"rules":[{{"name":"o","match":{{"grpc_services":["shop.v1.Orders"]}},"resolve":{resolve}}}]}}"#
        );
        let error = crate::config::Config::parse(config.as_bytes()).unwrap_err();
        assert!(error.to_string().contains(field), "{resolve}: {error}");
    }
}

#[test]
fn a_call_whose_key_a_lookup_could_not_carry_as_it_names_the_record_is_refused() {
    let host = FakeHost::default();
    let root = configured_root(&host, RESOLVING_CALLS, 1);
    for key_headers in [
        vec![("idempotency-key", "\"k1\"")],
        vec![("idempotency-key", "k1"), ("idempotency-key", "k2")],
    ] {
        let mut headers = super::grpc::grpc_headers(super::grpc::PLACE, None);
        headers.extend(key_headers.iter().copied());
        let (journey, verdict) =
            request_in_context(&host, &root, 7, &headers, &super::grpc::frame(b"order"));
        assert_ne!(verdict, Verdict::Continue, "{key_headers:?}");
        assert!(!is_executing(&journey.borrow()), "{key_headers:?}");
        let reply = the_reply(&host.take_effects());
        assert_eq!(
            grpc_status_of(&reply).as_deref(),
            Some("3"),
            "INVALID_ARGUMENT: {reply:?}"
        );
    }
}

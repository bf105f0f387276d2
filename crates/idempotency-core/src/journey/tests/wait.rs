//! Wait mode (`on_in_flight: "wait"`), single-proxy: a duplicate of a request in flight is
//! held and, on the root's tick, answered with the first request's response; with 409 when
//! `wait_ms` passes, a retry-able 503 when the first is released; one that leaves costs
//! nothing; beyond the bound a duplicate gets its 409 at once.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use std::cell::RefCell;

use super::*;
use crate::outcome::Outcome;
use crate::plugin::waits::{MAX_WAITERS, WAIT_TICK_MS};
use crate::root::PluginRoot;

const ROOT: u32 = 1;
const WAIT: &str = r#"{"access_log_fields":true,"rules":[{"name":"orders","match":{"path_prefixes":["/orders"]},
    "on_in_flight":"wait","wait_ms":2000}]}"#;

fn root(host: &FakeHost, config: &str) -> PluginRoot {
    configured_root(host, config, ROOT)
}

fn request(
    host: &FakeHost,
    root: &PluginRoot,
    context: u32,
    key: &str,
) -> (Rc<RefCell<RequestJourney>>, Verdict) {
    post_in_context(host, root, context, key)
}

fn tick(host: &FakeHost, root: &mut PluginRoot) {
    host.effective_context.set(ROOT);
    root.on_tick(host);
}

#[test]
fn a_held_duplicate_gets_the_first_requests_response_when_it_completes() {
    let host = FakeHost::default();
    let mut root = root(&host, WAIT);
    assert_eq!(host.tick_period_ms.get(), Some(WAIT_TICK_MS));
    let (first, verdict) = request(&host, &root, 7, "k1");
    assert_eq!(verdict, Verdict::Continue);
    let (second, verdict) = request(&host, &root, 8, "k1");
    assert_eq!(verdict, Verdict::Pause, "held, not answered");
    assert!(matches!(second.borrow().state(), Journey::Waiting(_)));
    assert!(host.take_effects().is_empty(), "no 409");
    tick(&host, &mut root);
    assert!(host.take_effects().is_empty(), "still running: still held");

    host.effective_context.set(7);
    respond(&host, &mut first.borrow_mut(), 201, br#"{"order":1}"#);
    let _ = host.take_effects();
    tick(&host, &mut root);
    let effects = host.take_effects();
    assert_eq!(
        effects.first(),
        Some(&Effect::Switched(8)),
        "answered in its own context"
    );
    let (status, headers, body) = the_reply(&effects);
    assert_eq!((status, body.as_slice()), (201, &br#"{"order":1}"#[..]));
    assert_eq!(header(&headers, "idempotent-replayed"), Some(&b"true"[..]));
    assert_eq!(effects.last(), Some(&Effect::Switched(ROOT)));
    assert_eq!(host.counter("orders", Outcome::Executed), 1);
    assert_eq!(host.counter("orders", Outcome::Waited), 1);
    assert_eq!(host.counter("orders", Outcome::ReplayedAfterWait), 1);
    assert_eq!(host.counter("orders", Outcome::Conflict), 0);
    assert_eq!(
        host.published_in(8, crate::journey::access_log::OUTCOME)
            .as_deref(),
        Some("waited+replayed_after_wait")
    );
}

#[test]
fn a_held_duplicate_gets_409_when_its_wait_passes_and_503_when_the_first_is_released() {
    let host = FakeHost::default();
    let mut root = root(&host, WAIT);
    let (first, _) = request(&host, &root, 7, "k1");
    let (_late, _) = request(&host, &root, 8, "k1");
    host.advance_ms(2_000);
    let (_soon, _) = request(&host, &root, 9, "k1");
    tick(&host, &mut root);
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(status, 409, "the first waiter's 2 s are over");
    assert_eq!(header(&headers, "retry-after"), Some(&b"1"[..]));
    assert!(problem_type(&body).ends_with("request-in-flight"));
    assert_eq!(host.counter("orders", Outcome::WaitTimedOut), 1);

    host.effective_context.set(7);
    respond(&host, &mut first.borrow_mut(), 503, b"busy");
    let _ = host.take_effects();
    tick(&host, &mut root);
    let (status, headers, body) = the_reply(&host.take_effects());
    assert_eq!(status, 503);
    assert_eq!(header(&headers, "retry-after"), Some(&b"1"[..]));
    assert!(problem_type(&body).ends_with("first-attempt-released"));
    assert_eq!(host.counter("orders", Outcome::WaitReleased), 1);
    // Its retry executes.
    let (_, verdict) = request(&host, &root, 10, "k1");
    assert_eq!(verdict, Verdict::Continue);
    assert_eq!(host.counter("orders", Outcome::Executed), 2);
}

#[test]
fn a_held_duplicate_whose_client_leaves_costs_nothing_further() {
    let host = FakeHost::default();
    let mut root = root(&host, WAIT);
    let (first, _) = request(&host, &root, 7, "k1");
    let (second, _) = request(&host, &root, 8, "k1");
    let (third, _) = request(&host, &root, 9, "k1");
    host.effective_context.set(8);
    second.borrow_mut().on(&host, Event::StreamEnd);
    drop(third); // gone without a stream end
    assert_eq!(held_duplicates(&root).0, 1);
    host.effective_context.set(7);
    respond(&host, &mut first.borrow_mut(), 201, b"ok");
    let _ = host.take_effects();
    tick(&host, &mut root);
    assert!(replies(&host.take_effects()).is_empty());
    assert_eq!(held_duplicates(&root).0, 0);
    assert_eq!(host.counter("orders", Outcome::ReplayedAfterWait), 0);
}

#[test]
fn beyond_the_bound_a_duplicate_gets_409_at_once() {
    let host = FakeHost::default();
    let root = root(&host, WAIT);
    let (_first, _) = request(&host, &root, 7, "k1");
    let mut held = Vec::new();
    for i in 0..MAX_WAITERS {
        let (waiter, verdict) = request(&host, &root, 100 + i as u32, "k1");
        assert_eq!(verdict, Verdict::Pause);
        held.push(waiter);
    }
    assert!(host.take_effects().is_empty());
    let (_, verdict) = request(&host, &root, 5_000, "k1");
    assert_eq!(verdict, Verdict::Pause);
    let (status, _, _) = the_reply(&host.take_effects());
    assert_eq!(status, 409);
    assert_eq!(host.counter("orders", Outcome::Conflict), 1);
    assert_eq!(host.counter("orders", Outcome::Waited), MAX_WAITERS as u64);
}

#[test]
fn without_wait_mode_a_duplicate_still_gets_409_at_once() {
    let host = FakeHost::default();
    let root = root(&host, ORDERS);
    let (_first, _) = request(&host, &root, 7, "k1");
    let (_, verdict) = request(&host, &root, 8, "k1");
    assert_eq!(verdict, Verdict::Pause);
    assert_eq!(the_reply(&host.take_effects()).0, 409);
    assert_eq!(host.counter("orders", Outcome::Waited), 0);
}

#[test]
fn held_duplicates_are_bounded_in_bytes_not_only_in_number() {
    use crate::plugin::waits::MAX_HELD_BYTES;
    let host = FakeHost::default();
    let root = root(&host, WAIT);
    let body = vec![b'x'; 1 << 20];
    let post_big = |context: u32| {
        host.effective_context.set(context);
        host.set_request(&post_headers("/orders", Some("k1")), &body);
        let journey = root.new_request(context).unwrap();
        journey.borrow_mut().on(
            &host,
            Event::RequestHeaders {
                end_of_stream: false,
            },
        );
        journey.borrow_mut().on(
            &host,
            Event::RequestBody {
                size: body.len(),
                end_of_stream: true,
            },
        );
        journey
    };
    let _first = post_big(7);
    let held: Vec<_> = (0..70).map(|i| post_big(100 + i)).collect();
    let fits = MAX_HELD_BYTES / (body.len() + 2048);
    assert_eq!(host.counter("orders", Outcome::Waited), fits as u64);
    assert_eq!(
        host.counter("orders", Outcome::Conflict),
        (70 - fits) as u64
    );
    assert_eq!(
        replies(&host.take_effects()).len(),
        70 - fits,
        "409s at once"
    );
    let (count, bytes) = held_duplicates(&root);
    assert_eq!(count, fits);
    assert!(bytes <= MAX_HELD_BYTES);
    drop(held);
}

#[test]
fn a_configuration_retired_by_a_push_stays_until_its_held_duplicates_are_answered() {
    let host = FakeHost::default();
    let mut retired = root(&host, WAIT);
    let (first, _) = request(&host, &retired, 7, "k1");
    let (_held, _) = request(&host, &retired, 8, "k1");
    host.effective_context.set(ROOT);
    assert!(
        !retired.on_done(),
        "kept: its tick must answer the held duplicate"
    );
    tick(&host, &mut retired);
    assert!(!host.take_effects().contains(&Effect::Done));

    host.effective_context.set(7);
    respond(&host, &mut first.borrow_mut(), 201, b"ok");
    let _ = host.take_effects();
    tick(&host, &mut retired);
    let effects = host.take_effects();
    assert_eq!(
        the_reply(&effects).0,
        201,
        "the held duplicate gets its replay"
    );
    assert_eq!(effects.last(), Some(&Effect::Done), "then the root lets go");

    let idle_host = FakeHost::default();
    let mut idle = root(&idle_host, WAIT);
    assert!(idle.on_done(), "nothing held: done at once");
}

#[test]
fn envoys_own_timeout_answers_a_held_duplicate_and_ends_its_wait() {
    let host = FakeHost::default();
    let root = root(&host, WAIT);
    let (_first, _) = request(&host, &root, 7, "k1");
    let (second, verdict) = request(&host, &root, 8, "k1");
    assert_eq!(verdict, Verdict::Pause);
    assert_eq!(held_duplicates(&root).0, 1);
    // Envoy's request timeout fires: its 408 passes back through the filter.
    host.effective_context.set(8);
    host.set_response(&[(":status", "408")], b"");
    let verdict = second.borrow_mut().on(
        &host,
        Event::ResponseHeaders {
            end_of_stream: true,
        },
    );
    assert_eq!(
        verdict,
        Verdict::Continue,
        "before: paused, and the reply hung"
    );
    assert_eq!(held_duplicates(&root).0, 0);
    assert!(matches!(second.borrow().state(), Journey::Finished));
}

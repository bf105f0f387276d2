//! A root whose host runs a request only in its own hooks (Envoy's dynamic modules): what
//! the store answers for a request is left as mail, never run in another context, and mail
//! its request cannot take releases what the store may hold for it.

#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use idempotency_protocol::stream::CallOp;

use super::stream::{
    answer, calls, claimed, config, opened, request, root_with, sent_claim, wake, REQUEST, ROOT,
};
use super::*;
use crate::root::PluginRoot;

/// A root configured to leave mail, whose stream opened: the host, root and stream.
fn mailing() -> (FakeHost, PluginRoot, u32) {
    let host = FakeHost::default();
    let mut root = root_with(&host, &config("fail_closed"));
    root.deliver_by_mail();
    let stream = opened(&host.take_effects())[0].0;
    (host, root, stream)
}

#[test]
fn a_claims_answer_waits_as_mail_and_resumes_its_request_in_the_requests_own_hook() {
    let (host, mut root, stream) = mailing();
    let journey = request(&host, &root, "k1");
    let (claim_id, owner) = sent_claim(&host);

    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    assert_eq!(host.take_effects(), vec![], "no switch, no resume");
    assert!(!is_executing(&journey.borrow()));
    let mail = root.take_mail();
    assert_eq!(mail.len(), 1);
    assert!(root.take_mail().is_empty(), "taken once");

    // The host runs the request's own hook: its context is the effective one.
    host.effective_context.set(REQUEST);
    for letter in mail {
        assert_eq!(letter.context_id(), REQUEST);
        root.deliver_mail(&host, letter);
    }
    assert_eq!(host.take_effects(), vec![Effect::Resume]);
    assert!(is_executing(&journey.borrow()));
}

#[test]
fn a_claim_whose_mail_its_request_never_takes_is_released_in_the_store() {
    let (host, mut root, stream) = mailing();
    let journey = request(&host, &root, "k1");
    let (claim_id, owner) = sent_claim(&host);
    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    // Envoy destroys the request before its scheduled hook runs.
    for letter in root.take_mail() {
        host.effective_context.set(ROOT);
        root.undelivered(&host, letter);
    }
    drop(journey);
    wake(&host, &root);
    let sent = calls(&host.take_effects());
    assert!(
        matches!(&sent[..], [(_, _, c)] if matches!(&c.op, CallOp::Release { owner: o, .. } if *o == owner)),
        "the store's claim released: {sent:?}"
    );
}

#[test]
fn mail_for_a_journey_already_gone_releases_its_claim_too() {
    let (host, mut root, stream) = mailing();
    let journey = request(&host, &root, "k1");
    let (claim_id, owner) = sent_claim(&host);
    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    let mail = root.take_mail();
    // The journey went (its request ended without a stream end reaching it) between the
    // mail being left and taken.
    drop(journey);
    host.effective_context.set(REQUEST);
    for letter in mail {
        root.deliver_mail(&host, letter);
    }
    assert!(!host.take_effects().contains(&Effect::Resume));
    wake(&host, &root);
    let sent = calls(&host.take_effects());
    assert!(
        matches!(&sent[..], [(_, _, c)] if matches!(&c.op, CallOp::Release { owner: o, .. } if *o == owner)),
        "{sent:?}"
    );
}

/// Envoy answered the request itself (its request timeout) while the store was confirming
/// its claim, and the claim's "claimed" is taken after that, before the stream's end.
/// `AwaitingStore` let Envoy's response pass and stayed; the answer then started the write
/// (`Executing`) although nothing could go upstream any more, and the stream's end recorded
/// it as an unknown outcome (409 to every retry until it was settled). Envoy's answer now
/// ends the wait: the claim is released, and the answer that comes later finds nobody.
#[test]
fn a_claims_answer_taken_after_envoy_answered_the_request_does_not_start_the_write() {
    let (host, mut root, stream) = mailing();
    let journey = request(&host, &root, "k1");
    let (claim_id, owner) = sent_claim(&host);
    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    let mail = root.take_mail();
    host.effective_context.set(REQUEST);
    let _ = journey.borrow_mut().on(
        &host,
        Event::ResponseHeaders {
            end_of_stream: true,
        },
    );
    for letter in mail {
        root.deliver_mail(&host, letter);
    }
    assert!(
        !is_executing(&journey.borrow()),
        "a request Envoy already answered starts its write"
    );
}

/// Round 2b (guarantee): a request held for the store whose filter fails (the native host's
/// `after_fault`, here at its destroy, with no request to act on) lets its claim go, in the
/// table and the store; the store's "claimed" taken afterwards finds nobody and starts
/// nothing. Nothing was sent upstream, so nothing is recorded as an unknown outcome.
#[test]
fn a_failed_request_held_for_the_store_lets_its_claim_go_and_its_answer_starts_nothing() {
    let (host, mut root, stream) = mailing();
    let journey = request(&host, &root, "k1");
    let (claim_id, owner) = sent_claim(&host);
    answer(&host, &mut root, stream, claim_id, claimed(&owner));
    let mail = root.take_mail();
    // The fault is settled at the request's destroy: the root's context, no request's.
    host.effective_context.set(ROOT);
    journey.borrow_mut().after_fault(&host);
    let mut effects = host.take_effects();
    host.effective_context.set(REQUEST);
    for letter in mail {
        root.deliver_mail(&host, letter);
    }
    assert!(!is_executing(&journey.borrow()));
    let after = host.take_effects();
    assert!(!after.contains(&Effect::Resume), "{after:?}");
    effects.extend(after);
    drop(journey);
    wake(&host, &root);
    effects.extend(host.take_effects());
    let sent = calls(&effects);
    assert!(
        sent.iter()
            .any(|(_, _, c)| matches!(&c.op, CallOp::Release { owner: o, .. } if *o == owner)),
        "the store's claim released: {sent:?}"
    );
    assert!(
        !sent
            .iter()
            .any(|(_, _, c)| matches!(&c.op, CallOp::Complete { .. })),
        "nothing recorded for a write that never went upstream: {sent:?}"
    );
    // The key is free here too: the next request of it asks the store.
    let again = request(&host, &root, "k1");
    let (_, next_owner) = sent_claim(&host);
    assert_ne!(next_owner, owner);
    drop(again);
}

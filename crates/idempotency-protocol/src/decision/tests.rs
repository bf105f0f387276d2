#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

use super::*;

const NOW: u64 = 1_000;
const FP: u8 = 1;
const OTHER_FP: u8 = 2;
const ME: u32 = 7;
const SOMEONE: u32 = 8;

fn in_flight<'a>(fingerprint: &'a u8, owner: &'a u32, ends: u64) -> Option<Record<'a, u8, u32>> {
    Some(Record::InFlight {
        fingerprint,
        owner,
        lease_ends_at_ms: ends,
    })
}

fn completed<'a>(
    fingerprint: &'a u8,
    expires: u64,
    record: Option<&'a [u8]>,
) -> Option<Record<'a, u8, u32>> {
    Some(Record::Completed {
        fingerprint,
        expires_at_ms: expires,
        record,
    })
}

#[test]
fn a_claim_takes_a_key_that_holds_nothing_live() {
    assert_eq!(claim::<u8, u32>(None, &FP, None, NOW), ClaimDecision::Claim);
    // A completion at its TTL end is gone, for any payload.
    assert_eq!(
        claim(completed(&FP, NOW, None), &FP, None, NOW),
        ClaimDecision::Claim
    );
    assert_eq!(
        claim(completed(&OTHER_FP, NOW, None), &FP, None, NOW),
        ClaimDecision::Claim
    );
}

#[test]
fn a_claim_takes_over_a_lease_that_has_passed() {
    assert_eq!(
        claim(in_flight(&FP, &SOMEONE, NOW), &FP, None, NOW),
        ClaimDecision::TakeOver
    );
    assert_eq!(
        claim(in_flight(&OTHER_FP, &SOMEONE, NOW - 1), &FP, None, NOW),
        ClaimDecision::TakeOver
    );
    assert!(ClaimDecision::TakeOver.claims() && ClaimDecision::Claim.claims());
}

#[test]
fn a_live_claim_of_the_same_payload_is_in_flight_until_its_lease_ends() {
    assert_eq!(
        claim(in_flight(&FP, &SOMEONE, NOW + 250), &FP, None, NOW),
        ClaimDecision::InFlight {
            retry_after_ms: 250
        }
    );
    assert_eq!(
        claim(in_flight(&FP, &SOMEONE, NOW + 1), &FP, None, NOW),
        ClaimDecision::InFlight { retry_after_ms: 1 }
    );
    assert!(!ClaimDecision::InFlight { retry_after_ms: 1 }.claims());
}

#[test]
fn the_owner_of_a_live_claim_asking_again_gets_it_back_and_nobody_else_does() {
    let other: u32 = SOMEONE + 1;
    assert_eq!(
        claim(
            in_flight(&FP, &SOMEONE, NOW + 250),
            &FP,
            Some(&SOMEONE),
            NOW
        ),
        ClaimDecision::AlreadyClaimed {
            lease_ends_at_ms: NOW + 250
        }
    );
    assert!(!ClaimDecision::AlreadyClaimed {
        lease_ends_at_ms: 1
    }
    .claims());
    assert_eq!(
        claim(in_flight(&FP, &SOMEONE, NOW + 250), &FP, Some(&other), NOW),
        ClaimDecision::InFlight {
            retry_after_ms: 250
        }
    );
    // Another payload under the same owner is still a mismatch; a lapsed lease is
    // taken over as for anyone.
    assert_eq!(
        claim(
            in_flight(&OTHER_FP, &SOMEONE, NOW + 250),
            &FP,
            Some(&SOMEONE),
            NOW
        ),
        ClaimDecision::Mismatch
    );
    assert_eq!(
        claim(in_flight(&FP, &SOMEONE, NOW), &FP, Some(&SOMEONE), NOW),
        ClaimDecision::TakeOver
    );
}

#[test]
fn a_live_completion_of_the_same_payload_is_replayed() {
    assert_eq!(
        claim(completed(&FP, NOW + 1, Some(b"r")), &FP, None, NOW),
        ClaimDecision::Replay
    );
    assert_eq!(
        claim(completed(&FP, NOW + 1, None), &FP, None, NOW),
        ClaimDecision::Replay
    );
}

#[test]
fn a_live_record_of_another_payload_is_a_mismatch() {
    assert_eq!(
        claim(in_flight(&OTHER_FP, &SOMEONE, NOW + 5), &FP, None, NOW),
        ClaimDecision::Mismatch
    );
    assert_eq!(
        claim(completed(&OTHER_FP, NOW + 5, None), &FP, None, NOW),
        ClaimDecision::Mismatch
    );
}

fn completion<'a>(
    owner: &'a u32,
    record: &'a [u8],
    fingerprint: Option<&'a u8>,
) -> Completion<'a, u8, u32> {
    Completion {
        owner,
        record,
        fingerprint,
    }
}

#[test]
fn the_owner_completes_its_claim_even_after_the_lease() {
    let mine = completion(&ME, b"r", None);
    assert_eq!(
        complete(in_flight(&FP, &ME, NOW + 5), &mine, NOW),
        CompleteDecision::Record
    );
    assert_eq!(
        complete(in_flight(&FP, &ME, NOW - 5), &mine, NOW),
        CompleteDecision::Record
    );
}

#[test]
fn another_owners_claim_is_never_completed() {
    for ends in [NOW + 5, NOW - 5] {
        assert_eq!(
            complete(
                in_flight(&FP, &SOMEONE, ends),
                &completion(&ME, b"r", None),
                NOW
            ),
            CompleteDecision::NotOwner,
            "lease ends at {ends}"
        );
    }
    // Not even with a fingerprint, while that claim lives.
    assert_eq!(
        complete(
            in_flight(&FP, &SOMEONE, NOW + 5),
            &completion(&ME, b"r", Some(&FP)),
            NOW
        ),
        CompleteDecision::NotOwner
    );
}

#[test]
fn a_resent_complete_finds_its_own_bytes_and_changes_nothing() {
    let resent = completion(&ME, b"r", None);
    assert_eq!(
        complete(completed(&FP, NOW + 5, Some(b"r")), &resent, NOW),
        CompleteDecision::AlreadyRecorded
    );
    assert!(CompleteDecision::AlreadyRecorded.completes());
    // Other bytes are never written over a completion, nor confirmed.
    let other = completion(&ME, b"other", Some(&FP));
    assert_eq!(
        complete(completed(&FP, NOW + 5, Some(b"r")), &other, NOW),
        CompleteDecision::NotOwner
    );
    // Where the bytes are kept elsewhere, nothing is confirmed.
    assert_eq!(
        complete(completed(&FP, NOW + 5, None), &resent, NOW),
        CompleteDecision::NotOwner
    );
    // An expired completion confirms nothing either.
    assert_eq!(
        complete(completed(&FP, NOW, Some(b"r")), &resent, NOW),
        CompleteDecision::NotOwner
    );
}

#[test]
fn a_completion_with_its_fingerprint_is_recorded_where_nothing_lives() {
    let late = completion(&ME, b"r", Some(&FP));
    for existing in [
        None,
        in_flight(&OTHER_FP, &SOMEONE, NOW),
        completed(&OTHER_FP, NOW, Some(b"old")),
    ] {
        assert_eq!(
            complete(existing, &late, NOW),
            CompleteDecision::RecordAfresh
        );
    }
    assert_eq!(
        complete(None, &completion(&ME, b"r", None), NOW),
        CompleteDecision::NotOwner
    );
    assert!(!CompleteDecision::NotOwner.completes());
}

#[test]
fn only_the_owner_releases_its_claim() {
    assert_eq!(
        release(in_flight(&FP, &ME, NOW + 5), &ME),
        ReleaseDecision::Release
    );
    // A lapsed lease nobody took over is still its owner's to release.
    assert_eq!(
        release(in_flight(&FP, &ME, NOW - 5), &ME),
        ReleaseDecision::Release
    );
    assert_eq!(
        release(in_flight(&FP, &SOMEONE, NOW + 5), &ME),
        ReleaseDecision::NotOwner
    );
    assert_eq!(
        release(completed(&FP, NOW + 5, None), &ME),
        ReleaseDecision::NotOwner
    );
    assert_eq!(release::<u8, u32>(None, &ME), ReleaseDecision::NotOwner);
}

#[test]
fn the_owner_renews_its_live_claim_from_now() {
    assert_eq!(
        renew(in_flight(&FP, &ME, NOW + 5), &ME, 1_000, NOW),
        RenewDecision::Renew {
            lease_ends_at_ms: NOW + 1_000
        }
    );
}

#[test]
fn a_lapsed_lease_nobody_took_over_is_still_renewed() {
    for ends in [NOW, NOW - 500] {
        assert_eq!(
            renew(in_flight(&FP, &ME, ends), &ME, 1_000, NOW),
            RenewDecision::Renew {
                lease_ends_at_ms: NOW + 1_000
            },
            "lease ended at {ends}"
        );
    }
}

#[test]
fn a_renew_never_shortens_a_lease() {
    assert_eq!(
        renew(in_flight(&FP, &ME, NOW + 60_000), &ME, 1_000, NOW),
        RenewDecision::Renew {
            lease_ends_at_ms: NOW + 60_000
        }
    );
    // Near the end of time the new end saturates instead of wrapping round to the past.
    assert_eq!(
        renew(in_flight(&FP, &ME, NOW), &ME, u64::MAX, NOW),
        RenewDecision::Renew {
            lease_ends_at_ms: u64::MAX
        }
    );
}

#[test]
fn only_the_owners_claim_is_renewed() {
    // Taken over: the key now holds someone else's claim, live or lapsed.
    for ends in [NOW + 5, NOW - 5] {
        assert_eq!(
            renew(in_flight(&FP, &SOMEONE, ends), &ME, 1_000, NOW),
            RenewDecision::NotOwner,
            "lease ends at {ends}"
        );
    }
    // Completed (live or expired), or nothing at all: a renew creates nothing.
    for expires in [NOW + 5, NOW] {
        assert_eq!(
            renew(completed(&FP, expires, Some(b"r")), &ME, 1_000, NOW),
            RenewDecision::NotOwner
        );
    }
    assert_eq!(
        renew::<u8, u32>(None, &ME, 1_000, NOW),
        RenewDecision::NotOwner
    );
}

#[test]
fn liveness_ends_at_the_expiry_instant() {
    let r = in_flight(&FP, &ME, NOW);
    assert!(r.as_ref().is_some_and(|r| r.is_live(NOW - 1)));
    assert!(r.as_ref().is_some_and(|r| !r.is_live(NOW)));
}

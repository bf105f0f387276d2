use super::*;
use crate::table::fake_shared::FakeShared;
use crate::table::OversizedBody::RecordWithoutIt;
use std::cell::RefCell;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

fn digest(n: u8) -> Digest {
    [n; 32]
}

fn response(status: u16) -> RecordedResponse {
    RecordedResponse {
        owner: 0,
        status,
        headers: vec![("content-type".into(), b"text/plain".to_vec())],
        body: b"done".to_vec(),
        trailers: Vec::new(),
        body_omitted: false,
        unknown: None,
    }
}

fn layout(capacity: u32) -> Layout {
    Layout::plan(64 << 20, Some(u64::from(capacity)), 1 << 20).unwrap()
}

fn table(shared: &FakeShared, capacity: u32) -> Table {
    let t = Table::new("test", layout(capacity), 0);
    t.create_buckets(shared).unwrap();
    t
}

fn held(c: Claim) -> Held {
    match c {
        Claim::Claimed(h) => h,
        other => panic!("expected a claim, got {other:?}"),
    }
}

#[test]
fn first_claim_executes_then_duplicates_wait_then_replay() {
    let s = FakeShared::default();
    let t = table(&s, 64);
    let (k, fp) = (digest(1), digest(2));
    let h = held(t.claim(&s, &k, &fp, 7, 1_000, 60_000, || {}).unwrap());
    assert!(!h.took_over);
    assert_eq!(
        t.claim(&s, &k, &fp, 8, 1_500, 60_000, || {}).unwrap(),
        Claim::InFlight {
            retry_after_ms: 59_500
        }
    );
    assert_eq!(
        t.complete(&s, &h, &response(201), 2_000, 10_000, RecordWithoutIt)
            .unwrap(),
        Completion::Recorded
    );
    let Claim::Completed {
        slot,
        owner,
        status,
        recorded_at_ms,
        ..
    } = t.claim(&s, &k, &fp, 9, 3_000, 60_000, || {}).unwrap()
    else {
        panic!("expected completed");
    };
    assert_eq!((owner, status, recorded_at_ms), (7, 201, 2_000));
    let replay = t.load_response(&s, slot, owner).unwrap().unwrap();
    assert_eq!(replay.body, b"done");
    assert_eq!(replay.status, 201);
}

#[test]
fn a_peek_sees_what_a_claim_would_and_never_claims() {
    let s = FakeShared::default();
    let t = table(&s, 64);
    let (k, fp) = (digest(1), digest(2));
    assert_eq!(t.peek(&s, &k, &fp, 1_000).unwrap(), None, "nothing yet");
    let h = held(t.claim(&s, &k, &fp, 7, 1_000, 60_000, || {}).unwrap());
    assert!(matches!(
        t.peek(&s, &k, &fp, 1_500).unwrap(),
        Some(Claim::InFlight { .. })
    ));
    assert_eq!(
        t.peek(&s, &k, &digest(3), 1_500).unwrap(),
        Some(Claim::Mismatch)
    );
    // Past the lease the key is free to take over: the waiter is told it was released.
    assert_eq!(t.peek(&s, &k, &fp, 61_000).unwrap(), None);
    t.complete(&s, &h, &response(201), 2_000, 10_000, RecordWithoutIt)
        .unwrap();
    assert!(matches!(
        t.peek(&s, &k, &fp, 3_000).unwrap(),
        Some(Claim::Completed {
            owner: 7,
            status: 201,
            ..
        })
    ));
    // The peeks claimed nothing: the record is still the one completed by owner 7.
    assert!(matches!(
        t.claim(&s, &k, &fp, 9, 3_000, 60_000, || {}).unwrap(),
        Claim::Completed { owner: 7, .. }
    ));
    t.release(
        &s,
        &held(
            t.claim(&s, &digest(5), &fp, 10, 3_000, 60_000, || {})
                .unwrap(),
        ),
    )
    .unwrap();
    assert_eq!(
        t.peek(&s, &digest(5), &fp, 3_000).unwrap(),
        None,
        "released"
    );
}

#[test]
fn different_payload_is_a_mismatch_and_leaves_the_record_intact() {
    let s = FakeShared::default();
    let t = table(&s, 64);
    let k = digest(1);
    let h = held(t.claim(&s, &k, &digest(2), 7, 0, 1_000, || {}).unwrap());
    assert_eq!(
        t.claim(&s, &k, &digest(3), 8, 1, 1_000, || {}).unwrap(),
        Claim::Mismatch
    );
    t.complete(&s, &h, &response(200), 2, 10_000, RecordWithoutIt)
        .unwrap();
    assert_eq!(
        t.claim(&s, &k, &digest(3), 8, 3, 1_000, || {}).unwrap(),
        Claim::Mismatch
    );
    assert!(matches!(
        t.claim(&s, &k, &digest(2), 9, 4, 1_000, || {}).unwrap(),
        Claim::Completed { owner: 7, .. }
    ));
}

#[test]
fn expired_records_are_claimed_again() {
    let s = FakeShared::default();
    let t = table(&s, 64);
    let (k, fp) = (digest(1), digest(2));
    let h = held(t.claim(&s, &k, &fp, 7, 0, 1_000, || {}).unwrap());
    t.complete(&s, &h, &response(200), 10, 5_000, RecordWithoutIt)
        .unwrap();
    assert!(matches!(
        t.claim(&s, &k, &fp, 8, 5_009, 1_000, || {}).unwrap(),
        Claim::Completed { .. }
    ));
    let again = held(t.claim(&s, &k, &fp, 8, 5_010, 1_000, || {}).unwrap());
    assert!(!again.took_over);
}

#[test]
fn abandoned_in_flight_claim_is_taken_over_and_the_late_owner_cannot_record() {
    let s = FakeShared::default();
    let t = table(&s, 64);
    let (k, fp) = (digest(1), digest(2));
    let first = held(t.claim(&s, &k, &fp, 7, 0, 1_000, || {}).unwrap());
    let second = held(t.claim(&s, &k, &fp, 8, 1_000, 1_000, || {}).unwrap());
    assert!(second.took_over);
    assert_eq!(
        t.complete(&s, &first, &response(200), 1_100, 5_000, RecordWithoutIt)
            .unwrap(),
        Completion::LostOwnership
    );
    assert_eq!(t.release(&s, &first).unwrap(), Completion::LostOwnership);
    assert_eq!(
        t.complete(&s, &second, &response(201), 1_200, 5_000, RecordWithoutIt)
            .unwrap(),
        Completion::Recorded
    );
    let Claim::Completed {
        slot,
        owner,
        status,
        ..
    } = t.claim(&s, &k, &fp, 9, 1_300, 1_000, || {}).unwrap()
    else {
        panic!("expected completed");
    };
    assert_eq!((owner, status), (8, 201));
    assert_eq!(
        t.load_response(&s, slot, owner).unwrap().unwrap().status,
        201
    );
}

#[test]
fn a_renewed_lease_is_not_taken_over_and_a_lost_one_cannot_be_renewed() {
    let s = FakeShared::default();
    let t = table(&s, 64);
    let first = held(
        t.claim(&s, &digest(1), &digest(9), 1, 0, 1_000, || {})
            .unwrap(),
    );
    assert_eq!(
        t.renew(&s, &first, 900, 1_000).unwrap(),
        Completion::Recorded
    );
    // Past the first lease, inside the renewed one: still in flight.
    assert!(matches!(
        t.claim(&s, &digest(1), &digest(9), 2, 1_500, 1_000, || {})
            .unwrap(),
        Claim::InFlight { .. }
    ));
    // A renewal never shortens the lease.
    assert_eq!(t.renew(&s, &first, 100, 10).unwrap(), Completion::Recorded);
    assert!(matches!(
        t.claim(&s, &digest(1), &digest(9), 2, 1_800, 1_000, || {})
            .unwrap(),
        Claim::InFlight { .. }
    ));
    // Unrenewed past its end, it is taken over, and the old owner cannot renew it back.
    let second = held(
        t.claim(&s, &digest(1), &digest(9), 3, 2_000, 1_000, || {})
            .unwrap(),
    );
    assert!(second.took_over);
    assert_eq!(
        t.renew(&s, &first, 2_100, 1_000).unwrap(),
        Completion::LostOwnership
    );
    // Nor is a completed record's TTL touched by a renewal.
    t.complete(
        &s,
        &second,
        &response(201),
        2_200,
        50_000,
        OversizedBody::RecordWithoutIt,
    )
    .unwrap();
    assert_eq!(
        t.renew(&s, &second, 2_300, 1_000).unwrap(),
        Completion::LostOwnership
    );
}

#[test]
fn release_lets_a_retry_execute() {
    let s = FakeShared::default();
    let t = table(&s, 64);
    let (k, fp) = (digest(1), digest(2));
    let h = held(t.claim(&s, &k, &fp, 7, 0, 1_000, || {}).unwrap());
    assert_eq!(t.release(&s, &h).unwrap(), Completion::Recorded);
    assert!(matches!(
        t.claim(&s, &k, &fp, 8, 1, 1_000, || {}).unwrap(),
        Claim::Claimed(_)
    ));
}

#[test]
fn a_full_bucket_reports_full_and_never_evicts_live_records() {
    let s = FakeShared::default();
    let t = table(&s, 1); // one bucket of WAYS slots
    assert_eq!(t.bucket_count(), 1);
    for n in 0..WAYS as u8 {
        held(
            t.claim(
                &s,
                &digest(10 + n),
                &digest(0),
                u64::from(n),
                0,
                1_000,
                || {},
            )
            .unwrap(),
        );
    }
    assert_eq!(
        t.claim(&s, &digest(99), &digest(0), 50, 10, 1_000, || {})
            .unwrap(),
        Claim::Full {
            kept_for_store: false
        }
    );
    // Every earlier claim is still in flight.
    for n in 0..WAYS as u8 {
        assert!(matches!(
            t.claim(&s, &digest(10 + n), &digest(0), 60, 20, 1_000, || {})
                .unwrap(),
            Claim::InFlight { .. }
        ));
    }
    // Once leases pass, slots are reused.
    assert!(matches!(
        t.claim(&s, &digest(99), &digest(0), 50, 1_000, 1_000, || {})
            .unwrap(),
        Claim::Claimed(_)
    ));
}

fn claim_and_record(t: &Table, s: &FakeShared, n: u8, now_ms: u64, body: usize) -> Completion {
    let h = held(
        t.claim(
            s,
            &digest(n),
            &digest(0),
            u64::from(n),
            now_ms,
            1_000,
            || {},
        )
        .unwrap(),
    );
    let mut r = response(201);
    r.body = vec![n; body];
    t.complete(s, &h, &r, now_ms, 60_000, RecordWithoutIt)
        .unwrap()
}

#[test]
fn a_full_bucket_evicts_its_oldest_completed_record_and_never_one_in_flight() {
    let s = FakeShared::default();
    let t = table(&s, 1); // one bucket: every key lands in it
                          // Slot 0 completed long ago, slot 1 recently, the others in flight.
    claim_and_record(&t, &s, 10, 100, 4);
    claim_and_record(&t, &s, 11, 900, 4);
    for n in 12..10 + WAYS as u8 {
        held(
            t.claim(&s, &digest(n), &digest(0), 50, 1_000, 60_000, || {})
                .unwrap(),
        );
    }
    let first = held(
        t.claim(&s, &digest(90), &digest(0), 90, 1_000, 60_000, || {})
            .unwrap(),
    );
    assert_eq!(first.evicted, Some(Evicted { age_ms: 900 }));
    let second = held(
        t.claim(&s, &digest(91), &digest(0), 91, 1_000, 60_000, || {})
            .unwrap(),
    );
    assert_eq!(second.evicted, Some(Evicted { age_ms: 100 }));
    // Only claims in flight remain: a new key finds the bucket full.
    assert_eq!(
        t.claim(&s, &digest(92), &digest(0), 92, 1_000, 60_000, || {})
            .unwrap(),
        Claim::Full {
            kept_for_store: false
        }
    );
    // The evicted keys are new again; the in-flight ones still answer 409.
    for n in 12..10 + WAYS as u8 {
        assert!(matches!(
            t.claim(&s, &digest(n), &digest(0), 60, 1_001, 60_000, || {})
                .unwrap(),
            Claim::InFlight { .. }
        ));
    }
}

#[test]
fn the_most_recent_records_of_a_bucket_always_replay() {
    let s = FakeShared::default();
    let t = table(&s, 1);
    for n in 0..100u8 {
        assert_eq!(
            claim_and_record(&t, &s, n, u64::from(n) * 10, 4),
            Completion::Recorded
        );
    }
    for n in 100 - WAYS as u8..100 {
        assert!(
            matches!(
                t.claim(&s, &digest(n), &digest(0), 999, 5_000, 1_000, || {})
                    .unwrap(),
                Claim::Completed { .. }
            ),
            "key {n}"
        );
    }
}

#[test]
fn a_large_response_is_kept_in_a_page_until_its_ring_comes_round() {
    let s = FakeShared::default();
    let t = table(&s, 64);
    let class = t.layout().class_for(100_000).unwrap();
    let pages = t.layout().classes[usize::from(class)].pages;
    assert_eq!(
        claim_and_record(&t, &s, 1, 0, 100_000),
        Completion::Recorded
    );
    let Claim::Completed { slot, owner, .. } = t
        .claim(&s, &digest(1), &digest(0), 99, 1, 1_000, || {})
        .unwrap()
    else {
        panic!("expected a replay");
    };
    let replay = t.load_response(&s, slot, owner).unwrap().unwrap();
    assert_eq!(replay.body, vec![1; 100_000]);
    assert!(!replay.body_omitted);
    // As many newer responses of that size as the ring has pages: the first page is reused.
    for n in 0..pages {
        let mut key = [0xEE; 32];
        key[..4].copy_from_slice(&n.to_be_bytes());
        let h = held(
            t.claim(&s, &key, &digest(0), 100 + u64::from(n), 10, 1_000, || {})
                .unwrap(),
        );
        let mut r = response(201);
        r.body = vec![2; 100_000];
        t.complete(&s, &h, &r, 10, 60_000, RecordWithoutIt).unwrap();
    }
    assert_eq!(t.load_response(&s, slot, owner).unwrap(), None);
}

#[test]
fn a_response_larger_than_every_page_is_recorded_without_its_body_or_left_to_the_store() {
    let s = FakeShared::default();
    let t = Table::new("test", Layout::plan(2 << 20, Some(64), 1 << 20).unwrap(), 0);
    t.create_buckets(&s).unwrap();
    assert_eq!(
        claim_and_record(&t, &s, 1, 0, 1 << 20),
        Completion::RecordedWithoutBody
    );
    let Claim::Completed {
        slot,
        owner,
        status,
        ..
    } = t
        .claim(&s, &digest(1), &digest(0), 99, 1, 1_000, || {})
        .unwrap()
    else {
        panic!("expected a replay");
    };
    let replay = t.load_response(&s, slot, owner).unwrap().unwrap();
    assert_eq!(
        (status, replay.status, replay.body_omitted),
        (201, 201, true)
    );
    assert!(replay.body.is_empty());
    assert_eq!(replay.headers, response(201).headers);

    // Cluster mode: the store has the body, so the slot is freed for the store to answer.
    let h = held(
        t.claim(&s, &digest(2), &digest(0), 2, 0, 1_000, || {})
            .unwrap(),
    );
    let mut big = response(201);
    big.body = vec![0; 1 << 20];
    assert_eq!(
        t.complete(&s, &h, &big, 1, 60_000, OversizedBody::LeaveToStore)
            .unwrap(),
        Completion::NotHeld
    );
    assert!(matches!(
        t.claim(&s, &digest(2), &digest(0), 3, 2, 1_000, || {})
            .unwrap(),
        Claim::Claimed(_)
    ));
}

#[test]
fn whatever_is_recorded_the_table_stays_within_its_layout_bound() {
    let s = FakeShared::default();
    let layout = Layout::plan(4 << 20, Some(64), 1 << 20).unwrap();
    let bound = layout.bound_bytes();
    let t = Table::new("test", layout, 0);
    t.create_buckets(&s).unwrap();
    let sizes = [0, 10, 1_500, 5_000, 20_000, 200_000, 900_000, 1 << 20];
    for round in 0..600u32 {
        let mut key = [0u8; 32];
        key[..4].copy_from_slice(&round.to_be_bytes());
        key[4] = 0xA5;
        let h = held(
            t.claim(
                &s,
                &key,
                &digest(0),
                u64::from(round),
                u64::from(round),
                1_000,
                || {},
            )
            .unwrap(),
        );
        let mut r = response(201);
        r.body = vec![7; sizes[round as usize % sizes.len()]];
        t.complete(&s, &h, &r, u64::from(round), 60_000, RecordWithoutIt)
            .unwrap();
        let entries = s
            .map
            .borrow()
            .keys()
            .filter(|k| k.starts_with("test/"))
            .count() as u64;
        let held_bytes =
            s.bytes_under("test/") as u64 + entries * crate::table::layout::ENTRY_OVERHEAD_BYTES;
        assert!(held_bytes <= bound, "round {round}: {held_bytes} > {bound}");
    }
}

#[test]
fn creating_buckets_never_clobbers_a_claim() {
    let s = FakeShared::default();
    let t = table(&s, 4);
    let (k, fp) = (digest(1), digest(2));
    held(t.claim(&s, &k, &fp, 7, 0, 1_000, || {}).unwrap());
    // Another worker configures later.
    t.create_buckets(&s).unwrap();
    assert!(matches!(
        t.claim(&s, &k, &fp, 8, 1, 1_000, || {}).unwrap(),
        Claim::InFlight { .. }
    ));
}

#[test]
fn a_stale_cas_makes_the_claim_retry_instead_of_overwriting() {
    // A shared data whose first write always loses, as if another worker wrote in between.
    struct Racing {
        inner: FakeShared,
        lose_next: RefCell<bool>,
    }
    impl SharedData for Racing {
        fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError> {
            if cas.is_some() && self.lose_next.replace(false) {
                // The rival claims the same key first.
                let t = Table::new("test", layout(4), 0);
                let rival = t
                    .claim(&self.inner, &digest(1), &digest(2), 99, 0, 1_000, || {})
                    .unwrap();
                assert!(matches!(rival, Claim::Claimed(_)));
                return Ok(SetOutcome::CasMismatch);
            }
            self.inner.set(key, value, cas)
        }
    }
    let s = Racing {
        inner: FakeShared::default(),
        lose_next: RefCell::new(false),
    };
    let t = table(&s.inner, 4);
    *s.lose_next.borrow_mut() = true;
    assert!(matches!(
        t.claim(&s, &digest(1), &digest(2), 7, 1, 1_000, || {})
            .unwrap(),
        Claim::InFlight { .. }
    ));
}

#[test]
fn a_configure_keeps_a_bucket_whose_cas_equals_the_create_marker() {
    let s = FakeShared::default();
    let t = table(&s, 8);
    let (k, fp) = (digest(1), digest(2));
    // The host's cas counter has wrapped around to the marker's value for this claim.
    *s.next_cas.borrow_mut() = CREATE_IF_ABSENT_CAS - 1;
    held(t.claim(&s, &k, &fp, 7, 0, 60_000, || {}).unwrap());
    assert_eq!(
        s.get(&t.bucket_key(0)).unwrap().map(|(_, cas)| cas),
        Some(CREATE_IF_ABSENT_CAS)
    );
    // An Istio push re-runs configure on every worker.
    t.create_buckets(&s).unwrap();
    assert!(matches!(
        t.claim(&s, &k, &fp, 8, 1, 60_000, || {}).unwrap(),
        Claim::InFlight { .. }
    ));
}

/// What another worker does, given the shared data.
type Rival<'a> = Box<dyn FnOnce(&FakeShared) + 'a>;

/// Shared data that lets another worker act right after a chosen read.
struct Interleaved<'a> {
    inner: &'a FakeShared,
    reads_before_rival: RefCell<usize>,
    rival: RefCell<Option<Rival<'a>>>,
}

impl SharedData for Interleaved<'_> {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        let seen = self.inner.get(key);
        let mut left = self.reads_before_rival.borrow_mut();
        if *left == 1 {
            if let Some(rival) = self.rival.borrow_mut().take() {
                rival(self.inner);
            }
        }
        *left = left.saturating_sub(1);
        seen
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError> {
        self.inner.set(key, value, cas)
    }
}

#[test]
fn a_late_finisher_never_overwrites_the_response_of_the_request_that_took_over() {
    let s = FakeShared::default();
    let t = table(&s, 8);
    let (k, fp) = (digest(1), digest(2));
    let late = held(t.claim(&s, &k, &fp, 7, 0, 1_000, || {}).unwrap());
    // Its lease has passed. Right after the late finisher reads the bucket and sees its
    // claim, another worker takes the key over, executes and records its own response.
    let rival_table = t.clone();
    let interleaved = Interleaved {
        inner: &s,
        reads_before_rival: RefCell::new(1),
        rival: RefCell::new(Some(Box::new(move |shared: &FakeShared| {
            let taker = held(
                rival_table
                    .claim(shared, &k, &fp, 8, 2_000, 1_000, || {})
                    .unwrap(),
            );
            assert!(taker.took_over);
            let mut theirs = response(201);
            theirs.body = b"the new owner's body".to_vec();
            assert_eq!(
                rival_table
                    .complete(shared, &taker, &theirs, 2_001, 60_000, RecordWithoutIt)
                    .unwrap(),
                Completion::Recorded
            );
        }))),
    };
    let mut mine = response(200);
    mine.body = b"the late finisher's body".to_vec();
    assert_eq!(
        t.complete(&interleaved, &late, &mine, 2_000, 60_000, RecordWithoutIt)
            .unwrap(),
        Completion::LostOwnership
    );
    let Claim::Completed { slot, owner, .. } =
        t.claim(&s, &k, &fp, 9, 3_000, 1_000, || {}).unwrap()
    else {
        panic!("expected the new owner's record");
    };
    assert_eq!(owner, 8);
    let replay = t.load_response(&s, slot, owner).unwrap().unwrap();
    assert_eq!(replay.body, b"the new owner's body");
}

#[test]
fn the_bucket_salt_is_made_once_per_process_and_moves_keys_between_buckets() {
    let s = FakeShared::default();
    let first = bucket_salt(&s, "ns", 1).unwrap();
    // Every later configure (another worker, a push) finds the same salt.
    assert_eq!(bucket_salt(&s, "ns", 2).unwrap(), first);
    let other_process = bucket_salt(&FakeShared::default(), "ns", 2).unwrap();
    assert_ne!(first, other_process);

    let here = Table::new("ns", layout(1024), first);
    let again = Table::new("ns", layout(1024), first);
    let there = Table::new("ns", layout(1024), other_process);
    let keys: Vec<Digest> = (0..64).map(digest).collect();
    assert!(keys.iter().all(|k| here.bucket_of(k) == again.bucket_of(k)));
    let moved = keys
        .iter()
        .filter(|k| here.bucket_of(k) != there.bucket_of(k))
        .count();
    assert!(moved > 48, "only {moved} of 64 keys changed bucket");
}

#[test]
fn a_bucket_changed_between_the_proof_and_the_flip_is_read_again_not_overwritten() {
    let s = FakeShared::default();
    let t = table(&s, 8); // one bucket: every key shares it
    let (k, fp, other) = (digest(1), digest(2), digest(3));
    let mine = held(t.claim(&s, &k, &fp, 7, 0, 60_000, || {}).unwrap());
    // Right after the completion's proof read, another worker claims another key of the
    // same bucket: the flip must not write back the bucket as the proof saw it.
    let rival_table = t.clone();
    let interleaved = Interleaved {
        inner: &s,
        reads_before_rival: RefCell::new(1),
        rival: RefCell::new(Some(Box::new(move |shared: &FakeShared| {
            let theirs = rival_table
                .claim(shared, &other, &fp, 8, 1_000, 60_000, || {})
                .unwrap();
            assert!(matches!(theirs, Claim::Claimed(_)));
        }))),
    };
    assert_eq!(
        t.complete(
            &interleaved,
            &mine,
            &response(201),
            1_000,
            60_000,
            RecordWithoutIt
        )
        .unwrap(),
        Completion::Recorded
    );
    assert!(matches!(
        t.claim(&s, &other, &fp, 9, 2_000, 60_000, || {}).unwrap(),
        Claim::InFlight { .. }
    ));
    let Claim::Completed { slot, owner, .. } =
        t.claim(&s, &k, &fp, 9, 2_000, 60_000, || {}).unwrap()
    else {
        panic!("expected the completed record");
    };
    assert_eq!(
        t.load_response(&s, slot, owner).unwrap().unwrap().status,
        201
    );
}

#[test]
fn a_claim_with_time_left_completes_with_one_bucket_write() {
    let s = FakeShared::default();
    let t = table(&s, 8);
    let (k, fp) = (digest(1), digest(2));
    let writes = || *s.next_cas.borrow();
    let h = held(t.claim(&s, &k, &fp, 7, 0, 60_000, || {}).unwrap());
    let before = writes();
    t.complete(&s, &h, &response(201), 1_000, 60_000, RecordWithoutIt)
        .unwrap();
    // The response and the flip to completed; no renewal.
    assert_eq!(writes() - before, 2);
    // Near the end of its lease a claim is renewed first.
    let h = held(t.claim(&s, &digest(3), &fp, 8, 0, 6_000, || {}).unwrap());
    let before = writes();
    t.complete(&s, &h, &response(201), 2_000, 60_000, RecordWithoutIt)
        .unwrap();
    assert_eq!(writes() - before, 3);
}

#[test]
fn corrupt_buckets_read_as_free() {
    assert_eq!(decode_bucket(b"junk"), [FREE_SLOT; WAYS]);
    let mut slots = [FREE_SLOT; WAYS];
    slots[0].state = SlotState::Completed;
    slots[0].owner = 5;
    assert_eq!(decode_bucket(&encode_bucket(&slots)), slots);
}

/// What a claim of `k` finds about the store: whether its record is still awaited there.
fn awaiting_store(t: &Table, s: &FakeShared, k: &Digest, fp: &Digest) -> bool {
    match t.claim(s, k, fp, 99, 3_000, 60_000, || {}).unwrap() {
        Claim::Completed {
            awaiting_store,
            status,
            ..
        } => {
            assert_eq!(status, 0, "an unknown outcome reads as status 0");
            awaiting_store
        }
        other => panic!("expected the record, got {other:?}"),
    }
}

#[test]
fn an_unknown_outcome_says_it_is_not_in_the_store_until_marked_so() {
    let s = FakeShared::default();
    let t = table(&s, 64);
    let (k, fp) = (digest(1), digest(2));
    let h = held(t.claim(&s, &k, &fp, 7, 1_000, 60_000, || {}).unwrap());
    let unknown = RecordedResponse::unknown_outcome(Default::default());
    let awaited = StoreCopy::Awaited;
    t.complete_with_store_copy(&s, &h, &unknown, 2_000, 10_000, RecordWithoutIt, awaited)
        .unwrap();
    assert!(awaiting_store(&t, &s, &k, &fp));
    // Another claim's mark (a stranger, or the key recorded again since) changes nothing.
    let stranger = Held {
        owner: 8,
        ..h.clone()
    };
    assert_eq!(
        t.mark_in_store(&s, &stranger).unwrap(),
        Completion::Recorded
    );
    assert!(awaiting_store(&t, &s, &k, &fp));
    t.mark_in_store(&s, &h).unwrap();
    assert!(!awaiting_store(&t, &s, &k, &fp));

    // A response carries the mark too, beside its own status, until its completion lands.
    let (k2, fp2) = (digest(3), digest(4));
    let h2 = held(t.claim(&s, &k2, &fp2, 9, 1_000, 60_000, || {}).unwrap());
    t.complete_with_store_copy(
        &s,
        &h2,
        &response(201),
        2_000,
        10_000,
        RecordWithoutIt,
        awaited,
    )
    .unwrap();
    assert!(matches!(
        t.claim(&s, &k2, &fp2, 10, 3_000, 60_000, || {}).unwrap(),
        Claim::Completed {
            status: 201,
            awaiting_store: true,
            ..
        }
    ));
    t.mark_in_store(&s, &h2).unwrap();
    assert!(matches!(
        t.claim(&s, &k2, &fp2, 10, 3_000, 60_000, || {}).unwrap(),
        Claim::Completed {
            status: 201,
            awaiting_store: false,
            ..
        }
    ));
}

#[test]
fn an_unknown_outcome_settled_into_another_keeps_waiting_for_the_store() {
    let s = FakeShared::default();
    let t = table(&s, 64);
    let (k, fp) = (digest(1), digest(2));
    let h = held(t.claim(&s, &k, &fp, 7, 1_000, 60_000, || {}).unwrap());
    let unknown = RecordedResponse::unknown_outcome(Default::default());
    t.complete_with_store_copy(
        &s,
        &h,
        &unknown,
        2_000,
        10_000,
        RecordWithoutIt,
        StoreCopy::Awaited,
    )
    .unwrap();
    let next = Settlement::Record {
        response: &unknown,
        ttl_ms: None,
        tombstone_ms: 0,
    };
    assert_eq!(
        t.settle_unknown(&s, &h, next, 2_500).unwrap(),
        Completion::Recorded
    );
    assert!(awaiting_store(&t, &s, &k, &fp));
}

#[test]
fn a_record_awaiting_the_store_is_never_evicted_until_marked_in_it() {
    let s = FakeShared::default();
    let t = table(&s, 1); // one bucket: every key lands in it
                          // The oldest record's completion has not reached the store; the others have.
    let pending = held(
        t.claim(&s, &digest(10), &digest(0), 10, 1, 60_000, || {})
            .unwrap(),
    );
    let awaited = StoreCopy::Awaited;
    t.complete_with_store_copy(
        &s,
        &pending,
        &response(201),
        100,
        60_000,
        RecordWithoutIt,
        awaited,
    )
    .unwrap();
    for n in 11..10 + WAYS as u8 {
        claim_and_record(&t, &s, n, 200 + u64::from(n), 4);
    }
    // Eviction takes the oldest record the store holds, never the pending one.
    for n in 0..(WAYS as u8 - 1) {
        held(
            t.claim(&s, &digest(90 + n), &digest(0), 90, 1_000, 60_000, || {})
                .unwrap(),
        );
    }
    assert_eq!(
        t.claim(&s, &digest(99), &digest(0), 99, 1_000, 60_000, || {})
            .unwrap(),
        Claim::Full {
            kept_for_store: true
        },
        "only claims in flight and the pending record"
    );
    assert!(
        matches!(
            t.claim(&s, &digest(10), &digest(9), 11, 1_000, 60_000, || {})
                .unwrap(),
            Claim::Mismatch
        ),
        "a reuse of its key with another payload still gets 422"
    );
    // Landed: it may go.
    t.mark_in_store(&s, &pending).unwrap();
    let taker = held(
        t.claim(&s, &digest(99), &digest(0), 99, 1_000, 60_000, || {})
            .unwrap(),
    );
    assert_eq!(taker.evicted, Some(Evicted { age_ms: 900 }));
}

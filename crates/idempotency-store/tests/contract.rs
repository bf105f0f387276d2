//! One behavioural contract, run against every storage backend.
//!
//! Memory and embedded expire by the service clock, so they get a
//! `ManualClock` and time moves instantly. Redis expires by its own clock, so
//! its harness uses short real leases and sleeps.

// Test code: a failed unwrap/index is a failed test, which is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use idempotency_store::clock::ManualClock;
use idempotency_store::storage::embedded::EmbeddedStorage;
use idempotency_store::storage::memory::MemoryStorage;
use idempotency_store::storage::redis::{ClusterMode, RedisStorage};
use idempotency_store::storage::{
    renew_batch, ClaimOutcome, CompleteOutcome, Digest, KeyPrefix, Lease, OwnerToken, RecordState,
    RecordView, ReleaseOutcome, RenewOutcome, Replacement, SettleOutcome, Storage,
};

use common::{random_digest, RedisCluster, RedisServer};
use idempotency_protocol::record::{RecordedResponse, UnknownOutcome};

const LONG_LEASE_MS: u64 = 60_000;
const LONG_TTL_MS: u64 = 86_400_000;

enum Time {
    Manual(Arc<ManualClock>),
    /// Backend owns the clock: expiry tests use `short_ms` and really wait.
    Real,
}

struct Harness {
    storage: Arc<dyn Storage>,
    time: Time,
    // Keeps the backing resources (temp dir, redis child) alive for the test.
    _guard: Box<dyn std::any::Any + Send>,
}

impl Harness {
    fn memory() -> Self {
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        Self {
            storage: Arc::new(MemoryStorage::new(clock.clone())),
            time: Time::Manual(clock),
            _guard: Box::new(()),
        }
    }

    fn embedded() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(ManualClock::new(1_700_000_000_000));
        let storage = EmbeddedStorage::open(dir.path(), clock.clone()).unwrap();
        Self {
            storage: Arc::new(storage),
            time: Time::Manual(clock),
            _guard: Box::new(dir),
        }
    }

    async fn redis() -> Self {
        let server = RedisServer::start();
        let storage = RedisStorage::connect(&server.url()).await.unwrap();
        Self {
            storage: Arc::new(storage),
            time: Time::Real,
            _guard: Box::new(server),
        }
    }

    async fn redis_cluster(cluster: &Arc<RedisCluster>) -> Self {
        let storage = RedisStorage::connect_to(&cluster.urls(), ClusterMode::Cluster)
            .await
            .unwrap();
        Self {
            storage: Arc::new(storage),
            time: Time::Real,
            _guard: Box::new(Arc::clone(cluster)),
        }
    }

    /// A lease/TTL short enough to outlive in a test.
    fn short_ms(&self) -> u64 {
        match self.time {
            Time::Manual(_) => 1_000,
            Time::Real => 200,
        }
    }

    /// Let `ms` pass (plus slack for the real clock).
    async fn pass(&self, ms: u64) {
        match &self.time {
            Time::Manual(c) => c.advance_ms(ms),
            Time::Real => tokio::time::sleep(Duration::from_millis(ms + 150)).await,
        }
    }

    fn s(&self) -> &dyn Storage {
        self.storage.as_ref()
    }

    /// Claims with a fresh owner, as the server does for a client that sent none.
    async fn claim(&self, key: &Digest, fp: &Digest, lease_ms: u64) -> ClaimOutcome {
        self.claim_as(key, fp, lease_ms, &OwnerToken::generate().unwrap())
            .await
    }

    async fn claim_as(
        &self,
        key: &Digest,
        fp: &Digest,
        lease_ms: u64,
        owner: &OwnerToken,
    ) -> ClaimOutcome {
        self.s().claim(key, fp, lease_ms, owner).await.unwrap()
    }

    async fn claim_owner(&self, key: &Digest, fp: &Digest, lease_ms: u64) -> OwnerToken {
        match self.claim(key, fp, lease_ms).await {
            ClaimOutcome::Claimed { owner, .. } => owner,
            other => panic!("expected claimed, got {other:?}"),
        }
    }

    async fn complete(
        &self,
        key: &Digest,
        owner: &OwnerToken,
        ttl: u64,
        rec: &[u8],
    ) -> CompleteOutcome {
        self.s()
            .complete(key, owner, ttl, rec.to_vec())
            .await
            .unwrap()
    }

    async fn release(&self, key: &Digest, owner: &OwnerToken) -> ReleaseOutcome {
        self.s().release(key, owner).await.unwrap()
    }

    async fn renew(&self, key: &Digest, owner: &OwnerToken, lease_ms: u64) -> RenewOutcome {
        self.s().renew(key, owner, lease_ms).await.unwrap()
    }

    /// Claims `key` for `owner`, which must succeed; answers the lease end.
    async fn claimed_until(
        &self,
        key: &Digest,
        fp: &Digest,
        lease_ms: u64,
        owner: &OwnerToken,
    ) -> u64 {
        match self.claim_as(key, fp, lease_ms, owner).await {
            ClaimOutcome::Claimed {
                lease_expires_at_ms,
                ..
            } => lease_expires_at_ms,
            other => panic!("expected claimed, got {other:?}"),
        }
    }

    /// What is stored for `key`, without the backend's clock at the read (which moves).
    async fn stored(&self, key: &Digest) -> Option<RecordView> {
        let view = self.s().lookup(key).await.unwrap()?;
        Some(RecordView { now_ms: 0, ..view })
    }

    async fn state(&self, key: &Digest) -> Option<RecordState> {
        self.s().lookup(key).await.unwrap().map(|v| v.state)
    }
}

fn foreign_owner() -> OwnerToken {
    OwnerToken::parse("deadbeefdeadbeefdeadbeefdeadbeef").unwrap()
}

async fn first_claim_claims(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let given = OwnerToken::generate().unwrap();
    let lease_end = match h.claim_as(&k, &fp, LONG_LEASE_MS, &given).await {
        ClaimOutcome::Claimed {
            owner,
            lease_expires_at_ms,
        } => {
            assert_eq!(owner, given, "the record is owned by the given token");
            assert!(lease_expires_at_ms > 1_600_000_000_000);
            lease_expires_at_ms
        }
        other => panic!("expected claimed, got {other:?}"),
    };
    let view = h.s().lookup(&k).await.unwrap().unwrap();
    assert_eq!(view.state, RecordState::InFlight);
    assert_eq!(view.fingerprint, fp);
    assert_eq!(view.record, None);
    assert_eq!(
        view.expires_at_ms, lease_end,
        "lookup reports the lease end"
    );
}

async fn second_claim_same_fingerprint_is_in_flight(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    match h.claim(&k, &fp, LONG_LEASE_MS).await {
        ClaimOutcome::InFlight { retry_after_ms } => {
            assert!(
                (1..=LONG_LEASE_MS).contains(&retry_after_ms),
                "{retry_after_ms}"
            );
        }
        other => panic!("expected in_flight, got {other:?}"),
    }
}

async fn different_fingerprint_is_mismatch_and_untouched(h: &Harness) {
    let (k, fp, other_fp) = (random_digest(), random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_eq!(
        h.claim(&k, &other_fp, LONG_LEASE_MS).await,
        ClaimOutcome::Mismatch
    );
    let view = h.s().lookup(&k).await.unwrap().unwrap();
    assert_eq!(
        (view.state, view.fingerprint),
        (RecordState::InFlight, fp.clone())
    );
    // The original owner's claim still stands.
    assert_eq!(
        h.complete(&k, &owner, LONG_TTL_MS, b"r").await,
        CompleteOutcome::Completed
    );
    // A completed record also refuses a different body.
    assert_eq!(
        h.claim(&k, &other_fp, LONG_LEASE_MS).await,
        ClaimOutcome::Mismatch
    );
}

async fn complete_then_claim_replays_bytes(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    let bytes: Vec<u8> = (0..=255u8).chain([0, 0, 13, 10]).collect();
    assert_eq!(
        h.complete(&k, &owner, LONG_TTL_MS, &bytes).await,
        CompleteOutcome::Completed
    );
    assert_eq!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Completed {
            record: bytes.clone()
        }
    );
    let view = h.s().lookup(&k).await.unwrap().unwrap();
    assert_eq!(view.state, RecordState::Completed);
    assert_eq!(view.record, Some(bytes));
}

async fn complete_by_wrong_owner_is_refused(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_eq!(
        h.complete(&k, &foreign_owner(), LONG_TTL_MS, b"x").await,
        CompleteOutcome::NotOwner
    );
    assert_eq!(h.state(&k).await, Some(RecordState::InFlight));
    assert_eq!(
        h.complete(&k, &owner, LONG_TTL_MS, b"ok").await,
        CompleteOutcome::Completed
    );
    // Completing a key nobody claimed is refused too.
    assert_eq!(
        h.complete(&random_digest(), &owner, LONG_TTL_MS, b"x")
            .await,
        CompleteOutcome::NotOwner
    );
}

async fn completed_record_is_never_overwritten(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_eq!(
        h.complete(&k, &owner, LONG_TTL_MS, b"first").await,
        CompleteOutcome::Completed
    );
    let before = h.stored(&k).await;
    assert_eq!(
        h.complete(&k, &owner, h.short_ms(), b"second").await,
        CompleteOutcome::NotOwner
    );
    assert_eq!(h.stored(&k).await, before, "bytes and expiry unchanged");
    assert_eq!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Completed {
            record: b"first".to_vec()
        }
    );
}

async fn release_by_owner_deletes(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_eq!(
        h.s().release(&k, &owner).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert_eq!(h.state(&k).await, None);
    // Released twice: nothing left to release.
    assert_eq!(
        h.s().release(&k, &owner).await.unwrap(),
        ReleaseOutcome::NotOwner
    );
    // The key is free again, even for another body.
    h.claim_owner(&k, &random_digest(), LONG_LEASE_MS).await;
}

async fn release_by_non_owner_is_refused(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_eq!(
        h.s().release(&k, &foreign_owner()).await.unwrap(),
        ReleaseOutcome::NotOwner
    );
    assert_eq!(h.state(&k).await, Some(RecordState::InFlight));
    // Nor can a completed record be released, even by its former owner.
    assert_eq!(
        h.complete(&k, &owner, LONG_TTL_MS, b"r").await,
        CompleteOutcome::Completed
    );
    assert_eq!(
        h.s().release(&k, &owner).await.unwrap(),
        ReleaseOutcome::NotOwner
    );
    assert_eq!(h.state(&k).await, Some(RecordState::Completed));
}

async fn lease_expiry_allows_takeover(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let short = h.short_ms();
    let old = h.claim_owner(&k, &fp, short).await;
    h.pass(short).await;
    assert_eq!(h.state(&k).await, None, "a lapsed lease reads as absent");
    let new = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_ne!(old, new);
    assert_eq!(
        h.complete(&k, &old, LONG_TTL_MS, b"late").await,
        CompleteOutcome::NotOwner
    );
    assert_eq!(
        h.s().release(&k, &old).await.unwrap(),
        ReleaseOutcome::NotOwner
    );
    assert_eq!(
        h.complete(&k, &new, LONG_TTL_MS, b"new").await,
        CompleteOutcome::Completed
    );
    assert_eq!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Completed {
            record: b"new".to_vec()
        }
    );
}

/// A record completed with a tombstone period answers whole until its TTL, then as its
/// tombstone (status and headers, the body omitted and marked) until that ends: a retry
/// replays, another payload is refused, and the sweeper's conversion changes neither.
async fn a_tombstone_outlives_the_whole_record(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let short = h.short_ms();
    let whole = RecordedResponse {
        owner: 1,
        status: 201,
        headers: vec![("content-type".into(), b"application/json".to_vec())],
        body: br#"{"order":1}"#.to_vec(),
        ..RecordedResponse::default()
    };
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_eq!(
        h.s()
            .complete_or_create(&k, &owner, short, 20 * short, whole.encode(), None)
            .await
            .unwrap(),
        CompleteOutcome::Completed
    );
    assert_eq!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Completed {
            record: whole.encode()
        }
    );
    let view = h.s().lookup(&k).await.unwrap().unwrap();
    assert_eq!(view.fingerprint, fp);
    let written_at_ms = view.written_at_ms.unwrap();
    assert_eq!(
        view.expires_at_ms,
        written_at_ms + 21 * short,
        "kept to the tombstone's end"
    );
    let retried_complete = || {
        h.s()
            .complete_or_create(&k, &owner, short, 20 * short, whole.encode(), None)
    };
    assert_eq!(
        retried_complete().await.unwrap(),
        CompleteOutcome::Completed
    );
    let other_response = RecordedResponse {
        status: 500,
        ..whole.clone()
    };
    let stranger = OwnerToken::parse("5e").unwrap();
    assert_eq!(
        h.s()
            .complete_or_create(
                &k,
                &stranger,
                short,
                20 * short,
                other_response.encode(),
                None
            )
            .await
            .unwrap(),
        CompleteOutcome::NotOwner
    );
    h.pass(short).await;
    h.s().sweep_expired().await.unwrap();
    let tombstone = whole.without_body();
    assert!(tombstone.body_omitted && tombstone.body.is_empty());
    for _ in 0..2 {
        assert_eq!(
            h.claim(&k, &fp, LONG_LEASE_MS).await,
            ClaimOutcome::Completed {
                record: tombstone.encode()
            }
        );
        assert_eq!(
            h.claim(&k, &random_digest(), LONG_LEASE_MS).await,
            ClaimOutcome::Mismatch
        );
        let view = h.s().lookup(&k).await.unwrap().unwrap();
        assert_eq!(view.record, Some(tombstone.encode()));
        assert_eq!(view.fingerprint, fp);
        assert_eq!(view.written_at_ms, Some(written_at_ms));
        assert_eq!(view.expires_at_ms, written_at_ms + 21 * short);
        let prefix = KeyPrefix::parse(&k.as_str()[..16]).unwrap();
        let found = h.s().find_by_prefix(&prefix, 20).await.unwrap();
        assert_eq!(
            found.keys,
            vec![k.clone()],
            "an operator finds it by its prefix"
        );
    }
    // A completion retried once the whole response has gone is still its own.
    assert_eq!(
        retried_complete().await.unwrap(),
        CompleteOutcome::Completed
    );
    h.pass(20 * short).await;
    h.s().sweep_expired().await.unwrap();
    assert_eq!(h.state(&k).await, None, "gone once its tombstone has ended");
    assert!(matches!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Claimed { .. }
    ));
}

/// Item 8 of "Never twice, never stuck": an attempt whose lease was taken
/// over can never overwrite the new owner's recorded response, whether it
/// finishes before, after or at the same time as the new owner.
async fn late_finisher_never_overwrites_the_new_owner(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let short = h.short_ms();
    let a = h.claim_owner(&k, &fp, short).await;
    h.pass(short).await;
    let b = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    // A finishes while B still runs: refused, B's claim untouched.
    assert_eq!(
        h.complete(&k, &a, LONG_TTL_MS, b"from A").await,
        CompleteOutcome::NotOwner
    );
    assert_eq!(h.state(&k).await, Some(RecordState::InFlight));
    assert_eq!(
        h.complete(&k, &b, LONG_TTL_MS, b"from B").await,
        CompleteOutcome::Completed
    );
    // A finishes after B recorded: refused, B's bytes stay.
    assert_eq!(
        h.complete(&k, &a, LONG_TTL_MS, b"from A").await,
        CompleteOutcome::NotOwner
    );
    assert_eq!(h.release(&k, &a).await, ReleaseOutcome::NotOwner);
    let view = h.s().lookup(&k).await.unwrap().unwrap();
    assert_eq!(view.record.as_deref(), Some(&b"from B"[..]));

    // A and B finish at the same moment: B's bytes win, every time.
    for _ in 0..5 {
        let (k, fp) = (random_digest(), random_digest());
        let a = h.claim_owner(&k, &fp, short).await;
        h.pass(short).await;
        let b = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
        let finish = |who: OwnerToken, bytes: &'static [u8]| {
            let (s, k) = (Arc::clone(&h.storage), k.clone());
            tokio::spawn(async move { s.complete(&k, &who, LONG_TTL_MS, bytes.to_vec()).await })
        };
        let (late, new) = (finish(a, b"from A"), finish(b, b"from B"));
        assert_eq!(late.await.unwrap().unwrap(), CompleteOutcome::NotOwner);
        assert_eq!(new.await.unwrap().unwrap(), CompleteOutcome::Completed);
        assert_eq!(
            h.claim(&k, &fp, LONG_LEASE_MS).await,
            ClaimOutcome::Completed {
                record: b"from B".to_vec()
            }
        );
    }
}

async fn ttl_expiry_allows_new_claim(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let short = h.short_ms();
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_eq!(
        h.complete(&k, &owner, short, b"r").await,
        CompleteOutcome::Completed
    );
    h.pass(short).await;
    assert_eq!(h.state(&k).await, None);
    // After the TTL even a different body may claim the key.
    h.claim_owner(&k, &random_digest(), LONG_LEASE_MS).await;
}

async fn given_owner_can_release_and_complete(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    // The client picks its token before calling, so it can release a claim
    // whose answer it never saw.
    let mine = OwnerToken::parse("00C0FFEE00c0ffee").unwrap();
    assert_eq!(mine.as_str(), "00c0ffee00c0ffee", "normalised to lowercase");
    assert!(matches!(
        h.claim_as(&k, &fp, LONG_LEASE_MS, &mine).await,
        ClaimOutcome::Claimed { owner, .. } if owner == mine
    ));
    // A claim that does not succeed does not hand the record to its owner.
    let other =
        OwnerToken::parse("0abba0000000000000000000000000000000000000000000000000000000000f")
            .unwrap();
    assert!(matches!(
        h.claim_as(&k, &fp, LONG_LEASE_MS, &other).await,
        ClaimOutcome::InFlight { .. }
    ));
    assert_eq!(h.release(&k, &other).await, ReleaseOutcome::NotOwner);
    assert_eq!(h.release(&k, &mine).await, ReleaseOutcome::Released);
    assert_eq!(h.state(&k).await, None);

    // Claimed again with the client's token: complete by it works too.
    assert!(matches!(
        h.claim_as(&k, &fp, LONG_LEASE_MS, &mine).await,
        ClaimOutcome::Claimed { owner, .. } if owner == mine
    ));
    assert_eq!(
        h.complete(&k, &foreign_owner(), LONG_TTL_MS, b"x").await,
        CompleteOutcome::NotOwner
    );
    assert_eq!(
        h.complete(&k, &mine, LONG_TTL_MS, b"done").await,
        CompleteOutcome::Completed
    );
    assert_eq!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Completed {
            record: b"done".to_vec()
        }
    );
}

async fn the_owner_asking_again_gets_its_claim_back(h: &Harness) {
    // A claim whose answer was lost: the client claims again with the same token.
    let (k, fp) = (random_digest(), random_digest());
    let mine = OwnerToken::parse("0123456789abcdef").unwrap();
    let ClaimOutcome::Claimed {
        lease_expires_at_ms: first_lease,
        ..
    } = h.claim_as(&k, &fp, LONG_LEASE_MS, &mine).await
    else {
        panic!("expected claimed");
    };
    match h.claim_as(&k, &fp, LONG_LEASE_MS, &mine).await {
        ClaimOutcome::Claimed {
            owner,
            lease_expires_at_ms,
        } => {
            assert_eq!(owner, mine);
            assert_eq!(
                lease_expires_at_ms, first_lease,
                "the lease is not extended"
            );
        }
        other => panic!("the owner's own claim is claimed again, got {other:?}"),
    }
    // Anyone else still finds it in flight, and another payload a mismatch.
    assert!(matches!(
        h.claim_as(&k, &fp, LONG_LEASE_MS, &foreign_owner()).await,
        ClaimOutcome::InFlight { .. }
    ));
    assert_eq!(
        h.claim_as(&k, &random_digest(), LONG_LEASE_MS, &mine).await,
        ClaimOutcome::Mismatch
    );
    // And it is still the owner's to complete.
    assert_eq!(
        h.complete(&k, &mine, LONG_TTL_MS, b"once").await,
        CompleteOutcome::Completed
    );
}

async fn retried_complete_with_same_bytes_succeeds_unchanged(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    let bytes: Vec<u8> = (0..=255u8).rev().chain([0, 0]).collect();
    assert_eq!(
        h.complete(&k, &owner, LONG_TTL_MS, &bytes).await,
        CompleteOutcome::Completed
    );
    let before = h.stored(&k).await.unwrap();
    // The retry asks for a much shorter TTL; the stored expiry must not move.
    let short = h.short_ms();
    assert_eq!(
        h.complete(&k, &owner, short, &bytes).await,
        CompleteOutcome::Completed
    );
    assert_eq!(h.stored(&k).await.unwrap(), before);
    h.pass(short).await;
    assert_eq!(
        h.state(&k).await,
        Some(RecordState::Completed),
        "the retry did not shorten the TTL"
    );
    // Empty bytes are bytes too.
    let (k2, fp2) = (random_digest(), random_digest());
    let owner2 = h.claim_owner(&k2, &fp2, LONG_LEASE_MS).await;
    for _ in 0..2 {
        assert_eq!(
            h.complete(&k2, &owner2, LONG_TTL_MS, b"").await,
            CompleteOutcome::Completed
        );
    }
    assert_eq!(
        h.complete(&k2, &owner2, LONG_TTL_MS, b"\0").await,
        CompleteOutcome::NotOwner
    );
}

async fn release_of_a_gone_record_is_not_owner(h: &Harness) {
    // Released before: the second release finds nothing.
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_eq!(h.release(&k, &owner).await, ReleaseOutcome::Released);
    assert_eq!(h.release(&k, &owner).await, ReleaseOutcome::NotOwner);

    // Expired and removed (Redis at lease end, the others by the sweeper).
    let (k, fp) = (random_digest(), random_digest());
    let short = h.short_ms();
    let owner = h.claim_owner(&k, &fp, short).await;
    h.pass(short).await;
    h.s().sweep_expired().await.unwrap();
    assert_eq!(h.release(&k, &owner).await, ReleaseOutcome::NotOwner);
    assert_eq!(h.state(&k).await, None);

    // Completed, then expired: nothing to release either.
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_eq!(
        h.complete(&k, &owner, short, b"r").await,
        CompleteOutcome::Completed
    );
    h.pass(short).await;
    assert_eq!(h.release(&k, &owner).await, ReleaseOutcome::NotOwner);
}

async fn concurrent_claims_have_one_winner(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (s, k, fp) = (Arc::clone(&h.storage), k.clone(), fp.clone());
        tasks.push(tokio::spawn(async move {
            let owner = OwnerToken::generate().unwrap();
            s.claim(&k, &fp, LONG_LEASE_MS, &owner).await
        }));
    }
    let (mut claimed, mut in_flight) = (0, 0);
    for t in tasks {
        match t.await.unwrap().unwrap() {
            ClaimOutcome::Claimed { .. } => claimed += 1,
            ClaimOutcome::InFlight { .. } => in_flight += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((claimed, in_flight), (1, 63));
}

/// A completion that waited out an outage longer than its claim's lease: the claim is gone
/// (Redis expired it; the sweeper removes it elsewhere) and nobody claimed the key since.
/// With the claim's fingerprint the write is recorded, so a retry replays it; a mismatching
/// payload still gets 422; without the fingerprint it is refused as before.
async fn complete_after_the_claim_is_gone_records_with_its_fingerprint(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let short = h.short_ms();
    let owner = h.claim_owner(&k, &fp, short).await;
    h.pass(short).await;
    h.s().sweep_expired().await.unwrap();
    assert_eq!(h.state(&k).await, None);
    assert_eq!(
        h.s()
            .complete_or_create(&k, &foreign_owner(), LONG_TTL_MS, 0, b"late".to_vec(), None)
            .await
            .unwrap(),
        CompleteOutcome::NotOwner
    );
    assert_eq!(
        h.s()
            .complete_or_create(&k, &owner, LONG_TTL_MS, 0, b"late".to_vec(), Some(&fp))
            .await
            .unwrap(),
        CompleteOutcome::Completed
    );
    assert_eq!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Completed {
            record: b"late".to_vec()
        }
    );
    assert_eq!(
        h.claim(&k, &random_digest(), LONG_LEASE_MS).await,
        ClaimOutcome::Mismatch
    );
}

/// The same late completion never lands on a key someone else claimed or completed since.
async fn complete_after_the_claim_is_gone_never_touches_a_newer_record(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let short = h.short_ms();
    let late = h.claim_owner(&k, &fp, short).await;
    h.pass(short).await;
    let newer = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_eq!(
        h.s()
            .complete_or_create(&k, &late, LONG_TTL_MS, 0, b"late".to_vec(), Some(&fp))
            .await
            .unwrap(),
        CompleteOutcome::NotOwner
    );
    assert_eq!(
        h.complete(&k, &newer, LONG_TTL_MS, b"newer").await,
        CompleteOutcome::Completed
    );
    assert_eq!(
        h.s()
            .complete_or_create(&k, &late, LONG_TTL_MS, 0, b"late".to_vec(), Some(&fp))
            .await
            .unwrap(),
        CompleteOutcome::NotOwner
    );
    assert_eq!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Completed {
            record: b"newer".to_vec()
        }
    );
}

/// A random key that starts with `prefix`.
fn key_with_prefix(prefix: &str) -> Digest {
    let tail = random_digest();
    Digest::parse(&format!("{prefix}{}", &tail.as_str()[prefix.len()..])).unwrap()
}

async fn lookup_shows_the_owner_and_when_the_record_was_written(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let owner = OwnerToken::generate().unwrap();
    h.claim_as(&k, &fp, LONG_LEASE_MS, &owner).await;
    let claimed = h.s().lookup(&k).await.unwrap().unwrap();
    assert_eq!(claimed.owner, Some(owner.clone()));
    let at = claimed.written_at_ms.expect("the claim's time is kept");
    assert_eq!(
        at + LONG_LEASE_MS,
        claimed.expires_at_ms,
        "claimed at the lease's start"
    );
    assert!(at <= claimed.now_ms, "{at} > {}", claimed.now_ms);
    h.pass(5).await;
    assert_eq!(
        h.complete(&k, &owner, LONG_TTL_MS, b"done").await,
        CompleteOutcome::Completed
    );
    let done = h.s().lookup(&k).await.unwrap().unwrap();
    assert_eq!(done.owner, None, "a completed record keeps no owner");
    let completed_at = done.written_at_ms.expect("the completion's time is kept");
    assert!(completed_at > at, "completed {completed_at}, claimed {at}");
    assert_eq!(completed_at + LONG_TTL_MS, done.expires_at_ms);
    assert!(completed_at <= done.now_ms);
}

async fn purge_removes_a_record_whatever_its_state(h: &Harness) {
    let (stuck, done, fp) = (random_digest(), random_digest(), random_digest());
    let owner = h.claim_owner(&stuck, &fp, LONG_LEASE_MS).await;
    let purged = h.s().purge(&stuck).await.unwrap().expect("a live claim");
    assert_eq!(purged.state, RecordState::InFlight);
    assert_eq!(purged.owner, Some(owner.clone()));
    assert_eq!(h.state(&stuck).await, None);
    assert_eq!(h.s().purge(&stuck).await.unwrap(), None, "nothing left");
    // The key is free at once, and the purged claimant has nothing left to release.
    assert!(matches!(
        h.claim(&stuck, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Claimed { .. }
    ));
    assert_eq!(h.release(&stuck, &owner).await, ReleaseOutcome::NotOwner);

    let o = h.claim_owner(&done, &fp, LONG_LEASE_MS).await;
    h.complete(&done, &o, LONG_TTL_MS, b"recorded").await;
    let purged = h
        .s()
        .purge(&done)
        .await
        .unwrap()
        .expect("a live completion");
    assert_eq!(purged.state, RecordState::Completed);
    assert_eq!(purged.record.as_deref(), Some(&b"recorded"[..]));
    // A retry now executes again instead of replaying.
    assert!(matches!(
        h.claim(&done, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Claimed { .. }
    ));
    assert_eq!(h.s().purge(&random_digest()).await.unwrap(), None);
}

async fn prefix_search_finds_live_records_in_key_order(h: &Harness) {
    let prefix = &random_digest().as_str()[..16].to_owned();
    let fp = random_digest();
    let mut live: Vec<Digest> = (0..3).map(|_| key_with_prefix(prefix)).collect();
    for k in &live {
        h.claim_owner(k, &fp, LONG_LEASE_MS).await;
    }
    let released = key_with_prefix(prefix);
    let o = h.claim_owner(&released, &fp, LONG_LEASE_MS).await;
    h.release(&released, &o).await;
    let lapsing = key_with_prefix(prefix);
    h.claim_owner(&lapsing, &fp, h.short_ms()).await;
    h.pass(h.short_ms()).await;
    live.sort();

    let find = |p: &str, limit: usize| {
        let p = KeyPrefix::parse(p).unwrap();
        async move { h.s().find_by_prefix(&p, limit).await.unwrap() }
    };
    let all = find(prefix, 20).await;
    assert_eq!(all.keys, live, "live records only, in key order");
    assert!(!all.truncated && all.exhaustive, "{all:?}");
    let upper = find(&prefix.to_uppercase(), 20).await;
    assert_eq!(upper.keys, live);
    let one = find(prefix, 1).await;
    assert_eq!(one.keys.len(), 1);
    assert!(one.truncated);
    assert!(live.contains(&one.keys[0]));
    let exact = find(live[1].as_str(), 20).await;
    assert_eq!(exact.keys, vec![live[1].clone()]);
    // The access log's 16 hex digits of a key that is not there: nothing, for sure.
    let absent = find(&random_digest().as_str()[..16], 20).await;
    assert!(absent.keys.is_empty() && !absent.truncated && absent.exhaustive);
}

/// The point of renew: a request still running upstream past its first lease keeps its key.
async fn a_renewed_claim_is_not_taken_over_until_its_renewed_lease_ends(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let short = h.short_ms();
    let mine = OwnerToken::generate().unwrap();
    let first_end = h.claimed_until(&k, &fp, short, &mine).await;
    let renewed_end = match h.renew(&k, &mine, 4 * short).await {
        RenewOutcome::Renewed {
            lease_expires_at_ms,
        } => lease_expires_at_ms,
        other => panic!("the owner renews its claim, got {other:?}"),
    };
    assert!(renewed_end > first_end, "{renewed_end} <= {first_end}");
    let view = h.s().lookup(&k).await.unwrap().unwrap();
    assert_eq!(
        (view.state, view.expires_at_ms, view.owner),
        (RecordState::InFlight, renewed_end, Some(mine.clone())),
        "lookup reports the renewed lease end"
    );
    // Past the first lease, within the renewed one: still the owner's.
    h.pass(short).await;
    assert!(matches!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::InFlight { .. }
    ));
    // Once the renewed lease has passed too, the key is taken over as any lapsed claim is.
    h.pass(4 * short).await;
    let taker = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_ne!(taker, mine);
    assert_eq!(
        h.renew(&k, &mine, LONG_LEASE_MS).await,
        RenewOutcome::NotOwner
    );
}

async fn a_claim_taken_over_is_not_renewed_for_its_old_owner(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let short = h.short_ms();
    let old = OwnerToken::generate().unwrap();
    h.claimed_until(&k, &fp, short, &old).await;
    h.pass(short).await;
    let new = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    let before = h.stored(&k).await;
    assert_eq!(
        h.renew(&k, &old, LONG_LEASE_MS).await,
        RenewOutcome::NotOwner
    );
    assert_eq!(h.stored(&k).await, before, "the new claim is untouched");
    assert_eq!(
        h.complete(&k, &new, LONG_TTL_MS, b"new").await,
        CompleteOutcome::Completed
    );
}

async fn a_renew_of_a_completed_or_absent_record_changes_nothing(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    assert_eq!(
        h.complete(&k, &owner, LONG_TTL_MS, b"done").await,
        CompleteOutcome::Completed
    );
    let before = h.stored(&k).await;
    assert_eq!(
        h.renew(&k, &owner, LONG_LEASE_MS).await,
        RenewOutcome::NotOwner
    );
    assert_eq!(h.stored(&k).await, before, "bytes and expiry unchanged");
    assert_eq!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Completed {
            record: b"done".to_vec()
        },
        "still replayed"
    );
    // A renew creates nothing, for a key never claimed or one released.
    let never = random_digest();
    assert_eq!(
        h.renew(&never, &owner, LONG_LEASE_MS).await,
        RenewOutcome::NotOwner
    );
    assert_eq!(h.state(&never).await, None);
    let released = random_digest();
    let o = h.claim_owner(&released, &fp, LONG_LEASE_MS).await;
    assert_eq!(h.release(&released, &o).await, ReleaseOutcome::Released);
    assert_eq!(
        h.renew(&released, &o, LONG_LEASE_MS).await,
        RenewOutcome::NotOwner
    );
    assert_eq!(h.state(&released).await, None);
}

async fn a_renew_never_shortens_a_lease(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let mine = OwnerToken::generate().unwrap();
    let end = h.claimed_until(&k, &fp, LONG_LEASE_MS, &mine).await;
    assert_eq!(
        h.renew(&k, &mine, 1).await,
        RenewOutcome::Renewed {
            lease_expires_at_ms: end
        }
    );
    assert_eq!(h.stored(&k).await.unwrap().expires_at_ms, end);
    h.pass(h.short_ms()).await;
    assert_eq!(h.state(&k).await, Some(RecordState::InFlight));
}

async fn a_batch_answers_the_indexes_of_the_leases_it_lost(h: &Harness) {
    let (fp, short) = (random_digest(), h.short_ms());
    let mine = OwnerToken::generate().unwrap();
    let keys: Vec<Digest> = (0..6).map(|_| random_digest()).collect();
    // 0 and 5: claims of mine; 1: someone else's; 2: completed; 3: released; 4: never claimed.
    h.claimed_until(&keys[1], &fp, LONG_LEASE_MS, &foreign_owner())
        .await;
    for i in [2, 3] {
        h.claimed_until(&keys[i], &fp, LONG_LEASE_MS, &mine).await;
    }
    h.complete(&keys[2], &mine, LONG_TTL_MS, b"r").await;
    h.release(&keys[3], &mine).await;
    // Short leases last, so that on the real clock they are still running at the batch.
    for i in [0, 5] {
        h.claimed_until(&keys[i], &fp, short, &mine).await;
    }
    let leases: Vec<Lease> = keys
        .iter()
        .map(|key| Lease {
            key: key.clone(),
            owner: mine.clone(),
        })
        .collect();
    assert_eq!(
        renew_batch(h.s(), &leases, 4 * short).await.unwrap(),
        vec![1, 2, 3, 4]
    );
    assert_eq!(h.state(&keys[4]).await, None, "a renew creates nothing");
    // The renewed claims outlive their first lease.
    h.pass(short).await;
    for i in [0, 5] {
        assert!(
            matches!(
                h.claim(&keys[i], &fp, LONG_LEASE_MS).await,
                ClaimOutcome::InFlight { .. }
            ),
            "lease {i}"
        );
    }
    let kept = [leases[5].clone(), leases[0].clone()];
    assert_eq!(
        renew_batch(h.s(), &kept, LONG_LEASE_MS).await.unwrap(),
        Vec::<u32>::new(),
        "every lease renewed: nothing lost"
    );
}

/// An unknown outcome is settled only while the key holds exactly the record the caller
/// names: replaced (fingerprint kept, expiry given or kept), or removed so the key is free;
/// anything else (another record, an in-flight claim, nothing, a retry of a settle that
/// landed) is left as it is.
async fn an_unknown_outcome_is_settled_only_where_it_still_is(h: &Harness) {
    let unknown = unknown_outcome("upstream_response_timeout");
    let resolved = b"IDR1 200 paid".to_vec();
    let settle = |current: &[u8], replacement: Option<Replacement>, k: Digest| {
        let current = current.to_vec();
        async move { h.s().settle(&k, &current, replacement).await.unwrap() }
    };
    let replaced = |ttl_ms| Replacement {
        record: resolved.clone(),
        ttl_ms,
        tombstone_ms: 0,
    };

    // Took effect, keeping the unknown outcome's expiry.
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    h.complete(&k, &owner, LONG_TTL_MS, &unknown).await;
    let before = h.stored(&k).await.unwrap();
    assert_eq!(
        settle(
            &unknown_outcome("another unknown outcome"),
            Some(replaced(None)),
            k.clone()
        )
        .await,
        SettleOutcome::NotFound
    );
    assert_eq!(
        settle(&unknown, Some(replaced(None)), k.clone()).await,
        SettleOutcome::Replaced
    );
    let after = h.stored(&k).await.unwrap();
    assert_eq!(after.record.as_deref(), Some(resolved.as_slice()));
    assert_eq!(after.fingerprint, fp, "the payload it was for stays");
    assert!(
        after.expires_at_ms.abs_diff(before.expires_at_ms) <= 1_000,
        "{} vs {}",
        after.expires_at_ms,
        before.expires_at_ms
    );
    assert_eq!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Completed {
            record: resolved.clone()
        }
    );
    // Its retry (the answer was lost) finds its own result and changes nothing.
    assert_eq!(
        settle(&unknown, Some(replaced(None)), k.clone()).await,
        SettleOutcome::NotFound
    );

    // Took effect, kept a TTL of its own from now.
    let k = random_digest();
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    h.complete(&k, &owner, 60_000, &unknown).await;
    assert_eq!(
        settle(&unknown, Some(replaced(Some(LONG_TTL_MS))), k.clone()).await,
        SettleOutcome::Replaced
    );
    let kept = h.stored(&k).await.unwrap();
    assert!(kept.expires_at_ms > 1_600_000_000_000 + LONG_TTL_MS / 2);

    // Never ran: removed, and the key is free.
    let k = random_digest();
    let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
    h.complete(&k, &owner, LONG_TTL_MS, &unknown).await;
    assert_eq!(
        settle(&unknown, None, k.clone()).await,
        SettleOutcome::Removed
    );
    assert_eq!(h.state(&k).await, None);
    assert!(matches!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Claimed { .. }
    ));

    // A claim in flight, and a key with nothing, are never touched.
    assert_eq!(
        settle(&unknown, None, k.clone()).await,
        SettleOutcome::NotFound
    );
    assert_eq!(h.state(&k).await, Some(RecordState::InFlight));
    let nothing = random_digest();
    assert_eq!(
        settle(&unknown, Some(replaced(None)), nothing.clone()).await,
        SettleOutcome::NotFound
    );
    assert_eq!(h.state(&nothing).await, None);
}

/// The record of an unknown outcome as a filter writes it; `details` tells two apart.
fn unknown_outcome(details: &str) -> Vec<u8> {
    RecordedResponse::unknown_outcome(UnknownOutcome {
        proxy_status: 504,
        details: details.to_owned(),
        attempts: 1,
        ..UnknownOutcome::default()
    })
    .encode()
}

/// A settle replaces or removes only an unknown outcome. A recorded response, named byte for
/// byte (anyone with the data-plane token can look it up), stays as it is, so its write never
/// runs again and its retries replay what it answered; its tombstone likewise.
async fn a_recorded_response_is_never_settled(h: &Harness) {
    let paid = RecordedResponse {
        status: 201,
        body: br#"{"charge":1}"#.to_vec(),
        ..RecordedResponse::default()
    }
    .encode();
    let rewritten = Replacement {
        record: unknown_outcome("rewritten"),
        ttl_ms: None,
        tombstone_ms: 0,
    };
    for tombstone_ms in [0, LONG_TTL_MS] {
        let (k, fp) = (random_digest(), random_digest());
        let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
        h.s()
            .complete_or_create(&k, &owner, LONG_TTL_MS, tombstone_ms, paid.clone(), None)
            .await
            .unwrap();
        let before = h.stored(&k).await.unwrap();
        let looked_up = before.record.clone().unwrap();
        assert_eq!(looked_up, paid);
        for replacement in [None, Some(rewritten.clone())] {
            assert_eq!(
                h.s().settle(&k, &looked_up, replacement).await.unwrap(),
                SettleOutcome::NotFound,
                "tombstone_ms {tombstone_ms}"
            );
        }
        assert_eq!(h.stored(&k).await, Some(before), "nothing changed");
        assert_eq!(
            h.claim(&k, &fp, LONG_LEASE_MS).await,
            ClaimOutcome::Completed {
                record: paid.clone()
            },
            "a retry replays, never runs again"
        );
    }
}

/// An unknown outcome settled as taken effect, with a tombstone, is kept exactly as a
/// completion with that tombstone: whole until its TTL (given, or the unknown outcome's), then
/// without its body until the tombstone's end, so a late redelivery replays its status and
/// never runs the write again.
async fn a_settled_answer_keeps_its_tombstone(h: &Harness) {
    let short = h.short_ms();
    let charged = RecordedResponse {
        status: 200,
        headers: vec![("idempotent-resolved".into(), b"true".to_vec())],
        body: br#"{"charge":1}"#.to_vec(),
        ..RecordedResponse::default()
    };
    let unknown = unknown_outcome("upstream_response_timeout");
    for ttl_ms in [Some(short), None] {
        let (k, fp) = (random_digest(), random_digest());
        let owner = h.claim_owner(&k, &fp, LONG_LEASE_MS).await;
        h.complete(&k, &owner, short, &unknown).await;
        let unknown_until = h.stored(&k).await.unwrap().expires_at_ms;
        let took_effect = Replacement {
            record: charged.encode(),
            ttl_ms,
            tombstone_ms: 20 * short,
        };
        assert_eq!(
            h.s().settle(&k, &unknown, Some(took_effect)).await.unwrap(),
            SettleOutcome::Replaced
        );
        let whole = h.stored(&k).await.unwrap();
        assert_eq!(whole.record, Some(charged.encode()));
        let ttl_end = match ttl_ms {
            Some(ttl) => whole.written_at_ms.unwrap() + ttl,
            None => unknown_until,
        };
        assert_eq!(
            whole.expires_at_ms,
            ttl_end + 20 * short,
            "kept to the tombstone's end ({ttl_ms:?})"
        );
        h.pass(short).await;
        h.s().sweep_expired().await.unwrap();
        let tombstone = charged.without_body().encode();
        assert_eq!(
            h.claim(&k, &fp, LONG_LEASE_MS).await,
            ClaimOutcome::Completed {
                record: tombstone.clone()
            },
            "past its TTL a redelivery gets the tombstone ({ttl_ms:?})"
        );
        assert_eq!(
            h.claim(&k, &random_digest(), LONG_LEASE_MS).await,
            ClaimOutcome::Mismatch
        );
        let kept = h.stored(&k).await.unwrap();
        assert_eq!(
            (kept.record, kept.fingerprint, kept.expires_at_ms),
            (Some(tombstone), fp, ttl_end + 20 * short)
        );
    }
}

macro_rules! contract_suite {
    ($backend:ident, $harness:expr) => {
        mod $backend {
            use super::*;

            contract_suite!(@cases $harness;
                first_claim_claims,
                second_claim_same_fingerprint_is_in_flight,
                different_fingerprint_is_mismatch_and_untouched,
                complete_then_claim_replays_bytes,
                complete_by_wrong_owner_is_refused,
                completed_record_is_never_overwritten,
                release_by_owner_deletes,
                release_by_non_owner_is_refused,
                lease_expiry_allows_takeover,
                late_finisher_never_overwrites_the_new_owner,
                ttl_expiry_allows_new_claim,
                given_owner_can_release_and_complete,
                the_owner_asking_again_gets_its_claim_back,
                retried_complete_with_same_bytes_succeeds_unchanged,
                release_of_a_gone_record_is_not_owner,
                concurrent_claims_have_one_winner,
                complete_after_the_claim_is_gone_records_with_its_fingerprint,
                complete_after_the_claim_is_gone_never_touches_a_newer_record,
                lookup_shows_the_owner_and_when_the_record_was_written,
                purge_removes_a_record_whatever_its_state,
                prefix_search_finds_live_records_in_key_order,
                a_renewed_claim_is_not_taken_over_until_its_renewed_lease_ends,
                a_claim_taken_over_is_not_renewed_for_its_old_owner,
                a_renew_of_a_completed_or_absent_record_changes_nothing,
                a_renew_never_shortens_a_lease,
                a_batch_answers_the_indexes_of_the_leases_it_lost,
                an_unknown_outcome_is_settled_only_where_it_still_is,
                a_recorded_response_is_never_settled,
                a_settled_answer_keeps_its_tombstone,
                a_tombstone_outlives_the_whole_record,
            );
        }
    };
    (@cases $harness:expr; $($case:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let h = $harness;
                super::$case(&h).await;
            }
        )+
    };
}

contract_suite!(memory, Harness::memory());
contract_suite!(embedded, Harness::embedded());
contract_suite!(redis, Harness::redis().await);

/// The whole contract on a real six-node Redis Cluster: one cluster for every case (each
/// uses keys of its own, spread over the three primaries' slots), run in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_contract_holds_on_a_redis_cluster() {
    let cluster = Arc::new(RedisCluster::start());
    let h = Harness::redis_cluster(&cluster).await;
    first_claim_claims(&h).await;
    second_claim_same_fingerprint_is_in_flight(&h).await;
    different_fingerprint_is_mismatch_and_untouched(&h).await;
    complete_then_claim_replays_bytes(&h).await;
    complete_by_wrong_owner_is_refused(&h).await;
    completed_record_is_never_overwritten(&h).await;
    release_by_owner_deletes(&h).await;
    release_by_non_owner_is_refused(&h).await;
    lease_expiry_allows_takeover(&h).await;
    late_finisher_never_overwrites_the_new_owner(&h).await;
    ttl_expiry_allows_new_claim(&h).await;
    given_owner_can_release_and_complete(&h).await;
    the_owner_asking_again_gets_its_claim_back(&h).await;
    retried_complete_with_same_bytes_succeeds_unchanged(&h).await;
    release_of_a_gone_record_is_not_owner(&h).await;
    concurrent_claims_have_one_winner(&h).await;
    complete_after_the_claim_is_gone_records_with_its_fingerprint(&h).await;
    complete_after_the_claim_is_gone_never_touches_a_newer_record(&h).await;
    lookup_shows_the_owner_and_when_the_record_was_written(&h).await;
    purge_removes_a_record_whatever_its_state(&h).await;
    a_renewed_claim_is_not_taken_over_until_its_renewed_lease_ends(&h).await;
    a_claim_taken_over_is_not_renewed_for_its_old_owner(&h).await;
    a_renew_of_a_completed_or_absent_record_changes_nothing(&h).await;
    a_renew_never_shortens_a_lease(&h).await;
    an_unknown_outcome_is_settled_only_where_it_still_is(&h).await;
    a_recorded_response_is_never_settled(&h).await;
    a_settled_answer_keeps_its_tombstone(&h).await;
    // Its keys live on every primary: one batch renews on all of them.
    a_batch_answers_the_indexes_of_the_leases_it_lost(&h).await;
    // Keys with one prefix live on every primary (the whole digest is the hash tag), so the
    // search must walk them all.
    prefix_search_finds_live_records_in_key_order(&h).await;
    // Many keys: every primary owns some of them, and each is served where its slot lives.
    for _ in 0..64 {
        first_claim_claims(&h).await;
    }

    // One seed URL and no `--redis-cluster`: the store sees a cluster node and uses the
    // cluster client, so keys of every primary's slots are claimed (a plain client claimed
    // only the seed's third and got MOVED for the rest).
    let seed = format!("redis://127.0.0.1:{}/", cluster.ports[0]);
    let one = RedisStorage::connect_to(&seed, ClusterMode::Auto)
        .await
        .unwrap();
    claims_land_on_every_primary(&one).await;

    // `--redis-cluster=false` on a cluster node: refused at start, not MOVED at run time.
    let Err(refused) = RedisStorage::connect_to(&seed, ClusterMode::Single).await else {
        panic!("a cluster node taken for a single server");
    };
    let refused = refused.to_string();
    assert!(
        refused.contains("is a cluster node") && refused.contains("MOVED"),
        "{refused}"
    );

    // A user whose ACL denies INFO, on every node: the store cannot ask, so `auto` refuses to
    // start with the reason (it used to take the seed for a single server and fail two thirds
    // of the keys with MOVED), and `--redis-cluster` (no question asked) works.
    for port in &cluster.ports {
        let acl = std::process::Command::new("redis-cli")
            .args(["-p", &port.to_string()])
            .args([
                "ACL", "SETUSER", "store", "on", ">pw", "~*", "&*", "+@all", "-info",
            ])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&acl.stdout).trim(), "OK");
    }
    let as_user = format!("redis://store:pw@127.0.0.1:{}/", cluster.ports[0]);
    let Err(refused) = RedisStorage::connect_to(&as_user, ClusterMode::Auto).await else {
        panic!("a seed that cannot be asked was guessed at");
    };
    let refused = refused.to_string();
    assert!(
        refused.contains("INFO cluster failed") && refused.contains("--redis-cluster"),
        "{refused}"
    );
    let told = RedisStorage::connect_to(&as_user, ClusterMode::Cluster)
        .await
        .unwrap();
    claims_land_on_every_primary(&told).await;
}

/// Claims of random keys, whose slots belong to every primary: each is claimed (a plain
/// client on one node got MOVED for the others' slots).
async fn claims_land_on_every_primary(storage: &RedisStorage) {
    let fp = random_digest();
    for _ in 0..60 {
        let owner = OwnerToken::generate().unwrap();
        let claimed = storage
            .claim(&random_digest(), &fp, LONG_LEASE_MS, &owner)
            .await;
        assert!(
            matches!(claimed, Ok(ClaimOutcome::Claimed { .. })),
            "{claimed:?}"
        );
    }
}

// Service-clock backends only: behaviour that Redis's own expiry cannot show
// (it deletes a lapsed lease at once) or that needs exact time.

async fn late_complete_without_takeover_succeeds(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, 1_000).await;
    h.pass(5_000).await;
    assert_eq!(
        h.complete(&k, &owner, LONG_TTL_MS, b"late").await,
        CompleteOutcome::Completed
    );
    assert_eq!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::Completed {
            record: b"late".to_vec()
        }
    );
}

async fn late_release_without_takeover_or_sweep_releases(h: &Harness) {
    // Like a late complete: a lapsed lease nobody took over still belongs to
    // its owner until the sweeper removes it (Redis has removed it already).
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, 1_000).await;
    h.pass(5_000).await;
    assert_eq!(h.release(&k, &owner).await, ReleaseOutcome::Released);
    assert_eq!(h.release(&k, &owner).await, ReleaseOutcome::NotOwner);
}

async fn retried_complete_after_ttl_is_not_owner(h: &Harness) {
    // Same bytes, but the completion has expired: it is gone, not confirmed.
    let (k, fp) = (random_digest(), random_digest());
    let owner = h.claim_owner(&k, &fp, 1_000).await;
    assert_eq!(
        h.complete(&k, &owner, 2_000, b"r").await,
        CompleteOutcome::Completed
    );
    h.pass(2_000).await;
    assert_eq!(
        h.complete(&k, &owner, 2_000, b"r").await,
        CompleteOutcome::NotOwner
    );
}

async fn retry_after_counts_down(h: &Harness) {
    let (k, fp) = (random_digest(), random_digest());
    h.claim_owner(&k, &fp, 10_000).await;
    h.pass(9_999).await;
    assert_eq!(
        h.claim(&k, &fp, 10_000).await,
        ClaimOutcome::InFlight { retry_after_ms: 1 }
    );
    h.pass(1).await;
    assert!(matches!(
        h.claim(&k, &fp, 10_000).await,
        ClaimOutcome::Claimed { .. }
    ));
}

async fn sweep_removes_only_expired(h: &Harness) {
    let (live, lapsed, done) = (random_digest(), random_digest(), random_digest());
    let fp = random_digest();
    h.claim_owner(&live, &fp, 100_000).await;
    h.claim_owner(&lapsed, &fp, 1_000).await;
    let o = h.claim_owner(&done, &fp, 1_000).await;
    assert_eq!(
        h.complete(&done, &o, 2_000, b"r").await,
        CompleteOutcome::Completed
    );
    assert_eq!(h.s().sweep_expired().await.unwrap(), 0);
    h.pass(3_000).await;
    assert_eq!(h.s().sweep_expired().await.unwrap(), 2);
    assert_eq!(h.state(&live).await, Some(RecordState::InFlight));
}

async fn a_lapsed_lease_nobody_took_over_is_renewed(h: &Harness) {
    // As with a late complete or release: the lapsed claim is still its owner's until a
    // takeover or the sweeper (Redis has removed it already).
    let (k, fp) = (random_digest(), random_digest());
    let mine = OwnerToken::generate().unwrap();
    h.claimed_until(&k, &fp, 1_000, &mine).await;
    h.pass(5_000).await;
    assert_eq!(h.state(&k).await, None, "a lapsed lease reads as absent");
    assert!(matches!(
        h.renew(&k, &mine, 10_000).await,
        RenewOutcome::Renewed { .. }
    ));
    assert_eq!(
        h.claim(&k, &fp, LONG_LEASE_MS).await,
        ClaimOutcome::InFlight {
            retry_after_ms: 10_000
        }
    );
    // The expiry index moved with the lease: a sweep leaves the renewed claim.
    assert_eq!(h.s().sweep_expired().await.unwrap(), 0);
    assert_eq!(h.state(&k).await, Some(RecordState::InFlight));
}

macro_rules! clock_suite {
    ($backend:ident, $harness:expr) => {
        mod $backend {
            use super::*;
            contract_suite!(@cases $harness;
                late_complete_without_takeover_succeeds,
                late_release_without_takeover_or_sweep_releases,
                retried_complete_after_ttl_is_not_owner,
                retry_after_counts_down,
                sweep_removes_only_expired,
                a_lapsed_lease_nobody_took_over_is_renewed,
            );
        }
    };
}

mod service_clock {
    use super::*;
    clock_suite!(memory, Harness::memory());
    clock_suite!(embedded, Harness::embedded());
}

#[tokio::test]
async fn embedded_completed_record_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let (k, fp) = (random_digest(), random_digest());
    {
        let s = EmbeddedStorage::open(dir.path(), clock.clone()).unwrap();
        let mine = OwnerToken::generate().unwrap();
        let ClaimOutcome::Claimed { owner, .. } = s.claim(&k, &fp, 1_000, &mine).await.unwrap()
        else {
            panic!("expected claimed");
        };
        let outcome = s
            .complete(&k, &owner, LONG_TTL_MS, b"persisted".to_vec())
            .await
            .unwrap();
        assert_eq!(outcome, CompleteOutcome::Completed);
    }
    let s = EmbeddedStorage::open(dir.path(), clock).unwrap();
    assert!(s.path().ends_with("idempotency.redb"));
    assert_eq!(
        s.claim(&k, &fp, 1_000, &OwnerToken::generate().unwrap())
            .await
            .unwrap(),
        ClaimOutcome::Completed {
            record: b"persisted".to_vec()
        }
    );
}

#[tokio::test]
async fn redis_records_are_one_string_under_a_cluster_safe_key() {
    let server = RedisServer::start();
    let s = RedisStorage::connect(&server.url()).await.unwrap();
    let (k, fp) = (random_digest(), random_digest());
    s.claim(&k, &fp, LONG_LEASE_MS, &OwnerToken::generate().unwrap())
        .await
        .unwrap();
    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let key = format!("idem:{{{}}}", k.as_str());
    let kind: String = ::redis::cmd("TYPE")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(kind, "string", "a packed record (one string, not a hash)");
    let pttl: i64 = ::redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        pttl > 0 && pttl <= 60_000,
        "lease expiry set by Redis: {pttl}"
    );
}

#[tokio::test]
async fn a_redis_prefix_search_stops_after_about_a_hundred_thousand_keys() {
    let server = RedisServer::start();
    let s = RedisStorage::connect(&server.url()).await.unwrap();
    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    // Three times the bound's keys (none of them a record): a search walks them all in vain.
    // In short scripts: one long one would outlast the client's response timeout.
    for batch in 0..30 {
        let _: () = ::redis::cmd("EVAL")
            .arg("for i = 1, 10000 do redis.call('SET', 'other:' .. ARGV[1] .. ':' .. i, 'x') end")
            .arg(0)
            .arg(batch)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let filled: i64 = ::redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    assert_eq!(filled, 300_000);
    let k = random_digest();
    let found = s
        .find_by_prefix(&KeyPrefix::parse(&k.as_str()[..16]).unwrap(), 20)
        .await
        .unwrap();
    assert!(found.keys.is_empty());
    assert!(
        !found.exhaustive,
        "bounded at {} SCAN calls of 1,000: not every key was looked at",
        idempotency_store::storage::redis::SCAN_MAX_CALLS
    );
}

#[tokio::test]
async fn redis_records_from_before_the_write_time_are_read_and_purged() {
    let server = RedisServer::start();
    let s = RedisStorage::connect(&server.url()).await.unwrap();
    let (k, fp) = (random_digest(), random_digest());
    // What the previous release wrote for a claim: no `written_at_ms` field.
    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let key = format!("idem:{{{}}}", k.as_str());
    let _: () = ::redis::cmd("HSET")
        .arg(&key)
        .arg(&[
            "state",
            "in_flight",
            "fingerprint",
            fp.as_str(),
            "owner",
            "0a1b",
        ])
        .arg(&["expires_at_ms", "4102444800000"])
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = ::redis::cmd("PEXPIRE")
        .arg(&key)
        .arg(LONG_LEASE_MS)
        .query_async(&mut conn)
        .await
        .unwrap();
    let view = s.lookup(&k).await.unwrap().unwrap();
    assert_eq!(view.state, RecordState::InFlight);
    assert_eq!(view.owner, Some(OwnerToken::parse("0a1b").unwrap()));
    assert_eq!(view.written_at_ms, None);
    assert!(
        view.now_ms > 1_600_000_000_000,
        "Redis's clock: {}",
        view.now_ms
    );
    let prefix = KeyPrefix::parse(&k.as_str()[..16]).unwrap();
    assert_eq!(
        s.find_by_prefix(&prefix, 20).await.unwrap().keys,
        vec![k.clone()]
    );
    assert_eq!(
        s.purge(&k).await.unwrap().map(|v| v.state),
        Some(RecordState::InFlight)
    );
    let exists: i64 = ::redis::cmd("EXISTS")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0, "DEL on the record's hash");
}

#[tokio::test]
async fn redis_renew_moves_the_key_expiry_with_the_lease() {
    let server = RedisServer::start();
    let s = RedisStorage::connect(&server.url()).await.unwrap();
    let (k, fp) = (random_digest(), random_digest());
    let mine = OwnerToken::generate().unwrap();
    s.claim(&k, &fp, 1_000, &mine).await.unwrap();
    let RenewOutcome::Renewed {
        lease_expires_at_ms,
    } = s.renew(&k, &mine, LONG_LEASE_MS).await.unwrap()
    else {
        panic!("renewed");
    };
    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let key = format!("idem:{{{}}}", k.as_str());
    let pttl: i64 = ::redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        pttl > 1_000 && pttl <= 60_000,
        "Redis deletes the key at the renewed lease end: {pttl}"
    );
    let stored = s.lookup(&k).await.unwrap().unwrap().expires_at_ms;
    assert_eq!(stored, lease_expires_at_ms);
}

/// Writes a record as the store before packed strings did: a hash, its lease or TTL on
/// Redis's expiry.
async fn legacy_hash(
    conn: &mut ::redis::aio::MultiplexedConnection,
    k: &Digest,
    fields: &[(&str, &str)],
) {
    let key = format!("idem:{{{}}}", k.as_str());
    let mut hset = ::redis::cmd("HSET");
    hset.arg(&key);
    for (name, value) in fields {
        hset.arg(*name).arg(*value);
    }
    let _: () = hset.query_async(conn).await.unwrap();
    let _: () = ::redis::cmd("PEXPIRE")
        .arg(&key)
        .arg(LONG_LEASE_MS)
        .query_async(conn)
        .await
        .unwrap();
}

/// An unknown outcome an earlier store wrote as a hash is settled like a packed one.
#[tokio::test]
async fn redis_unknown_outcomes_an_earlier_store_wrote_as_hashes_are_settled() {
    let server = RedisServer::start();
    let s = RedisStorage::connect(&server.url()).await.unwrap();
    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let fp = random_digest();
    // Unknown outcomes whose every byte is ASCII, as the hash fields here are text.
    let ascii_unknown = |details: &str| {
        let outcome = UnknownOutcome {
            details: details.to_owned(),
            ..UnknownOutcome::default()
        };
        String::from_utf8(RecordedResponse::unknown_outcome(outcome).encode()).unwrap()
    };
    let (unknown_a, unknown_b) = (ascii_unknown("a"), ascii_unknown("b"));
    fn hash<'a>(fp: &'a Digest, record: &'a str) -> [(&'a str, &'a str); 4] {
        [
            ("state", "completed"),
            ("fingerprint", fp.as_str()),
            ("record", record),
            ("expires_at_ms", "4102444800000"),
        ]
    }
    let (took, never) = (random_digest(), random_digest());
    legacy_hash(&mut conn, &took, &hash(&fp, &unknown_a)).await;
    legacy_hash(&mut conn, &never, &hash(&fp, &unknown_b)).await;
    assert_eq!(
        s.settle(&took, unknown_b.as_bytes(), None).await.unwrap(),
        SettleOutcome::NotFound
    );
    let paid = Replacement {
        record: b"paid".to_vec(),
        ttl_ms: None,
        tombstone_ms: 0,
    };
    assert_eq!(
        s.settle(&took, unknown_a.as_bytes(), Some(paid))
            .await
            .unwrap(),
        SettleOutcome::Replaced
    );
    let view = s.lookup(&took).await.unwrap().unwrap();
    assert_eq!(
        (view.record.as_deref(), &view.fingerprint),
        (Some(&b"paid"[..]), &fp)
    );
    assert_eq!(
        s.settle(&never, unknown_b.as_bytes(), None).await.unwrap(),
        SettleOutcome::Removed
    );
    assert!(s.lookup(&never).await.unwrap().is_none());
}

#[tokio::test]
async fn redis_records_an_earlier_store_wrote_as_hashes_are_decided_on_as_before() {
    let server = RedisServer::start();
    let s = RedisStorage::connect(&server.url()).await.unwrap();
    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let fp = random_digest();
    let holder = OwnerToken::parse("0a1b").unwrap();
    let in_flight = [
        ("state", "in_flight"),
        ("fingerprint", fp.as_str()),
        ("owner", "0a1b"),
        ("expires_at_ms", "4102444800000"),
    ];

    // A completed record replays, and refuses another payload.
    let done = random_digest();
    legacy_hash(
        &mut conn,
        &done,
        &[
            ("state", "completed"),
            ("fingerprint", fp.as_str()),
            ("record", "recorded\n\x00bytes"),
            ("expires_at_ms", "4102444800000"),
        ],
    )
    .await;
    let other = OwnerToken::generate().unwrap();
    assert_eq!(
        s.claim(&done, &fp, LONG_LEASE_MS, &other).await.unwrap(),
        ClaimOutcome::Completed {
            record: b"recorded\n\x00bytes".to_vec()
        }
    );
    assert_eq!(
        s.claim(&done, &random_digest(), LONG_LEASE_MS, &other)
            .await
            .unwrap(),
        ClaimOutcome::Mismatch
    );

    // A claim in flight: someone else waits, its holder renews and completes it, and the
    // completed record (now a packed string) replays.
    let running = random_digest();
    legacy_hash(&mut conn, &running, &in_flight).await;
    assert!(matches!(
        s.claim(&running, &fp, LONG_LEASE_MS, &other).await.unwrap(),
        ClaimOutcome::InFlight { .. }
    ));
    assert_eq!(
        s.claim(&running, &fp, LONG_LEASE_MS, &holder)
            .await
            .unwrap(),
        ClaimOutcome::Claimed {
            owner: holder.clone(),
            lease_expires_at_ms: 4_102_444_800_000
        }
    );
    assert_eq!(
        s.renew(&running, &other, LONG_LEASE_MS).await.unwrap(),
        RenewOutcome::NotOwner
    );
    assert!(matches!(
        s.renew(&running, &holder, 2 * LONG_LEASE_MS).await.unwrap(),
        RenewOutcome::Renewed { .. }
    ));
    assert_eq!(
        s.complete_or_create(&running, &other, LONG_TTL_MS, 0, b"r".to_vec(), None)
            .await
            .unwrap(),
        CompleteOutcome::NotOwner
    );
    assert_eq!(
        s.complete_or_create(&running, &holder, LONG_TTL_MS, 0, b"r".to_vec(), None)
            .await
            .unwrap(),
        CompleteOutcome::Completed
    );
    assert_eq!(
        s.claim(&running, &fp, LONG_LEASE_MS, &other).await.unwrap(),
        ClaimOutcome::Completed {
            record: b"r".to_vec()
        }
    );
    let view = s.lookup(&running).await.unwrap().unwrap();
    assert_eq!(
        (view.state, view.fingerprint),
        (RecordState::Completed, fp.clone())
    );

    // Another claim in flight is released by its holder only, and is then free.
    let abandoned = random_digest();
    legacy_hash(&mut conn, &abandoned, &in_flight).await;
    assert_eq!(
        s.release(&abandoned, &other).await.unwrap(),
        ReleaseOutcome::NotOwner
    );
    assert_eq!(
        s.release(&abandoned, &holder).await.unwrap(),
        ReleaseOutcome::Released
    );
    assert!(matches!(
        s.claim(&abandoned, &fp, LONG_LEASE_MS, &other)
            .await
            .unwrap(),
        ClaimOutcome::Claimed { .. }
    ));
}

/// A Redis restart leaves the store's pooled connection to the old server dead; the first
/// calls after it must still be answered (a claim, its completion, a replay), not fail with
/// the dead connection's error.
#[tokio::test]
async fn the_first_calls_after_a_redis_restart_are_answered() {
    let mut server = RedisServer::start();
    let s = RedisStorage::connect(&server.url()).await.unwrap();
    let (warm, fp) = (random_digest(), random_digest());
    let owner = OwnerToken::generate().unwrap();
    assert!(matches!(
        s.claim(&warm, &fp, 60_000, &owner).await.unwrap(),
        ClaimOutcome::Claimed { .. }
    ));
    for round in 0..3 {
        server.restart();
        let (k, owner) = (random_digest(), OwnerToken::generate().unwrap());
        let claimed = s.claim(&k, &fp, 60_000, &owner).await;
        assert!(
            matches!(claimed, Ok(ClaimOutcome::Claimed { .. })),
            "round {round}: {claimed:?}"
        );
        server.restart();
        let completed = s.complete(&k, &owner, 60_000, b"done".to_vec()).await;
        assert!(
            matches!(completed, Ok(CompleteOutcome::NotOwner)),
            "round {round}: the restart lost the claim, so the completion is refused: {completed:?}"
        );
        let again = OwnerToken::generate().unwrap();
        assert!(matches!(
            s.claim(&k, &fp, 60_000, &again).await.unwrap(),
            ClaimOutcome::Claimed { .. }
        ));
        assert_eq!(
            s.complete(&k, &again, 60_000, b"done".to_vec())
                .await
                .unwrap(),
            CompleteOutcome::Completed
        );
        server.restart();
        let replay = s.claim(&k, &fp, 60_000, &owner).await;
        assert!(
            matches!(replay, Ok(ClaimOutcome::Claimed { .. })),
            "round {round}: Redis kept nothing across the restart (no persistence): {replay:?}"
        );
    }
}

#[tokio::test]
async fn redis_outage_is_a_backend_error_not_a_hang() {
    let server = RedisServer::start();
    let s = RedisStorage::connect(&server.url()).await.unwrap();
    drop(server);
    let started = std::time::Instant::now();
    let owner = OwnerToken::generate().unwrap();
    let res = s
        .claim(&random_digest(), &random_digest(), 1_000, &owner)
        .await;
    assert!(
        res.is_err(),
        "claim against a dead redis must fail: {res:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
}

/// Redis memory per completed record, whole and as its tombstone: `used_memory` over many
/// records of a realistic response (6 headers, a 500-byte body). A measurement for
/// docs/redis.md, not a check: `cargo test -p idempotency-store --release --test contract --
/// --ignored --nocapture redis_memory_per_record`.
#[tokio::test]
#[ignore = "a measurement for the sizing docs; prints, asserts only that it ran"]
async fn redis_memory_per_record() {
    const N: usize = 50_000;
    let server = RedisServer::start();
    let s = RedisStorage::connect(&server.url()).await.unwrap();
    let client = ::redis::Client::open(server.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let used = |info: String| -> u64 {
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap()
    };
    let response = common::typical_response::typical_response(500);
    println!("layout | records | used_memory per record | value bytes");
    for (name, ttl_ms, tombstone_ms) in [
        ("whole, no tombstone", 600_000, 0),
        ("whole, with a tombstone (both keys)", 600_000, 600_000),
        ("tombstone alone (whole expired)", 1_500, 600_000),
    ] {
        let _: () = ::redis::cmd("FLUSHALL")
            .query_async(&mut conn)
            .await
            .unwrap();
        let before = used(
            ::redis::cmd("INFO")
                .arg("memory")
                .query_async(&mut conn)
                .await
                .unwrap(),
        );
        let record = response.encode();
        for _ in 0..N {
            let (k, fp, owner) = (
                random_digest(),
                random_digest(),
                OwnerToken::generate().unwrap(),
            );
            s.claim(&k, &fp, 60_000, &owner).await.unwrap();
            s.complete_or_create(&k, &owner, ttl_ms, tombstone_ms, record.clone(), None)
                .await
                .unwrap();
        }
        if ttl_ms < 60_000 {
            // Until Redis has expired every whole response.
            tokio::time::sleep(Duration::from_millis(ttl_ms + 500)).await;
            loop {
                let keys: u64 = ::redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
                if keys <= N as u64 {
                    break;
                }
                let _: Option<Vec<u8>> = ::redis::cmd("RANDOMKEY")
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        let after = used(
            ::redis::cmd("INFO")
                .arg("memory")
                .query_async(&mut conn)
                .await
                .unwrap(),
        );
        let value_bytes = if tombstone_ms > 0 && ttl_ms < 60_000 {
            response.without_body().encode().len()
        } else {
            record.len()
        };
        println!(
            "{name} | {N} | {} | {value_bytes}",
            after.saturating_sub(before) / N as u64
        );
    }
}

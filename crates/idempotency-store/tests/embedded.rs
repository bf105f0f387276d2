//! Embedded backend under concurrency: group commit must keep every
//! operation's answer true and durable.

// Test code: a failed unwrap/index is a failed test, which is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::sync::Arc;

use idempotency_store::clock::ManualClock;
use idempotency_store::metrics::Metrics;
use idempotency_store::storage::embedded::EmbeddedStorage;
use idempotency_store::storage::{ClaimOutcome, CompleteOutcome, OwnerToken, RecordState, Storage};

use common::random_digest;

const CLAIMS: usize = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_on_distinct_keys_are_all_answered_and_durable() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(1_700_000_000_000));
    let keys: Vec<_> = (0..CLAIMS).map(|_| random_digest()).collect();
    let fp = random_digest();
    {
        let s = Arc::new(EmbeddedStorage::open(dir.path(), clock.clone()).unwrap());
        let mut tasks = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let (s, k, fp) = (Arc::clone(&s), k.clone(), fp.clone());
            tasks.push(tokio::spawn(async move {
                let me = OwnerToken::generate().unwrap();
                let claimed = s.claim(&k, &fp, 60_000, &me).await.unwrap();
                assert!(
                    matches!(&claimed, ClaimOutcome::Claimed { owner, .. } if *owner == me),
                    "{claimed:?}"
                );
                // Every other key also gets completed, racing the claims of
                // the remaining keys through the same writer.
                if i % 2 == 0 {
                    let done = s
                        .complete(&k, &me, 86_400_000, format!("r{i}").into_bytes())
                        .await
                        .unwrap();
                    assert_eq!(done, CompleteOutcome::Completed);
                }
            }));
        }
        // The sweeper goes through the same writer; it must neither block
        // nor disturb live records.
        assert_eq!(s.sweep_expired().await.unwrap(), 0);
        for t in tasks {
            t.await.unwrap();
        }
        let b = s.batch_metrics();
        let ops = (CLAIMS + CLAIMS / 2 + 1) as u64;
        assert_eq!(b.batched_operations(), ops);
        assert_eq!(b.commits(), b.batches());
        assert!(
            b.commits() < ops,
            "{} commits for {ops} concurrent operations: nothing was batched",
            b.commits()
        );
        // Dropping the last handle stops the writer and closes the file.
    }
    let s = EmbeddedStorage::open(dir.path(), clock).unwrap();
    for (i, k) in keys.iter().enumerate() {
        let view = s.lookup(k).await.unwrap().unwrap();
        if i % 2 == 0 {
            assert_eq!(view.state, RecordState::Completed, "key {i}");
            assert_eq!(view.record, Some(format!("r{i}").into_bytes()));
        } else {
            assert_eq!(view.state, RecordState::InFlight, "key {i}");
        }
    }
}

#[tokio::test]
async fn batch_metrics_are_exposed() {
    let dir = tempfile::tempdir().unwrap();
    let s = EmbeddedStorage::open(dir.path(), Arc::new(ManualClock::new(1))).unwrap();
    let mut metrics = Metrics::new();
    metrics.register_embedded_batches(s.batch_metrics());
    s.claim(
        &random_digest(),
        &random_digest(),
        1_000,
        &OwnerToken::generate().unwrap(),
    )
    .await
    .unwrap();
    let text = metrics.encode().unwrap();
    assert!(
        text.contains("idempotency_store_embedded_commits_total 1"),
        "{text}"
    );
    assert!(
        text.contains("idempotency_store_batch_size_count 1"),
        "{text}"
    );
    assert!(
        text.contains("idempotency_store_batch_size_sum 1.0"),
        "{text}"
    );
}

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

/// `--max-db-bytes`, through the binary: once the file has reached it, a new claim is answered
/// 503 with the reason (the filter's store-error policy applies), a claim the store took is
/// still completed, a completed key still replays, and /metrics has the file's size, its
/// bound and the refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_file_answers_new_claims_503_with_the_reason_and_counts_them() {
    let dir = tempfile::tempdir().unwrap();
    let data_dir = dir.path().to_str().unwrap().to_owned();
    let (_run, addr) = common::start(
        &["--data-dir", &data_dir, "--max-db-bytes", "1MiB"],
        &[("IDEMPOTENCY_STORE_TOKEN", "t")],
    );
    let client = reqwest::Client::new();
    let post = |op: &'static str, body: serde_json::Value| {
        let (client, addr) = (client.clone(), addr.clone());
        async move {
            let resp = client
                .post(format!("http://{addr}/v1/{op}"))
                .bearer_auth("t")
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<serde_json::Value>().await.unwrap())
        }
    };
    let fp = "f".repeat(64);
    // 12,000 bytes of "AAA…", base64.
    let record = "QUFB".repeat(4_000);
    let claim = |key: String| {
        post(
            "claim",
            serde_json::json!({"key": key, "fingerprint": fp, "lease_ms": 60_000, "owner": "ab"}),
        )
    };
    let held = "e".repeat(64);
    assert_eq!(claim(held.clone()).await.1["outcome"], "claimed");
    let mut completed = Vec::new();
    let refusal = loop {
        assert!(completed.len() < 1_000, "no claim was refused");
        let key = format!("{:064x}", completed.len());
        let (status, body) = claim(key.clone()).await;
        if status == 503 {
            break body;
        }
        assert_eq!(
            (status, &body["outcome"]),
            (200, &serde_json::json!("claimed"))
        );
        let (status, _) = post(
            "complete",
            serde_json::json!({"key": key, "owner": "ab", "ttl_ms": 600_000, "record": record}),
        )
        .await;
        assert_eq!(status, 200);
        completed.push(key);
    };
    assert_eq!(
        refusal["type"], "urn:idempotency-store:backend-unavailable",
        "{refusal}"
    );
    let detail = refusal["detail"].as_str().unwrap();
    assert!(
        detail.contains("--max-db-bytes 1048576") && detail.contains("nothing was recorded"),
        "{detail}"
    );
    // Taken before the bound was reached: completed after it.
    let (status, _) = post(
        "complete",
        serde_json::json!({"key": held, "owner": "ab", "ttl_ms": 600_000, "record": record}),
    )
    .await;
    assert_eq!(status, 200);
    let (status, replay) = claim(completed[0].clone()).await;
    assert_eq!(
        (status, &replay["outcome"]),
        (200, &serde_json::json!("completed"))
    );

    let metrics = client
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value = |name: &str| -> f64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing from\n{metrics}"))
    };
    assert_eq!(
        value("idempotency_store_embedded_claims_refused_total"),
        1.0
    );
    assert_eq!(
        value("idempotency_store_embedded_max_file_bytes"),
        1_048_576.0
    );
    let file = value("idempotency_store_embedded_file_bytes");
    assert!((1_048_576.0..1_400_000.0).contains(&file), "{file}");
    assert_eq!(
        value(r#"idempotency_store_operations_total{operation="claim",outcome="store_full"}"#),
        1.0
    );
    assert_eq!(
        value(r#"idempotency_store_backend_errors_total{backend="embedded"}"#),
        0.0,
        "a full store is no backend failure"
    );
}

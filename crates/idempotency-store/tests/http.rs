//! The real router on a loopback port, driven by a real HTTP client.

// Test code: a failed unwrap/index is a failed test, which is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::sync::Arc;

use async_trait::async_trait;
use idempotency_store::clock::SystemClock;
use idempotency_store::metrics::Metrics;
use idempotency_store::server::{self, AppState, Auth};
use idempotency_store::storage::memory::MemoryStorage;
use idempotency_store::storage::{
    ClaimOutcome, CompleteOutcome, Digest, OwnerToken, RecordView, ReleaseOutcome, Storage,
    StorageError,
};
use reqwest::{Client, StatusCode, Version};
use serde_json::{json, Value};
use tokio::sync::oneshot;

const TOKEN: &str = "test-token-0123456789";
const K: &str = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
const FP: &str = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb";
const FP2: &str = "cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc";

struct TestServer {
    base: String,
    client: Client,
    _stop: oneshot::Sender<()>,
}

impl TestServer {
    async fn start_with(storage: Arc<dyn Storage>, auth: Auth, max_body: usize) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = server::router(
            AppState {
                storage,
                metrics: Arc::new(Metrics::new()),
                auth,
            },
            max_body,
        );
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(server::serve(listener, app, async {
            let _ = stopped.await;
        }));
        Self {
            base: format!("http://{addr}"),
            client: Client::new(),
            _stop: stop,
        }
    }

    async fn start() -> Self {
        Self::start_with(
            Arc::new(MemoryStorage::new(Arc::new(SystemClock))),
            Auth::bearer(TOKEN),
            server::DEFAULT_MAX_BODY_BYTES,
        )
        .await
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        let resp = self
            .client
            .post(self.url(path))
            .bearer_auth(TOKEN)
            .json(body)
            .send()
            .await
            .unwrap();
        let status = resp.status();
        (status, resp.json().await.unwrap())
    }

    async fn post_raw(&self, path: &str, body: &'static str) -> reqwest::Response {
        self.client
            .post(self.url(path))
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap()
    }

    async fn get(&self, path: &str) -> (StatusCode, Value) {
        let resp = self
            .client
            .get(self.url(path))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        let status = resp.status();
        (status, resp.json().await.unwrap())
    }

    async fn metrics(&self) -> String {
        self.client
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

fn content_type(resp: &reqwest::Response) -> String {
    resp.headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

async fn assert_bad_request(resp: reqwest::Response, mentions: &str) {
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert_eq!(content_type(&resp), "application/problem+json");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["type"], "urn:idempotency-store:bad-request");
    assert_eq!(body["status"], 400);
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains(mentions),
        "detail {detail:?} should mention {mentions:?}"
    );
}

#[tokio::test]
async fn happy_path_claim_complete_replay_release() {
    let srv = TestServer::start().await;
    let claim = json!({"key": K, "fingerprint": FP, "lease_ms": 60000});

    let (st, first) = srv.post("/v1/claim", &claim).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(first["outcome"], "claimed");
    let owner = first["owner"].as_str().unwrap().to_owned();
    assert_eq!(owner.len(), 32);
    assert!(first["lease_expires_at_ms"].as_u64().unwrap() > 1_600_000_000_000);

    let (_, again) = srv.post("/v1/claim", &claim).await;
    assert_eq!(again["outcome"], "in_flight");
    assert!(again["retry_after_ms"].as_u64().unwrap() >= 1);

    let (_, other) = srv
        .post(
            "/v1/claim",
            &json!({"key": K, "fingerprint": FP2, "lease_ms": 60000}),
        )
        .await;
    assert_eq!(other, json!({"outcome": "mismatch"}));

    let (st, rec) = srv.get(&format!("/v1/records/{K}")).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(rec["state"], "in_flight");
    assert_eq!(rec["fingerprint"], FP);
    assert!(rec.get("record").is_none());

    // Wrong owner: 409 with the outcome field, nothing changes.
    let (st, refused) = srv
        .post(
            "/v1/complete",
            &json!({"key": K, "owner": "abcd", "ttl_ms": 1000, "record": "eA=="}),
        )
        .await;
    assert_eq!(st, StatusCode::CONFLICT);
    assert_eq!(refused["outcome"], "not_owner");

    let (st, done) = srv
        .post(
            "/v1/complete",
            &json!({"key": K, "owner": owner, "ttl_ms": 86400000, "record": "aGVsbG8="}),
        )
        .await;
    assert_eq!(
        (st, done),
        (StatusCode::OK, json!({"outcome": "completed"}))
    );

    let (_, replay) = srv.post("/v1/claim", &claim).await;
    assert_eq!(
        replay,
        json!({"outcome": "completed", "record": "aGVsbG8="})
    );

    let (_, rec) = srv.get(&format!("/v1/records/{}", K.to_uppercase())).await;
    assert_eq!(rec["state"], "completed");
    assert_eq!(rec["record"], "aGVsbG8=");

    // Release: only the in-flight owner; a completed record is not released.
    let (st, _) = srv
        .post("/v1/release", &json!({"key": K, "owner": owner}))
        .await;
    assert_eq!(st, StatusCode::CONFLICT);

    let k2 = "d".repeat(64);
    let (_, c2) = srv
        .post(
            "/v1/claim",
            &json!({"key": k2, "fingerprint": FP, "lease_ms": 1000}),
        )
        .await;
    let owner2 = c2["owner"].as_str().unwrap();
    let (st, rel) = srv
        .post("/v1/release", &json!({"key": k2, "owner": owner2}))
        .await;
    assert_eq!((st, rel), (StatusCode::OK, json!({"outcome": "released"})));
    let (st, gone) = srv.get(&format!("/v1/records/{k2}")).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(gone["status"], 404);

    let metrics = srv.metrics().await;
    for needle in [
        r#"idempotency_store_operations_total{operation="claim",outcome="claimed"} 2"#,
        r#"idempotency_store_operations_total{operation="claim",outcome="in_flight"} 1"#,
        r#"idempotency_store_operations_total{operation="claim",outcome="mismatch"} 1"#,
        r#"idempotency_store_operations_total{operation="claim",outcome="completed"} 1"#,
        r#"idempotency_store_operations_total{operation="complete",outcome="not_owner"} 1"#,
        r#"idempotency_store_operations_total{operation="release",outcome="released"} 1"#,
        r#"idempotency_store_operations_total{operation="lookup",outcome="not_found"} 1"#,
        r#"idempotency_store_operation_duration_seconds_count{operation="claim"} 5"#,
    ] {
        assert!(metrics.contains(needle), "missing {needle} in\n{metrics}");
    }
}

#[tokio::test]
async fn auth_is_required_on_v1_only() {
    let srv = TestServer::start().await;
    let claim = json!({"key": K, "fingerprint": FP, "lease_ms": 1000});
    for auth in [
        None,
        Some("Bearer wrong-token"),
        Some(TOKEN),
        Some("Basic dGVzdA=="),
    ] {
        let mut req = srv.client.post(srv.url("/v1/claim")).json(&claim);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "auth {auth:?}");
        assert_eq!(content_type(&resp), "application/problem+json");
        assert_eq!(resp.headers()["www-authenticate"], "Bearer");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["type"], "urn:idempotency-store:unauthorized");
    }
    let resp = srv
        .client
        .get(srv.url(&format!("/v1/records/{K}")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    // The scheme is case-insensitive.
    let resp = srv
        .client
        .post(srv.url("/v1/claim"))
        .header("authorization", format!("bearer {TOKEN}"))
        .json(&claim)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);

    let health = srv.client.get(srv.url("/healthz")).send().await.unwrap();
    assert_eq!(health.status(), StatusCode::OK);
    assert_eq!(health.text().await.unwrap(), "ok");
    let metrics = srv.metrics().await;
    assert!(
        metrics.contains(r#"idempotency_store_rejected_requests_total{reason="unauthorized"} 5"#),
        "{metrics}"
    );
}

#[tokio::test]
async fn insecure_mode_needs_no_token() {
    let srv = TestServer::start_with(
        Arc::new(MemoryStorage::new(Arc::new(SystemClock))),
        Auth::Disabled,
        1024,
    )
    .await;
    let resp = srv
        .client
        .post(srv.url("/v1/claim"))
        .json(&json!({"key": K, "fingerprint": FP, "lease_ms": 1000}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}

#[tokio::test]
async fn every_validation_failure_is_a_400_problem() {
    let srv = TestServer::start().await;
    let cases: &[(&str, &str, &str)] = &[
        ("/v1/claim", "{not json", "invalid JSON"),
        ("/v1/claim", "", "invalid JSON"),
        ("/v1/claim", "[]", "invalid JSON"),
        (
            "/v1/claim",
            r#"{"key":"aa","fingerprint":"bb","lease_ms":1}"#,
            "`key`",
        ),
        (
            "/v1/claim",
            r#"{"key":"gaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","fingerprint":"bb","lease_ms":1}"#,
            "`key`",
        ),
        (
            "/v1/claim",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","fingerprint":"bb","lease_ms":1}"#,
            "`fingerprint`",
        ),
        (
            "/v1/claim",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","fingerprint":"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","lease_ms":0}"#,
            "`lease_ms`",
        ),
        (
            "/v1/claim",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","fingerprint":"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","lease_ms":86400001}"#,
            "`lease_ms`",
        ),
        (
            "/v1/claim",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","fingerprint":"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","lease_ms":-5}"#,
            "invalid value",
        ),
        (
            "/v1/claim",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","fingerprint":"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"}"#,
            "missing field `lease_ms`",
        ),
        (
            "/v1/claim",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","fingerprint":"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","lease_ms":5,"lease":5}"#,
            "unknown field `lease`",
        ),
        (
            "/v1/complete",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","owner":"","ttl_ms":1,"record":""}"#,
            "`owner`",
        ),
        (
            "/v1/complete",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","owner":"xyz","ttl_ms":1,"record":""}"#,
            "`owner`",
        ),
        (
            "/v1/complete",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","owner":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","ttl_ms":1,"record":""}"#,
            "`owner`",
        ),
        (
            "/v1/complete",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","owner":"ab","ttl_ms":0,"record":""}"#,
            "`ttl_ms`",
        ),
        (
            "/v1/complete",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","owner":"ab","ttl_ms":31536000001,"record":""}"#,
            "`ttl_ms`",
        ),
        (
            "/v1/complete",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","owner":"ab","ttl_ms":1,"record":"not base64!"}"#,
            "`record`",
        ),
        (
            "/v1/complete",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","owner":"ab","ttl_ms":1}"#,
            "missing field `record`",
        ),
        ("/v1/release", r#"{"key":"aa","owner":"ab"}"#, "`key`"),
        (
            "/v1/release",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","owner":"ab","x":1}"#,
            "unknown field `x`",
        ),
    ];
    for (path, body, mentions) in cases {
        let resp = srv.post_raw(path, body).await;
        assert_bad_request(resp, mentions).await;
    }
    let resp = srv
        .client
        .get(srv.url("/v1/records/not-a-digest"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_bad_request(resp, "`key`").await;

    let metrics = srv.metrics().await;
    let expected = format!(
        r#"idempotency_store_rejected_requests_total{{reason="bad_request"}} {}"#,
        cases.len() + 1
    );
    assert!(metrics.contains(&expected), "{metrics}");
}

#[tokio::test]
async fn oversized_body_is_413() {
    let srv = TestServer::start_with(
        Arc::new(MemoryStorage::new(Arc::new(SystemClock))),
        Auth::bearer(TOKEN),
        1024,
    )
    .await;
    let big = format!(
        r#"{{"key":"{K}","owner":"ab","ttl_ms":1,"record":"{}"}}"#,
        "A".repeat(4096)
    );
    let resp = srv
        .client
        .post(srv.url("/v1/complete"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(big)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(content_type(&resp), "application/problem+json");
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["status"], 413);
    let metrics = srv.metrics().await;
    assert!(metrics.contains(r#"idempotency_store_rejected_requests_total{reason="too_large"} 1"#));
}

#[tokio::test]
async fn h2c_prior_knowledge_and_http1_share_the_port() {
    let srv = TestServer::start().await;
    let h2 = Client::builder().http2_prior_knowledge().build().unwrap();
    let resp = h2
        .post(srv.url("/v1/claim"))
        .bearer_auth(TOKEN)
        .json(&json!({"key": K, "fingerprint": FP, "lease_ms": 60000}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.version(), Version::HTTP_2);
    assert_eq!(resp.status(), StatusCode::OK);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["outcome"], "claimed");

    let resp = srv.client.get(srv.url("/healthz")).send().await.unwrap();
    assert_eq!(resp.version(), Version::HTTP_11);
    let resp = h2.get(srv.url("/healthz")).send().await.unwrap();
    assert_eq!(resp.version(), Version::HTTP_2);
}

#[tokio::test]
async fn unknown_paths_and_methods_are_problems() {
    let srv = TestServer::start().await;
    let resp = srv.client.get(srv.url("/v1/nope")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    assert_eq!(content_type(&resp), "application/problem+json");
    let resp = srv
        .client
        .get(srv.url("/v1/claim"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(content_type(&resp), "application/problem+json");
}

/// A backend that is down.
struct Broken;

#[async_trait]
impl Storage for Broken {
    fn backend_name(&self) -> &'static str {
        "broken"
    }
    async fn claim(&self, _: &Digest, _: &Digest, _: u64) -> Result<ClaimOutcome, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
    async fn complete(
        &self,
        _: &Digest,
        _: &OwnerToken,
        _: u64,
        _: Vec<u8>,
    ) -> Result<CompleteOutcome, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
    async fn release(&self, _: &Digest, _: &OwnerToken) -> Result<ReleaseOutcome, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
    async fn lookup(&self, _: &Digest) -> Result<Option<RecordView>, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
    async fn sweep_expired(&self) -> Result<u64, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
}

#[tokio::test]
async fn backend_failure_is_503_and_counted() {
    let srv = TestServer::start_with(Arc::new(Broken), Auth::bearer(TOKEN), 4096).await;
    let (st, body) = srv
        .post(
            "/v1/claim",
            &json!({"key": K, "fingerprint": FP, "lease_ms": 1000}),
        )
        .await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["type"], "urn:idempotency-store:backend-unavailable");
    let (st, _) = srv.get(&format!("/v1/records/{K}")).await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE);
    let metrics = srv.metrics().await;
    assert!(
        metrics.contains(r#"idempotency_store_backend_errors_total{backend="broken"} 2"#),
        "{metrics}"
    );
    assert!(metrics
        .contains(r#"idempotency_store_operations_total{operation="claim",outcome="error"} 1"#));
}

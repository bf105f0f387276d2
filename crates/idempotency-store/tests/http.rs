//! The real router on a loopback port, driven by a real HTTP client.

// Test code: a failed unwrap/index is a failed test, which is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::extract::Request;
use axum::middleware::Next;
use axum::Router;
use idempotency_store::clock::SystemClock;
use idempotency_store::metrics::Metrics;
use idempotency_store::ops::auth::Auth;
use idempotency_store::ops::AppState;
use idempotency_store::server;
use idempotency_store::storage::memory::MemoryStorage;
use idempotency_store::storage::{
    ClaimOutcome, CompleteOutcome, Digest, KeyPrefix, OwnerToken, PrefixMatches, RecordView,
    ReleaseOutcome, RenewOutcome, Replacement, SettleOutcome, Storage, StorageError,
};
use reqwest::{Client, StatusCode, Version};
use serde_json::{json, Value};
use tokio::sync::{oneshot, Notify};

const TOKEN: &str = "test-token-0123456789";
/// The operators' token (lookup, search, purge), which the data plane does not take.
const OPERATOR_TOKEN: &str = "operator-token-9876543210";

/// Both tokens, as a store in production has them.
fn auth() -> Auth {
    Auth::bearer(TOKEN).with_operator_token(OPERATOR_TOKEN)
}

/// The token a path's route takes: the operators' for the record routes.
fn token_for(path: &str) -> &'static str {
    if path.starts_with("/v1/records") {
        OPERATOR_TOKEN
    } else {
        TOKEN
    }
}
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
        Self::start_wrapped(storage, auth, max_body, |app| app).await
    }

    /// Like `start_with`, but `wrap` may add layers around the real router.
    async fn start_wrapped(
        storage: Arc<dyn Storage>,
        auth: Auth,
        max_body: usize,
        wrap: impl FnOnce(Router) -> Router,
    ) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = wrap(server::router(
            AppState::new(
                storage,
                Arc::new(Metrics::new()),
                auth,
                Default::default(),
                idempotency_store::waits::DEFAULT_MAX_WAITS,
            ),
            max_body,
        ));
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
            auth(),
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
            .bearer_auth(token_for(path))
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
            .bearer_auth(token_for(path))
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

/// An unknown outcome is settled over HTTP by the filter (`/v1/settle`, the data-plane token)
/// or an operator (`/v1/records/{key}/settle`, the operator token), only while the key holds
/// exactly the record named as `current`.
#[tokio::test]
async fn an_unknown_outcome_is_settled_by_the_filter_or_an_operator() {
    let b64 = idempotency_protocol::wire::encode_record;
    let srv = TestServer::start().await;
    let unknown = b64(&unknown_outcome("upstream_response_timeout"));
    let record_unknown = |key: &'static str| {
        let (srv, unknown) = (&srv, unknown.clone());
        async move {
            let claim = json!({"key": key, "fingerprint": FP, "lease_ms": 60000, "owner": "0a"});
            assert_eq!(srv.post("/v1/claim", &claim).await.0, StatusCode::OK);
            let complete = json!({"key": key, "owner": "0a", "ttl_ms": 60000, "record": unknown});
            assert_eq!(srv.post("/v1/complete", &complete).await.0, StatusCode::OK);
        }
    };
    record_unknown(K).await;
    let other = b64(&unknown_outcome("another one"));
    let settle = json!({"key": K, "current": other, "record": b64(b"paid")});
    let (st, refused) = srv.post("/v1/settle", &settle).await;
    assert_eq!(st, StatusCode::CONFLICT);
    assert_eq!(refused["type"], "urn:idempotency-store:not-owner");
    let settle = json!({"key": K, "current": unknown, "record": b64(b"paid")});
    assert_eq!(
        srv.post("/v1/settle", &settle).await,
        (StatusCode::OK, json!({"outcome": "replaced"}))
    );
    let (_, rec) = srv.get(&format!("/v1/records/{K}")).await;
    assert_eq!(rec["record"], b64(b"paid"));
    // Its repeat finds its own result: nothing changes.
    assert_eq!(
        srv.post("/v1/settle", &settle).await.0,
        StatusCode::CONFLICT
    );

    // The operator's form: the key in the path, on the operator token only.
    const K2: &str = "dddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddddd";
    record_unknown(K2).await;
    let never_ran = json!({"current": unknown});
    let resp = srv
        .client
        .post(srv.url(&format!("/v1/records/{K2}/settle")))
        .bearer_auth(TOKEN)
        .json(&never_ran)
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status(),
        StatusCode::FORBIDDEN,
        "not on the data-plane token"
    );
    assert_eq!(
        srv.post(&format!("/v1/records/{K2}/settle"), &never_ran)
            .await,
        (StatusCode::OK, json!({"outcome": "removed"}))
    );
    assert_eq!(
        srv.get(&format!("/v1/records/{K2}")).await.0,
        StatusCode::NOT_FOUND
    );
    let keyed = json!({"key": K2, "current": unknown});
    let (st, bad) = srv.post(&format!("/v1/records/{K2}/settle"), &keyed).await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(bad["detail"].as_str().unwrap().contains("key"), "{bad}");
    let metrics = srv.metrics().await;
    assert!(
        metrics.contains(
            r#"idempotency_store_operations_total{operation="settle",outcome="replaced"} 1"#
        ),
        "{metrics}"
    );
    // A filter's lookup for a caller (the data-plane token): what the key holds, or 404.
    let (st, found) = srv.post("/v1/lookup", &json!({"key": K})).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(found["state"], "completed");
    assert_eq!(found["record"], b64(b"paid"));
    let (st, _) = srv.post("/v1/lookup", &json!({"key": K2})).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
}

/// The record of an unknown outcome as a filter writes it; `details` tells two apart.
fn unknown_outcome(details: &str) -> Vec<u8> {
    use idempotency_protocol::record::{RecordedResponse, UnknownOutcome};
    RecordedResponse::unknown_outcome(UnknownOutcome {
        proxy_status: 504,
        details: details.to_owned(),
        ..UnknownOutcome::default()
    })
    .encode()
}

/// What the data-plane token can do with a completed record: look it up (`/v1/lookup`), and
/// name it byte for byte in a settle. That settle is refused (400, naming `current`) and
/// changes nothing: the retry replays, the write never runs twice. The operator's settle
/// refuses it alike (an operator purges a record that is not an unknown outcome).
#[tokio::test]
async fn a_settle_of_a_recorded_response_is_refused_and_changes_nothing() {
    use idempotency_protocol::record::RecordedResponse;
    let b64 = idempotency_protocol::wire::encode_record;
    let srv = TestServer::start().await;
    let charged = RecordedResponse {
        status: 201,
        body: br#"{"charge":1}"#.to_vec(),
        ..RecordedResponse::default()
    }
    .encode();
    let claim = json!({"key": K, "fingerprint": FP, "lease_ms": 60000, "owner": "0a"});
    assert_eq!(srv.post("/v1/claim", &claim).await.0, StatusCode::OK);
    let complete = json!({"key": K, "owner": "0a", "ttl_ms": 60000, "record": b64(&charged)});
    assert_eq!(srv.post("/v1/complete", &complete).await.0, StatusCode::OK);
    let (st, found) = srv.post("/v1/lookup", &json!({"key": K})).await;
    assert_eq!(st, StatusCode::OK);
    let current = found["record"].clone();
    assert_eq!(current, b64(&charged));

    let filters = (
        "/v1/settle".to_owned(),
        json!({"key": K, "current": current}),
    );
    let operators = (
        format!("/v1/records/{K}/settle"),
        json!({"current": current}),
    );
    for (path, body) in [filters, operators] {
        let resp = srv
            .client
            .post(srv.url(&path))
            .bearer_auth(token_for(&path))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_bad_request(
            resp,
            "field `current`: is not the record of an unknown outcome",
        )
        .await;
    }
    assert_eq!(
        srv.post(
            "/v1/claim",
            &json!({"key": K, "fingerprint": FP, "lease_ms": 60000})
        )
        .await,
        (
            StatusCode::OK,
            json!({"outcome": "completed", "record": b64(&charged)})
        ),
        "the retry replays: the charge does not run again"
    );
}

/// A settle's `tombstone_ms` keeps its replacement as a completion's does: whole for
/// `ttl_ms`, then that much longer without its body. Freeing a key keeps nothing, so a
/// tombstone there is refused.
#[tokio::test]
async fn a_settle_over_http_keeps_the_tombstone_it_carries() {
    let b64 = idempotency_protocol::wire::encode_record;
    let srv = TestServer::start().await;
    let unknown = b64(&unknown_outcome("upstream_response_timeout"));
    let claim = json!({"key": K, "fingerprint": FP, "lease_ms": 60000, "owner": "0a"});
    assert_eq!(srv.post("/v1/claim", &claim).await.0, StatusCode::OK);
    let complete = json!({"key": K, "owner": "0a", "ttl_ms": 60000, "record": unknown});
    assert_eq!(srv.post("/v1/complete", &complete).await.0, StatusCode::OK);

    let freeing = json!({"key": K, "current": unknown, "tombstone_ms": 5000});
    let resp = srv
        .client
        .post(srv.url("/v1/settle"))
        .bearer_auth(TOKEN)
        .json(&freeing)
        .send()
        .await
        .unwrap();
    assert_bad_request(
        resp,
        "field `tombstone_ms`: must be 0 when the key is freed",
    )
    .await;

    let took_effect = json!({"key": K, "current": unknown, "record": b64(b"paid"),
        "ttl_ms": 1000, "tombstone_ms": 5000});
    assert_eq!(
        srv.post("/v1/settle", &took_effect).await,
        (StatusCode::OK, json!({"outcome": "replaced"}))
    );
    let (_, rec) = srv.get(&format!("/v1/records/{K}")).await;
    let kept_ms = rec["expires_at_ms"].as_u64().unwrap() - rec["written_at_ms"].as_u64().unwrap();
    assert_eq!(kept_ms, 1000 + 5000, "its TTL, then its tombstone: {rec}");
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
async fn operator_routes_take_the_operator_token_only_and_the_data_plane_its_own() {
    let srv = TestServer::start().await;
    let claim = json!({"key": K, "fingerprint": FP, "lease_ms": 60000});
    assert_eq!(srv.post("/v1/claim", &claim).await.0, StatusCode::OK);
    let forbidden = |resp: reqwest::Response, mentions: &'static str| async move {
        assert_eq!(resp.status(), StatusCode::FORBIDDEN);
        assert_eq!(content_type(&resp), "application/problem+json");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["type"], "urn:idempotency-store:forbidden");
        let detail = body["detail"].as_str().unwrap().to_owned();
        assert!(detail.contains(mentions), "{detail}");
    };
    // The token every Envoy holds (and its /config_dump shows) neither reads nor purges.
    let records = format!("/v1/records/{K}");
    let search = format!("/v1/records?prefix={}", &K[..16]);
    for request in [
        srv.client.get(srv.url(&records)),
        srv.client.get(srv.url(&search)),
        srv.client.delete(srv.url(&records)),
    ] {
        let resp = request.bearer_auth(TOKEN).send().await.unwrap();
        forbidden(resp, "data-plane token").await;
    }
    // Nor does the operator token claim.
    let resp = srv
        .client
        .post(srv.url("/v1/claim"))
        .bearer_auth(OPERATOR_TOKEN)
        .json(&claim)
        .send()
        .await
        .unwrap();
    forbidden(resp, "operator token").await;
    // The operator token reads; the record was never purged.
    let (st, rec) = srv.get(&records).await;
    assert_eq!((st, &rec["state"]), (StatusCode::OK, &json!("in_flight")));
    let resp = srv
        .client
        .get(srv.url(&records))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    assert!(srv
        .metrics()
        .await
        .contains(r#"idempotency_store_rejected_requests_total{reason="forbidden"} 4"#));

    // Without an operator token, the operator routes are disabled, not open.
    for auth in [Auth::bearer(TOKEN), Auth::insecure()] {
        let srv = TestServer::start_with(
            Arc::new(MemoryStorage::new(Arc::new(SystemClock))),
            auth,
            4096,
        )
        .await;
        for token in [Some(TOKEN), None] {
            let mut request = srv.client.get(srv.url(&records));
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            forbidden(request.send().await.unwrap(), "--operator-token-file").await;
        }
    }
}

#[tokio::test]
async fn insecure_mode_needs_no_token() {
    let srv = TestServer::start_with(
        Arc::new(MemoryStorage::new(Arc::new(SystemClock))),
        Auth::insecure(),
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
            "/v1/claim",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","fingerprint":"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","lease_ms":5,"owner":""}"#,
            "`owner`",
        ),
        (
            "/v1/claim",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","fingerprint":"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","lease_ms":5,"owner":"not-hex"}"#,
            "`owner`",
        ),
        (
            "/v1/claim",
            r#"{"key":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","fingerprint":"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","lease_ms":5,"owner":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"}"#,
            "`owner`",
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
        .bearer_auth(OPERATOR_TOKEN)
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
        auth(),
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

impl TestServer {
    async fn delete(&self, path: &str, token: Option<&str>) -> (StatusCode, Value) {
        let mut req = self.client.delete(self.url(path));
        if let Some(token) = token {
            req = req.bearer_auth(token);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status();
        (status, resp.json().await.unwrap())
    }
}

#[tokio::test]
async fn operators_find_records_by_prefix_see_their_owner_and_age_and_purge_them() {
    let srv = TestServer::start().await;
    let (st, claimed) = srv
        .post(
            "/v1/claim",
            &json!({"key": K, "fingerprint": FP, "lease_ms": 60000, "owner": "0a1b"}),
        )
        .await;
    assert_eq!(st, StatusCode::OK);
    let (_, rec) = srv.get(&format!("/v1/records/{K}")).await;
    assert_eq!(rec["state"], "in_flight");
    // A short hash of who holds the claim: never the owner token, with which anyone reading
    // could complete the claim with bytes of their own. (SHA-256 of "0a1b", 16 hex digits.)
    assert_eq!(rec["owner_hash"], "f47f40d943986712");
    assert!(rec.get("owner").is_none(), "{rec}");
    let (written, now) = (
        rec["written_at_ms"].as_u64().unwrap(),
        rec["now_ms"].as_u64().unwrap(),
    );
    assert!(written <= now && now < claimed["lease_expires_at_ms"].as_u64().unwrap());

    // The access log's 16 hex digits find the record; case does not matter.
    let (st, found) = srv
        .get(&format!("/v1/records?prefix={}", &K[..16].to_uppercase()))
        .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(
        found,
        json!({"keys": [K], "truncated": false, "exhaustive": true})
    );
    let (_, none) = srv.get("/v1/records?prefix=0123456789abcdef").await;
    assert_eq!(
        none,
        json!({"keys": [], "truncated": false, "exhaustive": true})
    );

    // Many records under one prefix: at most `limit` (20 by default), and it says so.
    let shared = "12345678";
    for i in 0..25 {
        let key = format!("{shared}{i:056x}");
        srv.post(
            "/v1/claim",
            &json!({"key": key, "fingerprint": FP, "lease_ms": 60000}),
        )
        .await;
    }
    let (_, many) = srv.get(&format!("/v1/records?prefix={shared}")).await;
    assert_eq!(many["keys"].as_array().unwrap().len(), 20);
    assert_eq!(
        (many["truncated"].clone(), many["exhaustive"].clone()),
        (json!(true), json!(true))
    );
    let (_, few) = srv
        .get(&format!("/v1/records?prefix={shared}&limit=3"))
        .await;
    let first: Vec<String> = (0..3).map(|i| format!("{shared}{i:056x}")).collect();
    assert_eq!(few["keys"], json!(first), "in key order");

    for (query, mentions) in [
        ("", "`prefix`: required"),
        ("?prefix=1234567", "8 to 64 hex"),
        ("?prefix=1234567x", "hex characters"),
        ("?prefix=12345678&limit=21", "`limit`"),
        ("?prefix=12345678&max=3", "unknown query parameter `max`"),
    ] {
        let resp = srv
            .client
            .get(srv.url(&format!("/v1/records{query}")))
            .bearer_auth(OPERATOR_TOKEN)
            .send()
            .await
            .unwrap();
        assert_bad_request(resp, mentions).await;
    }

    // Purge: authenticated, a full key only, and it answers what it removed.
    let (st, _) = srv.delete(&format!("/v1/records/{K}"), None).await;
    assert_eq!(st, StatusCode::UNAUTHORIZED);
    let resp = srv
        .client
        .delete(srv.url(&format!("/v1/records/{}", &K[..16])))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await
        .unwrap();
    assert_bad_request(resp, "`key`").await;
    let (st, purged) = srv
        .delete(&format!("/v1/records/{K}"), Some(OPERATOR_TOKEN))
        .await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(purged["outcome"], "purged");
    assert_eq!(purged["purged"]["state"], "in_flight");
    assert_eq!(purged["purged"]["owner_hash"], "f47f40d943986712");
    assert!(purged["purged"].get("owner").is_none(), "{purged}");
    let (st, _) = srv.get(&format!("/v1/records/{K}")).await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    let (st, again) = srv
        .delete(&format!("/v1/records/{K}"), Some(OPERATOR_TOKEN))
        .await;
    assert_eq!(st, StatusCode::NOT_FOUND);
    assert_eq!(again["type"], "urn:idempotency-store:not-found");
    // The key is free: a new claim takes it at once.
    let (_, retried) = srv
        .post(
            "/v1/claim",
            &json!({"key": K, "fingerprint": FP, "lease_ms": 60000}),
        )
        .await;
    assert_eq!(retried["outcome"], "claimed");

    let metrics = srv.metrics().await;
    for needle in [
        r#"idempotency_store_operations_total{operation="purge",outcome="purged"} 1"#,
        r#"idempotency_store_operations_total{operation="purge",outcome="not_found"} 1"#,
        r#"idempotency_store_operations_total{operation="search",outcome="found"} 3"#,
        r#"idempotency_store_operations_total{operation="search",outcome="not_found"} 1"#,
        r#"idempotency_store_rejected_requests_total{reason="bad_request"} 6"#,
    ] {
        assert!(metrics.contains(needle), "missing {needle} in\n{metrics}");
    }
}

#[tokio::test]
async fn claim_with_client_owner_echoes_it_and_that_owner_can_release() {
    let srv = TestServer::start().await;
    let mine = "00C0FFEE".repeat(8);
    let claim = json!({"key": K, "fingerprint": FP, "lease_ms": 60000, "owner": mine});
    let (st, first) = srv.post("/v1/claim", &claim).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(first["outcome"], "claimed");
    assert_eq!(first["owner"], mine.to_lowercase(), "echoed, lowercased");

    // The answer was "lost": the client releases with the token it chose.
    // Another claim with another owner did not take the record.
    let (_, again) = srv
        .post(
            "/v1/claim",
            &json!({"key": K, "fingerprint": FP, "lease_ms": 60000, "owner": "ab"}),
        )
        .await;
    assert_eq!(again["outcome"], "in_flight");
    let (st, _) = srv
        .post("/v1/release", &json!({"key": K, "owner": "ab"}))
        .await;
    assert_eq!(st, StatusCode::CONFLICT);
    let (st, rel) = srv
        .post("/v1/release", &json!({"key": K, "owner": mine}))
        .await;
    assert_eq!((st, rel), (StatusCode::OK, json!({"outcome": "released"})));

    // Releasing what is already gone stays a 409 not_owner (final for the filter).
    let (st, gone) = srv
        .post("/v1/release", &json!({"key": K, "owner": mine}))
        .await;
    assert_eq!(st, StatusCode::CONFLICT);
    assert_eq!(gone["outcome"], "not_owner");
    assert_eq!(gone["type"], "urn:idempotency-store:not-owner");

    // Without an owner the server still makes up a 128-bit one.
    let (_, fresh) = srv
        .post(
            "/v1/claim",
            &json!({"key": K, "fingerprint": FP, "lease_ms": 60000}),
        )
        .await;
    assert_eq!(fresh["outcome"], "claimed");
    let generated = fresh["owner"].as_str().unwrap();
    assert_eq!(generated.len(), 32);
    assert_ne!(generated, mine.to_lowercase());
}

#[tokio::test]
async fn renew_keeps_the_callers_claims_and_names_the_leases_it_lost() {
    let srv = TestServer::start().await;
    let (mine, other_key, unclaimed) = ("00c0ffee", FP, FP2);
    let (_, claimed) = srv
        .post(
            "/v1/claim",
            &json!({"key": K, "fingerprint": FP, "lease_ms": 1000, "owner": mine}),
        )
        .await;
    let first_end = claimed["lease_expires_at_ms"].as_u64().unwrap();
    srv.post(
        "/v1/claim",
        &json!({"key": other_key, "fingerprint": FP, "lease_ms": 60000, "owner": "ab"}),
    )
    .await;
    let renew = json!({"lease_ms": 60000, "leases": [
        {"key": K.to_uppercase(), "owner": "00C0FFEE"},
        {"key": other_key, "owner": mine},
        {"key": unclaimed, "owner": mine},
    ]});
    let (st, body) = srv.post("/v1/renew", &renew).await;
    assert_eq!(st, StatusCode::OK);
    assert_eq!(body, json!({"outcome": "renewed", "lost": [1, 2]}));
    let (_, record) = srv.get(&format!("/v1/records/{K}")).await;
    let renewed_end = record["expires_at_ms"].as_u64().unwrap();
    assert!(renewed_end >= first_end + 59_000, "{renewed_end}");
    // Still the same claim (SHA-256 of "00c0ffee", 16 hex digits).
    assert_eq!(record["owner_hash"], "b7e3ef9e4ac67f53");
    let (_, nothing_lost) = srv
        .post(
            "/v1/renew",
            &json!({"lease_ms": 1, "leases": [{"key": K, "owner": mine}]}),
        )
        .await;
    assert_eq!(nothing_lost, json!({"outcome": "renewed", "lost": []}));
    let (_, record) = srv.get(&format!("/v1/records/{K}")).await;
    assert_eq!(record["expires_at_ms"], renewed_end, "never shortened");

    let unauthorized = srv
        .client
        .post(srv.url("/v1/renew"))
        .json(&renew)
        .send()
        .await
        .unwrap();
    assert_eq!(unauthorized.status(), StatusCode::UNAUTHORIZED);

    let lease = json!({"key": K, "owner": mine});
    let too_many: Vec<Value> = vec![lease.clone(); 1025];
    let refused = [
        (json!({"lease_ms": 0, "leases": [lease]}), "`lease_ms`"),
        (
            json!({"lease_ms": 86_400_001, "leases": [lease]}),
            "`lease_ms`",
        ),
        (
            json!({"lease_ms": 5, "leases": []}),
            "`leases`: must hold 1 to 1024",
        ),
        (json!({"lease_ms": 5, "leases": too_many}), "got 1025"),
        (
            json!({"lease_ms": 5, "leases": [lease, {"key": "ab", "owner": mine}]}),
            "`leases[1].key`",
        ),
        (
            json!({"lease_ms": 5, "leases": [{"key": K, "owner": "xyz"}]}),
            "`leases[0].owner`",
        ),
        (json!({"leases": [lease]}), "missing field `lease_ms`"),
        (
            json!({"lease_ms": 5, "leases": [lease], "owner": mine}),
            "unknown field `owner`",
        ),
        (json!({"lease_ms": 5, "leases": lease}), "invalid type"),
    ];
    for (body, mentions) in &refused {
        let resp = srv
            .client
            .post(srv.url("/v1/renew"))
            .bearer_auth(TOKEN)
            .json(body)
            .send()
            .await
            .unwrap();
        assert_bad_request(resp, mentions).await;
    }
    let metrics = srv.metrics().await;
    for needle in [
        r#"idempotency_store_operations_total{operation="renew",outcome="not_owner"} 1"#,
        r#"idempotency_store_operations_total{operation="renew",outcome="renewed"} 1"#,
        r#"idempotency_store_operation_duration_seconds_count{operation="renew"} 2"#,
        r#"idempotency_store_rejected_requests_total{reason="bad_request"} 9"#,
    ] {
        assert!(
            metrics.contains(needle),
            "missing {needle} in
{metrics}"
        );
    }
}

#[tokio::test]
async fn retried_complete_with_same_bytes_is_200_other_bytes_409() {
    let srv = TestServer::start().await;
    let (_, c) = srv
        .post(
            "/v1/claim",
            &json!({"key": K, "fingerprint": FP, "lease_ms": 60000}),
        )
        .await;
    let owner = c["owner"].as_str().unwrap().to_owned();
    let complete = json!({"key": K, "owner": owner, "ttl_ms": 86400000, "record": "aGVsbG8="});
    let (st, done) = srv.post("/v1/complete", &complete).await;
    assert_eq!(
        (st, done),
        (StatusCode::OK, json!({"outcome": "completed"}))
    );
    let (_, before) = srv.get(&format!("/v1/records/{K}")).await;

    let retry = json!({"key": K, "owner": owner, "ttl_ms": 1, "record": "aGVsbG8="});
    let (st, again) = srv.post("/v1/complete", &retry).await;
    assert_eq!(
        (st, again),
        (StatusCode::OK, json!({"outcome": "completed"}))
    );

    let other = json!({"key": K, "owner": owner, "ttl_ms": 1, "record": "b3RoZXI="});
    let (st, refused) = srv.post("/v1/complete", &other).await;
    assert_eq!(st, StatusCode::CONFLICT);
    assert_eq!(refused["outcome"], "not_owner");

    let (_, mut after) = srv.get(&format!("/v1/records/{K}")).await;
    // Everything but the store's clock at each read.
    let mut before = before;
    for read in [&mut before, &mut after] {
        read.as_object_mut().unwrap().remove("now_ms");
    }
    assert_eq!(after, before, "record, expiry and write time unchanged");
    let metrics = srv.metrics().await;
    for needle in [
        r#"idempotency_store_operations_total{operation="complete",outcome="completed"} 2"#,
        r#"idempotency_store_operations_total{operation="complete",outcome="not_owner"} 1"#,
    ] {
        assert!(metrics.contains(needle), "missing {needle} in\n{metrics}");
    }
}

/// A backend that is down.
struct Broken;

#[async_trait]
impl Storage for Broken {
    fn backend_name(&self) -> &'static str {
        "broken"
    }
    async fn claim(
        &self,
        _: &Digest,
        _: &Digest,
        _: u64,
        _: &OwnerToken,
    ) -> Result<ClaimOutcome, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
    async fn complete_or_create(
        &self,
        _: &Digest,
        _: &OwnerToken,
        _: u64,
        _: u64,
        _: Vec<u8>,
        _: Option<&Digest>,
    ) -> Result<CompleteOutcome, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
    async fn release(&self, _: &Digest, _: &OwnerToken) -> Result<ReleaseOutcome, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
    async fn settle_exactly(
        &self,
        _: &Digest,
        _: &[u8],
        _: Option<Replacement>,
    ) -> Result<SettleOutcome, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
    async fn renew(
        &self,
        _: &Digest,
        _: &OwnerToken,
        _: u64,
    ) -> Result<RenewOutcome, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
    async fn lookup(&self, _: &Digest) -> Result<Option<RecordView>, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
    async fn purge(&self, _: &Digest) -> Result<Option<RecordView>, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
    async fn find_by_prefix(&self, _: &KeyPrefix, _: usize) -> Result<PrefixMatches, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
    async fn sweep_expired(&self) -> Result<u64, StorageError> {
        Err(StorageError::Backend("down".into()))
    }
}

#[tokio::test]
async fn backend_failure_is_503_and_counted() {
    let srv = TestServer::start_with(Arc::new(Broken), auth(), 4096).await;
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
    let (st, _) = srv.get(&format!("/v1/records?prefix={}", &K[..8])).await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE);
    let (st, _) = srv
        .delete(&format!("/v1/records/{K}"), Some(OPERATOR_TOKEN))
        .await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE);
    // A batch fails as a whole, once, whichever of its leases failed.
    let (st, body) = srv
        .post(
            "/v1/renew",
            &json!({"lease_ms": 1000, "leases": [{"key": K, "owner": "ab"}, {"key": FP, "owner": "ab"}]}),
        )
        .await;
    assert_eq!(st, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["type"], "urn:idempotency-store:backend-unavailable");
    let metrics = srv.metrics().await;
    assert!(
        metrics.contains(r#"idempotency_store_backend_errors_total{backend="broken"} 5"#),
        "{metrics}"
    );
    assert!(metrics
        .contains(r#"idempotency_store_operations_total{operation="renew",outcome="error"} 1"#));
    assert!(metrics
        .contains(r#"idempotency_store_operations_total{operation="claim",outcome="error"} 1"#));
}

/// Memory storage whose writes wait for `gate` (after announcing themselves
/// on `entered`), so a test can hold an operation inside the backend while
/// the client gives up.
struct Gated {
    inner: MemoryStorage,
    entered: Arc<Notify>,
    gate: Arc<Notify>,
}

impl Gated {
    async fn hold(&self) {
        self.entered.notify_one();
        self.gate.notified().await;
    }
}

#[async_trait]
impl Storage for Gated {
    fn backend_name(&self) -> &'static str {
        "gated"
    }
    async fn claim(
        &self,
        key: &Digest,
        fp: &Digest,
        lease_ms: u64,
        owner: &OwnerToken,
    ) -> Result<ClaimOutcome, StorageError> {
        self.hold().await;
        self.inner.claim(key, fp, lease_ms, owner).await
    }
    async fn complete_or_create(
        &self,
        key: &Digest,
        owner: &OwnerToken,
        ttl_ms: u64,
        tombstone_ms: u64,
        record: Vec<u8>,
        fingerprint: Option<&Digest>,
    ) -> Result<CompleteOutcome, StorageError> {
        self.hold().await;
        self.inner
            .complete_or_create(key, owner, ttl_ms, tombstone_ms, record, fingerprint)
            .await
    }
    async fn release(
        &self,
        key: &Digest,
        owner: &OwnerToken,
    ) -> Result<ReleaseOutcome, StorageError> {
        self.hold().await;
        self.inner.release(key, owner).await
    }
    async fn settle_exactly(
        &self,
        key: &Digest,
        current: &[u8],
        replacement: Option<Replacement>,
    ) -> Result<SettleOutcome, StorageError> {
        self.hold().await;
        self.inner.settle_exactly(key, current, replacement).await
    }
    async fn renew(
        &self,
        key: &Digest,
        owner: &OwnerToken,
        lease_ms: u64,
    ) -> Result<RenewOutcome, StorageError> {
        self.hold().await;
        self.inner.renew(key, owner, lease_ms).await
    }
    async fn lookup(&self, key: &Digest) -> Result<Option<RecordView>, StorageError> {
        self.inner.lookup(key).await
    }
    async fn purge(&self, key: &Digest) -> Result<Option<RecordView>, StorageError> {
        self.inner.purge(key).await
    }
    async fn find_by_prefix(
        &self,
        prefix: &KeyPrefix,
        limit: usize,
    ) -> Result<PrefixMatches, StorageError> {
        self.hold().await;
        self.inner.find_by_prefix(prefix, limit).await
    }
    async fn sweep_expired(&self) -> Result<u64, StorageError> {
        self.inner.sweep_expired().await
    }
}

#[tokio::test]
async fn one_prefix_search_runs_at_a_time_and_another_is_told_when_to_retry() {
    let (entered, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let storage = Arc::new(Gated {
        inner: MemoryStorage::new(Arc::new(SystemClock)),
        entered: Arc::clone(&entered),
        gate: Arc::clone(&gate),
    });
    let srv =
        Arc::new(TestServer::start_with(storage, auth(), server::DEFAULT_MAX_BODY_BYTES).await);
    let search = format!("/v1/records?prefix={}", &K[..16]);
    let first = tokio::spawn({
        let (srv, search) = (Arc::clone(&srv), search.clone());
        async move { srv.get(&search).await }
    });
    within("the first search to reach the backend", entered.notified()).await;
    let refused = within(
        "the second search to be refused at once",
        srv.client
            .get(srv.url(&search))
            .bearer_auth(OPERATOR_TOKEN)
            .send(),
    )
    .await
    .unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "2");
    assert_eq!(content_type(&refused), "application/problem+json");
    let body: Value = refused.json().await.unwrap();
    assert_eq!(body["type"], "urn:idempotency-store:too-many-requests");
    // Lookups are not searches: they go on.
    assert_eq!(
        srv.get(&format!("/v1/records/{K}")).await.0,
        StatusCode::NOT_FOUND
    );

    gate.notify_one();
    let (st, _) = first.await.unwrap();
    assert_eq!(st, StatusCode::OK);
    // Its place is free again once it ended.
    let next = tokio::spawn({
        let srv = Arc::clone(&srv);
        async move { srv.get(&search).await }
    });
    within("the next search to reach the backend", entered.notified()).await;
    gate.notify_one();
    assert_eq!(next.await.unwrap().0, StatusCode::OK);
    assert!(srv
        .metrics()
        .await
        .contains(r#"idempotency_store_rejected_requests_total{reason="throttled"} 1"#));
}

/// Fires its `Notify` when dropped while armed: the server dropped a request
/// future before it produced a response (the client went away).
struct AbandonedSignal(Option<Arc<Notify>>);

impl AbandonedSignal {
    /// The request finished normally.
    fn disarm(&mut self) {
        self.0 = None;
    }
}

impl Drop for AbandonedSignal {
    fn drop(&mut self) {
        if let Some(n) = self.0.take() {
            n.notify_one();
        }
    }
}

async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// The client gives up while the claim is inside the backend; the server drops
/// the request future. The claim must still be applied and counted.
async fn abandoned_claim_still_completes_and_is_counted(client: Client) {
    let (entered, gate, abandoned) = (
        Arc::new(Notify::new()),
        Arc::new(Notify::new()),
        Arc::new(Notify::new()),
    );
    let storage = Arc::new(Gated {
        inner: MemoryStorage::new(Arc::new(SystemClock)),
        entered: Arc::clone(&entered),
        gate: Arc::clone(&gate),
    });
    let signal = Arc::clone(&abandoned);
    let srv = TestServer::start_wrapped(
        storage,
        auth(),
        server::DEFAULT_MAX_BODY_BYTES,
        move |app| {
            app.layer(axum::middleware::from_fn(
                move |req: Request, next: Next| {
                    let mut guard = AbandonedSignal(Some(Arc::clone(&signal)));
                    async move {
                        let resp = next.run(req).await;
                        guard.disarm();
                        resp
                    }
                },
            ))
        },
    )
    .await;

    let mine = "5eed".repeat(8);
    let request = client
        .post(srv.url("/v1/claim"))
        .bearer_auth(TOKEN)
        .json(&json!({"key": K, "fingerprint": FP, "lease_ms": 60000, "owner": mine}))
        .send();
    let in_flight = tokio::spawn(request);
    within("the claim to reach the backend", entered.notified()).await;
    // The client gives up (as Envoy does on its callout timeout).
    in_flight.abort();
    assert!(in_flight.await.unwrap_err().is_cancelled());
    within(
        "the server to drop the abandoned request",
        abandoned.notified(),
    )
    .await;
    assert!(!srv.metrics().await.contains(r#"operation="claim""#));

    // Only now does the backend answer.
    gate.notify_one();
    let needle = r#"idempotency_store_operations_total{operation="claim",outcome="claimed"} 1"#;
    within("the abandoned claim to be counted", async {
        while !srv.metrics().await.contains(needle) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let metrics = srv.metrics().await;
    assert!(
        metrics
            .contains(r#"idempotency_store_operation_duration_seconds_count{operation="claim"} 1"#),
        "{metrics}"
    );
    let (st, rec) = srv.get(&format!("/v1/records/{K}")).await;
    assert_eq!((st, &rec["state"]), (StatusCode::OK, &json!("in_flight")));

    // The client knows the owner it chose and can free the key at once.
    let release = tokio::spawn({
        let (client, url) = (srv.client.clone(), srv.url("/v1/release"));
        async move {
            client
                .post(url)
                .bearer_auth(TOKEN)
                .json(&json!({"key": K, "owner": mine}))
                .send()
                .await
                .unwrap()
        }
    });
    within("the release to reach the backend", entered.notified()).await;
    gate.notify_one();
    assert_eq!(release.await.unwrap().status(), StatusCode::OK);
}

#[tokio::test]
async fn abandoned_http1_request_still_completes_and_is_counted() {
    abandoned_claim_still_completes_and_is_counted(Client::new()).await;
}

#[tokio::test]
async fn abandoned_h2c_request_still_completes_and_is_counted() {
    let h2 = Client::builder().http2_prior_knowledge().build().unwrap();
    abandoned_claim_still_completes_and_is_counted(h2).await;
}

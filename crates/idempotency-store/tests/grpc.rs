//! The gRPC stream (`proto/idempotency_store.proto`) on the real router over loopback, on the
//! embedded and the Redis backend: one stream carries every operation, answers come back by id,
//! and the stream and the HTTP API see the same records.

// Test code: a failed unwrap/index is a failed test, which is the point.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idempotency_store::clock::SystemClock;
use idempotency_store::grpc::pb;
use idempotency_store::grpc::pb::answer::Result as Reply;
use idempotency_store::grpc::pb::call::Op;
use idempotency_store::grpc::pb::store_client::StoreClient;
use idempotency_store::metrics::Metrics;
use idempotency_store::ops::auth::Auth;
use idempotency_store::ops::AppState;
use idempotency_store::server::{self, RouterOptions};
use idempotency_store::storage::embedded::EmbeddedStorage;
use idempotency_store::storage::redis::RedisStorage;
use idempotency_store::storage::Storage;
use idempotency_store::waits::WaitRoom;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Request, Streaming};

use common::{random_digest, RedisServer};

const TOKEN: &str = "grpc-test-token-0123";
const OPERATOR_TOKEN: &str = "grpc-test-operator-token";
const LEASE_MS: u64 = 60_000;
const TTL_MS: u64 = 600_000;

struct Store {
    addr: String,
    /// The store instance's waits, to see how many it holds.
    waits: Arc<WaitRoom>,
    /// Cancelled to start a shutdown, as the store's signal handler does.
    draining: tokio_util::sync::CancellationToken,
    _stop: oneshot::Sender<()>,
    _guard: Box<dyn Send>,
}

impl Store {
    async fn start(storage: Arc<dyn Storage>, guard: Box<dyn Send>) -> Self {
        Self::start_with(storage, guard, RouterOptions::default()).await
    }

    async fn start_with(
        storage: Arc<dyn Storage>,
        guard: Box<dyn Send>,
        options: RouterOptions,
    ) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let draining = tokio_util::sync::CancellationToken::new();
        let state = AppState::new(
            storage,
            Arc::new(Metrics::new()),
            Auth::bearer(TOKEN).with_operator_token(OPERATOR_TOKEN),
            draining.clone(),
            idempotency_store::waits::DEFAULT_MAX_WAITS,
        );
        let waits = Arc::clone(&state.waits);
        let app = server::router_with(state, options);
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(server::serve(listener, app, async {
            let _ = stopped.await;
        }));
        Self {
            addr: format!("http://{addr}"),
            waits,
            draining,
            _stop: stop,
            _guard: guard,
        }
    }

    async fn embedded() -> Self {
        Self::embedded_with(RouterOptions::default()).await
    }

    async fn embedded_with(options: RouterOptions) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let storage = EmbeddedStorage::open(dir.path(), Arc::new(SystemClock)).unwrap();
        Self::start_with(Arc::new(storage), Box::new(dir), options).await
    }

    async fn redis() -> Self {
        let redis = RedisServer::start();
        let storage = RedisStorage::connect(&redis.url()).await.unwrap();
        Self::start(Arc::new(storage), Box::new(redis)).await
    }

    async fn client(&self) -> StoreClient<Channel> {
        let channel = Channel::from_shared(self.addr.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        StoreClient::new(channel).max_decoding_message_size(16 << 20)
    }

    /// Opens a stream with `token`; calls go in through the sender.
    async fn open(
        &self,
        token: &str,
    ) -> Result<(mpsc::Sender<pb::Call>, Streaming<pb::Answer>), tonic::Status> {
        let (calls, rx) = mpsc::channel(4096);
        let mut request = Request::new(ReceiverStream::new(rx));
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        let answers = self.client().await.coordinate(request).await?.into_inner();
        Ok((calls, answers))
    }
}

/// One stream and the ids of its calls.
struct Conversation {
    calls: mpsc::Sender<pb::Call>,
    answers: Streaming<pb::Answer>,
    next_id: u64,
}

impl Conversation {
    async fn open(store: &Store) -> Self {
        let (calls, answers) = store.open(TOKEN).await.unwrap();
        Self {
            calls,
            answers,
            next_id: 1,
        }
    }

    async fn send(&mut self, op: Op) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.calls
            .send(pb::Call { id, op: Some(op) })
            .await
            .unwrap();
        id
    }

    async fn next(&mut self) -> pb::Answer {
        tokio::time::timeout(Duration::from_secs(10), self.answers.message())
            .await
            .expect("an answer within 10 s")
            .unwrap()
            .expect("the stream still open")
    }

    /// One call, and its answer.
    async fn call(&mut self, op: Op) -> Reply {
        let id = self.send(op).await;
        let answer = self.next().await;
        assert_eq!(answer.id, id);
        answer.result.unwrap()
    }
}

fn claim(key: &str, fingerprint: &str, owner: &str) -> Op {
    Op::Claim(pb::Claim {
        key: key.into(),
        fingerprint: fingerprint.into(),
        lease_ms: LEASE_MS,
        owner: owner.into(),
    })
}

fn complete(key: &str, owner: &str, record: &[u8]) -> Op {
    Op::Complete(pb::Complete {
        key: key.into(),
        owner: owner.into(),
        ttl_ms: TTL_MS,
        record: record.to_vec(),
        fingerprint: String::new(),
        tombstone_ms: 0,
    })
}

fn release(key: &str, owner: &str) -> Op {
    Op::Release(pb::Release {
        key: key.into(),
        owner: owner.into(),
    })
}

async fn one_stream_carries_every_operation(store: Store) {
    let mut s = Conversation::open(&store).await;
    let (key, fp, other_fp) = (random_digest(), random_digest(), random_digest());
    let (key, fp, other_fp) = (key.as_str(), fp.as_str(), other_fp.as_str());

    let Reply::Claimed(claimed) = s.call(claim(key, fp, "")).await else {
        panic!("a new key is claimed");
    };
    assert!(!claimed.owner.is_empty() && claimed.lease_expires_at_ms > 0);
    assert!(matches!(s.call(claim(key, fp, "")).await, Reply::InFlight(f) if f.retry_after_ms > 0));
    assert!(matches!(
        s.call(claim(key, other_fp, "")).await,
        Reply::Mismatch(_)
    ));
    assert!(matches!(
        s.call(complete(key, "abcdef", b"x")).await,
        Reply::NotOwner(_)
    ));

    let record = b"HTTP/1.1 201 recorded response bytes".to_vec();
    assert!(matches!(
        s.call(complete(key, &claimed.owner, &record)).await,
        Reply::Recorded(_)
    ));
    match s.call(claim(key, fp, "")).await {
        Reply::Completed(found) => assert_eq!(found.record, record),
        other => panic!("a completed key replays its record, got {other:?}"),
    }
    // A lookup answers what the key holds and changes nothing; a key with nothing is
    // `released`, and stays free.
    let look = |k: &str| Op::Lookup(pb::Lookup { key: k.to_owned() });
    match s.call(look(key)).await {
        Reply::Completed(found) => assert_eq!(found.record, record),
        other => panic!("a lookup of a completed key, got {other:?}"),
    }
    let nothing = random_digest();
    assert!(matches!(
        s.call(look(nothing.as_str())).await,
        Reply::Released(_)
    ));
    assert!(matches!(
        s.call(claim(nothing.as_str(), fp, "")).await,
        Reply::Claimed(_)
    ));
    assert!(
        matches!(s.call(look(nothing.as_str())).await, Reply::InFlight(f) if f.retry_after_ms > 0)
    );

    let released_key = random_digest();
    let owner = "0123456789abcdef";
    assert!(
        matches!(s.call(claim(released_key.as_str(), fp, owner)).await, Reply::Claimed(c) if c.owner == owner)
    );
    assert!(matches!(
        s.call(release(released_key.as_str(), "fedcba")).await,
        Reply::NotOwner(_)
    ));
    assert!(matches!(
        s.call(release(released_key.as_str(), owner)).await,
        Reply::Released(_)
    ));
    assert!(matches!(
        s.call(claim(released_key.as_str(), fp, "")).await,
        Reply::Claimed(_)
    ));
}

#[tokio::test]
async fn one_stream_carries_every_operation_on_the_embedded_backend() {
    one_stream_carries_every_operation(Store::embedded().await).await;
}

#[tokio::test]
async fn one_stream_carries_every_operation_on_redis() {
    one_stream_carries_every_operation(Store::redis().await).await;
}

/// A settle; `kept` = (ttl_ms, tombstone_ms) of the replacement.
fn settle(key: &str, current: &[u8], record: &[u8], kept: (u64, u64)) -> Op {
    Op::Settle(pb::Settle {
        key: key.into(),
        current: current.to_vec(),
        record: record.to_vec(),
        ttl_ms: kept.0,
        tombstone_ms: kept.1,
    })
}

/// The data-plane token can look a completed record up and name it byte for byte: a settle of
/// it is refused by name and changes nothing, so the write is not run again. An unknown
/// outcome is settled as before.
async fn a_settle_frees_only_an_unknown_outcome(store: Store) {
    use idempotency_protocol::record::{RecordedResponse, UnknownOutcome};
    let mut s = Conversation::open(&store).await;
    let fp = random_digest();
    let charged = RecordedResponse {
        status: 201,
        body: br#"{"charge":1}"#.to_vec(),
        ..RecordedResponse::default()
    }
    .encode();
    let unknown = RecordedResponse::unknown_outcome(UnknownOutcome::default()).encode();
    for (key, record) in [
        (random_digest(), charged.clone()),
        (random_digest(), unknown.clone()),
    ] {
        let key = key.as_str();
        let Reply::Claimed(claimed) = s.call(claim(key, fp.as_str(), "")).await else {
            panic!("a new key is claimed");
        };
        assert!(matches!(
            s.call(complete(key, &claimed.owner, &record)).await,
            Reply::Recorded(_)
        ));
        let Reply::Completed(looked_up) = s.call(Op::Lookup(pb::Lookup { key: key.into() })).await
        else {
            panic!("a completed key's lookup");
        };
        let settled = s.call(settle(key, &looked_up.record, b"", (0, 0))).await;
        let retry = s.call(claim(key, fp.as_str(), "")).await;
        if record == unknown {
            assert!(matches!(settled, Reply::Released(_)), "{settled:?}");
            assert!(matches!(retry, Reply::Claimed(_)), "freed: {retry:?}");
        } else {
            match settled {
                Reply::Failure(f) => {
                    assert_eq!(f.kind, pb::failure::Kind::BadRequest as i32);
                    assert!(
                        f.detail.contains("`current`") && f.detail.contains("unknown outcome"),
                        "{}",
                        f.detail
                    );
                }
                other => panic!("a recorded response settled: {other:?}"),
            }
            assert!(
                matches!(&retry, Reply::Completed(c) if c.record == charged),
                "replayed, not run again: {retry:?}"
            );
        }
    }
}

/// A settle's `tombstone_ms` keeps its replacement past the TTL without its body, as a
/// completion's does: a redelivery then replays the status and never runs again.
async fn a_settle_keeps_the_tombstone_it_carries(store: Store) {
    use idempotency_protocol::record::{RecordedResponse, UnknownOutcome};
    let mut s = Conversation::open(&store).await;
    let (key, fp) = (random_digest(), random_digest());
    let (key, fp) = (key.as_str(), fp.as_str());
    let unknown = RecordedResponse::unknown_outcome(UnknownOutcome::default()).encode();
    let charged = RecordedResponse {
        status: 200,
        body: br#"{"charge":1}"#.to_vec(),
        ..RecordedResponse::default()
    };
    let Reply::Claimed(claimed) = s.call(claim(key, fp, "")).await else {
        panic!("a new key is claimed");
    };
    assert!(matches!(
        s.call(complete(key, &claimed.owner, &unknown)).await,
        Reply::Recorded(_)
    ));
    let took_effect = settle(key, &unknown, &charged.encode(), (100, TTL_MS));
    assert!(matches!(s.call(took_effect).await, Reply::Recorded(_)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    match s.call(claim(key, fp, "")).await {
        Reply::Completed(found) => assert_eq!(found.record, charged.without_body().encode()),
        other => panic!("past its TTL, the tombstone: got {other:?}"),
    }
}

#[tokio::test]
async fn a_settle_keeps_the_tombstone_it_carries_on_the_embedded_backend() {
    a_settle_keeps_the_tombstone_it_carries(Store::embedded().await).await;
}

#[tokio::test]
async fn a_settle_keeps_the_tombstone_it_carries_on_redis() {
    a_settle_keeps_the_tombstone_it_carries(Store::redis().await).await;
}

#[tokio::test]
async fn a_settle_frees_only_an_unknown_outcome_on_the_embedded_backend() {
    a_settle_frees_only_an_unknown_outcome(Store::embedded().await).await;
}

#[tokio::test]
async fn a_settle_frees_only_an_unknown_outcome_on_redis() {
    a_settle_frees_only_an_unknown_outcome(Store::redis().await).await;
}

#[tokio::test]
async fn many_calls_in_flight_are_each_answered_once_by_id_and_a_bad_one_fails_alone() {
    let store = Store::embedded().await;
    let mut s = Conversation::open(&store).await;
    let fp = random_digest();
    let mut expected = HashMap::new();
    for _ in 0..300 {
        let key = random_digest();
        let id = s.send(claim(key.as_str(), fp.as_str(), "")).await;
        expected.insert(id, "claimed");
    }
    let bad = s.send(claim("not-a-digest", fp.as_str(), "")).await;
    expected.insert(bad, "bad_request");
    let empty = s
        .calls
        .send(pb::Call {
            id: 9_999,
            op: None,
        })
        .await
        .map(|()| 9_999)
        .unwrap();
    expected.insert(empty, "bad_request");

    let mut seen = HashMap::new();
    for _ in 0..expected.len() {
        let answer = s.next().await;
        let kind = match answer.result.unwrap() {
            Reply::Claimed(_) => "claimed",
            Reply::Failure(f) if f.kind == pb::failure::Kind::BadRequest as i32 => {
                if answer.id == bad {
                    assert!(f.detail.contains("key"), "{}", f.detail);
                }
                "bad_request"
            }
            other => panic!("unexpected {other:?}"),
        };
        assert!(
            seen.insert(answer.id, kind).is_none(),
            "id {} answered twice",
            answer.id
        );
    }
    assert_eq!(seen, expected);

    // The failures did not end the stream.
    let key = random_digest();
    assert!(matches!(
        s.call(claim(key.as_str(), fp.as_str(), "")).await,
        Reply::Claimed(_)
    ));
}

#[tokio::test]
async fn a_stream_without_the_token_is_refused() {
    let store = Store::embedded().await;
    // The operators' token is no data-plane token.
    match store.open(OPERATOR_TOKEN).await {
        Err(status) => {
            assert_eq!(status.code(), Code::PermissionDenied);
            assert!(status.message().contains("operator token"), "{status}");
        }
        Ok((_, mut answers)) => {
            let status = answers.message().await.unwrap_err();
            assert_eq!(status.code(), Code::PermissionDenied);
        }
    }
    match store.open("wrong-token").await {
        Err(status) => assert_eq!(status.code(), Code::Unauthenticated),
        Ok((calls, mut answers)) => {
            // Some transports report the refusal on the first read instead.
            let _ = calls
                .send(pb::Call {
                    id: 1,
                    op: Some(claim(
                        random_digest().as_str(),
                        random_digest().as_str(),
                        "",
                    )),
                })
                .await;
            let status = answers.message().await.unwrap_err();
            assert_eq!(status.code(), Code::Unauthenticated);
        }
    }
}

#[tokio::test]
async fn a_three_mebibyte_record_round_trips_in_one_message() {
    let store = Store::embedded().await;
    let mut s = Conversation::open(&store).await;
    let (key, fp) = (random_digest(), random_digest());
    let Reply::Claimed(claimed) = s.call(claim(key.as_str(), fp.as_str(), "")).await else {
        panic!("claimed");
    };
    let record: Vec<u8> = (0..3 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
    assert!(matches!(
        s.call(complete(key.as_str(), &claimed.owner, &record))
            .await,
        Reply::Recorded(_)
    ));
    match s.call(claim(key.as_str(), fp.as_str(), "")).await {
        Reply::Completed(found) => assert!(found.record == record),
        other => panic!("replay expected, got {other:?}"),
    }
}

#[tokio::test]
async fn the_stream_and_the_http_api_see_the_same_records() {
    let store = Store::embedded().await;
    let mut s = Conversation::open(&store).await;
    let (key, fp) = (random_digest(), random_digest());
    assert!(matches!(
        s.call(claim(key.as_str(), fp.as_str(), "")).await,
        Reply::Claimed(_)
    ));

    let http = reqwest::Client::new()
        .post(format!("{}/v1/claim", store.addr))
        .bearer_auth(TOKEN)
        .json(
            &serde_json::json!({"key": key.as_str(), "fingerprint": fp.as_str(), "lease_ms": 1000}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(http.status(), reqwest::StatusCode::OK);
    let body: serde_json::Value = http.json().await.unwrap();
    assert_eq!(body["outcome"], "in_flight");
}

/// A store whose calls may be at most `LIMIT` bytes (`--max-body-bytes`).
const LIMIT: usize = 65_536;

async fn small_limit_store() -> Store {
    Store::embedded_with(RouterOptions {
        max_body_bytes: LIMIT,
        ..RouterOptions::default()
    })
    .await
}

#[tokio::test]
async fn the_stream_announces_the_largest_call_it_takes() {
    for (store, limit) in [
        (small_limit_store().await, LIMIT),
        (Store::embedded().await, server::DEFAULT_MAX_BODY_BYTES),
    ] {
        let (_calls, rx) = mpsc::channel::<pb::Call>(1);
        let mut request = Request::new(ReceiverStream::new(rx));
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
        let response = store.client().await.coordinate(request).await.unwrap();
        let announced = response
            .metadata()
            .get(idempotency_store::grpc::MAX_MESSAGE_BYTES_METADATA)
            .expect("the limit in the initial metadata");
        assert_eq!(announced.to_str().unwrap(), limit.to_string());
    }
    assert_eq!(
        idempotency_store::grpc::MAX_MESSAGE_BYTES_METADATA,
        "x-idempotency-store-max-message-bytes"
    );
}

#[tokio::test]
async fn a_call_over_the_limit_is_refused_alone_and_the_stream_goes_on() {
    use prost::Message as _;
    let store = small_limit_store().await;
    let mut s = Conversation::open(&store).await;
    let (key, fp) = (random_digest(), random_digest());
    let Reply::Claimed(claimed) = s.call(claim(key.as_str(), fp.as_str(), "")).await else {
        panic!("claimed");
    };
    let op = complete(key.as_str(), &claimed.owner, &vec![7u8; LIMIT]);
    let id = s.next_id;
    let bytes = pb::Call {
        id,
        op: Some(op.clone()),
    }
    .encoded_len();
    assert!(bytes > LIMIT && bytes < 2 * LIMIT);
    match s.call(op).await {
        Reply::Failure(f) => {
            assert_eq!(f.kind, pb::failure::Kind::BadRequest as i32);
            assert_eq!(
                f.detail,
                format!("message of {bytes} bytes is over the store's limit of {LIMIT} bytes")
            );
        }
        other => panic!("refused, got {other:?}"),
    }
    // The stream is still open, and the refused completion changed nothing.
    assert!(matches!(
        s.call(claim(key.as_str(), fp.as_str(), "")).await,
        Reply::InFlight(_)
    ));
    let small = vec![7u8; LIMIT / 2];
    assert!(matches!(
        s.call(complete(key.as_str(), &claimed.owner, &small)).await,
        Reply::Recorded(_)
    ));
}

#[tokio::test]
async fn a_message_over_twice_the_limit_ends_the_stream_with_out_of_range() {
    let store = small_limit_store().await;
    let mut s = Conversation::open(&store).await;
    let (key, fp) = (random_digest(), random_digest());
    let Reply::Claimed(claimed) = s.call(claim(key.as_str(), fp.as_str(), "")).await else {
        panic!("claimed");
    };
    let record = vec![7u8; 2 * LIMIT + 1];
    s.send(complete(key.as_str(), &claimed.owner, &record))
        .await;
    let status = tokio::time::timeout(Duration::from_secs(10), s.answers.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
}

#[tokio::test]
async fn a_shutdown_ends_open_streams_after_answering_their_calls() {
    // A stream never ends by itself: without this, a stopping store would wait out its whole
    // grace period for every connected proxy.
    let store = Store::embedded().await;
    let mut s = Conversation::open(&store).await;
    let (key, fp) = (random_digest(), random_digest());
    let id = s.send(claim(key.as_str(), fp.as_str(), "")).await;
    let answer = s.next().await;
    assert_eq!(answer.id, id);
    store.draining.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(5), s.answers.message())
        .await
        .expect("the stream ends within 5 s of the shutdown");
    let status = ended.expect_err("the stream ends with a status");
    assert_eq!(status.code(), Code::Unavailable, "{status}");
}

fn wait(key: &str, fingerprint: &str, wait_ms: u64) -> Op {
    Op::Wait(pb::Wait {
        key: key.into(),
        fingerprint: fingerprint.into(),
        wait_ms,
    })
}

/// Waits end with the record once it completes, as released once it is released, and in
/// flight at their bound; claims sent behind a held wait are answered at once.
async fn a_wait_ends_when_the_key_in_flight_does(store: Store) {
    let mut s = Conversation::open(&store).await;
    let mut other = Conversation::open(&store).await;
    let (key, fp) = (random_digest(), random_digest());
    let (key, fp) = (key.as_str(), fp.as_str());
    let owner = "00aa11bb";
    assert!(matches!(
        s.call(claim(key, fp, owner)).await,
        Reply::Claimed(_)
    ));

    let waits: Vec<u64> = [
        s.send(wait(key, fp, 20_000)).await,
        s.send(wait(key, fp, 20_000)).await,
    ]
    .into();
    // Held waits do not hold up the calls behind them.
    let busy = random_digest();
    assert!(matches!(
        s.call(claim(busy.as_str(), fp, "")).await,
        Reply::Claimed(_)
    ));
    let record = b"the first response".to_vec();
    let started = std::time::Instant::now();
    // Completed over another stream: the waits are woken, not polled.
    assert!(matches!(
        other.call(complete(key, owner, &record)).await,
        Reply::Recorded(_)
    ));
    for _ in &waits {
        let answer = s.next().await;
        assert!(waits.contains(&answer.id));
        match answer.result.unwrap() {
            Reply::Completed(found) => assert_eq!(found.record, record),
            other => panic!("the waits get the record, got {other:?}"),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(5));

    let (released_key, owner) = (random_digest(), "00cc22dd");
    assert!(matches!(
        s.call(claim(released_key.as_str(), fp, owner)).await,
        Reply::Claimed(_)
    ));
    let id = s.send(wait(released_key.as_str(), fp, 20_000)).await;
    assert!(matches!(
        other.call(release(released_key.as_str(), owner)).await,
        Reply::Released(_)
    ));
    let answer = s.next().await;
    assert_eq!(answer.id, id);
    assert!(matches!(answer.result.unwrap(), Reply::Released(_)));

    // Nobody ends it: in flight at the bound. A bad wait is refused, the stream goes on.
    let answer = s.call(wait(busy.as_str(), fp, 300)).await;
    assert!(matches!(answer, Reply::InFlight(f) if f.retry_after_ms > 0));
    assert!(matches!(
        s.call(wait(busy.as_str(), fp, 0)).await,
        Reply::Failure(_)
    ));
    assert!(matches!(
        s.call(wait("nothex", fp, 100)).await,
        Reply::Failure(_)
    ));
}

/// Polls `what` every 10 ms for up to 5 s.
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    for _ in 0..500 {
        if check() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never: {what}");
}

#[tokio::test]
async fn waits_beyond_the_streams_places_are_answered_in_flight_at_once_and_end_with_it() {
    let places = 4;
    let store = Store::embedded_with(RouterOptions {
        max_calls_per_stream: places,
        ..RouterOptions::default()
    })
    .await;
    let mut s = Conversation::open(&store).await;
    let (key, fp) = (random_digest(), random_digest());
    let (key, fp) = (key.as_str(), fp.as_str());
    assert!(matches!(
        s.call(claim(key, fp, "00aa11bb")).await,
        Reply::Claimed(_)
    ));
    let mut held = Vec::new();
    for _ in 0..places {
        held.push(s.send(wait(key, fp, 30_000)).await);
    }
    eventually("the stream's waits held", || {
        store.waits.holding() == places
    })
    .await;
    // Beyond the stream's places (the store instance's 10,000 are far off): refused at once,
    // with no task spawned for them.
    let started = std::time::Instant::now();
    let beyond = [
        s.send(wait(key, fp, 30_000)).await,
        s.send(wait(key, fp, 30_000)).await,
    ];
    for _ in beyond {
        let answer = s.next().await;
        assert!(beyond.contains(&answer.id), "answer to {}", answer.id);
        assert!(
            matches!(answer.result, Some(Reply::InFlight(f)) if f.retry_after_ms == 1),
            "{answer:?}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(store.waits.holding(), places);
    // The waits hold no call slot: a claim still goes through.
    assert!(matches!(
        s.call(claim(random_digest().as_str(), fp, "")).await,
        Reply::Claimed(_)
    ));

    // The client goes away: every wait of its stream ends, and with it its place.
    drop(s);
    eventually("the waits of a stream that is gone to end", || {
        store.waits.holding() == 0
    })
    .await;
    assert!(!held.is_empty());
}

#[tokio::test]
async fn a_wait_ends_when_the_key_in_flight_does_on_the_embedded_backend() {
    a_wait_ends_when_the_key_in_flight_does(Store::embedded().await).await;
}

#[tokio::test]
async fn a_wait_ends_when_the_key_in_flight_does_on_redis() {
    a_wait_ends_when_the_key_in_flight_does(Store::redis().await).await;
}

fn renew(lease_ms: u64, leases: &[(&str, &str)]) -> Op {
    Op::Renew(pb::Renew {
        lease_ms,
        leases: leases
            .iter()
            .map(|(key, owner)| pb::Lease {
                key: (*key).into(),
                owner: (*owner).into(),
            })
            .collect(),
    })
}

/// A renew keeps the caller's claims past their first lease and names the leases it lost; a
/// malformed one is refused naming the field, and the stream goes on.
async fn a_renew_keeps_the_claims_still_running(store: Store) {
    let mut s = Conversation::open(&store).await;
    let (mine, theirs, done, unclaimed, fp) = (
        random_digest(),
        random_digest(),
        random_digest(),
        random_digest(),
        random_digest(),
    );
    let (mine, theirs, done, unclaimed, fp) = (
        mine.as_str(),
        theirs.as_str(),
        done.as_str(),
        unclaimed.as_str(),
        fp.as_str(),
    );
    let owner = "00aa11bb";
    let short = Op::Claim(pb::Claim {
        key: mine.into(),
        fingerprint: fp.into(),
        lease_ms: 1_000,
        owner: owner.into(),
    });
    assert!(matches!(s.call(short).await, Reply::Claimed(_)));
    assert!(matches!(
        s.call(claim(theirs, fp, "ffee")).await,
        Reply::Claimed(_)
    ));
    assert!(matches!(
        s.call(claim(done, fp, owner)).await,
        Reply::Claimed(_)
    ));
    assert!(matches!(
        s.call(complete(done, owner, b"r")).await,
        Reply::Recorded(_)
    ));
    let leases = [
        (mine, owner),
        (theirs, owner),
        (done, owner),
        (unclaimed, owner),
    ];
    match s.call(renew(LEASE_MS, &leases)).await {
        Reply::Renewed(renewed) => assert_eq!(renewed.lost, vec![1, 2, 3]),
        other => panic!("renewed, got {other:?}"),
    }
    // Past the first lease, the claim is still the owner's.
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    assert!(matches!(
        s.call(claim(mine, fp, "")).await,
        Reply::InFlight(_)
    ));
    match s.call(renew(LEASE_MS, &[(mine, owner)])).await {
        Reply::Renewed(renewed) => assert!(renewed.lost.is_empty()),
        other => panic!("renewed, got {other:?}"),
    }

    let too_many = vec![(mine, owner); 1025];
    let refused = [
        (renew(LEASE_MS, &[]), "field `leases`"),
        (renew(0, &[(mine, owner)]), "field `lease_ms`"),
        (
            renew(LEASE_MS, &[(mine, owner), ("nothex", owner)]),
            "field `leases[1].key`",
        ),
        (renew(LEASE_MS, &[(mine, "")]), "field `leases[0].owner`"),
        (renew(LEASE_MS, &too_many), "got 1025"),
    ];
    for (op, mentions) in refused {
        match s.call(op).await {
            Reply::Failure(f) if f.kind == pb::failure::Kind::BadRequest as i32 => {
                assert!(f.detail.contains(mentions), "{} lacks {mentions}", f.detail);
            }
            other => panic!("refused, got {other:?}"),
        }
    }
    assert!(matches!(
        s.call(claim(random_digest().as_str(), fp, "")).await,
        Reply::Claimed(_)
    ));
}

#[tokio::test]
async fn a_renew_keeps_the_claims_still_running_on_the_embedded_backend() {
    a_renew_keeps_the_claims_still_running(Store::embedded().await).await;
}

#[tokio::test]
async fn a_renew_keeps_the_claims_still_running_on_redis() {
    a_renew_keeps_the_claims_still_running(Store::redis().await).await;
}

//! The streaming API (`proto/idempotency_store.proto`): one long-lived bidirectional stream per
//! client worker, each call answered by id, in whatever order the backend finishes them. It
//! runs every operation through the same validation and [`ops::execute`] as the HTTP API.

use std::sync::Arc;

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::admission::ConnectionAuth;
use crate::metrics::Rejection;
use crate::ops::answer::unavailable_detail;
use crate::ops::auth::Verdict;
use crate::ops::operations::Lookup;
use crate::ops::{self, AppState};
use crate::protocol::{self, BadRequest, ClaimBody, LeaseBody, RenewBody};
use crate::storage::{
    ClaimOutcome, CompleteOutcome, RecordState, RecordView, ReleaseOutcome, SettleOutcome,
    StorageError,
};
use crate::waits::{HeldWait, WaitOutcome};

/// The generated messages, server and client.
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod pb {
    tonic::include_proto!("idempotency.store.v1");
}

use pb::answer::Result as Reply;
use pb::call::Op;
use pb::failure::Kind;

/// Calls one stream may have running at once. A client that sends more waits (HTTP/2 flow
/// control holds it back): one stream cannot take the whole backend.
pub const DEFAULT_MAX_CALLS_IN_FLIGHT: usize = 1024;

/// Initial response metadata of every stream: the largest `Call` message, in bytes (decimal),
/// that the store takes (`--max-body-bytes`). A client keeps its calls within it; a larger one
/// is refused alone, with a `BAD_REQUEST` failure, and the stream goes on.
pub const MAX_MESSAGE_BYTES_METADATA: &str = "x-idempotency-store-max-message-bytes";

/// The frames the stream reads, as a multiple of the announced limit. A frame over the limit
/// is still read whole so that its call can be refused alone (its id is in it); only one over
/// this ends the stream (`OUT_OF_RANGE`). Twice the limit bounds what one stream may make the
/// store buffer while leaving room for any client that got the limit wrong by a little.
pub const HARD_CAP_FACTOR: usize = 2;

/// The largest frame a stream reads for a limit of `max_message_bytes`.
pub fn hard_cap(max_message_bytes: usize) -> usize {
    max_message_bytes.saturating_mul(HARD_CAP_FACTOR)
}

/// What a stream reads from its client: a call, or one too large to take.
#[derive(Debug)]
pub enum Incoming {
    Call(pb::Call),
    /// A message over the limit, refused by the id read from it.
    TooLarge {
        id: u64,
        bytes: usize,
    },
}

/// The one field of a call read from a message too large to decode whole (prost skips the
/// others, the record among them, without copying them).
#[derive(Clone, PartialEq, prost::Message)]
struct CallId {
    #[prost(uint64, tag = "1")]
    id: u64,
}

/// Decodes calls up to `limit` bytes and only the id of larger ones.
#[derive(Debug, Clone, Copy)]
struct CallCodec {
    limit: usize,
}

impl tonic::codec::Codec for CallCodec {
    type Encode = pb::Answer;
    type Decode = Incoming;
    type Encoder = tonic_prost::ProstEncoder<pb::Answer>;
    type Decoder = Self;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        *self
    }
}

impl tonic::codec::Decoder for CallCodec {
    type Item = Incoming;
    type Error = Status;

    fn decode(
        &mut self,
        buf: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Incoming>, Status> {
        use prost::bytes::Buf as _;
        use prost::Message as _;
        let bytes = buf.remaining();
        if bytes > self.limit {
            let CallId { id } = CallId::decode(buf).map_err(|e| {
                Status::internal(format!("a message over the limit that is no Call: {e}"))
            })?;
            return Ok(Some(Incoming::TooLarge { id, bytes }));
        }
        pb::Call::decode(buf)
            .map(|call| Some(Incoming::Call(call)))
            .map_err(|e| Status::internal(e.to_string()))
    }
}

#[derive(Clone)]
pub struct StoreStreams {
    state: AppState,
    max_calls_in_flight: usize,
    max_message_bytes: usize,
}

impl StoreStreams {
    /// Streams that run `max_calls_in_flight` calls at once each and take calls of up to
    /// `max_message_bytes` (`--max-body-bytes`, as HTTP bodies).
    pub fn new(state: AppState, max_calls_in_flight: usize, max_message_bytes: usize) -> Self {
        Self {
            state,
            max_calls_in_flight: max_calls_in_flight.max(1),
            max_message_bytes,
        }
    }

    /// The gRPC service, for the router's `route_service`.
    pub fn service(self) -> StreamService {
        StreamService(self)
    }

    async fn coordinate(
        self,
        request: Request<Streaming<Incoming>>,
    ) -> Result<Response<ReceiverStream<Result<pb::Answer, Status>>>, Status> {
        let headers = request.metadata().clone().into_headers();
        match self.state.auth.data_plane(&headers) {
            Verdict::Allowed => {
                if let Some(auth) = request.extensions().get::<ConnectionAuth>() {
                    auth.authenticated();
                }
            }
            Verdict::Unauthorized => {
                self.state.metrics.rejected(Rejection::Unauthorized);
                return Err(Status::unauthenticated(
                    "missing or wrong `authorization: Bearer <token>` metadata",
                ));
            }
            Verdict::Forbidden(why) => {
                self.state.metrics.rejected(Rejection::Forbidden);
                return Err(Status::permission_denied(why));
            }
        }
        let mut calls = request.into_inner();
        let (answers, out) = mpsc::channel(self.max_calls_in_flight);
        let slots = Arc::new(Semaphore::new(self.max_calls_in_flight));
        // Waits have places of their own, as many as the calls: a wait may last a minute, and
        // the claims behind it must not queue for it.
        let wait_places = Arc::new(Semaphore::new(self.max_calls_in_flight));
        let state = self.state.clone();
        let max_calls = self.max_calls_in_flight;
        let limit = self.max_message_bytes;
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    biased;
                    () = state.draining.cancelled() => {
                        // Shutting down: answer what was taken, then tell the client to go
                        // elsewhere (it reconnects to another instance or after the restart).
                        let all = u32::try_from(max_calls).unwrap_or(u32::MAX);
                        let _ = slots.acquire_many(all).await;
                        let _ = answers
                            .send(Err(Status::unavailable("the store is shutting down")))
                            .await;
                        break;
                    }
                    message = calls.message() => message,
                };
                let call = match message {
                    Ok(Some(Incoming::Call(call))) => call,
                    Ok(Some(Incoming::TooLarge { id, bytes })) => {
                        let answer = too_large(&state, id, bytes, limit);
                        if answers.send(Ok(answer)).await.is_err() {
                            break;
                        }
                        continue;
                    }
                    Ok(None) => break,
                    Err(status) => {
                        // A frame over the hard cap, or a broken transport: the client is
                        // told why its stream ends; answers still being worked out are lost.
                        tracing::debug!(%status, "stream ended by the client or the transport");
                        let _ = answers.send(Err(status)).await;
                        break;
                    }
                };
                let call = match call.op {
                    Some(Op::Wait(wait)) => {
                        match begin_wait(&state, &wait_places, call.id, wait) {
                            Wait::Answered(answer) => {
                                if answers.send(Ok(answer)).await.is_err() {
                                    break;
                                }
                            }
                            Wait::Held(held) => {
                                tokio::spawn(held.run(state.clone(), answers.clone()));
                            }
                        }
                        continue;
                    }
                    op => pb::Call { id: call.id, op },
                };
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    break;
                };
                let state = state.clone();
                let answers = answers.clone();
                tokio::spawn(async move {
                    let answer = answer(&state, call).await;
                    // A client gone before its answer: the operation still ran and was
                    // counted (see ops::execute); there is nobody left to tell.
                    let _ = answers.send(Ok(answer)).await;
                    drop(slot);
                });
            }
        });
        let mut response = Response::new(ReceiverStream::new(out));
        response.metadata_mut().insert(
            MAX_MESSAGE_BYTES_METADATA,
            tonic::metadata::MetadataValue::from(limit),
        );
        Ok(response)
    }
}

/// The answer to a call whose message is over the limit: refused alone, by its id.
fn too_large(state: &AppState, id: u64, bytes: usize, limit: usize) -> pb::Answer {
    state.metrics.rejected(Rejection::TooLarge);
    pb::Answer {
        id,
        result: Some(Reply::Failure(pb::Failure {
            kind: Kind::BadRequest.into(),
            detail: too_large_detail(bytes, limit),
        })),
    }
}

/// The detail of that refusal; clients may read the numbers from it.
pub fn too_large_detail(bytes: usize, limit: usize) -> String {
    format!("message of {bytes} bytes is over the store's limit of {limit} bytes")
}

/// `idempotency.store.v1.Store`, served with [`CallCodec`] (the generated server's codec
/// would end the stream on an oversized message), and with the generated server's answer to
/// an unknown method.
#[derive(Clone)]
pub struct StreamService(StoreStreams);

impl<B> tonic::codegen::Service<tonic::codegen::http::Request<B>> for StreamService
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = tonic::codegen::http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: tonic::codegen::http::Request<B>) -> Self::Future {
        if req.uri().path() != COORDINATE_PATH {
            return Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) });
        }
        let streams = self.0.clone();
        let limit = streams.max_message_bytes;
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(CallCodec { limit })
                .max_decoding_message_size(hard_cap(limit))
                // An answer carries at most a record of the limit, plus its envelope.
                .max_encoding_message_size(limit.saturating_add(1024));
            Ok(grpc.streaming(Coordinate(streams), req).await)
        })
    }
}

/// The path of the one method.
const COORDINATE_PATH: &str = "/idempotency.store.v1.Store/Coordinate";

struct Coordinate(StoreStreams);

impl tonic::server::StreamingService<Incoming> for Coordinate {
    type Response = pb::Answer;
    type ResponseStream = ReceiverStream<Result<pb::Answer, Status>>;
    type Future = tonic::codegen::BoxFuture<Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: Request<Streaming<Incoming>>) -> Self::Future {
        Box::pin(self.0.clone().coordinate(request))
    }
}

/// A wait call, once the stream has looked at it.
enum Wait {
    /// Refused (malformed, or more waits than the stream or the store instance holds):
    /// answered at once, with no task of its own.
    Answered(pb::Answer),
    /// Has its places, in the stream and in the wait room, and waits on a task of its own.
    Held(HeldStreamWait),
}

/// Validates a wait and takes its places before anything is spawned for it: beyond the
/// stream's places or the room's `--max-waits`, it is answered `in_flight` at once.
fn begin_wait(state: &AppState, places: &Arc<Semaphore>, id: u64, wait: pb::Wait) -> Wait {
    let answered = |reply| {
        Wait::Answered(pb::Answer {
            id,
            result: Some(reply),
        })
    };
    let request = match protocol::validate_wait(&wait.key, &wait.fingerprint, wait.wait_ms) {
        Ok(request) => request,
        Err(bad) => return answered(refuse(state, bad)),
    };
    let Ok(place) = Arc::clone(places).try_acquire_owned() else {
        return answered(wait_reply(ops::wait_refused(state)));
    };
    let Some(held) = state.waits.hold(&request.key) else {
        return answered(wait_reply(ops::wait_refused(state)));
    };
    Wait::Held(HeldStreamWait {
        id,
        request,
        held,
        place,
    })
}

/// A wait with its places, ready to run.
struct HeldStreamWait {
    id: u64,
    request: protocol::WaitRequest,
    held: HeldWait,
    /// The stream's place, kept until the answer is delivered (or the stream is gone), so a
    /// client that does not read its answers cannot pile up waiting tasks.
    place: OwnedSemaphorePermit,
}

impl HeldStreamWait {
    async fn run(self, state: AppState, answers: mpsc::Sender<Result<pb::Answer, Status>>) {
        let Self {
            id,
            request,
            held,
            place,
        } = self;
        let answered = async {
            let reply = match ops::wait_for(&state, &held, request).await {
                Ok(outcome) => wait_reply(outcome),
                Err(e) => unavailable(&e),
            };
            // The room's place ends with the wait, not with the delivery of its answer.
            drop(held);
            let _ = answers
                .send(Ok(pb::Answer {
                    id,
                    result: Some(reply),
                }))
                .await;
        };
        tokio::select! {
            () = answered => {}
            // The stream is gone, whether the wait was still running or its answer waited
            // for room: nobody is left to answer, and the task ends with its places.
            () = answers.closed() => {}
        }
        drop(place);
    }
}

/// A call's answer. Runs on the task the stream spawned for the call, which no client owns:
/// the operation goes on to its end even if the client leaves (see `ops::execute`).
async fn answer(state: &AppState, call: pb::Call) -> pb::Answer {
    let reply = match call.op {
        None => refuse(state, BadRequest("a call without an operation".into())),
        Some(Op::Claim(c)) => {
            let raw = ClaimBody {
                key: c.key,
                fingerprint: c.fingerprint,
                lease_ms: c.lease_ms,
                owner: (!c.owner.is_empty()).then_some(c.owner),
            };
            match protocol::validate_claim(raw) {
                Ok(req) => match ops::execute_on_own_task(state, req).await {
                    Ok(outcome) => claim_reply(outcome),
                    Err(e) => unavailable(&e),
                },
                Err(bad) => refuse(state, bad),
            }
        }
        Some(Op::Complete(c)) => {
            let fingerprint = (!c.fingerprint.is_empty()).then_some(c.fingerprint.as_str());
            match protocol::validate_complete(
                &c.key,
                &c.owner,
                c.ttl_ms,
                c.tombstone_ms,
                c.record,
                fingerprint,
            ) {
                Ok(req) => match ops::execute_on_own_task(state, req).await {
                    Ok(CompleteOutcome::Completed) => Reply::Recorded(pb::Empty {}),
                    Ok(CompleteOutcome::NotOwner) => Reply::NotOwner(pb::Empty {}),
                    Err(e) => unavailable(&e),
                },
                Err(bad) => refuse(state, bad),
            }
        }
        // Waits never get here: the stream takes them apart first (`begin_wait`).
        Some(Op::Wait(_)) => refuse(state, BadRequest("a wait outside a stream".into())),
        Some(Op::Release(r)) => match protocol::validate_release(&r.key, &r.owner) {
            Ok(req) => match ops::execute_on_own_task(state, req).await {
                Ok(ReleaseOutcome::Released) => Reply::Released(pb::Empty {}),
                Ok(ReleaseOutcome::NotOwner) => Reply::NotOwner(pb::Empty {}),
                Err(e) => unavailable(&e),
            },
            Err(bad) => refuse(state, bad),
        },
        Some(Op::Lookup(l)) => match protocol::parse_key(&l.key) {
            Ok(key) => match ops::execute_on_own_task(state, Lookup(key)).await {
                Ok(found) => lookup_reply(found),
                Err(e) => unavailable(&e),
            },
            Err(bad) => refuse(state, bad),
        },
        Some(Op::Settle(c)) => {
            match protocol::validate_settle(&c.key, c.current, c.record, c.ttl_ms, c.tombstone_ms) {
                Ok(req) => match ops::execute_on_own_task(state, req).await {
                    Ok(SettleOutcome::Replaced) => Reply::Recorded(pb::Empty {}),
                    Ok(SettleOutcome::Removed) => Reply::Released(pb::Empty {}),
                    Ok(SettleOutcome::NotFound) => Reply::NotOwner(pb::Empty {}),
                    Err(e) => unavailable(&e),
                },
                Err(bad) => refuse(state, bad),
            }
        }
        Some(Op::Renew(r)) => {
            let raw = RenewBody {
                lease_ms: r.lease_ms,
                leases: r
                    .leases
                    .into_iter()
                    .map(|l| LeaseBody {
                        key: l.key,
                        owner: l.owner,
                    })
                    .collect(),
            };
            match protocol::validate_renew(raw) {
                Ok(req) => match ops::execute_on_own_task(state, req).await {
                    Ok(lost) => Reply::Renewed(pb::Renewed { lost }),
                    Err(e) => unavailable(&e),
                },
                Err(bad) => refuse(state, bad),
            }
        }
    };
    pb::Answer {
        id: call.id,
        result: Some(reply),
    }
}

fn claim_reply(outcome: ClaimOutcome) -> Reply {
    match outcome {
        ClaimOutcome::Claimed {
            owner,
            lease_expires_at_ms,
        } => Reply::Claimed(pb::Claimed {
            owner: owner.as_str().to_owned(),
            lease_expires_at_ms,
        }),
        ClaimOutcome::InFlight { retry_after_ms } => {
            Reply::InFlight(pb::InFlight { retry_after_ms })
        }
        ClaimOutcome::Completed { record } => Reply::Completed(pb::Recorded { record }),
        ClaimOutcome::Mismatch => Reply::Mismatch(pb::Empty {}),
    }
}

/// What a live record is, as a lookup answers it: its record when completed, the lease left
/// when in flight; `released` when there is none.
fn lookup_reply(found: Option<RecordView>) -> Reply {
    match found {
        Some(view) => match (view.state, view.record) {
            (RecordState::Completed, Some(record)) => Reply::Completed(pb::Recorded { record }),
            _ => Reply::InFlight(pb::InFlight {
                retry_after_ms: view.expires_at_ms.saturating_sub(view.now_ms).max(1),
            }),
        },
        None => Reply::Released(pb::Empty {}),
    }
}

fn wait_reply(outcome: WaitOutcome) -> Reply {
    match outcome {
        WaitOutcome::Completed { record } => Reply::Completed(pb::Recorded { record }),
        WaitOutcome::Released => Reply::Released(pb::Empty {}),
        WaitOutcome::Mismatch => Reply::Mismatch(pb::Empty {}),
        WaitOutcome::InFlight { retry_after_ms } => {
            Reply::InFlight(pb::InFlight { retry_after_ms })
        }
    }
}

fn refuse(state: &AppState, bad: BadRequest) -> Reply {
    state.metrics.rejected(Rejection::BadRequest);
    Reply::Failure(pb::Failure {
        kind: Kind::BadRequest.into(),
        detail: bad.0,
    })
}

fn unavailable(e: &StorageError) -> Reply {
    Reply::Failure(pb::Failure {
        kind: Kind::Unavailable.into(),
        detail: unavailable_detail(e),
    })
}

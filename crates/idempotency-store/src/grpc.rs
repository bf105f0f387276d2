//! The streaming API (`proto/idempotency_store.proto`): one long-lived bidirectional stream per
//! client worker, each call answered by id, in whatever order the backend finishes them. It
//! runs every operation through the same validation and [`server::execute`] as the HTTP API.

use std::sync::Arc;

use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::metrics::Rejection;
use crate::protocol::{self, BadRequest, ClaimBody, LeaseBody, RenewBody};
use crate::server::{self, AppState};
use crate::storage::{ClaimOutcome, CompleteOutcome, ReleaseOutcome};
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

#[derive(Clone)]
pub struct StoreStreams {
    state: AppState,
    max_calls_in_flight: usize,
}

impl StoreStreams {
    pub fn new(state: AppState, max_calls_in_flight: usize) -> Self {
        Self {
            state,
            max_calls_in_flight: max_calls_in_flight.max(1),
        }
    }

    /// The gRPC service, with messages bounded like HTTP bodies (`--max-body-bytes`).
    pub fn service(self, max_message_bytes: usize) -> pb::store_server::StoreServer<Self> {
        pb::store_server::StoreServer::new(self)
            .max_decoding_message_size(max_message_bytes)
            .max_encoding_message_size(max_message_bytes.saturating_add(1024))
    }
}

#[tonic::async_trait]
impl pb::store_server::Store for StoreStreams {
    type CoordinateStream = ReceiverStream<Result<pb::Answer, Status>>;

    async fn coordinate(
        &self,
        request: Request<Streaming<pb::Call>>,
    ) -> Result<Response<Self::CoordinateStream>, Status> {
        let headers = request.metadata().clone().into_headers();
        if !self.state.auth.allows(&headers) {
            self.state.metrics.rejected(Rejection::Unauthorized);
            return Err(Status::unauthenticated(
                "missing or wrong `authorization: Bearer <token>` metadata",
            ));
        }
        let mut calls = request.into_inner();
        let (answers, out) = mpsc::channel(self.max_calls_in_flight);
        let slots = Arc::new(Semaphore::new(self.max_calls_in_flight));
        // Waits have places of their own, as many as the calls: a wait may last a minute, and
        // the claims behind it must not queue for it.
        let wait_places = Arc::new(Semaphore::new(self.max_calls_in_flight));
        let state = self.state.clone();
        let max_calls = self.max_calls_in_flight;
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
                    Ok(Some(call)) => call,
                    Ok(None) => break,
                    Err(status) => {
                        // A message over the limit, or a broken transport: the client is
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
                    // counted (see server::execute); there is nobody left to tell.
                    let _ = answers.send(Ok(answer)).await;
                    drop(slot);
                });
            }
        });
        Ok(Response::new(ReceiverStream::new(out)))
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
        return answered(wait_reply(server::wait_refused(state)));
    };
    let Some(held) = state.waits.hold(&request.key) else {
        return answered(wait_reply(server::wait_refused(state)));
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
            let reply = match server::wait_for(&state, &held, request).await {
                Ok(outcome) => wait_reply(outcome),
                Err(_) => unavailable(),
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
                Ok(req) => match server::execute(state, req).await {
                    Ok(outcome) => claim_reply(outcome),
                    Err(_) => unavailable(),
                },
                Err(bad) => refuse(state, bad),
            }
        }
        Some(Op::Complete(c)) => {
            let fingerprint = (!c.fingerprint.is_empty()).then_some(c.fingerprint.as_str());
            match protocol::validate_complete(&c.key, &c.owner, c.ttl_ms, c.record, fingerprint) {
                Ok(req) => match server::execute(state, req).await {
                    Ok(CompleteOutcome::Completed) => Reply::Recorded(pb::Empty {}),
                    Ok(CompleteOutcome::NotOwner) => Reply::NotOwner(pb::Empty {}),
                    Err(_) => unavailable(),
                },
                Err(bad) => refuse(state, bad),
            }
        }
        // Waits never get here: the stream takes them apart first (`begin_wait`).
        Some(Op::Wait(_)) => refuse(state, BadRequest("a wait outside a stream".into())),
        Some(Op::Release(r)) => match protocol::validate_release(&r.key, &r.owner) {
            Ok(req) => match server::execute(state, req).await {
                Ok(ReleaseOutcome::Released) => Reply::Released(pb::Empty {}),
                Ok(ReleaseOutcome::NotOwner) => Reply::NotOwner(pb::Empty {}),
                Err(_) => unavailable(),
            },
            Err(bad) => refuse(state, bad),
        },
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
                Ok(req) => match server::execute(state, req).await {
                    Ok(lost) => Reply::Renewed(pb::Renewed { lost }),
                    Err(_) => unavailable(),
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

fn unavailable() -> Reply {
    Reply::Failure(pb::Failure {
        kind: Kind::Unavailable.into(),
        detail: "the storage backend failed; the outcome of this call is unknown, retry later"
            .into(),
    })
}

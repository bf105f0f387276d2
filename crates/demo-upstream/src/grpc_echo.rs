//! `--grpc-echo`: an instant store for the benchmark's coordination floor.
//!
//! It serves the store's streaming method (`idempotency.store.v1.Store/Coordinate`,
//! `proto/idempotency_store.proto`) over cleartext HTTP/2 and answers every call the moment
//! it has read it, with no storage behind it: a claim is `claimed` (the call's own owner, or
//! a fixed one), a completion `recorded`, a release `released`, a renew `renewed` with
//! nothing lost. What a filter measures
//! against it is the transport alone: one message out, one back, on a stream kept open.
//!
//! gRPC framing is done here by hand (a 1-byte compressed flag, a 4-byte big-endian length,
//! the message); the messages themselves by the protocol crate's codec, the one the filter
//! uses. Answers to the calls read from one HTTP/2 DATA frame go out in one DATA frame. The
//! request body is read as it comes, which releases HTTP/2 flow-control capacity to the
//! client; when the client ends its side the stream ends with `grpc-status: 0`.
//!
//! The same port answers HTTP/1.1 too (the harness's readiness probe): `GET /healthz` is
//! `ok`, `GET /__count` is `{"total":N}` with N the calls answered so far.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{HeaderMap, HeaderValue, CONTENT_TYPE};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use idempotency_protocol::stream::{self, CallOp, Reply};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// The path of the streaming method.
pub const COORDINATE_PATH: &str = "/idempotency.store.v1.Store/Coordinate";
/// Largest message accepted (the store's default `--max-body-bytes`).
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// The owner a claim without one is granted (hex, as the protocol wants).
pub const ECHO_OWNER: &str = "0e0e0e0e";

const GRPC_OK: u32 = 0;
const GRPC_INVALID_ARGUMENT: u32 = 3;
const GRPC_RESOURCE_EXHAUSTED: u32 = 8;
const GRPC_UNIMPLEMENTED: u32 = 12;

/// Calls answered, over every stream.
#[derive(Debug, Default)]
pub struct EchoCounters {
    calls: AtomicU64,
}

impl EchoCounters {
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

/// A response body: one buffer (the HTTP/1.1 answers, a refused call), or the frames a
/// stream's task sends.
pub enum EchoBody {
    Once(Option<Bytes>),
    Frames(mpsc::Receiver<Frame<Bytes>>),
}

impl Body for EchoBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.get_mut() {
            EchoBody::Once(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            EchoBody::Frames(rx) => rx.poll_recv(cx).map(|frame| frame.map(Ok)),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, EchoBody::Once(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            EchoBody::Once(Some(b)) => SizeHint::with_exact(b.len() as u64),
            EchoBody::Once(None) => SizeHint::with_exact(0),
            EchoBody::Frames(_) => SizeHint::default(),
        }
    }
}

/// Serves until the listener fails for good; every connection on a task of its own.
pub async fn serve_grpc_echo(listener: TcpListener, counters: Arc<EchoCounters>) {
    loop {
        let stream = crate::accept(&listener).await;
        let counters = Arc::clone(&counters);
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let counters = Arc::clone(&counters);
                async move { Ok::<_, Infallible>(handle(req, counters)) }
            });
            // Errors here are the client going away: nothing to do.
            let _ = Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn handle(req: Request<Incoming>, counters: Arc<EchoCounters>) -> Response<EchoBody> {
    let path = req.uri().path();
    let is_grpc = req
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"));
    match path {
        COORDINATE_PATH if is_grpc => {
            let (tx, rx) = mpsc::channel(64);
            tokio::spawn(answer_calls(req.into_body(), tx, counters));
            grpc_response(EchoBody::Frames(rx))
        }
        "/healthz" => plain(StatusCode::OK, "text/plain", "ok".into()),
        "/__count" => plain(
            StatusCode::OK,
            "application/json",
            format!("{{\"total\":{}}}", counters.calls()),
        ),
        _ if is_grpc => {
            // Trailers-only: an unknown method.
            let mut resp = grpc_response(EchoBody::Once(None));
            resp.headers_mut()
                .insert("grpc-status", status_value(GRPC_UNIMPLEMENTED));
            resp
        }
        _ => plain(StatusCode::NOT_FOUND, "text/plain", "not found".into()),
    }
}

fn grpc_response(body: EchoBody) -> Response<EchoBody> {
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    resp
}

fn plain(status: StatusCode, content_type: &'static str, body: String) -> Response<EchoBody> {
    let mut resp = Response::new(EchoBody::Once(Some(Bytes::from(body))));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    resp
}

fn status_value(code: u32) -> HeaderValue {
    HeaderValue::from(code)
}

/// Reads a stream's calls as they come and sends their answers; ends the stream with a
/// grpc-status once the client has ended its side (or sent something unreadable).
async fn answer_calls(
    mut body: Incoming,
    tx: mpsc::Sender<Frame<Bytes>>,
    counters: Arc<EchoCounters>,
) {
    let mut pending = Vec::new();
    let status = loop {
        let frame = match body.frame().await {
            None => break GRPC_OK,
            Some(Ok(frame)) => frame,
            // Reset by the client: nobody is left to answer.
            Some(Err(_)) => return,
        };
        let Ok(data) = frame.into_data() else {
            continue; // the client's trailers, if any
        };
        pending.extend_from_slice(&data);
        match answer_framed(&mut pending, now_ms()) {
            Ok((out, answered)) => {
                counters.calls.fetch_add(answered, Ordering::Relaxed);
                if !out.is_empty() && tx.send(Frame::data(Bytes::from(out))).await.is_err() {
                    return;
                }
            }
            Err(code) => break code,
        }
    };
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", status_value(status));
    let _ = tx.send(Frame::trailers(trailers)).await;
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Answers every whole gRPC message at the front of `pending` and removes it; what is left
/// is the start of a message still arriving. Returns the framed answers and how many there
/// are, or the grpc-status that ends the stream (a compressed, oversized or unreadable call).
pub fn answer_framed(pending: &mut Vec<u8>, now_ms: u64) -> Result<(Vec<u8>, u64), u32> {
    let mut out = Vec::new();
    let mut answered = 0;
    let mut at = 0;
    let result = loop {
        let Some(header) = pending.get(at..at + 5) else {
            break Ok(());
        };
        let (flag, len) = match header {
            [flag, a, b, c, d] => (*flag, u32::from_be_bytes([*a, *b, *c, *d]) as usize),
            _ => break Ok(()),
        };
        if flag != 0 {
            break Err(GRPC_UNIMPLEMENTED);
        }
        if len > MAX_MESSAGE_BYTES {
            break Err(GRPC_RESOURCE_EXHAUSTED);
        }
        let Some(message) = pending.get(at + 5..at + 5 + len) else {
            break Ok(());
        };
        let Ok(call) = stream::decode_call(message) else {
            break Err(GRPC_INVALID_ARGUMENT);
        };
        let answer = stream::encode_answer(&stream::Answer {
            id: call.id,
            reply: reply_to(call.op, now_ms),
        });
        out.push(0);
        out.extend_from_slice(
            &u32::try_from(answer.len())
                .unwrap_or(u32::MAX)
                .to_be_bytes(),
        );
        out.extend_from_slice(&answer);
        answered += 1;
        at += 5 + len;
    };
    pending.drain(..at.min(pending.len()));
    result.map(|()| (out, answered))
}

/// What an instant store answers.
fn reply_to(op: CallOp, now_ms: u64) -> Reply {
    match op {
        CallOp::Claim {
            lease_ms, owner, ..
        } => Reply::Claimed {
            owner: if owner.is_empty() {
                ECHO_OWNER.to_string()
            } else {
                owner
            },
            lease_expires_at_ms: now_ms.saturating_add(lease_ms),
        },
        CallOp::Complete { .. } | CallOp::Settle { .. } => Reply::Recorded,
        CallOp::Release { .. } | CallOp::Wait { .. } | CallOp::Lookup { .. } => Reply::Released,
        CallOp::Renew { .. } => Reply::Renewed { lost: Vec::new() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency_protocol::stream::{encode_call, Answer, Call};

    const HEX: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn framed(message: &[u8]) -> Vec<u8> {
        let mut out = vec![0];
        out.extend_from_slice(&(message.len() as u32).to_be_bytes());
        out.extend_from_slice(message);
        out
    }

    fn claim(id: u64, owner: &str) -> Vec<u8> {
        framed(&encode_call(&Call {
            id,
            op: CallOp::Claim {
                key: HEX.into(),
                fingerprint: HEX.into(),
                lease_ms: 5_000,
                owner: owner.into(),
            },
        }))
    }

    fn unframe(mut bytes: &[u8]) -> Vec<Answer> {
        let mut answers = Vec::new();
        while !bytes.is_empty() {
            assert_eq!(bytes[0], 0, "uncompressed");
            let len = u32::from_be_bytes(bytes[1..5].try_into().unwrap()) as usize;
            answers.push(stream::decode_answer(&bytes[5..5 + len]).unwrap());
            bytes = &bytes[5 + len..];
        }
        answers
    }

    #[test]
    fn every_whole_call_is_answered_and_a_partial_one_waits() {
        let mut pending = claim(7, "");
        pending.extend(claim(8, "abcd"));
        let third = claim(9, "");
        pending.extend_from_slice(&third[..4]);
        let (out, n) = answer_framed(&mut pending, 1_000).unwrap();
        assert_eq!(n, 2);
        assert_eq!(
            unframe(&out),
            vec![
                Answer {
                    id: 7,
                    reply: Reply::Claimed {
                        owner: ECHO_OWNER.into(),
                        lease_expires_at_ms: 6_000
                    }
                },
                Answer {
                    id: 8,
                    reply: Reply::Claimed {
                        owner: "abcd".into(),
                        lease_expires_at_ms: 6_000
                    }
                },
            ]
        );
        assert_eq!(pending, third[..4]);
        pending.extend_from_slice(&third[4..]);
        let (out, n) = answer_framed(&mut pending, 0).unwrap();
        assert_eq!((n, unframe(&out)[0].id), (1, 9));
        assert!(pending.is_empty());
    }

    #[test]
    fn completions_and_releases_are_taken_at_once() {
        let mut pending = framed(&encode_call(&Call {
            id: 1,
            op: CallOp::Complete {
                key: HEX.into(),
                owner: "ab".into(),
                ttl_ms: 1,
                record: vec![1, 2, 3],
                fingerprint: String::new(),
                tombstone_ms: 0,
            },
        }));
        pending.extend(framed(&encode_call(&Call {
            id: 2,
            op: CallOp::Release {
                key: HEX.into(),
                owner: "ab".into(),
            },
        })));
        let (out, _) = answer_framed(&mut pending, 0).unwrap();
        let replies: Vec<Reply> = unframe(&out).into_iter().map(|a| a.reply).collect();
        assert_eq!(replies, vec![Reply::Recorded, Reply::Released]);
    }

    #[test]
    fn compressed_oversized_and_unreadable_calls_end_the_stream() {
        let mut compressed = claim(1, "");
        compressed[0] = 1;
        assert_eq!(answer_framed(&mut compressed, 0), Err(GRPC_UNIMPLEMENTED));
        let mut huge = vec![0, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(answer_framed(&mut huge, 0), Err(GRPC_RESOURCE_EXHAUSTED));
        let mut garbage = framed(&[0x12, 0x05, 1]);
        assert_eq!(answer_framed(&mut garbage, 0), Err(GRPC_INVALID_ARGUMENT));
    }
}

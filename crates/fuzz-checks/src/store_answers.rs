//! The store's answers as the filter reads them: JSON bodies of the HTTP API
//! (`store::client::read_claim`, `read_write_answer`) and messages of the gRPC stream
//! (`idempotency_protocol::stream::decode_answer`, `store::client::read_claim_reply`,
//! `read_write_reply`).

use arbitrary::{Result, Unstructured};
use idempotency_core::store::client::{
    read_claim, read_claim_reply, read_write_answer, read_write_reply, StoreClaim, StoreFailure,
    WriteAnswer, WriteKind,
};
use idempotency_protocol::record::RecordedResponse;
use idempotency_protocol::stream::{decode_answer, encode_answer, Answer, FailureKind, Reply};
use idempotency_protocol::wire::{decode_record, encode_record, outcome, ClaimResponse};
use idempotency_store::grpc::pb;
use idempotency_store::grpc::pb::answer::Result as PbReply;
use prost::Message as _;
use serde_json::json;

use crate::gen::{replayable_record, token_text};

/// Any status and body: a non-200 claim answer is judged by its status alone, a claim the
/// filter accepts names an owner, and a response it would replay is one a sound filter could
/// have recorded and is exactly what the body carries; a write is done only on the answer
/// that says so, and a reset, a timeout or a 5xx is always retried. Built answers: each
/// claim outcome the store can send reads as that outcome, extra fields are ignored.
pub fn store_answer_http(data: &[u8]) {
    let _ = http_raw(Unstructured::new(data));
    let _ = http_built(&mut Unstructured::new(data));
}

/// Any bytes: a message that decodes re-encodes to itself (and the store's generated code
/// reads that encoding as the same message), and a claim answered on the stream reads as the
/// same answer sent as JSON would. Built answers: every answer the store can send decodes to
/// itself, and the filter's encoding is byte for byte the store's.
pub fn store_answer_stream(data: &[u8]) {
    stream_raw(data);
    let _ = stream_built(&mut Unstructured::new(data));
}

fn http_raw(mut u: Unstructured<'_>) -> Result<()> {
    let u = &mut u;
    let status: Option<u16> = if u.ratio(3, 4)? {
        Some(*u.choose(&[200, 200, 409, 429, 500, 503])?)
    } else {
        u.arbitrary()?
    };
    let kind = if u.arbitrary()? {
        WriteKind::Complete
    } else {
        WriteKind::Release
    };
    let body = std::mem::replace(u, Unstructured::new(&[])).take_rest();

    let claim = read_claim(status, body);
    match status {
        Some(200) => {}
        Some(s) if s >= 500 => assert_eq!(claim, Err(StoreFailure::ServerError(s))),
        Some(s) => assert_eq!(claim, Err(StoreFailure::Refused(s))),
        None => assert_eq!(claim, Err(StoreFailure::NoAnswer)),
    }
    match &claim {
        Ok(StoreClaim::Claimed { owner }) => assert!(!owner.is_empty()),
        Ok(StoreClaim::Completed(response)) => {
            assert_eq!(response.check_headers(), Ok(()));
            let sent: ClaimResponse = serde_json::from_slice(body).expect("read, so JSON");
            let ClaimResponse::Completed { record } = sent else {
                panic!("a replay from {sent:?}")
            };
            let bytes = decode_record(&record).expect("read, so base64");
            assert_eq!(RecordedResponse::decode(&bytes).as_ref(), Some(response));
        }
        _ => {}
    }

    let write = read_write_answer(kind, status, body);
    if write == WriteAnswer::Done {
        // serde reads a struct from an object, or from an array of its fields in order.
        let said = serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|v| {
                v.get("outcome")
                    .or_else(|| v.get(0))
                    .and_then(|o| o.as_str().map(str::to_owned))
            });
        let said_so = said.is_some_and(|o| o == outcome::COMPLETED || o == outcome::RELEASED);
        let gone = status == Some(409) && kind == WriteKind::Release;
        assert!(
            (status == Some(200) && said_so) || gone,
            "done on {status:?}"
        );
    }
    if status.is_none_or(|s| s >= 500 || s == 429) {
        assert!(
            matches!(write, WriteAnswer::Retry(_)),
            "{status:?}: {write:?}"
        );
    }
    Ok(())
}

fn http_built(u: &mut Unstructured<'_>) -> Result<()> {
    let (answer, expected) = match u.int_in_range(0..=3)? {
        0 => {
            let owner = token_text(u, 32)?;
            let expected = if owner.is_empty() {
                None
            } else {
                Some(StoreClaim::Claimed {
                    owner: owner.clone(),
                })
            };
            let answer = ClaimResponse::Claimed {
                owner,
                lease_expires_at_ms: u.arbitrary()?,
            };
            (answer, expected)
        }
        1 => (
            ClaimResponse::InFlight {
                retry_after_ms: u.arbitrary()?,
            },
            Some(StoreClaim::InFlight),
        ),
        2 => (ClaimResponse::Mismatch, Some(StoreClaim::Mismatch)),
        _ => {
            let response = replayable_record(u)?;
            let answer = ClaimResponse::Completed {
                record: encode_record(&response.encode()),
            };
            (answer, Some(StoreClaim::Completed(response)))
        }
    };
    let mut body = serde_json::to_value(&answer).expect("serializes");
    if u.arbitrary()? {
        // A newer store may add fields.
        body["added_later"] = json!({ "x": [1, 2] });
    }
    let read = read_claim(Some(200), body.to_string().as_bytes());
    match expected {
        Some(claim) => assert_eq!(read, Ok(claim), "{body}"),
        None => assert!(matches!(read, Err(StoreFailure::Garbage(_))), "{body}"),
    }

    let said = *u.choose(&[
        outcome::COMPLETED,
        outcome::RELEASED,
        outcome::NOT_OWNER,
        outcome::CLAIMED,
        "",
    ])?;
    let kind = if u.arbitrary()? {
        WriteKind::Complete
    } else {
        WriteKind::Release
    };
    let body = json!({ "outcome": said }).to_string();
    let done = read_write_answer(kind, Some(200), body.as_bytes()) == WriteAnswer::Done;
    assert_eq!(
        done,
        said == outcome::COMPLETED || said == outcome::RELEASED
    );
    Ok(())
}

/// The store's form of an answer (its generated types).
fn to_pb(answer: &Answer) -> pb::Answer {
    let empty = pb::Empty {};
    let result = match &answer.reply {
        Reply::Claimed {
            owner,
            lease_expires_at_ms,
        } => PbReply::Claimed(pb::Claimed {
            owner: owner.clone(),
            lease_expires_at_ms: *lease_expires_at_ms,
        }),
        Reply::InFlight { retry_after_ms } => PbReply::InFlight(pb::InFlight {
            retry_after_ms: *retry_after_ms,
        }),
        Reply::Completed { record } => PbReply::Completed(pb::Recorded {
            record: record.clone(),
        }),
        Reply::Mismatch => PbReply::Mismatch(empty),
        Reply::Recorded => PbReply::Recorded(empty),
        Reply::Released => PbReply::Released(empty),
        Reply::NotOwner => PbReply::NotOwner(empty),
        Reply::Renewed { lost } => PbReply::Renewed(pb::Renewed { lost: lost.clone() }),
        Reply::Failure { kind, detail } => PbReply::Failure(pb::Failure {
            // An enum is an int32 on the wire, sign-extended to 64 bits when negative.
            kind: match kind {
                FailureKind::BadRequest => 1,
                FailureKind::Unavailable => 2,
                FailureKind::Other(n) => *n as i64 as i32,
            },
            detail: detail.clone(),
        }),
    };
    pb::Answer {
        id: answer.id,
        result: Some(result),
    }
}

/// True when the store's generated code can carry `answer` (a failure kind is an int32).
fn fits_pb(answer: &Answer) -> bool {
    match answer.reply {
        Reply::Failure {
            kind: FailureKind::Other(n),
            ..
        } => i32::try_from(n as i64).is_ok(),
        _ => true,
    }
}

/// The same claim answer as the HTTP API would send it, for the replies that have one.
fn as_json(reply: &Reply) -> Option<ClaimResponse> {
    Some(match reply {
        Reply::Claimed {
            owner,
            lease_expires_at_ms,
        } => ClaimResponse::Claimed {
            owner: owner.clone(),
            lease_expires_at_ms: *lease_expires_at_ms,
        },
        Reply::InFlight { retry_after_ms } => ClaimResponse::InFlight {
            retry_after_ms: *retry_after_ms,
        },
        Reply::Completed { record } => ClaimResponse::Completed {
            record: encode_record(record),
        },
        Reply::Mismatch => ClaimResponse::Mismatch,
        _ => return None,
    })
}

fn stream_raw(data: &[u8]) {
    let Ok(answer) = decode_answer(data) else {
        return;
    };
    let encoded = encode_answer(&answer);
    assert_eq!(decode_answer(&encoded).as_ref(), Ok(&answer));
    if fits_pb(&answer) {
        assert_eq!(pb::Answer::decode(&encoded[..]).ok(), Some(to_pb(&answer)));
    }
    let on_stream = read_claim_reply(answer.reply.clone());
    if let Some(json) = as_json(&answer.reply) {
        let body = serde_json::to_vec(&json).expect("serializes");
        assert_eq!(on_stream, read_claim(Some(200), &body), "{answer:?}");
    }
    for kind in [WriteKind::Complete, WriteKind::Release] {
        let done = read_write_reply(kind, &answer.reply) == WriteAnswer::Done;
        let says_done = matches!(
            (kind, &answer.reply),
            (WriteKind::Complete, Reply::Recorded)
                | (WriteKind::Release, Reply::Released | Reply::NotOwner)
        );
        assert_eq!(done, says_done, "{kind:?} {answer:?}");
    }
}

fn stream_built(u: &mut Unstructured<'_>) -> Result<()> {
    let reply = match u.int_in_range(0..=8)? {
        0 => Reply::Claimed {
            owner: token_text(u, 40)?,
            lease_expires_at_ms: u.arbitrary()?,
        },
        1 => Reply::InFlight {
            retry_after_ms: u.arbitrary()?,
        },
        2 => Reply::Completed {
            record: if u.arbitrary()? {
                replayable_record(u)?.encode()
            } else {
                u.arbitrary()?
            },
        },
        3 => Reply::Mismatch,
        4 => Reply::Recorded,
        5 => Reply::Released,
        6 => Reply::NotOwner,
        7 => Reply::Renewed {
            lost: u.arbitrary()?,
        },
        _ => {
            let number = if u.arbitrary()? {
                u.arbitrary::<i32>()? as i64 as u64
            } else {
                u.arbitrary()?
            };
            let kind = match number {
                1 => FailureKind::BadRequest,
                2 => FailureKind::Unavailable,
                n => FailureKind::Other(n),
            };
            Reply::Failure {
                kind,
                detail: u.arbitrary()?,
            }
        }
    };
    let answer = Answer {
        id: u.arbitrary()?,
        reply,
    };
    let encoded = encode_answer(&answer);
    assert_eq!(decode_answer(&encoded).as_ref(), Ok(&answer));
    if fits_pb(&answer) {
        let theirs = to_pb(&answer);
        assert_eq!(encoded, theirs.encode_to_vec(), "byte for byte: {answer:?}");
        assert_eq!(pb::Answer::decode(&encoded[..]).as_ref(), Ok(&theirs));
    }
    Ok(())
}

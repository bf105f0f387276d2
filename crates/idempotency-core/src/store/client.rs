//! The filter's side of the store protocol (`docs/store-protocol.md`): request bodies it sends
//! and how it reads the answers, in the protocol crate's wire types. Anything unexpected is a
//! `StoreFailure`, never a panic: the rule's store-error policy decides what the client sees.

use idempotency_protocol::stream::{CallOp, FailureKind, Reply};
use idempotency_protocol::wire::{
    decode_record, encode_record, outcome, ClaimBody, ClaimResponse, CompleteBody, OutcomeResponse,
    ReleaseBody, RenewBody, RenewResponse, SettleBody, MAX_RENEW_LEASES,
};

use idempotency_protocol::naming::{to_hex, Digest};
use idempotency_protocol::record::RecordedResponse;

/// Largest store answer the filter reads (a recorded response of the largest allowed cap,
/// base64-encoded, plus JSON framing).
pub const MAX_STORE_ANSWER_BYTES: usize = 96 * 1024 * 1024;

/// What the store said about a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreClaim {
    Claimed { owner: String },
    InFlight,
    Completed(RecordedResponse),
    Mismatch,
}

/// Why a claim got no usable answer from the store. The rule's store-error policy decides
/// what the client sees; whether the store may have applied the claim decides whether the
/// proxy must also release it there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreFailure {
    /// The host would not send the callout (unknown cluster, bad headers): never reached
    /// the store.
    NotSent(String),
    /// Reset, timeout or an unreadable answer: the claim may have landed.
    NoAnswer,
    /// A 5xx: the store may have applied the claim before failing.
    ServerError(u16),
    /// Any other non-200 status: the store refused the request as a whole.
    Refused(u16),
    /// A 200 this filter cannot use.
    Garbage(String),
    /// The store holds a completed record of the key that this filter cannot read (corrupt,
    /// or written by a newer build): the key is taken, so the write never runs on it.
    UnreadableRecord(String),
}

impl StoreFailure {
    /// True when the store may hold the claim although no usable answer said so.
    pub fn may_have_been_applied(&self) -> bool {
        matches!(self, StoreFailure::NoAnswer | StoreFailure::ServerError(_))
    }
}

impl std::fmt::Display for StoreFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreFailure::NotSent(why) => write!(f, "callout refused: {why}"),
            StoreFailure::NoAnswer => f.write_str("store unreachable or timed out"),
            StoreFailure::ServerError(s) | StoreFailure::Refused(s) => {
                write!(f, "store answered status {s}")
            }
            StoreFailure::Garbage(why) | StoreFailure::UnreadableRecord(why) => f.write_str(why),
        }
    }
}

/// The owner token this proxy claims with. Chosen by the proxy, not the store, so that a
/// claim whose answer never arrived (timeout) can still be released by its owner.
/// `local_owner` is unique within the Envoy process and the clock separates processes: the
/// two side by side, in hex. (Owners only tell claims of one key apart, so the key adds
/// nothing, and hashing them added a SHA-256 to every cluster-mode claim.)
pub fn store_owner(local_owner: u64, now_nanos: u64) -> String {
    format!("{local_owner:016x}{now_nanos:016x}")
}

/// A claim as a protocol call (the same call goes on the stream or, as JSON, in a callout).
pub fn claim_call(key: &Digest, fingerprint: &Digest, lease_ms: u64, owner: &str) -> CallOp {
    CallOp::Claim {
        key: to_hex(key),
        fingerprint: to_hex(fingerprint),
        lease_ms,
        owner: owner.to_owned(),
    }
}

pub fn complete_call(
    key: &Digest,
    fingerprint: &Digest,
    owner: &str,
    ttl_ms: u64,
    tombstone_ms: u64,
    response: &RecordedResponse,
) -> CallOp {
    CallOp::Complete {
        key: to_hex(key),
        owner: owner.to_owned(),
        ttl_ms,
        record: response.encode(),
        // Lets the store record the completion even if the claim lapsed and was removed
        // while this write waited out an outage (and nobody claimed the key since).
        fingerprint: to_hex(fingerprint),
        tombstone_ms,
    }
}

/// Renewal calls for `leases` (key and owner, in hex), each within the store's batch bound.
pub fn renew_calls(lease_ms: u64, leases: Vec<(String, String)>) -> Vec<CallOp> {
    leases
        .chunks(MAX_RENEW_LEASES)
        .map(|chunk| CallOp::Renew {
            lease_ms,
            leases: chunk.to_vec(),
        })
        .collect()
}

pub fn release_call(key: &Digest, owner: &str) -> CallOp {
    CallOp::Release {
        key: to_hex(key),
        owner: owner.to_owned(),
    }
}

/// Settles the unknown outcome `current` recorded for `key`: replaced by `record` (kept
/// `ttl_ms` from now, 0: as long as `current` would have been; then `tombstone_ms` as its
/// tombstone), or freed (`record` None).
pub fn settle_call(
    key: &Digest,
    current: Vec<u8>,
    record: Option<Vec<u8>>,
    ttl_ms: u64,
    tombstone_ms: u64,
) -> CallOp {
    CallOp::Settle {
        key: to_hex(key),
        current,
        record: record.unwrap_or_default(),
        ttl_ms,
        tombstone_ms,
    }
}

/// A held duplicate's wait for `key`'s in-flight record to end (stream only).
pub fn wait_call(key: &Digest, fingerprint: &Digest, wait_ms: u64) -> CallOp {
    CallOp::Wait {
        key: to_hex(key),
        fingerprint: to_hex(fingerprint),
        wait_ms,
    }
}

/// The JSON body of `call` for the HTTP API (a wait has none: the stream alone carries it).
pub fn http_body(call: &CallOp) -> Vec<u8> {
    let json = match call {
        CallOp::Claim {
            key,
            fingerprint,
            lease_ms,
            owner,
        } => serde_json::to_vec(&ClaimBody {
            key: key.clone(),
            fingerprint: fingerprint.clone(),
            lease_ms: *lease_ms,
            owner: Some(owner.clone()),
        }),
        CallOp::Complete {
            key,
            owner,
            ttl_ms,
            record,
            fingerprint,
            tombstone_ms,
        } => serde_json::to_vec(&CompleteBody {
            key: key.clone(),
            owner: owner.clone(),
            ttl_ms: *ttl_ms,
            record: encode_record(record),
            fingerprint: Some(fingerprint.clone()),
            tombstone_ms: *tombstone_ms,
        }),
        CallOp::Release { key, owner } => serde_json::to_vec(&ReleaseBody {
            key: key.clone(),
            owner: owner.clone(),
        }),
        CallOp::Renew { lease_ms, leases } => serde_json::to_vec(&RenewBody::of(*lease_ms, leases)),
        CallOp::Settle {
            key,
            current,
            record,
            ttl_ms,
            tombstone_ms,
        } => serde_json::to_vec(&SettleBody {
            key: Some(key.clone()),
            current: encode_record(current),
            record: (!record.is_empty()).then(|| encode_record(record)),
            ttl_ms: (*ttl_ms != 0).then_some(*ttl_ms),
            tombstone_ms: *tombstone_ms,
        }),
        // The stream alone carries these.
        CallOp::Wait { .. } | CallOp::Lookup { .. } => return Vec::new(),
    };
    json.unwrap_or_default()
}

/// Bytes a call holds (what a waiting write costs the retry budget).
pub fn call_bytes(call: &CallOp) -> usize {
    match call {
        CallOp::Complete { record, .. } => record.len().saturating_add(256),
        // A key and an owner of up to 64 hex characters each, per lease.
        CallOp::Renew { leases, .. } => leases.len().saturating_mul(128).saturating_add(256),
        CallOp::Settle {
            current, record, ..
        } => current
            .len()
            .saturating_add(record.len())
            .saturating_add(256),
        CallOp::Claim { .. }
        | CallOp::Release { .. }
        | CallOp::Wait { .. }
        | CallOp::Lookup { .. } => 256,
    }
}

/// Reads a claim's answer on the stream, with the same rules as `read_claim`.
pub fn read_claim_reply(reply: Reply) -> Result<StoreClaim, StoreFailure> {
    match reply {
        Reply::Claimed { owner, .. } if !owner.is_empty() => Ok(StoreClaim::Claimed { owner }),
        Reply::Claimed { .. } => Err(StoreFailure::Garbage(
            "store claim answer has an empty owner".to_string(),
        )),
        Reply::InFlight { .. } => Ok(StoreClaim::InFlight),
        Reply::Mismatch => Ok(StoreClaim::Mismatch),
        Reply::Completed { record } => replayable(&record).map(StoreClaim::Completed),
        // The backend failed mid-call: the claim may have landed.
        Reply::Failure {
            kind: FailureKind::Unavailable | FailureKind::Other(_),
            ..
        } => Err(StoreFailure::ServerError(503)),
        Reply::Failure {
            kind: FailureKind::BadRequest,
            ..
        } => Err(StoreFailure::Refused(400)),
        Reply::Recorded | Reply::Released | Reply::NotOwner | Reply::Renewed { .. } => Err(
            StoreFailure::Garbage("store answered a claim with a write's outcome".to_string()),
        ),
    }
}

/// Reads a completion's or release's answer on the stream.
pub fn read_write_reply(kind: WriteKind, reply: &Reply) -> WriteAnswer {
    match (kind, reply) {
        (WriteKind::Complete, Reply::Recorded) | (WriteKind::Release, Reply::Released) => {
            WriteAnswer::Done
        }
        (WriteKind::Renew, Reply::Renewed { lost }) => renewed(lost.clone()),
        (WriteKind::Settle, Reply::Recorded | Reply::Released) => WriteAnswer::Done,
        (WriteKind::Settle, Reply::NotOwner) => WriteAnswer::NotSettled,
        // Nothing left to release (released before, expired, or taken over): the goal holds.
        (WriteKind::Release, Reply::NotOwner) => WriteAnswer::Done,
        (WriteKind::Complete, Reply::NotOwner) => WriteAnswer::Superseded,
        (
            _,
            Reply::Failure {
                kind: FailureKind::BadRequest,
                detail,
            },
        ) => WriteAnswer::Refused(format!("store refused the call: {detail}")),
        (_, Reply::Failure { detail, .. }) => WriteAnswer::Retry(format!("store failed: {detail}")),
        (_, other) => WriteAnswer::Retry(format!("unexpected answer {other:?}")),
    }
}

/// A recorded response from the store, if this filter may replay it.
fn replayable(bytes: &[u8]) -> Result<RecordedResponse, StoreFailure> {
    let response = RecordedResponse::decode(bytes).ok_or_else(|| {
        StoreFailure::UnreadableRecord("store record is not a recorded response".to_string())
    })?;
    // A header this filter could never have recorded means the record is corrupt or was
    // written by someone else: the whole answer is garbage, as for an undecodable record
    // (fail_closed answers 503, the retry tries again). Replaying it without the bad
    // headers instead would present a changed response as the recorded one.
    response.check_headers().map_err(|why| {
        StoreFailure::UnreadableRecord(format!("store record cannot be replayed: {why}"))
    })?;
    Ok(response)
}

/// Reads a claim answer: only a 200 with a well-formed body counts.
pub fn read_claim(status: Option<u16>, body: &[u8]) -> Result<StoreClaim, StoreFailure> {
    match status {
        Some(200) => {}
        Some(s) if s >= 500 => return Err(StoreFailure::ServerError(s)),
        Some(s) => return Err(StoreFailure::Refused(s)),
        None => return Err(StoreFailure::NoAnswer),
    }
    let answer: ClaimResponse = serde_json::from_slice(body)
        .map_err(|e| StoreFailure::Garbage(format!("store claim answer unreadable: {e}")))?;
    Ok(match answer {
        ClaimResponse::Claimed { owner, .. } if !owner.is_empty() => StoreClaim::Claimed { owner },
        ClaimResponse::Claimed { .. } => {
            return Err(StoreFailure::Garbage(
                "store claim answer has an empty owner".to_string(),
            ))
        }
        ClaimResponse::InFlight { .. } => StoreClaim::InFlight,
        ClaimResponse::Mismatch => StoreClaim::Mismatch,
        ClaimResponse::Completed { record } => {
            let bytes = decode_record(&record)
                .map_err(|e| StoreFailure::Garbage(format!("store record is not base64: {e}")))?;
            StoreClaim::Completed(replayable(&bytes)?)
        }
    })
}

/// Whether a complete/release call reached a final answer (done, or refused for good) or
/// should be retried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteAnswer {
    Done,
    /// A completion the store refused because the key is no longer this claim's: its lease
    /// passed and another request took the key over (on another replica, or during an outage
    /// under fail_open); the store keeps that request's record.
    Superseded,
    /// A settle the store did not apply: the key holds another record by now (settled by an
    /// earlier attempt whose answer was lost, moved on by another proxy resolving it, settled
    /// by an operator, or expired). Nothing changed.
    NotSettled,
    /// The store refused for good (a request it will never take).
    Refused(String),
    Retry(String),
    /// A renewal some of whose leases were no longer this proxy's claims: their indices, in the renew call's list, of the leases the store no longer holds.
    LeasesLost(Vec<u32>),
}

/// Which write an answer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteKind {
    Complete,
    Release,
    Renew,
    Settle,
}

/// A renewal's answer: done, or these of its leases were taken over meanwhile.
fn renewed(lost: Vec<u32>) -> WriteAnswer {
    if lost.is_empty() {
        WriteAnswer::Done
    } else {
        WriteAnswer::LeasesLost(lost)
    }
}

pub fn read_write_answer(kind: WriteKind, status: Option<u16>, body: &[u8]) -> WriteAnswer {
    match status {
        Some(200) if kind == WriteKind::Settle => WriteAnswer::Done,
        Some(409) if kind == WriteKind::Settle => WriteAnswer::NotSettled,
        // Nothing left to release (released before, expired, or taken over): the goal holds.
        Some(409) if kind == WriteKind::Release => WriteAnswer::Done,
        Some(200) if kind == WriteKind::Renew => {
            match serde_json::from_slice::<RenewResponse>(body) {
                Ok(a) if a.outcome == outcome::RENEWED => renewed(a.lost),
                Ok(a) => WriteAnswer::Retry(format!("unexpected outcome '{}'", a.outcome)),
                Err(e) => WriteAnswer::Retry(format!("answer unreadable: {e}")),
            }
        }
        Some(200) => match serde_json::from_slice::<OutcomeResponse>(body) {
            Ok(a) if a.outcome == outcome::COMPLETED || a.outcome == outcome::RELEASED => {
                WriteAnswer::Done
            }
            Ok(a) => WriteAnswer::Retry(format!("unexpected outcome '{}'", a.outcome)),
            Err(e) => WriteAnswer::Retry(format!("answer unreadable: {e}")),
        },
        Some(409) => WriteAnswer::Superseded,
        Some(s @ (400 | 401 | 403 | 404 | 413)) => {
            WriteAnswer::Refused(format!("store refused the request with status {s}"))
        }
        Some(s) => WriteAnswer::Retry(format!("store answered status {s}")),
        None => WriteAnswer::Retry("store unreachable or timed out".to_string()),
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use base64::engine::general_purpose::STANDARD as BASE64;
    use base64::Engine as _;

    fn recorded() -> RecordedResponse {
        RecordedResponse {
            owner: 3,
            status: 201,
            headers: vec![("content-type".into(), b"application/json".to_vec())],
            body: b"{}".to_vec(),
            trailers: Vec::new(),
            body_omitted: false,
            unknown: None,
        }
    }

    #[test]
    fn request_bodies_follow_the_protocol() {
        let v: serde_json::Value = serde_json::from_slice(&http_body(&claim_call(
            &[0xab; 32],
            &[1; 32],
            60_000,
            "0a1b",
        )))
        .unwrap();
        assert_eq!(v["owner"], "0a1b");
        assert_eq!(v["key"].as_str().unwrap(), "ab".repeat(32));
        assert_eq!(v["fingerprint"].as_str().unwrap(), "01".repeat(32));
        assert_eq!(v["lease_ms"], 60_000);
        let v: serde_json::Value = serde_json::from_slice(&http_body(&complete_call(
            &[0; 32],
            &[2; 32],
            "own",
            5,
            0,
            &recorded(),
        )))
        .unwrap();
        let bytes = BASE64.decode(v["record"].as_str().unwrap()).unwrap();
        assert_eq!(RecordedResponse::decode(&bytes), Some(recorded()));
        assert_eq!(v["owner"], "own");
        assert_eq!(v["fingerprint"].as_str().unwrap(), "02".repeat(32));
        // No tombstone: the field is left out, so a store older than tombstones takes it.
        assert!(v.get("tombstone_ms").is_none());
        let v: serde_json::Value = serde_json::from_slice(&http_body(&complete_call(
            &[0; 32],
            &[2; 32],
            "own",
            5,
            7,
            &recorded(),
        )))
        .unwrap();
        assert_eq!(v["tombstone_ms"], 7);
        let settle = |tombstone_ms| {
            let call = settle_call(&[0; 32], vec![1], Some(vec![2]), 5, tombstone_ms);
            serde_json::from_slice::<serde_json::Value>(&http_body(&call)).unwrap()
        };
        assert!(settle(0).get("tombstone_ms").is_none(), "as a completion's");
        assert_eq!(settle(9)["tombstone_ms"], 9);
    }

    #[test]
    fn claim_answers_are_read() {
        assert_eq!(
            read_claim(
                Some(200),
                br#"{"outcome":"claimed","owner":"ab","lease_expires_at_ms":1}"#
            ),
            Ok(StoreClaim::Claimed { owner: "ab".into() })
        );
        assert_eq!(
            read_claim(Some(200), br#"{"outcome":"in_flight","retry_after_ms":5}"#),
            Ok(StoreClaim::InFlight)
        );
        assert_eq!(
            read_claim(Some(200), br#"{"outcome":"mismatch"}"#),
            Ok(StoreClaim::Mismatch)
        );
        let record = BASE64.encode(recorded().encode());
        let body = format!(r#"{{"outcome":"completed","record":"{record}"}}"#);
        assert_eq!(
            read_claim(Some(200), body.as_bytes()),
            Ok(StoreClaim::Completed(recorded()))
        );
    }

    #[test]
    fn garbage_and_errors_are_failures_not_panics() {
        for (status, body) in [
            (None, &b""[..]),
            (Some(503), &b"{}"[..]),
            (Some(401), &b"{}"[..]),
            (Some(200), &b"not json"[..]),
            (Some(200), &br#"{"outcome":"exploded"}"#[..]),
            (Some(200), &br#"{"outcome":"claimed","owner":""}"#[..]),
            (Some(200), &br#"{"outcome":"completed","record":"!!"}"#[..]),
            (
                Some(200),
                &br#"{"outcome":"completed","record":"aGVsbG8="}"#[..],
            ),
        ] {
            assert!(read_claim(status, body).is_err(), "{status:?} {body:?}");
        }
        // Only a lost answer or a server error leaves a claim the proxy must undo.
        let applied = |status, body: &[u8]| {
            read_claim(status, body)
                .unwrap_err()
                .may_have_been_applied()
        };
        assert!(applied(None, b""));
        assert!(applied(Some(503), b"{}"));
        assert!(!applied(Some(401), b"{}"));
        assert!(!applied(Some(200), b"not json"));
    }

    #[test]
    fn records_with_unsafe_headers_are_garbage_answers() {
        for (name, value) in [
            ("x-injected", &b"1\r\nset-cookie: session=stolen"[..]),
            ("x-nul", &b"a\0"[..]),
            ("bad name", &b"v"[..]),
        ] {
            let mut record = recorded();
            record.headers.push((name.to_string(), value.to_vec()));
            let body = format!(
                r#"{{"outcome":"completed","record":"{}"}}"#,
                BASE64.encode(record.encode())
            );
            let failure = read_claim(Some(200), body.as_bytes()).unwrap_err();
            assert!(
                failure.to_string().contains("cannot be replayed"),
                "{failure}"
            );
        }
    }

    #[test]
    fn write_answers_tell_done_refused_and_retry_apart() {
        use WriteKind::{Complete, Release};
        let done = WriteAnswer::Done;
        assert_eq!(
            read_write_answer(Complete, Some(200), br#"{"outcome":"completed"}"#),
            done
        );
        assert_eq!(
            read_write_answer(Release, Some(200), br#"{"outcome":"released"}"#),
            done
        );
        assert_eq!(
            read_write_answer(Complete, Some(409), b""),
            WriteAnswer::Superseded
        );
        assert_eq!(
            read_write_answer(Release, Some(409), b""),
            WriteAnswer::Done
        );
        assert!(matches!(
            read_write_answer(Release, Some(401), b""),
            WriteAnswer::Refused(_)
        ));
        assert!(matches!(
            read_write_answer(Complete, Some(503), b""),
            WriteAnswer::Retry(_)
        ));
        assert!(matches!(
            read_write_answer(Complete, None, b""),
            WriteAnswer::Retry(_)
        ));
        assert!(matches!(
            read_write_answer(Complete, Some(200), b"junk"),
            WriteAnswer::Retry(_)
        ));
        // A settle's sender learns whether the store applied it.
        use WriteKind::Settle;
        let replaced = br#"{"outcome":"replaced"}"#;
        assert_eq!(read_write_answer(Settle, Some(200), replaced), done);
        assert_eq!(
            read_write_answer(Settle, Some(409), b""),
            WriteAnswer::NotSettled
        );
        assert_eq!(read_write_reply(Settle, &Reply::Released), done);
        assert_eq!(
            read_write_reply(Settle, &Reply::NotOwner),
            WriteAnswer::NotSettled
        );
    }

    #[test]
    fn store_owners_are_hex_and_differ_per_claim() {
        let a = store_owner(1, 100);
        assert_eq!(a.len(), 32);
        assert!(a.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(a, store_owner(2, 100));
        assert_ne!(a, store_owner(1, 101));
        // The counter and the clock never share digits: (1, 256) is not (256, 1).
        assert_ne!(store_owner(1, 256), store_owner(256, 1));
    }
}

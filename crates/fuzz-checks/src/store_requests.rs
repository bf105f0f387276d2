//! The store's requests: JSON bodies of the HTTP API (`idempotency_store::protocol`) and
//! calls on the gRPC stream (`idempotency_protocol::stream::decode_call` for the filter's
//! side, the store's generated code for its own).

use arbitrary::{Result, Unstructured};
use idempotency_protocol::record::{is_unknown_outcome, RecordedResponse, UnknownOutcome};
use idempotency_protocol::stream::{decode_call, encode_call, Call, CallOp};
use idempotency_protocol::wire::{
    decode_record, encode_record, ClaimBody, CompleteBody, ReleaseBody, RenewBody, MAX_LEASE_MS,
    MAX_RENEW_LEASES, MAX_TTL_MS, MIN_LEASE_MS, MIN_TTL_MS,
};
use idempotency_store::grpc::pb;
use idempotency_store::grpc::pb::call::Op as PbOp;
use idempotency_store::protocol::{
    parse_claim, parse_complete, parse_key, parse_release, parse_renew, validate_claim,
    validate_complete, validate_release, validate_renew, validate_settle, validate_wait,
};
use idempotency_store::storage::Digest;
use idempotency_store::waits::MAX_WAIT_MS;
use prost::Message as _;
use serde_json::Value;

use crate::gen::{digest_text, renew_leases, token_text};

/// Any body: a request the store accepts holds what the body says, normalised (digests and
/// owners as lowercase hex of the right length, times within the store's bounds, the record
/// decoded from base64). Built bodies: the store accepts exactly the requests whose every
/// field is valid, refuses any unknown field, and reads back the values sent.
pub fn store_request_http(data: &[u8]) {
    http_raw(data);
    let _ = http_built(&mut Unstructured::new(data));
}

/// Any bytes: a call that decodes re-encodes to itself, the store's generated code reads that
/// encoding as the same call, and the store validates it as it would the same call in JSON.
/// Built calls: every call the filter can send decodes to itself and is byte for byte what
/// the store's generated code writes.
pub fn store_request_stream(data: &[u8]) {
    stream_raw(data);
    let _ = stream_built(&mut Unstructured::new(data));
}

fn is_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn is_owner(s: &str) -> bool {
    (1..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

fn lower(s: &str) -> String {
    s.to_ascii_lowercase()
}

fn http_raw(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        match parse_key(text) {
            Ok(key) => assert_eq!(key.as_str(), lower(text)),
            Err(_) => assert!(!is_digest(text)),
        }
        if is_digest(text) {
            assert!(parse_key(text).is_ok());
        }
    }
    if let Ok(req) = parse_claim(data) {
        let sent: ClaimBody = serde_json::from_slice(data).expect("accepted, so readable");
        assert_eq!(req.key.as_str(), lower(&sent.key));
        assert_eq!(req.fingerprint.as_str(), lower(&sent.fingerprint));
        assert!(is_digest(req.key.as_str()) && is_digest(req.fingerprint.as_str()));
        assert!((MIN_LEASE_MS..=MAX_LEASE_MS).contains(&req.lease_ms));
        assert_eq!(req.lease_ms, sent.lease_ms);
        assert_eq!(
            req.owner.as_ref().map(|o| o.as_str().to_owned()),
            sent.owner.as_deref().map(lower)
        );
        assert!(req.owner.as_ref().is_none_or(|o| is_owner(o.as_str())));
    }
    if let Ok(req) = parse_complete(data) {
        let sent: CompleteBody = serde_json::from_slice(data).expect("accepted, so readable");
        assert_eq!(req.key.as_str(), lower(&sent.key));
        assert!(is_owner(req.owner.as_str()) && req.owner.as_str() == lower(&sent.owner));
        assert!((MIN_TTL_MS..=MAX_TTL_MS).contains(&req.ttl_ms));
        assert_eq!(Ok(&req.record), decode_record(&sent.record).as_ref());
        assert_eq!(
            req.fingerprint.as_ref().map(|f| f.as_str().to_owned()),
            sent.fingerprint.as_deref().map(lower)
        );
    }
    if let Ok(req) = parse_release(data) {
        let sent: ReleaseBody = serde_json::from_slice(data).expect("accepted, so readable");
        assert_eq!(req.key.as_str(), lower(&sent.key));
        assert_eq!(req.owner.as_str(), lower(&sent.owner));
        assert!(is_digest(req.key.as_str()) && is_owner(req.owner.as_str()));
    }
    if let Ok(req) = parse_renew(data) {
        let sent: RenewBody = serde_json::from_slice(data).expect("accepted, so readable");
        assert!((MIN_LEASE_MS..=MAX_LEASE_MS).contains(&req.lease_ms));
        assert_eq!(req.lease_ms, sent.lease_ms);
        assert!((1..=MAX_RENEW_LEASES).contains(&req.leases.len()));
        assert_eq!(req.leases.len(), sent.leases.len());
        for (read, sent) in req.leases.iter().zip(&sent.leases) {
            assert_eq!(read.key.as_str(), lower(&sent.key));
            assert_eq!(read.owner.as_str(), lower(&sent.owner));
            assert!(is_digest(read.key.as_str()) && is_owner(read.owner.as_str()));
        }
    }
}

fn renew_body(lease_ms: u64, leases: &[(String, String)]) -> RenewBody {
    RenewBody::of(lease_ms, leases)
}

fn time(u: &mut Unstructured<'_>, max: u64) -> Result<u64> {
    let any = u.arbitrary()?;
    Ok(*u.choose(&[0, 1, 5_000, max, max + 1, any])?)
}

/// `body` as JSON, with an unknown field added when `extra`.
fn json_with(body: &impl serde::Serialize, extra: bool) -> Vec<u8> {
    let mut v = serde_json::to_value(body).expect("serializes");
    if extra {
        v["lease"] = Value::from(5);
    }
    serde_json::to_vec(&v).expect("serializes")
}

fn http_built(u: &mut Unstructured<'_>) -> Result<()> {
    let extra = u.ratio(1, 8)?;
    match u.int_in_range(0..=3)? {
        0 => {
            let sent = ClaimBody {
                key: digest_text(u)?,
                fingerprint: digest_text(u)?,
                lease_ms: time(u, MAX_LEASE_MS)?,
                owner: if u.arbitrary()? {
                    Some(token_text(u, 66)?)
                } else {
                    None
                },
            };
            let valid = !extra
                && is_digest(&sent.key)
                && is_digest(&sent.fingerprint)
                && (MIN_LEASE_MS..=MAX_LEASE_MS).contains(&sent.lease_ms)
                && sent.owner.as_deref().is_none_or(is_owner);
            let read = parse_claim(&json_with(&sent, extra));
            assert_eq!(read.is_ok(), valid, "{sent:?} {read:?}");
            if let Ok(req) = read {
                assert_eq!(req.key.as_str(), lower(&sent.key));
                assert_eq!(req.fingerprint.as_str(), lower(&sent.fingerprint));
                assert_eq!(req.lease_ms, sent.lease_ms);
                assert_eq!(
                    req.owner.map(|o| o.as_str().to_owned()),
                    sent.owner.as_deref().map(lower)
                );
            }
        }
        1 => {
            let record: Vec<u8> = u.arbitrary()?;
            let record_text = if u.ratio(1, 6)? {
                u.arbitrary()?
            } else {
                encode_record(&record)
            };
            let sent = CompleteBody {
                key: digest_text(u)?,
                owner: token_text(u, 66)?,
                ttl_ms: time(u, MAX_TTL_MS)?,
                record: record_text,
                fingerprint: if u.arbitrary()? {
                    Some(digest_text(u)?)
                } else {
                    None
                },
                tombstone_ms: time(u, MAX_TTL_MS)?,
            };
            let decoded = decode_record(&sent.record);
            let valid = !extra
                && is_digest(&sent.key)
                && is_owner(&sent.owner)
                && (MIN_TTL_MS..=MAX_TTL_MS).contains(&sent.ttl_ms)
                && sent.tombstone_ms <= MAX_TTL_MS
                && decoded.is_ok()
                && sent.fingerprint.as_deref().is_none_or(is_digest);
            let read = parse_complete(&json_with(&sent, extra));
            assert_eq!(read.is_ok(), valid, "{sent:?} {read:?}");
            if let Ok(req) = read {
                assert_eq!(req.key.as_str(), lower(&sent.key));
                assert_eq!(req.owner.as_str(), lower(&sent.owner));
                assert_eq!(req.ttl_ms, sent.ttl_ms);
                assert_eq!(req.tombstone_ms, sent.tombstone_ms);
                assert_eq!(Ok(req.record), decoded);
                if sent.record == encode_record(&record) {
                    assert_eq!(decoded, Ok(record));
                }
            }
        }
        2 => {
            let sent = ReleaseBody {
                key: digest_text(u)?,
                owner: token_text(u, 66)?,
            };
            let valid = !extra && is_digest(&sent.key) && is_owner(&sent.owner);
            let read = parse_release(&json_with(&sent, extra));
            assert_eq!(read.is_ok(), valid, "{sent:?} {read:?}");
            if let Ok(req) = read {
                assert_eq!(req.key.as_str(), lower(&sent.key));
                assert_eq!(req.owner.as_str(), lower(&sent.owner));
            }
        }
        _ => {
            let lease_ms = time(u, MAX_LEASE_MS)?;
            let leases = renew_leases(u, MAX_RENEW_LEASES)?;
            let sent = renew_body(lease_ms, &leases);
            let valid = !extra
                && (MIN_LEASE_MS..=MAX_LEASE_MS).contains(&lease_ms)
                && (1..=MAX_RENEW_LEASES).contains(&leases.len())
                && leases.iter().all(|(k, o)| is_digest(k) && is_owner(o));
            let read = parse_renew(&json_with(&sent, extra));
            assert_eq!(read.is_ok(), valid, "{sent:?} {read:?}");
            if let Ok(req) = read {
                assert_eq!(req.lease_ms, lease_ms);
                let read: Vec<(String, String)> = req
                    .leases
                    .iter()
                    .map(|l| (l.key.as_str().to_owned(), l.owner.as_str().to_owned()))
                    .collect();
                let sent: Vec<(String, String)> =
                    leases.iter().map(|(k, o)| (lower(k), lower(o))).collect();
                assert_eq!(read, sent);
            }
        }
    }
    Ok(())
}

/// The store's form of a call (its generated types).
fn to_pb(call: &Call) -> pb::Call {
    let op = match &call.op {
        CallOp::Claim {
            key,
            fingerprint,
            lease_ms,
            owner,
        } => PbOp::Claim(pb::Claim {
            key: key.clone(),
            fingerprint: fingerprint.clone(),
            lease_ms: *lease_ms,
            owner: owner.clone(),
        }),
        CallOp::Complete {
            key,
            owner,
            ttl_ms,
            record,
            fingerprint,
            tombstone_ms,
        } => PbOp::Complete(pb::Complete {
            key: key.clone(),
            owner: owner.clone(),
            ttl_ms: *ttl_ms,
            record: record.clone(),
            fingerprint: fingerprint.clone(),
            tombstone_ms: *tombstone_ms,
        }),
        CallOp::Release { key, owner } => PbOp::Release(pb::Release {
            key: key.clone(),
            owner: owner.clone(),
        }),
        CallOp::Wait {
            key,
            fingerprint,
            wait_ms,
        } => PbOp::Wait(pb::Wait {
            key: key.clone(),
            fingerprint: fingerprint.clone(),
            wait_ms: *wait_ms,
        }),
        CallOp::Lookup { key } => PbOp::Lookup(pb::Lookup { key: key.clone() }),
        CallOp::Settle {
            key,
            current,
            record,
            ttl_ms,
            tombstone_ms,
        } => PbOp::Settle(pb::Settle {
            key: key.clone(),
            current: current.clone(),
            record: record.clone(),
            ttl_ms: *ttl_ms,
            tombstone_ms: *tombstone_ms,
        }),
        CallOp::Renew { lease_ms, leases } => PbOp::Renew(pb::Renew {
            lease_ms: *lease_ms,
            leases: leases
                .iter()
                .map(|(key, owner)| pb::Lease {
                    key: key.clone(),
                    owner: owner.clone(),
                })
                .collect(),
        }),
    };
    pb::Call {
        id: call.id,
        op: Some(op),
    }
}

/// The store's verdict on a call from the stream (as its gRPC service reads the fields: an
/// empty owner or fingerprint is absent) and on the same call as a JSON body.
fn verdicts(op: &CallOp) -> (String, String) {
    match op {
        CallOp::Claim {
            key,
            fingerprint,
            lease_ms,
            owner,
        } => {
            let body = ClaimBody {
                key: key.clone(),
                fingerprint: fingerprint.clone(),
                lease_ms: *lease_ms,
                owner: (!owner.is_empty()).then(|| owner.clone()),
            };
            let json = serde_json::to_vec(&body).expect("serializes");
            (
                format!("{:?}", validate_claim(body)),
                format!("{:?}", parse_claim(&json)),
            )
        }
        CallOp::Complete {
            key,
            owner,
            ttl_ms,
            record,
            fingerprint,
            tombstone_ms,
        } => {
            let fingerprint = (!fingerprint.is_empty()).then_some(fingerprint.as_str());
            let body = CompleteBody {
                key: key.clone(),
                owner: owner.clone(),
                ttl_ms: *ttl_ms,
                record: encode_record(record),
                fingerprint: fingerprint.map(str::to_owned),
                tombstone_ms: *tombstone_ms,
            };
            let json = serde_json::to_vec(&body).expect("serializes");
            (
                format!(
                    "{:?}",
                    validate_complete(
                        key,
                        owner,
                        *ttl_ms,
                        *tombstone_ms,
                        record.clone(),
                        fingerprint
                    )
                ),
                format!("{:?}", parse_complete(&json)),
            )
        }
        CallOp::Release { key, owner } => {
            let body = ReleaseBody {
                key: key.clone(),
                owner: owner.clone(),
            };
            let json = serde_json::to_vec(&body).expect("serializes");
            (
                format!("{:?}", validate_release(key, owner)),
                format!("{:?}", parse_release(&json)),
            )
        }
        // Stream only: judged against the documented bounds instead of a JSON twin.
        CallOp::Wait {
            key,
            fingerprint,
            wait_ms,
        } => {
            let valid = Digest::parse(key).is_ok()
                && Digest::parse(fingerprint).is_ok()
                && (1..=MAX_WAIT_MS).contains(wait_ms);
            (
                format!("{:?}", validate_wait(key, fingerprint, *wait_ms).is_ok()),
                format!("{valid:?}"),
            )
        }
        // Stream only: a key, as every other call's.
        CallOp::Lookup { key } => (
            format!("{:?}", parse_key(key).is_ok()),
            format!("{:?}", Digest::parse(key).is_ok()),
        ),
        // Stream only: judged against the documented bounds instead of a JSON twin.
        CallOp::Settle {
            key,
            current,
            record,
            ttl_ms,
            tombstone_ms,
        } => {
            let valid = Digest::parse(key).is_ok()
                && is_unknown_outcome(current)
                && if record.is_empty() {
                    *ttl_ms == 0 && *tombstone_ms == 0
                } else {
                    (*ttl_ms == 0 || (MIN_TTL_MS..=MAX_TTL_MS).contains(ttl_ms))
                        && *tombstone_ms <= MAX_TTL_MS
                };
            let validated =
                validate_settle(key, current.clone(), record.clone(), *ttl_ms, *tombstone_ms);
            (format!("{:?}", validated.is_ok()), format!("{valid:?}"))
        }
        CallOp::Renew { lease_ms, leases } => {
            let body = renew_body(*lease_ms, leases);
            let json = serde_json::to_vec(&body).expect("serializes");
            (
                format!("{:?}", validate_renew(body)),
                format!("{:?}", parse_renew(&json)),
            )
        }
    }
}

fn stream_raw(data: &[u8]) {
    let Ok(call) = decode_call(data) else {
        return;
    };
    let encoded = encode_call(&call);
    assert_eq!(decode_call(&encoded).as_ref(), Ok(&call));
    assert_eq!(pb::Call::decode(&encoded[..]).ok(), Some(to_pb(&call)));
    let (on_stream, as_json) = verdicts(&call.op);
    assert_eq!(on_stream, as_json, "{call:?}");
}

fn stream_built(u: &mut Unstructured<'_>) -> Result<()> {
    let op = match u.int_in_range(0..=6)? {
        0 => CallOp::Claim {
            key: digest_text(u)?,
            fingerprint: digest_text(u)?,
            lease_ms: time(u, MAX_LEASE_MS)?,
            owner: token_text(u, 66)?,
        },
        1 => CallOp::Complete {
            key: digest_text(u)?,
            owner: token_text(u, 66)?,
            ttl_ms: time(u, MAX_TTL_MS)?,
            record: u.arbitrary()?,
            fingerprint: if u.arbitrary()? {
                digest_text(u)?
            } else {
                String::new()
            },
            tombstone_ms: time(u, MAX_TTL_MS)?,
        },
        2 => CallOp::Release {
            key: digest_text(u)?,
            owner: token_text(u, 66)?,
        },
        3 => CallOp::Wait {
            key: digest_text(u)?,
            fingerprint: digest_text(u)?,
            wait_ms: time(u, MAX_WAIT_MS)?,
        },
        5 => CallOp::Lookup {
            key: digest_text(u)?,
        },
        4 => CallOp::Settle {
            key: digest_text(u)?,
            // What a filter sends (an unknown outcome), or anything.
            current: if u.arbitrary()? {
                let outcome = UnknownOutcome {
                    details: u.arbitrary()?,
                    ..UnknownOutcome::default()
                };
                RecordedResponse::unknown_outcome(outcome).encode()
            } else {
                u.arbitrary()?
            },
            record: u.arbitrary()?,
            ttl_ms: if u.arbitrary()? {
                0
            } else {
                time(u, MAX_TTL_MS)?
            },
            tombstone_ms: if u.arbitrary()? {
                0
            } else {
                time(u, MAX_TTL_MS)?
            },
        },
        _ => CallOp::Renew {
            lease_ms: time(u, MAX_LEASE_MS)?,
            leases: renew_leases(u, MAX_RENEW_LEASES)?,
        },
    };
    let call = Call {
        id: u.arbitrary()?,
        op,
    };
    let encoded = encode_call(&call);
    assert_eq!(decode_call(&encoded).as_ref(), Ok(&call));
    let theirs = to_pb(&call);
    assert_eq!(encoded, theirs.encode_to_vec(), "byte for byte: {call:?}");
    assert_eq!(pb::Call::decode(&encoded[..]).as_ref(), Ok(&theirs));
    let (on_stream, as_json) = verdicts(&call.op);
    assert_eq!(on_stream, as_json, "{call:?}");
    Ok(())
}

//! The messages of the store's gRPC stream (`proto/idempotency_store.proto`) in protobuf's
//! wire format, for the filter: a Wasm module that must stay small and whose dependencies are
//! kept to a few, so the handful of messages it sends and reads are encoded here by hand.
//! The store uses code generated from the schema; the store's tests check that both agree.
//!
//! Decoding never panics and never trusts a length: every read is bounds-checked, unknown
//! fields are skipped (a newer store may add some), and a malformed message is an error.

/// A call on the stream: the client's `id` comes back on the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub id: u64,
    pub op: CallOp,
}

/// Digests and owners as the HTTP API's hex text; an empty `owner` (claim) or
/// `fingerprint` (complete) means absent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallOp {
    Claim {
        key: String,
        fingerprint: String,
        lease_ms: u64,
        owner: String,
    },
    Complete {
        key: String,
        owner: String,
        ttl_ms: u64,
        record: Vec<u8>,
        fingerprint: String,
        /// After `ttl_ms`, how long the record is kept without its body (0: not at all).
        tombstone_ms: u64,
    },
    Release {
        key: String,
        owner: String,
    },
    /// Answered when the key's in-flight record ends (`Completed`, `Released`, `Mismatch`)
    /// or `wait_ms` passes (`InFlight`).
    Wait {
        key: String,
        fingerprint: String,
        wait_ms: u64,
    },
    /// Keeps the leases of claims still running alive: each `(key, owner)` gets `lease_ms`
    /// more from now. Answered `Renewed` with the leases that were lost.
    Renew {
        lease_ms: u64,
        leases: Vec<(String, String)>,
    },
    /// Settles an unknown outcome: only if the key's completed record holds exactly
    /// `current`, it becomes `record` (kept `ttl_ms` from now; 0: until `current` would have
    /// expired), or, with `record` empty, is removed so the key is free. Answered `Recorded`,
    /// `Released`, or `NotOwner` when the record is anything else (nothing changes).
    Settle {
        key: String,
        current: Vec<u8>,
        record: Vec<u8>,
        ttl_ms: u64,
        /// After that, how long `record` is kept without its body, as a completion's
        /// tombstone (0: not at all).
        tombstone_ms: u64,
    },
    /// What the key holds, changing nothing (a caller asking about its own key): answered
    /// `Completed` with the record, `InFlight`, or `Released` when nothing live holds it.
    Lookup {
        key: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub id: u64,
    pub reply: Reply,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Claimed {
        owner: String,
        lease_expires_at_ms: u64,
    },
    InFlight {
        retry_after_ms: u64,
    },
    Completed {
        record: Vec<u8>,
    },
    Mismatch,
    Recorded,
    Released,
    NotOwner,
    /// To a renew: the 0-based indexes of its leases that were not renewed (not the caller's
    /// any more); empty when every lease was.
    Renewed {
        lost: Vec<u32>,
    },
    Failure {
        kind: FailureKind,
        detail: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// Malformed call; sending it again will not help.
    BadRequest,
    /// The backend failed: the outcome is unknown.
    Unavailable,
    /// A kind this build does not know (a newer store); treated like `Unavailable`.
    Other(u64),
}

impl FailureKind {
    fn number(self) -> u64 {
        match self {
            Self::BadRequest => 1,
            Self::Unavailable => 2,
            Self::Other(n) => n,
        }
    }

    fn from_number(n: u64) -> Self {
        match n {
            1 => Self::BadRequest,
            2 => Self::Unavailable,
            n => Self::Other(n),
        }
    }
}

/// Why bytes are not a message of the schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(pub &'static str);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "malformed stream message: {}", self.0)
    }
}

// Field numbers, as in the schema.
mod field {
    pub const ID: u32 = 1;
    // Call.op
    pub const CLAIM: u32 = 2;
    pub const COMPLETE: u32 = 3;
    pub const RELEASE: u32 = 4;
    pub const WAIT: u32 = 5;
    pub const RENEW: u32 = 6;
    pub const SETTLE: u32 = 7;
    pub const LOOKUP: u32 = 8;
    // Answer.result
    pub const CLAIMED: u32 = 2;
    pub const IN_FLIGHT: u32 = 3;
    pub const COMPLETED: u32 = 4;
    pub const MISMATCH: u32 = 5;
    pub const RECORDED: u32 = 6;
    pub const RELEASED: u32 = 7;
    pub const NOT_OWNER: u32 = 8;
    pub const FAILURE: u32 = 9;
    pub const RENEWED: u32 = 10;
}

const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

// ------------------------------------------------------------------------------------------
// encoding
// ------------------------------------------------------------------------------------------

struct Writer(Vec<u8>);

impl Writer {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn tag(&mut self, field: u32, wire: u8) {
        self.varint(u64::from(field) << 3 | u64::from(wire));
    }

    /// A scalar as proto3 writes it: nothing when it is the default.
    fn uint(&mut self, field: u32, v: u64) {
        if v != 0 {
            self.tag(field, VARINT);
            self.varint(v);
        }
    }

    fn bytes(&mut self, field: u32, v: &[u8]) {
        if !v.is_empty() {
            self.message(field, v);
        }
    }

    /// A length-delimited field written even when empty (a set oneof member).
    fn message(&mut self, field: u32, v: &[u8]) {
        self.tag(field, LEN);
        self.varint(v.len() as u64);
        self.0.extend_from_slice(v);
    }

    /// A repeated number field, packed as proto3 writes it: nothing when it is empty.
    fn packed(&mut self, field: u32, values: &[u32]) {
        if !values.is_empty() {
            let numbers = build(|w| values.iter().for_each(|n| w.varint(u64::from(*n))));
            self.message(field, &numbers);
        }
    }
}

/// Room for a message of small fields (a claim, most answers) without growing.
const SMALL_MESSAGE_BYTES: usize = 160;
/// A field's tag and length prefix, at most (field numbers below 16, lengths below 2^32).
const FIELD_HEAD_BYTES: usize = 6;

fn build(fill: impl FnOnce(&mut Writer)) -> Vec<u8> {
    build_sized(SMALL_MESSAGE_BYTES, fill)
}

/// `build` into a buffer of `capacity` bytes: a message carrying a record is written once,
/// not grown and copied as it fills (a completion is the largest call on the stream).
fn build_sized(capacity: usize, fill: impl FnOnce(&mut Writer)) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(capacity));
    fill(&mut w);
    w.0
}

/// A Call or an Answer: its id, and its oneof member (field number `member`) holding `body`.
fn wrap(id: u64, member: u32, body: &[u8]) -> Vec<u8> {
    build_sized(body.len() + 2 * FIELD_HEAD_BYTES + 10, |w| {
        w.uint(field::ID, id);
        w.message(member, body);
    })
}

pub fn encode_call(call: &Call) -> Vec<u8> {
    encode_call_parts(call.id, &call.op)
}

/// `encode_call` for a call the caller keeps (a write that may be sent again).
pub fn encode_call_parts(id: u64, op: &CallOp) -> Vec<u8> {
    let (field, body) = match op {
        CallOp::Claim {
            key,
            fingerprint,
            lease_ms,
            owner,
        } => (
            field::CLAIM,
            build(|w| {
                w.bytes(1, key.as_bytes());
                w.bytes(2, fingerprint.as_bytes());
                w.uint(3, *lease_ms);
                w.bytes(4, owner.as_bytes());
            }),
        ),
        CallOp::Complete {
            key,
            owner,
            ttl_ms,
            record,
            fingerprint,
            tombstone_ms,
        } => (
            field::COMPLETE,
            build_sized(
                key.len() + owner.len() + record.len() + fingerprint.len() + 6 * FIELD_HEAD_BYTES,
                |w| {
                    w.bytes(1, key.as_bytes());
                    w.bytes(2, owner.as_bytes());
                    w.uint(3, *ttl_ms);
                    w.bytes(4, record);
                    w.bytes(5, fingerprint.as_bytes());
                    w.uint(6, *tombstone_ms);
                },
            ),
        ),
        CallOp::Release { key, owner } => (
            field::RELEASE,
            build(|w| {
                w.bytes(1, key.as_bytes());
                w.bytes(2, owner.as_bytes());
            }),
        ),
        CallOp::Wait {
            key,
            fingerprint,
            wait_ms,
        } => (
            field::WAIT,
            build(|w| {
                w.bytes(1, key.as_bytes());
                w.bytes(2, fingerprint.as_bytes());
                w.uint(3, *wait_ms);
            }),
        ),
        CallOp::Renew { lease_ms, leases } => (
            field::RENEW,
            build(|w| {
                w.uint(1, *lease_ms);
                for (key, owner) in leases {
                    // Every element is written, even an empty one, as for any repeated message.
                    let lease = build(|l| {
                        l.bytes(1, key.as_bytes());
                        l.bytes(2, owner.as_bytes());
                    });
                    w.message(2, &lease);
                }
            }),
        ),
        CallOp::Settle {
            key,
            current,
            record,
            ttl_ms,
            tombstone_ms,
        } => (
            field::SETTLE,
            build_sized(
                key.len() + current.len() + record.len() + 5 * FIELD_HEAD_BYTES,
                |w| {
                    w.bytes(1, key.as_bytes());
                    w.bytes(2, current);
                    w.bytes(3, record);
                    w.uint(4, *ttl_ms);
                    w.uint(5, *tombstone_ms);
                },
            ),
        ),
        CallOp::Lookup { key } => (field::LOOKUP, build(|w| w.bytes(1, key.as_bytes()))),
    };
    wrap(id, field, &body)
}

/// Envoy's `envoy.config.core.v3.GrpcService` naming `cluster` and the `:authority` its
/// streams carry. Given to Envoy instead of a bare cluster name, whose default authority (the
/// cluster name) is not a valid host where the name has Istio's `outbound|port||fqdn` form.
pub fn envoy_grpc_service(cluster: &str, authority: &str) -> Vec<u8> {
    let envoy_grpc = build(|w| {
        w.bytes(1, cluster.as_bytes());
        w.bytes(2, authority.as_bytes());
    });
    build(|w| w.message(1, &envoy_grpc))
}

pub fn encode_answer(answer: &Answer) -> Vec<u8> {
    let (field, body) = match &answer.reply {
        Reply::Claimed {
            owner,
            lease_expires_at_ms,
        } => (
            field::CLAIMED,
            build(|w| {
                w.bytes(1, owner.as_bytes());
                w.uint(2, *lease_expires_at_ms);
            }),
        ),
        Reply::InFlight { retry_after_ms } => {
            (field::IN_FLIGHT, build(|w| w.uint(1, *retry_after_ms)))
        }
        Reply::Completed { record } => (
            field::COMPLETED,
            build_sized(record.len() + FIELD_HEAD_BYTES, |w| w.bytes(1, record)),
        ),
        Reply::Mismatch => (field::MISMATCH, Vec::new()),
        Reply::Recorded => (field::RECORDED, Vec::new()),
        Reply::Released => (field::RELEASED, Vec::new()),
        Reply::NotOwner => (field::NOT_OWNER, Vec::new()),
        Reply::Renewed { lost } => (field::RENEWED, build(|w| w.packed(1, lost))),
        Reply::Failure { kind, detail } => (
            field::FAILURE,
            build(|w| {
                w.uint(1, kind.number());
                w.bytes(2, detail.as_bytes());
            }),
        ),
    };
    wrap(answer.id, field, &body)
}

// ------------------------------------------------------------------------------------------
// decoding
// ------------------------------------------------------------------------------------------

enum Value<'a> {
    Varint(u64),
    Len(&'a [u8]),
}

struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn varint(&mut self) -> Result<u64, DecodeError> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = self
                .0
                .split_first()
                .ok_or(DecodeError("truncated varint"))?;
            self.0 = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(DecodeError("varint longer than 10 bytes"))
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], DecodeError> {
        let n = usize::try_from(n).map_err(|_| DecodeError("length too large"))?;
        if n > self.0.len() {
            return Err(DecodeError("length beyond the message"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    /// The next field, its unknown wire types skipped over; None at the end.
    fn next(&mut self) -> Result<Option<(u32, Value<'a>)>, DecodeError> {
        while !self.0.is_empty() {
            let tag = self.varint()?;
            let field =
                u32::try_from(tag >> 3).map_err(|_| DecodeError("field number too large"))?;
            if field == 0 {
                return Err(DecodeError("field number 0"));
            }
            match (tag & 7) as u8 {
                VARINT => return Ok(Some((field, Value::Varint(self.varint()?)))),
                LEN => {
                    let len = self.varint()?;
                    return Ok(Some((field, Value::Len(self.take(len)?))));
                }
                FIXED64 => {
                    self.take(8)?;
                }
                FIXED32 => {
                    self.take(4)?;
                }
                _ => return Err(DecodeError("unsupported wire type")),
            }
        }
        Ok(None)
    }
}

fn text(bytes: &[u8]) -> Result<String, DecodeError> {
    String::from_utf8(bytes.to_vec()).map_err(|_| DecodeError("a string field is not UTF-8"))
}

/// Reads a message's fields; `on` gets each known field (by number and value) and says
/// whether it took it; a known number with the wrong wire type is an error.
fn each_field<'a>(
    bytes: &'a [u8],
    mut on: impl FnMut(u32, Value<'a>) -> Result<(), DecodeError>,
) -> Result<(), DecodeError> {
    let mut fields = Fields(bytes);
    while let Some((number, value)) = fields.next()? {
        on(number, value)?;
    }
    Ok(())
}

fn want_varint(v: Value<'_>) -> Result<u64, DecodeError> {
    match v {
        Value::Varint(n) => Ok(n),
        Value::Len(_) => Err(DecodeError("a number field holds bytes")),
    }
}

fn want_len(v: Value<'_>) -> Result<&[u8], DecodeError> {
    match v {
        Value::Len(b) => Ok(b),
        Value::Varint(_) => Err(DecodeError("a bytes field holds a number")),
    }
}

fn want_u32(n: u64) -> Result<u32, DecodeError> {
    u32::try_from(n).map_err(|_| DecodeError("a uint32 field holds a larger number"))
}

/// Adds the values of one occurrence of a repeated uint32 field to `into`: packed (one
/// length-delimited run of varints, as proto3 writes it) or not (one varint), since a reader
/// must accept both.
fn repeated_u32(v: Value<'_>, into: &mut Vec<u32>) -> Result<(), DecodeError> {
    match v {
        Value::Varint(n) => into.push(want_u32(n)?),
        Value::Len(run) => {
            let mut numbers = Fields(run);
            while !numbers.0.is_empty() {
                into.push(want_u32(numbers.varint()?)?);
            }
        }
    }
    Ok(())
}

/// A Call or an Answer: its `id`, and the one member of its oneof that this build knows
/// (its field number and bytes).
struct Envelope<'a> {
    id: u64,
    member: Option<(u32, &'a [u8])>,
}

/// Reads an envelope whose oneof members are the fields `members`; the last one wins, as
/// protobuf says for a oneof seen twice, and other fields are skipped.
fn envelope<'a>(
    bytes: &'a [u8],
    members: std::ops::RangeInclusive<u32>,
) -> Result<Envelope<'a>, DecodeError> {
    let mut id = 0;
    let mut member = None;
    each_field(bytes, |number, value| {
        if number == field::ID {
            id = want_varint(value)?;
        } else if members.contains(&number) {
            member = Some((number, want_len(value)?));
        }
        Ok(())
    })?;
    Ok(Envelope { id, member })
}

/// Whether an encoded call asks the store for new work (a claim, a held duplicate's wait, a
/// caller's lookup) rather than finishing work already begun (a completion, release, renewal
/// or settle): a carrier short of room turns the former away first. Unreadable: false.
pub fn asks_for_new_work(bytes: &[u8]) -> bool {
    matches!(
        envelope(bytes, field::CLAIM..=field::LOOKUP),
        Ok(Envelope {
            member: Some((field::CLAIM | field::WAIT | field::LOOKUP, _)),
            ..
        })
    )
}

pub fn decode_call(bytes: &[u8]) -> Result<Call, DecodeError> {
    let Envelope { id, member } = envelope(bytes, field::CLAIM..=field::LOOKUP)?;
    let op = match member {
        Some((field::CLAIM, body)) => {
            let (mut key, mut fingerprint, mut lease_ms, mut owner) =
                (String::new(), String::new(), 0, String::new());
            each_field(body, |n, v| {
                match n {
                    1 => key = text(want_len(v)?)?,
                    2 => fingerprint = text(want_len(v)?)?,
                    3 => lease_ms = want_varint(v)?,
                    4 => owner = text(want_len(v)?)?,
                    _ => {}
                }
                Ok(())
            })?;
            CallOp::Claim {
                key,
                fingerprint,
                lease_ms,
                owner,
            }
        }
        Some((field::COMPLETE, body)) => {
            let (mut key, mut owner, mut ttl_ms, mut record, mut fingerprint) =
                (String::new(), String::new(), 0, Vec::new(), String::new());
            let mut tombstone_ms = 0;
            each_field(body, |n, v| {
                match n {
                    1 => key = text(want_len(v)?)?,
                    2 => owner = text(want_len(v)?)?,
                    3 => ttl_ms = want_varint(v)?,
                    4 => record = want_len(v)?.to_vec(),
                    5 => fingerprint = text(want_len(v)?)?,
                    6 => tombstone_ms = want_varint(v)?,
                    _ => {}
                }
                Ok(())
            })?;
            CallOp::Complete {
                key,
                owner,
                ttl_ms,
                record,
                fingerprint,
                tombstone_ms,
            }
        }
        Some((field::RELEASE, body)) => {
            let (mut key, mut owner) = (String::new(), String::new());
            each_field(body, |n, v| {
                match n {
                    1 => key = text(want_len(v)?)?,
                    2 => owner = text(want_len(v)?)?,
                    _ => {}
                }
                Ok(())
            })?;
            CallOp::Release { key, owner }
        }
        Some((field::WAIT, body)) => {
            let (mut key, mut fingerprint, mut wait_ms) = (String::new(), String::new(), 0);
            each_field(body, |n, v| {
                match n {
                    1 => key = text(want_len(v)?)?,
                    2 => fingerprint = text(want_len(v)?)?,
                    3 => wait_ms = want_varint(v)?,
                    _ => {}
                }
                Ok(())
            })?;
            CallOp::Wait {
                key,
                fingerprint,
                wait_ms,
            }
        }
        Some((field::RENEW, body)) => {
            let (mut lease_ms, mut leases) = (0, Vec::new());
            each_field(body, |n, v| {
                match n {
                    1 => lease_ms = want_varint(v)?,
                    2 => {
                        let (mut key, mut owner) = (String::new(), String::new());
                        each_field(want_len(v)?, |n, v| {
                            match n {
                                1 => key = text(want_len(v)?)?,
                                2 => owner = text(want_len(v)?)?,
                                _ => {}
                            }
                            Ok(())
                        })?;
                        leases.push((key, owner));
                    }
                    _ => {}
                }
                Ok(())
            })?;
            CallOp::Renew { lease_ms, leases }
        }
        Some((field::SETTLE, body)) => {
            let (mut key, mut current, mut record, mut ttl_ms, mut tombstone_ms) =
                (String::new(), Vec::new(), Vec::new(), 0, 0);
            each_field(body, |n, v| {
                match n {
                    1 => key = text(want_len(v)?)?,
                    2 => current = want_len(v)?.to_vec(),
                    3 => record = want_len(v)?.to_vec(),
                    4 => ttl_ms = want_varint(v)?,
                    5 => tombstone_ms = want_varint(v)?,
                    _ => {}
                }
                Ok(())
            })?;
            CallOp::Settle {
                key,
                current,
                record,
                ttl_ms,
                tombstone_ms,
            }
        }
        Some((field::LOOKUP, body)) => {
            let mut key = String::new();
            each_field(body, |n, v| {
                if n == 1 {
                    key = text(want_len(v)?)?;
                }
                Ok(())
            })?;
            CallOp::Lookup { key }
        }
        _ => return Err(DecodeError("a call without a known operation")),
    };
    Ok(Call { id, op })
}

pub fn decode_answer(bytes: &[u8]) -> Result<Answer, DecodeError> {
    let Envelope { id, member } = envelope(bytes, field::CLAIMED..=field::RENEWED)?;
    let reply = match member {
        Some((field::CLAIMED, body)) => {
            let (mut owner, mut lease_expires_at_ms) = (String::new(), 0);
            each_field(body, |n, v| {
                match n {
                    1 => owner = text(want_len(v)?)?,
                    2 => lease_expires_at_ms = want_varint(v)?,
                    _ => {}
                }
                Ok(())
            })?;
            Reply::Claimed {
                owner,
                lease_expires_at_ms,
            }
        }
        Some((field::IN_FLIGHT, body)) => {
            let mut retry_after_ms = 0;
            each_field(body, |n, v| {
                if n == 1 {
                    retry_after_ms = want_varint(v)?;
                }
                Ok(())
            })?;
            Reply::InFlight { retry_after_ms }
        }
        Some((field::COMPLETED, body)) => {
            let mut record = Vec::new();
            each_field(body, |n, v| {
                if n == 1 {
                    record = want_len(v)?.to_vec();
                }
                Ok(())
            })?;
            Reply::Completed { record }
        }
        Some((field::MISMATCH, _)) => Reply::Mismatch,
        Some((field::RECORDED, _)) => Reply::Recorded,
        Some((field::RELEASED, _)) => Reply::Released,
        Some((field::NOT_OWNER, _)) => Reply::NotOwner,
        Some((field::RENEWED, body)) => {
            let mut lost = Vec::new();
            each_field(body, |n, v| {
                if n == 1 {
                    repeated_u32(v, &mut lost)?;
                }
                Ok(())
            })?;
            Reply::Renewed { lost }
        }
        Some((field::FAILURE, body)) => {
            let (mut kind, mut detail) = (0, String::new());
            each_field(body, |n, v| {
                match n {
                    1 => kind = want_varint(v)?,
                    // A detail that is not UTF-8 is still a failure; keep what can be read.
                    2 => detail = String::from_utf8_lossy(want_len(v)?).into_owned(),
                    _ => {}
                }
                Ok(())
            })?;
            Reply::Failure {
                kind: FailureKind::from_number(kind),
                detail,
            }
        }
        _ => return Err(DecodeError("an answer without a known result")),
    };
    Ok(Answer { id, reply })
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    const HEX: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn calls() -> Vec<Call> {
        vec![
            Call {
                id: 1,
                op: CallOp::Claim {
                    key: HEX.into(),
                    fingerprint: HEX.to_uppercase(),
                    lease_ms: 60_000,
                    owner: String::new(),
                },
            },
            Call {
                id: u64::MAX,
                op: CallOp::Complete {
                    key: HEX.into(),
                    owner: "abc".into(),
                    ttl_ms: 86_400_000,
                    record: (0..=255).collect(),
                    fingerprint: HEX.into(),
                    tombstone_ms: 15_552_000_000,
                },
            },
            Call {
                id: 0,
                op: CallOp::Release {
                    key: String::new(),
                    owner: "ff".into(),
                },
            },
            Call {
                id: 9,
                op: CallOp::Wait {
                    key: HEX.into(),
                    fingerprint: HEX.into(),
                    wait_ms: 10_000,
                },
            },
            Call {
                id: 10,
                op: CallOp::Renew {
                    lease_ms: 30_000,
                    leases: vec![
                        (HEX.into(), "0a0b".into()),
                        (String::new(), String::new()),
                        (HEX.to_uppercase(), "ff".repeat(32)),
                    ],
                },
            },
            Call {
                id: 11,
                op: CallOp::Renew {
                    lease_ms: 0,
                    leases: Vec::new(),
                },
            },
            Call {
                id: 12,
                op: CallOp::Settle {
                    key: HEX.into(),
                    current: b"IDR1 unknown".to_vec(),
                    record: b"IDR1 took effect".to_vec(),
                    ttl_ms: 86_400_000,
                    tombstone_ms: 15_552_000_000,
                },
            },
            Call {
                id: 14,
                op: CallOp::Lookup { key: HEX.into() },
            },
            Call {
                id: 13,
                op: CallOp::Settle {
                    key: HEX.into(),
                    current: vec![0; 3],
                    record: Vec::new(),
                    ttl_ms: 0,
                    tombstone_ms: 0,
                },
            },
        ]
    }

    fn answers() -> Vec<Answer> {
        let replies = vec![
            Reply::Claimed {
                owner: "0a0b".into(),
                lease_expires_at_ms: 1_700_000_000_000,
            },
            Reply::InFlight { retry_after_ms: 0 },
            Reply::InFlight {
                retry_after_ms: 250,
            },
            Reply::Completed { record: Vec::new() },
            Reply::Completed {
                record: vec![0; 70_000],
            },
            Reply::Mismatch,
            Reply::Recorded,
            Reply::Released,
            Reply::NotOwner,
            Reply::Renewed { lost: Vec::new() },
            Reply::Renewed {
                lost: vec![0, 1, 127, 128, 1023, u32::MAX],
            },
            Reply::Failure {
                kind: FailureKind::BadRequest,
                detail: "field `key`: must be 64 hex characters".into(),
            },
            Reply::Failure {
                kind: FailureKind::Other(7),
                detail: String::new(),
            },
        ];
        replies
            .into_iter()
            .enumerate()
            .map(|(i, reply)| Answer {
                id: (i as u64) << 40 | 3,
                reply,
            })
            .collect()
    }

    #[test]
    fn the_grpc_service_names_its_cluster_and_authority() {
        // GrpcService{envoy_grpc(1): EnvoyGrpc{cluster_name(1): "c", authority(2): "a"}}
        assert_eq!(
            envoy_grpc_service("c", "a"),
            vec![0x0a, 0x06, 0x0a, 0x01, b'c', 0x12, 0x01, b'a']
        );
        let istio = "outbound|8081||idempotency-store.idempotency.svc.cluster.local";
        let bytes = envoy_grpc_service(istio, "idempotency-store");
        assert!(
            std::str::from_utf8(&bytes).is_ok(),
            "passed to the host as text"
        );
    }

    #[test]
    fn every_call_and_answer_decodes_to_what_was_encoded() {
        for call in calls() {
            assert_eq!(
                decode_call(&encode_call(&call)),
                Ok(call.clone()),
                "{call:?}"
            );
        }
        for answer in answers() {
            assert_eq!(
                decode_answer(&encode_answer(&answer)),
                Ok(answer.clone()),
                "{answer:?}"
            );
        }
    }

    #[test]
    fn unknown_fields_of_a_newer_store_are_skipped() {
        let answer = Answer {
            id: 42,
            reply: Reply::Claimed {
                owner: "ab".into(),
                lease_expires_at_ms: 9,
            },
        };
        let mut bytes = encode_answer(&answer);
        // Field 15 as a varint, field 16 as bytes, field 17 fixed64, field 18 fixed32.
        bytes.extend_from_slice(&[15 << 3, 1]);
        bytes.extend_from_slice(&[0x82, 0x01, 2, b'h', b'i']);
        bytes.extend_from_slice(&[0x89, 0x01, 1, 2, 3, 4, 5, 6, 7, 8]);
        bytes.extend_from_slice(&[0x95, 0x01, 1, 2, 3, 4]);
        assert_eq!(decode_answer(&bytes), Ok(answer));
    }

    #[test]
    fn every_truncation_of_a_message_is_an_error_or_a_shorter_message_never_a_panic() {
        for answer in answers() {
            let bytes = encode_answer(&answer);
            for cut in 0..bytes.len() {
                let _ = decode_answer(bytes.get(..cut).unwrap_or_default());
            }
            // The envelope's oneof member is cut: the message is refused, not misread.
            assert!(decode_answer(bytes.get(..bytes.len() - 1).unwrap_or_default()).is_err());
        }
    }

    #[test]
    fn malformed_bytes_are_refused_with_a_reason() {
        let cases: [(&[u8], &str); 6] = [
            (&[], "an answer without a known result"),
            (&[0x08, 0x80], "truncated varint"),
            (&[0x12, 0x05, 1], "length beyond the message"),
            (&[0x0b], "unsupported wire type"),
            (&[0x00, 0x01], "field number 0"),
            (&[0x0a, 0x00], "a number field holds bytes"),
        ];
        for (bytes, why) in cases {
            assert_eq!(decode_answer(bytes), Err(DecodeError(why)), "{bytes:?}");
        }
        let too_long = [0xff; 11];
        assert_eq!(
            Fields(&too_long).varint(),
            Err(DecodeError("varint longer than 10 bytes"))
        );
    }

    #[test]
    fn lost_leases_are_read_packed_or_not() {
        // Answer{id: 1, renewed(10): Renewed{lost(1): ...}}
        let packed = [0x08, 0x01, 0x52, 0x05, 0x0a, 0x03, 0x02, 0x80, 0x01];
        let unpacked = [0x08, 0x01, 0x52, 0x05, 0x08, 0x02, 0x08, 0x80, 0x01];
        // Both forms in one message add up, as for any repeated field.
        let mixed = [0x08, 0x01, 0x52, 0x06, 0x08, 0x02, 0x0a, 0x02, 0x80, 0x01];
        let expected = Answer {
            id: 1,
            reply: Reply::Renewed { lost: vec![2, 128] },
        };
        for bytes in [&packed[..], &unpacked[..], &mixed[..]] {
            assert_eq!(decode_answer(bytes), Ok(expected.clone()), "{bytes:?}");
        }
        assert_eq!(encode_answer(&expected), packed);
    }

    #[test]
    fn a_lost_index_beyond_uint32_or_cut_short_is_refused() {
        // lost = 2^32, unpacked and packed.
        let unpacked = [0x52, 0x06, 0x08, 0x80, 0x80, 0x80, 0x80, 0x10];
        let packed = [0x52, 0x07, 0x0a, 0x05, 0x80, 0x80, 0x80, 0x80, 0x10];
        for bytes in [&unpacked[..], &packed[..]] {
            assert_eq!(
                decode_answer(bytes),
                Err(DecodeError("a uint32 field holds a larger number"))
            );
        }
        // A packed run whose last varint is cut off.
        let cut = [0x52, 0x03, 0x0a, 0x01, 0x80];
        assert_eq!(decode_answer(&cut), Err(DecodeError("truncated varint")));
    }

    #[test]
    fn every_truncation_of_a_call_is_an_error_or_a_shorter_call_never_a_panic() {
        for call in calls() {
            let bytes = encode_call(&call);
            for cut in 0..bytes.len() {
                let _ = decode_call(bytes.get(..cut).unwrap_or_default());
            }
        }
    }

    #[test]
    fn ids_and_numbers_use_every_bit() {
        for id in [0, 1, 127, 128, 16_383, 16_384, u64::MAX >> 1, u64::MAX] {
            let answer = Answer {
                id,
                reply: Reply::InFlight { retry_after_ms: id },
            };
            assert_eq!(decode_answer(&encode_answer(&answer)), Ok(answer));
        }
    }
}

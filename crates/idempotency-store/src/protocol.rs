//! The `/v1` API as the store reads and answers it: validation of request
//! bodies into typed requests, and the answers built from storage outcomes.
//! The wire types themselves, the bounds and the names are the protocol
//! crate's (`idempotency_protocol::wire`), shared with the filter.

use serde::Deserialize;

use idempotency_protocol::wire::{decode_record, encode_record};
pub use idempotency_protocol::wire::{
    outcome, ClaimBody, ClaimResponse, CompleteBody, LeaseBody, LookupBody, OutcomeResponse,
    Problem, RecordResponse, ReleaseBody, RenewBody, RenewResponse, SettleBody, MAX_LEASE_MS,
    MAX_RENEW_LEASES, MAX_TTL_MS, MIN_LEASE_MS, MIN_TTL_MS, OWNER_HASH_HEX, PROBLEM_BAD_REQUEST,
    PROBLEM_FORBIDDEN, PROBLEM_METHOD_NOT_ALLOWED, PROBLEM_NOT_FOUND, PROBLEM_NOT_OWNER,
    PROBLEM_TOO_LARGE, PROBLEM_TOO_MANY_REQUESTS, PROBLEM_UNAUTHORIZED, PROBLEM_UNAVAILABLE,
};

use crate::storage::{
    ClaimOutcome, CompleteOutcome, Digest, Lease, OwnerToken, RecordView, ReleaseOutcome,
};

/// Why a request body was refused; becomes the problem+json `detail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRequest(pub String);

impl BadRequest {
    fn field(name: &str, why: &str) -> Self {
        Self(format!("field `{name}`: {why}"))
    }
}

// Validated requests.

#[derive(Debug, Clone)]
pub struct ClaimRequest {
    pub key: Digest,
    pub fingerprint: Digest,
    pub lease_ms: u64,
    /// The client's own token, if it sent one. A client that picks its owner
    /// before calling can release the claim even if the answer is lost.
    pub owner: Option<OwnerToken>,
}

#[derive(Debug, Clone)]
pub struct CompleteRequest {
    pub key: Digest,
    pub owner: OwnerToken,
    pub ttl_ms: u64,
    /// After `ttl_ms`, how long the record is kept without its body; 0: not at all.
    pub tombstone_ms: u64,
    pub record: Vec<u8>,
    pub fingerprint: Option<Digest>,
}

#[derive(Debug, Clone)]
pub struct ReleaseRequest {
    pub key: Digest,
    pub owner: OwnerToken,
}

/// The leases of one renew call, in the order the call named them (the answer's `lost`
/// indexes into it).
#[derive(Debug, Clone)]
pub struct RenewRequest {
    pub lease_ms: u64,
    pub leases: Vec<Lease>,
}

fn parse_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, BadRequest> {
    // serde_json's message names the missing/unknown field or the bad type
    // and its position, which is what a client needs to fix the call.
    serde_json::from_slice(body).map_err(|e| BadRequest(format!("invalid JSON body: {e}")))
}

pub fn parse_key(raw: &str) -> Result<Digest, BadRequest> {
    Digest::parse(raw).map_err(|why| BadRequest::field("key", why))
}

fn parse_owner(raw: &str) -> Result<OwnerToken, BadRequest> {
    OwnerToken::parse(raw).map_err(|why| BadRequest::field("owner", why))
}

fn check_range(name: &str, v: u64, min: u64, max: u64) -> Result<u64, BadRequest> {
    if (min..=max).contains(&v) {
        Ok(v)
    } else {
        Err(BadRequest::field(
            name,
            &format!("must be between {min} and {max}, got {v}"),
        ))
    }
}

pub fn parse_claim(body: &[u8]) -> Result<ClaimRequest, BadRequest> {
    validate_claim(parse_json(body)?)
}

/// A claim's fields, however they arrived (JSON or the gRPC stream).
pub fn validate_claim(raw: ClaimBody) -> Result<ClaimRequest, BadRequest> {
    Ok(ClaimRequest {
        key: parse_key(&raw.key)?,
        fingerprint: Digest::parse(&raw.fingerprint)
            .map_err(|why| BadRequest::field("fingerprint", why))?,
        lease_ms: check_range("lease_ms", raw.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS)?,
        owner: raw.owner.as_deref().map(parse_owner).transpose()?,
    })
}

pub fn parse_complete(body: &[u8]) -> Result<CompleteRequest, BadRequest> {
    let raw: CompleteBody = parse_json(body)?;
    let record = decode_record(&raw.record)
        .map_err(|e| BadRequest::field("record", &format!("not standard base64: {e}")))?;
    validate_complete(
        &raw.key,
        &raw.owner,
        raw.ttl_ms,
        raw.tombstone_ms,
        record,
        raw.fingerprint.as_deref(),
    )
}

/// A completion's fields with its record already as bytes (base64-decoded from JSON, or
/// as the gRPC stream carries it).
pub fn validate_complete(
    key: &str,
    owner: &str,
    ttl_ms: u64,
    tombstone_ms: u64,
    record: Vec<u8>,
    fingerprint: Option<&str>,
) -> Result<CompleteRequest, BadRequest> {
    Ok(CompleteRequest {
        key: parse_key(key)?,
        owner: parse_owner(owner)?,
        ttl_ms: check_range("ttl_ms", ttl_ms, MIN_TTL_MS, MAX_TTL_MS)?,
        tombstone_ms: check_range("tombstone_ms", tombstone_ms, 0, MAX_TTL_MS)?,
        record,
        fingerprint: fingerprint
            .map(|f| Digest::parse(f).map_err(|why| BadRequest::field("fingerprint", why)))
            .transpose()?,
    })
}

/// Who settles an unknown outcome: the filter that recorded it, or an operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settler {
    Filter,
    Operator,
}

impl Settler {
    pub fn as_str(self) -> &'static str {
        match self {
            Settler::Filter => "filter",
            Settler::Operator => "operator",
        }
    }
}

/// A settle of an unknown outcome.
#[derive(Debug, Clone)]
pub struct SettleRequest {
    pub key: Digest,
    pub current: Vec<u8>,
    pub replacement: Option<crate::storage::Replacement>,
    pub by: Settler,
}

/// `POST /v1/settle`'s body (the key in it), or, with `path_key`, the operator's
/// `POST /v1/records/{key}/settle` (the key in the path, none in the body).
pub fn parse_settle(
    body: &[u8],
    path_key: Option<&str>,
    by: Settler,
) -> Result<SettleRequest, BadRequest> {
    let raw: SettleBody = parse_json(body)?;
    let key = match (path_key, &raw.key) {
        (Some(key), None) => key,
        (None, Some(key)) => key.as_str(),
        (Some(_), Some(_)) => {
            return Err(BadRequest::field(
                "key",
                "is the path's: leave it out of the body",
            ))
        }
        (None, None) => return Err(BadRequest::field("key", "missing")),
    };
    let base64 = |field: &str, text: &str| {
        decode_record(text)
            .map_err(|e| BadRequest::field(field, &format!("not standard base64: {e}")))
    };
    let current = base64("current", &raw.current)?;
    let record = match &raw.record {
        Some(text) => base64("record", text)?,
        None => Vec::new(),
    };
    let mut settle = validate_settle(
        key,
        current,
        record,
        raw.ttl_ms.unwrap_or(0),
        raw.tombstone_ms,
    )?;
    settle.by = by;
    Ok(settle)
}

/// `record` empty frees the key; `ttl_ms` 0 keeps the current record's expiry; `tombstone_ms`
/// keeps the replacement that much longer without its body, as a completion's does.
pub fn validate_settle(
    key: &str,
    current: Vec<u8>,
    record: Vec<u8>,
    ttl_ms: u64,
    tombstone_ms: u64,
) -> Result<SettleRequest, BadRequest> {
    let key = parse_key(key)?;
    if current.is_empty() {
        return Err(BadRequest::field(
            "current",
            "must hold the record to settle",
        ));
    }
    if !idempotency_protocol::record::is_unknown_outcome(&current) {
        // Refused before the store is read, so the answer tells nothing of what it holds.
        return Err(BadRequest::field(
            "current",
            "is not the record of an unknown outcome: a settle replaces or removes only \
             those, never a recorded response",
        ));
    }
    let replacement = if record.is_empty() {
        for (name, value) in [("ttl_ms", ttl_ms), ("tombstone_ms", tombstone_ms)] {
            if value != 0 {
                return Err(BadRequest::field(name, "must be 0 when the key is freed"));
            }
        }
        None
    } else {
        let ttl_ms = match ttl_ms {
            0 => None,
            ttl => Some(check_range("ttl_ms", ttl, MIN_TTL_MS, MAX_TTL_MS)?),
        };
        Some(crate::storage::Replacement {
            record,
            ttl_ms,
            tombstone_ms: check_range("tombstone_ms", tombstone_ms, 0, MAX_TTL_MS)?,
        })
    };
    Ok(SettleRequest {
        key,
        current,
        replacement,
        by: Settler::Filter,
    })
}

pub fn parse_release(body: &[u8]) -> Result<ReleaseRequest, BadRequest> {
    let raw: ReleaseBody = parse_json(body)?;
    validate_release(&raw.key, &raw.owner)
}

/// A filter's wait for `key`'s in-flight record to end (stream only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WaitRequest {
    pub key: Digest,
    pub fingerprint: Digest,
    pub wait_ms: u64,
}

pub fn validate_wait(
    key: &str,
    fingerprint: &str,
    wait_ms: u64,
) -> Result<WaitRequest, BadRequest> {
    Ok(WaitRequest {
        key: parse_key(key)?,
        fingerprint: Digest::parse(fingerprint)
            .map_err(|why| BadRequest::field("fingerprint", why))?,
        wait_ms: check_range("wait_ms", wait_ms, 1, crate::waits::MAX_WAIT_MS)?,
    })
}

pub fn validate_release(key: &str, owner: &str) -> Result<ReleaseRequest, BadRequest> {
    Ok(ReleaseRequest {
        key: parse_key(key)?,
        owner: parse_owner(owner)?,
    })
}

pub fn parse_renew(body: &[u8]) -> Result<RenewRequest, BadRequest> {
    validate_renew(parse_json(body)?)
}

/// A renew's fields, however they arrived (JSON or the gRPC stream): the lease as a claim's,
/// 1 to [`MAX_RENEW_LEASES`] leases, each key and owner as a release's, the first fault
/// named by its place (`leases[3].owner`).
pub fn validate_renew(raw: RenewBody) -> Result<RenewRequest, BadRequest> {
    let lease_ms = check_range("lease_ms", raw.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS)?;
    if !(1..=MAX_RENEW_LEASES).contains(&raw.leases.len()) {
        return Err(BadRequest::field(
            "leases",
            &format!(
                "must hold 1 to {MAX_RENEW_LEASES} leases, got {}",
                raw.leases.len()
            ),
        ));
    }
    let leases = raw
        .leases
        .iter()
        .enumerate()
        .map(|(i, lease)| {
            Ok(Lease {
                key: Digest::parse(&lease.key)
                    .map_err(|why| BadRequest::field(&format!("leases[{i}].key"), why))?,
                owner: OwnerToken::parse(&lease.owner)
                    .map_err(|why| BadRequest::field(&format!("leases[{i}].owner"), why))?,
            })
        })
        .collect::<Result<_, BadRequest>>()?;
    Ok(RenewRequest { lease_ms, leases })
}

/// A renew call's outcome for metrics: whether it lost any of its leases.
pub fn renew_outcome_name(lost: &[u32]) -> &'static str {
    if lost.is_empty() {
        outcome::RENEWED
    } else {
        outcome::NOT_OWNER
    }
}

// Answers.

impl From<ClaimOutcome> for ClaimResponse {
    fn from(o: ClaimOutcome) -> Self {
        match o {
            ClaimOutcome::Claimed {
                owner,
                lease_expires_at_ms,
            } => Self::Claimed {
                owner: owner.as_str().to_owned(),
                lease_expires_at_ms,
            },
            ClaimOutcome::Mismatch => Self::Mismatch,
            ClaimOutcome::InFlight { retry_after_ms } => Self::InFlight { retry_after_ms },
            ClaimOutcome::Completed { record } => Self::Completed {
                record: encode_record(&record),
            },
        }
    }
}

pub fn complete_outcome_name(o: CompleteOutcome) -> &'static str {
    match o {
        CompleteOutcome::Completed => outcome::COMPLETED,
        CompleteOutcome::NotOwner => outcome::NOT_OWNER,
    }
}

pub fn release_outcome_name(o: ReleaseOutcome) -> &'static str {
    match o {
        ReleaseOutcome::Released => outcome::RELEASED,
        ReleaseOutcome::NotOwner => outcome::NOT_OWNER,
    }
}

pub fn claim_outcome_name(o: &ClaimOutcome) -> &'static str {
    match o {
        ClaimOutcome::Claimed { .. } => outcome::CLAIMED,
        ClaimOutcome::Mismatch => outcome::MISMATCH,
        ClaimOutcome::InFlight { .. } => outcome::IN_FLIGHT,
        ClaimOutcome::Completed { .. } => outcome::COMPLETED,
    }
}

/// What an operator sees of an owner token: enough to tell two claims apart, never the token
/// (with it, a reader could complete someone else's claim with bytes of its own).
pub fn owner_hash(owner: &OwnerToken) -> String {
    use sha2::{Digest as _, Sha256};
    let digest = Sha256::digest(owner.as_str().as_bytes());
    digest
        .iter()
        .take(OWNER_HASH_HEX / 2)
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl From<RecordView> for RecordResponse {
    fn from(v: RecordView) -> Self {
        Self {
            state: v.state,
            fingerprint: v.fingerprint.as_str().to_owned(),
            expires_at_ms: v.expires_at_ms,
            record: v.record.map(|r| encode_record(&r)),
            owner_hash: v.owner.as_ref().map(owner_hash),
            written_at_ms: v.written_at_ms,
            now_ms: Some(v.now_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn claim_normalises_case() {
        let body = format!(
            r#"{{"key":"{}","fingerprint":"{HEX}","lease_ms":5}}"#,
            HEX.to_uppercase()
        );
        let req = parse_claim(body.as_bytes()).unwrap();
        assert_eq!(req.key.as_str(), HEX);
    }

    #[test]
    fn claim_rejections_name_the_field() {
        let cases = [
            (
                r#"{"key":"ab","fingerprint":"x","lease_ms":5}"#.to_owned(),
                "key",
            ),
            (
                format!(r#"{{"key":"{HEX}","fingerprint":"zz","lease_ms":5}}"#),
                "fingerprint",
            ),
            (
                format!(r#"{{"key":"{HEX}","fingerprint":"{HEX}","lease_ms":0}}"#),
                "lease_ms",
            ),
            (
                format!(r#"{{"key":"{HEX}","fingerprint":"{HEX}","lease_ms":86400001}}"#),
                "lease_ms",
            ),
            (
                format!(r#"{{"key":"{HEX}","fingerprint":"{HEX}"}}"#),
                "lease_ms",
            ),
            (
                format!(r#"{{"key":"{HEX}","fingerprint":"{HEX}","lease_ms":5,"x":1}}"#),
                "x",
            ),
        ];
        for (body, field) in cases {
            let err = parse_claim(body.as_bytes()).unwrap_err();
            assert!(err.0.contains(field), "{body} -> {}", err.0);
        }
    }

    #[test]
    fn claim_owner_is_optional_validated_and_lowercased() {
        let with_owner =
            |owner: &str| format!(r#"{{"key":"{HEX}","fingerprint":"{HEX}","lease_ms":5{owner}}}"#);
        assert_eq!(parse_claim(with_owner("").as_bytes()).unwrap().owner, None);
        // An explicit null is the same as leaving the field out.
        let null = with_owner(r#","owner":null"#);
        assert_eq!(parse_claim(null.as_bytes()).unwrap().owner, None);
        let given = with_owner(r#","owner":"AbC1""#);
        assert_eq!(
            parse_claim(given.as_bytes()).unwrap().owner,
            Some(OwnerToken::parse("abc1").unwrap())
        );
        let too_long = format!(r#","owner":"{HEX}0""#);
        for bad in [r#","owner":"""#, r#","owner":"xyz""#, too_long.as_str()] {
            let body = with_owner(bad);
            let err = parse_claim(body.as_bytes()).unwrap_err();
            assert!(err.0.contains("`owner`"), "{body} -> {}", err.0);
        }
        assert!(parse_claim(with_owner(r#","owner":7"#).as_bytes()).is_err());
    }

    #[test]
    fn complete_checks_base64_and_ttl() {
        let ok = format!(r#"{{"key":"{HEX}","owner":"ab","ttl_ms":1,"record":"aGk="}}"#);
        assert_eq!(parse_complete(ok.as_bytes()).unwrap().record, b"hi");
        let bad = format!(r#"{{"key":"{HEX}","owner":"ab","ttl_ms":1,"record":"!!"}}"#);
        assert!(parse_complete(bad.as_bytes())
            .unwrap_err()
            .0
            .contains("record"));
        let ttl = format!(r#"{{"key":"{HEX}","owner":"ab","ttl_ms":31536000001,"record":""}}"#);
        assert!(parse_complete(ttl.as_bytes())
            .unwrap_err()
            .0
            .contains("ttl_ms"));
        let owner = format!(r#"{{"key":"{HEX}","owner":"","ttl_ms":1,"record":""}}"#);
        assert!(parse_complete(owner.as_bytes())
            .unwrap_err()
            .0
            .contains("owner"));
    }

    #[test]
    fn renew_rejections_name_the_field_and_the_lease() {
        let lease = |key: &str, owner: &str| format!(r#"{{"key":"{key}","owner":"{owner}"}}"#);
        let body = |lease_ms: u64, leases: &[&str]| {
            format!(
                r#"{{"lease_ms":{lease_ms},"leases":[{}]}}"#,
                leases.join(",")
            )
        };
        let good = lease(&HEX.to_uppercase(), "AB");
        let req = parse_renew(body(5, &[&good, &lease(HEX, "cd")]).as_bytes()).unwrap();
        assert_eq!(req.lease_ms, 5);
        assert_eq!(req.leases.len(), 2);
        assert_eq!(
            (req.leases[0].key.as_str(), req.leases[0].owner.as_str()),
            (HEX, "ab"),
            "normalised to lowercase"
        );
        let too_many = vec![good.as_str(); MAX_RENEW_LEASES + 1];
        assert!(parse_renew(body(5, &too_many[..MAX_RENEW_LEASES]).as_bytes()).is_ok());
        let cases = [
            (body(0, &[&good]), "field `lease_ms`"),
            (body(86_400_001, &[&good]), "field `lease_ms`"),
            (
                body(5, &[]),
                "field `leases`: must hold 1 to 1024 leases, got 0",
            ),
            (body(5, &too_many), "got 1025"),
            (
                body(5, &[&good, &lease("ab", "cd")]),
                "field `leases[1].key`",
            ),
            (
                body(5, &[&good, &good, &lease(HEX, "")]),
                "field `leases[2].owner`: must not be empty",
            ),
            (
                body(5, &[&lease(HEX, &"a".repeat(65))]),
                "field `leases[0].owner`",
            ),
            (r#"{"lease_ms":5}"#.to_owned(), "missing field `leases`"),
            (
                format!(r#"{{"lease_ms":5,"leases":[{good}],"x":1}}"#),
                "unknown field `x`",
            ),
            (
                format!(r#"{{"lease_ms":5,"leases":[{{"key":"{HEX}","owner":"ab","x":1}}]}}"#),
                "unknown field `x`",
            ),
        ];
        for (body, mentions) in cases {
            let err = parse_renew(body.as_bytes()).unwrap_err();
            assert!(err.0.contains(mentions), "{body} -> {}", err.0);
        }
    }

    #[test]
    fn an_operator_sees_a_short_hash_of_the_owner_never_the_owner() {
        let owner = OwnerToken::parse("51BD921F2E07E7FA34203537D0274365").unwrap();
        // First 16 hex digits of SHA-256 over "51bd921f2e07e7fa34203537d0274365".
        assert_eq!(owner_hash(&owner), "c4d0c028b2b3d804");
        let view = RecordView {
            state: idempotency_protocol::wire::RecordState::InFlight,
            fingerprint: Digest::parse(HEX).unwrap(),
            expires_at_ms: 2,
            record: None,
            owner: Some(owner.clone()),
            written_at_ms: Some(1),
            now_ms: 1,
        };
        let wire = serde_json::to_string(&RecordResponse::from(view)).unwrap();
        assert!(
            wire.contains(r#""owner_hash":"c4d0c028b2b3d804""#),
            "{wire}"
        );
        assert!(!wire.contains(owner.as_str()), "{wire}");
    }

    #[test]
    fn claim_response_shapes() {
        let v = serde_json::to_value(ClaimResponse::Mismatch).unwrap();
        assert_eq!(v, serde_json::json!({"outcome":"mismatch"}));
        let v = serde_json::to_value(ClaimResponse::InFlight { retry_after_ms: 3 }).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"outcome":"in_flight","retry_after_ms":3})
        );
    }
}

//! The store protocol's JSON bodies (`docs/store-protocol.md`), exactly as they travel: digests
//! and owners as hex text, records as base64. Validation of what a request carries (digest
//! and owner syntax) is the store's; these types only fix the shape both sides read and write.

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use serde::{Deserialize, Serialize};

// The store refuses a `lease_ms` or `ttl_ms` outside these; the filter refuses such a rule
// at configure rather than fail each request.
pub const MIN_LEASE_MS: u64 = 1;
/// One day: a request still in flight after that is abandoned, not slow.
pub const MAX_LEASE_MS: u64 = 86_400_000;
pub const MIN_TTL_MS: u64 = 1;
/// Most leases one renew call carries: a worker renews all its live requests in one call
/// per tick, and a bound keeps one call's work (and its answer) small.
pub const MAX_RENEW_LEASES: usize = 1024;
/// One year.
pub const MAX_TTL_MS: u64 = 31_536_000_000;

/// Where the store serves each operation: under `PREFIX` by default (the filter's
/// `store.path_prefix` may name another, for a store behind a path-routing proxy).
pub mod path {
    pub const PREFIX: &str = "/v1";
    pub const CLAIM: &str = "/claim";
    pub const COMPLETE: &str = "/complete";
    pub const RELEASE: &str = "/release";
    pub const RENEW: &str = "/renew";
    /// An unknown outcome settled by the filter that recorded it.
    pub const SETTLE: &str = "/settle";
    /// What a key holds, for a caller asking about its own (the filter's lookup route).
    pub const LOOKUP: &str = "/lookup";
    /// Followed by `/{key}`: a record's state (`GET`), or its removal (`DELETE`); alone,
    /// with `?prefix=<hex>[&limit=N]`, the keys that start with a prefix. For operators.
    pub const RECORDS: &str = "/records";
}

/// The query of a prefix search, `GET /v1/records?prefix=<hex>&limit=<n>`.
pub mod search {
    pub const PREFIX: &str = "prefix";
    pub const LIMIT: &str = "limit";
    /// Shorter prefixes would match too many records to name one.
    pub const MIN_PREFIX_HEX: usize = 8;
    /// The most keys one search answers, and the default `limit`.
    pub const MAX_LIMIT: usize = 20;
}

/// The `outcome` values of 200 answers (and of the 409 problem on complete/release).
pub mod outcome {
    pub const CLAIMED: &str = "claimed";
    pub const IN_FLIGHT: &str = "in_flight";
    pub const COMPLETED: &str = "completed";
    pub const MISMATCH: &str = "mismatch";
    pub const RELEASED: &str = "released";
    pub const NOT_OWNER: &str = "not_owner";
    /// A renew call that reached every backend it asked; its `lost` names the leases that
    /// were not the caller's any more.
    pub const RENEWED: &str = "renewed";
    /// A purge that removed a record.
    pub const PURGED: &str = "purged";
    /// A settle that replaced an unknown outcome's record.
    pub const REPLACED: &str = "replaced";
    /// A settle that removed one: the key is free.
    pub const REMOVED: &str = "removed";
}

/// Problem `type` URIs of error answers.
pub const PROBLEM_BAD_REQUEST: &str = "urn:idempotency-store:bad-request";
pub const PROBLEM_UNAUTHORIZED: &str = "urn:idempotency-store:unauthorized";
/// The other kind of token (data plane or operator) than the route takes, or a route that is
/// disabled; `detail` says which.
pub const PROBLEM_FORBIDDEN: &str = "urn:idempotency-store:forbidden";
pub const PROBLEM_TOO_LARGE: &str = "urn:idempotency-store:payload-too-large";
pub const PROBLEM_NOT_FOUND: &str = "urn:idempotency-store:not-found";
pub const PROBLEM_NOT_OWNER: &str = "urn:idempotency-store:not-owner";
/// A prefix search while another runs on the same store instance; `Retry-After` says when.
pub const PROBLEM_TOO_MANY_REQUESTS: &str = "urn:idempotency-store:too-many-requests";
pub const PROBLEM_METHOD_NOT_ALLOWED: &str = "urn:idempotency-store:method-not-allowed";
pub const PROBLEM_UNAVAILABLE: &str = "urn:idempotency-store:backend-unavailable";

/// A record's bytes on the wire: standard base64 with padding.
pub fn encode_record(bytes: &[u8]) -> String {
    BASE64.encode(bytes)
}

pub fn decode_record(text: &str) -> Result<Vec<u8>, base64::DecodeError> {
    BASE64.decode(text.as_bytes())
}

// Unknown fields are refused so that a typo such as `lease` for `lease_ms` is an error rather
// than a silently ignored option.

/// `POST /v1/claim`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClaimBody {
    pub key: String,
    pub fingerprint: String,
    pub lease_ms: u64,
    /// Chosen by the client so that it can release a claim whose answer it never received;
    /// absent → the store generates one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// `POST /v1/complete`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompleteBody {
    pub key: String,
    pub owner: String,
    pub ttl_ms: u64,
    /// See [`encode_record`].
    pub record: String,
    /// The claim's fingerprint: with it, a key whose claim has lapsed and gone is recorded
    /// rather than refused (see [`crate::decision::CompleteDecision::RecordAfresh`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// After `ttl_ms`, how long the record is kept without its body (a tombstone); absent
    /// or 0: not at all. Left out when 0, so a store older than tombstones takes the call.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tombstone_ms: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// `POST /v1/release`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseBody {
    pub key: String,
    pub owner: String,
}

/// `POST /v1/settle` (the filter) and `POST /v1/records/{key}/settle` (an operator, whose
/// path names the key): only while the key's completed record holds exactly `current`, it
/// becomes `record` (kept `ttl_ms` from now; absent or 0: as long as `current` would have
/// been; then `tombstone_ms` more without its body), or, without `record`, is removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SettleBody {
    /// Absent in the operator's form, whose path names the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// See [`encode_record`].
    pub current: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// As a completion's: after the replacement's TTL, how long it is kept without its body
    /// (absent or 0: not at all). Left out when 0, so a store older than it takes the call.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tombstone_ms: u64,
}

/// `POST /v1/lookup`: what `key` holds, changing nothing. Answered as
/// `GET /v1/records/{key}` is ([`RecordResponse`], or 404).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LookupBody {
    pub key: String,
}

/// One claim whose lease a renew keeps alive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseBody {
    pub key: String,
    pub owner: String,
}

/// `POST /v1/renew`: every lease gets `lease_ms` more from now (never less than it has).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenewBody {
    pub lease_ms: u64,
    /// 1 to [`MAX_RENEW_LEASES`].
    pub leases: Vec<LeaseBody>,
}

impl RenewBody {
    /// A renew of `leases`, each a (key, owner) pair in hex as the stream carries them.
    pub fn of(lease_ms: u64, leases: &[(String, String)]) -> Self {
        Self {
            lease_ms,
            leases: leases
                .iter()
                .map(|(key, owner)| LeaseBody {
                    key: key.clone(),
                    owner: owner.clone(),
                })
                .collect(),
        }
    }
}

/// The 200 answer to a renew: `{"outcome":"renewed","lost":[..]}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenewResponse {
    /// [`outcome::RENEWED`].
    pub outcome: String,
    /// The 0-based indexes (into the call's `leases`) of the leases that were not renewed
    /// because they are not the caller's any more: taken over, completed, released or gone.
    #[serde(default)]
    pub lost: Vec<u32>,
}

impl RenewResponse {
    pub fn renewed(lost: Vec<u32>) -> Self {
        Self {
            outcome: outcome::RENEWED.to_owned(),
            lost,
        }
    }
}

/// The 200 answer to a claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ClaimResponse {
    Claimed {
        owner: String,
        // The store always sends the times; a reader that does not act on them (the filter)
        // does not insist on them.
        #[serde(default)]
        lease_expires_at_ms: u64,
    },
    Mismatch,
    InFlight {
        #[serde(default)]
        retry_after_ms: u64,
    },
    Completed {
        /// The bytes given at complete, see [`encode_record`].
        record: String,
    },
}

/// The 200 answer to a complete or release: `{"outcome":"completed"}` or
/// `{"outcome":"released"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutcomeResponse {
    pub outcome: String,
}

impl OutcomeResponse {
    pub fn new(outcome: &str) -> Self {
        Self {
            outcome: outcome.to_owned(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordState {
    InFlight,
    Completed,
}

/// Hex digits of an in-flight record's `owner_hash` (64 bits of the digest).
pub const OWNER_HASH_HEX: usize = 16;

/// The 200 answer to `GET /v1/records/{key}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordResponse {
    pub state: RecordState,
    pub fingerprint: String,
    pub expires_at_ms: u64,
    /// Present only for completed records.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<String>,
    /// Present only for in-flight records: the first [`OWNER_HASH_HEX`] hex digits of SHA-256
    /// over the claimant's owner token (its lowercase hex text). It tells claims apart; unlike
    /// the token itself, it does not let whoever reads it complete or release the claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_hash: Option<String>,
    /// When the record was claimed (in flight) or completed; absent for a record written
    /// before the store kept that time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_at_ms: Option<u64>,
    /// The store's clock (for Redis, the Redis server's) when it read the record: ages and
    /// time left are differences from this. Optional only to read older stores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub now_ms: Option<u64>,
}

/// The 200 answer to `GET /v1/records?prefix=<hex>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SearchResponse {
    /// Keys (64 hex) of live records that start with the prefix, in order, at most `limit`.
    pub keys: Vec<String>,
    /// More records match than `keys` holds.
    pub truncated: bool,
    /// The search was not cut short by its bounds: unless `truncated`, `keys` are all the
    /// matches. False means others may exist (a Redis keyspace too large to walk at once).
    pub exhaustive: bool,
}

/// The 200 answer to `DELETE /v1/records/{key}`: the record that was removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PurgeResponse {
    /// [`outcome::PURGED`].
    pub outcome: String,
    pub purged: RecordResponse,
}

/// RFC 9457 problem details. `outcome` is set only on 409 not_owner so that a client can
/// branch on the same field it reads from 200 answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use serde_json::json;

    #[test]
    fn claim_answers_carry_the_outcome_names() {
        let answers = [
            (
                ClaimResponse::Claimed {
                    owner: "ab".into(),
                    lease_expires_at_ms: 9,
                },
                json!({"outcome": outcome::CLAIMED, "owner": "ab", "lease_expires_at_ms": 9}),
            ),
            (
                ClaimResponse::InFlight { retry_after_ms: 3 },
                json!({"outcome": outcome::IN_FLIGHT, "retry_after_ms": 3}),
            ),
            (
                ClaimResponse::Completed {
                    record: "aGk=".into(),
                },
                json!({"outcome": outcome::COMPLETED, "record": "aGk="}),
            ),
            (
                ClaimResponse::Mismatch,
                json!({"outcome": outcome::MISMATCH}),
            ),
        ];
        for (answer, wire) in answers {
            assert_eq!(serde_json::to_value(&answer).unwrap(), wire);
            assert_eq!(
                serde_json::from_value::<ClaimResponse>(wire).unwrap(),
                answer
            );
        }
    }

    #[test]
    fn optional_request_fields_are_left_out_and_unknown_ones_refused() {
        let claim = ClaimBody {
            key: "k".into(),
            fingerprint: "f".into(),
            lease_ms: 5,
            owner: None,
        };
        assert_eq!(
            serde_json::to_value(&claim).unwrap(),
            json!({"key": "k", "fingerprint": "f", "lease_ms": 5})
        );
        let typo = json!({"key": "k", "fingerprint": "f", "lease": 5});
        assert!(serde_json::from_value::<ClaimBody>(typo).is_err());
        let complete = json!({"key": "k", "owner": "o", "ttl_ms": 1, "record": ""});
        let parsed: CompleteBody = serde_json::from_value(complete).unwrap();
        assert_eq!(parsed.fingerprint, None);
        let settle = SettleBody {
            key: Some("k".into()),
            current: "c".into(),
            record: None,
            ttl_ms: None,
            tombstone_ms: 0,
        };
        let without_tombstone = json!({"key": "k", "current": "c"});
        assert_eq!(serde_json::to_value(&settle).unwrap(), without_tombstone);
        assert_eq!(
            serde_json::from_value::<SettleBody>(without_tombstone).unwrap(),
            settle
        );
        let kept = SettleBody {
            tombstone_ms: 7,
            ..settle
        };
        assert_eq!(serde_json::to_value(&kept).unwrap()["tombstone_ms"], 7);
    }

    #[test]
    fn renew_bodies_and_answers_have_the_documented_shape() {
        let body = RenewBody {
            lease_ms: 30_000,
            leases: vec![LeaseBody {
                key: "k".into(),
                owner: "o".into(),
            }],
        };
        let wire = json!({"lease_ms": 30_000, "leases": [{"key": "k", "owner": "o"}]});
        assert_eq!(serde_json::to_value(&body).unwrap(), wire);
        assert_eq!(serde_json::from_value::<RenewBody>(wire).unwrap(), body);
        let typo = json!({"lease_ms": 1, "leases": [{"key": "k", "owner": "o", "ownr": "o"}]});
        assert!(serde_json::from_value::<RenewBody>(typo).is_err());
        assert_eq!(
            serde_json::to_value(RenewResponse::renewed(vec![0, 3])).unwrap(),
            json!({"outcome": outcome::RENEWED, "lost": [0, 3]})
        );
    }

    #[test]
    fn records_are_standard_padded_base64() {
        assert_eq!(encode_record(b"hi"), "aGk=");
        assert_eq!(decode_record("aGk=").unwrap(), b"hi");
        assert!(decode_record("!!").is_err());
    }

    #[test]
    fn problems_name_their_type_field_type() {
        let p = Problem {
            kind: PROBLEM_NOT_OWNER.into(),
            title: "Not the owner".into(),
            status: 409,
            detail: "d".into(),
            outcome: Some(outcome::NOT_OWNER.into()),
        };
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["type"], PROBLEM_NOT_OWNER);
        assert_eq!(v["outcome"], "not_owner");
    }
}

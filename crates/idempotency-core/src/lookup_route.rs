//! A rule's lookup route (`lookup`): a caller asks what the filter holds for its own key,
//! with a `GET` of the route's path carrying the key and the scope headers as its writes do.
//! The answer is the key's state (completed with its recorded status, in flight, unknown and
//! whether a resolution is pending, or none), never an execution. The storage key is derived
//! as for a write (rule, scope, key), so a caller only ever sees its own scope's records, and
//! only for a key it already knows.
//!
//! [`LookupRoute`](crate::config::lookup_route::LookupRoute) is what a rule configures; this
//! module turns what was found into the answer.

use idempotency_protocol::stream::Reply;
use idempotency_protocol::wire::{decode_record, RecordResponse, RecordState};
use serde_json::{json, Map, Value};

use crate::store::client::{read_claim_reply, StoreClaim, StoreFailure};
use idempotency_protocol::record::{key_expires_value, RecordedResponse, KEY_EXPIRES_HEADER};

/// What the filter holds for a key, locally or in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    None,
    InFlight {
        retry_after_ms: u64,
    },
    /// A completed record (or an unknown outcome), and when it expires if known.
    Completed {
        response: Box<RecordedResponse>,
        expires_at_ms: Option<u64>,
    },
}

/// A store's answer to a lookup on its stream.
pub fn found_in_reply(answer: Result<Reply, StoreFailure>) -> Result<Found, StoreFailure> {
    match answer? {
        Reply::Released => Ok(Found::None),
        Reply::InFlight { retry_after_ms } => Ok(Found::InFlight { retry_after_ms }),
        other => match read_claim_reply(other)? {
            StoreClaim::Completed(response) => Ok(Found::Completed {
                response: Box::new(response),
                expires_at_ms: None,
            }),
            _ => Err(StoreFailure::Garbage(
                "store answered a lookup with a claim's outcome".to_string(),
            )),
        },
    }
}

/// A store's answer to a lookup over its HTTP API (`POST /v1/lookup`).
pub fn found_in_http(status: Option<u16>, body: &[u8]) -> Result<Found, StoreFailure> {
    match status {
        Some(404) => return Ok(Found::None),
        Some(200) => {}
        Some(s) if s >= 500 => return Err(StoreFailure::ServerError(s)),
        Some(s) => return Err(StoreFailure::Refused(s)),
        None => return Err(StoreFailure::NoAnswer),
    }
    let view: RecordResponse = serde_json::from_slice(body)
        .map_err(|e| StoreFailure::Garbage(format!("store lookup answer unreadable: {e}")))?;
    match (view.state, view.record) {
        (RecordState::Completed, Some(text)) => {
            let bytes = decode_record(&text)
                .map_err(|e| StoreFailure::Garbage(format!("store record is not base64: {e}")))?;
            found_in_reply(Ok(Reply::Completed { record: bytes }))
        }
        _ => Ok(Found::InFlight {
            retry_after_ms: view
                .expires_at_ms
                .saturating_sub(view.now_ms.unwrap_or(view.expires_at_ms))
                .max(1),
        }),
    }
}

/// The answer's status and JSON body: 200 for a record in any state, 404 for none.
pub fn answer(found: &Found, include_response: bool, now_ms: u64) -> (u16, Vec<u8>) {
    let (status, body) = match found {
        Found::None => (404, json!({"state": "none"})),
        Found::InFlight { retry_after_ms } => (
            200,
            json!({"state": "in_flight", "retry_after_seconds": retry_after_ms.div_ceil(1000).max(1)}),
        ),
        Found::Completed {
            response,
            expires_at_ms,
        } => (
            200,
            completed(response, *expires_at_ms, include_response, now_ms),
        ),
    };
    (status, serde_json::to_vec(&body).unwrap_or_default())
}

/// Until when a completed record is kept: from the table when it knows (single-proxy mode),
/// else as the record says (the `idempotency-key-expires` it recorded: the store's answer
/// carries only the record). An unknown outcome's answer says when to ask again instead,
/// in both modes alike.
fn expires_of(response: &RecordedResponse, expires_at_ms: Option<u64>) -> Option<String> {
    if response.unknown.is_some() {
        return None;
    }
    if let Some(at) = expires_at_ms {
        return Some(key_expires_value(at));
    }
    response
        .headers
        .iter()
        .find(|(name, _)| name == KEY_EXPIRES_HEADER)
        .and_then(|(_, value)| String::from_utf8(value.clone()).ok())
}

fn completed(
    response: &RecordedResponse,
    expires_at_ms: Option<u64>,
    include_response: bool,
    now_ms: u64,
) -> Value {
    let mut body = Map::new();
    match &response.unknown {
        Some(unknown) => {
            body.insert("state".into(), json!("unknown"));
            match unknown.resolution_due_ms {
                Some(due) => {
                    body.insert("resolution".into(), json!("pending"));
                    let wait = due.saturating_sub(now_ms).div_ceil(1000).max(1);
                    body.insert("retry_after_seconds".into(), json!(wait));
                }
                None => {
                    body.insert("resolution".into(), json!("none"));
                }
            }
        }
        None => {
            body.insert("state".into(), json!("completed"));
            body.insert("status".into(), json!(response.status));
        }
    }
    if let Some(expires) = expires_of(response, expires_at_ms) {
        body.insert("expires".into(), json!(expires));
    }
    if include_response && response.unknown.is_none() {
        let headers: Vec<Value> = response
            .headers
            .iter()
            .map(|(n, v)| json!([n, String::from_utf8_lossy(v)]))
            .collect();
        let shown = match std::str::from_utf8(&response.body) {
            Ok(text) => {
                json!({"headers": headers, "body": text, "body_omitted": response.body_omitted})
            }
            Err(_) => json!({
                "headers": headers,
                "body_base64": idempotency_protocol::wire::encode_record(&response.body),
                "body_omitted": response.body_omitted,
            }),
        };
        body.insert("response".into(), shown);
    }
    Value::Object(body)
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;
    use idempotency_protocol::record::UnknownOutcome;

    fn parsed(found: &Found, include: bool) -> (u16, Value) {
        let (status, body) = answer(found, include, 1_700_000_000_000);
        (status, serde_json::from_slice(&body).unwrap())
    }

    #[test]
    fn each_state_is_said_plainly_and_the_response_only_when_asked() {
        assert_eq!(parsed(&Found::None, false), (404, json!({"state": "none"})));
        assert_eq!(
            parsed(
                &Found::InFlight {
                    retry_after_ms: 1_500
                },
                false
            )
            .1,
            json!({"state": "in_flight", "retry_after_seconds": 2})
        );
        let done = Found::Completed {
            response: Box::new(RecordedResponse {
                status: 201,
                headers: vec![("content-type".into(), b"application/json".to_vec())],
                body: br#"{"id":1}"#.to_vec(),
                ..RecordedResponse::default()
            }),
            expires_at_ms: Some(1_700_003_600_000),
        };
        let (status, body) = parsed(&done, false);
        assert_eq!(status, 200);
        assert_eq!(body["state"], "completed");
        assert_eq!(body["status"], 201);
        assert_eq!(body["expires"], "Tue, 14 Nov 2023 23:13:20 GMT");
        assert!(body.get("response").is_none());
        let (_, body) = parsed(&done, true);
        assert_eq!(body["response"]["body"], r#"{"id":1}"#);
        assert_eq!(
            body["response"]["headers"][0],
            json!(["content-type", "application/json"])
        );
        let pending = Found::Completed {
            response: Box::new(RecordedResponse::unknown_outcome(UnknownOutcome {
                resolution_due_ms: Some(1_700_000_004_000),
                ..UnknownOutcome::default()
            })),
            expires_at_ms: None,
        };
        assert_eq!(
            parsed(&pending, true).1,
            json!({"state": "unknown", "resolution": "pending", "retry_after_seconds": 4})
        );
    }

    /// The store answers a lookup with the record alone: a completed record's `expires` is
    /// the one it recorded; an unknown outcome's answer has none, whatever the mode.
    #[test]
    fn every_completed_record_says_until_when_and_no_unknown_outcome_does() {
        let expires = "Tue, 14 Nov 2023 23:13:20 GMT";
        let from_store = Found::Completed {
            response: Box::new(RecordedResponse {
                status: 200,
                headers: vec![(KEY_EXPIRES_HEADER.into(), expires.as_bytes().to_vec())],
                ..RecordedResponse::default()
            }),
            expires_at_ms: None,
        };
        assert_eq!(
            parsed(&from_store, false).1,
            json!({"state": "completed", "status": 200, "expires": expires})
        );
        let local_unknown = Found::Completed {
            response: Box::new(RecordedResponse::unknown_outcome(UnknownOutcome::default())),
            expires_at_ms: Some(1_700_003_600_000),
        };
        assert_eq!(
            parsed(&local_unknown, false).1,
            json!({"state": "unknown", "resolution": "none"})
        );
    }
}

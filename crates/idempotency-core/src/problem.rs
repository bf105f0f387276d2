//! Every answer the filter gives itself: RFC 9457 problem details with a stable `type`.

use serde::Serialize;

/// Base of the problem type URIs; `docs/problems.md` documents each one.
pub const PROBLEM_TYPE_BASE: &str = "urn:idempotency-filter:problem:";

/// A local reply: status, extra headers and an `application/problem+json` body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub status: u16,
    pub kind: &'static str,
    pub title: &'static str,
    pub detail: String,
    /// Seconds for `Retry-After`, when a retry can help.
    pub retry_after_seconds: Option<u64>,
}

#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
    rule: &'a str,
}

impl Problem {
    /// `source` names where the key was expected, e.g. "header 'idempotency-key'".
    pub fn missing_key(source: &str) -> Problem {
        Problem {
            status: 400,
            kind: "missing-key",
            title: "Idempotency key is missing",
            detail: format!(
                "This endpoint requires an idempotency key in the {source}: send a unique \
                 value (a UUID) and send the same value again when you retry."
            ),
            retry_after_seconds: None,
        }
    }

    pub fn invalid_key(source: &str, why: &str) -> Problem {
        Problem {
            status: 400,
            kind: "invalid-key",
            title: "Idempotency key is invalid",
            detail: format!(
                "The {source} is not a valid idempotency key: {why}. Use 1 to 255 visible \
                 ASCII characters (in a header, bare or as a quoted string)."
            ),
            retry_after_seconds: None,
        }
    }

    /// A rule that resolves unknown outcomes looks the write up at the service, should its
    /// answer be lost, by a path built from the request; `what` (the key's source, or a
    /// header) cannot go into that lookup, for `why`. Refused before the write runs: later,
    /// a lookup that cannot name the write could only be misread.
    pub fn unfit_for_lookup(what: &str, why: &str) -> Problem {
        Problem {
            status: 400,
            kind: "unfit-for-lookup",
            title: "The request could not be looked up at the service",
            detail: format!(
                "Should this endpoint lose a write's answer, it asks the service whether the \
                 write took effect, by a lookup made of the request's values; the {what} {why}. \
                 It was not executed: send it with another value (a UUID as the key, say)."
            ),
            retry_after_seconds: None,
        }
    }

    /// `header` is the scope header the request lacks. No `WWW-Authenticate` challenge: the
    /// filter does not know the scheme; the authentication in front of it does.
    pub fn missing_scope(header: &str) -> Problem {
        Problem {
            status: 401,
            kind: "missing-scope",
            title: "The caller is not identified",
            detail: format!(
                "This endpoint keeps idempotency keys per caller and the request has no \
                 '{header}' header to tell who is calling, so it was not executed. \
                 Authenticate and send the request again with the same key."
            ),
            retry_after_seconds: None,
        }
    }

    pub fn request_too_large(limit: usize) -> Problem {
        Problem {
            status: 400,
            kind: "body-too-large",
            title: "Request body too large for an idempotent request",
            detail: format!(
                "The body is larger than the {limit} bytes this endpoint buffers to read the \
                 idempotency key or fingerprint the payload. Send a smaller body."
            ),
            retry_after_seconds: None,
        }
    }

    pub fn in_flight() -> Problem {
        Problem {
            status: 409,
            kind: "request-in-flight",
            title: "A request with this idempotency key is still in progress",
            detail: "The first request with this key has not finished yet. Retry after the \
                     Retry-After delay to receive its result."
                .to_string(),
            // Not the lease's remainder: the first attempt usually finishes within a second,
            // and the lease only bounds how long a crashed attempt blocks the key.
            retry_after_seconds: Some(1),
        }
    }

    /// A held duplicate whose first request did not complete: its claim was released (the
    /// upstream failed or refused it) or lapsed. This request was not executed; a retry is.
    pub fn first_attempt_released() -> Problem {
        Problem {
            status: 503,
            kind: "first-attempt-released",
            title: "The first request with this idempotency key did not complete",
            detail: "This request waited for the first request with the same key, which failed \
                     or was abandoned without a result to share. This request was not executed: \
                     retry it with the same key after the Retry-After delay."
                .to_string(),
            retry_after_seconds: Some(1),
        }
    }

    /// The first request with this key reached the upstream (or may have) and ended without
    /// its answer: a timeout, a reset, or a client that left. 409, like a request in flight,
    /// because the key is bound to a request whose end is not known; without Retry-After,
    /// because waiting will not change it. Not a 5xx: gateways and SDKs resend those on
    /// their own, and nothing failed that a resend could fix.
    pub fn outcome_unknown() -> Problem {
        Problem {
            status: 409,
            kind: "outcome-unknown",
            title: "The first request with this idempotency key may have completed",
            detail: "The first request with this key reached the service, but no answer came back \
                     (a timeout, a dropped connection, or a client that left). It may have been \
                     carried out, so it will not be run again under this key. Check with the \
                     service whether it took effect (look the resource up) before sending it \
                     again under a new key."
                .to_string(),
            retry_after_seconds: None,
        }
    }

    /// An unknown outcome the filter is resolving by asking the service (`resolve`): still
    /// 409 `outcome-unknown`, but it clears, so Retry-After says when the answer is due.
    pub fn outcome_being_resolved(retry_after_seconds: u64) -> Problem {
        Problem {
            detail: "The first request with this key reached the service, but no answer came back \
                     (a timeout, a dropped connection, or a client that left). It will not be run \
                     again under this key: the proxy is asking the service whether it took \
                     effect. Retry with the same key after Retry-After: you will get its result, \
                     or, if it never ran, it will run then."
                .to_string(),
            retry_after_seconds: Some(retry_after_seconds.max(1)),
            ..Problem::outcome_unknown()
        }
    }

    pub fn key_reused(source: &str) -> Problem {
        Problem {
            status: 422,
            kind: "key-reused",
            title: "Idempotency key was used with a different request",
            detail: format!(
                "The key from the {source} was already used with a different method, path or body. \
                 Use a new key for a new request; a retry must repeat the original request exactly."
            ),
            retry_after_seconds: None,
        }
    }

    pub fn table_full() -> Problem {
        Problem {
            status: 503,
            kind: "capacity-exhausted",
            title: "Idempotency records are at capacity",
            detail: "The proxy cannot record another idempotency key right now, so the request \
                     was not executed. Retry later."
                .to_string(),
            retry_after_seconds: Some(1),
        }
    }

    /// A detached rule sends the request itself, and the ABI carries header values as text.
    pub fn unforwardable_header(name: &str) -> Problem {
        Problem {
            status: 400,
            kind: "header-not-forwardable",
            title: "A request header cannot be forwarded",
            detail: format!(
                "This endpoint's writes are sent on by the proxy itself, which forwards header \
                 values as UTF-8 text; the '{name}' header is not. It was not executed."
            ),
            retry_after_seconds: None,
        }
    }

    pub fn unavailable(what: &str) -> Problem {
        Problem {
            status: 503,
            kind: "idempotency-unavailable",
            title: "Idempotency protection is unavailable",
            detail: format!("The request was not executed because {what}. Retry later."),
            retry_after_seconds: Some(1),
        }
    }

    /// A gRPC call's body is not gRPC's framing (a length-prefixed message).
    pub fn malformed_grpc() -> Problem {
        Problem {
            status: 400,
            kind: "grpc-malformed",
            title: "The request is not a gRPC message",
            detail: "The body of this gRPC call is not length-prefixed messages, so it was not \
                     executed. Send it with a gRPC client."
                .to_string(),
            retry_after_seconds: None,
        }
    }

    /// A gRPC call that sent its key's `metadata` and a second request message: the filter
    /// protects calls with one request message only, and a unary method would run on the
    /// first of several (grpcio does), again under a recorded key.
    pub fn key_on_stream(metadata: &str) -> Problem {
        Problem {
            status: 400,
            kind: "grpc-key-on-stream",
            title: "Idempotency key on a call with several request messages",
            detail: format!(
                "Only calls with one request message (unary and server-streaming) are \
                 protected, and this call sent the '{metadata}' metadata and a second \
                 message, so none of it was sent to the service. Send the key on unary \
                 and server-streaming calls only."
            ),
            retry_after_seconds: None,
        }
    }

    /// The first call with this key completed, and its response is not kept (larger than the
    /// rule records, or its copy in the local table reused): it is not run again, and there
    /// is no message to replay.
    pub fn response_not_kept() -> Problem {
        Problem {
            status: 409,
            kind: "response-not-kept",
            title:
                "The first request with this idempotency key completed; its response was not kept",
            detail: "The first request with this key was carried out, but its response is not \
                     kept (larger than this endpoint records, or no longer in the proxy's table), \
                     so it cannot be sent again. It will not be run again under this key: look \
                     the result up with the service."
                .to_string(),
            retry_after_seconds: None,
        }
    }

    pub fn type_uri(&self) -> String {
        format!("{PROBLEM_TYPE_BASE}{}", self.kind)
    }

    /// The JSON body, naming the rule that answered.
    pub fn body(&self, rule: &str) -> Vec<u8> {
        serde_json::to_vec(&Body {
            kind: self.type_uri(),
            title: self.title,
            status: self.status,
            detail: &self.detail,
            rule,
        })
        .unwrap_or_default()
    }

    /// Headers of the local reply (content-type first).
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = vec![("content-type", "application/problem+json".to_string())];
        if let Some(s) = self.retry_after_seconds {
            h.push(("retry-after", s.to_string()));
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn bodies_are_problem_json_with_stable_types() {
        let p = Problem::key_reused("header 'idempotency-key'");
        let v: serde_json::Value = serde_json::from_slice(&p.body("orders")).unwrap();
        assert_eq!(v["type"], "urn:idempotency-filter:problem:key-reused");
        assert_eq!(v["status"], 422);
        assert_eq!(v["rule"], "orders");
        assert!(v["detail"].as_str().unwrap().contains("idempotency-key"));
        assert_eq!(
            p.headers(),
            vec![("content-type", "application/problem+json".to_string())]
        );
    }

    #[test]
    fn an_unidentified_caller_gets_401_naming_the_header() {
        let p = Problem::missing_scope("authorization");
        let v: serde_json::Value = serde_json::from_slice(&p.body("orders")).unwrap();
        assert_eq!(v["type"], "urn:idempotency-filter:problem:missing-scope");
        assert_eq!(v["status"], 401);
        assert!(v["detail"].as_str().unwrap().contains("'authorization'"));
    }

    #[test]
    fn an_unknown_outcome_is_a_409_without_retry_after() {
        let p = Problem::outcome_unknown();
        let v: serde_json::Value = serde_json::from_slice(&p.body("payments")).unwrap();
        assert_eq!(v["type"], "urn:idempotency-filter:problem:outcome-unknown");
        assert_eq!(v["status"], 409);
        assert!(v["detail"]
            .as_str()
            .unwrap()
            .contains("may have been carried out"));
        assert!(!p.headers().iter().any(|(n, _)| *n == "retry-after"));
    }

    #[test]
    fn conflicts_carry_retry_after() {
        let p = Problem::in_flight();
        assert_eq!(p.status, 409);
        assert!(p.headers().contains(&("retry-after", "1".to_string())));
        let p = Problem::invalid_key("header 'idempotency-key'", "the key is 300 bytes long");
        assert!(p.detail.contains("300 bytes") && p.detail.contains("header 'idempotency-key'"));
    }
}

//! The filter's own answers to a gRPC call: the problem an HTTP client would get, as a
//! trailers-only gRPC status whose `grpc-message` says what the problem's detail says.

use std::fmt::Write as _;

use super::status;
use crate::problem::Problem;

/// Metadata naming the problem type, so a client can tell apart answers that share a code.
pub const PROBLEM_TYPE_METADATA: &str = "idempotency-problem-type";

/// The status code of each problem.
///
/// - A duplicate while the first call runs is `ABORTED`, gRPC's code for a concurrency
///   conflict (HTTP's 409), with `grpc-retry-pushback-ms`: a client's retry policy that lists
///   `ABORTED` waits that long. Not `UNAVAILABLE`: clients and meshes retry that on their
///   own, without backoff from the filter, and it would read like the store being down.
/// - A first attempt whose outcome is unknown, or whose response was too large to record,
///   is `FAILED_PRECONDITION`: no retry under this key will change it; the caller checks
///   whether the write took effect.
/// - A key reused with another message, a missing or malformed key, or a key on a call with
///   several request messages is `INVALID_ARGUMENT`: the call itself is wrong.
/// - No trust in the caller's identity is `UNAUTHENTICATED`; a message too large to buffer is
///   `RESOURCE_EXHAUSTED`, as gRPC's own size limits are.
/// - Anything the filter could not do (store unreachable, table full, a first attempt that
///   was released) is `UNAVAILABLE` with pushback: nothing ran, and a retry may succeed.
pub fn code_of(problem: &Problem) -> u32 {
    match problem.kind {
        "request-in-flight" => status::ABORTED,
        "outcome-unknown" | "response-not-kept" => status::FAILED_PRECONDITION,
        "missing-key"
        | "invalid-key"
        | "key-reused"
        | "header-not-forwardable"
        | "grpc-malformed"
        | "grpc-key-on-stream"
        | "unfit-for-lookup" => status::INVALID_ARGUMENT,
        "missing-scope" => status::UNAUTHENTICATED,
        "body-too-large" => status::RESOURCE_EXHAUSTED,
        _ => status::UNAVAILABLE,
    }
}

/// The headers of the trailers-only answer (a local reply with no body: Envoy keeps them,
/// status 200 and `content-type: application/grpc` included).
pub fn trailers_only(problem: &Problem) -> Vec<(&'static str, String)> {
    let mut h = vec![
        ("content-type", "application/grpc".to_string()),
        ("grpc-status", code_of(problem).to_string()),
        (
            "grpc-message",
            percent_encode(&format!("{}: {}", problem.title, problem.detail)),
        ),
        (PROBLEM_TYPE_METADATA, problem.type_uri()),
    ];
    if let Some(s) = problem.retry_after_seconds {
        h.push(("grpc-retry-pushback-ms", s.saturating_mul(1000).to_string()));
    }
    h
}

/// `grpc-message` is percent-encoded UTF-8: every byte outside printable ASCII, and `%`.
pub fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn value<'a>(h: &'a [(&'static str, String)], name: &str) -> Option<&'a str> {
        h.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }

    #[test]
    fn each_problem_has_its_code_and_retryable_ones_push_back() {
        let in_flight = trailers_only(&Problem::in_flight());
        assert_eq!(value(&in_flight, "grpc-status"), Some("10"));
        assert_eq!(value(&in_flight, "grpc-retry-pushback-ms"), Some("1000"));
        assert_eq!(
            value(&in_flight, PROBLEM_TYPE_METADATA),
            Some("urn:idempotency-filter:problem:request-in-flight")
        );
        for (problem, code) in [
            (
                Problem::key_reused("metadata 'idempotency-key'"),
                status::INVALID_ARGUMENT,
            ),
            (
                Problem::missing_key("metadata 'idempotency-key'"),
                status::INVALID_ARGUMENT,
            ),
            (
                Problem::missing_scope("authorization"),
                status::UNAUTHENTICATED,
            ),
            (Problem::outcome_unknown(), status::FAILED_PRECONDITION),
            (
                Problem::unavailable("the store could not be reached"),
                status::UNAVAILABLE,
            ),
            (Problem::table_full(), status::UNAVAILABLE),
        ] {
            let h = trailers_only(&problem);
            assert_eq!(
                value(&h, "grpc-status"),
                Some(code.to_string().as_str()),
                "{}",
                problem.kind
            );
            assert!(value(&h, "grpc-message")
                .is_some_and(|m| m.contains(&percent_encode(problem.title))));
        }
        assert_eq!(
            value(
                &trailers_only(&Problem::outcome_unknown()),
                "grpc-retry-pushback-ms"
            ),
            None
        );
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode("a b%c"), "a b%25c");
        assert_eq!(percent_encode("caf\u{e9}\n"), "caf%C3%A9%0A");
    }
}

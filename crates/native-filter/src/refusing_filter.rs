//! What a request gets when the module cannot protect it: its filter could not be made (a
//! panic), its worker's root refused the configuration, or a hook of it failed before the
//! response began. A Wasm VM that fails stops, and Envoy answers 503; the native build answers
//! the same way, with problem+json and a Retry-After, never an unprotected pass.

use idempotency_core::problem::Problem;

use crate::abi::{Filter, HeadersStatus, HttpFilter};

/// A request's filter that answers every request 503 at its headers.
pub struct RefusingFilter;

impl HttpFilter for RefusingFilter {
    fn on_request_headers(&mut self, f: &Filter, _end_of_stream: bool) -> HeadersStatus {
        answer_unavailable(f, "the idempotency filter could not take this request");
        HeadersStatus::StopIteration
    }
}

/// Answers the request 503 problem+json: `what` went wrong, retry later.
pub fn answer_unavailable(filter: &Filter, what: &str) {
    let problem = Problem::unavailable(what);
    let headers = problem.headers();
    let headers: Vec<(&str, &[u8])> = headers
        .iter()
        .map(|(name, value)| (*name, value.as_bytes()))
        .collect();
    filter.send_response(problem.status, &headers, &problem.body(""));
}

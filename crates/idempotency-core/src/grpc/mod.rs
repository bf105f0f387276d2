//! gRPC unary calls as writes: what a gRPC rule needs beyond an HTTP one. [`frame`] reads the
//! length-prefixed messages of a request or a response, [`status`] names the status codes
//! and says which release a claim, [`answer`] turns the filter's own problems into
//! trailers-only gRPC statuses; the other end of a replay's hop (see `REPLAY_PATH`) is the
//! journey's `echo`.
//!
//! Why a replay of a response with a message takes a hop: Envoy answers a gRPC request's
//! local reply as trailers-only, whatever body it is given, so the filter cannot send a
//! recorded message itself. It sends the request on instead, rewritten to `REPLAY_PATH` with
//! the recorded message as its body: a route for that path leads to an internal listener
//! whose filter (in `grpc_replay_echo` mode) answers with the body it received, and this
//! filter restores the recorded metadata and adds the recorded trailers as the answer passes
//! back. No service implements that path, so a hop that goes astray executes nothing. A host
//! that sends a reply's headers, body and trailers itself (`Host::sends_replies_with_trailers`,
//! the native build) needs no hop: the filter sends the recorded response there.

pub mod answer;
pub mod frame;
/// gRPC's status codes: the protocol crate's, which the store's `record` command shares.
pub use idempotency_protocol::grpc_status as status;

/// The method a replay's hop is sent to; users route its service to the echo listener.
pub const REPLAY_PATH: &str = "/idempotency.filter.v1.Replay/Echo";
/// The service part of [`REPLAY_PATH`], as a route prefix.
pub const REPLAY_SERVICE_PREFIX: &str = "/idempotency.filter.v1.Replay/";
/// The content type of a hop: not gRPC, so that the echo's local reply may carry a body.
pub const HOP_CONTENT_TYPE: &str = "application/x-idempotency-replay";
/// Set by the echo on its answer, so the filter can tell its hop reached the echo.
pub const ECHO_MARKER: &str = "x-idempotency-replay-echo";

/// What a gRPC rule adds to a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcRule {
    /// Status codes that release the claim (the call did not take effect).
    pub release: Vec<u32>,
}

/// A gRPC request's content type: `application/grpc`, bare or with a subtype
/// (`application/grpc+proto`); gRPC-Web is not gRPC here (its trailers travel in the body).
pub fn is_grpc_content_type(value: &str) -> bool {
    match strip_prefix_ignoring_case(value.trim(), "application/grpc") {
        Some(rest) => rest.is_empty() || rest.starts_with('+') || rest.starts_with(';'),
        None => false,
    }
}

/// `value` without `prefix`, compared without regard to ASCII case (no lowercase copy: every
/// protected request asks).
fn strip_prefix_ignoring_case<'a>(value: &'a str, prefix: &str) -> Option<&'a str> {
    let head = value.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| value.get(prefix.len()..))
        .flatten()
}

/// A gRPC-Web request's content type (`application/grpc-web`, `-text`, `+proto`...): a gRPC
/// call whose status travels in its body, which the filter does not protect.
pub fn is_grpc_web_content_type(value: &str) -> bool {
    match strip_prefix_ignoring_case(value.trim(), "application/grpc-web") {
        Some(rest) => {
            let rest = strip_prefix_ignoring_case(rest, "-text").unwrap_or(rest);
            rest.is_empty() || rest.starts_with('+') || rest.starts_with(';')
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn grpc_content_types_are_told_from_grpc_web_and_others() {
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC+json",
            "application/grpc; charset=utf-8",
        ] {
            assert!(is_grpc_content_type(yes), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/json",
            "",
            "application/grpcx",
        ] {
            assert!(!is_grpc_content_type(no), "{no}");
        }
        for web in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpc-web-text",
            "Application/gRPC-Web-Text+proto",
        ] {
            assert!(is_grpc_web_content_type(web), "{web}");
        }
        for no in ["application/grpc", "application/grpc-webx", "text/plain"] {
            assert!(!is_grpc_web_content_type(no), "{no}");
        }
    }
}

//! Whether an answer that reached Envoy from its upstream says that somebody behind Envoy gave
//! up on the request after it may have reached the service: a proxy between Envoy and the
//! service (an Istio sidecar, nginx, a load balancer) whose timeout or reset comes back as the
//! upstream's `502`, `503` or `504`, or as gRPC's `UNAVAILABLE` or `DEADLINE_EXCEEDED`. To
//! Envoy that is the upstream's answer (`via_upstream`); only the status and the proxy's own
//! words tell it from the service's "not processed".
//!
//! The rule the filter follows: an answer that says someone gave up while the write may have
//! run is an unknown outcome; one that proves the request never reached the service (a
//! proxy's "no healthy upstream", a refused connection) is not, and neither is the service's
//! own answer. The decision table is in docs/guarantees.md.

use idempotency_protocol::grpc_status;
use idempotency_protocol::record::flags as flag;

/// What an upstream's answer says about the request behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Judgement {
    /// Someone behind Envoy gave up after the request may have reached the service; the
    /// reason, in Envoy's style of response details.
    GaveUp(&'static str),
    /// A proxy behind Envoy answered, and its words prove it never sent the request on.
    NeverSent,
    /// The service's own answer (or nothing says otherwise): the rule's release policy decides.
    ServiceAnswer,
}

/// The HTTP statuses whose judgement reads the body: a proxy's words tell a reset after
/// sending from a refused connection, and a proxy's `503` from the service's.
pub fn reads_body(status: u16) -> bool {
    matches!(status, 502 | 503)
}

/// Envoy's body text is short; a longer body is not one of its local replies.
pub const TEXT_BYTES: usize = 512;

/// Judges an HTTP answer by its status and the beginning of its body (empty when none).
pub fn of_http(status: u16, body: &[u8]) -> Judgement {
    match (status, proxy_text(body)) {
        // A gateway timeout: by its definition a proxy that stopped waiting for the service.
        (504, _) => Judgement::GaveUp("gateway_timeout"),
        (502 | 503, ProxyText::NeverSent(_)) => Judgement::NeverSent,
        (502 | 503, ProxyText::GaveUp(reason)) => Judgement::GaveUp(reason),
        // nginx, HAProxy and cloud load balancers answer `502` for a connection the service
        // closed, whether or not it had read the request: nothing proves it never ran.
        (502, ProxyText::None) => Judgement::GaveUp("bad_gateway"),
        // A `503` (with or without `Retry-After`) is how services and proxies say "not now":
        // overloaded, draining, no instance left. Envoy's is the one that may follow a reset
        // after sending, and its words say so.
        _ => Judgement::ServiceAnswer,
    }
}

/// Judges a gRPC call's status and `grpc-message` (percent-encoded, as sent).
pub fn of_grpc(code: u32, message: &[u8]) -> Judgement {
    match code {
        // The service's own deadline, or one a proxy propagated: someone stopped waiting.
        grpc_status::DEADLINE_EXCEEDED => Judgement::GaveUp("grpc_deadline_exceeded"),
        // Envoy turns its local replies into `UNAVAILABLE` with its words as the message.
        grpc_status::UNAVAILABLE => match proxy_text(&percent_decoded(message)) {
            ProxyText::GaveUp(reason) => Judgement::GaveUp(reason),
            ProxyText::NeverSent(_) => Judgement::NeverSent,
            ProxyText::None => Judgement::ServiceAnswer,
        },
        _ => Judgement::ServiceAnswer,
    }
}

/// What a proxy's fixed words say, when the text is one of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyText {
    /// The request never left the proxy; the response flags Envoy would report for it.
    NeverSent(u64),
    GaveUp(&'static str),
    /// Not a proxy's words this filter knows.
    None,
}

/// Envoy's body for a route or per-try timeout (its `504`).
const ENVOY_TIMEOUT: &str = "upstream request timeout";
/// Envoy's body when no host of the cluster is healthy.
const ENVOY_NO_HEALTHY_UPSTREAM: &str = "no healthy upstream";
/// Envoy's body for a reset or refusal before the response began: `<this> reset reason:
/// <reason>[, transport failure reason: ...]`, or `<this> retried and the latest reset
/// reason: ...` after its retries.
const ENVOY_RESET_BEFORE_HEADERS: &str =
    "upstream connect error or disconnect/reset before headers.";
/// Reset reasons of a request that was never written to the upstream: no connection, a
/// circuit breaker, or an HTTP/2 stream the upstream refused unprocessed.
const RESETS_BEFORE_SENDING: [(&str, u64); 6] = [
    (
        "local connection failure",
        flag::UPSTREAM_CONNECTION_FAILURE,
    ),
    (
        "remote connection failure",
        flag::UPSTREAM_CONNECTION_FAILURE,
    ),
    ("connection failure", flag::UPSTREAM_CONNECTION_FAILURE),
    ("connection timeout", flag::UPSTREAM_CONNECTION_FAILURE),
    ("overflow", flag::UPSTREAM_OVERFLOW),
    ("remote refused stream reset", flag::UPSTREAM_REMOTE_RESET),
];

/// Reads Envoy's fixed local-reply words: whether they prove the request never left that
/// Envoy, or say it gave up after sending (a timeout, a reset after sending, a retry).
pub fn proxy_text(body: &[u8]) -> ProxyText {
    let text = (body.len() <= TEXT_BYTES)
        .then(|| std::str::from_utf8(body).ok())
        .flatten()
        .map(str::trim);
    let Some(text) = text else {
        return ProxyText::None;
    };
    if text == ENVOY_TIMEOUT {
        return ProxyText::GaveUp("proxy_timeout");
    }
    if text == ENVOY_NO_HEALTHY_UPSTREAM {
        return ProxyText::NeverSent(flag::NO_HEALTHY_UPSTREAM);
    }
    let Some(rest) = text.strip_prefix(ENVOY_RESET_BEFORE_HEADERS) else {
        return ProxyText::None;
    };
    // After a retry of its own, an earlier attempt may have run the write, whatever the
    // latest reset was.
    let Some((_, reason)) = rest.split_once(" reset reason: ") else {
        return ProxyText::GaveUp("proxy_reset");
    };
    if rest.trim_start().starts_with("retried") {
        return ProxyText::GaveUp("proxy_retried");
    }
    let reason = reason.split(',').next().unwrap_or("").trim();
    match RESETS_BEFORE_SENDING
        .iter()
        .find(|(name, _)| *name == reason)
    {
        Some((_, flags)) => ProxyText::NeverSent(*flags),
        None => ProxyText::GaveUp("proxy_reset_after_sending"),
    }
}

/// `grpc-message` is percent-encoded: every byte outside printable ASCII, and `%`.
fn percent_decoded(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(message.len());
    let mut rest = message;
    while let Some((&byte, tail)) = rest.split_first() {
        let escaped = match tail {
            [high, low, ..] if byte == b'%' => hex(*high).zip(hex(*low)),
            _ => None,
        };
        match (escaped, tail.get(2..)) {
            (Some((high, low)), Some(after)) => {
                out.push(high << 4 | low);
                rest = after;
            }
            _ => {
                out.push(byte);
                rest = tail;
            }
        }
    }
    out
}

fn hex(digit: u8) -> Option<u8> {
    char::from(digit)
        .to_digit(16)
        .and_then(|d| u8::try_from(d).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const NGINX_504: &str = "<html>\r\n<head><title>504 Gateway Time-out</title></head>\r\n<body>\r\n<center><h1>504 Gateway Time-out</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";
    const NGINX_502: &str = "<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n";

    fn reset(reason: &str) -> String {
        format!("{ENVOY_RESET_BEFORE_HEADERS} reset reason: {reason}")
    }

    #[test]
    fn a_gateway_timeout_is_someone_giving_up_whoever_words_it() {
        for body in [ENVOY_TIMEOUT, NGINX_504, "", "{\"error\":\"timeout\"}"] {
            assert!(
                matches!(of_http(504, body.as_bytes()), Judgement::GaveUp(_)),
                "{body}"
            );
        }
    }

    #[test]
    fn a_bad_gateway_is_unknown_unless_a_proxy_says_it_never_sent() {
        assert!(matches!(
            of_http(502, NGINX_502.as_bytes()),
            Judgement::GaveUp("bad_gateway")
        ));
        assert!(matches!(of_http(502, b""), Judgement::GaveUp(_)));
        assert_eq!(
            of_http(502, reset("connection failure").as_bytes()),
            Judgement::NeverSent
        );
        assert!(matches!(
            of_http(502, reset("protocol error").as_bytes()),
            Judgement::GaveUp("proxy_reset_after_sending")
        ));
    }

    #[test]
    fn a_503_is_the_services_unless_envoys_words_say_it_was_reset_after_sending() {
        for body in ["", "{\"error\":\"busy\"}", "Service Unavailable"] {
            assert_eq!(
                of_http(503, body.as_bytes()),
                Judgement::ServiceAnswer,
                "{body}"
            );
        }
        for reason in [
            "connection termination",
            "remote reset",
            "protocol error",
            "something new",
        ] {
            assert!(
                matches!(of_http(503, reset(reason).as_bytes()), Judgement::GaveUp(_)),
                "{reason}"
            );
        }
        let retried = format!(
            "{ENVOY_RESET_BEFORE_HEADERS} retried and the latest reset reason: connection failure"
        );
        assert_eq!(
            of_http(503, retried.as_bytes()),
            Judgement::GaveUp("proxy_retried")
        );
        for reason in [
            "connection failure, transport failure reason: delayed connect error: Connection refused",
            "remote connection failure",
            "local connection failure",
            "connection timeout",
            "overflow",
            "remote refused stream reset",
        ] {
            assert_eq!(of_http(503, reset(reason).as_bytes()), Judgement::NeverSent, "{reason}");
        }
        assert_eq!(of_http(503, b"no healthy upstream\n"), Judgement::NeverSent);
    }

    #[test]
    fn other_statuses_are_the_services() {
        for status in [200, 201, 400, 409, 422, 429, 500] {
            assert_eq!(
                of_http(status, ENVOY_TIMEOUT.as_bytes()),
                Judgement::ServiceAnswer
            );
        }
    }

    #[test]
    fn a_long_body_is_not_envoys_words() {
        let mut long = reset("connection failure").into_bytes();
        long.resize(TEXT_BYTES + 1, b' ');
        assert_eq!(proxy_text(&long), ProxyText::None);
        assert_eq!(of_http(502, &long), Judgement::GaveUp("bad_gateway"));
        assert_eq!(of_http(503, &long), Judgement::ServiceAnswer);
    }

    #[test]
    fn grpc_deadline_exceeded_and_a_proxys_unavailable_gave_up() {
        assert!(matches!(
            of_grpc(grpc_status::DEADLINE_EXCEEDED, b"whatever"),
            Judgement::GaveUp(_)
        ));
        assert!(matches!(
            of_grpc(grpc_status::UNAVAILABLE, b"upstream request timeout"),
            Judgement::GaveUp("proxy_timeout")
        ));
        assert!(matches!(
            of_grpc(
                grpc_status::UNAVAILABLE,
                b"upstream%20connect error or disconnect/reset before headers. reset reason: connection termination"
            ),
            Judgement::GaveUp(_)
        ));
        assert_eq!(
            of_grpc(grpc_status::UNAVAILABLE, b"no healthy upstream"),
            Judgement::NeverSent
        );
        assert_eq!(
            of_grpc(grpc_status::UNAVAILABLE, b"busy, try later"),
            Judgement::ServiceAnswer
        );
        assert_eq!(
            of_grpc(grpc_status::INTERNAL, b"upstream request timeout"),
            Judgement::ServiceAnswer
        );
        assert_eq!(of_grpc(grpc_status::OK, b""), Judgement::ServiceAnswer);
    }

    #[test]
    fn percent_decoding_takes_what_grpc_sends() {
        assert_eq!(percent_decoded(b"a%20b%25c"), b"a b%c");
        assert_eq!(percent_decoded(b"100%"), b"100%");
        assert_eq!(percent_decoded(b"%zz%4"), b"%zz%4");
        assert_eq!(percent_decoded(b"caf%C3%A9"), "café".as_bytes());
    }
}

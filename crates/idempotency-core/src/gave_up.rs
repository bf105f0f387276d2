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
use percent_encoding::percent_decode;

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

/// Envoy's body text is short; a longer body is not one of its local replies.
pub const TEXT_BYTES: usize = 512;

/// Statuses that say a gateway stopped waiting, whoever sends them: `504`, Cloudflare's
/// `524` (a timeout after connecting) and `520` (an empty or unknown answer from the origin),
/// and the `598`/`599` network timeouts some proxies use.
const TIMED_OUT_STATUSES: [u16; 4] = [504, 520, 524, 598];

/// Judges an HTTP answer as far as its headers tell. None: its first body bytes decide
/// (`of_words`), a `502` or `503` whose proxy's words tell a reset after sending from a
/// refused connection, and a proxy's `503` from the service's.
pub fn of_headers(status: u16, headers: &[(String, Vec<u8>)]) -> Option<Judgement> {
    if status >= 500 && attempts_behind(headers) > 1 {
        // An Envoy in between retried on its own (`include_attempt_count_in_response`): an
        // earlier attempt may have run the write, whatever the last one says.
        return Some(Judgement::GaveUp("proxy_retried"));
    }
    if TIMED_OUT_STATUSES.contains(&status) || status == 599 {
        return Some(Judgement::GaveUp("gateway_timeout"));
    }
    if !matches!(status, 502 | 503) {
        return Some(Judgement::ServiceAnswer);
    }
    if header(headers, "l5d-proxy-error").is_some() {
        // Linkerd's proxy answered; its words are not Envoy's.
        return Some(Judgement::GaveUp("linkerd_proxy_error"));
    }
    let encoded = header(headers, "content-encoding")
        .is_some_and(|v| !v.trim_ascii().eq_ignore_ascii_case(b"identity"));
    if encoded {
        // A compressor between the proxy and this filter: the words cannot be read, and
        // nothing proves the request was never sent.
        return Some(Judgement::GaveUp("encoded_words"));
    }
    None
}

/// Judges a `502` or `503` whose body has ended, by its first bytes.
pub fn of_ended_words(status: u16, words: &[u8]) -> Judgement {
    of_http(status, words)
}

/// Judges a `502` or `503` by its first body bytes, `complete` once the body has ended
/// (or `TEXT_BYTES` passed). None: they could still become one of a proxy's words.
pub fn of_words(status: u16, words: &[u8], complete: bool) -> Option<Judgement> {
    let decided = complete || words.len() > TEXT_BYTES || !could_be_proxy_text(words);
    decided.then(|| of_http(status, words))
}

/// Judges a whole answer: its headers, then its body.
pub fn of_answer(status: u16, headers: &[(String, Vec<u8>)], body: &[u8]) -> Judgement {
    of_headers(status, headers).unwrap_or_else(|| of_http(status, body))
}

/// Judges a `502` or `503` by its whole body (the first `TEXT_BYTES`; more: not a proxy's).
fn of_http(status: u16, body: &[u8]) -> Judgement {
    match (status, proxy_text(body)) {
        (_, ProxyText::NeverSent(_)) => Judgement::NeverSent,
        (_, ProxyText::GaveUp(reason)) => Judgement::GaveUp(reason),
        // nginx, HAProxy and cloud load balancers answer `502` for a connection the service
        // closed, whether or not it had read the request: nothing proves it never ran.
        (502, ProxyText::None) => Judgement::GaveUp("bad_gateway"),
        // A `503` (with or without `Retry-After`) is how services and proxies say "not now":
        // overloaded, draining, no instance left. Envoy's is the one that may follow a reset
        // after sending, and its words say so.
        _ => Judgement::ServiceAnswer,
    }
}

/// Judges a gRPC call's status by the metadata it came in (its trailers, or a trailers-only
/// answer's headers): their `grpc-message`, percent-encoded as sent, and a proxy's marks.
pub fn of_grpc(code: u32, metadata: &[(String, Vec<u8>)]) -> Judgement {
    match code {
        // The service's own deadline, or one a proxy propagated: someone stopped waiting.
        grpc_status::DEADLINE_EXCEEDED => Judgement::GaveUp("grpc_deadline_exceeded"),
        // Proxies turn their local replies into `UNAVAILABLE` with their words as the
        // message: Envoy's fixed ones, Linkerd's marked by `l5d-proxy-error`.
        grpc_status::UNAVAILABLE if header(metadata, "l5d-proxy-error").is_some() => {
            Judgement::GaveUp("linkerd_proxy_error")
        }
        grpc_status::UNAVAILABLE => {
            let message = header(metadata, "grpc-message").unwrap_or_default();
            let decoded: Vec<u8> = percent_decode(message).collect();
            match proxy_text(&decoded) {
                ProxyText::GaveUp(reason) => Judgement::GaveUp(reason),
                ProxyText::NeverSent(_) => Judgement::NeverSent,
                // Any message that speaks of a timeout or a reset: someone stopped waiting or
                // lost the call midway. Mistaking the service's own for one only keeps the
                // key (an unknown outcome), never runs the call again.
                ProxyText::None if speaks_of_giving_up(&decoded) => {
                    Judgement::GaveUp("unavailable_after_timeout_or_reset")
                }
                ProxyText::None => Judgement::ServiceAnswer,
            }
        }
        _ => Judgement::ServiceAnswer,
    }
}

/// How many attempts an Envoy behind this one says it made (`x-envoy-attempt-count`).
fn attempts_behind(headers: &[(String, Vec<u8>)]) -> u64 {
    header(headers, "x-envoy-attempt-count")
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1)
}

fn header<'h>(headers: &'h [(String, Vec<u8>)], name: &str) -> Option<&'h [u8]> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_slice())
}

/// Words that say a call was given up on or lost midway.
const GIVING_UP_WORDS: [&str; 6] = [
    "timeout",
    "timed out",
    "deadline",
    "reset",
    "disconnect",
    "max stream duration",
];

fn speaks_of_giving_up(text: &[u8]) -> bool {
    let lower = String::from_utf8_lossy(text).to_ascii_lowercase();
    GIVING_UP_WORDS.iter().any(|w| lower.contains(w))
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

/// Envoy's bodies for its own timeouts (its `504`, `UNAVAILABLE` to a gRPC call): a route or
/// per-try timeout, a stream idle timeout once the request was whole, a route's
/// `max_stream_duration`.
const ENVOY_TIMEOUTS: [&str; 3] = [
    "upstream request timeout",
    "stream timeout",
    "upstream max stream duration reached",
];
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
    if ENVOY_TIMEOUTS.contains(&text) {
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

/// Whether `words`, the first bytes of a body, could still grow into one of Envoy's words.
fn could_be_proxy_text(words: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(words) else {
        // Cut inside a character, perhaps: only a longer prefix tells.
        return words.len() <= TEXT_BYTES;
    };
    let text = text.trim_start();
    ENVOY_TIMEOUTS
        .iter()
        .chain([ENVOY_NO_HEALTHY_UPSTREAM, ENVOY_RESET_BEFORE_HEADERS].iter())
        .any(|phrase| phrase.starts_with(text) || text.starts_with(phrase))
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
        for body in [ENVOY_TIMEOUTS[0], NGINX_504, "", "{\"error\":\"timeout\"}"] {
            assert!(
                matches!(of_answer(504, &[], body.as_bytes()), Judgement::GaveUp(_)),
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
                of_answer(status, &[], ENVOY_TIMEOUTS[0].as_bytes()),
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
            of_grpc(grpc_status::DEADLINE_EXCEEDED, &message(b"whatever")),
            Judgement::GaveUp(_)
        ));
        assert!(matches!(
            of_grpc(
                grpc_status::UNAVAILABLE,
                &message(b"upstream request timeout")
            ),
            Judgement::GaveUp("proxy_timeout")
        ));
        assert!(matches!(
            of_grpc(grpc_status::UNAVAILABLE, &message(b"upstream%20connect error or disconnect/reset before headers. reset reason: connection termination")),
            Judgement::GaveUp(_)
        ));
        assert_eq!(
            of_grpc(grpc_status::UNAVAILABLE, &message(b"no healthy upstream")),
            Judgement::NeverSent
        );
        assert_eq!(
            of_grpc(grpc_status::UNAVAILABLE, &message(b"busy, try later")),
            Judgement::ServiceAnswer
        );
        assert_eq!(
            of_grpc(grpc_status::INTERNAL, &message(b"upstream request timeout")),
            Judgement::ServiceAnswer
        );
        assert_eq!(
            of_grpc(grpc_status::OK, &message(b"")),
            Judgement::ServiceAnswer
        );
    }

    /// Trailers carrying `text` as the call's `grpc-message`.
    fn message(text: &[u8]) -> Vec<(String, Vec<u8>)> {
        vec![("grpc-message".to_string(), text.to_vec())]
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn envoys_other_timeouts_and_any_unavailable_that_speaks_of_one_gave_up() {
        for text in [
            "stream timeout",
            "upstream max stream duration reached",
            "database timeout",
            "Connection reset by peer",
            "upstream%20request%20timeout",
        ] {
            assert!(
                matches!(
                    of_grpc(grpc_status::UNAVAILABLE, &message(text.as_bytes())),
                    Judgement::GaveUp(_)
                ),
                "{text}"
            );
        }
        let linkerd = pairs(&[("l5d-proxy-error", "connection closed")]);
        assert!(matches!(
            of_grpc(grpc_status::UNAVAILABLE, &linkerd),
            Judgement::GaveUp(_)
        ));
        assert!(matches!(
            of_answer(503, &linkerd, b""),
            Judgement::GaveUp(_)
        ));
    }

    #[test]
    fn what_the_headers_decide_before_any_body() {
        for status in [520, 524, 598, 599] {
            assert!(
                matches!(of_headers(status, &[]), Some(Judgement::GaveUp(_))),
                "{status}"
            );
        }
        // Words a compressor made unreadable; an Envoy behind that retried.
        let gzip = pairs(&[("content-encoding", "gzip")]);
        assert!(matches!(of_headers(503, &gzip), Some(Judgement::GaveUp(_))));
        let identity = pairs(&[("content-encoding", "identity")]);
        assert_eq!(of_headers(503, &identity), None, "read the words");
        let retried = pairs(&[("x-envoy-attempt-count", "2")]);
        assert!(matches!(
            of_headers(500, &retried),
            Some(Judgement::GaveUp(_))
        ));
        assert!(matches!(
            of_headers(503, &retried),
            Some(Judgement::GaveUp(_))
        ));
        assert_eq!(
            of_headers(201, &retried),
            Some(Judgement::ServiceAnswer),
            "a success is the service's"
        );
        assert_eq!(of_headers(500, &[]), Some(Judgement::ServiceAnswer));
    }

    #[test]
    fn words_are_judged_as_soon_as_they_cannot_be_a_proxys() {
        // Still possibly Envoy's: wait.
        assert_eq!(of_words(503, b"", false), None);
        assert_eq!(of_words(503, b"  upstream conn", false), None);
        assert_eq!(of_words(503, b"no healthy", false), None);
        // Not Envoy's: decided at once.
        assert_eq!(
            of_words(503, b"{\"error\":", false),
            Some(Judgement::ServiceAnswer)
        );
        assert_eq!(
            of_words(502, b"<html>", false),
            Some(Judgement::GaveUp("bad_gateway"))
        );
        let long = vec![b'u'; TEXT_BYTES + 1];
        assert_eq!(of_words(503, &long, false), Some(Judgement::ServiceAnswer));
        // At the end, whatever they are.
        assert_eq!(
            of_words(503, b"upstream conn", true),
            Some(Judgement::ServiceAnswer)
        );
    }

    #[test]
    fn a_malformed_escape_in_the_message_is_read_as_it_is() {
        for text in ["100%", "%zz upstream request timeout", "%4"] {
            assert_eq!(
                of_grpc(grpc_status::UNAVAILABLE, &message(text.as_bytes())),
                if text.contains("timeout") {
                    Judgement::GaveUp("unavailable_after_timeout_or_reset")
                } else {
                    Judgement::ServiceAnswer
                },
                "{text}"
            );
        }
    }
}

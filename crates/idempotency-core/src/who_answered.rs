//! Who answered a protected request, and whether it reached the upstream, from what Envoy
//! reports on the stream (`response.code_details`, `response.flags`,
//! `upstream.request_attempt_count`). The filter sits before the router: a route timeout, a
//! reset after the request was sent, or a router retry all reach it as one answer from
//! Envoy, and only these properties tell them apart from the upstream's own answer or from a
//! request that never left the proxy.

use crate::gave_up::{proxy_text, ProxyText};
use crate::host::Host;
use idempotency_protocol::record::{Retention, UnknownOutcome};

/// Envoy's response flags: the protocol crate's, as records and the store's `record` command
/// name them.
pub use idempotency_protocol::record::flags as flag;
pub use idempotency_protocol::record::flags::flag_names;

/// Flags that say the router never sent the request: no host to send it to, no connection
/// to it, a circuit breaker or overload refusing it, nothing to route to. `URX` comes with
/// them whenever a retry policy exists, even one capped at no retry.
const NEVER_SENT: u64 = flag::FAILED_LOCAL_HEALTH_CHECK
    | flag::NO_HEALTHY_UPSTREAM
    | flag::UPSTREAM_CONNECTION_FAILURE
    | flag::UPSTREAM_OVERFLOW
    | flag::NO_ROUTE_FOUND
    | flag::NO_CLUSTER_FOUND
    | flag::DNS_RESOLUTION_FAILED
    | flag::DROP_OVERLOAD
    | flag::UPSTREAM_RETRY_LIMIT_EXCEEDED;

/// Envoy's `response.code_details` for a reset before the response began:
/// `upstream_reset_before_response_started{<reason>}`, a transport failure after the reason
/// behind `|` when there is one.
const RESET_BEFORE_RESPONSE: &str = "upstream_reset_before_response_started{";
/// The reset reason of an HTTP/2 or HTTP/3 stream the upstream refused: `REFUSED_STREAM`, or
/// a stream above the last one its `GOAWAY` accepted (Envoy 1.36 and 1.40 report both so,
/// with the flag `UR`). The server did not process it (RFC 9113 8.7).
const REFUSED_STREAM: &str = "remote_refused_stream_reset";

/// Envoy's `response.code_details` for a response the upstream sent.
const VIA_UPSTREAM: &str = "via_upstream";
/// ... and for the answer of a route that answers itself (`direct_response`): that route's
/// service, whose answer is recorded like an upstream's.
const DIRECT_RESPONSE: &str = "direct_response";

/// What Envoy says about how a request ended.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EnvoyReport {
    /// The response's status; 0 when none was sent (the client left first).
    pub status: u16,
    /// `response.code_details`; None when Envoy gives none.
    pub details: Option<String>,
    pub flags: u64,
    /// `upstream.request_attempt_count` (Envoy 1.33 and later); None when absent.
    pub attempts: Option<u32>,
}

/// Who answered, as far as the filter can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answerer {
    /// The upstream's own response. `resent`: the router sent the request more than once
    /// (a retry policy the filter could not switch off), so an earlier attempt may also have
    /// run the write.
    Upstream { resent: bool },
    /// Envoy answered, and the request provably never reached the upstream: a retry may run.
    NeverReached,
    /// Envoy answered (or the client left) after the request may have reached the upstream:
    /// whether the write ran is unknown.
    Unknown,
}

impl EnvoyReport {
    /// Reads what Envoy reports for the response whose headers (status `status`) are being
    /// delivered, or, with status 0, for a stream that ended without one. The upstream's own
    /// answer costs two reads; flags are read only for Envoy's.
    pub fn read(host: &impl Host, status: u16) -> EnvoyReport {
        let details = property(host, &["response", "code_details"])
            .and_then(|bytes| String::from_utf8(bytes).ok());
        let attempts = property(host, &["upstream", "request_attempt_count"])
            .and_then(|bytes| integer(&bytes))
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX));
        let flags = if matches!(details.as_deref(), Some(VIA_UPSTREAM | DIRECT_RESPONSE)) {
            0
        } else {
            property(host, &["response", "flags"])
                .and_then(|bytes| integer(&bytes))
                .unwrap_or(0)
        };
        EnvoyReport {
            status,
            details,
            flags,
            attempts,
        }
    }

    pub fn answerer(&self) -> Answerer {
        let attempts = self.attempts.unwrap_or(1);
        if self.details.as_deref() == Some(VIA_UPSTREAM) {
            return Answerer::Upstream {
                resent: attempts > 1,
            };
        }
        if self.details.as_deref() == Some(DIRECT_RESPONSE) {
            return Answerer::Upstream { resent: false };
        }
        // No attempt at all: a filter after this one answered, or the client left before the
        // router sent anything.
        if self.attempts == Some(0) {
            return Answerer::NeverReached;
        }
        // Flags describe the last attempt only (an earlier one that reached the upstream
        // leaves no trace), so they prove "never sent" for a single attempt alone.
        if attempts <= 1 && self.flags != 0 && self.flags & !NEVER_SENT == 0 {
            return Answerer::NeverReached;
        }
        // A stream the upstream refused did not run; the flag `UR` alone does not tell it
        // from a reset after the upstream took the request, its details do. After an earlier
        // attempt, that attempt may have run it.
        if attempts <= 1 && self.is_refused_stream() {
            return Answerer::NeverReached;
        }
        // Without details (none given) and without a flag, Envoy reports nothing wrong: the
        // response is the upstream's, as before Envoy reported details.
        if self.details.is_none() && self.flags == 0 && self.status != 0 {
            return Answerer::Upstream {
                resent: attempts > 1,
            };
        }
        Answerer::Unknown
    }

    /// The upstream refused the stream (`UR`, and a retry policy's `URX` at most): the reset
    /// reason in the details, not the flag, says so.
    fn is_refused_stream(&self) -> bool {
        let reason = self
            .details
            .as_deref()
            .and_then(|details| details.strip_prefix(RESET_BEFORE_RESPONSE))
            .and_then(|rest| rest.split(['|', '}']).next());
        reason == Some(REFUSED_STREAM)
            && self.flags & flag::UPSTREAM_REMOTE_RESET != 0
            && self.flags & !(flag::UPSTREAM_REMOTE_RESET | flag::UPSTREAM_RETRY_LIMIT_EXCEEDED)
                == 0
    }

    /// The route answered itself (`direct_response`): nothing left Envoy.
    pub fn is_direct_response(&self) -> bool {
        self.details.as_deref() == Some(DIRECT_RESPONSE)
    }

    /// This report of the upstream's answer, saying that someone behind Envoy gave up on the
    /// request (`gave_up`), for the unknown outcome's record and the log.
    pub fn gave_up_behind(&self, reason: &str) -> EnvoyReport {
        EnvoyReport {
            details: Some(format!("upstream_gave_up{{{reason}}}")),
            ..self.clone()
        }
    }

    /// What the record of an unknown outcome keeps of this report.
    /// `retention`: how long the key is kept if the write is found to have taken effect.
    pub fn as_unknown_outcome(&self, retention: Retention) -> UnknownOutcome {
        UnknownOutcome {
            proxy_status: self.status,
            response_flags: self.flags,
            details: self.details.clone().unwrap_or_default(),
            attempts: self.attempts.unwrap_or(0),
            resolution_due_ms: None,
            retention: Some(retention),
        }
    }
}

/// What Envoy reported, for a log line: `status 503, flags UR, details ..., attempts 1`.
impl std::fmt::Display for EnvoyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "status {}, flags {}, details {}, attempts ",
            self.status,
            flag_names(self.flags),
            self.details.as_deref().unwrap_or("-")
        )?;
        match self.attempts {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("-"),
        }
    }
}

impl EnvoyReport {
    /// Who answered a detached write (`execution: "detached"`), sent as a callout: Envoy
    /// reports no details or flags for one, but its router's own answers have fixed bodies,
    /// and a 504 at the callout's timeout is its own. `status` 0: the exchange failed
    /// without a response (reset midway).
    pub fn of_detached(
        status: u16,
        body: &[u8],
        elapsed_ms: u64,
        timeout_ms: u64,
    ) -> (Answerer, EnvoyReport) {
        let report = |details: &str, flags: u64| EnvoyReport {
            status,
            details: Some(format!("detached: {details}")),
            flags,
            attempts: Some(1),
        };
        if status == 0 {
            let lost = report("the response was cut short", flag::UPSTREAM_REMOTE_RESET);
            return (Answerer::Unknown, lost);
        }
        let text = std::str::from_utf8(body).unwrap_or("").trim();
        // Envoy's own reply to a callout past its timeout; a response that did arrive, however
        // late, is the upstream's.
        if status == 504 && (text == "upstream request timeout" || elapsed_ms >= timeout_ms) {
            let timed_out = report("upstream_timeout_ms passed", flag::UPSTREAM_REQUEST_TIMEOUT);
            return (Answerer::Unknown, timed_out);
        }
        if matches!(status, 502..=503) {
            match proxy_text(text.as_bytes()) {
                ProxyText::NeverSent(flags) => {
                    return (Answerer::NeverReached, report(text, flags));
                }
                ProxyText::GaveUp(reason) => {
                    let after_sending = format!("{reason} ({text})");
                    let flags = flag::UPSTREAM_CONNECTION_TERMINATION;
                    return (Answerer::Unknown, report(&after_sending, flags));
                }
                ProxyText::None => {}
            }
        }
        (
            Answerer::Upstream { resent: false },
            report("via_upstream", 0),
        )
    }
}

fn property(host: &impl Host, path: &[&str]) -> Option<Vec<u8>> {
    match host.property(path) {
        Ok(value) => value,
        Err(e) => {
            log::debug!("property {} unreadable: {}", path.join("."), e.0);
            None
        }
    }
}

/// Envoy hands integer properties over as 8 little-endian bytes.
fn integer(bytes: &[u8]) -> Option<u64> {
    let raw: [u8; 8] = bytes.try_into().ok()?;
    u64::try_from(i64::from_le_bytes(raw)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn report(status: u16, details: &str, flags: u64, attempts: u32) -> EnvoyReport {
        EnvoyReport {
            status,
            details: Some(details.to_string()),
            flags,
            attempts: Some(attempts),
        }
    }

    #[test]
    fn the_upstreams_own_answer_is_told_from_envoys() {
        assert_eq!(
            report(500, "via_upstream", 0, 1).answerer(),
            Answerer::Upstream { resent: false }
        );
        assert_eq!(
            report(201, "via_upstream", 0, 3).answerer(),
            Answerer::Upstream { resent: true }
        );
    }

    #[test]
    fn a_route_that_answers_itself_is_that_routes_service() {
        assert_eq!(
            report(201, "direct_response", 0, 0).answerer(),
            Answerer::Upstream { resent: false }
        );
    }

    #[test]
    fn a_request_that_never_left_envoy_may_run_again() {
        for (details, flags, attempts) in [
            ("no_healthy_upstream", flag::NO_HEALTHY_UPSTREAM, 1),
            (
                "upstream_reset_before_response_started{remote_connection_failure}",
                flag::UPSTREAM_CONNECTION_FAILURE,
                1,
            ),
            (
                "upstream_reset_before_response_started{connection_failure}",
                flag::UPSTREAM_CONNECTION_FAILURE | flag::UPSTREAM_RETRY_LIMIT_EXCEEDED,
                1,
            ),
            (
                "upstream_reset_before_response_started{overflow}",
                flag::UPSTREAM_OVERFLOW,
                1,
            ),
            // An HTTP/2 stream the upstream refused (RST_STREAM REFUSED_STREAM, or above its
            // GOAWAY), as Envoy 1.36 and 1.40 report it; with a retry policy capped at none.
            (
                "upstream_reset_before_response_started{remote_refused_stream_reset}",
                flag::UPSTREAM_REMOTE_RESET,
                1,
            ),
            (
                "upstream_reset_before_response_started{remote_refused_stream_reset}",
                flag::UPSTREAM_REMOTE_RESET | flag::UPSTREAM_RETRY_LIMIT_EXCEEDED,
                1,
            ),
            ("route_not_found", flag::NO_ROUTE_FOUND, 0),
            ("cluster_not_found", flag::NO_CLUSTER_FOUND, 0),
            // A filter after this one answered: the router never ran.
            ("ext_authz_denied", 0x1000, 0),
        ] {
            assert_eq!(
                report(503, details, flags, attempts).answerer(),
                Answerer::NeverReached,
                "{details}"
            );
        }
        // The client left before the router made an attempt.
        assert_eq!(
            report(0, "downstream_remote_disconnect", 0x4000, 0).answerer(),
            Answerer::NeverReached
        );
    }

    #[test]
    fn an_answer_after_the_request_may_have_reached_the_upstream_is_unknown() {
        for (status, details, flags, attempts) in [
            (504, "response_timeout", flag::UPSTREAM_REQUEST_TIMEOUT, 1),
            (
                504,
                "upstream_per_try_timeout",
                flag::UPSTREAM_REQUEST_TIMEOUT | flag::UPSTREAM_RETRY_LIMIT_EXCEEDED,
                3,
            ),
            (
                503,
                "upstream_reset_before_response_started{connection_termination}",
                flag::UPSTREAM_CONNECTION_TERMINATION,
                1,
            ),
            (
                503,
                "upstream_reset_before_response_started{remote_reset}",
                flag::UPSTREAM_REMOTE_RESET,
                1,
            ),
            (
                502,
                "upstream_reset_before_response_started{protocol_error}",
                0x80_0000,
                1,
            ),
            // Flags tell only of the last attempt: a refused connection after an attempt
            // that was reset (seen on Envoy 1.36 and 1.40) reads as `URX,UF`.
            (
                503,
                "upstream_reset_before_response_started{remote_connection_failure}",
                flag::UPSTREAM_CONNECTION_FAILURE | flag::UPSTREAM_RETRY_LIMIT_EXCEEDED,
                2,
            ),
            // A refused stream after an earlier attempt, which may have run the write.
            (
                503,
                "upstream_reset_before_response_started{remote_refused_stream_reset}",
                flag::UPSTREAM_REMOTE_RESET | flag::UPSTREAM_RETRY_LIMIT_EXCEEDED,
                2,
            ),
            // Refused, say the details, but a flag besides `UR` says something else happened
            // too; and `UR` with another reason is a reset after the upstream took the request.
            (
                503,
                "upstream_reset_before_response_started{remote_refused_stream_reset}",
                flag::UPSTREAM_REMOTE_RESET | flag::UPSTREAM_REQUEST_TIMEOUT,
                1,
            ),
            (
                503,
                "upstream_reset_before_response_started{remote_refused_stream_reset_later}",
                flag::UPSTREAM_REMOTE_RESET,
                1,
            ),
            (
                503,
                "upstream_reset_after_response_started{remote_refused_stream_reset}",
                flag::UPSTREAM_REMOTE_RESET,
                1,
            ),
            // The client left after the router made its attempt (Envoy reports one even when
            // the request had not been written to the upstream yet).
            (0, "downstream_remote_disconnect", 0x4000, 1),
            // Envoy answered without saying why: nothing proves the upstream was not reached.
            (503, "some_future_detail", 0, 1),
        ] {
            assert_eq!(
                report(status, details, flags, attempts).answerer(),
                Answerer::Unknown,
                "{details} {flags:#x}"
            );
        }
    }

    #[test]
    fn without_details_a_clean_report_is_the_upstreams_and_a_flagged_one_is_not() {
        let mut r = EnvoyReport {
            status: 503,
            details: None,
            flags: 0,
            attempts: None,
        };
        assert_eq!(r.answerer(), Answerer::Upstream { resent: false });
        r.flags = flag::UPSTREAM_REQUEST_TIMEOUT;
        assert_eq!(r.answerer(), Answerer::Unknown);
        r.status = 0;
        r.flags = 0;
        assert_eq!(r.answerer(), Answerer::Unknown);
    }

    #[test]
    fn a_detached_writes_answer_is_told_by_envoys_fixed_replies_and_the_clock() {
        let of = |status, body: &str, elapsed| {
            EnvoyReport::of_detached(status, body.as_bytes(), elapsed, 5_000).0
        };
        assert_eq!(of(201, "{}", 10), Answerer::Upstream { resent: false });
        // The upstream's own 503 and 504 are its answers, released or recorded by policy.
        assert_eq!(
            of(503, "{\"error\":\"busy\"}", 10),
            Answerer::Upstream { resent: false }
        );
        assert_eq!(
            of(504, "gateway timeout", 10),
            Answerer::Upstream { resent: false }
        );
        assert_eq!(
            of(504, "upstream request timeout", 4_990),
            Answerer::Unknown
        );
        assert_eq!(of(504, "", 5_000), Answerer::Unknown);
        assert_eq!(
            of(200, "late but whole", 5_000),
            Answerer::Upstream { resent: false }
        );
        assert_eq!(of(0, "", 10), Answerer::Unknown);
        assert_eq!(of(503, "no healthy upstream", 1), Answerer::NeverReached);
        let reset = |reason: &str| {
            format!(
                "upstream connect error or disconnect/reset before headers. reset reason: {reason}"
            )
        };
        for reason in ["connection failure, transport failure reason: delayed connect error: Connection refused", "remote connection failure", "overflow", "remote refused stream reset"] {
            assert_eq!(of(503, &reset(reason), 3), Answerer::NeverReached, "{reason}");
        }
        for reason in [
            "connection termination",
            "remote reset",
            "protocol error",
            "something new",
        ] {
            assert_eq!(of(503, &reset(reason), 3), Answerer::Unknown, "{reason}");
        }
        let retried = "upstream connect error or disconnect/reset before headers. retried and the latest reset reason: connection termination";
        assert_eq!(of(503, retried, 3), Answerer::Unknown);
        let (_, report) = EnvoyReport::of_detached(504, b"upstream request timeout", 5_000, 5_000);
        assert_eq!(report.flags, flag::UPSTREAM_REQUEST_TIMEOUT);
        assert_eq!(
            report.details.as_deref(),
            Some("detached: upstream_timeout_ms passed")
        );
    }

    #[test]
    fn a_report_prints_what_envoy_said() {
        let refused = report(
            503,
            "upstream_reset_before_response_started{remote_refused_stream_reset}",
            flag::UPSTREAM_REMOTE_RESET,
            1,
        );
        assert_eq!(
            refused.to_string(),
            "status 503, flags UR, details \
             upstream_reset_before_response_started{remote_refused_stream_reset}, attempts 1"
        );
        let silent = EnvoyReport::default();
        assert_eq!(
            silent.to_string(),
            "status 0, flags -, details -, attempts -"
        );
    }

    #[test]
    fn flags_print_as_envoys_access_log_does() {
        assert_eq!(flag_names(0), "-");
        assert_eq!(
            flag_names(flag::UPSTREAM_REQUEST_TIMEOUT | flag::UPSTREAM_RETRY_LIMIT_EXCEEDED),
            "UT,URX"
        );
        assert_eq!(flag_names(flag::DROP_OVERLOAD), "DO");
        assert_eq!(flag_names(flag::NO_CLUSTER_FOUND), "NC");
    }

    #[test]
    fn integers_are_read_as_envoy_sends_them() {
        assert_eq!(integer(&3i64.to_le_bytes()), Some(3));
        assert_eq!(integer(&(-1i64).to_le_bytes()), None);
        assert_eq!(integer(b"3"), None);
    }
}

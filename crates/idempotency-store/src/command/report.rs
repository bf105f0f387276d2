//! What `record show` and `record purge` print: one block per record for people, or JSON
//! for machines. Times are the store's clock (`now_ms` of its answer), so an age or time
//! left does not depend on the clock of the machine the command runs on.

use std::fmt::Write as _;

use idempotency_protocol::record::flags::flag_names;
use idempotency_protocol::record::RESOLVED_HEADER;
use idempotency_protocol::record::{RecordedResponse, UnknownOutcome};
use idempotency_protocol::wire::{decode_record, RecordResponse, RecordState};
use serde_json::{json, Value};

/// One record as the store answered it, with what follows from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shown {
    pub key: String,
    pub state: RecordState,
    pub fingerprint: String,
    pub written_at_ms: Option<u64>,
    pub expires_at_ms: u64,
    pub now_ms: u64,
    /// A short hash of an in-flight claim's owner token (the store never shows the token).
    pub owner_hash: Option<String>,
    pub response: Option<Response>,
}

/// A completed record's bytes, read as the filter's recorded response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    Recorded(Summary),
    /// No response: the write's outcome is unknown (Envoy gave up on it after it may have
    /// reached the upstream, or the client left), with what Envoy reported.
    OutcomeUnknown(UnknownOutcome),
    /// Not something the filter wrote (or base64 that does not decode): reported, not fatal.
    Unreadable {
        bytes: usize,
        why: String,
    },
}

/// What a recorded response holds, without its contents. (Its `owner` is not shown: the
/// filter sends the store its responses with owner 0, the number means something only in
/// an Envoy's local table.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// The record is what the service answered when asked about an unknown outcome, or what
    /// an operator settled it with (`idempotent-resolved: true` among its headers).
    pub resolved: bool,
    pub status: u16,
    pub headers: usize,
    pub body_bytes: usize,
    pub body_omitted: bool,
    /// A gRPC response's `grpc-status` (from its trailers, or its headers when trailers-only).
    pub grpc_status: Option<u32>,
}

impl Shown {
    /// `local_now_ms` stands in for a store that does not send its clock (an older one).
    pub fn new(key: &str, answer: &RecordResponse, local_now_ms: u64) -> Self {
        let response = answer
            .record
            .as_deref()
            .map(|text| match decode_record(text) {
                Err(e) => Response::Unreadable {
                    bytes: text.len(),
                    why: format!("not base64: {e}"),
                },
                Ok(bytes) => match RecordedResponse::decode(&bytes) {
                    Some(RecordedResponse {
                        unknown: Some(unknown),
                        ..
                    }) => Response::OutcomeUnknown(*unknown),
                    Some(r) => Response::Recorded(Summary {
                        resolved: r
                            .headers
                            .iter()
                            .any(|(n, v)| n == RESOLVED_HEADER && v.as_slice() == b"true"),
                        status: r.status,
                        headers: r.headers.len(),
                        body_bytes: r.body.len(),
                        body_omitted: r.body_omitted,
                        grpc_status: idempotency_protocol::grpc_status::status_in(&r.trailers)
                            .or_else(|| idempotency_protocol::grpc_status::status_in(&r.headers))
                            .flatten(),
                    }),
                    None => Response::Unreadable {
                        bytes: bytes.len(),
                        why: "not a response recorded by the filter".to_owned(),
                    },
                },
            });
        Self {
            key: key.to_owned(),
            state: answer.state,
            fingerprint: answer.fingerprint.clone(),
            written_at_ms: answer.written_at_ms,
            expires_at_ms: answer.expires_at_ms,
            now_ms: answer.now_ms.unwrap_or(local_now_ms),
            owner_hash: answer.owner_hash.clone(),
            response,
        }
    }

    pub fn age_ms(&self) -> Option<u64> {
        self.written_at_ms.map(|at| self.now_ms.saturating_sub(at))
    }

    pub fn left_ms(&self) -> u64 {
        self.expires_at_ms.saturating_sub(self.now_ms)
    }

    fn state_name(&self) -> &'static str {
        match self.state {
            RecordState::InFlight => "in_flight",
            RecordState::Completed => "completed",
        }
    }

    /// The block people read.
    pub fn text(&self) -> String {
        let mut out = String::new();
        let mut line = |label: &str, value: String| {
            let _ = writeln!(out, "  {label:<12} {value}");
        };
        let (written, ends) = match self.state {
            RecordState::InFlight => ("claimed", "lease left"),
            RecordState::Completed => ("completed", "ttl left"),
        };
        line("key", self.key.clone());
        line("state", self.state_name().to_owned());
        line(
            "age",
            match self.age_ms() {
                Some(age) => format!(
                    "{} ({written} {})",
                    duration(age),
                    timestamp(self.now_ms.saturating_sub(age))
                ),
                None => "unknown (written by a store that did not keep the time)".to_owned(),
            },
        );
        line(
            ends,
            format!(
                "{} (until {})",
                duration(self.left_ms()),
                timestamp(self.expires_at_ms)
            ),
        );
        if let Some(hash) = &self.owner_hash {
            line("owner hash", hash.clone());
        }
        line("fingerprint", self.fingerprint.clone());
        match &self.response {
            Some(Response::Recorded(r)) => {
                if r.resolved {
                    line(
                        "resolved",
                        format!(
                            "an unknown outcome, settled as taken effect{}",
                            match self.written_at_ms {
                                Some(at) => format!(" at {}", timestamp(at)),
                                None => String::new(),
                            }
                        ),
                    );
                }
                line("status", r.status.to_string());
                if let Some(code) = r.grpc_status {
                    line(
                        "grpc status",
                        format!("{code} {}", idempotency_protocol::grpc_status::name(code)),
                    );
                }
                line("headers", r.headers.to_string());
                line(
                    "body",
                    if r.body_omitted {
                        "omitted (larger than the rule's max_response_bytes)".to_owned()
                    } else {
                        format!("{} bytes", r.body_bytes)
                    },
                );
            }
            Some(Response::OutcomeUnknown(u)) => {
                line(
                    "outcome",
                    "unknown: the first attempt may have completed; every retry is told so"
                        .to_owned(),
                );
                line(
                    "envoy said",
                    format!(
                        "status {}, flags {}, details {}, attempts {}",
                        if u.proxy_status == 0 {
                            "none (the client left)".to_owned()
                        } else {
                            u.proxy_status.to_string()
                        },
                        flag_names(u.response_flags),
                        if u.details.is_empty() {
                            "-"
                        } else {
                            &u.details
                        },
                        u.attempts
                    ),
                );
                line(
                    "resolution",
                    match u.resolution_due_ms {
                        Some(due) if due > self.now_ms => format!(
                            "pending: the service is asked at {} (in {})",
                            timestamp(due),
                            duration(due.saturating_sub(self.now_ms))
                        ),
                        Some(due) => format!(
                            "pending: the service was first to be asked at {}; the proxy \
                             resolving it retries, or is gone (settle it by hand: record \
                             resolve)",
                            timestamp(due)
                        ),
                        None => {
                            "none: settle it by hand (record resolve) or let it expire".to_owned()
                        }
                    },
                );
            }
            Some(Response::Unreadable { bytes, why }) => {
                line("response", format!("unreadable: {why} ({bytes} bytes)"));
            }
            None => {}
        }
        out
    }

    pub fn json(&self) -> Value {
        let response = match &self.response {
            Some(Response::Recorded(r)) => json!({
                "resolved": r.resolved,
                "status": r.status,
                "header_count": r.headers,
                "body_bytes": r.body_bytes,
                "body_omitted": r.body_omitted,
                "grpc_status": r.grpc_status,
            }),
            Some(Response::OutcomeUnknown(u)) => json!({
                "outcome": "unknown",
                "proxy_status": u.proxy_status,
                "response_flags": flag_names(u.response_flags),
                "details": u.details,
                "attempts": u.attempts,
                "resolution_due_ms": u.resolution_due_ms,
            }),
            Some(Response::Unreadable { bytes, why }) => {
                json!({"unreadable": why, "record_bytes": bytes})
            }
            None => Value::Null,
        };
        json!({
            "key": self.key,
            "state": self.state_name(),
            "fingerprint": self.fingerprint,
            "written_at_ms": self.written_at_ms,
            "age_ms": self.age_ms(),
            "expires_at_ms": self.expires_at_ms,
            "expires_in_ms": self.left_ms(),
            "store_now_ms": self.now_ms,
            "owner_hash": self.owner_hash,
            "response": response,
        })
    }
}

/// `850ms`, `12.3s`, `4m05s`, `3h04m`, `2d03h`: as precise as a person needs.
pub fn duration(ms: u64) -> String {
    let s = ms / 1000;
    match ms {
        0..=999 => format!("{ms}ms"),
        1_000..=59_999 => format!("{}.{}s", s, (ms % 1000) / 100),
        60_000..=3_599_999 => format!("{}m{:02}s", s / 60, s % 60),
        3_600_000..=86_399_999 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{:02}h", s / 86_400, (s % 86_400) / 3600),
    }
}

/// RFC 3339 in UTC with milliseconds, as Envoy's `%START_TIME%` logs it, so a record's
/// times can be set beside access log lines.
pub fn timestamp(unix_ms: u64) -> String {
    let days = unix_ms / 86_400_000;
    let ms_of_day = unix_ms % 86_400_000;
    let (year, month, day) = civil_date(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        ms_of_day / 3_600_000,
        (ms_of_day / 60_000) % 60,
        (ms_of_day / 1000) % 60,
        ms_of_day % 1000
    )
}

/// The Gregorian date `days` after 1970-01-01. Counts in 400-year eras (146,097 days, the
/// calendar's exact period) of years starting in March, so that a leap day ends its year.
fn civil_date(days: u64) -> (u64, u64, u64) {
    // 1970-01-01 is day 719,468 counted from 0000-03-01.
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    // Months from March: 153 days per five months.
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = era * 400 + year_of_era + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency_protocol::wire::encode_record;

    fn answer(state: RecordState, record: Option<Vec<u8>>) -> RecordResponse {
        RecordResponse {
            state,
            fingerprint: "f".repeat(64),
            expires_at_ms: 1_700_000_060_000,
            record: record.map(|r| encode_record(&r)),
            owner_hash: (state == RecordState::InFlight).then(|| "f47f40d943986712".to_owned()),
            written_at_ms: Some(1_700_000_000_000),
            now_ms: Some(1_700_000_012_345),
        }
    }

    #[test]
    fn an_in_flight_record_shows_its_age_lease_left_and_owner() {
        let shown = Shown::new("k", &answer(RecordState::InFlight, None), 0);
        let text = shown.text();
        assert!(text.contains("in_flight"), "{text}");
        assert!(
            text.contains("age          12.3s (claimed 2023-11-14T22:13:20.000Z)"),
            "{text}"
        );
        assert!(
            text.contains("lease left   47.6s (until 2023-11-14T22:14:20.000Z)"),
            "{text}"
        );
        assert!(text.contains("owner hash   f47f40d943986712"), "{text}");
        let json = shown.json();
        assert_eq!(json["age_ms"], 12_345);
        assert_eq!(json["expires_in_ms"], 47_655);
        assert_eq!(json["owner_hash"], "f47f40d943986712");
        assert!(json.get("owner").is_none(), "{json}");
        assert_eq!(json["response"], Value::Null);
    }

    #[test]
    fn an_unknown_outcome_says_so_with_what_envoy_reported() {
        let unknown = RecordedResponse::unknown_outcome(UnknownOutcome {
            proxy_status: 504,
            response_flags: 0x8004,
            details: "upstream_per_try_timeout".into(),
            attempts: 1,
            resolution_due_ms: None,
            retention: None,
        });
        let shown = Shown::new(
            "k",
            &answer(RecordState::Completed, Some(unknown.encode())),
            0,
        );
        let text = shown.text();
        assert!(text.contains("outcome      unknown"), "{text}");
        assert!(
            text.contains(
                "envoy said   status 504, flags UT,URX, details upstream_per_try_timeout, attempts 1"
            ),
            "{text}"
        );
        let json = shown.json();
        assert_eq!(json["response"]["outcome"], "unknown");
        assert_eq!(json["response"]["response_flags"], "UT,URX");
        assert_eq!(json["response"]["attempts"], 1);
    }

    #[test]
    fn a_completed_record_shows_the_recorded_response_or_why_it_cannot() {
        let recorded = RecordedResponse {
            owner: 0,
            status: 201,
            headers: vec![("content-type".into(), b"application/json".to_vec())],
            body: b"{\"id\":1}".to_vec(),
            trailers: Vec::new(),
            body_omitted: false,
            unknown: None,
        };
        let shown = Shown::new(
            "k",
            &answer(RecordState::Completed, Some(recorded.encode())),
            0,
        );
        let text = shown.text();
        for needle in [
            "completed",
            "ttl left",
            "status       201",
            "headers      1",
            "8 bytes",
        ] {
            assert!(text.contains(needle), "{needle} in {text}");
        }
        assert_eq!(shown.json()["response"]["status"], 201);
        let omitted = RecordedResponse {
            body: vec![],
            body_omitted: true,
            ..recorded.clone()
        };
        let shown = Shown::new(
            "k",
            &answer(RecordState::Completed, Some(omitted.encode())),
            0,
        );
        assert!(shown.text().contains("body         omitted"));
        assert!(!shown.text().contains("grpc status"));
        assert_eq!(shown.json()["response"]["grpc_status"], Value::Null);
        let grpc = RecordedResponse {
            trailers: vec![("grpc-status".into(), b"5".to_vec())],
            ..recorded.clone()
        };
        let shown = Shown::new("k", &answer(RecordState::Completed, Some(grpc.encode())), 0);
        assert!(
            shown.text().contains("grpc status  5 NOT_FOUND"),
            "{}",
            shown.text()
        );
        assert_eq!(shown.json()["response"]["grpc_status"], 5);
        let junk = Shown::new(
            "k",
            &answer(RecordState::Completed, Some(b"junk".to_vec())),
            0,
        );
        assert!(junk
            .text()
            .contains("unreadable: not a response recorded by the filter (4 bytes)"));
        let mut not_base64 = answer(RecordState::Completed, None);
        not_base64.record = Some("!!".to_owned());
        assert!(Shown::new("k", &not_base64, 0)
            .text()
            .contains("not base64"));
    }

    #[test]
    fn an_old_record_has_no_age_and_an_old_store_no_clock() {
        let mut old = answer(RecordState::InFlight, None);
        old.written_at_ms = None;
        old.now_ms = None;
        let shown = Shown::new("k", &old, 1_700_000_050_000);
        assert!(shown.text().contains("age          unknown"));
        assert_eq!(shown.json()["age_ms"], Value::Null);
        assert_eq!(shown.left_ms(), 10_000, "measured on the local clock then");
    }

    #[test]
    fn durations_and_timestamps_read_like_logs() {
        assert_eq!(duration(850), "850ms");
        assert_eq!(duration(12_345), "12.3s");
        assert_eq!(duration(245_000), "4m05s");
        assert_eq!(duration(11_040_000), "3h04m");
        assert_eq!(duration(190_800_000), "2d05h");
        assert_eq!(timestamp(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(timestamp(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(timestamp(951_868_800_000), "2000-03-01T00:00:00.000Z");
        assert_eq!(timestamp(1_709_251_199_999), "2024-02-29T23:59:59.999Z");
        assert_eq!(timestamp(4_102_444_800_000), "2100-01-01T00:00:00.000Z");
    }
}

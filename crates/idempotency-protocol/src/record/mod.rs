//! The recorded response: what a retry gets back. Encoded compactly because it is copied
//! in and out of Envoy's shared data (and sent to the store as opaque bytes).

pub mod flags;
pub mod reader;

use reader::Reader;

const MAGIC: &[u8; 4] = b"IDR1";
const FLAG_BODY_OMITTED: u8 = 1;
/// The record is an unknown outcome; what Envoy reported follows the body.
const FLAG_OUTCOME_UNKNOWN: u8 = 2;
/// Trailers follow the body (a gRPC response's status and trailing metadata).
const FLAG_TRAILERS: u8 = 4;
/// An unknown outcome the filter is resolving: when it next asks the service follows what
/// Envoy reported.
const FLAG_RESOLUTION_PENDING: u8 = 8;
/// An unknown outcome that carries how long a resolution that took effect keeps the key
/// (`Retention`): its two durations follow the due time, if any.
const FLAG_RETENTION: u8 = 16;
/// Envoy's details string is kept to this many bytes (its own strings are far shorter).
const MAX_DETAILS_BYTES: usize = 255;

/// The response header that says until when a key is remembered, on the first recorded
/// answer and on every replay (an HTTP-date, like `Expires`): a client then knows how long a
/// retry with this key is safe. The IETF draft leaves this open; the name is this filter's.
pub const KEY_EXPIRES_HEADER: &str = "idempotency-key-expires";
/// The marker a replay of a resolved record carries: its response is what the service said
/// when asked, not the first attempt's own answer.
pub const RESOLVED_HEADER: &str = "idempotent-resolved";

/// `KEY_EXPIRES_HEADER`'s value for a record kept until `expires_at_ms`.
pub fn key_expires_value(expires_at_ms: u64) -> String {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(expires_at_ms);
    httpdate::fmt_http_date(at)
}

/// A write that reached the upstream (or may have) without an answer from it: Envoy's router
/// timed out, the connection was reset after the request was sent, or the client left. The
/// write may have happened, so its key stays taken and every retry is told so. What Envoy
/// reported is kept for the operator (`idempotency-store record show`, the access log).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct UnknownOutcome {
    /// The status Envoy answered the first attempt with; 0 when the client left before any.
    pub proxy_status: u16,
    /// Envoy's response flags (the legacy bit vector of `response.flags`).
    pub response_flags: u64,
    /// `response.code_details`, as Envoy set it (cut to 255 bytes).
    pub details: String,
    /// `upstream.request_attempt_count`: how many times the router sent the request.
    pub attempts: u32,
    /// The rule resolves unknown outcomes (`resolve`) and this one is not settled yet: when
    /// the service is next asked (ms since the epoch), which a retry is told to wait for.
    /// None: nobody will ask (no `resolve`, or its attempts ran out: an operator settles it).
    pub resolution_due_ms: Option<u64>,
    /// How long the key is kept once the write is found to have taken effect: the rule's,
    /// carried here so that every way of settling it (the filter's lookup, an operator's
    /// `record resolve`) keeps the same record and tombstone. None: recorded by a filter
    /// that did not carry it.
    pub retention: Option<Retention>,
}

/// A rule's `ttl_seconds` and `tombstone_seconds`, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Retention {
    pub ttl_ms: u64,
    pub tombstone_ms: u64,
}

/// A response as recorded for replay.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecordedResponse {
    /// The claim that produced it, so a reader can tell it belongs to the slot it read.
    pub owner: u64,
    pub status: u16,
    /// Lower-case names, in upstream order, already filtered for replay.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    /// Lower-case names, in upstream order: a gRPC response's `grpc-status`, `grpc-message`
    /// and trailing metadata (empty for HTTP, and for a trailers-only gRPC response, whose
    /// status is among its headers).
    pub trailers: Vec<(String, Vec<u8>)>,
    /// The body exceeded the rule's cap and was not recorded.
    pub body_omitted: bool,
    /// Set when no response was recorded because the write's outcome is unknown (then
    /// `status` is 0, and headers and body are empty): a retry is told, never replayed.
    /// (Boxed: rare, and records are moved around a lot.)
    pub unknown: Option<Box<UnknownOutcome>>,
}

impl RecordedResponse {
    /// What is left of a record whose response is gone from the local table (its page was
    /// reused) but whose slot still says how it ended: its status, marked as omitted, or for
    /// an unknown outcome (status 0), that.
    pub fn status_only(status: u16) -> RecordedResponse {
        if status == 0 {
            return RecordedResponse::unknown_outcome(UnknownOutcome::default());
        }
        RecordedResponse {
            status,
            body_omitted: true,
            ..RecordedResponse::default()
        }
    }

    /// The record as its tombstone keeps it: status, headers and trailers, the body dropped
    /// and marked as omitted (a record with no body keeps its look).
    pub fn without_body(&self) -> RecordedResponse {
        RecordedResponse {
            owner: self.owner,
            status: self.status,
            headers: self.headers.clone(),
            body: Vec::new(),
            trailers: self.trailers.clone(),
            body_omitted: self.body_omitted || !self.body.is_empty(),
            unknown: self.unknown.clone(),
        }
    }

    /// The record of a write whose outcome is unknown.
    pub fn unknown_outcome(outcome: UnknownOutcome) -> RecordedResponse {
        RecordedResponse {
            unknown: Some(Box::new(outcome)),
            ..RecordedResponse::default()
        }
    }
}

/// Whether `bytes` are the record of a write whose outcome is unknown: the only record a
/// settle may replace or remove (a recorded response is never overwritten or freed by one).
pub fn is_unknown_outcome(bytes: &[u8]) -> bool {
    RecordedResponse::decode(bytes).is_some_and(|record| record.unknown.is_some())
}

impl RecordedResponse {
    pub fn encode(&self) -> Vec<u8> {
        self.encode_as(self.owner)
    }

    /// Its encoding under another claim's `owner` (the table stamps the claim that records
    /// it without copying the response to do so).
    pub fn encode_as(&self, owner: u64) -> Vec<u8> {
        let headers_len: usize = self
            .headers
            .iter()
            .map(|(n, v)| 6 + n.len() + v.len())
            .sum();
        let mut out = Vec::with_capacity(4 + 8 + 2 + 1 + 2 + headers_len + 4 + self.body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&owner.to_be_bytes());
        out.extend_from_slice(&self.status.to_be_bytes());
        let mut flags = 0;
        if self.body_omitted {
            flags |= FLAG_BODY_OMITTED;
        }
        if self.unknown.is_some() {
            flags |= FLAG_OUTCOME_UNKNOWN;
        }
        if !self.trailers.is_empty() {
            flags |= FLAG_TRAILERS;
        }
        if self
            .unknown
            .as_ref()
            .is_some_and(|u| u.resolution_due_ms.is_some())
        {
            flags |= FLAG_RESOLUTION_PENDING;
        }
        if self.unknown.as_ref().is_some_and(|u| u.retention.is_some()) {
            flags |= FLAG_RETENTION;
        }
        out.push(flags);
        encode_pairs(&mut out, &self.headers);
        let body_len = u32::try_from(self.body.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&body_len.to_be_bytes());
        out.extend_from_slice(self.body.get(..body_len as usize).unwrap_or(&self.body));
        if !self.trailers.is_empty() {
            encode_pairs(&mut out, &self.trailers);
        }
        if let Some(unknown) = &self.unknown {
            out.extend_from_slice(&unknown.proxy_status.to_be_bytes());
            out.extend_from_slice(&unknown.response_flags.to_be_bytes());
            out.extend_from_slice(&unknown.attempts.to_be_bytes());
            let details = cut_at_char(&unknown.details, MAX_DETAILS_BYTES).as_bytes();
            out.push(details.len() as u8);
            out.extend_from_slice(details);
            if let Some(due) = unknown.resolution_due_ms {
                out.extend_from_slice(&due.to_be_bytes());
            }
            if let Some(retention) = unknown.retention {
                out.extend_from_slice(&retention.ttl_ms.to_be_bytes());
                out.extend_from_slice(&retention.tombstone_ms.to_be_bytes());
            }
        }
        out
    }

    /// None for anything that is not a complete, well-formed record.
    pub fn decode(bytes: &[u8]) -> Option<RecordedResponse> {
        let mut r = Reader::new(bytes);
        if r.take(4)? != MAGIC {
            return None;
        }
        let owner = r.u64()?;
        let status = r.u16()?;
        let flags = r.u8()?;
        let headers = decode_pairs(&mut r)?;
        let body_len = r.u32()?;
        let body = r.take(usize::try_from(body_len).ok()?)?.to_vec();
        let trailers = if flags & FLAG_TRAILERS != 0 {
            // The flag is set only for trailers: an empty list is not an encoding.
            Some(decode_pairs(&mut r)?).filter(|t| !t.is_empty())?
        } else {
            Vec::new()
        };
        let unknown = if flags & FLAG_OUTCOME_UNKNOWN != 0 {
            let proxy_status = r.u16()?;
            let response_flags = r.u64()?;
            let attempts = r.u32()?;
            let details_len = r.u8()?;
            let details = std::str::from_utf8(r.take(usize::from(details_len))?).ok()?;
            let resolution_due_ms = if flags & FLAG_RESOLUTION_PENDING != 0 {
                Some(r.u64()?)
            } else {
                None
            };
            let retention = if flags & FLAG_RETENTION != 0 {
                Some(Retention {
                    ttl_ms: r.u64()?,
                    tombstone_ms: r.u64()?,
                })
            } else {
                None
            };
            Some(Box::new(UnknownOutcome {
                proxy_status,
                response_flags,
                details: details.to_string(),
                attempts,
                resolution_due_ms,
                retention,
            }))
        } else {
            None
        };
        if !r.is_empty() {
            return None;
        }
        Some(RecordedResponse {
            owner,
            status,
            headers,
            body,
            trailers,
            body_omitted: flags & FLAG_BODY_OMITTED != 0,
            unknown,
        })
    }
}

/// A count, then each name (16-bit length) and value (32-bit length). Counts and lengths
/// saturate at what the format holds; Envoy's own limits are far lower.
fn encode_pairs(out: &mut Vec<u8>, pairs: &[(String, Vec<u8>)]) {
    let count = u16::try_from(pairs.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&count.to_be_bytes());
    for (name, value) in pairs.iter().take(usize::from(count)) {
        let name = name.as_bytes();
        let name = name.get(..usize::from(u16::MAX)).unwrap_or(name);
        let value = value.get(..u32::MAX as usize).unwrap_or(value);
        out.extend_from_slice(&(name.len() as u16).to_be_bytes());
        out.extend_from_slice(name);
        out.extend_from_slice(&(value.len() as u32).to_be_bytes());
        out.extend_from_slice(value);
    }
}

fn decode_pairs(r: &mut Reader<'_>) -> Option<Vec<(String, Vec<u8>)>> {
    let count = r.u16()?;
    let mut pairs = Vec::with_capacity(usize::from(count).min(64));
    for _ in 0..count {
        let name_len = r.u16()?;
        let name = std::str::from_utf8(r.take(usize::from(name_len))?).ok()?;
        let value_len = r.u32()?;
        let value = r.take(usize::try_from(value_len).ok()?)?;
        pairs.push((name.to_string(), value.to_vec()));
    }
    Some(pairs)
}

/// The longest prefix of `text` of at most `max` bytes that ends on a character boundary.
fn cut_at_char(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or("")
}

/// An RFC 9110 token character (`tchar`).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Why a header of a record cannot be sent to Envoy, if it cannot.
fn unsafe_header(name: &str, value: &[u8]) -> Option<String> {
    if name.is_empty() || !name.bytes().all(is_tchar) {
        let shown: String = name
            .chars()
            .take(64)
            .flat_map(char::escape_default)
            .collect();
        return Some(format!("header name '{shown}' is not a token"));
    }
    if value.iter().any(|b| matches!(b, b'\r' | b'\n' | 0)) {
        return Some(format!("header '{name}' has CR, LF or NUL in its value"));
    }
    None
}

impl RecordedResponse {
    /// Whether every header can be replayed as it is: a token for a name (so no pseudo-header
    /// either) and no CR, LF or NUL in a value. Envoy never hands the filter such headers, so
    /// a record that has them was not written by a sound filter; it is checked before any of
    /// it reaches Envoy, where a line break in a value could split the replayed response.
    pub fn check_headers(&self) -> Result<(), String> {
        match self
            .headers
            .iter()
            .chain(self.trailers.iter())
            .find_map(|(name, value)| unsafe_header(name, value))
        {
            Some(why) => Err(why),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    fn sample() -> RecordedResponse {
        RecordedResponse {
            owner: 42,
            status: 201,
            headers: vec![
                ("content-type".into(), b"application/json".to_vec()),
                ("x-bin".into(), vec![0, 255, 10]),
            ],
            body: b"{\"id\":1}".to_vec(),
            trailers: Vec::new(),
            body_omitted: false,
            unknown: None,
        }
    }

    #[test]
    fn only_an_unknown_outcome_is_one() {
        let unknown = RecordedResponse::unknown_outcome(UnknownOutcome::default()).encode();
        assert!(is_unknown_outcome(&unknown));
        assert!(!is_unknown_outcome(&sample().encode()));
        assert!(!is_unknown_outcome(
            &RecordedResponse::status_only(504).encode()
        ));
        assert!(!is_unknown_outcome(b"IDR1 unknown"), "not a record at all");
        let cut = unknown.get(..unknown.len() - 1).unwrap_or_default();
        assert!(!is_unknown_outcome(cut));
    }

    #[test]
    fn round_trips_byte_for_byte() {
        let r = sample();
        assert_eq!(RecordedResponse::decode(&r.encode()), Some(r));
        let omitted = RecordedResponse {
            body: vec![],
            body_omitted: true,
            ..sample()
        };
        assert_eq!(RecordedResponse::decode(&omitted.encode()), Some(omitted));
    }

    #[test]
    fn a_grpc_response_round_trips_with_its_trailers_and_older_records_still_read() {
        let grpc = RecordedResponse {
            trailers: vec![
                ("grpc-status".into(), b"0".to_vec()),
                ("grpc-status-details-bin".into(), b"CAkSBG5vcGU".to_vec()),
            ],
            ..sample()
        };
        let bytes = grpc.encode();
        assert_eq!(RecordedResponse::decode(&bytes), Some(grpc));
        for cut in 0..bytes.len() {
            assert_eq!(
                RecordedResponse::decode(&bytes[..cut]),
                None,
                "cut at {cut}"
            );
        }
        // A record without trailers is encoded as before they existed (no flag, no section).
        let plain = sample().encode();
        assert_eq!(plain.get(14).map(|f| f & FLAG_TRAILERS), Some(0));
        assert!(RecordedResponse::decode(&plain).is_some_and(|r| r.trailers.is_empty()));
    }

    #[test]
    fn an_unknown_outcome_round_trips_with_what_envoy_reported() {
        let r = RecordedResponse::unknown_outcome(UnknownOutcome {
            proxy_status: 504,
            response_flags: 0x8004,
            details: "upstream_per_try_timeout".into(),
            attempts: 1,
            resolution_due_ms: None,
            retention: None,
        });
        let decoded = RecordedResponse::decode(&r.encode()).unwrap();
        assert_eq!(decoded, r);
        assert_eq!(decoded.status, 0);
        // One being resolved says when the service is next asked, and reads back whole only.
        let pending = RecordedResponse::unknown_outcome(UnknownOutcome {
            resolution_due_ms: Some(1_764_000_000_000),
            ..(*r.unknown.clone().unwrap())
        });
        let bytes = pending.encode();
        assert_eq!(RecordedResponse::decode(&bytes), Some(pending.clone()));
        assert_eq!(RecordedResponse::decode(&bytes[..bytes.len() - 1]), None);
        // One that carries its retention, with a due time and without.
        for due in [Some(1_764_000_000_000), None] {
            let kept = RecordedResponse::unknown_outcome(UnknownOutcome {
                resolution_due_ms: due,
                retention: Some(Retention {
                    ttl_ms: 86_400_000,
                    tombstone_ms: 15_552_000_000,
                }),
                ..(*pending.unknown.clone().unwrap())
            });
            let bytes = kept.encode();
            assert_eq!(RecordedResponse::decode(&bytes), Some(kept));
            assert_eq!(RecordedResponse::decode(&bytes[..bytes.len() - 1]), None);
        }
        // Details beyond what the record keeps are cut on a character boundary.
        let long = RecordedResponse::unknown_outcome(UnknownOutcome {
            details: "é".repeat(200),
            ..UnknownOutcome::default()
        });
        let decoded = RecordedResponse::decode(&long.encode()).unwrap();
        let details = decoded.unknown.unwrap().details;
        assert_eq!(details.len(), 254);
        assert!(details.chars().all(|c| c == 'é'));
        // Lost from the table but for its slot's status 0, it is still an unknown outcome.
        assert!(RecordedResponse::status_only(0).unknown.is_some());
        assert!(RecordedResponse::status_only(201).unknown.is_none());
    }

    #[test]
    fn a_header_value_beyond_64_kib_round_trips_whole() {
        // The value's length field is 32 bits: such a value must not be cut to 16 bits' worth
        // (a replay would carry another header than the one recorded). Found by fuzzing.
        let r = RecordedResponse {
            headers: vec![("x-large".into(), vec![b'v'; 70_000])],
            ..sample()
        };
        assert_eq!(RecordedResponse::decode(&r.encode()), Some(r));
    }

    #[test]
    fn truncated_or_padded_input_is_refused() {
        let bytes = sample().encode();
        for cut in 0..bytes.len() {
            assert_eq!(
                RecordedResponse::decode(&bytes[..cut]),
                None,
                "cut at {cut}"
            );
        }
        let mut padded = bytes.clone();
        padded.push(0);
        assert_eq!(RecordedResponse::decode(&padded), None);
        assert_eq!(
            RecordedResponse::decode(b"garbage that is long enough"),
            None
        );
    }

    #[test]
    fn unsafe_header_names_and_values_are_found() {
        // The sample's binary value (NUL, LF) round-trips but is not replayable.
        assert!(sample().check_headers().unwrap_err().contains("'x-bin'"));
        let ok = RecordedResponse {
            headers: vec![
                ("x-tab-and-bytes".into(), b"a\tb \x7f\xff".to_vec()),
                ("X-Odd_Name!#$%&'*+.^`|~".into(), Vec::new()),
            ],
            ..sample()
        };
        assert_eq!(ok.check_headers(), Ok(()));
        for (name, value, needle) in [
            ("x-split", &b"a\r\nset-cookie: s=1"[..], "CR, LF or NUL"),
            ("x-lf", &b"a\nb"[..], "CR, LF or NUL"),
            ("x-cr", &b"a\r"[..], "CR, LF or NUL"),
            ("x-nul", &b"a\0b"[..], "CR, LF or NUL"),
            ("", &b"v"[..], "not a token"),
            (":status", &b"200"[..], "not a token"),
            ("bad name", &b"v"[..], "not a token"),
            ("x-a\r\nx-b", &b"v"[..], "'x-a\\r\\nx-b' is not a token"),
            ("caf\u{e9}", &b"v"[..], "not a token"),
        ] {
            let r = RecordedResponse {
                headers: vec![
                    ("content-type".into(), b"text/plain".to_vec()),
                    (name.to_string(), value.to_vec()),
                ],
                ..sample()
            };
            let why = r.check_headers().unwrap_err();
            assert!(why.contains(needle), "{name:?}: {why}");
            // The binary format itself carries them: the check is a separate step.
            assert_eq!(RecordedResponse::decode(&r.encode()), Some(r));
        }
    }
}

//! The recorded response: what a retry gets back. Encoded compactly because it is copied
//! in and out of Envoy's shared data (and sent to the store as opaque bytes).

use crate::wire::Reader;

const MAGIC: &[u8; 4] = b"IDR1";
const FLAG_BODY_OMITTED: u8 = 1;

/// A response as recorded for replay.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RecordedResponse {
    /// The claim that produced it, so a reader can tell it belongs to the slot it read.
    pub owner: u64,
    pub status: u16,
    /// Lower-case names, in upstream order, already filtered for replay.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
    /// The body exceeded the rule's cap and was not recorded.
    pub body_omitted: bool,
}

impl RecordedResponse {
    pub fn encode(&self) -> Vec<u8> {
        let headers_len: usize = self
            .headers
            .iter()
            .map(|(n, v)| 6 + n.len() + v.len())
            .sum();
        let mut out = Vec::with_capacity(4 + 8 + 2 + 1 + 2 + headers_len + 4 + self.body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.owner.to_be_bytes());
        out.extend_from_slice(&self.status.to_be_bytes());
        out.push(if self.body_omitted {
            FLAG_BODY_OMITTED
        } else {
            0
        });
        // Counts and lengths saturate at what the format holds; Envoy's own limits are far lower.
        let count = u16::try_from(self.headers.len()).unwrap_or(u16::MAX);
        out.extend_from_slice(&count.to_be_bytes());
        for (name, value) in self.headers.iter().take(usize::from(count)) {
            let name = name.as_bytes();
            let name = name.get(..usize::from(u16::MAX)).unwrap_or(name);
            let value = value.get(..u32::MAX as usize).unwrap_or(value);
            out.extend_from_slice(&(name.len() as u16).to_be_bytes());
            out.extend_from_slice(name);
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value);
        }
        let body_len = u32::try_from(self.body.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&body_len.to_be_bytes());
        out.extend_from_slice(self.body.get(..body_len as usize).unwrap_or(&self.body));
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
        let count = r.u16()?;
        let mut headers = Vec::with_capacity(usize::from(count).min(64));
        for _ in 0..count {
            let name_len = r.u16()?;
            let name = std::str::from_utf8(r.take(usize::from(name_len))?).ok()?;
            let value_len = r.u32()?;
            let value = r.take(usize::try_from(value_len).ok()?)?;
            headers.push((name.to_string(), value.to_vec()));
        }
        let body_len = r.u32()?;
        let body = r.take(usize::try_from(body_len).ok()?)?.to_vec();
        if !r.is_empty() {
            return None;
        }
        Some(RecordedResponse {
            owner,
            status,
            headers,
            body,
            body_omitted: flags & FLAG_BODY_OMITTED != 0,
        })
    }
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
            body_omitted: false,
        }
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

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
            let value = value.get(..usize::from(u16::MAX)).unwrap_or(value);
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
}

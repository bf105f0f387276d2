//! SHA-256 digests: record keys and request fingerprints. The filter computes them as bytes;
//! the wire (and the store's keys) carry them as 64 lowercase hex characters.

/// A SHA-256 digest as the filter computes it.
pub type Digest = [u8; 32];

/// Length of a digest's hex text.
pub const HEX_LEN: usize = 64;

/// Lowercase hex of a digest: its wire form.
pub fn to_hex(digest: &Digest) -> String {
    // Every request's access log and store call hex-encodes a digest: a table lookup, not
    // the formatting machinery (`write!` per byte was 6 % of a request's own work in V8).
    let mut text = [0u8; HEX_LEN];
    match hex::encode_to_slice(digest, &mut text) {
        Ok(()) => String::from_utf8(text.to_vec()).unwrap_or_default(),
        // Unreachable: the buffer is exactly twice the digest's length, and hex is ASCII.
        Err(_) => String::new(),
    }
}

/// A digest in its wire form, as a request names it: 64 hex characters, normalised to
/// lowercase so that `AB..` and `ab..` name one record. Ordered as its text, which is also
/// the order of the bytes, so a store can index records by it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HexDigest(String);

impl HexDigest {
    pub const HEX_LEN: usize = HEX_LEN;

    /// Accepts either case; the error says what is wrong, for a 400's detail.
    pub fn parse(raw: &str) -> Result<Self, &'static str> {
        if raw.len() != HEX_LEN {
            return Err("must be exactly 64 hex characters");
        }
        if !raw.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err("must contain only hex characters [0-9a-fA-F]");
        }
        Ok(Self(raw.to_ascii_lowercase()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The digest's 32 bytes, for a store that keys records by bytes (half the text's size).
    /// None only if the text were not what `parse` and `From` make (it always is).
    pub fn to_bytes(&self) -> Option<Digest> {
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(&self.0, &mut bytes).ok()?;
        Some(bytes)
    }
}

impl From<&Digest> for HexDigest {
    fn from(digest: &Digest) -> Self {
        Self(to_hex(digest))
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn hex_is_lowercase_and_orders_like_the_bytes() {
        let low: Digest = std::array::from_fn(|i| (i as u8).wrapping_mul(8));
        let h = to_hex(&low);
        assert_eq!(h.len(), HEX_LEN);
        assert!(h.starts_with("00081018") && h.ends_with("f8"), "{h}");
        let mut high = low;
        high[1] = 0xa0;
        assert!(HexDigest::from(&low) < HexDigest::from(&high));
    }

    #[test]
    fn bytes_round_trip_through_the_text() {
        let bytes: Digest = std::array::from_fn(|i| (i as u8).wrapping_mul(37));
        assert_eq!(HexDigest::from(&bytes).to_bytes(), Some(bytes));
        let parsed = HexDigest::parse(&"Fe".repeat(32)).map(|h| h.to_bytes());
        assert_eq!(parsed, Ok(Some([0xfe; 32])));
    }

    #[test]
    fn parse_normalises_case_and_names_the_fault() {
        let upper = "AB".repeat(32);
        assert_eq!(
            HexDigest::parse(&upper).map(|h| h.as_str().to_owned()),
            Ok("ab".repeat(32))
        );
        assert_eq!(HexDigest::parse(&upper), Ok(HexDigest::from(&[0xab; 32])));
        assert_eq!(
            HexDigest::parse("ab"),
            Err("must be exactly 64 hex characters")
        );
        assert_eq!(
            HexDigest::parse(&"zz".repeat(32)),
            Err("must contain only hex characters [0-9a-fA-F]")
        );
    }
}

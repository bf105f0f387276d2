//! The request fingerprint: a retry must carry the same payload as the original.

use sha2::{Digest as _, Sha256};

use crate::key::{hash_field, Digest};

/// SHA-256 over the method, the path with its query, and the body.
pub fn request_fingerprint(method: &[u8], path_with_query: &[u8], body: &[u8]) -> Digest {
    let mut h = Sha256::new();
    hash_field(&mut h, b"idempotency-filter/fingerprint/v1");
    hash_field(&mut h, method);
    hash_field(&mut h, path_with_query);
    hash_field(&mut h, body);
    h.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn every_part_of_the_request_counts() {
        let base = request_fingerprint(b"POST", b"/orders?x=1", b"{\"a\":1}");
        assert_eq!(
            base,
            request_fingerprint(b"POST", b"/orders?x=1", b"{\"a\":1}")
        );
        assert_ne!(
            base,
            request_fingerprint(b"PATCH", b"/orders?x=1", b"{\"a\":1}")
        );
        assert_ne!(
            base,
            request_fingerprint(b"POST", b"/orders?x=2", b"{\"a\":1}")
        );
        assert_ne!(
            base,
            request_fingerprint(b"POST", b"/orders?x=1", b"{\"a\":2}")
        );
        assert_ne!(
            request_fingerprint(b"POST", b"/a", b"b"),
            request_fingerprint(b"POST", b"/ab", b"")
        );
    }
}

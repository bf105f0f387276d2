//! The request fingerprint: a retry must carry the same payload as the original.

use sha2::{Digest as _, Sha256};

use idempotency_protocol::naming::fields::path_without_query;
use idempotency_protocol::naming::fields::RequestBody;
use idempotency_protocol::naming::source::{FieldSource, SourceFailure};
use idempotency_protocol::naming::{hash_field, Digest};

/// What of the request the fingerprint covers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum FingerprintMode {
    /// Method, path with query, and the body byte for byte.
    #[default]
    Body,
    /// Method, path without query, and the selected body fields, canonical: JSON key order
    /// and whitespace do not matter. For senders that re-sign or re-stamp each delivery.
    Fields(Vec<FieldSource>),
    /// No payload check: any request with the key replays the first one.
    None,
}

impl FingerprintMode {
    pub fn needs_body(&self) -> bool {
        !matches!(self, FingerprintMode::None)
    }
}

/// What the request speaks. A record answers only the protocol that made it: a gRPC call's
/// frames and trailers are no answer to an HTTP request, nor the other way round. The body
/// modes tell them apart by the bytes (a call's body is framed); `None` needs it said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Http,
    Grpc,
}

/// SHA-256 over the method, the path with its query, and the body.
pub fn request_fingerprint(method: &[u8], path_with_query: &[u8], body: &[u8]) -> Digest {
    let mut h = Sha256::new();
    hash_field(&mut h, b"idempotency-filter/fingerprint/v1");
    hash_field(&mut h, method);
    hash_field(&mut h, path_with_query);
    hash_field(&mut h, body);
    h.finalize().into()
}

/// The fingerprint a rule's mode asks for.
pub fn fingerprint(
    mode: &FingerprintMode,
    method: &str,
    path_with_query: &str,
    body: &mut RequestBody<'_>,
    raw_body: &[u8],
    protocol: Protocol,
) -> Result<Digest, SourceFailure> {
    match mode {
        FingerprintMode::Body => Ok(request_fingerprint(
            method.as_bytes(),
            path_with_query.as_bytes(),
            raw_body,
        )),
        FingerprintMode::None => {
            let mut h = Sha256::new();
            // HTTP's stays what it was, so records made before still match.
            hash_field(&mut h, b"idempotency-filter/fingerprint/none/v1");
            if protocol == Protocol::Grpc {
                hash_field(&mut h, b"grpc");
            }
            Ok(h.finalize().into())
        }
        FingerprintMode::Fields(fields) => {
            let mut h = Sha256::new();
            hash_field(&mut h, b"idempotency-filter/fingerprint/fields/v1");
            hash_field(&mut h, method.as_bytes());
            hash_field(&mut h, path_without_query(path_with_query).as_bytes());
            for field in fields {
                // A JSON pointer names one value (a member named twice on the way is an
                // error); a form field may legitimately repeat, and then every value counts.
                let values: Vec<Vec<u8>> = match field {
                    FieldSource::Json(pointer) => body
                        .json_canonical(pointer)
                        .map(|v| v.into_iter().collect()),
                    FieldSource::Form(name) => body.form_values(name),
                    FieldSource::Header(_) | FieldSource::Query(_) => Ok(Vec::new()),
                }
                .map_err(|e| {
                    SourceFailure::invalid(format!("fingerprint {}", field.describe()), e)
                })?;
                hash_values(&mut h, &values);
            }
            Ok(h.finalize().into())
        }
    }
}

/// Absent, one value, or several: the first two are hashed as they always were, so the
/// fingerprints of records made before repeated form fields counted stay the same.
fn hash_values(h: &mut Sha256, values: &[Vec<u8>]) {
    match values {
        [] => h.update([0u8]),
        [one] => {
            h.update([1u8]);
            hash_field(h, one);
        }
        many => {
            h.update([2u8]);
            h.update((many.len() as u64).to_be_bytes());
            for v in many {
                hash_field(h, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

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

    fn fp(
        mode: &FingerprintMode,
        path: &str,
        ct: &str,
        body: &[u8],
    ) -> Result<Digest, SourceFailure> {
        let mut parsed = RequestBody::new(ct, body);
        fingerprint(mode, "POST", path, &mut parsed, body, Protocol::Http)
    }

    #[test]
    fn selected_fields_ignore_key_order_whitespace_and_other_fields() {
        let mode = FingerprintMode::Fields(vec![
            FieldSource::Json("/amount".into()),
            FieldSource::Json("/currency".into()),
        ]);
        let a = fp(
            &mode,
            "/cb?sig=1",
            "application/json",
            br#"{"amount":{"v":1,"u":2},"currency":"EUR","ts":1}"#,
        )
        .unwrap();
        let b = fp(
            &mode,
            "/cb?sig=2",
            "application/json",
            br#"{ "ts": 2, "currency":"EUR", "amount": {"u":2, "v":1} }"#,
        )
        .unwrap();
        assert_eq!(a, b);
        let c = fp(
            &mode,
            "/cb",
            "application/json",
            br#"{"amount":{"v":1,"u":3},"currency":"EUR"}"#,
        )
        .unwrap();
        assert_ne!(a, c);
        // An absent field differs from any present value.
        let d = fp(
            &mode,
            "/cb",
            "application/json",
            br#"{"amount":{"v":1,"u":2}}"#,
        )
        .unwrap();
        assert_ne!(a, d);
        assert!(fp(&mode, "/cb", "application/json", b"not json").is_err());
    }

    #[test]
    fn form_fields_and_none() {
        let mode = FingerprintMode::Fields(vec![FieldSource::Form("total_fee".into())]);
        let ct = "application/x-www-form-urlencoded";
        assert_eq!(
            fp(&mode, "/notify", ct, b"total_fee=1.00&sign=aa").unwrap(),
            fp(&mode, "/notify", ct, b"sign=bb&total_fee=1.00").unwrap()
        );
        let none = FingerprintMode::None;
        assert_eq!(
            fp(&none, "/a", "", b"x").unwrap(),
            fp(&none, "/b", "", b"y").unwrap()
        );
        assert!(!none.needs_body() && FingerprintMode::Body.needs_body());
    }

    #[test]
    fn json_numbers_count_by_their_text() {
        let mode = FingerprintMode::Fields(vec![FieldSource::Json("/amount".into())]);
        let ct = "application/json";
        let a = fp(
            &mode,
            "/cb",
            ct,
            br#"{"amount":1234567890123456789012345678}"#,
        )
        .unwrap();
        let b = fp(
            &mode,
            "/cb",
            ct,
            br#"{"amount":1234567890123456789012345679}"#,
        )
        .unwrap();
        assert_ne!(a, b);
        assert_ne!(
            fp(&mode, "/cb", ct, br#"{"amount":1.5}"#).unwrap(),
            fp(&mode, "/cb", ct, br#"{"amount":1.50}"#).unwrap()
        );
        let dup = fp(&mode, "/cb", ct, br#"{"amount":1,"amount":2}"#).unwrap_err();
        assert!(dup.why().contains("more than once"), "{}", dup.why());
        assert_eq!(dup.source(), "fingerprint JSON body field '/amount'");
    }

    #[test]
    fn repeated_form_fields_all_count_and_bad_encodings_fail() {
        let mode = FingerprintMode::Fields(vec![FieldSource::Form("item".into())]);
        let ct = "application/x-www-form-urlencoded";
        let two = fp(&mode, "/n", ct, b"item=a&item=b").unwrap();
        assert_ne!(two, fp(&mode, "/n", ct, b"item=a&item=c").unwrap());
        assert_ne!(two, fp(&mode, "/n", ct, b"item=b&item=a").unwrap());
        assert_ne!(two, fp(&mode, "/n", ct, b"item=a").unwrap());
        // One value hashes as it always did.
        let mut h = Sha256::new();
        hash_field(&mut h, b"idempotency-filter/fingerprint/fields/v1");
        hash_field(&mut h, b"POST");
        hash_field(&mut h, b"/n");
        h.update([1u8]);
        hash_field(&mut h, b"a b");
        let expected: Digest = h.finalize().into();
        assert_eq!(fp(&mode, "/n?q", ct, b"item=a+b&x=1").unwrap(), expected);
        let bad = fp(&mode, "/n", ct, b"item=%zz").unwrap_err();
        assert!(bad.why().contains("percent-encoding"), "{}", bad.why());
        assert!(!bad.is_missing());
    }
}

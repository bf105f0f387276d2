//! The idempotency key: parsing the header value and deriving the scoped storage key.

pub mod fields;
pub mod rule;
pub mod source;

use sha2::{Digest as _, Sha256};
use std::fmt;

/// A SHA-256 digest (storage keys and fingerprints) and its lowercase hex, for logs and the
/// store protocol: the protocol crate's, which the store shares.
pub use crate::digest::{to_hex, Digest};

/// Longest key accepted, in bytes (Stripe's limit; the draft recommends UUIDs).
pub const MAX_KEY_BYTES: usize = 255;

/// Why a key header value was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyError {
    Empty,
    TooLong { len: usize },
    InvalidByte { position: usize },
    MalformedQuotedString,
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::Empty => write!(f, "the key is empty"),
            KeyError::TooLong { len } => {
                write!(
                    f,
                    "the key is {len} bytes long; at most {MAX_KEY_BYTES} are allowed"
                )
            }
            KeyError::InvalidByte { position } => write!(
                f,
                "the key has a byte outside visible ASCII (0x21-0x7E) at position {position}"
            ),
            KeyError::MalformedQuotedString => write!(
                f,
                "the key starts with a double quote but is not a valid structured-field string"
            ),
        }
    }
}

fn is_visible(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

/// Parses an `Idempotency-Key` value: an sf-string (`"abc"`, with `\"` and `\\` escapes) or a
/// bare token (`abc`). Both forms of the same key are the same key.
pub fn parse_key(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let trimmed = trim_ows(raw);
    let key = match trimmed.split_first() {
        Some((b'"', rest)) => unquote(rest)?,
        _ => {
            if let Some(position) = trimmed.iter().position(|&b| !is_visible(b)) {
                return Err(KeyError::InvalidByte { position });
            }
            trimmed.to_vec()
        }
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(KeyError::TooLong { len: key.len() });
    }
    Ok(key)
}

fn trim_ows(raw: &[u8]) -> &[u8] {
    let start = raw.iter().position(|b| *b != b' ' && *b != b'\t');
    let end = raw.iter().rposition(|b| *b != b' ' && *b != b'\t');
    match (start, end) {
        (Some(s), Some(e)) => raw.get(s..=e).unwrap_or(&[]),
        _ => &[],
    }
}

/// `rest` is everything after the opening quote.
fn unquote(rest: &[u8]) -> Result<Vec<u8>, KeyError> {
    let mut out = Vec::with_capacity(rest.len());
    let mut iter = rest.iter().enumerate();
    while let Some((i, &b)) = iter.next() {
        match b {
            b'\\' => match iter.next() {
                Some((_, &escaped @ (b'"' | b'\\'))) => out.push(escaped),
                _ => return Err(KeyError::MalformedQuotedString),
            },
            b'"' => {
                // The closing quote must end the value.
                return if i + 1 == rest.len() {
                    Ok(out)
                } else {
                    Err(KeyError::MalformedQuotedString)
                };
            }
            b if is_visible(b) => out.push(b),
            _ => return Err(KeyError::InvalidByte { position: i + 1 }),
        }
    }
    Err(KeyError::MalformedQuotedString)
}

/// Feeds length-prefixed fields into a hash so that no two field lists hash alike.
pub fn hash_field(hasher: &mut Sha256, field: &[u8]) {
    hasher.update((field.len() as u64).to_be_bytes());
    hasher.update(field);
}

/// The storage key: SHA-256 over the rule, the scope values (absent differs from empty) and
/// the key. Raw keys and credentials never leave this function.
/// Hex digits of a storage key that name it in the access log and in log lines: 64 bits,
/// distinct for every record a store holds in practice, short in a line.
pub const SHORT_HASH_HEX: usize = 16;

/// The first [`SHORT_HASH_HEX`] hex digits of a storage key.
pub fn short_hash(key: &Digest) -> String {
    let mut hex = to_hex(key);
    hex.truncate(SHORT_HASH_HEX);
    hex
}

pub fn storage_key(rule_name: &str, scope_values: &[Option<&[u8]>], key: &[u8]) -> Digest {
    let mut h = Sha256::new();
    hash_field(&mut h, b"idempotency-filter/storage-key/v1");
    hash_field(&mut h, rule_name.as_bytes());
    h.update((scope_values.len() as u64).to_be_bytes());
    for value in scope_values {
        match value {
            Some(v) => {
                h.update([1u8]);
                hash_field(&mut h, v);
            }
            None => h.update([0u8]),
        }
    }
    hash_field(&mut h, key);
    h.finalize().into()
}

/// Leads every multi-value scope encoding. No valid HTTP field value contains NUL, and a lone
/// value that starts with it is encoded like a list too, so no encoding can pass for a value.
const MULTI_VALUE_MARKER: u8 = 0;

/// One scope header's contribution to the storage key, from every value the request carries
/// for it, in order (a caller cannot hide a second value behind the first). None when the
/// header is absent. A single value is used as it is, so records stored before repeated
/// headers counted keep their storage keys across an upgrade. Anything else is the marker,
/// the count and each value length-prefixed: absent, empty, one value and several values
/// never encode alike.
pub fn scope_value(values: &[&[u8]]) -> Option<Vec<u8>> {
    match values {
        [] => None,
        [one] if one.first() != Some(&MULTI_VALUE_MARKER) => Some(one.to_vec()),
        many => {
            let len = many.iter().map(|v| 8 + v.len()).sum::<usize>();
            let mut out = Vec::with_capacity(9 + len);
            out.push(MULTI_VALUE_MARKER);
            out.extend_from_slice(&(many.len() as u64).to_be_bytes());
            for v in many {
                out.extend_from_slice(&(v.len() as u64).to_be_bytes());
                out.extend_from_slice(v);
            }
            Some(out)
        }
    }
}

/// The scope of one request, one entry per configured header (see [`scope_value`]).
/// With `required`, a header other than `:authority` that is absent or only blank is
/// named in the error: such callers would otherwise share one scope and could replay each
/// other's responses.
pub fn request_scope<'h, 'v>(
    scope_headers: &'h [String],
    required: bool,
    values_of: impl Fn(&str) -> Vec<&'v [u8]>,
) -> Result<Vec<Option<Vec<u8>>>, &'h str> {
    let mut scope = Vec::with_capacity(scope_headers.len());
    for name in scope_headers {
        let values = values_of(name);
        let identifies = values.iter().any(|v| !v.trim_ascii().is_empty());
        if required && !identifies && name != ":authority" {
            return Err(name);
        }
        scope.push(scope_value(&values));
    }
    Ok(scope)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn bare_and_quoted_forms_are_the_same_key() {
        assert_eq!(parse_key(b"abc-123").unwrap(), b"abc-123");
        assert_eq!(parse_key(b"\"abc-123\"").unwrap(), b"abc-123");
        assert_eq!(parse_key(b"  \"a\\\"b\\\\c\"  ").unwrap(), b"a\"b\\c");
    }

    #[test]
    fn bad_keys_are_refused_with_a_reason() {
        assert_eq!(parse_key(b""), Err(KeyError::Empty));
        assert_eq!(parse_key(b"   "), Err(KeyError::Empty));
        assert_eq!(parse_key(b"\"\""), Err(KeyError::Empty));
        assert_eq!(parse_key(&[b'a'; 256]), Err(KeyError::TooLong { len: 256 }));
        assert!(parse_key(&[b'a'; 255]).is_ok());
        assert_eq!(
            parse_key(b"ab c"),
            Err(KeyError::InvalidByte { position: 2 })
        );
        assert_eq!(
            parse_key("caf\u{e9}".as_bytes()),
            Err(KeyError::InvalidByte { position: 3 })
        );
        assert_eq!(parse_key(b"\"abc"), Err(KeyError::MalformedQuotedString));
        assert_eq!(parse_key(b"\"ab\"c"), Err(KeyError::MalformedQuotedString));
        assert_eq!(
            parse_key(b"\"a\\nb\""),
            Err(KeyError::MalformedQuotedString)
        );
        assert_eq!(
            parse_key(b"\"a b\""),
            Err(KeyError::InvalidByte { position: 2 })
        );
    }

    #[test]
    fn storage_key_depends_on_rule_scope_and_key() {
        let base = storage_key("orders", &[Some(b"api"), Some(b"Bearer a")], b"k1");
        assert_ne!(
            base,
            storage_key("payments", &[Some(b"api"), Some(b"Bearer a")], b"k1")
        );
        assert_ne!(
            base,
            storage_key("orders", &[Some(b"api"), Some(b"Bearer b")], b"k1")
        );
        assert_ne!(
            base,
            storage_key("orders", &[Some(b"api"), Some(b"Bearer a")], b"k2")
        );
        assert_eq!(
            base,
            storage_key("orders", &[Some(b"api"), Some(b"Bearer a")], b"k1")
        );
        // Absent and empty scope values are different callers.
        assert_ne!(
            storage_key("orders", &[None], b"k"),
            storage_key("orders", &[Some(b"")], b"k")
        );
        // Moving bytes between fields changes the digest.
        assert_ne!(
            storage_key("orders", &[Some(b"ab")], b"c"),
            storage_key("orders", &[Some(b"a")], b"bc")
        );
    }

    #[test]
    fn a_single_scope_value_hashes_as_before_repeated_headers_counted() {
        // Pinned: a storage key computed by earlier releases. Changing it would orphan every
        // record stored before an upgrade.
        let one = scope_value(&[b"Bearer a"]);
        assert_eq!(one.as_deref(), Some(&b"Bearer a"[..]));
        let digest = storage_key("orders", &[Some(b"api"), one.as_deref()], b"k1");
        assert_eq!(
            to_hex(&digest),
            "a6df2d0df2d2a81489c8dcb9622e05d28bf3c78be8881699b2f4ce2c55d74d43"
        );
        assert_eq!(scope_value(&[]), None);
        assert_eq!(scope_value(&[b""]).as_deref(), Some(&b""[..]));
    }

    #[test]
    fn every_value_of_a_repeated_scope_header_counts() {
        let key = |values: &[&[u8]]| {
            let v = scope_value(values);
            storage_key("orders", &[v.as_deref()], b"k")
        };
        let two = key(&[b"tenant-a", b"tenant-b"]);
        // The first value alone, the other value alone, the other order: other callers.
        assert_ne!(two, key(&[b"tenant-a"]));
        assert_ne!(two, key(&[b"tenant-b"]));
        assert_ne!(two, key(&[b"tenant-b", b"tenant-a"]));
        assert_eq!(two, key(&[b"tenant-a", b"tenant-b"]));
        // Absent, empty, one empty value among two, two empty values: all different.
        let variants = [
            key(&[]),
            key(&[b""]),
            key(&[b"", b""]),
            key(&[b"a", b""]),
            key(&[b"", b"a"]),
            key(&[b"a"]),
            key(&[b"ab"]),
            key(&[b"a", b"b"]),
        ];
        for (i, a) in variants.iter().enumerate() {
            for b in variants.iter().skip(i + 1) {
                assert_ne!(a, b);
            }
        }
        // Moving bytes between values changes the scope.
        assert_ne!(key(&[b"ab", b"c"]), key(&[b"a", b"bc"]));
        // A lone value cannot pose as the encoding of a list.
        let list = scope_value(&[b"a", b"b"]).unwrap();
        assert_ne!(key(&[&list]), two);
    }

    #[test]
    fn a_required_scope_names_the_first_absent_header() {
        let headers = vec![
            ":authority".to_string(),
            "authorization".to_string(),
            "x-tenant".to_string(),
        ];
        let request = |present: &'static [(&'static str, &'static [u8])]| {
            move |name: &str| -> Vec<&'static [u8]> {
                present
                    .iter()
                    .filter(|(n, _)| *n == name)
                    .map(|(_, v)| *v)
                    .collect()
            }
        };
        let anonymous = request(&[(":authority", b"api"), ("x-tenant", b"t1")]);
        assert_eq!(
            request_scope(&headers, true, anonymous),
            Err("authorization")
        );
        // Not required: the anonymous scope is kept, absent differing from empty.
        let scope = request_scope(&headers, false, anonymous).unwrap();
        assert_eq!(
            scope,
            vec![Some(b"api".to_vec()), None, Some(b"t1".to_vec())]
        );
        // A blank value identifies nobody either.
        let blank = request(&[
            (":authority", b"api"),
            ("authorization", b"  "),
            ("x-tenant", b"t1"),
        ]);
        assert_eq!(request_scope(&headers, true, blank), Err("authorization"));
        // :authority is never required (HTTP/1.0 requests may lack it).
        let no_host = request(&[("authorization", b"Bearer a"), ("x-tenant", b"t1")]);
        let scope = request_scope(&headers, true, no_host).unwrap();
        assert_eq!(scope.first(), Some(&None));
        let repeated = request(&[
            (":authority", b"api"),
            ("authorization", b"Bearer a"),
            ("x-tenant", b"t1"),
            ("x-tenant", b"t2"),
        ]);
        let scope = request_scope(&headers, true, repeated).unwrap();
        assert_eq!(scope.get(2), Some(&scope_value(&[b"t1", b"t2"])));
    }

    #[test]
    fn hex_is_lower_case() {
        let mut d = [0u8; 32];
        d[0] = 0xab;
        d[31] = 0x01;
        let h = to_hex(&d);
        assert!(h.starts_with("ab00") && h.ends_with("01") && h.len() == 64);
    }
}

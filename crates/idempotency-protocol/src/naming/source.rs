//! Where a rule takes its idempotency key from: one or several request headers, query
//! parameters, JSON body fields (RFC 6901 pointers) or form fields, combined into one key.

use crate::naming::fields::{query_value, FieldError, RequestBody};
use crate::naming::{parse_key, KeyError, MAX_KEY_BYTES};

/// One place a key value (or a fingerprinted field) is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FieldSource {
    /// Lower-case header name.
    Header(String),
    Query(String),
    /// JSON Pointer into a JSON body.
    Json(String),
    /// Field of an `application/x-www-form-urlencoded` body.
    Form(String),
}

impl FieldSource {
    pub fn in_body(&self) -> bool {
        matches!(self, FieldSource::Json(_) | FieldSource::Form(_))
    }

    /// The JSON Pointer of a JSON body field.
    pub fn json_pointer(&self) -> Option<&str> {
        match self {
            FieldSource::Json(p) => Some(p),
            FieldSource::Header(_) | FieldSource::Query(_) | FieldSource::Form(_) => None,
        }
    }

    /// How problem details and logs name the source.
    pub fn describe(&self) -> String {
        match self {
            FieldSource::Header(h) => format!("header '{h}'"),
            FieldSource::Query(q) => format!("query parameter '{q}'"),
            FieldSource::Json(p) => format!("JSON body field '{p}'"),
            FieldSource::Form(f) => format!("form field '{f}'"),
        }
    }
}

/// A key source that failed, and how: absent, or present but unusable. A rule with an
/// optional key lets a request without one pass, never one with a malformed one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceFailure {
    Missing { source: String },
    Invalid { source: String, why: String },
}

impl SourceFailure {
    fn missing(source: &FieldSource) -> SourceFailure {
        SourceFailure::Missing {
            source: source.describe(),
        }
    }

    pub fn invalid(source: impl Into<String>, why: impl std::fmt::Display) -> SourceFailure {
        SourceFailure::Invalid {
            source: source.into(),
            why: why.to_string(),
        }
    }

    fn from_field(source: &FieldSource, e: FieldError) -> SourceFailure {
        match e {
            FieldError::Missing => SourceFailure::missing(source),
            other => SourceFailure::invalid(source.describe(), other),
        }
    }

    pub fn is_missing(&self) -> bool {
        matches!(self, SourceFailure::Missing { .. })
    }

    /// How the problem details name the source.
    pub fn source(&self) -> &str {
        match self {
            SourceFailure::Missing { source } | SourceFailure::Invalid { source, .. } => source,
        }
    }

    pub fn why(&self) -> &str {
        match self {
            SourceFailure::Missing { .. } => "it is missing",
            SourceFailure::Invalid { why, .. } => why,
        }
    }
}

/// Values of the sources readable from the request headers; body sources stay None until
/// the body has arrived.
pub fn header_parts<'h>(
    sources: &[FieldSource],
    header: impl Fn(&str) -> Option<&'h [u8]>,
    path_with_query: &str,
) -> Result<Vec<Option<Vec<u8>>>, SourceFailure> {
    sources
        .iter()
        .map(|source| match source {
            FieldSource::Header(name) => match header(name) {
                None => Err(SourceFailure::missing(source)),
                Some(raw) => parse_key(raw)
                    .map(Some)
                    .map_err(|e: KeyError| SourceFailure::invalid(source.describe(), e)),
            },
            FieldSource::Query(name) => match query_value(path_with_query, name) {
                Ok(None) => Err(SourceFailure::missing(source)),
                Ok(Some(v)) => checked_value(source, v).map(Some),
                Err(e) => Err(SourceFailure::from_field(source, e)),
            },
            FieldSource::Json(_) | FieldSource::Form(_) => Ok(None),
        })
        .collect()
}

fn checked_value(source: &FieldSource, value: Vec<u8>) -> Result<Vec<u8>, SourceFailure> {
    if value.is_empty() {
        return Err(SourceFailure::invalid(
            source.describe(),
            "the value is empty",
        ));
    }
    if value.len() > MAX_KEY_BYTES {
        return Err(SourceFailure::invalid(
            source.describe(),
            format!(
                "the value is {} bytes long; at most {MAX_KEY_BYTES} are allowed",
                value.len()
            ),
        ));
    }
    Ok(value)
}

/// Fills in the body sources and combines every part into the key.
pub fn complete_key(
    sources: &[FieldSource],
    parts: Vec<Option<Vec<u8>>>,
    body: &mut RequestBody<'_>,
) -> Result<Vec<u8>, SourceFailure> {
    key_values(sources, parts, body).map(combine)
}

/// Each source's value, in the rule's order: `complete_key` before they are combined (a
/// lookup's path names them one by one).
pub fn key_values(
    sources: &[FieldSource],
    parts: Vec<Option<Vec<u8>>>,
    body: &mut RequestBody<'_>,
) -> Result<Vec<Vec<u8>>, SourceFailure> {
    let mut values = Vec::with_capacity(sources.len());
    for (source, part) in sources.iter().zip(parts) {
        let value = match (part, source) {
            (Some(v), _) => v,
            (None, FieldSource::Json(pointer)) => body
                .json_scalar(pointer)
                .map_err(|e| SourceFailure::from_field(source, e))?,
            (None, FieldSource::Form(name)) => body
                .form_value(name)
                .map_err(|e| SourceFailure::from_field(source, e))?
                .ok_or_else(|| SourceFailure::missing(source))?,
            (None, _) => return Err(SourceFailure::missing(source)),
        };
        values.push(checked_value(source, value)?);
    }
    Ok(values)
}

/// One value is the key itself; several are length-prefixed so that no two different lists
/// of values give the same key.
pub fn combine(mut values: Vec<Vec<u8>>) -> Vec<u8> {
    if values.len() == 1 {
        return values.pop().unwrap_or_default();
    }
    let mut out = Vec::with_capacity(values.iter().map(|v| v.len() + 4).sum::<usize>() + 4);
    out.extend_from_slice(&(values.len() as u32).to_be_bytes());
    for v in values {
        out.extend_from_slice(&(v.len() as u32).to_be_bytes());
        out.extend_from_slice(&v);
    }
    out
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn headers<'a>(pairs: &'a [(&'a str, &'a [u8])]) -> impl Fn(&str) -> Option<&'a [u8]> + 'a {
        move |name| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
    }

    #[test]
    fn header_and_query_sources_need_no_body() {
        let sources = vec![
            FieldSource::Header("ce-source".into()),
            FieldSource::Header("ce-id".into()),
            FieldSource::Query("order_no".into()),
        ];
        let h: &[(&str, &[u8])] = &[("ce-source", b"/shop"), ("ce-id", b"\"42\"")];
        let parts = header_parts(&sources, headers(h), "/x?order_no=7").unwrap();
        let mut body = RequestBody::new("", b"");
        let key = complete_key(&sources, parts, &mut body).unwrap();
        let h2: &[(&str, &[u8])] = &[("ce-source", b"/shop"), ("ce-id", b"42")];
        let parts2 = header_parts(&sources, headers(h2), "/x?order_no=7").unwrap();
        assert_eq!(key, complete_key(&sources, parts2, &mut body).unwrap());
    }

    #[test]
    fn composite_keys_do_not_collide_when_bytes_move_between_values() {
        assert_ne!(
            combine(vec![b"ab".to_vec(), b"c".to_vec()]),
            combine(vec![b"a".to_vec(), b"bc".to_vec()])
        );
        assert_eq!(combine(vec![b"only".to_vec()]), b"only");
    }

    #[test]
    fn body_sources_are_read_after_the_body() {
        let sources = vec![FieldSource::Json("/transaction/id".into())];
        let parts = header_parts(&sources, |_| None, "/cb").unwrap();
        assert_eq!(parts, vec![None]);
        let mut body = RequestBody::new("application/json", br#"{"transaction":{"id":"tx-9"}}"#);
        assert_eq!(complete_key(&sources, parts, &mut body).unwrap(), b"tx-9");
    }

    #[test]
    fn failures_name_the_source() {
        let sources = vec![FieldSource::Header("x-github-delivery".into())];
        let e = header_parts(&sources, |_| None, "/").unwrap_err();
        assert!(e.is_missing() && e.source() == "header 'x-github-delivery'");

        let sources = vec![FieldSource::Json("/id".into())];
        for (ct, body, missing, needle) in [
            ("application/json", &br#"{"other":1}"#[..], true, "missing"),
            (
                "application/json",
                &br#"{"id":{"a":1}}"#[..],
                false,
                "not a string",
            ),
            ("application/json", &br#"{"id":""}"#[..], false, "empty"),
            ("application/json", &b"{oops"[..], false, "invalid JSON"),
            ("text/plain", &br#"{"id":"x"}"#[..], false, "not JSON"),
        ] {
            let mut b = RequestBody::new(ct, body);
            let e = complete_key(&sources, vec![None], &mut b).unwrap_err();
            assert_eq!(e.is_missing(), missing, "{ct} {body:?}");
            assert!(e.why().contains(needle), "{}", e.why());
            assert_eq!(e.source(), "JSON body field '/id'");
        }
        let long = format!("/x?k={}", "a".repeat(256));
        let e = header_parts(&[FieldSource::Query("k".into())], |_| None, &long).unwrap_err();
        assert!(e.why().contains("256 bytes"));
    }

    #[test]
    fn undecodable_or_repeated_form_and_query_keys_fail_naming_the_source() {
        let form = "application/x-www-form-urlencoded";
        let sources = vec![FieldSource::Form("trade_no".into())];
        for (body, needle) in [
            (&b"trade_no=%zz"[..], "invalid percent-encoding ('%zz')"),
            (&b"trade_no=%ff"[..], "not UTF-8"),
            (&b"trade_no=1&trade_no=2"[..], "more than once"),
        ] {
            let mut b = RequestBody::new(form, body);
            let e = complete_key(&sources, vec![None], &mut b).unwrap_err();
            assert!(!e.is_missing(), "{body:?}");
            assert_eq!(e.source(), "form field 'trade_no'");
            assert!(e.why().contains(needle), "{}", e.why());
        }
        let sources = vec![FieldSource::Query("order_no".into())];
        for (path, needle) in [
            ("/c?order_no=%4", "invalid percent-encoding ('%4')"),
            ("/c?order_no=%C3%28", "not UTF-8"),
            ("/c?order_no=1&order_no=1", "more than once"),
        ] {
            let e = header_parts(&sources, |_| None, path).unwrap_err();
            assert!(!e.is_missing(), "{path}");
            assert_eq!(e.source(), "query parameter 'order_no'");
            assert!(e.why().contains(needle), "{}", e.why());
        }
    }

    #[test]
    fn big_json_numbers_are_different_keys() {
        let sources = vec![FieldSource::Json("/id".into())];
        let key = |body: &[u8]| {
            let mut b = RequestBody::new("application/json", body);
            complete_key(&sources, vec![None], &mut b).unwrap()
        };
        assert_ne!(
            key(br#"{"id":1234567890123456789012345678}"#),
            key(br#"{"id":1234567890123456789012345679}"#)
        );
        let mut b = RequestBody::new("application/json", br#"{"id":1,"id":2}"#);
        let e = complete_key(&sources, vec![None], &mut b).unwrap_err();
        assert!(
            !e.is_missing() && e.why().contains("more than once"),
            "{e:?}"
        );
    }
}

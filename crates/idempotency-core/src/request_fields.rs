//! Values taken from the request itself: query parameters, and fields of a JSON or
//! `application/x-www-form-urlencoded` body. The body is parsed once and shared by the key
//! sources and the fingerprint fields.
//!
//! Every value is read losslessly: two requests whose field differs never yield the same
//! bytes. JSON numbers are kept as their literal text (see [`Json`]), and form or query values
//! are percent-decoded strictly: an invalid escape, a value that is not UTF-8 once decoded, or
//! a key field given twice is an error rather than a guess.

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// Why a field could not be read (the caller names the source).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FieldError {
    Missing,
    NotScalar,
    WrongContentType {
        expected: &'static str,
        actual: String,
    },
    Unparseable(String),
    /// The field (or, for JSON, an object member on its pointer) appears more than once:
    /// which one the upstream reads is unknown, so none is picked.
    Duplicate,
    /// The value's percent-encoding is invalid, or the decoded value is not UTF-8.
    BadEncoding(String),
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FieldError::Missing => write!(f, "the field is missing"),
            FieldError::NotScalar => {
                write!(f, "the field is not a string, number or boolean")
            }
            FieldError::WrongContentType { expected, actual } => {
                write!(f, "the body is not {expected} (content-type: '{actual}')")
            }
            FieldError::Unparseable(why) => write!(f, "the body cannot be parsed: {why}"),
            FieldError::Duplicate => write!(f, "the field appears more than once"),
            FieldError::BadEncoding(why) => write!(f, "{why}"),
        }
    }
}

/// A parsed JSON document that keeps what `serde_json::Value` loses: each number's literal
/// text (a `Value` turns integers beyond u64 into f64, so two different 28-digit ids became
/// the same key) and every member of an object in document order, duplicates included.
///
/// How: serde_json parses and validates the document into this tree with numbers as
/// placeholders, then the literal texts are read from the (now known valid) bytes in document
/// order, which is the order the parser visited them ([`number_literals`]). Two alternatives
/// were rejected. serde_json's `arbitrary_precision` feature would be unified by Cargo into
/// every crate built with this one (the filter's configuration, the store), changing their
/// `Number`/`Value` and breaking numbers inside untagged or flattened serde types.
/// `RawValue` keeps literal text only for values a type asks for in advance, so finding the
/// numbers inside a fingerprinted subtree would re-parse it once per nesting level (up to
/// 128 times the body). If a change of features ever made serde_json hand numbers to the
/// visitor differently, the count check in [`parse_json`] fails loudly (every JSON body with
/// a number would be refused, and the unit tests catch it) instead of keying by the wrong text.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Json {
    Null,
    Bool(bool),
    /// The number's literal text, exactly as sent. `100`, `1e2` and `100.0` are different
    /// values here: the key and the fingerprint follow the bytes the sender chose, since any
    /// normalisation loses precision somewhere (and a retry resends the same bytes).
    Number(String),
    String(String),
    Array(Vec<Json>),
    /// Members in document order, duplicates kept.
    Object(Vec<(String, Json)>),
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }

    // Numbers get their text afterwards, from the document itself.
    fn visit_i64<E>(self, _: i64) -> Result<Json, E> {
        Ok(Json::Number(String::new()))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Json, E> {
        Ok(Json::Number(String::new()))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Json, E> {
        Ok(Json::Number(String::new()))
    }

    fn visit_str<E>(self, v: &str) -> Result<Json, E> {
        Ok(Json::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Json, E> {
        Ok(Json::String(v))
    }

    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_none<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Json>()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut members = Vec::new();
        while let Some(member) = map.next_entry::<String, Json>()? {
            members.push(member);
        }
        Ok(Json::Object(members))
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Json, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

/// The literal text of every number in a valid JSON document, in document order. Outside
/// strings, a JSON number is exactly a run that starts with `-` or a digit (`true`, `false`
/// and `null` start with letters); inside strings only `\` (escaping the next byte) and the
/// closing `"` matter. Only ever run on bytes serde_json has accepted.
fn number_literals(bytes: &[u8]) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut in_string = false;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if in_string {
            match b {
                b'\\' => i += 1,
                b'"' => in_string = false,
                _ => {}
            }
            i += 1;
        } else if b == b'"' {
            in_string = true;
            i += 1;
        } else if b == b'-' || b.is_ascii_digit() {
            let start = i;
            while bytes
                .get(i)
                .is_some_and(|c| matches!(c, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E'))
            {
                i += 1;
            }
            let text = std::str::from_utf8(bytes.get(start..i)?).ok()?;
            out.push(text.to_owned());
        } else {
            i += 1;
        }
    }
    Some(out)
}

fn parse_json(bytes: &[u8]) -> Result<Json, FieldError> {
    let mut doc: Json = serde_json::from_slice(bytes)
        .map_err(|e| FieldError::Unparseable(format!("invalid JSON: {e}")))?;
    let mut literals = number_literals(bytes).unwrap_or_default().into_iter();
    if !doc.fill_numbers(&mut literals) || literals.next().is_some() {
        return Err(FieldError::Unparseable(
            "the numbers of the JSON document could not be located".to_string(),
        ));
    }
    Ok(doc)
}

/// An RFC 6901 array index, as serde_json reads it: decimal, no sign, no leading zero.
fn array_index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

impl Json {
    /// Gives each number placeholder its literal text, walking in document order; false when
    /// the document has more numbers than texts.
    fn fill_numbers(&mut self, literals: &mut impl Iterator<Item = String>) -> bool {
        match self {
            Json::Number(text) => match literals.next() {
                Some(t) => {
                    *text = t;
                    true
                }
                None => false,
            },
            Json::Array(items) => items.iter_mut().all(|item| item.fill_numbers(literals)),
            Json::Object(members) => members
                .iter_mut()
                .all(|(_, value)| value.fill_numbers(literals)),
            Json::Null | Json::Bool(_) | Json::String(_) => true,
        }
    }

    /// The value at an RFC 6901 pointer, None when absent. An object member named twice on
    /// the way is an error: serde_json would take the last, other parsers the first, so the
    /// upstream may well read another value than the key.
    fn pointer(&self, pointer: &str) -> Result<Option<&Json>, FieldError> {
        if pointer.is_empty() {
            return Ok(Some(self));
        }
        let Some(rest) = pointer.strip_prefix('/') else {
            return Ok(None);
        };
        let mut node = self;
        for raw in rest.split('/') {
            let token = raw.replace("~1", "/").replace("~0", "~");
            node = match node {
                Json::Object(members) => {
                    let mut found = members.iter().filter(|(k, _)| *k == token);
                    match (found.next(), found.next()) {
                        (None, _) => return Ok(None),
                        (Some((_, v)), None) => v,
                        (Some(_), Some(_)) => return Err(FieldError::Duplicate),
                    }
                }
                Json::Array(items) => match array_index(&token).and_then(|i| items.get(i)) {
                    Some(v) => v,
                    None => return Ok(None),
                },
                Json::Null | Json::Bool(_) | Json::Number(_) | Json::String(_) => return Ok(None),
            };
        }
        Ok(Some(node))
    }

    /// Canonical text: members sorted by name (stably, so duplicates keep their order and
    /// all count), no insignificant whitespace, strings escaped as serde_json does, numbers
    /// as sent. For values without duplicates or non-integer numbers this is byte for byte
    /// what `serde_json::Value` printed before, so fingerprints of such bodies are unchanged.
    fn write_canonical(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        match self {
            Json::Null => out.extend_from_slice(b"null"),
            Json::Bool(true) => out.extend_from_slice(b"true"),
            Json::Bool(false) => out.extend_from_slice(b"false"),
            Json::Number(text) => out.extend_from_slice(text.as_bytes()),
            Json::String(s) => serde_json::to_writer(&mut *out, s)?,
            Json::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    item.write_canonical(out)?;
                }
                out.push(b']');
            }
            Json::Object(members) => {
                let mut sorted: Vec<&(String, Json)> = members.iter().collect();
                sorted.sort_by(|a, b| a.0.cmp(&b.0));
                out.push(b'{');
                for (i, (name, value)) in sorted.into_iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    serde_json::to_writer(&mut *out, name)?;
                    out.push(b':');
                    value.write_canonical(out)?;
                }
                out.push(b'}');
            }
        }
        Ok(())
    }
}

/// The request body, parsed lazily as whatever the sources need.
pub struct RequestBody<'a> {
    content_type: &'a str,
    bytes: &'a [u8],
    json: Option<Result<Json, FieldError>>,
}

fn is_json_type(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

fn is_form_type(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .eq_ignore_ascii_case("application/x-www-form-urlencoded")
}

impl<'a> RequestBody<'a> {
    pub fn new(content_type: &'a str, bytes: &'a [u8]) -> RequestBody<'a> {
        RequestBody {
            content_type,
            bytes,
            json: None,
        }
    }

    fn json(&mut self) -> Result<&Json, FieldError> {
        let content_type = self.content_type;
        let bytes = self.bytes;
        let parsed = self.json.get_or_insert_with(|| {
            if is_json_type(content_type) {
                parse_json(bytes)
            } else {
                Err(FieldError::WrongContentType {
                    expected: "JSON",
                    actual: content_type.to_string(),
                })
            }
        });
        parsed.as_ref().map_err(Clone::clone)
    }

    fn form(&self) -> Result<&'a [u8], FieldError> {
        if is_form_type(self.content_type) {
            Ok(self.bytes)
        } else {
            Err(FieldError::WrongContentType {
                expected: "application/x-www-form-urlencoded",
                actual: self.content_type.to_string(),
            })
        }
    }

    /// A scalar JSON field by JSON Pointer (RFC 6901), as the bytes of its value: a string's
    /// content, a number's literal text, or `true`/`false`.
    pub fn json_scalar(&mut self, pointer: &str) -> Result<Vec<u8>, FieldError> {
        match self.json()?.pointer(pointer)? {
            None => Err(FieldError::Missing),
            Some(Json::String(s)) => Ok(s.as_bytes().to_vec()),
            Some(Json::Number(text)) => Ok(text.as_bytes().to_vec()),
            Some(Json::Bool(b)) => Ok(b.to_string().into_bytes()),
            Some(Json::Null | Json::Array(_) | Json::Object(_)) => Err(FieldError::NotScalar),
        }
    }

    /// Any JSON field, canonical (sorted keys, no insignificant whitespace, numbers as sent),
    /// or None when absent.
    pub fn json_canonical(&mut self, pointer: &str) -> Result<Option<Vec<u8>>, FieldError> {
        let Some(value) = self.json()?.pointer(pointer)? else {
            return Ok(None);
        };
        let mut out = Vec::new();
        value
            .write_canonical(&mut out)
            .map_err(|e| FieldError::Unparseable(format!("invalid JSON: {e}")))?;
        Ok(Some(out))
    }

    /// The value of a form field that must appear at most once (a key source).
    pub fn form_value(&mut self, name: &str) -> Result<Option<Vec<u8>>, FieldError> {
        single_value(self.form()?, name)
    }

    /// Every value of a form field, in order (a fingerprinted field: forms legitimately
    /// repeat fields, and each value counts).
    pub fn form_values(&mut self, name: &str) -> Result<Vec<Vec<u8>>, FieldError> {
        pairs(self.form()?)
            .filter(|(n, _)| n == name.as_bytes())
            .map(|(_, v)| decode_value(v))
            .collect()
    }
}

/// The value of query parameter `name` in a `:path`, percent-decoded; an error when the
/// parameter is given twice or its value is not validly encoded UTF-8.
pub fn query_value(path_with_query: &str, name: &str) -> Result<Option<Vec<u8>>, FieldError> {
    let Some((_, query)) = path_with_query.split_once('?') else {
        return Ok(None);
    };
    let query = query.split('#').next().unwrap_or(query);
    single_value(query.as_bytes(), name)
}

/// `application/x-www-form-urlencoded` pairs (WHATWG URL, "urlencoded parsing"): the name
/// decoded as the standard says (an invalid escape stays literal, so names still compare
/// the way the upstream's parser sees them), the value left raw for [`decode_value`].
fn pairs(bytes: &[u8]) -> impl Iterator<Item = (Vec<u8>, &[u8])> {
    bytes
        .split(|b| *b == b'&')
        .filter(|sequence| !sequence.is_empty())
        .map(|sequence| {
            let mut parts = sequence.splitn(2, |b| *b == b'=');
            let name = parts.next().unwrap_or_default();
            let value = parts.next().unwrap_or_default();
            (decode_lenient(name), value)
        })
}

fn single_value(bytes: &[u8], name: &str) -> Result<Option<Vec<u8>>, FieldError> {
    let mut found = pairs(bytes).filter(|(n, _)| n == name.as_bytes());
    match (found.next(), found.next()) {
        (None, _) => Ok(None),
        (Some((_, value)), None) => decode_value(value).map(Some),
        // Which one the upstream reads (first, last, a list) is the upstream's choice.
        (Some(_), Some(_)) => Err(FieldError::Duplicate),
    }
}

fn hex_digit(c: u8) -> Option<u8> {
    char::from(c)
        .to_digit(16)
        .and_then(|d| u8::try_from(d).ok())
}

/// The byte of the escape `%XY` at `i`, if there is one with two hex digits.
fn escape_at(raw: &[u8], i: usize) -> Option<u8> {
    if raw.get(i) != Some(&b'%') {
        return None;
    }
    let high = hex_digit(*raw.get(i + 1)?)?;
    let low = hex_digit(*raw.get(i + 2)?)?;
    Some(high << 4 | low)
}

fn decode_lenient(raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        match (b, escape_at(raw, i)) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (other, _) => {
                out.push(other);
                i += 1;
            }
        }
    }
    out
}

/// A value, percent-decoded strictly: the lenient decoding leaves `%zz` as it is and turns
/// every byte that is not UTF-8 into U+FFFD, so different values would give the same key.
fn decode_value(raw: &[u8]) -> Result<Vec<u8>, FieldError> {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        match b {
            b'%' => match escape_at(raw, i) {
                Some(byte) => {
                    out.push(byte);
                    i += 3;
                }
                None => {
                    let shown: String = raw
                        .get(i..)
                        .unwrap_or_default()
                        .iter()
                        .take(3)
                        .map(|&c| {
                            if c.is_ascii_graphic() {
                                char::from(c)
                            } else {
                                '?'
                            }
                        })
                        .collect();
                    return Err(FieldError::BadEncoding(format!(
                        "the value has an invalid percent-encoding ('{shown}')"
                    )));
                }
            },
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            other => {
                out.push(other);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map(String::into_bytes).map_err(|_| {
        FieldError::BadEncoding("the value is not UTF-8 once percent-decoded".to_string())
    })
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    #[test]
    fn json_scalars_by_pointer() {
        let body = br#"{"data":{"object":{"id":"evt_1","amount":1200,"paid":true,"tags":["a"]}},"a/b":"slash"}"#;
        let mut b = RequestBody::new("application/json; charset=utf-8", body);
        assert_eq!(b.json_scalar("/data/object/id").unwrap(), b"evt_1");
        assert_eq!(b.json_scalar("/data/object/amount").unwrap(), b"1200");
        assert_eq!(b.json_scalar("/data/object/paid").unwrap(), b"true");
        assert_eq!(b.json_scalar("/a~1b").unwrap(), b"slash");
        assert_eq!(
            b.json_scalar("/data/object/tags"),
            Err(FieldError::NotScalar)
        );
        assert_eq!(b.json_scalar("/data/object/nope"), Err(FieldError::Missing));
        assert_eq!(b.json_scalar("/data/object/tags/0").unwrap(), b"a");
    }

    #[test]
    fn canonical_json_ignores_key_order_and_whitespace() {
        let mut a = RequestBody::new("application/json", br#"{"x":{"b":1,"a":[1, 2]}}"#);
        let mut b = RequestBody::new(
            "application/cloudevents+json",
            br#"{ "x" : { "a" : [1,2] , "b" : 1 } }"#,
        );
        assert_eq!(
            a.json_canonical("/x").unwrap(),
            b.json_canonical("/x").unwrap()
        );
        assert_eq!(a.json_canonical("/missing").unwrap(), None);
    }

    #[test]
    fn wrong_type_and_bad_json_are_reported() {
        let mut b = RequestBody::new("text/plain", b"{}");
        assert!(matches!(
            b.json_scalar("/id"),
            Err(FieldError::WrongContentType { .. })
        ));
        let mut b = RequestBody::new("application/json", b"{not json");
        assert!(matches!(
            b.json_scalar("/id"),
            Err(FieldError::Unparseable(_))
        ));
        let mut b = RequestBody::new("application/json", b"{}");
        assert!(matches!(
            b.form_value("a"),
            Err(FieldError::WrongContentType { .. })
        ));
    }

    #[test]
    fn form_and_query_values_are_decoded() {
        let mut b = RequestBody::new(
            "application/x-www-form-urlencoded",
            b"trade_no=2024%2F001&total_fee=1.00&subject=a+b",
        );
        assert_eq!(b.form_value("trade_no").unwrap().unwrap(), b"2024/001");
        assert_eq!(b.form_value("subject").unwrap().unwrap(), b"a b");
        assert_eq!(b.form_value("nope").unwrap(), None);
        assert_eq!(
            query_value("/pay?order_no=A%2D1&x=2", "order_no")
                .unwrap()
                .unwrap(),
            b"A-1"
        );
        assert_eq!(query_value("/pay?x=2", "order_no"), Ok(None));
        assert_eq!(query_value("/pay", "order_no"), Ok(None));
        assert_eq!(
            query_value("/pay?order_no=caf%C3%A9#frag", "order_no")
                .unwrap()
                .unwrap(),
            "café".as_bytes()
        );
    }

    fn json_key(body: &str, pointer: &str) -> Result<Vec<u8>, FieldError> {
        RequestBody::new("application/json", body.as_bytes()).json_scalar(pointer)
    }

    fn canonical(body: &str, pointer: &str) -> Vec<u8> {
        RequestBody::new("application/json", body.as_bytes())
            .json_canonical(pointer)
            .unwrap()
            .unwrap()
    }

    #[test]
    fn json_numbers_are_keyed_by_their_literal_text() {
        // Beyond u64 serde_json's Value makes both the same f64.
        let a = json_key(r#"{"id":1234567890123456789012345678}"#, "/id").unwrap();
        let b = json_key(r#"{"id":1234567890123456789012345679}"#, "/id").unwrap();
        assert_eq!(a, b"1234567890123456789012345678");
        assert_ne!(a, b);
        for literal in [
            "100", "1e2", "1E2", "100.0", "1.50", "-0", "-12.5e+3", "0.1",
        ] {
            let body = format!(r#"{{"n": {literal} , "m":[1,2]}}"#);
            assert_eq!(json_key(&body, "/n").unwrap(), literal.as_bytes());
        }
        // Same text as before for the everyday cases, so keys stay stable.
        assert_eq!(
            json_key(r#"{"n":18446744073709551615}"#, "/n").unwrap(),
            b"18446744073709551615"
        );
        assert_eq!(json_key(r#"{"n":-42}"#, "/n").unwrap(), b"-42");
    }

    #[test]
    fn number_texts_are_found_around_strings_escapes_and_nesting() {
        let body = r#"{"s":"1 \" 2 \\","a":[true,-3.5e-2,{"k":"-4","v":[7, 8]}],"z":null,"e":"\u0031","f":90}"#;
        assert_eq!(json_key(body, "/a/1").unwrap(), b"-3.5e-2");
        assert_eq!(json_key(body, "/a/2/k").unwrap(), b"-4");
        assert_eq!(json_key(body, "/a/2/v/1").unwrap(), b"8");
        assert_eq!(json_key(body, "/s").unwrap(), br#"1 " 2 \"#);
        assert_eq!(json_key(body, "/e").unwrap(), b"1");
        assert_eq!(json_key(body, "/f").unwrap(), b"90");
        assert_eq!(json_key(body, "/z"), Err(FieldError::NotScalar));
        assert_eq!(json_key("7", "").unwrap(), b"7");
        // RFC 6901 array indexes: no leading zeros or signs.
        assert_eq!(json_key(body, "/a/01"), Err(FieldError::Missing));
        assert_eq!(json_key(body, "/a/+1"), Err(FieldError::Missing));
        // Beyond f64's range serde_json refuses the document: an error, not a lossy key.
        assert!(matches!(
            json_key(r#"{"n":1e400}"#, "/n"),
            Err(FieldError::Unparseable(_))
        ));
    }

    #[test]
    fn canonical_json_keeps_number_texts_and_duplicates() {
        assert_ne!(
            canonical(r#"{"a":{"n":1234567890123456789012345678}}"#, "/a"),
            canonical(r#"{"a":{"n":1234567890123456789012345679}}"#, "/a")
        );
        assert_eq!(
            canonical(r#"{"a":{"y":1.50,"x":[1e2, "s\n"]}}"#, "/a"),
            br#"{"x":[1e2,"s\n"],"y":1.50}"#
        );
        // Byte for byte what serde_json's Value printed for integers, strings and nesting.
        let body = r#"{"a":{"b":[1,-2,{"c":"é\"\u0007"}],"a":true,"n":null}}"#;
        let value: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(canonical(body, "/a"), value["a"].to_string().into_bytes());
        // Duplicates inside a fingerprinted value all count, in their order.
        let dup = canonical(r#"{"a":{"k":1,"j":0,"k":2}}"#, "/a");
        assert_eq!(dup, br#"{"j":0,"k":1,"k":2}"#);
        assert_ne!(dup, canonical(r#"{"a":{"k":2,"j":0,"k":1}}"#, "/a"));
    }

    #[test]
    fn a_member_named_twice_on_the_pointer_is_refused() {
        let body = r#"{"order":{"id":"a","id":"b"},"x":1,"x":2}"#;
        assert_eq!(json_key(body, "/order/id"), Err(FieldError::Duplicate));
        assert_eq!(json_key(body, "/x"), Err(FieldError::Duplicate));
        let mut b = RequestBody::new("application/json", body.as_bytes());
        assert_eq!(
            b.json_canonical("/order"),
            Ok(Some(br#"{"id":"a","id":"b"}"#.to_vec()))
        );
        assert_eq!(b.json_canonical("/order/id"), Err(FieldError::Duplicate));
        // Elsewhere in the body a duplicate does not matter.
        assert_eq!(
            json_key(r#"{"id":"k","o":{"a":1,"a":2}}"#, "/id").unwrap(),
            b"k"
        );
        let twice = r#"{"o":{"id":1},"o":{"id":2}}"#;
        assert_eq!(json_key(twice, "/o/id"), Err(FieldError::Duplicate));
    }

    #[test]
    fn invalid_percent_encoding_and_non_utf8_values_are_refused() {
        let form = "application/x-www-form-urlencoded";
        for (body, needle) in [
            ("trade_no=%zz1", "'%zz'"),
            ("trade_no=12%4", "'%4'"),
            ("trade_no=12%", "'%'"),
            ("trade_no=%4g", "'%4g'"),
            ("trade_no=%ff", "not UTF-8"),
            ("trade_no=%fe", "not UTF-8"),
            ("trade_no=%C3", "not UTF-8"),
        ] {
            let mut b = RequestBody::new(form, body.as_bytes());
            match b.form_value("trade_no") {
                Err(FieldError::BadEncoding(why)) => assert!(why.contains(needle), "{body}: {why}"),
                other => panic!("{body}: {other:?}"),
            }
            let path = format!("/pay?{body}");
            assert!(matches!(
                query_value(&path, "trade_no"),
                Err(FieldError::BadEncoding(_))
            ));
        }
        // Other fields may be malformed: only the field read is checked.
        let mut b = RequestBody::new(form, b"sign=%zz&trade_no=T1&x=%ff");
        assert_eq!(b.form_value("trade_no").unwrap().unwrap(), b"T1");
        assert_eq!(query_value("/p?x=%zz&k=v", "k").unwrap().unwrap(), b"v");
        // A name with a bad escape keeps it literally, as the standard parser does.
        let mut b = RequestBody::new(form, b"a%zz=1");
        assert_eq!(b.form_value("a%zz").unwrap().unwrap(), b"1");
    }

    #[test]
    fn a_key_field_given_twice_is_refused() {
        let form = "application/x-www-form-urlencoded";
        for body in [
            "trade_no=1&trade_no=2",
            "trade_no=1&trade_no=1",
            "trade_no=1&trade%5Fno=2",
            "trade_no&trade_no=x",
        ] {
            let mut b = RequestBody::new(form, body.as_bytes());
            assert_eq!(
                b.form_value("trade_no"),
                Err(FieldError::Duplicate),
                "{body}"
            );
            let path = format!("/pay?{body}");
            assert_eq!(
                query_value(&path, "trade_no"),
                Err(FieldError::Duplicate),
                "{body}"
            );
        }
        // A fingerprinted field may repeat: every value counts.
        let mut b = RequestBody::new(form, b"item=a&x=1&item=b%20c&item=");
        assert_eq!(
            b.form_values("item").unwrap(),
            vec![b"a".to_vec(), b"b c".to_vec(), Vec::new()]
        );
        assert_eq!(b.form_values("nope").unwrap(), Vec::<Vec<u8>>::new());
        let mut b = RequestBody::new(form, b"item=a&item=%zz");
        assert!(matches!(
            b.form_values("item"),
            Err(FieldError::BadEncoding(_))
        ));
        // Empty sequences are skipped, a name without '=' has an empty value.
        let mut b = RequestBody::new(form, b"&&flag&k=v&");
        assert_eq!(b.form_value("flag").unwrap().unwrap(), b"");
        assert_eq!(b.form_value("k").unwrap().unwrap(), b"v");
    }
}

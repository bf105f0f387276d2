//! Values taken from the request itself: query parameters, and fields of a JSON or
//! `application/x-www-form-urlencoded` body. A JSON body is read in one pass for the key
//! sources and fingerprint fields a rule names, keeping only them (see [`json`]).
//!
//! Every value is read losslessly: two requests whose field differs never yield the same
//! bytes. JSON numbers are kept as their literal text, and form or query values
//! are percent-decoded strictly: an invalid escape, a value that is not UTF-8 once decoded, or
//! a key field given twice is an error rather than a guess.

mod json;

use json::Form;

/// Splits `/a/b?x=1` into the path used for matching and fingerprinting.
pub fn path_without_query(path: &str) -> &str {
    path.split(['?', '#']).next().unwrap_or(path)
}

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

/// The request body, read as whatever the sources need.
pub struct RequestBody<'a> {
    content_type: &'a str,
    bytes: &'a [u8],
    /// JSON fields to read together on the first JSON read ([`RequestBody::will_read_json`]).
    announced: Vec<(String, Form)>,
    /// JSON fields a pass has read and nobody has asked for yet.
    json_read: Vec<(String, Form, json::Read)>,
    /// The JSON document's error, once a pass found it: every later JSON read gives it too.
    json_error: Option<FieldError>,
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
            announced: Vec::new(),
            json_read: Vec::new(),
            json_error: None,
        }
    }

    /// Names the JSON fields that will be read, as key sources ([`RequestBody::json_scalar`])
    /// and as fingerprint fields ([`RequestBody::json_canonical`]): the first JSON read then
    /// finds them all in one pass over the body instead of one pass each.
    pub fn will_read_json<'p>(
        &mut self,
        scalars: impl IntoIterator<Item = &'p str>,
        canonical: impl IntoIterator<Item = &'p str>,
    ) {
        let scalars = scalars.into_iter().map(|p| (p, Form::Scalar));
        let canonical = canonical.into_iter().map(|p| (p, Form::Canonical));
        for (pointer, form) in scalars.chain(canonical) {
            if !self
                .announced
                .iter()
                .any(|(p, f)| p == pointer && *f == form)
            {
                self.announced.push((pointer.to_string(), form));
            }
        }
    }

    /// A JSON field, from an earlier pass or from a pass for it and every announced field.
    fn json_field(&mut self, pointer: &str, form: Form) -> json::Read {
        if !is_json_type(self.content_type) {
            return Err(FieldError::WrongContentType {
                expected: "JSON",
                actual: self.content_type.to_string(),
            });
        }
        if let Some(e) = &self.json_error {
            return Err(e.clone());
        }
        let is_it = |p: &str, f: Form| p == pointer && f == form;
        if let Some(at) = self.json_read.iter().position(|(p, f, _)| is_it(p, *f)) {
            return self.json_read.swap_remove(at).2;
        }
        let mut wanted = std::mem::take(&mut self.announced);
        if !wanted.iter().any(|(p, f)| is_it(p, *f)) {
            wanted.push((pointer.to_string(), form));
        }
        let found = json::read_fields(self.bytes, &wanted).inspect_err(|e| {
            self.json_error = Some(e.clone());
        })?;
        let mut read = Ok(None);
        for ((p, f), r) in wanted.into_iter().zip(found) {
            if is_it(&p, f) {
                read = r;
            } else {
                self.json_read.push((p, f, r));
            }
        }
        read
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
        self.json_field(pointer, Form::Scalar)?
            .ok_or(FieldError::Missing)
    }

    /// Any JSON field, canonical (sorted keys, no insignificant whitespace, numbers as sent),
    /// or None when absent.
    pub fn json_canonical(&mut self, pointer: &str) -> Result<Option<Vec<u8>>, FieldError> {
        self.json_field(pointer, Form::Canonical)
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
mod tests;

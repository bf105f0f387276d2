//! Values taken from the request itself: query parameters, and fields of a JSON or
//! `application/x-www-form-urlencoded` body. The body is parsed once and shared by the key
//! sources and the fingerprint fields.

use serde_json::Value;

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
        }
    }
}

/// The request body, parsed lazily as whatever the sources need.
pub struct RequestBody<'a> {
    content_type: &'a str,
    bytes: &'a [u8],
    json: Option<Result<Value, FieldError>>,
    form: Option<Result<Vec<(String, String)>, FieldError>>,
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
            form: None,
        }
    }

    fn json(&mut self) -> Result<&Value, FieldError> {
        if self.json.is_none() {
            let parsed = if !is_json_type(self.content_type) {
                Err(FieldError::WrongContentType {
                    expected: "JSON",
                    actual: self.content_type.to_string(),
                })
            } else {
                serde_json::from_slice::<Value>(self.bytes)
                    .map_err(|e| FieldError::Unparseable(format!("invalid JSON: {e}")))
            };
            self.json = Some(parsed);
        }
        match &self.json {
            Some(Ok(v)) => Ok(v),
            Some(Err(e)) => Err(e.clone()),
            None => Err(FieldError::Missing),
        }
    }

    fn form(&mut self) -> Result<&[(String, String)], FieldError> {
        if self.form.is_none() {
            let parsed = if !is_form_type(self.content_type) {
                Err(FieldError::WrongContentType {
                    expected: "application/x-www-form-urlencoded",
                    actual: self.content_type.to_string(),
                })
            } else {
                Ok(form_urlencoded::parse(self.bytes)
                    .map(|(k, v)| (k.into_owned(), v.into_owned()))
                    .collect())
            };
            self.form = Some(parsed);
        }
        match &self.form {
            Some(Ok(v)) => Ok(v.as_slice()),
            Some(Err(e)) => Err(e.clone()),
            None => Err(FieldError::Missing),
        }
    }

    /// A scalar JSON field by JSON Pointer (RFC 6901), as the bytes of its value: a string's
    /// content, or a number's or boolean's JSON text.
    pub fn json_scalar(&mut self, pointer: &str) -> Result<Vec<u8>, FieldError> {
        match self.json()?.pointer(pointer) {
            None => Err(FieldError::Missing),
            Some(Value::String(s)) => Ok(s.as_bytes().to_vec()),
            Some(v @ (Value::Number(_) | Value::Bool(_))) => Ok(v.to_string().into_bytes()),
            Some(_) => Err(FieldError::NotScalar),
        }
    }

    /// Any JSON field, canonical (sorted keys, no insignificant whitespace), or None when absent.
    pub fn json_canonical(&mut self, pointer: &str) -> Result<Option<Vec<u8>>, FieldError> {
        // serde_json's map keeps keys sorted, so serialising is canonical.
        Ok(self
            .json()?
            .pointer(pointer)
            .map(|v| v.to_string().into_bytes()))
    }

    /// The first value of a form field.
    pub fn form_value(&mut self, name: &str) -> Result<Option<Vec<u8>>, FieldError> {
        Ok(self
            .form()?
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_bytes().to_vec()))
    }
}

/// The first value of query parameter `name` in a `:path`, percent-decoded.
pub fn query_value(path_with_query: &str, name: &str) -> Option<Vec<u8>> {
    let query = path_with_query.split_once('?')?.1;
    let query = query.split('#').next().unwrap_or(query);
    form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.into_owned().into_bytes())
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
            query_value("/pay?order_no=A%2D1&x=2", "order_no").unwrap(),
            b"A-1"
        );
        assert_eq!(query_value("/pay?x=2", "order_no"), None);
        assert_eq!(query_value("/pay", "order_no"), None);
    }
}

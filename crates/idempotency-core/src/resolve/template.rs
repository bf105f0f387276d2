//! The lookup's path, as a rule writes it: literal text with placeholders filled from the
//! original request. `{key}` is the idempotency key (a rule with one key source), `{key.N}`
//! the N-th source of a composite key (from 0), `{header.NAME}` a request header. Every value
//! is percent-encoded whole, so a client-chosen key can never add a path segment, a query
//! or a fragment to the lookup.

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

/// Everything but RFC 3986's unreserved characters is encoded.
const COMPONENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Literal(String),
    /// The whole key (one source).
    Key,
    /// One source of a composite key.
    KeySource(usize),
    /// A request header (lower case).
    Header(String),
}

/// A parsed path template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTemplate {
    parts: Vec<Part>,
}

/// What a template is filled from.
pub struct Values<'a> {
    /// The key's source values, in the rule's order.
    pub key_sources: &'a [Vec<u8>],
    /// Lower-case name and value of the request headers the template names.
    pub headers: &'a [(String, Vec<u8>)],
}

impl PathTemplate {
    /// Parses `text` for a rule whose key has `key_sources` sources.
    pub fn parse(text: &str, key_sources: usize) -> Result<PathTemplate, String> {
        if !text.starts_with('/') {
            return Err("must start with '/'".to_string());
        }
        if text.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err("must be printable ASCII without spaces".to_string());
        }
        let mut parts = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            let (literal, after) = rest.split_at(open);
            let Some(close) = after.find('}') else {
                return Err("has a '{' without its '}'".to_string());
            };
            if !literal.is_empty() {
                parts.push(Part::Literal(literal.to_string()));
            }
            let name = after.get(1..close).unwrap_or("");
            parts.push(placeholder(name, key_sources)?);
            rest = after.get(close + 1..).unwrap_or("");
        }
        if rest.contains('}') {
            return Err("has a '}' without its '{'".to_string());
        }
        if !rest.is_empty() {
            parts.push(Part::Literal(rest.to_string()));
        }
        if !parts.iter().any(|p| !matches!(p, Part::Literal(_))) {
            // A fixed path would ask about every key alike: no answer could be this key's.
            return Err("must name the write with {key}, {key.N} or {header.NAME}".to_string());
        }
        Ok(PathTemplate { parts })
    }

    /// The request headers the template reads.
    pub fn headers(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Header(name) => Some(name.as_str()),
            _ => None,
        })
    }

    /// The path for one request; Err names a placeholder the request has no value for.
    pub fn render(&self, values: &Values<'_>) -> Result<String, String> {
        let mut out = String::new();
        for part in &self.parts {
            let value: &[u8] = match part {
                Part::Literal(text) => {
                    out.push_str(text);
                    continue;
                }
                Part::Key => values.key_sources.first().map(Vec::as_slice).unwrap_or(&[]),
                Part::KeySource(i) => values.key_sources.get(*i).map(Vec::as_slice).unwrap_or(&[]),
                Part::Header(name) => values
                    .headers
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.as_slice())
                    .unwrap_or(&[]),
            };
            let Ok(text) = std::str::from_utf8(value) else {
                return Err(format!("{} is not UTF-8", describe(part)));
            };
            if text.is_empty() {
                return Err(format!("{} is empty or missing", describe(part)));
            }
            out.extend(utf8_percent_encode(text, COMPONENT));
        }
        Ok(out)
    }
}

fn placeholder(name: &str, key_sources: usize) -> Result<Part, String> {
    if name == "key" {
        if key_sources != 1 {
            return Err(format!(
                "{{key}} needs a key with one source; this one has {key_sources}: use {{key.0}} \
                 to {{key.{}}}",
                key_sources.saturating_sub(1)
            ));
        }
        return Ok(Part::Key);
    }
    if let Some(index) = name.strip_prefix("key.") {
        return match index.parse::<usize>() {
            Ok(i) if i < key_sources => Ok(Part::KeySource(i)),
            _ => Err(format!(
                "{{{name}}}: the key has {key_sources} source(s), numbered from 0"
            )),
        };
    }
    if let Some(header) = name.strip_prefix("header.") {
        let lower = header.to_ascii_lowercase();
        let valid = !lower.is_empty()
            && lower
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_".contains(&b));
        if !valid {
            return Err(format!("{{{name}}}: '{header}' is not a header name"));
        }
        return Ok(Part::Header(lower));
    }
    Err(format!(
        "{{{name}}} is not a placeholder: use {{key}}, {{key.N}} or {{header.NAME}}"
    ))
}

fn describe(part: &Part) -> String {
    match part {
        Part::Literal(_) | Part::Key => "the key".to_string(),
        Part::KeySource(i) => format!("key source {i}"),
        Part::Header(name) => format!("header '{name}'"),
    }
}

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn render(
        template: &str,
        sources: &[&str],
        headers: &[(&str, &str)],
    ) -> Result<String, String> {
        let t = PathTemplate::parse(template, sources.len().max(1))?;
        let sources: Vec<Vec<u8>> = sources.iter().map(|s| s.as_bytes().to_vec()).collect();
        let headers: Vec<(String, Vec<u8>)> = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
            .collect();
        t.render(&Values {
            key_sources: &sources,
            headers: &headers,
        })
    }

    #[test]
    fn a_chosen_key_cannot_leave_its_path_segment() {
        assert_eq!(
            render("/payments/by-key/{key}", &["../../admin?x=1#f"], &[]).unwrap(),
            "/payments/by-key/..%2F..%2Fadmin%3Fx%3D1%23f"
        );
        assert_eq!(
            render("/p/{key}", &["a b%/é"], &[]).unwrap(),
            "/p/a%20b%25%2F%C3%A9"
        );
    }

    #[test]
    fn composite_keys_and_headers_fill_their_own_placeholders() {
        let t =
            PathTemplate::parse("/orders/{key.1}?tenant={header.X-Tenant}&n={key.0}", 2).unwrap();
        let sources = vec![b"7".to_vec(), b"ord-1".to_vec()];
        let headers = vec![("x-tenant".to_string(), b"acme".to_vec())];
        let values = Values {
            key_sources: &sources,
            headers: &headers,
        };
        assert_eq!(t.render(&values).unwrap(), "/orders/ord-1?tenant=acme&n=7");
        assert_eq!(t.headers().collect::<Vec<_>>(), vec!["x-tenant"]);
        let no_header = Values {
            key_sources: &sources,
            headers: &[],
        };
        assert!(t.render(&no_header).unwrap_err().contains("x-tenant"));
    }

    #[test]
    fn templates_that_cannot_name_one_write_are_refused() {
        for (template, sources, why) in [
            ("payments/{key}", 1, "start with '/'"),
            ("/payments", 1, "must name the write"),
            ("/p/{key", 1, "without its '}'"),
            ("/p/key}", 1, "without its '{'"),
            ("/p/{key}", 2, "{key.0}"),
            ("/p/{key.2}", 2, "numbered from 0"),
            ("/p/{body}", 1, "not a placeholder"),
            ("/p/{header.}", 1, "not a header name"),
            ("/p/ {key}", 1, "printable"),
        ] {
            let err = PathTemplate::parse(template, sources).unwrap_err();
            assert!(err.contains(why), "{template}: {err}");
        }
    }
}

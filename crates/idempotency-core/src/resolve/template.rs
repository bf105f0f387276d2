//! The lookup's path, as a rule writes it: literal text with placeholders filled from the
//! original request. `{key}` is the idempotency key (a rule with one key source), `{key.N}`
//! the N-th source of a composite key (from 0), `{header.NAME}` a request header (one of the
//! rule's scope headers: `settings` says why).
//!
//! A value in the query is percent-encoded whole. A value in the path is not encoded but
//! refused unless it is made of RFC 3986's unreserved characters and forms no dot segment:
//! proxies and frameworks between Envoy and the service rewrite paths (they remove `.` and
//! `..` segments, `%2e` forms included, unescape `%2F` and `%5C`, merge slashes, cut `;`
//! parameters, decode twice), and a rewritten lookup names another write or none, whose "not
//! found" would free the key for a second execution. No encoding survives all of them (an
//! RFC 3986 normaliser reads `%2e` as a dot), so the request is refused before it runs.

use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

/// Everything but RFC 3986's unreserved characters is encoded (a value in the query).
const COMPONENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// The only bytes a value may put in the lookup's path: RFC 3986's unreserved characters,
/// which no normaliser rewrites.
fn path_safe(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~".contains(&b)
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    /// Template text; the query's first literal starts with its `?`.
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
    /// Parts from this index on are in the query.
    query_from: usize,
}

/// What a template is filled from.
pub struct Values<'a> {
    /// The key's source values, in the rule's order.
    pub key_sources: &'a [Vec<u8>],
    /// Lower-case name and value of the request headers the template names.
    pub headers: &'a [(String, Vec<u8>)],
}

/// A value a lookup takes from the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupInput {
    /// A source of the key, by its index in the rule (`{key}` is 0).
    KeySource(usize),
    /// A request header (lower case).
    Header(String),
}

/// Why a request's value cannot go into its lookup; the request is refused before it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unfit {
    pub input: LookupInput,
    /// Reads after the value's name: "holds '/', which ...".
    pub why: String,
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
        let path_text = text.split('?').next().unwrap_or("");
        if let Some(dots) = path_text
            .split('/')
            .find(|segment| !segment.contains('{') && is_dot_segment(segment))
        {
            return Err(format!(
                "has the segment '{dots}', which proxies and frameworks remove as a relative \
                 step"
            ));
        }
        let mut parts = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            let (literal, after) = rest.split_at(open);
            let Some(close) = after.find('}') else {
                return Err("has a '{' without its '}'".to_string());
            };
            push_literal(&mut parts, literal);
            let name = after.get(1..close).unwrap_or("");
            parts.push(placeholder(name, key_sources)?);
            rest = after.get(close + 1..).unwrap_or("");
        }
        if rest.contains('}') {
            return Err("has a '}' without its '{'".to_string());
        }
        push_literal(&mut parts, rest);
        if !parts.iter().any(|p| !matches!(p, Part::Literal(_))) {
            // A fixed path would ask about every key alike: no answer could be this key's.
            return Err("must name the write with {key}, {key.N} or {header.NAME}".to_string());
        }
        let query_from = parts
            .iter()
            .position(|p| matches!(p, Part::Literal(text) if text.starts_with('?')))
            .unwrap_or(parts.len());
        Ok(PathTemplate { parts, query_from })
    }

    /// A gRPC method's path, `/package.Service/Method`, as a fixed lookup path: a gRPC
    /// lookup names the write by the key's metadata, not by its path.
    pub fn grpc_method(text: &str) -> Result<PathTemplate, String> {
        let named = text
            .strip_prefix('/')
            .and_then(|rest| rest.split_once('/'))
            .is_some_and(|(service, method)| {
                let name = |s: &str| {
                    !s.is_empty()
                        && s.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
                };
                name(service) && name(method) && !method.contains('.')
            });
        if !named {
            return Err(format!(
                "'{text}' is not a gRPC method's path (/package.Service/Method)"
            ));
        }
        Ok(PathTemplate {
            parts: vec![Part::Literal(text.to_string())],
            query_from: 1,
        })
    }

    /// The request headers the template reads.
    pub fn headers(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Header(name) => Some(name.as_str()),
            _ => None,
        })
    }

    /// The path for one request; Err names the value that cannot go into it, and why.
    pub fn render(&self, values: &Values<'_>) -> Result<String, Unfit> {
        let mut out = String::new();
        // Where each value went in the path, to tell which one made a dot segment.
        let mut spans: Vec<(usize, usize, LookupInput)> = Vec::new();
        for (index, part) in self.parts.iter().enumerate() {
            if index == self.query_from {
                check_segments(&out, &spans)?;
            }
            let (input, value): (LookupInput, &[u8]) = match part {
                Part::Literal(text) => {
                    out.push_str(text);
                    continue;
                }
                Part::Key => (
                    LookupInput::KeySource(0),
                    values.key_sources.first().map(Vec::as_slice).unwrap_or(&[]),
                ),
                Part::KeySource(i) => (
                    LookupInput::KeySource(*i),
                    values.key_sources.get(*i).map(Vec::as_slice).unwrap_or(&[]),
                ),
                Part::Header(name) => (
                    LookupInput::Header(name.clone()),
                    values
                        .headers
                        .iter()
                        .find(|(n, _)| n == name)
                        .map(|(_, v)| v.as_slice())
                        .unwrap_or(&[]),
                ),
            };
            let unfit = |why: String| Unfit {
                input: input.clone(),
                why,
            };
            if value.is_empty() {
                return Err(unfit("is empty or missing".to_string()));
            }
            if index < self.query_from {
                if let Some(&bad) = value.iter().find(|b| !path_safe(**b)) {
                    return Err(unfit(format!(
                        "holds {}, which proxies and frameworks on the way to the service may \
                         rewrite in a path (only letters, digits, '-', '.', '_' and '~' are \
                         left alone)",
                        shown(bad)
                    )));
                }
                // Unreserved ASCII only: nothing to encode.
                let start = out.len();
                out.push_str(&String::from_utf8_lossy(value));
                spans.push((start, out.len(), input));
                continue;
            }
            let Ok(text) = std::str::from_utf8(value) else {
                return Err(unfit("is not UTF-8".to_string()));
            };
            out.extend(utf8_percent_encode(text, COMPONENT));
        }
        if self.query_from >= self.parts.len() {
            check_segments(&out, &spans)?;
        }
        Ok(out)
    }
}

/// A template literal, split where the query starts so that its `?` opens a part.
fn push_literal(parts: &mut Vec<Part>, literal: &str) {
    let starts_query = !parts
        .iter()
        .any(|p| matches!(p, Part::Literal(text) if text.contains('?')));
    match literal.find('?') {
        Some(at) if starts_query && at > 0 => {
            let (path, query) = literal.split_at(at);
            parts.push(Part::Literal(path.to_string()));
            parts.push(Part::Literal(query.to_string()));
        }
        _ if literal.is_empty() => {}
        _ => parts.push(Part::Literal(literal.to_string())),
    }
}

/// `.` or `..`, also written with `%2e` (as RFC 3986 normalisers read it).
fn is_dot_segment(segment: &str) -> bool {
    let dots = segment.to_ascii_lowercase().replace("%2e", ".");
    dots == "." || dots == ".."
}

/// No segment of the rendered `path` that a value helped make may be a dot segment.
fn check_segments(path: &str, spans: &[(usize, usize, LookupInput)]) -> Result<(), Unfit> {
    let mut start = 0;
    for segment in path.split('/') {
        let end = start + segment.len();
        let made_by = spans
            .iter()
            .find(|(from, to, _)| *from < end && *to > start)
            .map(|(_, _, input)| input);
        if let (Some(input), true) = (made_by, is_dot_segment(segment)) {
            return Err(Unfit {
                input: input.clone(),
                why: format!(
                    "would make '{segment}' a segment of the lookup's path, which proxies and \
                     frameworks remove as a relative step"
                ),
            });
        }
        start = end + 1;
    }
    Ok(())
}

/// A byte as a refusal shows it.
fn shown(b: u8) -> String {
    if b.is_ascii_graphic() {
        format!("'{}'", char::from(b))
    } else if b == b' ' {
        "a space".to_string()
    } else {
        format!("the byte 0x{b:02x}")
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

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn render(template: &str, sources: &[&str], headers: &[(&str, &str)]) -> Result<String, Unfit> {
        let t = PathTemplate::parse(template, sources.len().max(1)).unwrap();
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
    fn a_key_that_would_be_a_dot_segment_is_refused() {
        // A normaliser turns /payments/by-key/.. into /payments/, whose 404 would say "never
        // ran" of a write that did.
        for key in [".", ".."] {
            let unfit = render("/payments/by-key/{key}", &[key], &[]).unwrap_err();
            assert_eq!(unfit.input, LookupInput::KeySource(0));
            assert!(
                unfit.why.contains(&format!("'{key}' a segment")),
                "{unfit:?}"
            );
        }
        // Made with the text or the other values around it, too.
        let unfit = render("/p/{key.0}{key.1}/x", &[".", "."], &[]).unwrap_err();
        assert_eq!(unfit.input, LookupInput::KeySource(0));
        assert!(render("/p/.{key}", &["."], &[]).is_err());
        assert!(render("/p/%2E{key}", &["."], &[]).is_err());
        // Dots inside a segment are only dots.
        for key in ["...", ".a", "a..", "v1.2"] {
            assert_eq!(
                render("/p/{key}", &[key], &[]).unwrap(),
                format!("/p/{key}")
            );
        }
        assert_eq!(render("/p/{key}.json", &["."], &[]).unwrap(), "/p/..json");
    }

    #[test]
    fn a_path_takes_only_what_no_normaliser_rewrites() {
        // Unescaped slashes, backslashes, ';' parameters, double decoding, '+' as a space,
        // Unicode folding: each could make the lookup name another write.
        for (key, shown) in [
            ("a/b", "'/'"),
            ("..%2F..", "'%'"),
            ("a\\b", "'\\'"),
            ("a;v=1", "';'"),
            ("a+b", "'+'"),
            ("a b", "a space"),
            ("caf\u{e9}", "the byte 0xc3"),
            ("a?b", "'?'"),
        ] {
            let unfit = render("/payments/by-key/{key}", &[key], &[]).unwrap_err();
            assert!(
                unfit.why.starts_with(&format!("holds {shown},")),
                "{key}: {unfit:?}"
            );
        }
        let uuid = "0f8fad5b-d9cb-469f-a165-70867728950e";
        assert_eq!(
            render("/payments/by-key/{key}", &[uuid], &[]).unwrap(),
            format!("/payments/by-key/{uuid}")
        );
        assert_eq!(render("/p/{key}", &["A_z~9.x"], &[]).unwrap(), "/p/A_z~9.x");
    }

    #[test]
    fn a_query_carries_any_value_percent_encoded_whole() {
        assert_eq!(
            render("/payments?key={key}", &["../../admin?x=1#f"], &[]).unwrap(),
            "/payments?key=..%2F..%2Fadmin%3Fx%3D1%23f"
        );
        assert_eq!(
            render("/p?k={key}", &["a b%/é"], &[]).unwrap(),
            "/p?k=a%20b%25%2F%C3%A9"
        );
        assert_eq!(render("/p?k={key}", &[".."], &[]).unwrap(), "/p?k=..");
    }

    #[test]
    fn composite_keys_and_headers_fill_their_own_placeholders() {
        let t =
            PathTemplate::parse("/orders/{key.1}?tenant={header.X-Tenant}&n={key.0}", 2).unwrap();
        let sources = vec![b"7".to_vec(), b"ord-1".to_vec()];
        let headers = vec![("x-tenant".to_string(), b"acme co".to_vec())];
        let values = Values {
            key_sources: &sources,
            headers: &headers,
        };
        assert_eq!(
            t.render(&values).unwrap(),
            "/orders/ord-1?tenant=acme%20co&n=7"
        );
        assert_eq!(t.headers().collect::<Vec<_>>(), vec!["x-tenant"]);
        let no_header = Values {
            key_sources: &sources,
            headers: &[],
        };
        let unfit = t.render(&no_header).unwrap_err();
        assert_eq!(unfit.input, LookupInput::Header("x-tenant".to_string()));
        assert_eq!(unfit.why, "is empty or missing");
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
            ("/p/{key}/..", 1, "the segment '..'"),
            ("/p/./{key}", 1, "the segment '.'"),
            ("/p/%2e%2E/{key}", 1, "the segment '%2e%2E'"),
        ] {
            let err = PathTemplate::parse(template, sources).unwrap_err();
            assert!(err.contains(why), "{template}: {err}");
        }
        // In the query, dots are only text.
        assert!(PathTemplate::parse("/p/{key}?v=..", 1).is_ok());
    }
}

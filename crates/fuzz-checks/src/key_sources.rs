//! Keys taken from the request (`idempotency_protocol::naming::source`): headers, query parameters,
//! JSON and form body fields, one or several combined.

use arbitrary::{Result, Unstructured};
use idempotency_protocol::naming::fields::{query_value, RequestBody};
use idempotency_protocol::naming::source::{complete_key, header_parts, FieldSource};
use idempotency_protocol::naming::{parse_key, MAX_KEY_BYTES};

use crate::gen::{number_literal, percent_encode, sf_string, visible_ascii};

const JSON: &str = "application/json";
const FORM: &str = "application/x-www-form-urlencoded";

/// Any request: a key is never empty, and each of its parts is what its source gives on its
/// own (the parsed header, the decoded query value, the body field), 1 to 255 bytes; a
/// "missing" failure is only ever for a source that is absent. Built requests: a request
/// whose every source holds a valid value always has a key, and two requests have the same
/// key exactly when every source holds the same bytes.
pub fn key_sources(data: &[u8]) {
    let _ = raw(Unstructured::new(data));
    let _ = built(&mut Unstructured::new(data));
}

/// The parts of a key made of several, as `key::source` frames them (count, then each part
/// length-prefixed, all u32 big-endian); None when the bytes are not such a frame.
fn split_parts(key: &[u8], count: usize) -> Option<Vec<&[u8]>> {
    let (n, mut rest) = key.split_first_chunk::<4>()?;
    if u32::from_be_bytes(*n) as usize != count {
        return None;
    }
    let mut parts = Vec::with_capacity(count);
    for _ in 0..count {
        let (len, tail) = rest.split_first_chunk::<4>()?;
        let (part, tail) = tail.split_at_checked(u32::from_be_bytes(*len) as usize)?;
        parts.push(part);
        rest = tail;
    }
    rest.is_empty().then_some(parts)
}

fn raw(mut u: Unstructured<'_>) -> Result<()> {
    let u = &mut u;
    let choices = [
        FieldSource::Header("idempotency-key".to_string()),
        FieldSource::Header("x-id".to_string()),
        FieldSource::Query("k".to_string()),
        FieldSource::Json("/k".to_string()),
        FieldSource::Form("k".to_string()),
    ];
    let n = u.int_in_range(1..=3)?;
    let sources: Vec<FieldSource> = (0..n)
        .map(|_| u.choose(&choices).cloned())
        .collect::<Result<_>>()?;
    let key_header: Option<Vec<u8>> = u.arbitrary()?;
    let x_id: Option<Vec<u8>> = u.arbitrary()?;
    let path = format!("/orders{}", u.arbitrary::<String>()?);
    let content_type = *u.choose(&[JSON, FORM, "text/plain"])?;
    let body = std::mem::replace(u, Unstructured::new(&[])).take_rest();

    let header = |name: &str| match name {
        "idempotency-key" => key_header.as_deref(),
        "x-id" => x_id.as_deref(),
        _ => None,
    };
    let parts = match header_parts(&sources, header, &path) {
        Ok(parts) => parts,
        Err(failure) => {
            if failure.is_missing() {
                let absent = sources.iter().any(|s| match s {
                    FieldSource::Header(h) => header(h).is_none(),
                    FieldSource::Query(q) => query_value(&path, q) == Ok(None),
                    FieldSource::Json(_) | FieldSource::Form(_) => false,
                });
                assert!(absent, "missing, yet every source is there: {failure:?}");
            }
            return Ok(());
        }
    };
    let mut parsed = RequestBody::new(content_type, body);
    let Ok(key) = complete_key(&sources, parts, &mut parsed) else {
        return Ok(());
    };
    let parts = if sources.len() == 1 {
        vec![&key[..]]
    } else {
        split_parts(&key, sources.len()).expect("a composite key is framed")
    };
    let mut body_again = RequestBody::new(content_type, body);
    for (source, part) in sources.iter().zip(parts) {
        assert!(
            (1..=MAX_KEY_BYTES).contains(&part.len()),
            "{source:?}: {part:?}"
        );
        let alone = match source {
            FieldSource::Header(h) => parse_key(header(h).expect("present")).ok(),
            FieldSource::Query(q) => query_value(&path, q).ok().flatten(),
            FieldSource::Json(p) => body_again.json_scalar(p).ok(),
            FieldSource::Form(f) => body_again.form_value(f).ok().flatten(),
        };
        assert_eq!(alone.as_deref(), Some(part), "{source:?}");
    }
    Ok(())
}

/// A value for one source: what the request carries, and the key bytes it stands for.
struct Sent {
    wire: Vec<u8>,
    key: Vec<u8>,
}

/// 1 to 255 bytes of UTF-8.
fn text_value(u: &mut Unstructured<'_>) -> Result<String> {
    let mut s: String = u.arbitrary()?;
    while s.len() > MAX_KEY_BYTES {
        s.pop();
    }
    if s.is_empty() {
        s.push(char::from(b'a' + u.int_in_range(0..=2)?));
    }
    Ok(s)
}

fn value_for(u: &mut Unstructured<'_>, source: &FieldSource) -> Result<Sent> {
    Ok(match source {
        FieldSource::Header(_) => {
            let len = u.int_in_range(1..=MAX_KEY_BYTES)?;
            let key = visible_ascii(u, len)?;
            let wire = if key[0] != b'"' && u.arbitrary()? {
                key.clone()
            } else {
                sf_string(&key)
            };
            Sent { wire, key }
        }
        FieldSource::Query(_) | FieldSource::Form(_) => {
            let text = text_value(u)?;
            Sent {
                wire: percent_encode(text.as_bytes(), u.arbitrary()?).into_bytes(),
                key: text.into_bytes(),
            }
        }
        FieldSource::Json(_) => {
            if u.ratio(1, 4)? {
                let literal = number_literal(u)?;
                Sent {
                    wire: literal.clone().into_bytes(),
                    key: literal.into_bytes(),
                }
            } else {
                let text = text_value(u)?;
                Sent {
                    wire: serde_json::to_vec(&text).expect("a string serializes"),
                    key: text.into_bytes(),
                }
            }
        }
    })
}

/// The key of a request carrying `values` for `sources`, None when it has none.
fn key_of(sources: &[FieldSource], values: &[Sent], json_body: bool) -> Option<Vec<u8>> {
    let mut query = Vec::new();
    let mut body_fields = Vec::new();
    for (source, v) in sources.iter().zip(values) {
        let wire = String::from_utf8(v.wire.clone()).expect("ASCII or UTF-8");
        match source {
            FieldSource::Query(q) => query.push(format!("{q}={wire}")),
            FieldSource::Json(p) => body_fields.push(format!("\"{}\":{wire}", &p[1..])),
            FieldSource::Form(f) => body_fields.push(format!("{f}={wire}")),
            FieldSource::Header(_) => {}
        }
    }
    let path = format!("/orders?x=1&{}", query.join("&"));
    let body = if json_body {
        format!("{{\"other\":[1,2],{}}}", body_fields.join(","))
    } else {
        format!("other=1&{}", body_fields.join("&"))
    };
    let header = |name: &str| {
        sources
            .iter()
            .position(|s| *s == FieldSource::Header(name.to_string()))
            .map(|i| &values[i].wire[..])
    };
    let parts = header_parts(sources, header, &path).ok()?;
    let content_type = if json_body { JSON } else { FORM };
    let mut parsed = RequestBody::new(content_type, body.as_bytes());
    complete_key(sources, parts, &mut parsed).ok()
}

fn built(u: &mut Unstructured<'_>) -> Result<()> {
    let json_body = u.arbitrary()?;
    let n = u.int_in_range(1..=4)?;
    let mut sources = Vec::with_capacity(n);
    for i in 0..n {
        sources.push(match u.int_in_range(0..=2)? {
            0 => FieldSource::Header(format!("x-h{i}")),
            1 => FieldSource::Query(format!("q{i}")),
            _ if json_body => FieldSource::Json(format!("/f{i}")),
            _ => FieldSource::Form(format!("f{i}")),
        });
    }
    let first: Vec<Sent> = sources
        .iter()
        .map(|s| value_for(u, s))
        .collect::<Result<_>>()?;
    // The second request changes some of the values (or none).
    let mut second = Vec::with_capacity(n);
    for (source, v) in sources.iter().zip(&first) {
        second.push(if u.arbitrary()? {
            value_for(u, source)?
        } else {
            Sent {
                wire: v.wire.clone(),
                key: v.key.clone(),
            }
        });
    }
    let key1 = key_of(&sources, &first, json_body).expect("every source holds a valid value");
    let key2 = key_of(&sources, &second, json_body).expect("every source holds a valid value");
    if n == 1 {
        assert_eq!(key1, first[0].key, "a single source is the key");
    }
    let same = first.iter().zip(&second).all(|(a, b)| a.key == b.key);
    assert_eq!(key1 == key2, same, "{sources:?}");
    Ok(())
}

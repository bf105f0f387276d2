//! Values built from the fuzzer's bytes, and the reference encodings the checks compare the
//! product's against (written here from the specifications, not from the product's code).

use arbitrary::{Result, Unstructured};
use idempotency_protocol::record::{RecordedResponse, Retention, UnknownOutcome};

/// Visible ASCII (0x21-0x7E), `len` bytes of it.
pub fn visible_ascii(u: &mut Unstructured<'_>, len: usize) -> Result<Vec<u8>> {
    (0..len)
        .map(|_| Ok(0x21 + u.int_in_range(0..=0x5d_u8)?))
        .collect()
}

/// A short name from a small alphabet, so that two generated names often collide.
pub fn short_name(u: &mut Unstructured<'_>) -> Result<String> {
    let len = u.int_in_range(1..=3)?;
    (0..len)
        .map(|_| Ok(char::from(*u.choose(b"abc_-")?)))
        .collect()
}

/// A string that is sometimes of the small alphabet, sometimes anything.
pub fn any_string(u: &mut Unstructured<'_>) -> Result<String> {
    if u.ratio(1, 2)? {
        short_name(u)
    } else {
        u.arbitrary()
    }
}

/// RFC 9651 sf-string: the key in quotes, `"` and `\` escaped.
pub fn sf_string(key: &[u8]) -> Vec<u8> {
    let mut out = vec![b'"'];
    for &b in key {
        if b == b'"' || b == b'\\' {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'"');
    out
}

/// Percent-encodes every byte but the URL-unreserved ones; `+` for space half of the time,
/// as form encoders may.
pub fn percent_encode(bytes: &[u8], plus_for_space: bool) -> String {
    let mut out = String::with_capacity(bytes.len() * 3);
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(char::from(b));
        } else if b == b' ' && plus_for_space {
            out.push('+');
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A JSON value as a sender may write it: members in any order and named twice, numbers as
/// literal text.
#[derive(Debug, Clone, PartialEq)]
pub enum Tree {
    Null,
    Bool(bool),
    /// Literal text in JSON's number grammar, within f64's range.
    Number(String),
    Str(String),
    Array(Vec<Tree>),
    Object(Vec<(String, Tree)>),
}

impl Tree {
    pub fn generate(u: &mut Unstructured<'_>, depth: u8) -> Result<Tree> {
        let leaf_only = depth == 0;
        Ok(match u.int_in_range(0..=if leaf_only { 3 } else { 5 })? {
            0 => Tree::Null,
            1 => Tree::Bool(u.arbitrary()?),
            2 => Tree::Number(number_literal(u)?),
            3 => Tree::Str(any_string(u)?),
            4 => {
                let n = u.int_in_range(0..=3)?;
                Tree::Array(
                    (0..n)
                        .map(|_| Tree::generate(u, depth - 1))
                        .collect::<Result<_>>()?,
                )
            }
            _ => {
                let n = u.int_in_range(0..=4)?;
                Tree::Object(
                    (0..n)
                        .map(|_| Ok((short_name(u)?, Tree::generate(u, depth - 1)?)))
                        .collect::<Result<_>>()?,
                )
            }
        })
    }

    /// JSON text: members in their order, or in another order that keeps each name's values
    /// in theirs (descending by name), with whitespace between every token.
    pub fn write(&self, shuffled: bool, out: &mut String) {
        let gap = if shuffled { " \n\t" } else { "" };
        match self {
            Tree::Null => out.push_str("null"),
            Tree::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Tree::Number(text) => out.push_str(text),
            Tree::Str(s) => out.push_str(&json_string(s)),
            Tree::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(gap);
                    item.write(shuffled, out);
                }
                out.push_str(gap);
                out.push(']');
            }
            Tree::Object(members) => {
                let mut members: Vec<&(String, Tree)> = members.iter().collect();
                if shuffled {
                    members.sort_by(|a, b| b.0.cmp(&a.0));
                }
                out.push('{');
                for (i, (name, value)) in members.into_iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(gap);
                    out.push_str(&json_string(name));
                    out.push_str(gap);
                    out.push(':');
                    out.push_str(gap);
                    value.write(shuffled, out);
                }
                out.push_str(gap);
                out.push('}');
            }
        }
    }

    pub fn text(&self, shuffled: bool) -> String {
        let mut out = String::new();
        self.write(shuffled, &mut out);
        out
    }

    /// The canonical form the fingerprint documents: members sorted by name (stably, so a name
    /// given twice keeps both values in their order), no whitespace, numbers as sent.
    pub fn canonical(&self) -> String {
        match self {
            Tree::Array(items) => {
                let inner: Vec<String> = items.iter().map(Tree::canonical).collect();
                format!("[{}]", inner.join(","))
            }
            Tree::Object(members) => {
                let mut sorted: Vec<&(String, Tree)> = members.iter().collect();
                sorted.sort_by(|a, b| a.0.cmp(&b.0));
                let inner: Vec<String> = sorted
                    .into_iter()
                    .map(|(n, v)| format!("{}:{}", json_string(n), v.canonical()))
                    .collect();
                format!("{{{}}}", inner.join(","))
            }
            leaf => leaf.text(false),
        }
    }
}

/// A string as JSON text. serde_json's escaping, which the canonical form names as its own.
pub fn json_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string always serializes")
}

/// A number in JSON's grammar (`-? int frac? exp?`), kept far from f64's overflow.
pub fn number_literal(u: &mut Unstructured<'_>) -> Result<String> {
    let mut text = String::new();
    if u.ratio(1, 3)? {
        text.push('-');
    }
    let int_digits = u.int_in_range(1..=22)?;
    if int_digits == 1 {
        text.push(char::from(b'0' + u.int_in_range(0..=9)?));
    } else {
        text.push(char::from(b'1' + u.int_in_range(0..=8)?));
        for _ in 1..int_digits {
            text.push(char::from(b'0' + u.int_in_range(0..=9)?));
        }
    }
    if u.ratio(1, 3)? {
        text.push('.');
        for _ in 0..u.int_in_range(1..=4)? {
            text.push(char::from(b'0' + u.int_in_range(0..=9)?));
        }
    }
    if u.ratio(1, 4)? {
        text.push(*u.choose(&['e', 'E'])?);
        if let Some(sign) = u.choose(&[None, Some('+'), Some('-')])? {
            text.push(*sign);
        }
        for _ in 0..u.int_in_range(1..=2)? {
            text.push(char::from(b'0' + u.int_in_range(0..=9)?));
        }
    }
    Ok(text)
}

/// 64 hex characters of either case, or (half of the time) something close to it or not.
pub fn digest_text(u: &mut Unstructured<'_>) -> Result<String> {
    if u.ratio(1, 2)? {
        let hex = b"0123456789abcdefABCDEF";
        (0..64).map(|_| Ok(char::from(*u.choose(hex)?))).collect()
    } else {
        token_text(u, 70)
    }
}

/// Hex of 1 to `max` characters, or anything (empty, too long, not hex).
pub fn token_text(u: &mut Unstructured<'_>, max: usize) -> Result<String> {
    if u.ratio(2, 3)? {
        let len = u.int_in_range(0..=max)?;
        let alphabet = b"0123456789abcdefABCDEFxz";
        (0..len)
            .map(|_| Ok(char::from(*u.choose(alphabet)?)))
            .collect()
    } else {
        u.arbitrary()
    }
}

/// The leases of a renew: (key, owner) pairs, mostly a few, sometimes none or around the
/// store's bound of `max`; each key and owner valid or not.
pub fn renew_leases(u: &mut Unstructured<'_>, max: usize) -> Result<Vec<(String, String)>> {
    let count = *u.choose(&[0, 1, 1, 2, 3, 5, max, max + 1])?;
    (0..count)
        .map(|_| Ok((digest_text(u)?, token_text(u, 66)?)))
        .collect()
}

/// A response a sound filter could have recorded: token header names, values without CR, LF
/// or NUL.
pub fn replayable_record(u: &mut Unstructured<'_>) -> Result<RecordedResponse> {
    let tchar = b"abcdefghijklmnopqrstuvwxyz0123456789!#$%&'*+-.^_`|~ABC";
    let count = u.int_in_range(0..=6)?;
    let mut headers = Vec::with_capacity(count);
    for _ in 0..count {
        let name_len = u.int_in_range(1..=12)?;
        let name = (0..name_len)
            .map(|_| Ok(char::from(*u.choose(tchar)?)))
            .collect::<Result<String>>()?;
        let value: Vec<u8> = u
            .arbitrary::<Vec<u8>>()?
            .into_iter()
            .filter(|b| !matches!(b, b'\r' | b'\n' | 0))
            .collect();
        headers.push((name, value));
    }
    let trailers = if u.arbitrary::<bool>()? {
        vec![(
            "grpc-status".to_string(),
            u.int_in_range(0..=16_u8)?.to_string().into_bytes(),
        )]
    } else {
        Vec::new()
    };
    Ok(RecordedResponse {
        owner: u.arbitrary()?,
        status: u.arbitrary()?,
        headers,
        body: u.arbitrary()?,
        trailers,
        body_omitted: u.arbitrary()?,
        unknown: unknown_outcome(u)?,
    })
}

/// Now and then what Envoy reported of a write whose outcome is unknown; its details within
/// the 255 bytes the record keeps.
pub fn unknown_outcome(u: &mut Unstructured<'_>) -> Result<Option<Box<UnknownOutcome>>> {
    if !u.arbitrary::<bool>()? {
        return Ok(None);
    }
    let mut details: String = u.arbitrary()?;
    while details.len() > 255 {
        details.pop();
    }
    Ok(Some(Box::new(UnknownOutcome {
        proxy_status: u.arbitrary()?,
        response_flags: u.arbitrary()?,
        details,
        attempts: u.arbitrary()?,
        resolution_due_ms: u.arbitrary()?,
        retention: if u.arbitrary()? {
            Some(Retention {
                ttl_ms: u.arbitrary()?,
                tombstone_ms: u.arbitrary()?,
            })
        } else {
            None
        },
    })))
}

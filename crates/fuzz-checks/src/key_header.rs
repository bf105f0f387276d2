//! The `Idempotency-Key` header value (`idempotency_protocol::naming::parse_key`).

use arbitrary::{Result, Unstructured};
use idempotency_protocol::naming::{parse_key, KeyError, MAX_KEY_BYTES};

use crate::gen::{sf_string, visible_ascii};

/// A key that parses is 1 to 255 bytes of visible ASCII, and its sf-string and bare-token
/// forms parse to it again; a refusal names a real fault of the input; surrounding spaces
/// and tabs never change the answer. Keys built from the input: both forms give the same
/// key, one byte too many or one invalid byte is refused as such.
pub fn key_header(data: &[u8]) {
    raw(data);
    let _ = built(&mut Unstructured::new(data));
}

fn is_visible(b: u8) -> bool {
    (0x21..=0x7e).contains(&b)
}

fn trim_ows(raw: &[u8]) -> &[u8] {
    let is_ows = |b: &u8| *b == b' ' || *b == b'\t';
    let start = raw.iter().position(|b| !is_ows(b)).unwrap_or(raw.len());
    let end = raw
        .iter()
        .rposition(|b| !is_ows(b))
        .map_or(start, |e| e + 1);
    &raw[start..end.max(start)]
}

fn raw(data: &[u8]) {
    let parsed = parse_key(data);
    let padded = [b" \t", data, b"\t "].concat();
    assert_eq!(parse_key(&padded), parsed, "spaces around the value");
    let trimmed = trim_ows(data);
    match &parsed {
        Ok(key) => {
            assert!((1..=MAX_KEY_BYTES).contains(&key.len()), "{key:?}");
            assert!(key.iter().copied().all(is_visible), "{key:?}");
            assert_eq!(parse_key(&sf_string(key)).as_ref(), Ok(key), "sf-string");
            if key.first() != Some(&b'"') {
                assert_eq!(parse_key(key).as_ref(), Ok(key), "bare token");
            }
        }
        Err(KeyError::Empty) => assert!(trimmed.is_empty() || trimmed == b"\"\""),
        Err(KeyError::TooLong { len }) => assert!(*len > MAX_KEY_BYTES && *len <= trimmed.len()),
        Err(KeyError::InvalidByte { position }) => {
            let b = trimmed.get(*position).copied();
            assert!(
                b.is_some_and(|b| !is_visible(b)),
                "{position} in {trimmed:?}"
            );
        }
        Err(KeyError::MalformedQuotedString) => assert_eq!(trimmed.first(), Some(&b'"')),
    }
}

fn built(u: &mut Unstructured<'_>) -> Result<()> {
    let len = u.int_in_range(1..=MAX_KEY_BYTES)?;
    let key = visible_ascii(u, len)?;
    assert_eq!(parse_key(&sf_string(&key)), Ok(key.clone()));
    if key.first() != Some(&b'"') {
        assert_eq!(parse_key(&key), Ok(key.clone()));
    }
    if len == MAX_KEY_BYTES {
        let longer = [&key[..], b"x"].concat();
        assert_eq!(
            parse_key(&sf_string(&longer)),
            Err(KeyError::TooLong { len: len + 1 })
        );
    }
    // One byte outside visible ASCII (not a leading or trailing space or tab, which are
    // trimmed), anywhere in a bare token.
    let at = u.int_in_range(0..=len - 1)?;
    let bad = *u.choose(&[0x00, 0x09, 0x20, 0x7f, 0x80, 0xff])?;
    let mut broken = key.clone();
    broken[at] = bad;
    let edge = at == 0 || at == len - 1;
    if broken[0] != b'"' && !(edge && (bad == b' ' || bad == b'\t')) {
        assert_eq!(
            parse_key(&broken),
            Err(KeyError::InvalidByte { position: at })
        );
    }
    Ok(())
}

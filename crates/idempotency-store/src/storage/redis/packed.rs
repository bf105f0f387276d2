//! A record as one Redis string: a short text header, then the recorded response's bytes.
//!
//! ```text
//! i1\n<state>\n<fingerprint>\n<owner>\n<expires_at_ms>\n<written_at_ms>\n<record>
//! ```
//!
//! `state` is `F` (in flight: `owner` is the claimant's token, `record` empty) or `C`
//! (completed: `owner` empty). Hex digests, hex owners and decimal numbers hold no newline,
//! so the header splits on the first five; the record is the rest, byte for byte.
//!
//! A record with a tombstone, which may be kept for a year and so is most of what a long
//! retention holds, has a binary header instead, 46 bytes where the text one takes 99:
//!
//! ```text
//! t1<fingerprint: 32 bytes><expires_at_ms: 6 bytes><written_at_ms: 6 bytes><tombstone>
//! ```
//!
//! (instants big-endian, good until the year 10889). Its record is the tombstone, the
//! response without its body, and `expires_at_ms` the tombstone's end; the whole response is
//! a string of its own at the key plus `:w` (`whole_key`), which Redis expires at the TTL.
//!
//! One string lets a claim be one native `SET key value NX PX lease GET` instead of a
//! script, and costs Redis a string's bytes instead of a hash table's (see docs/redis.md).
//! The scripts in `scripts.rs` read and write the same layouts in Lua (`PACKED_LUA`).

use super::super::{Digest, OwnerToken, RecordState, RecordView};

/// The header's first line, naming this layout; a later layout gets its own.
const MAGIC: &[u8] = b"i1\n";
const IN_FLIGHT: &[u8] = b"F";
const COMPLETED: &[u8] = b"C";
/// A record with a tombstone: its own layout, named by its first two bytes.
const TOMBSTONED_MAGIC: &[u8] = b"t1";
const INSTANT_BYTES: usize = 6;

/// A packed record, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packed<'a> {
    pub state: RecordState,
    pub fingerprint: Digest,
    pub owner: Option<OwnerToken>,
    pub expires_at_ms: u64,
    pub written_at_ms: u64,
    /// The recorded response; empty while in flight; the tombstone for a `t1` record.
    pub record: &'a [u8],
    /// A `t1` record: the whole response is kept apart, until the TTL.
    pub whole_apart: bool,
}

/// The value of a fresh claim by `owner`, made at `now_ms`, its lease ending at
/// `expires_at_ms`.
pub fn in_flight(
    fingerprint: &Digest,
    owner: &OwnerToken,
    expires_at_ms: u64,
    now_ms: u64,
) -> Vec<u8> {
    let mut value = Vec::with_capacity(MAGIC.len() + 2 + 64 + 1 + 64 + 2 * 21);
    value.extend_from_slice(MAGIC);
    for field in [
        IN_FLIGHT,
        fingerprint.as_str().as_bytes(),
        owner.as_str().as_bytes(),
        expires_at_ms.to_string().as_bytes(),
        now_ms.to_string().as_bytes(),
    ] {
        value.extend_from_slice(field);
        value.push(b'\n');
    }
    value
}

/// Reads a packed record; None for anything else (another layout, a damaged value).
pub fn parse(value: &[u8]) -> Option<Packed<'_>> {
    if let Some(rest) = value.strip_prefix(TOMBSTONED_MAGIC) {
        return parse_tombstoned(rest);
    }
    let mut rest = value.strip_prefix(MAGIC)?;
    let mut fields: [&[u8]; 5] = [&[]; 5];
    for field in &mut fields {
        let end = rest.iter().position(|&b| b == b'\n')?;
        let (head, tail) = rest.split_at(end);
        *field = head;
        rest = tail.get(1..)?;
    }
    let [state, fingerprint, owner, expires_at_ms, written_at_ms] = fields;
    let text = |bytes: &[u8]| std::str::from_utf8(bytes).ok().map(str::to_owned);
    let number = |bytes: &[u8]| std::str::from_utf8(bytes).ok()?.parse::<u64>().ok();
    let state = match state {
        IN_FLIGHT => RecordState::InFlight,
        COMPLETED => RecordState::Completed,
        _ => return None,
    };
    let owner = match state {
        RecordState::InFlight => Some(OwnerToken::parse(&text(owner)?).ok()?),
        RecordState::Completed => None,
    };
    Some(Packed {
        state,
        fingerprint: Digest::parse(&text(fingerprint)?).ok()?,
        owner,
        expires_at_ms: number(expires_at_ms)?,
        written_at_ms: number(written_at_ms)?,
        record: rest,
        whole_apart: false,
    })
}

/// The binary layout of a record with a tombstone, after its magic.
fn parse_tombstoned(value: &[u8]) -> Option<Packed<'_>> {
    let (fingerprint, rest) = value.split_first_chunk::<32>()?;
    let (expires_at_ms, rest) = rest.split_first_chunk::<INSTANT_BYTES>()?;
    let (written_at_ms, record) = rest.split_first_chunk::<INSTANT_BYTES>()?;
    let instant =
        |bytes: &[u8; INSTANT_BYTES]| bytes.iter().fold(0u64, |n, &b| (n << 8) | u64::from(b));
    Some(Packed {
        state: RecordState::Completed,
        fingerprint: Digest::from(fingerprint),
        owner: None,
        expires_at_ms: instant(expires_at_ms),
        written_at_ms: instant(written_at_ms),
        record,
        whole_apart: true,
    })
}

impl Packed<'_> {
    /// The response a reader gets: the whole one kept apart (`whole`, read from
    /// `whole_key`) while it lasts, else the record's own bytes (a `t1` record's tombstone).
    pub fn answered(&self, whole: Option<&[u8]>) -> Vec<u8> {
        match whole {
            Some(whole) if self.whole_apart => whole.to_vec(),
            _ => self.record.to_vec(),
        }
    }

    /// What a lookup shows, read at `now_ms`; `whole` as for [`Self::answered`].
    pub fn view(&self, now_ms: u64, whole: Option<&[u8]>) -> RecordView {
        RecordView {
            state: self.state,
            fingerprint: self.fingerprint.clone(),
            expires_at_ms: self.expires_at_ms,
            record: match self.state {
                RecordState::Completed => Some(self.answered(whole)),
                RecordState::InFlight => None,
            },
            owner: self.owner.clone(),
            written_at_ms: Some(self.written_at_ms),
            now_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn digest(c: char) -> Digest {
        Digest::parse(&c.to_string().repeat(64)).unwrap()
    }

    #[test]
    fn a_claim_reads_back_as_written() {
        let owner = OwnerToken::parse("00ff").unwrap();
        let value = in_flight(&digest('a'), &owner, 1_700_000_060_000, 1_700_000_000_000);
        let read = parse(&value).unwrap();
        assert_eq!(read.state, RecordState::InFlight);
        assert_eq!(read.fingerprint, digest('a'));
        assert_eq!(read.owner, Some(owner));
        assert_eq!(read.expires_at_ms, 1_700_000_060_000);
        assert_eq!(read.written_at_ms, 1_700_000_000_000);
        assert!(read.record.is_empty());
    }

    #[test]
    fn a_completed_record_keeps_its_bytes_newlines_and_all() {
        let mut value = format!("i1\nC\n{}\n\n9\n8\n", "b".repeat(64)).into_bytes();
        let body = b"HTTP 201\n\n\x00\xff{\"id\":1}\n";
        value.extend_from_slice(body);
        let read = parse(&value).unwrap();
        assert_eq!(read.state, RecordState::Completed);
        assert_eq!(read.owner, None);
        assert_eq!(read.record, body);
        assert_eq!(read.view(10, None).record.as_deref(), Some(&body[..]));
        assert!(!read.whole_apart);
    }

    #[test]
    fn a_tombstoned_record_answers_its_whole_response_while_that_lasts() {
        let mut value = b"t1".to_vec();
        value.extend_from_slice(&[0xbb; 32]);
        value.extend_from_slice(&[0x01, 0x8b, 0xcf, 0xe5, 0x68, 0x00]);
        value.extend_from_slice(&[0, 0, 0, 0, 0x01, 0x02]);
        value.extend_from_slice(b"status only");
        let read = parse(&value).unwrap();
        assert_eq!(read.state, RecordState::Completed);
        assert_eq!(read.fingerprint, digest('b'));
        assert_eq!(read.expires_at_ms, 1_700_000_000_000);
        assert_eq!(read.written_at_ms, 258);
        assert_eq!(read.owner, None);
        assert!(read.whole_apart);
        assert_eq!(read.answered(Some(b"whole")), b"whole");
        assert_eq!(read.answered(None), b"status only");
    }

    #[test]
    fn anything_else_is_not_a_record() {
        let fp = "c".repeat(64);
        for bad in [
            String::new(),
            "i1\n".to_owned(),
            format!("i2\nC\n{fp}\n\n9\n8\n"),
            format!("i1\nX\n{fp}\n\n9\n8\n"),
            format!("i1\nC\n{fp}\n\nnine\n8\n"),
            format!("i1\nF\n{fp}\n\n9\n8\n"),
            "i1\nC\nshort\n\n9\n8\n".to_owned(),
            format!("i1\nC\n{fp}\n\n9\n8"),
            format!("i1\nT\n{fp}\n\n9\n8\n"),
            // A tombstoned record shorter than its header.
            format!("t1{}", "c".repeat(32 + 11)),
        ] {
            assert_eq!(parse(bad.as_bytes()), None, "{bad:?}");
        }
    }
}

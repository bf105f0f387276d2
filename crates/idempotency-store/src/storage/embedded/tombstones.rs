//! The tombstone table: records past their TTL, kept without their body until their
//! tombstone's end.
//!
//! Tombstones live in a table of their own rather than shrinking in place among the whole
//! records: redb merges a leaf with its neighbour only when a deletion leaves it under a third
//! full, never when a value shrinks, so a leaf of three whole responses kept its page for three
//! tombstones (about 1,430 bytes of file each in the scale run). Here leaves hold tombstones
//! only, and every field is binary: the key and fingerprint as 32 bytes each, not 64 hex
//! characters.

use redb::TableDefinition;

use super::{Digest, StoredBody, StoredRecord};

/// Key bytes -> encoded tombstone.
pub(super) const TOMBSTONES: TableDefinition<&[u8; 32], &[u8]> =
    TableDefinition::new("tombstones_v1");

// Layout of one tombstone, version 1:
//   [0]      format version (1)
//   [1..9]   the tombstone's end (its expiry), big endian
//   [9..17]  written_at_ms, big endian
//   [17..49] fingerprint, 32 bytes
//   [49..]   the recorded response without its body
const FORMAT_V1: u8 = 1;

/// The bytes of a tombstone, or None for a record that is not one this table keeps: an
/// in-flight claim, or a record whose written time is unknown (read from format 1, which
/// never has a tombstone: the sweeper converts only format 3).
pub(super) fn encode(rec: &StoredRecord) -> Option<Vec<u8>> {
    let StoredBody::Completed { record } = &rec.body else {
        return None;
    };
    let written_at_ms = rec.written_at_ms?;
    if rec.tombstone_until_ms.is_some() {
        return None;
    }
    let fingerprint = rec.fingerprint.to_bytes()?;
    let mut out = Vec::with_capacity(1 + 8 + 8 + 32 + record.len());
    out.push(FORMAT_V1);
    out.extend_from_slice(&rec.expires_at_ms.to_be_bytes());
    out.extend_from_slice(&written_at_ms.to_be_bytes());
    out.extend_from_slice(&fingerprint);
    out.extend_from_slice(record);
    Some(out)
}

/// The tombstone's end, read without decoding the rest (the sweeper's check).
pub(super) fn expires_at_ms(bytes: &[u8]) -> Option<u64> {
    let (&version, rest) = bytes.split_first()?;
    let (exp, _) = rest.split_first_chunk::<8>()?;
    (version == FORMAT_V1).then(|| u64::from_be_bytes(*exp))
}

/// The tombstone as the record it answers for, or what is wrong with its bytes.
pub(super) fn decode(bytes: &[u8]) -> Result<StoredRecord, &'static str> {
    let (&version, rest) = bytes.split_first().ok_or("empty tombstone")?;
    if version != FORMAT_V1 {
        return Err("unknown tombstone format version");
    }
    let (exp, rest) = rest.split_first_chunk::<8>().ok_or("truncated tombstone")?;
    let (written, rest) = rest.split_first_chunk::<8>().ok_or("truncated tombstone")?;
    let (fingerprint, record) = rest
        .split_first_chunk::<32>()
        .ok_or("truncated tombstone fingerprint")?;
    Ok(StoredRecord {
        fingerprint: Digest::from(fingerprint),
        expires_at_ms: u64::from_be_bytes(*exp),
        written_at_ms: Some(u64::from_be_bytes(*written)),
        tombstone_until_ms: None,
        body: StoredBody::Completed {
            record: record.to_vec(),
        },
    })
}

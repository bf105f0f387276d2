//! What the local table keeps in Envoy's shared data, which every worker (and every earlier
//! configuration) of the process writes: buckets and page pointers (`table::codec`), the
//! registry of tables (`table::lineage`) and the layout tags in its lines (`table::layout`).

use arbitrary::{Arbitrary, Result, Unstructured};
use idempotency_core::table::codec::{
    decode_page_pointer, encode_page_pointer, reencode_bucket, BUCKET_BYTES,
};
use idempotency_core::table::layout::{Layout, PageClass};
use idempotency_core::table::lineage::{self, TableEntry};
use idempotency_core::table::{SLOT_BYTES, WAYS};
use idempotency_protocol::record::RecordedResponse;

/// Buckets: any value reads without panicking as exactly the slots it holds whole (a state
/// byte other than in-flight or completed reads as free, a short tail as free slots), so a
/// bucket the table wrote reads back as it was written, and reading is stable. Page pointers
/// decode only from the exact encoding, and never from a recorded response (the two share
/// the response keys). Layout tags and registry lines read back what was written, and
/// re-encoding what was read is stable.
pub fn table_codecs(data: &[u8]) {
    bucket(data);
    page_pointer(data);
    registry(data);
    let _ = built(&mut Unstructured::new(data));
}

fn bucket(data: &[u8]) {
    let out = reencode_bucket(data);
    assert_eq!(out.len(), BUCKET_BYTES);
    let whole = (data.len() / SLOT_BYTES).min(WAYS);
    for (way, slot) in out.chunks(SLOT_BYTES).enumerate() {
        if way < whole {
            let given = &data[way * SLOT_BYTES..(way + 1) * SLOT_BYTES];
            let state = if matches!(given[0], 1 | 2) {
                given[0]
            } else {
                0
            };
            assert_eq!(slot[0], state, "slot {way}'s state");
            assert_eq!(slot[1..], given[1..], "slot {way}");
        } else {
            assert!(
                slot.iter().all(|&b| b == 0),
                "slot {way} past the end is free"
            );
        }
    }
    assert_eq!(reencode_bucket(&out), out, "stable");
}

fn page_pointer(data: &[u8]) {
    if let Some((class, seq, owner)) = decode_page_pointer(data) {
        assert_eq!(encode_page_pointer(class, seq, owner), data);
    }
    if let Some(record) = RecordedResponse::decode(data) {
        assert_eq!(decode_page_pointer(&record.encode()), None);
    }
}

fn registry(data: &[u8]) {
    let entries = lineage::decode(data);
    let encoded = lineage::encode(&entries);
    assert_eq!(lineage::decode(&encoded), entries, "stable");
    assert!(entries.len() <= data.iter().filter(|&&b| b == b'\n').count() + 1);
    if let Ok(text) = std::str::from_utf8(data) {
        for line in text.lines() {
            let tag = line.split(' ').next().unwrap_or("");
            if let Some(layout) = Layout::parse(tag) {
                assert_eq!(Layout::parse(&layout.tag()), Some(layout), "{tag}");
            }
        }
    }
}

#[derive(Arbitrary, Debug)]
struct BuiltLayout {
    buckets: u32,
    inline_bytes: u32,
    classes: Vec<(u32, u32)>,
}

impl BuiltLayout {
    fn layout(&self) -> Layout {
        Layout {
            buckets: self.buckets,
            inline_bytes: self.inline_bytes,
            classes: self
                .classes
                .iter()
                .map(|&(page_bytes, pages)| PageClass { page_bytes, pages })
                .collect(),
        }
    }
}

fn built(u: &mut Unstructured<'_>) -> Result<()> {
    // A bucket the table could write: every state byte free, in flight or completed.
    let mut bucket = vec![0; BUCKET_BYTES];
    u.fill_buffer(&mut bucket)?;
    for way in 0..WAYS {
        bucket[way * SLOT_BYTES] %= 3;
    }
    assert_eq!(reencode_bucket(&bucket), bucket);

    let (class, seq, owner) = u.arbitrary()?;
    let pointer = encode_page_pointer(class, seq, owner);
    assert_eq!(decode_page_pointer(&pointer), Some((class, seq, owner)));
    assert_eq!(RecordedResponse::decode(&pointer), None);
    for cut in 0..pointer.len() {
        assert_eq!(decode_page_pointer(&pointer[..cut]), None);
    }
    assert_eq!(decode_page_pointer(&[&pointer[..], &[0]].concat()), None);

    let n = u.int_in_range(0..=5)?;
    let mut entries = Vec::with_capacity(n);
    for _ in 0..n {
        let layout = BuiltLayout::arbitrary(u)?.layout();
        assert_eq!(Layout::parse(&layout.tag()).as_ref(), Some(&layout));
        let retired: u64 = u.arbitrary()?;
        entries.push(TableEntry {
            layout,
            record_life_ms: u.arbitrary()?,
            // Written as 0 when in use: a table is never retired at the epoch itself.
            retired_at_ms: (retired != 0).then_some(retired),
        });
    }
    assert_eq!(lineage::decode(&lineage::encode(&entries)), entries);
    Ok(())
}

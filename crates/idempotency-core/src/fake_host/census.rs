//! What crosses the ABI, as the fake host counts it: each host call by kind, and the bytes
//! copied into the module (`bytes_in`) and out to the host (`bytes_out`), header maps counted
//! in their ABI serialisation. The census test (`journey/tests/census.rs`) reads it per path.

use std::cell::RefCell;
use std::collections::BTreeMap;

/// Calls of one kind and their bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tally {
    pub calls: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
}

#[derive(Default)]
pub(crate) struct Census {
    rows: RefCell<BTreeMap<&'static str, Tally>>,
}

impl Census {
    pub fn count(&self, kind: &'static str, bytes_in: usize, bytes_out: usize) {
        let mut rows = self.rows.borrow_mut();
        let tally = rows.entry(kind).or_default();
        tally.calls += 1;
        tally.bytes_in += bytes_in as u64;
        tally.bytes_out += bytes_out as u64;
    }

    /// Everything counted since the last call, by kind.
    pub fn take(&self) -> BTreeMap<&'static str, Tally> {
        std::mem::take(&mut *self.rows.borrow_mut())
    }
}

/// A header map's size as the ABI copies it: a count, two lengths per pair, each name and
/// value with its NUL.
pub(crate) fn map_bytes<'a>(pairs: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> usize {
    4 + pairs
        .into_iter()
        .map(|(n, v)| 8 + n.len() + v.len() + 2)
        .sum::<usize>()
}

//! Test support: shared data with the host's documented CAS semantics, including the one
//! that shapes the table's design: a write to an absent key succeeds whatever cas it carries.

use std::cell::RefCell;
use std::collections::HashMap;

use crate::table::{HostError, SetOutcome, SharedData};

#[derive(Default)]
pub(crate) struct FakeShared {
    pub map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    /// Like Envoy's: one wrapping counter for the whole map, never 0.
    pub next_cas: RefCell<u32>,
}

impl SharedData for FakeShared {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        Ok(self.map.borrow().get(key).cloned())
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError> {
        let mut map = self.map.borrow_mut();
        let mut next = self.next_cas.borrow_mut();
        *next = next.wrapping_add(1).max(1);
        if let Some((_, current)) = map.get(key) {
            if matches!(cas, Some(c) if c != 0 && c != *current) {
                return Ok(SetOutcome::CasMismatch);
            }
        }
        map.insert(key.to_string(), (value.to_vec(), *next));
        Ok(SetOutcome::Stored)
    }
}

impl FakeShared {
    /// Bytes of the values of every key starting with `prefix`.
    pub fn bytes_under(&self, prefix: &str) -> usize {
        self.map
            .borrow()
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, (v, _))| v.len())
            .sum()
    }
}

//! Test support: shared data with the host's documented CAS semantics, including the one
//! that shapes the table's design: a write to an absent key succeeds whatever cas it carries.
//! A rival can be armed to run just before a chosen write, so that another worker's whole
//! operation lands between a caller's read and its compare-and-swap, as it can in Envoy.

use std::cell::RefCell;
use std::collections::HashMap;

use crate::host::{HostError, SetOutcome, SharedData};

#[derive(Default)]
pub(crate) struct FakeShared {
    pub map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    /// Like Envoy's: one wrapping counter for the whole map, never 0.
    pub next_cas: RefCell<u32>,
    /// Runs once, just before the write it counts down to (see `before_write`).
    rival: RefCell<Option<(u32, Rival)>>,
}

type Rival = Box<dyn FnOnce(&FakeShared)>;

impl SharedData for FakeShared {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        Ok(self.map.borrow().get(key).cloned())
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError> {
        let due = {
            let mut armed = self.rival.borrow_mut();
            match armed.as_mut() {
                Some((0, _)) => armed.take().map(|(_, rival)| rival),
                Some((writes_before, _)) => {
                    *writes_before -= 1;
                    None
                }
                None => None,
            }
        };
        if let Some(rival) = due {
            // The rival's own writes see no armed rival: it was taken above.
            rival(self);
        }
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

// The property tests that arm rivals run natively only (proptest does not build for wasm32).
#[cfg_attr(target_arch = "wasm32", allow(dead_code))]
impl FakeShared {
    /// Arms `rival` to run once, just before the write that follows `writes_before` others.
    pub fn before_write(&self, writes_before: u32, rival: Rival) {
        *self.rival.borrow_mut() = Some((writes_before, rival));
    }

    /// Disarms the rival; returns it when it never ran (the caller wrote too few times).
    pub fn disarm(&self) -> Option<Rival> {
        self.rival.borrow_mut().take().map(|(_, rival)| rival)
    }

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

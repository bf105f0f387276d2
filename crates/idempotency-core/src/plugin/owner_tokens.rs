//! Owner tokens: unique per claim across every worker of one Envoy process, so a late
//! request can never complete or release a claim another request took over.

use std::cell::Cell;

use crate::host::Host;
use crate::host::SetOutcome;

const SEQUENCE_BITS: u32 = 40;

pub struct OwnerTokens {
    vm_number: u64,
    next: Cell<u64>,
}

impl OwnerTokens {
    /// Takes a process-wide VM number from a shared-data counter (CAS, so each VM gets its
    /// own); falls back to the clock if shared data refuses.
    pub fn allocate(host: &impl Host, key: &str) -> OwnerTokens {
        for _ in 0..64 {
            let (current, cas) = match host.get(key) {
                Ok(Some((bytes, cas))) => (parse_u64(&bytes), Some(cas)),
                Ok(None) => (0, Some(u32::MAX)),
                Err(_) => break,
            };
            let mine = current.wrapping_add(1);
            if let Ok(SetOutcome::Stored) = host.set(key, mine.to_string().as_bytes(), cas) {
                return OwnerTokens::starting_at(mine);
            }
        }
        OwnerTokens::starting_at(host.now_nanos())
    }

    fn starting_at(vm_number: u64) -> OwnerTokens {
        OwnerTokens {
            vm_number: vm_number & ((1 << (64 - SEQUENCE_BITS)) - 1),
            next: Cell::new(1),
        }
    }

    /// Unique among the VMs of this Envoy process.
    pub fn vm_number(&self) -> u64 {
        self.vm_number
    }

    pub fn next(&self) -> u64 {
        let seq = self.next.get();
        self.next
            .set(seq.wrapping_add(1) & ((1 << SEQUENCE_BITS) - 1));
        (self.vm_number << SEQUENCE_BITS) | seq
    }
}

fn parse_u64(bytes: &[u8]) -> u64 {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

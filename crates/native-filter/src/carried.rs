//! What the workers carry to the main thread's root (`main_root.rs`): the resolutions their
//! roots took on, as plain data, in a queue the configuration shares.

use std::sync::Mutex;

use idempotency_core::plugin::resolutions::PortableResolution;

/// Resolutions carried from the workers, waiting for the main thread (bounded: each worker
/// holds at most core's budget, and the main thread takes them at its next run).
pub const MAX_CARRIED: usize = idempotency_core::plugin::resolutions::MAX_RESOLUTIONS;

/// What the workers leave for the main root.
#[derive(Default)]
pub struct Carried {
    resolutions: Mutex<Vec<PortableResolution>>,
}

impl Carried {
    /// From a worker: Err gives back what did not fit (the main thread is not keeping up).
    pub fn push(
        &self,
        resolutions: Vec<PortableResolution>,
    ) -> Result<(), Vec<PortableResolution>> {
        let mut held = self
            .resolutions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let room = MAX_CARRIED.saturating_sub(held.len());
        let mut resolutions = resolutions;
        let refused = resolutions.split_off(room.min(resolutions.len()));
        held.extend(resolutions);
        if refused.is_empty() {
            Ok(())
        } else {
            Err(refused)
        }
    }

    pub fn take_all(&self) -> Vec<PortableResolution> {
        std::mem::take(
            &mut *self
                .resolutions
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.resolutions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .is_empty()
    }
}

//! What every worker shares of one loaded configuration (`configuration.rs` loads it; each
//! worker's root reads it).

use std::sync::atomic::{AtomicBool, AtomicU64};

use crate::metrics::Metrics;

/// What every worker shares of one configuration.
pub struct Shared {
    /// Never reused in the process's life: the workers find their root by it.
    pub id: u64,
    pub configuration: Vec<u8>,
    pub metrics: Metrics,
    /// Envoy let go of the configuration (a push replaced it).
    pub retired: AtomicBool,
}

/// Bumped whenever a configuration retires, so a worker looks for roots to drop only then.
pub static RETIREMENTS: AtomicU64 = AtomicU64::new(0);

//! What every worker shares of one loaded configuration (`configuration.rs` loads it; each
//! worker's root reads it).

use std::sync::atomic::{AtomicBool, AtomicU64};

use std::sync::Arc;

use crate::carried::Carried;
use crate::courier::Courier;
use crate::main_thread::MainThread;
use crate::metrics::Metrics;

/// What every worker shares of one configuration.
pub struct Shared {
    /// Never reused in the process's life: the workers find their root by it.
    pub id: u64,
    pub configuration: Vec<u8>,
    pub metrics: Metrics,
    /// Carries the workers' store streams on the module's store thread.
    pub courier: Arc<Courier>,
    /// Brings Envoy's main thread to the configuration's main root.
    pub main_thread: Arc<MainThread>,
    /// What the workers hand the main thread's root (`main_root.rs`).
    pub carried: Carried,
    /// Envoy let go of the configuration (a push replaced it).
    pub retired: AtomicBool,
}

/// Bumped whenever a configuration retires, so a worker looks for roots to drop only then.
pub static RETIREMENTS: AtomicU64 = AtomicU64::new(0);

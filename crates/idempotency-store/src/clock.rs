//! Time source for the backends that expire records by the service's own clock.
//!
//! Injectable so the contract tests can move time forward deterministically
//! instead of sleeping.
//!
//! This is the store's one reading of the wall clock (the crate's clippy.toml refuses
//! `SystemTime::now` elsewhere): it is for the instants that are persisted or compared
//! across processes, the lease and TTL ends of records. Every duration and deadline inside
//! the process (waits, timeouts, search bounds, throttling) is measured on the monotonic
//! clock (`Instant`), which a step of the wall clock does not move.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub trait Clock: Send + Sync {
    fn now_ms(&self) -> u64;
}

/// Wall clock. A clock before 1970 reads as 0 rather than failing: expiry
/// then errs towards keeping records, never towards handing out duplicates.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    // The one place the wall clock is read (see the module's doc).
    #[allow(clippy::disallowed_methods)]
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// A clock that only moves when told to (tests).
#[derive(Debug, Default)]
pub struct ManualClock {
    now: AtomicU64,
}

impl ManualClock {
    pub fn new(start_ms: u64) -> Self {
        Self {
            now: AtomicU64::new(start_ms),
        }
    }

    pub fn advance_ms(&self, by: u64) {
        self.now.fetch_add(by, Ordering::SeqCst);
    }

    pub fn set_ms(&self, to: u64) {
        self.now.store(to, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}

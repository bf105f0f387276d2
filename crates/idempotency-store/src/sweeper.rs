//! Background removal of expired records, so the embedded file and the
//! memory map do not grow with every key ever seen. Correctness never depends
//! on it: reads already treat expired records as absent.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::storage::Storage;

pub fn spawn(storage: Arc<dyn Storage>, metrics: Arc<Metrics>, every: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        // After a stall, one sweep catches up; a burst of sweeps would not help.
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            match storage.sweep_expired().await {
                Ok(0) => {}
                Ok(n) => tracing::debug!(removed = n, "swept expired records"),
                Err(e) => {
                    metrics.backend_error(storage.backend_name());
                    tracing::warn!(error = %e, "sweeping expired records failed");
                }
            }
        }
    })
}

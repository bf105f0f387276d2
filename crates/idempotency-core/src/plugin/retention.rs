//! The retention the local table achieves under pressure, for the operator: the age of the
//! youngest record evicted in the last window, as a gauge. When it falls below the rules'
//! TTL, the budget (`local_table.max_bytes`) is too small for the write rate.

use std::cell::Cell;

use crate::host::Host;

pub const GAUGE_NAME: &str = "idempotency.local_table.youngest_evicted_age_ms";
/// The gauge shows the youngest eviction over this long (per worker), so one scrape
/// interval's worst case is not hidden by the next eviction of an old record.
const WINDOW_MS: u64 = 10_000;

pub struct Retention {
    /// 0 when the host refused the gauge.
    gauge: u32,
    /// When the current window ends, and the youngest age evicted in it.
    window: Cell<Option<(u64, u64)>>,
}

impl Retention {
    pub fn define(host: &impl Host) -> Retention {
        let gauge = host.define_gauge(GAUGE_NAME).unwrap_or_else(|e| {
            log::warn!("metric {GAUGE_NAME} not defined: {}", e.0);
            0
        });
        Retention {
            gauge,
            window: Cell::new(None),
        }
    }

    /// A record `age_ms` old was evicted now.
    pub fn on_eviction(&self, host: &impl Host, now_ms: u64, age_ms: u64) {
        let ends_at = match self.window.get() {
            Some((ends_at, youngest)) if now_ms < ends_at => {
                if age_ms >= youngest {
                    return;
                }
                ends_at
            }
            _ => now_ms.saturating_add(WINDOW_MS),
        };
        self.window.set(Some((ends_at, age_ms)));
        if self.gauge != 0 {
            host.set_gauge(self.gauge, age_ms);
        }
    }
}

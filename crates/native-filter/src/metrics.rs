//! A configuration's counters and gauges. Envoy lets a dynamic module define metrics only
//! while it creates the configuration (on the main thread), while core's roots define theirs
//! when each worker configures: so the module builds the configuration once at load, defining
//! every metric for real, and a worker's later definition finds the one defined then by name.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::abi::{ConfigHandle, CounterId, GaugeId};

#[derive(Default)]
struct Defined {
    counter_ids: HashMap<String, u32>,
    counters: Vec<CounterId>,
    gauge_ids: HashMap<String, u32>,
    gauges: Vec<GaugeId>,
}

pub struct Metrics {
    handle: ConfigHandle,
    /// While Envoy creates the configuration.
    defining: Mutex<Defined>,
    /// Once Envoy has the configuration: read on every request without a lock.
    frozen: OnceLock<Defined>,
}

impl Metrics {
    pub fn new(handle: ConfigHandle) -> Metrics {
        Metrics {
            handle,
            defining: Mutex::new(Defined::default()),
            frozen: OnceLock::new(),
        }
    }

    fn defining(&self) -> MutexGuard<'_, Defined> {
        self.defining
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// No metric is defined after this (Envoy would refuse it).
    pub fn freeze(&self) {
        let defined = std::mem::take(&mut *self.defining());
        let _ = self.frozen.set(defined);
    }

    pub fn counter(&self, name: &str) -> Result<u32, String> {
        if let Some(frozen) = self.frozen.get() {
            return frozen.counter_ids.get(name).copied().ok_or_else(|| {
                format!("counter {name} was not defined when the configuration loaded")
            });
        }
        let mut defined = self.defining();
        if let Some(id) = defined.counter_ids.get(name) {
            return Ok(*id);
        }
        let counter = self
            .handle
            .define_counter(name)
            .map_err(|e| e.to_string())?;
        defined.counters.push(counter);
        let id = metric_id(defined.counters.len())?;
        defined.counter_ids.insert(name.to_string(), id);
        Ok(id)
    }

    pub fn gauge(&self, name: &str) -> Result<u32, String> {
        if let Some(frozen) = self.frozen.get() {
            return frozen.gauge_ids.get(name).copied().ok_or_else(|| {
                format!("gauge {name} was not defined when the configuration loaded")
            });
        }
        let mut defined = self.defining();
        if let Some(id) = defined.gauge_ids.get(name) {
            return Ok(*id);
        }
        let gauge = self.handle.define_gauge(name).map_err(|e| e.to_string())?;
        defined.gauges.push(gauge);
        let id = metric_id(defined.gauges.len())?;
        defined.gauge_ids.insert(name.to_string(), id);
        Ok(id)
    }

    /// A lost increment is not worth failing a request over (as in core's `Host`).
    pub fn increment(&self, id: u32) {
        let counter = match self.frozen.get() {
            Some(frozen) => slot(&frozen.counters, id),
            None => slot(&self.defining().counters, id),
        };
        if let Some(counter) = counter {
            if let Err(e) = self.handle.increment_counter(counter, 1) {
                log::debug!("counter not incremented: {e}");
            }
        }
    }

    pub fn set_gauge(&self, id: u32, value: u64) {
        let gauge = match self.frozen.get() {
            Some(frozen) => slot(&frozen.gauges, id),
            None => slot(&self.defining().gauges, id),
        };
        if let Some(gauge) = gauge {
            if let Err(e) = self.handle.set_gauge(gauge, value) {
                log::debug!("gauge not set: {e}");
            }
        }
    }
}

/// Ids start at 1, as proxy-wasm's do: core reads 0 as "not defined" and counts nothing.
fn metric_id(count: usize) -> Result<u32, String> {
    u32::try_from(count).map_err(|e| e.to_string())
}

fn slot<T: Copy>(defined: &[T], id: u32) -> Option<T> {
    defined.get((id as usize).checked_sub(1)?).copied()
}

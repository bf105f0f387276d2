//! A configuration's counters and gauges. Envoy lets a dynamic module define metrics only
//! while it creates the configuration (on the main thread), while core's roots define theirs
//! when each worker configures: so the module builds the configuration once at load, defining
//! every metric for real, and a worker's later definition finds the one defined then by name.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::abi::{ConfigHandle, CounterId, GaugeId};

/// One kind of metric as defined so far: ids by name, Envoy's handles by id.
struct Book<T> {
    ids: HashMap<String, u32>,
    handles: Vec<T>,
}

impl<T> Default for Book<T> {
    fn default() -> Self {
        Book {
            ids: HashMap::new(),
            handles: Vec::new(),
        }
    }
}

impl<T: Copy> Book<T> {
    /// The metric's id; `define` asks Envoy for it the first time.
    fn id(
        &mut self,
        name: &str,
        define: impl FnOnce() -> Result<T, crate::abi::AbiError>,
    ) -> Result<u32, String> {
        if let Some(id) = self.ids.get(name) {
            return Ok(*id);
        }
        self.handles.push(define().map_err(|e| e.to_string())?);
        let id = metric_id(self.handles.len())?;
        self.ids.insert(name.to_string(), id);
        Ok(id)
    }

    fn handle(&self, id: u32) -> Option<T> {
        self.handles.get((id as usize).checked_sub(1)?).copied()
    }
}

#[derive(Default)]
struct Defined {
    counters: Book<CounterId>,
    gauges: Book<GaugeId>,
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
            return frozen.counters.ids.get(name).copied().ok_or_else(|| {
                format!("counter {name} was not defined when the configuration loaded")
            });
        }
        self.defining()
            .counters
            .id(name, || self.handle.define_counter(name))
    }

    pub fn gauge(&self, name: &str) -> Result<u32, String> {
        if let Some(frozen) = self.frozen.get() {
            return frozen.gauges.ids.get(name).copied().ok_or_else(|| {
                format!("gauge {name} was not defined when the configuration loaded")
            });
        }
        self.defining()
            .gauges
            .id(name, || self.handle.define_gauge(name))
    }

    /// A lost increment is not worth failing a request over (as in core's `Host`).
    pub fn increment(&self, id: u32) {
        let counter = match self.frozen.get() {
            Some(frozen) => frozen.counters.handle(id),
            None => self.defining().counters.handle(id),
        };
        if let Some(counter) = counter {
            if let Err(e) = self.handle.increment_counter(counter, 1) {
                log::debug!("counter not incremented: {e}");
            }
        }
    }

    pub fn set_gauge(&self, id: u32, value: u64) {
        let gauge = match self.frozen.get() {
            Some(frozen) => frozen.gauges.handle(id),
            None => self.defining().gauges.handle(id),
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

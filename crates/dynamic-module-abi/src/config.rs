//! The filter config's Envoy object: its metrics (any thread), its scheduler and its own
//! callouts (main thread).

use std::time::Duration;

use crate::buffers::module_buffer;
use crate::{ffi, metrics, start_callout, AbiError};

/// A counter defined on the filter config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterId(pub(crate) usize);

/// A gauge defined on the filter config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GaugeId(pub(crate) usize);

/// The filter config's Envoy object (`DynamicModuleHttpFilterConfig*`). Valid until the
/// config's destroy hook (which drops the factory holding it); usable from any thread.
#[derive(Debug, Clone, Copy)]
pub struct ConfigHandle {
    ptr: ffi::HttpFilterConfigEnvoyPtr,
}

// SAFETY: the config-level metric calls only read the config's metric table (frozen after
// config creation) and touch Envoy stats, which are atomic.
unsafe impl Send for ConfigHandle {}
// SAFETY: as above.
unsafe impl Sync for ConfigHandle {}

impl ConfigHandle {
    /// # Safety
    /// `ptr` must be the `filter_config_envoy_ptr` Envoy passed to the config-new hook.
    pub unsafe fn from_raw(ptr: ffi::HttpFilterConfigEnvoyPtr) -> ConfigHandle {
        ConfigHandle { ptr }
    }

    /// Defines a counter, named `<metrics namespace>.<name>` in Envoy's stats. Only during
    /// the factory builder (config creation); afterwards Envoy answers Frozen.
    pub fn define_counter(&self, name: &str) -> Result<CounterId, AbiError> {
        let mut id: usize = 0;
        // SAFETY: the name is read during the call; `id` is written by Envoy.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_define_counter(
                self.ptr,
                module_buffer(name.as_bytes()),
                std::ptr::null_mut(),
                0,
                &mut id,
            )
        };
        metrics("http_filter_config_define_counter", result).map(|()| CounterId(id))
    }

    /// Adds `by` to a counter, from any thread.
    pub fn increment_counter(&self, id: CounterId, by: u64) -> Result<(), AbiError> {
        // SAFETY: no labels.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_increment_counter(
                self.ptr,
                id.0,
                std::ptr::null_mut(),
                0,
                by,
            )
        };
        metrics("http_filter_config_increment_counter", result)
    }

    /// Defines a gauge (see `define_counter`).
    pub fn define_gauge(&self, name: &str) -> Result<GaugeId, AbiError> {
        let mut id: usize = 0;
        // SAFETY: the name is read during the call; `id` is written by Envoy.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_define_gauge(
                self.ptr,
                module_buffer(name.as_bytes()),
                std::ptr::null_mut(),
                0,
                &mut id,
            )
        };
        metrics("http_filter_config_define_gauge", result).map(|()| GaugeId(id))
    }

    /// Sets a gauge, from any thread.
    pub fn set_gauge(&self, id: GaugeId, value: u64) -> Result<(), AbiError> {
        // SAFETY: no labels.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_set_gauge(
                self.ptr,
                id.0,
                std::ptr::null_mut(),
                0,
                value,
            )
        };
        metrics("http_filter_config_set_gauge", result)
    }

    /// A scheduler whose events run the config's `on_config_scheduled` on the main thread.
    /// None if Envoy made none.
    pub fn new_scheduler(&self) -> Option<ConfigScheduler> {
        // SAFETY: the config pointer is Envoy's, live until config destroy.
        let ptr = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(self.ptr)
        };
        (!ptr.is_null()).then_some(ConfigScheduler { ptr })
    }
}

/// Posts events to the config's `on_config_scheduled`, which Envoy runs on the main thread.
/// Deleted on drop. Once the config is gone a commit is a no-op in Envoy (it holds the config
/// weakly); never commit after the drop: keep it behind a lock that the drop also takes.
#[derive(Debug)]
pub struct ConfigScheduler {
    ptr: ffi::HttpFilterConfigSchedulerModulePtr,
}

// SAFETY: Envoy's config scheduler commit locks a weak pointer and posts to the main
// dispatcher, from any thread. Delete is one call, made once (Drop).
unsafe impl Send for ConfigScheduler {}
// SAFETY: as above; commit takes no module-side state.
unsafe impl Sync for ConfigScheduler {}

impl ConfigScheduler {
    pub fn commit(&self, event_id: u64) {
        // SAFETY: the scheduler is live until Drop.
        unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                self.ptr, event_id,
            )
        }
    }
}

impl Drop for ConfigScheduler {
    fn drop(&mut self) {
        // SAFETY: created by config_scheduler_new, deleted once.
        unsafe { ffi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.ptr) }
    }
}

/// The config as the main thread's config hooks get it: what may only be done there (its
/// callouts, which Envoy keeps in maps no lock guards); this type is neither Send nor Sync,
/// and only those hooks make one.
#[derive(Debug)]
pub struct MainThreadConfig {
    ptr: ffi::HttpFilterConfigEnvoyPtr,
    /// Not Send, not Sync.
    _main_thread_only: std::marker::PhantomData<*const ()>,
}

impl MainThreadConfig {
    /// # Safety
    /// `ptr` must be the live config's Envoy pointer, and the caller on the main thread
    /// inside one of Envoy's config hooks.
    pub unsafe fn from_raw(ptr: ffi::HttpFilterConfigEnvoyPtr) -> MainThreadConfig {
        MainThreadConfig {
            ptr,
            _main_thread_only: std::marker::PhantomData,
        }
    }

    /// Starts a one-shot HTTP request to `cluster` (headers must include `:method`, `:path`
    /// and `host`) that outlives every request: its answer comes to the config's
    /// `on_config_callout_done` with the id returned, or never if the config is destroyed
    /// first. Timeouts count in whole milliseconds.
    pub fn http_callout(
        &self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u64, AbiError> {
        let callback: crate::CalloutCallback =
            ffi::envoy_dynamic_module_callback_http_filter_config_http_callout;
        // SAFETY: the pointer is the live config, on the main thread (this type is made only there).
        unsafe { start_callout(callback, self.ptr, cluster, headers, body, timeout) }
    }
}

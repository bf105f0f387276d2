//! One request's filter in Envoy: what its hooks may ask of Envoy, by concept (its headers,
//! its body, its reply and resume, what Envoy knows of the stream), and the rest here (its
//! scheduler, metrics and callouts).

mod body;
mod headers;
mod reply;
mod stream_info;

pub use headers::HeaderMap;
pub use stream_info::{AttributeId, MetadataSource};

use std::time::Duration;

use crate::config::{CounterId, GaugeId};
use crate::scheduler::Scheduler;
use crate::{ffi, metrics, start_callout, AbiError};

/// One request's filter in Envoy (`DynamicModuleHttpFilter*`). Valid from the filter's
/// creation until its `on_destroy`, on its worker thread only (it is neither Send nor Sync).
#[derive(Debug)]
pub struct Filter {
    ptr: ffi::HttpFilterEnvoyPtr,
}

/// A copy of a [`Filter`]'s pointer, to reach that request from another request's hook on
/// the same worker (e.g. resume a request that waits for another). Not Send: same worker only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FilterHandle {
    ptr: ffi::HttpFilterEnvoyPtr,
}

impl FilterHandle {
    /// The filter again.
    ///
    /// # Safety
    /// The request must not have been destroyed yet (its `on_destroy` has not run), and this
    /// must run on the worker thread the request lives on.
    pub unsafe fn filter(&self) -> Filter {
        Filter { ptr: self.ptr }
    }

    /// A number naming this request while it lives (its pointer's address).
    pub fn key(&self) -> usize {
        self.ptr as usize
    }
}

impl Filter {
    /// # Safety
    /// `ptr` must be the `filter_envoy_ptr` Envoy passed to the running hook (or a live
    /// filter's pointer on its own worker).
    pub unsafe fn from_raw(ptr: ffi::HttpFilterEnvoyPtr) -> Filter {
        Filter { ptr }
    }

    /// This filter's pointer, to use from another request's hook on the same worker.
    pub fn handle(&self) -> FilterHandle {
        FilterHandle { ptr: self.ptr }
    }
    /// The index of the worker this request runs on (0-based, below the concurrency).
    pub fn worker_index(&self) -> u32 {
        // SAFETY: plain query.
        unsafe { ffi::envoy_dynamic_module_callback_http_filter_get_worker_index(self.ptr) }
    }

    /// A scheduler that posts events to this request's `on_scheduled`, from any thread.
    pub fn new_scheduler(&self) -> Option<Scheduler> {
        // SAFETY: plain call; the result is ours to delete.
        let ptr = unsafe { ffi::envoy_dynamic_module_callback_http_filter_scheduler_new(self.ptr) };
        (!ptr.is_null()).then_some(Scheduler { ptr })
    }

    /// Adds `by` to a counter defined on this filter's config.
    pub fn increment_counter(&self, id: CounterId, by: u64) -> Result<(), AbiError> {
        // SAFETY: no labels.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_increment_counter(
                self.ptr,
                id.0,
                std::ptr::null_mut(),
                0,
                by,
            )
        };
        metrics("http_filter_increment_counter", result)
    }

    /// Sets a gauge defined on this filter's config.
    pub fn set_gauge(&self, id: GaugeId, value: u64) -> Result<(), AbiError> {
        // SAFETY: no labels.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_set_gauge(
                self.ptr,
                id.0,
                std::ptr::null_mut(),
                0,
                value,
            )
        };
        metrics("http_filter_set_gauge", result)
    }

    /// Starts a one-shot HTTP request to `cluster` (headers must include `:method`, `:path`
    /// and `host`); its answer comes to this request's `on_http_callout_done` with the id
    /// returned here. Timeouts count in whole milliseconds.
    pub fn http_callout(
        &self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u64, AbiError> {
        let callback: crate::CalloutCallback =
            ffi::envoy_dynamic_module_callback_http_filter_http_callout;
        // SAFETY: the pointer is this request's filter, in its hook.
        unsafe { start_callout(callback, self.ptr, cluster, headers, body, timeout) }
    }
}

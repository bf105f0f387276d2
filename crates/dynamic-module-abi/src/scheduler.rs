//! A request's scheduler: events posted to its worker from any thread.

use crate::ffi;

/// Posts events to one request's `on_scheduled` on its worker, from any thread. Deleted on
/// drop. Once the request is gone, a commit is a no-op in Envoy (it holds the filter weakly).
#[derive(Debug)]
pub struct Scheduler {
    pub(crate) ptr: ffi::HttpFilterSchedulerModulePtr,
}

// SAFETY: Envoy documents scheduler_commit as safe from any thread; the scheduler object only
// posts to the worker's dispatcher. Delete is one call, made once (Drop).
unsafe impl Send for Scheduler {}
// SAFETY: as above; commit takes no module-side state.
unsafe impl Sync for Scheduler {}

impl Scheduler {
    /// Posts `event_id` to the request's `on_scheduled` (runs later, on its worker).
    pub fn commit(&self, event_id: u64) {
        // SAFETY: the scheduler is live until Drop.
        unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_scheduler_commit(self.ptr, event_id)
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        // SAFETY: created by scheduler_new, deleted once.
        unsafe { ffi::envoy_dynamic_module_callback_http_filter_scheduler_delete(self.ptr) }
    }
}

//! A small safe layer over Envoy's dynamic modules ABI (`ffi`): every callback's answer is
//! checked and becomes a `Result`/`Option`; nothing here panics. The only crate of the
//! project with `unsafe` code.
//!
//! # Layout
//!
//! - `ffi.rs`: the raw declarations, as the ABI's `abi.h` (v0.1.0, Envoy 1.39's) has them.
//! - `hooks.rs`: the exported `envoy_dynamic_module_on_*` functions, each behind a panic
//!   barrier, which dispatch to the [`FilterFactory`] / [`HttpFilter`] built by the
//!   [`Module`] the .so registers with [`dynamic_module!`].
//! - `filter/`: one request's [`Filter`], valid during its hooks on its worker: its headers,
//!   body, reply and resume, and what Envoy knows of its stream, one file each.
//! - `hook_frames.rs`: the hooks on this thread's stack, and the calls each deferred until it
//!   returns.
//! - `scheduler.rs`: a request's [`Scheduler`], which posts to its worker from any thread.
//! - `config.rs`: the filter config's [`ConfigHandle`] (metrics, any thread), its
//!   [`ConfigScheduler`] and [`MainThreadConfig`] (its callouts, main thread).
//! - `status.rs`: what a hook answers Envoy; `buffers.rs`: bytes across the ABI;
//!   `logging.rs`: Envoy's log, and a `log` crate logger over it.
//! - `mock_abi.rs` (tests, or the `mock` feature): Envoy's callbacks, mocked.
//!
//! Memory, as the header has it: every byte slice Envoy lends (headers, bodies, attributes,
//! metadata, config bytes) is valid only until the current hook returns or a setter is called,
//! so the layer copies it out before returning. Every buffer the module passes in is only read
//! during the call (Envoy copies what it keeps).

#![allow(unsafe_code)]

mod buffers;
mod config;
pub mod ffi;
mod filter;
mod hook_frames;
pub mod hooks;
mod logging;
// Envoy's callbacks, mocked: for this crate's tests and, with the `mock` feature, for tests of
// the modules built on it (never in a module loaded by Envoy: it would shadow Envoy's).
#[cfg(any(test, feature = "mock"))]
pub mod mock_abi;
mod scheduler;
mod status;
#[cfg(test)]
mod tests;

use std::fmt;

pub use config::{ConfigHandle, ConfigScheduler, CounterId, GaugeId, MainThreadConfig};
pub use filter::{AttributeId, Filter, FilterHandle, HeaderMap, MetadataSource};
pub use hooks::{FactoryBuilder, FilterFactory, HttpFilter, Module};
pub use logging::{install_logger, log, log_enabled, LogLevel};
pub use scheduler::Scheduler;
pub use status::{BodyStatus, CalloutResult, HeadersStatus, TrailersStatus};

pub(crate) use buffers::{copy_envoy, headers_from_envoy};
pub(crate) use hook_frames::{enter_hook, leave_hook};

/// The ABI version the module reports from `envoy_dynamic_module_on_program_init`: that of
/// the header the bindings follow (see `ffi`). Envoy 1.40 (`v0.2.0`) only logs a warning for
/// it.
pub const ABI_VERSION: &str = "v0.1.0";

/// Why a call into Envoy did not do what was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AbiError {
    /// The callback answered false: the map, body or state is not available now (wrong phase,
    /// the stream is gone), or the value was refused (e.g. a read-only filter state key).
    Refused(&'static str),
    /// A metrics callback answered this `envoy_dynamic_module_type_metrics_result`
    /// (1 not found, 2 invalid labels, 3 frozen: defined after config creation).
    Metrics { call: &'static str, result: u32 },
    /// The callout was not started: `envoy_dynamic_module_type_http_callout_init_result`
    /// (1 missing :method/:path/host, 2 cluster not found, 3 duplicate id, 4 cannot create).
    CalloutNotStarted(u32),
    /// Envoy handed back a buffer or count that does not hold together.
    Inconsistent(&'static str),
}

impl fmt::Display for AbiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AbiError::Refused(call) => write!(f, "{call}: refused by Envoy"),
            AbiError::Metrics { call, result } => write!(f, "{call}: metrics result {result}"),
            AbiError::CalloutNotStarted(code) => write!(f, "http callout not started: {code}"),
            AbiError::Inconsistent(call) => write!(f, "{call}: inconsistent answer"),
        }
    }
}

impl std::error::Error for AbiError {}

/// A callout or stream Envoy was asked to start: its id, or why it did not start.
/// Envoy's callback that starts a one-shot callout, a request's or the config's (the same
/// shape, each on its own Envoy object).
pub(crate) type CalloutCallback = unsafe extern "C" fn(
    *mut std::ffi::c_void,
    *mut u64,
    ffi::ModuleBuffer,
    *mut ffi::ModuleHttpHeader,
    usize,
    ffi::ModuleBuffer,
    u64,
) -> ffi::HttpCalloutInitResult;

/// Starts a one-shot HTTP callout to `cluster` with `callback` on Envoy's object `owner`;
/// timeouts count in whole milliseconds. The callout's id, or why it did not start.
///
/// # Safety
/// `owner` must be the live Envoy object `callback` takes: a request's filter in its hook,
/// or the config on the main thread.
pub(crate) unsafe fn start_callout(
    callback: CalloutCallback,
    owner: *mut std::ffi::c_void,
    cluster: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
    timeout: std::time::Duration,
) -> Result<u64, AbiError> {
    let mut raw = buffers::module_headers(headers);
    let mut id: u64 = 0;
    let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
    // SAFETY: `owner` as the caller promises; everything passed is read during the call, and
    // `id` is written by Envoy.
    let result = unsafe {
        callback(
            owner,
            &mut id,
            buffers::module_buffer(cluster.as_bytes()),
            raw.as_mut_ptr(),
            raw.len(),
            buffers::module_buffer(body),
            timeout_ms,
        )
    };
    started(result, id)
}

pub(crate) fn started(result: ffi::HttpCalloutInitResult, id: u64) -> Result<u64, AbiError> {
    if result == ffi::CALLOUT_INIT_SUCCESS {
        Ok(id)
    } else {
        Err(AbiError::CalloutNotStarted(result))
    }
}

pub(crate) fn metrics(call: &'static str, result: ffi::MetricsResult) -> Result<(), AbiError> {
    if result == ffi::METRICS_SUCCESS {
        Ok(())
    } else {
        Err(AbiError::Metrics { call, result })
    }
}

//! The event hooks Envoy calls (`envoy_dynamic_module_on_*`), exported from the .so, and the
//! Rust interface they dispatch to.
//!
//! A module built on these bindings (a cdylib depending on this crate) exports them all: the
//! `#[no_mangle]` functions here are kept in the .so, and [`crate::dynamic_module!`] adds the
//! program-init hook, which registers the module's [`Module`].
//!
//! Every hook catches panics (the .so is built with `panic = "unwind"`, profile `native`):
//! nothing unwinds into Envoy. A panic in a filter's method, or in a call it deferred, is
//! logged, the filter's `on_panic` is called, and the filter is *poisoned*: its later hooks
//! do not call it (it is still dropped at destroy). A failed filter's request hooks answer
//! "stop" until its response begins (the request never goes upstream unseen; `on_panic`
//! answers it), "continue" after; its response hooks "continue".
//!
//! Envoy 1.40 resolves these hooks when a filter config loads and refuses the config if one is
//! missing: config new/destroy, filter new/destroy, request and response
//! headers/body/trailers, stream complete, http callout done, the five http stream hooks,
//! scheduled, and the two downstream watermark hooks. Per-route config new/destroy are
//! resolved only for a per-route config; they are exported and refuse it (unsupported).

#![allow(unsafe_code)]
// The hooks are Envoy's entry points: the pointers they take are valid by the ABI's contract,
// not the caller's choice, so they are safe `extern "C"` functions that dereference them.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::ffi::c_char;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use super::ffi::{self, EnvoyBuffer, EnvoyHttpHeader};
use super::{
    copy_envoy, enter_hook, headers_from_envoy, leave_hook, log, BodyStatus, CalloutResult,
    ConfigHandle, Filter, HeadersStatus, LogLevel, MainThreadConfig, TrailersStatus,
};

/// One per filter config: makes the per-request filters. Shared by every worker.
pub trait FilterFactory: Send + Sync + 'static {
    /// Called on the request's worker when its stream starts. None: this request is not
    /// filtered (every hook answers Continue); the stream goes on.
    fn new_filter(&self, filter: &Filter) -> Option<Box<dyn HttpFilter>>;
    /// The request's filter when `new_filter` panicked (None: the stream goes on unfiltered).
    fn failed_filter(&self) -> Option<Box<dyn HttpFilter>> {
        None
    }
    /// An event committed on a [`super::ConfigScheduler`] of this config (main thread).
    #[allow(unused_variables)]
    fn on_config_scheduled(&self, config: &MainThreadConfig, event_id: u64) {}
    /// The answer to a callout this config started with [`MainThreadConfig::http_callout`]
    /// (main thread); headers and body copied.
    #[allow(unused_variables)]
    fn on_config_callout_done(
        &self,
        config: &MainThreadConfig,
        callout_id: u64,
        result: CalloutResult,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    ) {
    }
}

/// One per request, called on its worker only. `f` is valid during the call only.
#[allow(unused_variables)]
pub trait HttpFilter {
    fn on_request_headers(&mut self, f: &Filter, end_of_stream: bool) -> HeadersStatus {
        HeadersStatus::Continue
    }
    fn on_request_body(&mut self, f: &Filter, end_of_stream: bool) -> BodyStatus {
        BodyStatus::Continue
    }
    fn on_request_trailers(&mut self, f: &Filter) -> TrailersStatus {
        TrailersStatus::Continue
    }
    fn on_response_headers(&mut self, f: &Filter, end_of_stream: bool) -> HeadersStatus {
        HeadersStatus::Continue
    }
    fn on_response_body(&mut self, f: &Filter, end_of_stream: bool) -> BodyStatus {
        BodyStatus::Continue
    }
    fn on_response_trailers(&mut self, f: &Filter) -> TrailersStatus {
        TrailersStatus::Continue
    }
    /// The stream is done (before the access log is written: set filter state here).
    fn on_stream_complete(&mut self, f: &Filter) {}
    /// An event committed on a [`super::Scheduler`] of this request.
    fn on_scheduled(&mut self, f: &Filter, event_id: u64) {}
    /// The answer to [`Filter::http_callout`]. Headers and body are copies.
    fn on_http_callout_done(
        &mut self,
        f: &Filter,
        callout_id: u64,
        result: CalloutResult,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    ) {
    }
    /// Just before the filter is dropped. No `Filter`: Envoy passes none at destroy.
    fn on_destroy(&mut self) {}
    /// A panic was caught in one of the methods above; called once, then the filter gets no
    /// more hooks but `on_destroy`. Resume what it holds (e.g. `f.continue_decoding()`).
    fn on_panic(&mut self, f: &Filter) {}
}

/// Builds the factory for one filter config: the filter's `filter_name`, its `filter_config`
/// bytes (a StringValue's or BytesValue's bytes; a Struct's JSON) and the config's handle
/// (define metrics here: Envoy refuses definitions after). Err refuses the config, with the
/// message in Envoy's log.
pub type FactoryBuilder =
    fn(name: &str, config: &[u8], handle: ConfigHandle) -> Result<Box<dyn FilterFactory>, String>;

/// What a .so registers at program init: its name (prefixing what the hooks log) and what
/// its filter configs are built with.
#[derive(Clone, Copy)]
pub struct Module {
    pub name: &'static str,
    pub factory_builder: FactoryBuilder,
}

/// The module registered by program init (the first registration stays).
static MODULE: OnceLock<Module> = OnceLock::new();

/// The registered module's name, for log lines.
fn module_name() -> &'static str {
    MODULE.get().map_or("dynamic module", |module| module.name)
}

/// Defines the program-init hook (`envoy_dynamic_module_on_program_init`) of the .so that
/// invokes it once, at its crate root: it registers the [`Module`] the other hooks dispatch to.
///
/// ```ignore
/// dynamic_module_abi::dynamic_module!(Module { name: "my_module", factory_builder: build });
/// ```
#[macro_export]
macro_rules! dynamic_module {
    ($module:expr) => {
        #[no_mangle]
        pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const ::std::ffi::c_char {
            $crate::hooks::program_init($module)
        }
    };
}

/// The module's object for a filter config.
struct ConfigObject {
    factory: Box<dyn FilterFactory>,
}

/// The module's object for a request.
pub(crate) struct FilterObject {
    filter: RefCell<Option<Box<dyn HttpFilter>>>,
    poisoned: Cell<bool>,
    /// Envoy destroyed the request inside one of its hooks: the hook up the stack frees it
    /// once it returns.
    destroyed: Cell<bool>,
    /// A response hook has run: the response has begun.
    responding: Cell<bool>,
    /// Envoy's pointer for the request (what its module-sent replies are known by).
    envoy: Cell<usize>,
}

impl FilterObject {
    pub(crate) fn new(filter: Option<Box<dyn HttpFilter>>) -> Self {
        FilterObject {
            filter: RefCell::new(filter),
            poisoned: Cell::new(false),
            destroyed: Cell::new(false),
            responding: Cell::new(false),
            envoy: Cell::new(0),
        }
    }
}

/// Runs the filter's `on_destroy` and drops it, then frees `raw`.
///
/// # Safety
/// `raw` was made by `Box::into_raw` in filter_new, Envoy has destroyed the request, and no
/// reference to the object is used afterwards.
unsafe fn free_filter_object(raw: *mut FilterObject) {
    // SAFETY: as the caller promises.
    let object = unsafe { Box::from_raw(raw) };
    crate::hook_frames::forget_reply(object.envoy.get());
    if let Some(mut filter) = object.filter.into_inner() {
        barrier("on_destroy", (), || filter.on_destroy());
        barrier("drop filter", (), move || drop(filter));
    }
}

fn panic_text(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(not a string)")
}

/// What a hook answers Envoy when the module does not run the filter's method: `pass` for a
/// request with no filter of the module's, `closed` for one whose filter failed (panicked,
/// poisoned, or re-entered).
#[derive(Clone, Copy)]
struct Answers<R> {
    pass: R,
    closed: R,
    /// A response hook: the response has begun.
    response: bool,
}

/// The same answer either way (hooks that answer nothing).
const fn always<R>(answer: R) -> Answers<R>
where
    R: Copy,
{
    Answers {
        pass: answer,
        closed: answer,
        response: false,
    }
}

/// A response hook: what is there goes on either way, and the response has begun.
const fn response_side<R: Copy>(answer: R) -> Answers<R> {
    Answers {
        pass: answer,
        closed: answer,
        response: true,
    }
}

/// A request hook: passed on without a filter; held when its filter failed before its
/// response began, so a request the filter could not look at never goes upstream (fail
/// closed; `on_panic` answers it). Once the response has begun, the rest of the request goes
/// on (an upstream answering while it reads would wait for it).
const fn request_side<R: Copy>(pass: R, closed: R) -> Answers<R> {
    Answers {
        pass,
        closed,
        response: false,
    }
}

/// Runs `body` with nothing unwinding out of it; a panic is logged and gives `fallback`.
fn barrier<R>(hook: &'static str, fallback: R, body: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(answer) => answer,
        Err(payload) => {
            // The logging itself must not unwind either.
            let _ = catch_unwind(AssertUnwindSafe(|| {
                log(
                    LogLevel::Error,
                    &format!(
                        "{}: panic in {hook}: {}",
                        module_name(),
                        panic_text(&*payload)
                    ),
                );
            }));
            fallback
        }
    }
}

/// Calls one method of a request's filter: skipped (fallback) if the request has no filter,
/// is poisoned, or its filter is already in a hook further up this stack (Envoy re-entered
/// it); a panic poisons it. Calls the filter deferred on itself run after it returns.
fn dispatch<R: Copy>(
    hook: &'static str,
    envoy_ptr: ffi::HttpFilterEnvoyPtr,
    module_ptr: ffi::HttpFilterModulePtr,
    answers: Answers<R>,
    method: impl FnOnce(&mut dyn HttpFilter, &Filter) -> R,
) -> R {
    let Answers {
        pass,
        closed,
        response,
    } = answers;
    barrier(hook, closed, || {
        if module_ptr.is_null() || envoy_ptr.is_null() {
            return pass;
        }
        // SAFETY: module_ptr is a FilterObject this module made in filter_new and frees only
        // in filter_destroy, which Envoy calls after every other hook of the request.
        let object = unsafe { &*module_ptr.cast::<FilterObject>() };
        if response {
            object.responding.set(true);
        }
        let fallback = if object.responding.get() {
            pass
        } else {
            closed
        };
        if object.poisoned.get() {
            return fallback;
        }
        // SAFETY: Envoy's pointer for this hook.
        let f = unsafe { Filter::from_raw(envoy_ptr) };
        let Ok(mut slot) = object.filter.try_borrow_mut() else {
            log(
                LogLevel::Warn,
                &format!(
                    "{}: {hook} re-entered a filter already in a hook; skipped",
                    module_name()
                ),
            );
            return fallback;
        };
        let Some(filter) = slot.as_mut() else {
            return pass;
        };
        enter_hook(envoy_ptr);
        let answer = match catch_unwind(AssertUnwindSafe(|| method(filter.as_mut(), &f))) {
            Ok(answer) => answer,
            Err(payload) => {
                let why = format!("panic in {hook}: {}", panic_text(&*payload));
                turn_off(object, filter.as_mut(), &f, &why);
                // The step that asked for a resume did not finish: the request must not go
                // upstream on its word (`on_panic` answers it instead).
                f.withdraw_resume();
                fallback
            }
        };
        drop(slot);
        let held = leave_hook();
        if object.destroyed.get() {
            // Envoy destroyed the request inside this hook: its pointer is gone, and with it
            // the calls held for it. The filter goes now, with its registrations (its
            // `on_destroy`), so nothing the module keeps can reach a freed request.
            drop(held);
            // SAFETY: made in filter_new; Envoy called destroy for it already (which only
            // marked it, since this hook held it); `object` is not used after this.
            unsafe { free_filter_object(module_ptr.cast_mut().cast::<FilterObject>()) };
            return answer;
        }
        // The calls the hook deferred (its local reply, its resume) are the hook's own work:
        // a panic in them fails the request closed as one in the hook does, and the hook's
        // answer stands (a reply that panicked must not turn into a pass upstream).
        if catch_unwind(AssertUnwindSafe(|| f.run_held(held))).is_err() {
            if let Ok(mut slot) = object.filter.try_borrow_mut() {
                if let Some(filter) = slot.as_mut() {
                    turn_off(
                        object,
                        filter.as_mut(),
                        &f,
                        &format!("panic in a call {hook} made"),
                    );
                }
            }
        }
        answer
    })
}

/// A filter failed (`why`): it is poisoned, said so in the log, and its `on_panic` answers its
/// request (itself barred from unwinding).
fn turn_off(object: &FilterObject, filter: &mut dyn HttpFilter, f: &Filter, why: &str) {
    object.poisoned.set(true);
    log(
        LogLevel::Error,
        &format!("{}: {why}; the request's filter is off", module_name()),
    );
    if catch_unwind(AssertUnwindSafe(|| filter.on_panic(f))).is_err() {
        log(
            LogLevel::Error,
            &format!("{}: panic in on_panic", module_name()),
        );
    }
}

// ------------------------------------------------------------------------------------------
// Program and config
// ------------------------------------------------------------------------------------------

static ABI_VERSION_C: &[u8] = b"v0.1.0\0";

/// The program-init hook's work (see [`crate::dynamic_module!`]): registers `module`,
/// installs the logger, and answers the ABI version (null, which makes Envoy refuse the
/// module, only if that panicked).
pub fn program_init(module: Module) -> *const c_char {
    barrier("program_init", std::ptr::null(), || {
        // A second call (Envoy makes one per load) keeps the first registration.
        let _ = MODULE.set(module);
        super::install_logger();
        debug_assert_eq!(
            ABI_VERSION_C.strip_suffix(b"\0"),
            Some(super::ABI_VERSION.as_bytes())
        );
        ABI_VERSION_C.as_ptr().cast::<c_char>()
    })
}

/// The config-new hook's work, with the builder given (tests pass their own).
pub fn new_config(
    builder: FactoryBuilder,
    envoy_ptr: ffi::HttpFilterConfigEnvoyPtr,
    name: &[u8],
    config: &[u8],
) -> ffi::HttpFilterConfigModulePtr {
    barrier("http_filter_config_new", std::ptr::null(), || {
        let name = String::from_utf8_lossy(name);
        // SAFETY: Envoy's config pointer, valid until config destroy.
        let handle = unsafe { ConfigHandle::from_raw(envoy_ptr) };
        match builder(&name, config, handle) {
            Ok(factory) => Box::into_raw(Box::new(ConfigObject { factory }))
                .cast_const()
                .cast(),
            Err(message) => {
                log(
                    LogLevel::Error,
                    &format!(
                        "{}: filter config {name:?} refused: {message}",
                        module_name()
                    ),
                );
                std::ptr::null()
            }
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    filter_config_envoy_ptr: ffi::HttpFilterConfigEnvoyPtr,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> ffi::HttpFilterConfigModulePtr {
    barrier("http_filter_config_new", std::ptr::null(), || {
        // SAFETY: Envoy's buffers, valid during this hook; copied.
        let (name, config) = unsafe {
            (
                copy_envoy(name.ptr, name.length),
                copy_envoy(config.ptr, config.length),
            )
        };
        let Some(module) = MODULE.get() else {
            log(
                LogLevel::Error,
                "dynamic module: no module registered at program init; filter config refused",
            );
            return std::ptr::null();
        };
        new_config(
            module.factory_builder,
            filter_config_envoy_ptr,
            &name,
            &config,
        )
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(
    filter_config_ptr: ffi::HttpFilterConfigModulePtr,
) {
    barrier("http_filter_config_destroy", (), || {
        if !filter_config_ptr.is_null() {
            // SAFETY: made by Box::into_raw in new_config; Envoy destroys it once.
            drop(unsafe { Box::from_raw(filter_config_ptr.cast_mut().cast::<ConfigObject>()) });
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _name: EnvoyBuffer,
    _config: EnvoyBuffer,
) -> ffi::HttpFilterPerRouteConfigModulePtr {
    barrier("http_filter_per_route_config_new", std::ptr::null(), || {
        log(
            LogLevel::Error,
            &format!(
                "{}: per-route config (DynamicModuleFilterPerRoute) is not supported",
                module_name()
            ),
        );
        std::ptr::null()
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_destroy(
    _filter_config_ptr: ffi::HttpFilterPerRouteConfigModulePtr,
) {
    // Never made (per_route_config_new refuses), so nothing to free.
}

// ------------------------------------------------------------------------------------------
// Filter lifecycle
// ------------------------------------------------------------------------------------------

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    filter_config_ptr: ffi::HttpFilterConfigModulePtr,
    filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
) -> ffi::HttpFilterModulePtr {
    barrier("http_filter_new", std::ptr::null(), || {
        // Never null: Envoy may close the stream for a null filter. A request the factory
        // skips gets an object with no filter; one whose creation panicked, the factory's
        // filter for that.
        let filter = if filter_config_ptr.is_null() {
            None
        } else {
            // SAFETY: made in new_config, alive until config destroy, which Envoy calls after
            // every filter of the config is gone.
            let config = unsafe { &*filter_config_ptr.cast::<ConfigObject>() };
            // SAFETY: Envoy's pointer for this hook.
            let f = unsafe { Filter::from_raw(filter_envoy_ptr) };
            let made = barrier("new_filter", None, || {
                #[cfg(feature = "mock")]
                super::mock_abi::maybe_panic("new_filter");
                Some(config.factory.new_filter(&f))
            });
            match made {
                Some(filter) => filter,
                None => barrier("failed_filter", None, || config.factory.failed_filter()),
            }
        };
        let object = FilterObject::new(filter);
        object.envoy.set(filter_envoy_ptr as usize);
        Box::into_raw(Box::new(object)).cast_const().cast()
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(
    filter_module_ptr: ffi::HttpFilterModulePtr,
) {
    barrier("http_filter_destroy", (), || {
        if filter_module_ptr.is_null() {
            return;
        }
        let raw = filter_module_ptr.cast_mut().cast::<FilterObject>();
        // SAFETY: made by Box::into_raw in filter_new; Envoy destroys it once, after its
        // other hooks have returned (1.40 defers destruction out of hooks).
        let in_use = unsafe { (*raw).filter.try_borrow_mut().is_err() };
        if in_use {
            // Freeing it now would free memory a hook up this stack is using: that hook frees
            // it as it returns.
            // SAFETY: as above; a shared read of a Cell.
            unsafe { (*raw).destroyed.set(true) };
            return;
        }
        // SAFETY: as above, and no borrow is live.
        unsafe { free_filter_object(raw) };
    })
}

// ------------------------------------------------------------------------------------------
// Stream events
// ------------------------------------------------------------------------------------------

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    filter_module_ptr: ffi::HttpFilterModulePtr,
    end_of_stream: bool,
) -> ffi::HeadersStatus {
    dispatch(
        "request_headers",
        filter_envoy_ptr,
        filter_module_ptr,
        request_side(HeadersStatus::Continue, HeadersStatus::StopIteration),
        |filter, f| filter.on_request_headers(f, end_of_stream),
    )
    .raw()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    filter_module_ptr: ffi::HttpFilterModulePtr,
    end_of_stream: bool,
) -> ffi::BodyStatus {
    dispatch(
        "request_body",
        filter_envoy_ptr,
        filter_module_ptr,
        // Buffered, not dropped: a filter re-entered here may resume the request later.
        request_side(BodyStatus::Continue, BodyStatus::StopIterationAndBuffer),
        |filter, f| filter.on_request_body(f, end_of_stream),
    )
    .raw()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    filter_module_ptr: ffi::HttpFilterModulePtr,
) -> ffi::TrailersStatus {
    dispatch(
        "request_trailers",
        filter_envoy_ptr,
        filter_module_ptr,
        request_side(TrailersStatus::Continue, TrailersStatus::StopIteration),
        |filter, f| filter.on_request_trailers(f),
    )
    .raw()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    filter_module_ptr: ffi::HttpFilterModulePtr,
    end_of_stream: bool,
) -> ffi::HeadersStatus {
    dispatch(
        "response_headers",
        filter_envoy_ptr,
        filter_module_ptr,
        response_side(HeadersStatus::Continue),
        |filter, f| filter.on_response_headers(f, end_of_stream),
    )
    .raw()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    filter_module_ptr: ffi::HttpFilterModulePtr,
    end_of_stream: bool,
) -> ffi::BodyStatus {
    dispatch(
        "response_body",
        filter_envoy_ptr,
        filter_module_ptr,
        response_side(BodyStatus::Continue),
        |filter, f| filter.on_response_body(f, end_of_stream),
    )
    .raw()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    filter_module_ptr: ffi::HttpFilterModulePtr,
) -> ffi::TrailersStatus {
    dispatch(
        "response_trailers",
        filter_envoy_ptr,
        filter_module_ptr,
        response_side(TrailersStatus::Continue),
        |filter, f| filter.on_response_trailers(f),
    )
    .raw()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    filter_module_ptr: ffi::HttpFilterModulePtr,
) {
    dispatch(
        "stream_complete",
        filter_envoy_ptr,
        filter_module_ptr,
        always(()),
        |filter, f| filter.on_stream_complete(f),
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    filter_module_ptr: ffi::HttpFilterModulePtr,
    event_id: u64,
) {
    dispatch(
        "scheduled",
        filter_envoy_ptr,
        filter_module_ptr,
        always(()),
        |filter, f| filter.on_scheduled(f, event_id),
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    filter_module_ptr: ffi::HttpFilterModulePtr,
    callout_id: u64,
    result: ffi::HttpCalloutResult,
    headers: *mut EnvoyHttpHeader,
    headers_size: usize,
    body_chunks: *mut EnvoyBuffer,
    body_chunks_size: usize,
) {
    dispatch(
        "http_callout_done",
        filter_envoy_ptr,
        filter_module_ptr,
        always(()),
        |filter, f| {
            // Copied before the filter runs: Envoy's buffers live until this hook returns.
            let (headers, body) = copy_answer(headers, headers_size, body_chunks, body_chunks_size);
            filter.on_http_callout_done(
                f,
                callout_id,
                CalloutResult::from_raw(result),
                headers,
                body,
            );
        },
    )
}

// ------------------------------------------------------------------------------------------
// The config's own events (optional hooks; main thread)
// ------------------------------------------------------------------------------------------

/// Calls the factory of the config `module_ptr`, on the main thread.
fn with_config(
    hook: &'static str,
    envoy_ptr: ffi::HttpFilterConfigEnvoyPtr,
    module_ptr: ffi::HttpFilterConfigModulePtr,
    body: impl FnOnce(&dyn FilterFactory, &MainThreadConfig),
) {
    barrier(hook, (), || {
        if module_ptr.is_null() || envoy_ptr.is_null() {
            return;
        }
        // SAFETY: made in new_config, freed only in config destroy, after which Envoy calls
        // none of the config's hooks (its scheduler and streams die with it).
        let config = unsafe { &*module_ptr.cast::<ConfigObject>() };
        // SAFETY: Envoy's config pointer for this hook, which runs on the main thread.
        let main = unsafe { MainThreadConfig::from_raw(envoy_ptr) };
        body(config.factory.as_ref(), &main);
    })
}

/// Envoy's response headers and body chunks as the module keeps them (copied: Envoy's live
/// only while its hook runs).
fn copy_answer(
    headers: *mut EnvoyHttpHeader,
    headers_size: usize,
    body_chunks: *mut EnvoyBuffer,
    body_chunks_size: usize,
) -> (Vec<(String, Vec<u8>)>, Vec<u8>) {
    let headers = if headers.is_null() || headers_size == 0 {
        Vec::new()
    } else {
        // SAFETY: Envoy's array of `headers_size` entries, valid for this hook.
        headers_from_envoy(unsafe { std::slice::from_raw_parts(headers, headers_size) })
    };
    let mut body = Vec::new();
    if !body_chunks.is_null() && body_chunks_size > 0 {
        // SAFETY: Envoy's array of `body_chunks_size` slices, valid for this hook.
        let chunks = unsafe { std::slice::from_raw_parts(body_chunks, body_chunks_size) };
        for chunk in chunks {
            // SAFETY: each slice is Envoy's, valid for this hook.
            body.extend_from_slice(&unsafe { copy_envoy(chunk.ptr, chunk.length) });
        }
    }
    (headers, body)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    filter_config_envoy_ptr: ffi::HttpFilterConfigEnvoyPtr,
    filter_config_module_ptr: ffi::HttpFilterConfigModulePtr,
    callout_id: u64,
    result: ffi::HttpCalloutResult,
    headers: *mut EnvoyHttpHeader,
    headers_size: usize,
    body_chunks: *mut EnvoyBuffer,
    body_chunks_size: usize,
) {
    with_config(
        "config_http_callout_done",
        filter_config_envoy_ptr,
        filter_config_module_ptr,
        |factory, main| {
            let (headers, body) = copy_answer(headers, headers_size, body_chunks, body_chunks_size);
            factory.on_config_callout_done(
                main,
                callout_id,
                CalloutResult::from_raw(result),
                headers,
                body,
            );
        },
    );
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    filter_config_envoy_ptr: ffi::HttpFilterConfigEnvoyPtr,
    filter_config_module_ptr: ffi::HttpFilterConfigModulePtr,
    event_id: u64,
) {
    with_config(
        "config_scheduled",
        filter_config_envoy_ptr,
        filter_config_module_ptr,
        |factory, main| factory.on_config_scheduled(main, event_id),
    );
}

// ------------------------------------------------------------------------------------------
// Hooks Envoy requires but the filter does not use: they do nothing.
// ------------------------------------------------------------------------------------------

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_headers(
    _filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    _filter_module_ptr: ffi::HttpFilterModulePtr,
    _stream_id: u64,
    _headers: *mut EnvoyHttpHeader,
    _headers_size: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_data(
    _filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    _filter_module_ptr: ffi::HttpFilterModulePtr,
    _stream_id: u64,
    _data: *const EnvoyBuffer,
    _data_count: usize,
    _end_stream: bool,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_trailers(
    _filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    _filter_module_ptr: ffi::HttpFilterModulePtr,
    _stream_id: u64,
    _trailers: *mut EnvoyHttpHeader,
    _trailers_size: usize,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_complete(
    _filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    _filter_module_ptr: ffi::HttpFilterModulePtr,
    _stream_id: u64,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_stream_reset(
    _filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    _filter_module_ptr: ffi::HttpFilterModulePtr,
    _stream_id: u64,
    _reason: ffi::HttpStreamResetReason,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(
    _filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    _filter_module_ptr: ffi::HttpFilterModulePtr,
) {
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(
    _filter_envoy_ptr: ffi::HttpFilterEnvoyPtr,
    _filter_module_ptr: ffi::HttpFilterModulePtr,
) {
}

/// The config callout-done hook's work, for tests that hold a config pointer.
pub fn config_callout_done(
    envoy_ptr: ffi::HttpFilterConfigEnvoyPtr,
    module_ptr: ffi::HttpFilterConfigModulePtr,
    callout_id: u64,
    result: CalloutResult,
    headers: Vec<(String, Vec<u8>)>,
    body: Vec<u8>,
) {
    with_config(
        "config_http_callout_done",
        envoy_ptr,
        module_ptr,
        |factory, main| factory.on_config_callout_done(main, callout_id, result, headers, body),
    );
}

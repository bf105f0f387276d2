//! Envoy's side of the dynamic modules ABI, mocked for native tests: each
//! `envoy_dynamic_module_callback_*` the bindings call is defined here over a per-thread state
//! that a test sets up and reads back. Every call is recorded, and a test can make any call
//! answer "no" (false, null, or a status), as Envoy may.
//!
//! The signatures must match `ffi` exactly (the compiler does not compare an `extern` block
//! with a `#[no_mangle]` definition).

#![allow(clippy::missing_safety_doc, clippy::too_many_arguments)]

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ffi::c_char;
use std::sync::Mutex;

use crate::ffi::{self, EnvoyBuffer, EnvoyHttpHeader, ModuleBuffer, ModuleHttpHeader};

/// Headers as the mock keeps them.
pub type Pairs = Vec<(String, Vec<u8>)>;
/// send_response arguments: filter, status, headers, body.
pub type Reply = (usize, u32, Pairs, Vec<u8>);
/// A response sent in parts, by filter, in call order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Headers(usize, Pairs, bool),
    Data(usize, Vec<u8>, bool),
    Trailers(usize, Pairs),
}
/// http_callout arguments: cluster, headers, body, timeout ms.
pub type Callout = (String, Pairs, Vec<u8>, u64);

/// What a test sets up and what the calls leave behind.
#[derive(Default)]
pub struct Abi {
    /// Calls that answer "no" (false / an error status / null), by short name.
    pub refuse: HashSet<&'static str>,
    /// Calls that panic (as a bug in the module's code under them would), by short name.
    pub panic_on: HashSet<&'static str>,
    /// Every call, by short name, in order.
    pub calls: Vec<String>,
    /// Header maps by `HttpHeaderType`.
    pub maps: HashMap<u32, Vec<(String, Vec<u8>)>>,
    /// Body chunks by `HttpBodyType`.
    pub bodies: HashMap<u32, Vec<Vec<u8>>>,
    /// What `received_buffered_request_body` answers.
    pub received_is_buffered: bool,
    /// A size get_body_size reports instead of the real one.
    pub body_size_lie: Option<usize>,
    pub attr_strings: HashMap<u32, Vec<u8>>,
    pub attr_ints: HashMap<u32, u64>,
    /// Metadata by (`MetadataSource`, namespace), then key.
    pub metadata: HashMap<(u32, String), HashMap<String, MetadataValue>>,
    pub filter_state: HashMap<Vec<u8>, Vec<u8>>,
    /// send_response arguments: filter, status, headers, body.
    pub responses: Vec<Reply>,
    /// send_response_headers / _data / _trailers, in order.
    pub parts: Vec<Part>,
    /// The metrics result metric calls answer.
    pub metrics_result: u32,
    /// Metric calls: (call, id, value).
    pub metric_calls: Vec<(&'static str, usize, u64)>,
    pub next_metric_id: usize,
    /// The init result http_callout answers.
    pub callout_result: u32,
    /// http_callout arguments: cluster, headers, body, timeout ms.
    pub callouts: Vec<Callout>,
    pub logs: Vec<(u32, String)>,
    /// Run by continue_decoding, with the filter pointer: lets a test re-enter hooks as Envoy
    /// does when it resumes a stream.
    pub on_continue: Option<fn(ffi::HttpFilterEnvoyPtr)>,
    /// Run at the end of send_response and send_response_headers, with the filter pointer:
    /// lets a test re-enter hooks as Envoy does inside a local reply (the stream's end).
    pub on_reply: Option<fn(ffi::HttpFilterEnvoyPtr)>,
    pub worker_index: u32,
    /// config_http_callout arguments: cluster, headers, body, timeout ms (ids count from 1).
    pub config_callouts: Vec<Callout>,
}

/// A metadata value as the mock keeps it (a protobuf Value, in short).
#[derive(Clone, Debug)]
pub enum MetadataValue {
    String(Vec<u8>),
    /// A number, bool, list or struct: Envoy answers false for these.
    NotAString,
}

thread_local! {
    pub static ABI: RefCell<Abi> = RefCell::new(Abi::default());
}

/// Scheduler commits (scheduler pointer, event id), from any thread.
pub static COMMITS: Mutex<Vec<(usize, u64)>> = Mutex::new(Vec::new());
/// Schedulers deleted.
pub static DELETED: Mutex<Vec<usize>> = Mutex::new(Vec::new());
/// Config scheduler commits (scheduler pointer, event id), from any thread.
pub static CONFIG_COMMITS: Mutex<Vec<(usize, u64)>> = Mutex::new(Vec::new());
/// Config schedulers deleted.
pub static CONFIG_DELETED: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// A fresh ABI for the test that calls it (tests run on threads of their own).
pub fn reset() {
    ABI.with(|abi| *abi.borrow_mut() = Abi::default());
}

pub fn with<T>(f: impl FnOnce(&mut Abi) -> T) -> T {
    ABI.with(|abi| f(&mut abi.borrow_mut()))
}

/// Records the call; true if the test made it answer "no".
fn refused(name: &'static str) -> bool {
    with(|abi| {
        abi.calls.push(name.to_owned());
        abi.refuse.contains(name)
    })
}

/// Called by the bindings' Rust side (mocked builds only) before a call reaches Envoy: panics
/// once if the test asked, as a bug in the module's code there would. (A panic cannot
/// unwind out of the mock's `extern "C"` functions themselves: that aborts.)
pub fn maybe_panic(name: &'static str) {
    let panic = with(|abi| abi.panic_on.remove(name));
    assert!(!panic, "mock: {name} panics (as asked, once)");
}

unsafe fn bytes(ptr: *const c_char, len: usize) -> Vec<u8> {
    if ptr.is_null() || len == 0 {
        Vec::new()
    } else {
        std::slice::from_raw_parts(ptr.cast::<u8>(), len).to_vec()
    }
}

unsafe fn text(buffer: ModuleBuffer) -> String {
    String::from_utf8_lossy(&bytes(buffer.ptr, buffer.length)).into_owned()
}

/// Lends `value` to the module as Envoy does: valid until the test ends (leaked).
fn lend(value: &[u8]) -> EnvoyBuffer {
    let leaked: &'static [u8] = Box::leak(value.to_vec().into_boxed_slice());
    EnvoyBuffer {
        ptr: leaked.as_ptr().cast::<c_char>(),
        length: leaked.len(),
    }
}

unsafe fn module_headers(headers: *mut ModuleHttpHeader, n: usize) -> Vec<(String, Vec<u8>)> {
    if headers.is_null() {
        return Vec::new();
    }
    std::slice::from_raw_parts(headers, n)
        .iter()
        .map(|h| {
            (
                String::from_utf8_lossy(&bytes(h.key_ptr, h.key_length)).into_owned(),
                bytes(h.value_ptr, h.value_length),
            )
        })
        .collect()
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_log(level: u32, message: ModuleBuffer) {
    let message = text(message);
    with(|abi| abi.logs.push((level, message)));
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_log_enabled(_level: u32) -> bool {
    true
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_get_header(
    _filter: ffi::HttpFilterEnvoyPtr,
    header_type: u32,
    key: ModuleBuffer,
    result: *mut EnvoyBuffer,
    index: usize,
    optional_size: *mut usize,
) -> bool {
    if refused("get_header") {
        return false;
    }
    let key = text(key);
    let values: Vec<Vec<u8>> = with(|abi| {
        abi.maps
            .get(&header_type)
            .map(|m| {
                m.iter()
                    .filter(|(k, _)| *k == key)
                    .map(|(_, v)| v.clone())
                    .collect()
            })
            .unwrap_or_default()
    });
    if !optional_size.is_null() {
        *optional_size = values.len();
    }
    *result = match values.get(index) {
        Some(v) => lend(v),
        None => EnvoyBuffer {
            ptr: std::ptr::null(),
            length: 0,
        },
    };
    true
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_get_headers_size(
    _filter: ffi::HttpFilterEnvoyPtr,
    header_type: u32,
) -> usize {
    if refused("get_headers_size") {
        return 0;
    }
    with(|abi| abi.maps.get(&header_type).map_or(0, Vec::len))
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_get_headers(
    _filter: ffi::HttpFilterEnvoyPtr,
    header_type: u32,
    result: *mut EnvoyHttpHeader,
) -> bool {
    if refused("get_headers") {
        return false;
    }
    let map = with(|abi| abi.maps.get(&header_type).cloned().unwrap_or_default());
    for (i, (k, v)) in map.iter().enumerate() {
        let (k, v) = (lend(k.as_bytes()), lend(v));
        *result.add(i) = EnvoyHttpHeader {
            key_ptr: k.ptr,
            key_length: k.length,
            value_ptr: v.ptr,
            value_length: v.length,
        };
    }
    true
}

unsafe fn edit(
    name: &'static str,
    header_type: u32,
    key: ModuleBuffer,
    value: ModuleBuffer,
    replace: bool,
) -> bool {
    if refused(name) {
        return false;
    }
    let key = text(key);
    let value = (!value.ptr.is_null()).then(|| bytes(value.ptr, value.length));
    with(|abi| {
        let map = abi.maps.entry(header_type).or_default();
        if replace || value.is_none() {
            map.retain(|(k, _)| *k != key);
        }
        if let Some(value) = value {
            map.push((key, value));
        }
    });
    true
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_set_header(
    _filter: ffi::HttpFilterEnvoyPtr,
    header_type: u32,
    key: ModuleBuffer,
    value: ModuleBuffer,
) -> bool {
    edit("set_header", header_type, key, value, true)
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_add_header(
    _filter: ffi::HttpFilterEnvoyPtr,
    header_type: u32,
    key: ModuleBuffer,
    value: ModuleBuffer,
) -> bool {
    edit("add_header", header_type, key, value, false)
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_send_response(
    filter: ffi::HttpFilterEnvoyPtr,
    status_code: u32,
    headers: *mut ModuleHttpHeader,
    headers_size: usize,
    body: ModuleBuffer,
    _details: ModuleBuffer,
) {
    refused("send_response");
    let headers = module_headers(headers, headers_size);
    let body = bytes(body.ptr, body.length);
    with(|abi| {
        abi.responses
            .push((filter as usize, status_code, headers, body))
    });
    replied(filter);
}

/// Runs the test's `on_reply`, outside the mock's borrow (it re-enters hooks).
fn replied(filter: ffi::HttpFilterEnvoyPtr) {
    if let Some(on_reply) = with(|abi| abi.on_reply) {
        on_reply(filter);
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_send_response_headers(
    filter: ffi::HttpFilterEnvoyPtr,
    headers: *mut ModuleHttpHeader,
    headers_size: usize,
    end_stream: bool,
) {
    refused("send_response_headers");
    let headers = module_headers(headers, headers_size);
    with(|abi| {
        abi.parts
            .push(Part::Headers(filter as usize, headers, end_stream))
    });
    replied(filter);
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_send_response_data(
    filter: ffi::HttpFilterEnvoyPtr,
    data: ModuleBuffer,
    end_stream: bool,
) {
    refused("send_response_data");
    let data = bytes(data.ptr, data.length);
    with(|abi| {
        abi.parts
            .push(Part::Data(filter as usize, data, end_stream))
    });
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_send_response_trailers(
    filter: ffi::HttpFilterEnvoyPtr,
    trailers: *mut ModuleHttpHeader,
    trailers_size: usize,
) {
    refused("send_response_trailers");
    let trailers = module_headers(trailers, trailers_size);
    with(|abi| abi.parts.push(Part::Trailers(filter as usize, trailers)));
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_get_body_size(
    _filter: ffi::HttpFilterEnvoyPtr,
    body_type: u32,
) -> usize {
    refused("get_body_size");
    with(|abi| {
        abi.body_size_lie.unwrap_or_else(|| {
            abi.bodies
                .get(&body_type)
                .map_or(0, |c| c.iter().map(Vec::len).sum())
        })
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_get_body_chunks_size(
    _filter: ffi::HttpFilterEnvoyPtr,
    body_type: u32,
) -> usize {
    refused("get_body_chunks_size");
    with(|abi| abi.bodies.get(&body_type).map_or(0, Vec::len))
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_get_body_chunks(
    _filter: ffi::HttpFilterEnvoyPtr,
    body_type: u32,
    result: *mut EnvoyBuffer,
) -> bool {
    if refused("get_body_chunks") {
        return false;
    }
    let chunks = with(|abi| abi.bodies.get(&body_type).cloned().unwrap_or_default());
    for (i, chunk) in chunks.iter().enumerate() {
        *result.add(i) = lend(chunk);
    }
    true
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_append_body(
    _filter: ffi::HttpFilterEnvoyPtr,
    body_type: u32,
    data: ModuleBuffer,
) -> bool {
    if refused("append_body") {
        return false;
    }
    let data = bytes(data.ptr, data.length);
    with(|abi| abi.bodies.entry(body_type).or_default().push(data));
    true
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_drain_body(
    _filter: ffi::HttpFilterEnvoyPtr,
    body_type: u32,
    number_of_bytes: usize,
) -> bool {
    if refused("drain_body") {
        return false;
    }
    with(|abi| {
        let chunks = abi.bodies.entry(body_type).or_default();
        let mut all: Vec<u8> = chunks.concat();
        all.drain(..number_of_bytes.min(all.len()));
        *chunks = if all.is_empty() {
            Vec::new()
        } else {
            vec![all]
        };
    });
    true
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_received_buffered_request_body(
    _filter: ffi::HttpFilterEnvoyPtr,
) -> bool {
    with(|abi| abi.received_is_buffered)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_received_buffered_response_body(
    _filter: ffi::HttpFilterEnvoyPtr,
) -> bool {
    with(|abi| abi.received_is_buffered)
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_set_filter_state_bytes(
    _filter: ffi::HttpFilterEnvoyPtr,
    key: ModuleBuffer,
    value: ModuleBuffer,
) -> bool {
    if refused("set_filter_state_bytes") {
        return false;
    }
    let (key, value) = (bytes(key.ptr, key.length), bytes(value.ptr, value.length));
    with(|abi| abi.filter_state.insert(key, value));
    true
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
    _filter: ffi::HttpFilterEnvoyPtr,
    attribute_id: u32,
    result: *mut EnvoyBuffer,
) -> bool {
    if refused("get_attribute_string") {
        return false;
    }
    match with(|abi| abi.attr_strings.get(&attribute_id).cloned()) {
        Some(v) => {
            *result = lend(&v);
            true
        }
        None => false,
    }
}

/// As Envoy: false for an absent namespace or key and for a value that is not a string;
/// `result` written only on success.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_get_metadata_string(
    _filter: ffi::HttpFilterEnvoyPtr,
    metadata_source: u32,
    ns: ModuleBuffer,
    key: ModuleBuffer,
    result: *mut EnvoyBuffer,
) -> bool {
    if refused("get_metadata_string") {
        return false;
    }
    let (ns, key) = (text(ns), text(key));
    let found = with(|abi| {
        abi.metadata
            .get(&(metadata_source, ns))
            .and_then(|fields| fields.get(&key).cloned())
    });
    match found {
        Some(MetadataValue::String(v)) => {
            *result = lend(&v);
            true
        }
        Some(MetadataValue::NotAString) | None => false,
    }
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_filter_get_attribute_int(
    _filter: ffi::HttpFilterEnvoyPtr,
    attribute_id: u32,
    result: *mut u64,
) -> bool {
    if refused("get_attribute_int") {
        return false;
    }
    match with(|abi| abi.attr_ints.get(&attribute_id).copied()) {
        Some(v) => {
            *result = v;
            true
        }
        None => false,
    }
}

unsafe fn define(name: &'static str, id: *mut usize) -> u32 {
    refused(name);
    with(|abi| {
        if abi.metrics_result == 0 {
            *id = abi.next_metric_id;
            abi.next_metric_id += 1;
        }
        abi.metrics_result
    })
}

fn metric(name: &'static str, id: usize, value: u64) -> u32 {
    refused(name);
    with(|abi| {
        abi.metric_calls.push((name, id, value));
        abi.metrics_result
    })
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_filter_config_define_counter(
    _config: ffi::HttpFilterConfigEnvoyPtr,
    _name: ModuleBuffer,
    _label_names: *mut ModuleBuffer,
    _label_names_length: usize,
    counter_id_ptr: *mut usize,
) -> u32 {
    define("define_counter", counter_id_ptr)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
    _config: ffi::HttpFilterConfigEnvoyPtr,
    id: usize,
    _label_values: *mut ModuleBuffer,
    _label_values_length: usize,
    value: u64,
) -> u32 {
    metric("config_increment_counter", id, value)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_increment_counter(
    _filter: ffi::HttpFilterEnvoyPtr,
    id: usize,
    _label_values: *mut ModuleBuffer,
    _label_values_length: usize,
    value: u64,
) -> u32 {
    metric("increment_counter", id, value)
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
    _config: ffi::HttpFilterConfigEnvoyPtr,
    _name: ModuleBuffer,
    _label_names: *mut ModuleBuffer,
    _label_names_length: usize,
    gauge_id_ptr: *mut usize,
) -> u32 {
    define("define_gauge", gauge_id_ptr)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
    _config: ffi::HttpFilterConfigEnvoyPtr,
    id: usize,
    _label_values: *mut ModuleBuffer,
    _label_values_length: usize,
    value: u64,
) -> u32 {
    metric("config_set_gauge", id, value)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_set_gauge(
    _filter: ffi::HttpFilterEnvoyPtr,
    id: usize,
    _label_values: *mut ModuleBuffer,
    _label_values_length: usize,
    value: u64,
) -> u32 {
    metric("set_gauge", id, value)
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_scheduler_new(
    filter: ffi::HttpFilterEnvoyPtr,
) -> ffi::HttpFilterSchedulerModulePtr {
    if refused("scheduler_new") {
        return std::ptr::null_mut();
    }
    // The filter pointer stands in for the scheduler (tests use distinct fake pointers).
    filter
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
    scheduler: ffi::HttpFilterSchedulerModulePtr,
    event_id: u64,
) {
    if let Ok(mut commits) = COMMITS.lock() {
        commits.push((scheduler as usize, event_id));
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_scheduler_delete(
    scheduler: ffi::HttpFilterSchedulerModulePtr,
) {
    if let Ok(mut deleted) = DELETED.lock() {
        deleted.push(scheduler as usize);
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_continue_decoding(
    filter: ffi::HttpFilterEnvoyPtr,
) {
    with(|abi| {
        abi.calls
            .push(format!("continue_decoding {}", filter as usize))
    });
    if let Some(on_continue) = with(|abi| abi.on_continue) {
        on_continue(filter);
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_continue_encoding(
    filter: ffi::HttpFilterEnvoyPtr,
) {
    with(|abi| {
        abi.calls
            .push(format!("continue_encoding {}", filter as usize))
    });
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_get_worker_index(
    _filter: ffi::HttpFilterEnvoyPtr,
) -> u32 {
    with(|abi| abi.worker_index)
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_filter_http_callout(
    _filter: ffi::HttpFilterEnvoyPtr,
    callout_id_out: *mut u64,
    cluster_name: ModuleBuffer,
    headers: *mut ModuleHttpHeader,
    headers_size: usize,
    body: ModuleBuffer,
    timeout_milliseconds: u64,
) -> u32 {
    refused("http_callout");
    let call = (
        text(cluster_name),
        module_headers(headers, headers_size),
        bytes(body.ptr, body.length),
        timeout_milliseconds,
    );
    with(|abi| {
        abi.callouts.push(call);
        if abi.callout_result == ffi::CALLOUT_INIT_SUCCESS {
            *callout_id_out = abi.callouts.len() as u64;
        }
        abi.callout_result
    })
}

#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_callback_http_filter_config_http_callout(
    _config: ffi::HttpFilterConfigEnvoyPtr,
    callout_id_out: *mut u64,
    cluster_name: ModuleBuffer,
    headers: *mut ModuleHttpHeader,
    headers_size: usize,
    body: ModuleBuffer,
    timeout_milliseconds: u64,
) -> u32 {
    refused("config_http_callout");
    let call = (
        text(cluster_name),
        module_headers(headers, headers_size),
        bytes(body.ptr, body.length),
        timeout_milliseconds,
    );
    with(|abi| {
        abi.config_callouts.push(call);
        if abi.callout_result == ffi::CALLOUT_INIT_SUCCESS {
            *callout_id_out = abi.config_callouts.len() as u64;
        }
        abi.callout_result
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
    config: ffi::HttpFilterConfigEnvoyPtr,
) -> ffi::HttpFilterConfigSchedulerModulePtr {
    if refused("config_scheduler_new") {
        return std::ptr::null_mut();
    }
    // The config pointer stands in for the scheduler.
    config
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
    scheduler: ffi::HttpFilterConfigSchedulerModulePtr,
    event_id: u64,
) {
    if let Ok(mut commits) = CONFIG_COMMITS.lock() {
        commits.push((scheduler as usize, event_id));
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
    scheduler: ffi::HttpFilterConfigSchedulerModulePtr,
) {
    if let Ok(mut deleted) = CONFIG_DELETED.lock() {
        deleted.push(scheduler as usize);
    }
}

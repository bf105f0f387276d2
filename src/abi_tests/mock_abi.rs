//! The proxy-wasm ABI as Envoy exports it, mocked for native tests: each `proxy_*` function
//! the filter (and the SDK's callout and stream calls) import is defined here, over a
//! per-thread state a test sets up and reads back. Every call is recorded, and a test can make
//! any call answer any status, as Envoy may.
//!
//! Buffers handed to the module are allocated as the module's allocator would (one exact-size
//! block per buffer), since the module takes ownership of them.

#![allow(unsafe_code, clippy::missing_safety_doc, clippy::too_many_arguments)]

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};

/// ABI statuses (proxy-wasm 0.2.1).
pub const OK: u32 = 0;
pub const NOT_FOUND: u32 = 1;
pub const BAD_ARGUMENT: u32 = 2;
pub const SERIALIZATION_FAILURE: u32 = 3;
pub const PARSE_FAILURE: u32 = 4;
pub const EMPTY: u32 = 7;
pub const CAS_MISMATCH: u32 = 8;
pub const INTERNAL_FAILURE: u32 = 10;
pub const UNIMPLEMENTED: u32 = 12;

/// `proxy_http_call` arguments: cluster, serialized headers, body, serialized trailers,
/// timeout (ms).
pub type HttpCall = (String, Vec<u8>, Vec<u8>, Vec<u8>, u32);

/// What a test sets up and what the calls leave behind.
#[derive(Default)]
pub struct Abi {
    /// A status a call answers instead of doing its work, by the call's ABI name.
    pub refuse: HashMap<&'static str, u32>,
    /// Every call, by ABI name, in order.
    pub calls: Vec<&'static str>,
    pub maps: HashMap<u32, Vec<(String, Vec<u8>)>>,
    pub buffers: HashMap<u32, Vec<u8>>,
    /// `proxy_get_buffer_bytes` arguments: buffer type, start, max size.
    pub buffer_reads: Vec<(u32, usize, usize)>,
    /// `proxy_set_buffer_bytes` arguments: buffer type, start, size replaced, bytes.
    pub buffer_writes: Vec<(u32, usize, usize, Vec<u8>)>,
    /// Header edits: (call, map type, name, value).
    pub header_edits: Vec<(&'static str, u32, String, Vec<u8>)>,
    /// Properties by their path as the ABI carries it (segments joined by NUL).
    pub properties: HashMap<Vec<u8>, Vec<u8>>,
    pub shared: HashMap<String, (Vec<u8>, u32)>,
    pub next_cas: u32,
    /// `proxy_set_shared_data` arguments: key, value, cas.
    pub shared_writes: Vec<(String, Vec<u8>, u32)>,
    pub queues: HashMap<u32, VecDeque<Option<Vec<u8>>>>,
    pub now_nanos: u64,
    /// `proxy_send_local_response` arguments: status, body, serialized headers, grpc status.
    pub local_replies: Vec<(u32, Vec<u8>, Vec<u8>, i32)>,
    pub http_calls: Vec<HttpCall>,
    /// `proxy_grpc_stream` arguments: cluster, service, method, serialized metadata.
    pub grpc_streams: Vec<(String, String, String, Vec<u8>)>,
    /// `proxy_grpc_send` arguments: token, message, end of stream.
    pub grpc_sent: Vec<(u32, Vec<u8>, u32)>,
    /// Streams closed: token, and whether by a reset (`proxy_grpc_cancel`).
    pub grpc_closed: Vec<(u32, bool)>,
    pub next_token: u32,
    pub effective_context: Vec<u32>,
    pub tick_periods: Vec<u32>,
    pub metrics: HashMap<String, (u32, u32)>,
    /// Counter increments and gauge values: metric id, value.
    pub metric_values: Vec<(u32, i64)>,
}

thread_local! {
    pub static ABI: RefCell<Abi> = RefCell::new(Abi { next_cas: 1, next_token: 1, ..Abi::default() });
}

/// A fresh ABI for the test that calls it (tests run on threads of their own).
pub fn reset() {
    ABI.with(|abi| {
        *abi.borrow_mut() = Abi {
            next_cas: 1,
            next_token: 1,
            ..Abi::default()
        }
    });
}

pub fn with<T>(f: impl FnOnce(&mut Abi) -> T) -> T {
    ABI.with(|abi| f(&mut abi.borrow_mut()))
}

/// Records the call and answers the status a test forced on it, if any.
fn enter(name: &'static str) -> u32 {
    with(|abi| {
        abi.calls.push(name);
        abi.refuse.get(name).copied().unwrap_or(OK)
    })
}

unsafe fn bytes(data: *const u8, size: usize) -> Vec<u8> {
    if data.is_null() || size == 0 {
        Vec::new()
    } else {
        std::slice::from_raw_parts(data, size).to_vec()
    }
}

unsafe fn text(data: *const u8, size: usize) -> String {
    String::from_utf8_lossy(&bytes(data, size)).into_owned()
}

/// Hands `value` to the module as a block it now owns.
unsafe fn give(value: Vec<u8>, data: *mut *mut u8, size: *mut usize) {
    let block: Box<[u8]> = value.into_boxed_slice();
    *size = block.len();
    *data = Box::into_raw(block).cast::<u8>();
}

/// A header map as Envoy serializes it: count, (name length, value length) pairs, then each
/// name and value NUL-terminated, lengths little-endian u32.
pub fn serialize_map(pairs: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
    for (name, value) in pairs {
        out.extend_from_slice(&(name.len() as u32).to_le_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
    }
    for (name, value) in pairs {
        out.extend_from_slice(name.as_bytes());
        out.push(0);
        out.extend_from_slice(value);
        out.push(0);
    }
    out
}

/// The pairs of a map the module serialized.
pub fn deserialize_map(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let count = u32_at(0);
    let mut data_at = 4 + count * 8;
    let mut pairs = Vec::new();
    for i in 0..count {
        let (name_len, value_len) = (u32_at(4 + i * 8), u32_at(8 + i * 8));
        let name = String::from_utf8(bytes[data_at..data_at + name_len].to_vec()).unwrap();
        let value_at = data_at + name_len + 1;
        pairs.push((name, bytes[value_at..value_at + value_len].to_vec()));
        data_at = value_at + value_len + 1;
    }
    pairs
}

#[no_mangle]
pub extern "C" fn proxy_log(_level: u32, _data: *const u8, _size: usize) -> u32 {
    // Not recorded: logging happens everywhere and says nothing the tests look at.
    OK
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_current_time_nanoseconds(out: *mut u64) -> u32 {
    let status = enter("proxy_get_current_time_nanoseconds");
    if status == OK {
        *out = with(|abi| abi.now_nanos);
    }
    status
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_buffer_bytes(
    buffer: u32,
    start: usize,
    max_size: usize,
    data: *mut *mut u8,
    size: *mut usize,
) -> u32 {
    let status = enter("proxy_get_buffer_bytes");
    let found = with(|abi| {
        abi.buffer_reads.push((buffer, start, max_size));
        abi.buffers.get(&buffer).cloned()
    });
    if status != OK {
        return status;
    }
    match found {
        None => NOT_FOUND,
        Some(all) => {
            let end = start.saturating_add(max_size).min(all.len());
            give(
                all.get(start.min(end)..end).unwrap_or_default().to_vec(),
                data,
                size,
            );
            OK
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_buffer_status(
    buffer: u32,
    length: *mut usize,
    flags: *mut u32,
) -> u32 {
    let status = enter("proxy_get_buffer_status");
    if status == OK {
        *length = with(|abi| abi.buffers.get(&buffer).map_or(0, Vec::len));
        *flags = 0;
    }
    status
}

#[no_mangle]
pub unsafe extern "C" fn proxy_set_buffer_bytes(
    buffer: u32,
    start: usize,
    size: usize,
    data: *const u8,
    data_size: usize,
) -> u32 {
    let status = enter("proxy_set_buffer_bytes");
    if status == OK {
        let value = bytes(data, data_size);
        with(|abi| abi.buffer_writes.push((buffer, start, size, value)));
    }
    status
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_header_map_pairs(
    map: u32,
    data: *mut *mut u8,
    size: *mut usize,
) -> u32 {
    let status = enter("proxy_get_header_map_pairs");
    if status == OK {
        let pairs = with(|abi| abi.maps.get(&map).cloned().unwrap_or_default());
        give(serialize_map(&pairs), data, size);
    }
    status
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_header_map_value(
    map: u32,
    name: *const u8,
    name_size: usize,
    data: *mut *mut u8,
    size: *mut usize,
) -> u32 {
    let status = enter("proxy_get_header_map_value");
    if status != OK {
        return status;
    }
    let name = text(name, name_size);
    let found = with(|abi| {
        abi.maps.get(&map).and_then(|pairs| {
            pairs
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.clone())
        })
    });
    match found {
        Some(value) => {
            give(value, data, size);
            OK
        }
        None => NOT_FOUND,
    }
}

unsafe fn header_edit(
    call: &'static str,
    map: u32,
    name: (*const u8, usize),
    value: (*const u8, usize),
) -> u32 {
    let status = enter(call);
    if status == OK {
        let (name, value) = (text(name.0, name.1), bytes(value.0, value.1));
        with(|abi| abi.header_edits.push((call, map, name, value)));
    }
    status
}

#[no_mangle]
pub unsafe extern "C" fn proxy_add_header_map_value(
    map: u32,
    name: *const u8,
    name_size: usize,
    value: *const u8,
    value_size: usize,
) -> u32 {
    header_edit(
        "proxy_add_header_map_value",
        map,
        (name, name_size),
        (value, value_size),
    )
}

#[no_mangle]
pub unsafe extern "C" fn proxy_replace_header_map_value(
    map: u32,
    name: *const u8,
    name_size: usize,
    value: *const u8,
    value_size: usize,
) -> u32 {
    header_edit(
        "proxy_replace_header_map_value",
        map,
        (name, name_size),
        (value, value_size),
    )
}

#[no_mangle]
pub unsafe extern "C" fn proxy_remove_header_map_value(
    map: u32,
    name: *const u8,
    name_size: usize,
) -> u32 {
    header_edit(
        "proxy_remove_header_map_value",
        map,
        (name, name_size),
        (std::ptr::null(), 0),
    )
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_property(
    path: *const u8,
    path_size: usize,
    data: *mut *mut u8,
    size: *mut usize,
) -> u32 {
    let status = enter("proxy_get_property");
    if status != OK {
        return status;
    }
    match with(|abi| abi.properties.get(&bytes(path, path_size)).cloned()) {
        Some(value) => {
            give(value, data, size);
            OK
        }
        None => NOT_FOUND,
    }
}

#[no_mangle]
pub unsafe extern "C" fn proxy_set_property(
    path: *const u8,
    path_size: usize,
    value: *const u8,
    value_size: usize,
) -> u32 {
    let status = enter("proxy_set_property");
    if status == OK {
        let (path, value) = (bytes(path, path_size), bytes(value, value_size));
        with(|abi| abi.properties.insert(path, value));
    }
    status
}

#[no_mangle]
pub unsafe extern "C" fn proxy_get_shared_data(
    key: *const u8,
    key_size: usize,
    data: *mut *mut u8,
    size: *mut usize,
    cas: *mut u32,
) -> u32 {
    let status = enter("proxy_get_shared_data");
    if status != OK {
        return status;
    }
    match with(|abi| abi.shared.get(&text(key, key_size)).cloned()) {
        Some((value, value_cas)) => {
            give(value, data, size);
            *cas = value_cas;
            OK
        }
        None => NOT_FOUND,
    }
}

/// As Envoy: a cas of 0 writes unconditionally; any other must match the entry's (an absent
/// entry matches none).
#[no_mangle]
pub unsafe extern "C" fn proxy_set_shared_data(
    key: *const u8,
    key_size: usize,
    value: *const u8,
    value_size: usize,
    cas: u32,
) -> u32 {
    let status = enter("proxy_set_shared_data");
    if status != OK {
        return status;
    }
    let (key, value) = (text(key, key_size), bytes(value, value_size));
    with(|abi| {
        abi.shared_writes.push((key.clone(), value.clone(), cas));
        let current = abi.shared.get(&key).map(|(_, c)| *c);
        if cas != 0 && current != Some(cas) {
            return CAS_MISMATCH;
        }
        abi.next_cas += 1;
        let next = abi.next_cas;
        abi.shared.insert(key, (value, next));
        OK
    })
}

#[no_mangle]
pub extern "C" fn proxy_continue_stream(_stream: u32) -> u32 {
    enter("proxy_continue_stream")
}

#[no_mangle]
pub unsafe extern "C" fn proxy_send_local_response(
    status_code: u32,
    _details: *const u8,
    _details_size: usize,
    body: *const u8,
    body_size: usize,
    headers: *const u8,
    headers_size: usize,
    grpc_status: i32,
) -> u32 {
    let status = enter("proxy_send_local_response");
    if status == OK {
        let reply = (
            status_code,
            bytes(body, body_size),
            bytes(headers, headers_size),
            grpc_status,
        );
        with(|abi| abi.local_replies.push(reply));
    }
    status
}

fn next_token(abi: &mut Abi) -> u32 {
    abi.next_token += 1;
    abi.next_token
}

#[no_mangle]
pub unsafe extern "C" fn proxy_http_call(
    cluster: *const u8,
    cluster_size: usize,
    headers: *const u8,
    headers_size: usize,
    body: *const u8,
    body_size: usize,
    trailers: *const u8,
    trailers_size: usize,
    timeout_ms: u32,
    token: *mut u32,
) -> u32 {
    let status = enter("proxy_http_call");
    if status == OK {
        let call = (
            text(cluster, cluster_size),
            bytes(headers, headers_size),
            bytes(body, body_size),
            bytes(trailers, trailers_size),
            timeout_ms,
        );
        *token = with(|abi| {
            abi.http_calls.push(call);
            next_token(abi)
        });
    }
    status
}

#[no_mangle]
pub unsafe extern "C" fn proxy_grpc_stream(
    cluster: *const u8,
    cluster_size: usize,
    service: *const u8,
    service_size: usize,
    method: *const u8,
    method_size: usize,
    metadata: *const u8,
    metadata_size: usize,
    token: *mut u32,
) -> u32 {
    let status = enter("proxy_grpc_stream");
    if status == OK {
        let stream = (
            text(cluster, cluster_size),
            text(service, service_size),
            text(method, method_size),
            bytes(metadata, metadata_size),
        );
        *token = with(|abi| {
            abi.grpc_streams.push(stream);
            next_token(abi)
        });
    }
    status
}

#[no_mangle]
pub unsafe extern "C" fn proxy_grpc_send(
    token: u32,
    message: *const u8,
    message_size: usize,
    end_stream: u32,
) -> u32 {
    let status = enter("proxy_grpc_send");
    if status == OK {
        let message = bytes(message, message_size);
        with(|abi| abi.grpc_sent.push((token, message, end_stream)));
    }
    status
}

#[no_mangle]
pub extern "C" fn proxy_grpc_close(token: u32) -> u32 {
    let status = enter("proxy_grpc_close");
    if status == OK {
        with(|abi| abi.grpc_closed.push((token, false)));
    }
    status
}

#[no_mangle]
pub extern "C" fn proxy_grpc_cancel(token: u32) -> u32 {
    let status = enter("proxy_grpc_cancel");
    if status == OK {
        with(|abi| abi.grpc_closed.push((token, true)));
    }
    status
}

#[no_mangle]
pub extern "C" fn proxy_set_effective_context(context_id: u32) -> u32 {
    let status = enter("proxy_set_effective_context");
    if status == OK {
        with(|abi| abi.effective_context.push(context_id));
    }
    status
}

#[no_mangle]
pub extern "C" fn proxy_set_tick_period_milliseconds(period: u32) -> u32 {
    let status = enter("proxy_set_tick_period_milliseconds");
    if status == OK {
        with(|abi| abi.tick_periods.push(period));
    }
    status
}

#[no_mangle]
pub extern "C" fn proxy_done() -> u32 {
    enter("proxy_done")
}

#[no_mangle]
pub unsafe extern "C" fn proxy_register_shared_queue(
    name: *const u8,
    name_size: usize,
    id: *mut u32,
) -> u32 {
    let status = enter("proxy_register_shared_queue");
    if status == OK {
        let name = text(name, name_size);
        *id = with(|abi| {
            let id = 100 + abi.queues.len() as u32;
            abi.queues.entry(id).or_default();
            let _ = name;
            id
        });
    }
    status
}

#[no_mangle]
pub unsafe extern "C" fn proxy_enqueue_shared_queue(
    queue: u32,
    value: *const u8,
    value_size: usize,
) -> u32 {
    let status = enter("proxy_enqueue_shared_queue");
    if status != OK {
        return status;
    }
    let value = bytes(value, value_size);
    with(|abi| match abi.queues.get_mut(&queue) {
        Some(q) => {
            q.push_back(Some(value));
            OK
        }
        None => NOT_FOUND,
    })
}

/// An entry queued as None is handed over as a null buffer, as Envoy does an empty value.
#[no_mangle]
pub unsafe extern "C" fn proxy_dequeue_shared_queue(
    queue: u32,
    data: *mut *mut u8,
    size: *mut usize,
) -> u32 {
    let status = enter("proxy_dequeue_shared_queue");
    if status != OK {
        return status;
    }
    match with(|abi| abi.queues.get_mut(&queue).map(VecDeque::pop_front)) {
        None => NOT_FOUND,
        Some(None) => EMPTY,
        Some(Some(Some(value))) => {
            give(value, data, size);
            OK
        }
        Some(Some(None)) => {
            *data = std::ptr::null_mut();
            *size = 0;
            OK
        }
    }
}

#[no_mangle]
pub unsafe extern "C" fn proxy_define_metric(
    kind: u32,
    name: *const u8,
    name_size: usize,
    id: *mut u32,
) -> u32 {
    let status = enter("proxy_define_metric");
    if status == OK {
        let name = text(name, name_size);
        *id = with(|abi| {
            let id = 1 + abi.metrics.len() as u32;
            abi.metrics.insert(name, (id, kind));
            id
        });
    }
    status
}

#[no_mangle]
pub extern "C" fn proxy_increment_metric(id: u32, offset: i64) -> u32 {
    let status = enter("proxy_increment_metric");
    if status == OK {
        with(|abi| abi.metric_values.push((id, offset)));
    }
    status
}

#[no_mangle]
pub extern "C" fn proxy_record_metric(id: u32, value: u64) -> u32 {
    let status = enter("proxy_record_metric");
    if status == OK {
        with(|abi| abi.metric_values.push((id, value as i64)));
    }
    status
}

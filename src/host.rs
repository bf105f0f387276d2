//! The proxy-wasm host calls this filter makes, each returning every status to the caller.
//!
//! Why not the SDK's `hostcalls`: in proxy-wasm 0.2.5 they panic on any status they do not
//! expect (for example BadArgument when a header map is no longer available), and a panic
//! kills the worker's VM. These wrappers call the same ABI and never panic; the SDK is still
//! used for its context dispatcher and memory allocator.

#![allow(unsafe_code)]

use proxy_wasm::types::{BufferType, MapType, MetricType, StreamType};
use std::ptr::{null, null_mut};
use std::time::Duration;

/// A host status other than Ok, by its ABI number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostStatus(pub u32);

impl HostStatus {
    pub const CAS_MISMATCH: HostStatus = HostStatus(8);

    pub fn name(self) -> &'static str {
        match self.0 {
            1 => "NotFound",
            2 => "BadArgument",
            3 => "SerializationFailure",
            4 => "ParseFailure",
            7 => "Empty",
            8 => "CasMismatch",
            10 => "InternalFailure",
            12 => "Unimplemented",
            _ => "UnknownStatus",
        }
    }
}

impl std::fmt::Display for HostStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.0)
    }
}

type HostResult<T> = Result<T, HostStatus>;

fn check(status: u32) -> HostResult<()> {
    if status == 0 {
        Ok(())
    } else {
        Err(HostStatus(status))
    }
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_log(level: u32, message_data: *const u8, message_size: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(return_time: *mut u64) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        return_buffer_data: *mut *mut u8,
        return_buffer_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: u32,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key_data: *const u8, key_size: usize) -> u32;
    fn proxy_add_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_buffer_status(buffer_type: u32, length: *mut usize, flags: *mut u32) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: u32,
        start: usize,
        size: usize,
        buffer_data: *const u8,
        buffer_size: usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_set_property(
        path_data: *const u8,
        path_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key_data: *const u8,
        key_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
        return_cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
    fn proxy_grpc_send(token: u32, message: *const u8, message_size: usize, end_stream: u32)
        -> u32;
    fn proxy_grpc_close(token: u32) -> u32;
    fn proxy_grpc_cancel(token: u32) -> u32;
    fn proxy_set_effective_context(context_id: u32) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_done() -> u32;
    fn proxy_register_shared_queue(
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_enqueue_shared_queue(queue_id: u32, value_data: *const u8, value_size: usize) -> u32;
    fn proxy_dequeue_shared_queue(
        queue_id: u32,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
    fn proxy_send_local_response(
        status_code: u32,
        status_code_details_data: *const u8,
        status_code_details_size: usize,
        body_data: *const u8,
        body_size: usize,
        headers_data: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_define_metric(
        metric_type: u32,
        name_data: *const u8,
        name_size: usize,
        return_id: *mut u32,
    ) -> u32;
    fn proxy_increment_metric(metric_id: u32, offset: i64) -> u32;
    fn proxy_record_metric(metric_id: u32, value: u64) -> u32;
}

/// Takes ownership of a buffer the host allocated through the module's allocator.
///
/// # Safety
/// `data` must be null or a block of `size` bytes the host obtained from this module's
/// `proxy_on_memory_allocate` for this call.
unsafe fn take_host_buffer(data: *mut u8, size: usize) -> Option<Vec<u8>> {
    if data.is_null() {
        None
    } else {
        Some(Vec::from_raw_parts(data, size, size))
    }
}

pub fn log(level: u32, message: &str) {
    // Nothing useful can be done if logging itself fails.
    let _ = unsafe { proxy_log(level, message.as_ptr(), message.len()) };
}

/// Nanoseconds since the Unix epoch by the host's clock (0 if the host refuses).
pub fn now_nanos() -> u64 {
    let mut nanos: u64 = 0;
    match check(unsafe { proxy_get_current_time_nanoseconds(&mut nanos) }) {
        Ok(()) => nanos,
        Err(_) => 0,
    }
}

pub fn get_buffer(
    buffer: BufferType,
    start: usize,
    max_size: usize,
) -> HostResult<Option<Vec<u8>>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    let status =
        unsafe { proxy_get_buffer_bytes(buffer as u32, start, max_size, &mut data, &mut size) };
    match status {
        0 => Ok(unsafe { take_host_buffer(data, size) }),
        1 | 7 => Ok(None),
        other => Err(HostStatus(other)),
    }
}

/// All pairs of a header map, values as bytes (names are lower case in Envoy).
pub fn get_header_pairs(map: MapType) -> HostResult<Vec<(String, Vec<u8>)>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    check(unsafe { proxy_get_header_map_pairs(map as u32, &mut data, &mut size) })?;
    Ok(unsafe { take_host_buffer(data, size) }
        .map(|bytes| deserialize_pairs(&bytes))
        .unwrap_or_default())
}

/// One header's value; None when the map has no such header (Envoy answers NotFound).
pub fn get_header(map: MapType, name: &str) -> HostResult<Option<Vec<u8>>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    let status = unsafe {
        proxy_get_header_map_value(map as u32, name.as_ptr(), name.len(), &mut data, &mut size)
    };
    match status {
        0 => Ok(unsafe { take_host_buffer(data, size) }),
        1 => Ok(None),
        other => Err(HostStatus(other)),
    }
}

pub fn remove_header(map: MapType, name: &str) -> HostResult<()> {
    check(unsafe { proxy_remove_header_map_value(map as u32, name.as_ptr(), name.len()) })
}

pub fn add_header(map: MapType, name: &str, value: &[u8]) -> HostResult<()> {
    check(unsafe {
        proxy_add_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

/// Replaces the whole of a buffer: Envoy drains the `size` bytes it is told from the start
/// and prepends the new ones, so the buffer's length is read first.
pub fn set_buffer(buffer: BufferType, bytes: &[u8]) -> HostResult<()> {
    let mut length: usize = 0;
    let mut flags: u32 = 0;
    check(unsafe { proxy_get_buffer_status(buffer as u32, &mut length, &mut flags) })?;
    check(unsafe { proxy_set_buffer_bytes(buffer as u32, 0, length, bytes.as_ptr(), bytes.len()) })
}

pub fn replace_header(map: MapType, name: &str, value: &[u8]) -> HostResult<()> {
    check(unsafe {
        proxy_replace_header_map_value(
            map as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

pub fn get_property(path: &[&str]) -> HostResult<Option<Vec<u8>>> {
    let serialized = path.join("\0");
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    let status =
        unsafe { proxy_get_property(serialized.as_ptr(), serialized.len(), &mut data, &mut size) };
    match status {
        0 => Ok(unsafe { take_host_buffer(data, size) }),
        1 => Ok(None),
        other => Err(HostStatus(other)),
    }
}

/// Sets a stream property; Envoy keeps it as filter state `wasm.<path>`.
pub fn set_property(path: &[&str], value: &[u8]) -> HostResult<()> {
    let serialized = path.join("\0");
    check(unsafe {
        proxy_set_property(
            serialized.as_ptr(),
            serialized.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

/// The value (possibly absent) and cas of a shared data key; None when the key does not exist.
pub fn get_shared_data(key: &str) -> HostResult<Option<(Option<Vec<u8>>, u32)>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    let mut cas: u32 = 0;
    let status =
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut size, &mut cas) };
    match status {
        0 => Ok(Some((unsafe { take_host_buffer(data, size) }, cas))),
        1 => Ok(None),
        other => Err(HostStatus(other)),
    }
}

pub fn set_shared_data(key: &str, value: &[u8], cas: u32) -> HostResult<()> {
    check(unsafe {
        proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
    })
}

pub fn resume_request() -> HostResult<()> {
    check(unsafe { proxy_continue_stream(StreamType::HttpRequest as u32) })
}

pub fn set_tick_period(period: Duration) -> HostResult<()> {
    let ms = u32::try_from(period.as_millis()).unwrap_or(u32::MAX);
    check(unsafe { proxy_set_tick_period_milliseconds(ms) })
}

/// Tells Envoy that a root context which asked to finish its work (`on_done` returned false)
/// is done now.
pub fn done() -> HostResult<()> {
    check(unsafe { proxy_done() })
}

pub fn register_shared_queue(name: &str) -> HostResult<u32> {
    let mut id: u32 = 0;
    check(unsafe { proxy_register_shared_queue(name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn enqueue_shared_queue(queue_id: u32, value: &[u8]) -> HostResult<()> {
    check(unsafe { proxy_enqueue_shared_queue(queue_id, value.as_ptr(), value.len()) })
}

/// Ok(None) once the queue is empty.
pub fn dequeue_shared_queue(queue_id: u32) -> HostResult<Option<Vec<u8>>> {
    let mut data: *mut u8 = null_mut();
    let mut size: usize = 0;
    match unsafe { proxy_dequeue_shared_queue(queue_id, &mut data, &mut size) } {
        0 => Ok(unsafe { take_host_buffer(data, size) }.or(Some(Vec::new()))),
        7 => Ok(None),
        other => Err(HostStatus(other)),
    }
}

/// Dispatches an HTTP call through the SDK, which must learn the token so the answer reaches
/// the calling context. The SDK returns BadArgument and InternalFailure; the host returns no
/// other status for a well-formed call.
pub fn dispatch_http_call(
    cluster: &str,
    headers: Vec<(&str, &str)>,
    body: &[u8],
    trailers: Vec<(&str, &str)>,
    timeout: Duration,
) -> HostResult<u32> {
    // A zero timeout means "none" to the host: never send one.
    let timeout = timeout.max(Duration::from_millis(1));
    proxy_wasm::hostcalls::dispatch_http_call(cluster, headers, Some(body), trailers, timeout)
        .map_err(|status| HostStatus(status as u32))
}

/// Opens a gRPC stream through the SDK, which must learn the token so the stream's messages
/// reach the opening context. Envoy answers ParseFailure for an unknown cluster and
/// InternalFailure when it cannot create the stream, both of which the SDK returns.
pub fn open_grpc_stream(
    cluster: &str,
    service: &str,
    method: &str,
    metadata: &[(&str, &[u8])],
) -> HostResult<u32> {
    proxy_wasm::hostcalls::open_grpc_stream(cluster, service, method, metadata.to_vec())
        .map_err(|status| HostStatus(status as u32))
}

pub fn send_grpc_message(token: u32, message: &[u8]) -> HostResult<()> {
    check(unsafe { proxy_grpc_send(token, message.as_ptr(), message.len(), 0) })
}

/// Half-closes the stream (`reset`: false), or resets it at once.
pub fn close_grpc_stream(token: u32, reset: bool) -> HostResult<()> {
    check(unsafe {
        if reset {
            proxy_grpc_cancel(token)
        } else {
            proxy_grpc_close(token)
        }
    })
}

pub fn set_effective_context(context_id: u32) -> HostResult<()> {
    check(unsafe { proxy_set_effective_context(context_id) })
}

pub fn send_local_response(status: u32, headers: &[(&str, &[u8])], body: &[u8]) -> HostResult<()> {
    let serialized = serialize_pairs(headers);
    check(unsafe {
        proxy_send_local_response(
            status,
            null(),
            0,
            body.as_ptr(),
            body.len(),
            serialized.as_ptr(),
            serialized.len(),
            -1,
        )
    })
}

pub fn define_counter(name: &str) -> HostResult<u32> {
    define_metric(MetricType::Counter, name)
}

pub fn define_gauge(name: &str) -> HostResult<u32> {
    define_metric(MetricType::Gauge, name)
}

fn define_metric(kind: MetricType, name: &str) -> HostResult<u32> {
    let mut id: u32 = 0;
    check(unsafe { proxy_define_metric(kind as u32, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn increment_counter(id: u32) {
    // A lost increment is not worth failing a request over.
    let _ = unsafe { proxy_increment_metric(id, 1) };
}

pub fn set_gauge(id: u32, value: u64) {
    // Nor is a lost gauge value.
    let _ = unsafe { proxy_record_metric(id, value) };
}

/// Header maps cross the ABI as: count, then (name length, value length) pairs, then each
/// name and value followed by a NUL, all lengths little-endian u32.
fn serialize_pairs(pairs: &[(&str, &[u8])]) -> Vec<u8> {
    let size = 4 + pairs
        .iter()
        .map(|(n, v)| 10 + n.len() + v.len())
        .sum::<usize>();
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
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

fn read_u32_le(bytes: &[u8], at: usize) -> Option<usize> {
    let raw: [u8; 4] = bytes.get(at..at.checked_add(4)?)?.try_into().ok()?;
    usize::try_from(u32::from_le_bytes(raw)).ok()
}

/// Malformed input yields the pairs read so far, never a panic.
fn deserialize_pairs(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let Some(count) = read_u32_le(bytes, 0) else {
        return Vec::new();
    };
    let mut pairs = Vec::with_capacity(count.min(256));
    let mut data_at = 4usize.saturating_add(count.saturating_mul(8));
    for i in 0..count {
        let sizes_at = 4 + i * 8;
        let (Some(name_len), Some(value_len)) = (
            read_u32_le(bytes, sizes_at),
            read_u32_le(bytes, sizes_at + 4),
        ) else {
            break;
        };
        let name_end = data_at.saturating_add(name_len);
        let value_at = name_end.saturating_add(1);
        let value_end = value_at.saturating_add(value_len);
        let (Some(name), Some(value)) =
            (bytes.get(data_at..name_end), bytes.get(value_at..value_end))
        else {
            break;
        };
        pairs.push((String::from_utf8_lossy(name).into_owned(), value.to_vec()));
        data_at = value_end.saturating_add(1);
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_pairs_round_trip_and_garbage_is_harmless() {
        let pairs: Vec<(&str, &[u8])> = vec![(":status", b"200"), ("x-a", b""), ("b", b"v\x01")];
        let decoded = deserialize_pairs(&serialize_pairs(&pairs));
        let expected: Vec<(String, Vec<u8>)> = pairs
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_vec()))
            .collect();
        assert_eq!(decoded, expected);
        let bytes = serialize_pairs(&pairs);
        // Every cut short of the last value's terminator loses at least the last pair.
        for cut in 0..bytes.len() - 1 {
            let partial = deserialize_pairs(&bytes[..cut]);
            assert!(partial.len() < pairs.len());
        }
        assert!(deserialize_pairs(&[0xff, 0xff, 0xff, 0xff]).is_empty());
    }
}

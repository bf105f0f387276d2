//! Bytes across the ABI: what the module lends Envoy for one call, and copies of what Envoy
//! lends the module for one hook.

use std::ffi::c_char;

use crate::ffi;

pub(crate) fn module_buffer(bytes: &[u8]) -> ffi::ModuleBuffer {
    ffi::ModuleBuffer {
        ptr: bytes.as_ptr().cast::<c_char>(),
        length: bytes.len(),
    }
}

/// Copies bytes Envoy lends. Null or empty is empty.
///
/// # Safety
/// `ptr` must be null or point at `length` readable bytes.
pub(crate) unsafe fn copy_envoy(ptr: *const c_char, length: usize) -> Vec<u8> {
    if ptr.is_null() || length == 0 {
        Vec::new()
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), length) }.to_vec()
    }
}

pub(crate) fn empty_envoy_buffer() -> ffi::EnvoyBuffer {
    ffi::EnvoyBuffer {
        ptr: std::ptr::null(),
        length: 0,
    }
}

pub(crate) fn headers_from_envoy(pairs: &[ffi::EnvoyHttpHeader]) -> Vec<(String, Vec<u8>)> {
    pairs
        .iter()
        .map(|h| {
            // SAFETY: Envoy filled each entry with a key and value it owns, valid for the hook.
            let (key, value) = unsafe {
                (
                    copy_envoy(h.key_ptr, h.key_length),
                    copy_envoy(h.value_ptr, h.value_length),
                )
            };
            (String::from_utf8_lossy(&key).into_owned(), value)
        })
        .collect()
}

pub(crate) fn module_headers(headers: &[(&str, &[u8])]) -> Vec<ffi::ModuleHttpHeader> {
    headers
        .iter()
        .map(|(name, value)| ffi::ModuleHttpHeader {
            key_ptr: name.as_ptr().cast::<c_char>(),
            key_length: name.len(),
            value_ptr: value.as_ptr().cast::<c_char>(),
            value_length: value.len(),
        })
        .collect()
}

pub(crate) fn owned_headers(headers: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .map(|(n, v)| ((*n).to_owned(), v.to_vec()))
        .collect()
}

pub(crate) fn borrowed_headers(headers: &[(String, Vec<u8>)]) -> Vec<(&str, &[u8])> {
    headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_slice()))
        .collect()
}

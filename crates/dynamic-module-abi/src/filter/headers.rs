//! A request's header maps and trailers.

use std::ffi::c_char;

use super::Filter;
use crate::buffers::{copy_envoy, empty_envoy_buffer, headers_from_envoy, module_buffer};
use crate::{ffi, AbiError};

/// Which header map of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderMap {
    RequestHeaders,
    RequestTrailers,
    ResponseHeaders,
    ResponseTrailers,
}

impl HeaderMap {
    fn raw(self) -> ffi::HttpHeaderType {
        match self {
            HeaderMap::RequestHeaders => ffi::HEADER_TYPE_REQUEST_HEADER,
            HeaderMap::RequestTrailers => ffi::HEADER_TYPE_REQUEST_TRAILER,
            HeaderMap::ResponseHeaders => ffi::HEADER_TYPE_RESPONSE_HEADER,
            HeaderMap::ResponseTrailers => ffi::HEADER_TYPE_RESPONSE_TRAILER,
        }
    }
}

impl Filter {
    /// The first value of a request header (names are lower case in Envoy).
    pub fn request_header(&self, name: &str) -> Option<Vec<u8>> {
        self.header(HeaderMap::RequestHeaders, name)
    }

    /// The first value of `name` in `which`, or None if absent (or the map is not available).
    pub fn header(&self, which: HeaderMap, name: &str) -> Option<Vec<u8>> {
        let mut value = empty_envoy_buffer();
        let mut count: usize = 0;
        // SAFETY: the key is read during the call; `value` and `count` are written by Envoy.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_get_header(
                self.ptr,
                which.raw(),
                module_buffer(name.as_bytes()),
                &mut value,
                0,
                &mut count,
            )
        };
        if !ok || count == 0 || value.ptr.is_null() {
            return None;
        }
        // SAFETY: Envoy's value, valid for this hook.
        Some(unsafe { copy_envoy(value.ptr, value.length) })
    }

    /// Every value of `name` in `which`, in order.
    pub fn header_values(&self, which: HeaderMap, name: &str) -> Vec<Vec<u8>> {
        let mut values = Vec::new();
        let mut index = 0;
        loop {
            let mut value = empty_envoy_buffer();
            let mut count: usize = 0;
            // SAFETY: as in `header`.
            let ok = unsafe {
                ffi::envoy_dynamic_module_callback_http_get_header(
                    self.ptr,
                    which.raw(),
                    module_buffer(name.as_bytes()),
                    &mut value,
                    index,
                    &mut count,
                )
            };
            if !ok || index >= count || value.ptr.is_null() {
                return values;
            }
            // SAFETY: Envoy's value, valid for this hook.
            values.push(unsafe { copy_envoy(value.ptr, value.length) });
            index += 1;
        }
    }

    /// All entries of `which`, in Envoy's order (pseudo headers first), names as Envoy has
    /// them (lower case). Empty if the map is not available.
    pub fn headers(&self, which: HeaderMap) -> Vec<(String, Vec<u8>)> {
        #[cfg(any(test, feature = "mock"))]
        crate::mock_abi::maybe_panic("get_headers");
        // SAFETY: plain query.
        let size = unsafe {
            ffi::envoy_dynamic_module_callback_http_get_headers_size(self.ptr, which.raw())
        };
        if size == 0 {
            return Vec::new();
        }
        let empty = ffi::EnvoyHttpHeader {
            key_ptr: std::ptr::null(),
            key_length: 0,
            value_ptr: std::ptr::null(),
            value_length: 0,
        };
        let mut entries = vec![empty; size];
        // SAFETY: `entries` has room for `size` entries, the count Envoy just gave; nothing
        // runs on this worker in between.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_get_headers(
                self.ptr,
                which.raw(),
                entries.as_mut_ptr(),
            )
        };
        if !ok {
            return Vec::new();
        }
        headers_from_envoy(&entries)
    }

    /// Replaces every value of `name` with `value` (adds it if absent).
    pub fn set_header(&self, which: HeaderMap, name: &str, value: &[u8]) -> Result<(), AbiError> {
        // A non-null pointer even for an empty value: a null one means "remove".
        let value_buffer = if value.is_empty() {
            ffi::ModuleBuffer {
                ptr: b"".as_ptr().cast::<c_char>(),
                length: 0,
            }
        } else {
            module_buffer(value)
        };
        // SAFETY: both buffers are read during the call.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_set_header(
                self.ptr,
                which.raw(),
                module_buffer(name.as_bytes()),
                value_buffer,
            )
        };
        ok.then_some(()).ok_or(AbiError::Refused("set_header"))
    }

    /// Adds a value of `name`, keeping the others.
    pub fn add_header(&self, which: HeaderMap, name: &str, value: &[u8]) -> Result<(), AbiError> {
        // SAFETY: both buffers are read during the call.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_add_header(
                self.ptr,
                which.raw(),
                module_buffer(name.as_bytes()),
                ffi::ModuleBuffer {
                    ptr: if value.is_empty() {
                        b"".as_ptr().cast::<c_char>()
                    } else {
                        value.as_ptr().cast::<c_char>()
                    },
                    length: value.len(),
                },
            )
        };
        ok.then_some(()).ok_or(AbiError::Refused("add_header"))
    }

    /// Removes every value of `name` (the ABI's set_header with a null value). Ok if absent.
    pub fn remove_header(&self, which: HeaderMap, name: &str) -> Result<(), AbiError> {
        // SAFETY: the key is read during the call; a null value means remove.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_set_header(
                self.ptr,
                which.raw(),
                module_buffer(name.as_bytes()),
                ffi::ModuleBuffer {
                    ptr: std::ptr::null(),
                    length: 0,
                },
            )
        };
        ok.then_some(()).ok_or(AbiError::Refused("remove_header"))
    }
}

//! A request's and a response's body: what is buffered, the chunk a hook sees, and the
//! request body replaced.

use super::Filter;
use crate::buffers::{copy_envoy, empty_envoy_buffer, module_buffer};
use crate::{ffi, AbiError};

impl Filter {
    /// The bytes of one of Envoy's body buffers, or None if that buffer is not available now
    /// (the received chunk outside a body hook).
    fn body(&self, body_type: ffi::HttpBodyType) -> Result<Option<Vec<u8>>, AbiError> {
        // SAFETY: plain queries.
        let (chunks, size) = unsafe {
            (
                ffi::envoy_dynamic_module_callback_http_get_body_chunks_size(self.ptr, body_type),
                ffi::envoy_dynamic_module_callback_http_get_body_size(self.ptr, body_type),
            )
        };
        if chunks == 0 {
            return Ok(None);
        }
        let mut slices = vec![empty_envoy_buffer(); chunks];
        // SAFETY: room for `chunks` entries, the count Envoy just gave.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_get_body_chunks(
                self.ptr,
                body_type,
                slices.as_mut_ptr(),
            )
        };
        if !ok {
            return Ok(None);
        }
        let mut body = Vec::with_capacity(size);
        for slice in &slices {
            // SAFETY: Envoy's slices, valid for this hook.
            body.extend_from_slice(&unsafe { copy_envoy(slice.ptr, slice.length) });
        }
        if body.len() != size {
            return Err(AbiError::Inconsistent("get_body_chunks"));
        }
        Ok(Some(body))
    }

    /// The whole request body received so far: what Envoy buffered (the filter answered
    /// StopIterationAndBuffer to earlier chunks) followed by the chunk of the running
    /// request-body hook (not yet in the buffer). In the end-of-stream body hook this is the
    /// whole body. Outside a body hook, the buffered part only.
    pub fn request_body(&self) -> Result<Vec<u8>, AbiError> {
        self.whole_body(
            ffi::BODY_TYPE_BUFFERED_REQUEST_BODY,
            ffi::BODY_TYPE_RECEIVED_REQUEST_BODY,
            // SAFETY: plain query.
            unsafe {
                ffi::envoy_dynamic_module_callback_http_received_buffered_request_body(self.ptr)
            },
        )
    }

    /// The whole response body so far, as [`Filter::request_body`] for the response.
    pub fn response_body(&self) -> Result<Vec<u8>, AbiError> {
        self.whole_body(
            ffi::BODY_TYPE_BUFFERED_RESPONSE_BODY,
            ffi::BODY_TYPE_RECEIVED_RESPONSE_BODY,
            // SAFETY: plain query.
            unsafe {
                ffi::envoy_dynamic_module_callback_http_received_buffered_response_body(self.ptr)
            },
        )
    }

    fn whole_body(
        &self,
        buffered: ffi::HttpBodyType,
        received: ffi::HttpBodyType,
        received_is_buffered: bool,
    ) -> Result<Vec<u8>, AbiError> {
        let mut body = self.body(buffered)?.unwrap_or_default();
        // When the chunk Envoy delivers is the buffer itself (a filter before this one
        // buffered and resumed), it must not be counted twice.
        if !received_is_buffered {
            if let Some(chunk) = self.body(received)? {
                body.extend_from_slice(&chunk);
            }
        }
        Ok(body)
    }

    /// The size of [`Filter::request_body`] without copying it: what a body hook reports.
    pub fn request_body_size(&self) -> usize {
        // SAFETY: plain queries.
        unsafe {
            let buffered = ffi::envoy_dynamic_module_callback_http_get_body_size(
                self.ptr,
                ffi::BODY_TYPE_BUFFERED_REQUEST_BODY,
            );
            if ffi::envoy_dynamic_module_callback_http_received_buffered_request_body(self.ptr) {
                return buffered;
            }
            buffered.saturating_add(ffi::envoy_dynamic_module_callback_http_get_body_size(
                self.ptr,
                ffi::BODY_TYPE_RECEIVED_REQUEST_BODY,
            ))
        }
    }

    /// The size of [`Filter::response_body_chunk`] without copying it.
    pub fn response_body_chunk_size(&self) -> usize {
        // SAFETY: plain query.
        unsafe {
            ffi::envoy_dynamic_module_callback_http_get_body_size(
                self.ptr,
                ffi::BODY_TYPE_RECEIVED_RESPONSE_BODY,
            )
        }
    }

    /// The chunk of the running response-body hook (empty outside it).
    pub fn response_body_chunk(&self) -> Result<Vec<u8>, AbiError> {
        Ok(self
            .body(ffi::BODY_TYPE_RECEIVED_RESPONSE_BODY)?
            .unwrap_or_default())
    }

    /// The chunk of the running request-body hook (empty outside it).
    pub fn request_body_chunk(&self) -> Result<Vec<u8>, AbiError> {
        Ok(self
            .body(ffi::BODY_TYPE_RECEIVED_REQUEST_BODY)?
            .unwrap_or_default())
    }

    /// Replaces the whole request body (buffered part and running chunk) with `body`. Only
    /// for a filter that holds the body (nothing after it has seen it yet). Content-Length
    /// is not changed here.
    pub fn replace_request_body(&self, body: &[u8]) -> Result<(), AbiError> {
        let drain = |body_type| {
            // SAFETY: plain calls; draining more than there is drains all.
            unsafe {
                let size =
                    ffi::envoy_dynamic_module_callback_http_get_body_size(self.ptr, body_type);
                size == 0
                    || ffi::envoy_dynamic_module_callback_http_drain_body(self.ptr, body_type, size)
            }
        };
        if !drain(ffi::BODY_TYPE_BUFFERED_REQUEST_BODY) {
            return Err(AbiError::Refused("drain_body"));
        }
        // SAFETY: plain query.
        let received_is_buffered = unsafe {
            ffi::envoy_dynamic_module_callback_http_received_buffered_request_body(self.ptr)
        };
        // The running chunk, if any (refused outside a body hook: nothing to drain then).
        let in_body_hook = !received_is_buffered && drain(ffi::BODY_TYPE_RECEIVED_REQUEST_BODY);
        if body.is_empty() {
            return Ok(());
        }
        let append = |body_type| {
            // SAFETY: `body` is read during the call.
            unsafe {
                ffi::envoy_dynamic_module_callback_http_append_body(
                    self.ptr,
                    body_type,
                    module_buffer(body),
                )
            }
        };
        let appended = (in_body_hook && append(ffi::BODY_TYPE_RECEIVED_REQUEST_BODY))
            || append(ffi::BODY_TYPE_BUFFERED_REQUEST_BODY);
        appended
            .then_some(())
            .ok_or(AbiError::Refused("append_body"))
    }
}

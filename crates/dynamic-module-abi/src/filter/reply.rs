//! A request's local reply and its resume: made at once, or, inside the request's own hook,
//! when the hook returns (`hook_frames`).

use super::Filter;
use crate::buffers::{borrowed_headers, module_buffer, module_headers, owned_headers};
use crate::ffi;
use crate::hook_frames::{defer_if_in_own_hook, Deferred};
use crate::logging::{log, LogLevel};

impl Filter {
    /// Sends a local reply (status, headers, body) downstream. From this filter's own hook it
    /// is made when the hook's method returns (see ABI-NOTES.md, re-entry).
    pub fn send_response(&self, status: u16, headers: &[(&str, &[u8])], body: &[u8]) {
        #[cfg(any(test, feature = "mock"))]
        crate::mock_abi::maybe_panic("send_response");
        let call = Deferred::SendResponse {
            status: u32::from(status),
            headers: owned_headers(headers),
            body: body.to_vec(),
        };
        self.run_or_defer(call);
    }

    /// Starts a response downstream with exactly these headers (`:status` among them; Envoy
    /// adds only what its codec and connection manager add to any response: `date`, `server`,
    /// and `content-length: 0` for an HTTP/1 response ended here). Unlike [`Filter::send_response`]
    /// nothing is dropped or added by Envoy's local reply rules. `end_stream`: no body follows.
    /// Deferred like `send_response` from this filter's own hook; calls made in one hook are
    /// made in the order given.
    pub fn send_response_headers(&self, headers: &[(&str, &[u8])], end_stream: bool) {
        self.run_or_defer(Deferred::SendResponseHeaders {
            headers: owned_headers(headers),
            end_stream,
        });
    }

    /// Body bytes of a response started with [`Filter::send_response_headers`].
    pub fn send_response_data(&self, data: &[u8], end_stream: bool) {
        self.run_or_defer(Deferred::SendResponseData {
            data: data.to_vec(),
            end_stream,
        });
    }

    /// Trailers ending a response started with [`Filter::send_response_headers`].
    pub fn send_response_trailers(&self, trailers: &[(&str, &[u8])]) {
        self.run_or_defer(Deferred::SendResponseTrailers {
            trailers: owned_headers(trailers),
        });
    }

    /// Makes the calls held for this request, in order, up to the first that ends its
    /// response: Envoy may end the stream inside that one (a local reply always does), and a
    /// call after it would reach a stream that is gone.
    pub(crate) fn run_held(&self, calls: Vec<Deferred>) {
        let mut calls = calls.into_iter();
        for call in calls.by_ref() {
            let ends = call.ends_the_response();
            self.run(call);
            if ends {
                break;
            }
        }
        let dropped = calls.count();
        if dropped > 0 {
            log(
                LogLevel::Debug,
                &format!("{dropped} call(s) after the response's end dropped"),
            );
        }
    }

    /// Takes back a resume this request's running hook asked for and has not made yet (its
    /// filter fails it closed instead).
    pub fn withdraw_resume(&self) {
        crate::hook_frames::withdraw(self.ptr, |call| matches!(call, Deferred::ContinueDecoding));
    }

    fn run_or_defer(&self, call: Deferred) {
        if let Some(call) = defer_if_in_own_hook(self.ptr, call) {
            self.run(call);
        }
    }

    /// Resumes the request the filter stopped. From this filter's own hook it is made when the
    /// hook's method returns.
    pub fn continue_decoding(&self) {
        self.run_or_defer(Deferred::ContinueDecoding);
    }

    /// Resumes the response the filter stopped. From this filter's own hook it is made when
    /// the hook's method returns.
    pub fn continue_encoding(&self) {
        self.run_or_defer(Deferred::ContinueEncoding);
    }

    /// Makes a call now.
    pub(crate) fn run(&self, call: Deferred) {
        if !crate::hook_frames::may_send(self.ptr, &call) {
            log(
                LogLevel::Debug,
                "a response's part after the module ended that response dropped",
            );
            return;
        }
        match call {
            // SAFETY: plain calls on the live filter.
            Deferred::ContinueDecoding => unsafe {
                ffi::envoy_dynamic_module_callback_http_filter_continue_decoding(self.ptr)
            },
            Deferred::ContinueEncoding => unsafe {
                ffi::envoy_dynamic_module_callback_http_filter_continue_encoding(self.ptr)
            },
            Deferred::SendResponse {
                status,
                headers,
                body,
            } => {
                let borrowed = borrowed_headers(&headers);
                let mut raw = module_headers(&borrowed);
                // SAFETY: headers and body are read during the call; an empty `details`.
                unsafe {
                    ffi::envoy_dynamic_module_callback_http_send_response(
                        self.ptr,
                        status,
                        raw.as_mut_ptr(),
                        raw.len(),
                        module_buffer(&body),
                        ffi::ModuleBuffer {
                            ptr: std::ptr::null(),
                            length: 0,
                        },
                    )
                }
            }
            Deferred::SendResponseHeaders {
                headers,
                end_stream,
            } => {
                let borrowed = borrowed_headers(&headers);
                let mut raw = module_headers(&borrowed);
                // SAFETY: Envoy copies the headers during the call.
                unsafe {
                    ffi::envoy_dynamic_module_callback_http_send_response_headers(
                        self.ptr,
                        raw.as_mut_ptr(),
                        raw.len(),
                        end_stream,
                    )
                }
            }
            // SAFETY: Envoy copies the data during the call.
            Deferred::SendResponseData { data, end_stream } => unsafe {
                ffi::envoy_dynamic_module_callback_http_send_response_data(
                    self.ptr,
                    module_buffer(&data),
                    end_stream,
                )
            },
            Deferred::SendResponseTrailers { trailers } => {
                let borrowed = borrowed_headers(&trailers);
                let mut raw = module_headers(&borrowed);
                // SAFETY: Envoy copies the trailers during the call.
                unsafe {
                    ffi::envoy_dynamic_module_callback_http_send_response_trailers(
                        self.ptr,
                        raw.as_mut_ptr(),
                        raw.len(),
                    )
                }
            }
        }
    }
}

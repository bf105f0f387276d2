//! A small safe layer over Envoy's dynamic modules ABI (`ffi`): every callback's answer is
//! checked and becomes a `Result`/`Option`; nothing here panics.
//!
//! - [`Filter`]: one request's Envoy filter, valid during that request's hooks on its worker.
//! - [`ConfigHandle`]: the filter config's Envoy object (metrics), usable from any thread.
//! - [`Scheduler`]: posts an event to a request's worker from any thread.
//! - [`ConfigScheduler`], [`MainThreadConfig`]: the config's own events and streams, on the
//!   main thread.
//! - [`fn@log`]: Envoy's log (and a `log` crate logger over it, installed at program init).
//! - `hooks`: the exported `envoy_dynamic_module_on_*` functions, which dispatch to the
//!   [`FilterFactory`] / [`HttpFilter`] built by the [`Module`] the .so registers with
//!   [`dynamic_module!`] (which defines the program-init hook).
//!
//! Memory, as the header has it: every byte slice Envoy lends (headers, bodies, attributes,
//! metadata, config bytes) is valid only until the current hook returns or a setter is called,
//! so the layer copies it out before returning. Every buffer the module passes in is only read
//! during the call (Envoy copies what it keeps).

#![allow(unsafe_code)]

pub mod ffi;
pub mod hooks;
// Envoy's callbacks, mocked: for this crate's tests and, with the `mock` feature, for tests of
// the modules built on it (never in a module loaded by Envoy: it would shadow Envoy's).
#[cfg(any(test, feature = "mock"))]
pub mod mock_abi;
#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::ffi::c_char;
use std::fmt;
use std::time::Duration;

pub use hooks::{FactoryBuilder, FilterFactory, HttpFilter, Module};

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

/// What a headers hook tells Envoy (`FilterHeadersStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadersStatus {
    Continue,
    StopIteration,
    ContinueAndDontEndStream,
    StopAllIterationAndBuffer,
    StopAllIterationAndWatermark,
}

impl HeadersStatus {
    pub(crate) fn raw(self) -> ffi::HeadersStatus {
        match self {
            HeadersStatus::Continue => ffi::HEADERS_CONTINUE,
            HeadersStatus::StopIteration => ffi::HEADERS_STOP_ITERATION,
            HeadersStatus::ContinueAndDontEndStream => ffi::HEADERS_CONTINUE_AND_DONT_END_STREAM,
            HeadersStatus::StopAllIterationAndBuffer => ffi::HEADERS_STOP_ALL_ITERATION_AND_BUFFER,
            HeadersStatus::StopAllIterationAndWatermark => {
                ffi::HEADERS_STOP_ALL_ITERATION_AND_WATERMARK
            }
        }
    }
}

/// What a body hook tells Envoy (`FilterDataStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyStatus {
    Continue,
    StopIterationAndBuffer,
    StopIterationAndWatermark,
    StopIterationNoBuffer,
}

impl BodyStatus {
    pub(crate) fn raw(self) -> ffi::BodyStatus {
        match self {
            BodyStatus::Continue => ffi::BODY_CONTINUE,
            BodyStatus::StopIterationAndBuffer => ffi::BODY_STOP_ITERATION_AND_BUFFER,
            BodyStatus::StopIterationAndWatermark => ffi::BODY_STOP_ITERATION_AND_WATERMARK,
            BodyStatus::StopIterationNoBuffer => ffi::BODY_STOP_ITERATION_NO_BUFFER,
        }
    }
}

/// What a trailers hook tells Envoy (`FilterTrailersStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrailersStatus {
    Continue,
    StopIteration,
}

impl TrailersStatus {
    pub(crate) fn raw(self) -> ffi::TrailersStatus {
        match self {
            TrailersStatus::Continue => ffi::TRAILERS_CONTINUE,
            TrailersStatus::StopIteration => ffi::TRAILERS_STOP_ITERATION,
        }
    }
}

/// How a callout ended (`envoy_dynamic_module_type_http_callout_result`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CalloutResult {
    Success,
    Reset,
    ExceedResponseBufferLimit,
    /// A value this header does not know (a newer Envoy).
    Other(u32),
}

impl CalloutResult {
    pub(crate) fn from_raw(raw: ffi::HttpCalloutResult) -> Self {
        match raw {
            ffi::CALLOUT_RESULT_SUCCESS => CalloutResult::Success,
            ffi::CALLOUT_RESULT_RESET => CalloutResult::Reset,
            ffi::CALLOUT_RESULT_EXCEED_RESPONSE_BUFFER_LIMIT => {
                CalloutResult::ExceedResponseBufferLimit
            }
            other => CalloutResult::Other(other),
        }
    }
}

/// The attributes the filter reads (CEL names in the comments).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttributeId {
    /// `request.path` (with the query)
    RequestPath,
    /// `request.url_path` (without the query)
    RequestUrlPath,
    /// `request.host`
    RequestHost,
    /// `request.method`
    RequestMethod,
    /// `request.id` (x-request-id)
    RequestId,
    /// `response.code` (int)
    ResponseCode,
    /// `response.code_details`
    ResponseCodeDetails,
    /// `response.flags` (int: Envoy's response flags as a bit set)
    ResponseFlags,
    /// `source.address` (Envoy 1.40: "ip:port")
    SourceAddress,
    /// `source.port` (int)
    SourcePort,
    /// `connection.id` (int)
    ConnectionId,
    /// `upstream.request_attempt_count` (int)
    UpstreamRequestAttemptCount,
    /// `xds.cluster_name`
    XdsClusterName,
    /// `xds.route_name`
    XdsRouteName,
    /// `xds.virtual_host_name`
    XdsVirtualHostName,
}

impl AttributeId {
    fn raw(self) -> ffi::AttributeId {
        match self {
            AttributeId::RequestPath => ffi::ATTRIBUTE_REQUEST_PATH,
            AttributeId::RequestUrlPath => ffi::ATTRIBUTE_REQUEST_URL_PATH,
            AttributeId::RequestHost => ffi::ATTRIBUTE_REQUEST_HOST,
            AttributeId::RequestMethod => ffi::ATTRIBUTE_REQUEST_METHOD,
            AttributeId::RequestId => ffi::ATTRIBUTE_REQUEST_ID,
            AttributeId::ResponseCode => ffi::ATTRIBUTE_RESPONSE_CODE,
            AttributeId::ResponseCodeDetails => ffi::ATTRIBUTE_RESPONSE_CODE_DETAILS,
            AttributeId::ResponseFlags => ffi::ATTRIBUTE_RESPONSE_FLAGS,
            AttributeId::SourceAddress => ffi::ATTRIBUTE_SOURCE_ADDRESS,
            AttributeId::SourcePort => ffi::ATTRIBUTE_SOURCE_PORT,
            AttributeId::ConnectionId => ffi::ATTRIBUTE_CONNECTION_ID,
            AttributeId::UpstreamRequestAttemptCount => {
                ffi::ATTRIBUTE_UPSTREAM_REQUEST_ATTEMPT_COUNT
            }
            AttributeId::XdsClusterName => ffi::ATTRIBUTE_XDS_CLUSTER_NAME,
            AttributeId::XdsRouteName => ffi::ATTRIBUTE_XDS_ROUTE_NAME,
            AttributeId::XdsVirtualHostName => ffi::ATTRIBUTE_XDS_VIRTUAL_HOST_NAME,
        }
    }
}

/// Where [`Filter::metadata_string`] looks: the `filter_metadata` of one of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetadataSource {
    /// The stream's dynamic metadata (set by filters during the request).
    Dynamic,
    /// The matched route's `metadata` (None before routing or with no route).
    Route,
    /// The upstream cluster's `metadata`.
    Cluster,
    /// The chosen upstream host's (LbEndpoint) `metadata` (only once a host is chosen).
    Host,
    /// The chosen upstream host's locality (LocalityLbEndpoints) `metadata`.
    HostLocality,
}

impl MetadataSource {
    fn raw(self) -> ffi::MetadataSource {
        match self {
            MetadataSource::Dynamic => ffi::METADATA_SOURCE_DYNAMIC,
            MetadataSource::Route => ffi::METADATA_SOURCE_ROUTE,
            MetadataSource::Cluster => ffi::METADATA_SOURCE_CLUSTER,
            MetadataSource::Host => ffi::METADATA_SOURCE_HOST,
            MetadataSource::HostLocality => ffi::METADATA_SOURCE_HOST_LOCALITY,
        }
    }
}

// ------------------------------------------------------------------------------------------
// Buffers
// ------------------------------------------------------------------------------------------

fn module_buffer(bytes: &[u8]) -> ffi::ModuleBuffer {
    ffi::ModuleBuffer {
        ptr: bytes.as_ptr().cast::<c_char>(),
        length: bytes.len(),
    }
}

/// Copies bytes Envoy lends. Null or empty is empty.
///
/// # Safety
/// `ptr` must be null or point at `length` readable bytes.
unsafe fn copy_envoy(ptr: *const c_char, length: usize) -> Vec<u8> {
    if ptr.is_null() || length == 0 {
        Vec::new()
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), length) }.to_vec()
    }
}

fn empty_envoy_buffer() -> ffi::EnvoyBuffer {
    ffi::EnvoyBuffer {
        ptr: std::ptr::null(),
        length: 0,
    }
}

fn headers_from_envoy(pairs: &[ffi::EnvoyHttpHeader]) -> Vec<(String, Vec<u8>)> {
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

fn module_headers(headers: &[(&str, &[u8])]) -> Vec<ffi::ModuleHttpHeader> {
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

// ------------------------------------------------------------------------------------------
// Deferred calls: a filter's own continue/send_response made inside one of its hooks
// ------------------------------------------------------------------------------------------

/// A call that would make Envoy re-enter the filter whose hook is running (Envoy runs the
/// rest of the chain, and possibly a local reply through this filter's encoder hooks,
/// synchronously). Made from that filter's own hook, it is queued and made right after the
/// filter's method returns, when the filter is no longer borrowed.
pub(crate) enum Deferred {
    ContinueDecoding,
    ContinueEncoding,
    SendResponse {
        status: u32,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    },
    SendResponseHeaders {
        headers: Vec<(String, Vec<u8>)>,
        end_stream: bool,
    },
    SendResponseData {
        data: Vec<u8>,
        end_stream: bool,
    },
    SendResponseTrailers {
        trailers: Vec<(String, Vec<u8>)>,
    },
}

impl Deferred {
    /// Whether the call ends the response (and so, as far as the module goes, the stream).
    fn ends_the_response(&self) -> bool {
        match self {
            Deferred::SendResponse { .. } | Deferred::SendResponseTrailers { .. } => true,
            Deferred::SendResponseHeaders { end_stream, .. }
            | Deferred::SendResponseData { end_stream, .. } => *end_stream,
            Deferred::ContinueDecoding | Deferred::ContinueEncoding => false,
        }
    }
}

fn owned_headers(headers: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    headers
        .iter()
        .map(|(n, v)| ((*n).to_owned(), v.to_vec()))
        .collect()
}

fn borrowed_headers(headers: &[(String, Vec<u8>)]) -> Vec<(&str, &[u8])> {
    headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_slice()))
        .collect()
}

struct HookFrame {
    filter: usize,
    deferred: Vec<Deferred>,
}

thread_local! {
    /// The filters whose hooks are on this thread's stack, innermost last.
    static HOOKS: RefCell<Vec<HookFrame>> = const { RefCell::new(Vec::new()) };
}

/// Marks `ptr`'s hook as running until the matching [`leave_hook`].
pub(crate) fn enter_hook(ptr: ffi::HttpFilterEnvoyPtr) {
    HOOKS.with(|hooks| {
        if let Ok(mut hooks) = hooks.try_borrow_mut() {
            hooks.push(HookFrame {
                filter: ptr as usize,
                deferred: Vec::new(),
            });
        }
    });
}

/// Ends the innermost hook and hands back the calls its filter deferred.
pub(crate) fn leave_hook() -> Vec<Deferred> {
    HOOKS.with(|hooks| {
        hooks
            .try_borrow_mut()
            .ok()
            .and_then(|mut hooks| hooks.pop())
            .map(|frame| frame.deferred)
            .unwrap_or_default()
    })
}

/// Queues `call` if one of `ptr`'s own hooks is running, to its innermost one: Envoy would otherwise run that filter's hooks inside the call while its
/// hook holds it (a hook deeper in the stack, under another request's, included); gives it
/// back otherwise.
fn defer_if_in_own_hook(ptr: ffi::HttpFilterEnvoyPtr, call: Deferred) -> Option<Deferred> {
    HOOKS.with(|hooks| match hooks.try_borrow_mut() {
        Ok(mut hooks) => match hooks
            .iter_mut()
            .rev()
            .find(|frame| frame.filter == ptr as usize)
        {
            Some(frame) => {
                frame.deferred.push(call);
                None
            }
            None => Some(call),
        },
        Err(_) => Some(call),
    })
}

// ------------------------------------------------------------------------------------------
// Filter
// ------------------------------------------------------------------------------------------

/// One request's filter in Envoy (`DynamicModuleHttpFilter*`). Valid from the filter's
/// creation until its `on_destroy`, on its worker thread only (it is neither Send nor Sync).
#[derive(Debug)]
pub struct Filter {
    ptr: ffi::HttpFilterEnvoyPtr,
}

/// A copy of a [`Filter`]'s pointer, to reach that request from another request's hook on
/// the same worker (e.g. resume a request that waits for another). Not Send: same worker only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FilterHandle {
    ptr: ffi::HttpFilterEnvoyPtr,
}

impl FilterHandle {
    /// The filter again.
    ///
    /// # Safety
    /// The request must not have been destroyed yet (its `on_destroy` has not run), and this
    /// must run on the worker thread the request lives on.
    pub unsafe fn filter(&self) -> Filter {
        Filter { ptr: self.ptr }
    }

    /// A number naming this request while it lives (its pointer's address).
    pub fn key(&self) -> usize {
        self.ptr as usize
    }
}

impl Filter {
    /// # Safety
    /// `ptr` must be the `filter_envoy_ptr` Envoy passed to the running hook (or a live
    /// filter's pointer on its own worker).
    pub unsafe fn from_raw(ptr: ffi::HttpFilterEnvoyPtr) -> Filter {
        Filter { ptr }
    }

    /// This filter's pointer, to use from another request's hook on the same worker.
    pub fn handle(&self) -> FilterHandle {
        FilterHandle { ptr: self.ptr }
    }

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
        mock_abi::maybe_panic("get_headers");
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

    /// Sends a local reply (status, headers, body) downstream. From this filter's own hook it
    /// is made when the hook's method returns (see ABI-NOTES.md, re-entry).
    pub fn send_response(&self, status: u16, headers: &[(&str, &[u8])], body: &[u8]) {
        #[cfg(any(test, feature = "mock"))]
        mock_abi::maybe_panic("send_response");
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

    /// A string (bytes) attribute, or None if Envoy has none now.
    pub fn attribute_string(&self, id: AttributeId) -> Option<Vec<u8>> {
        let mut value = empty_envoy_buffer();
        // SAFETY: `value` is written by Envoy.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_get_attribute_string(
                self.ptr,
                id.raw(),
                &mut value,
            )
        };
        // SAFETY: Envoy's value, valid for this hook.
        ok.then(|| unsafe { copy_envoy(value.ptr, value.length) })
    }

    /// The string at `filter_metadata.<namespace>.<key>` of `source`'s metadata, e.g. a
    /// route's `metadata: {filter_metadata: {idempotency: {rule: payments}}}` gives
    /// `metadata_string(Route, "idempotency", "rule") == Some(b"payments")`.
    ///
    /// None when Envoy has no such metadata now (no route, no upstream host yet), the
    /// namespace or key is absent, or the value is not a string (a number, bool, list or
    /// struct: Envoy also logs an error then). An empty string is `Some(vec![])`.
    pub fn metadata_string(
        &self,
        source: MetadataSource,
        namespace: &str,
        key: &str,
    ) -> Option<Vec<u8>> {
        let mut value = empty_envoy_buffer();
        // SAFETY: both buffers are read during the call; `value` is written by Envoy.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_get_metadata_string(
                self.ptr,
                source.raw(),
                module_buffer(namespace.as_bytes()),
                module_buffer(key.as_bytes()),
                &mut value,
            )
        };
        if !ok {
            None
        } else if value.length == 0 {
            Some(Vec::new())
        } else if value.ptr.is_null() {
            // "Found" with bytes that cannot be read: nothing to trust.
            None
        } else {
            // SAFETY: Envoy's string, valid for this hook; copied before it returns.
            Some(unsafe { copy_envoy(value.ptr, value.length) })
        }
    }

    /// An integer attribute, or None if Envoy has none now.
    pub fn attribute_int(&self, id: AttributeId) -> Option<u64> {
        let mut value: u64 = 0;
        // SAFETY: `value` is written by Envoy.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_get_attribute_int(
                self.ptr,
                id.raw(),
                &mut value,
            )
        };
        ok.then_some(value)
    }

    /// Sets a bytes filter state object (readable in the access log as
    /// `%FILTER_STATE(name:PLAIN)%`).
    pub fn set_filter_state(&self, name: &str, value: &[u8]) -> Result<(), AbiError> {
        // SAFETY: both buffers are read during the call.
        let ok = unsafe {
            ffi::envoy_dynamic_module_callback_http_set_filter_state_bytes(
                self.ptr,
                module_buffer(name.as_bytes()),
                module_buffer(value),
            )
        };
        ok.then_some(())
            .ok_or(AbiError::Refused("set_filter_state_bytes"))
    }

    /// The index of the worker this request runs on (0-based, below the concurrency).
    pub fn worker_index(&self) -> u32 {
        // SAFETY: plain query.
        unsafe { ffi::envoy_dynamic_module_callback_http_filter_get_worker_index(self.ptr) }
    }

    /// A scheduler that posts events to this request's `on_scheduled`, from any thread.
    pub fn new_scheduler(&self) -> Option<Scheduler> {
        // SAFETY: plain call; the result is ours to delete.
        let ptr = unsafe { ffi::envoy_dynamic_module_callback_http_filter_scheduler_new(self.ptr) };
        (!ptr.is_null()).then_some(Scheduler { ptr })
    }

    /// Adds `by` to a counter defined on this filter's config.
    pub fn increment_counter(&self, id: CounterId, by: u64) -> Result<(), AbiError> {
        // SAFETY: no labels.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_increment_counter(
                self.ptr,
                id.0,
                std::ptr::null_mut(),
                0,
                by,
            )
        };
        metrics("http_filter_increment_counter", result)
    }

    /// Sets a gauge defined on this filter's config.
    pub fn set_gauge(&self, id: GaugeId, value: u64) -> Result<(), AbiError> {
        // SAFETY: no labels.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_set_gauge(
                self.ptr,
                id.0,
                std::ptr::null_mut(),
                0,
                value,
            )
        };
        metrics("http_filter_set_gauge", result)
    }

    /// Starts a one-shot HTTP request to `cluster` (headers must include `:method`, `:path`
    /// and `host`); its answer comes to this request's `on_http_callout_done` with the id
    /// returned here. Timeouts count in whole milliseconds.
    pub fn http_callout(
        &self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u64, AbiError> {
        let mut raw = module_headers(headers);
        let mut id: u64 = 0;
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        // SAFETY: everything passed is read during the call; `id` is written by Envoy.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_http_callout(
                self.ptr,
                &mut id,
                module_buffer(cluster.as_bytes()),
                raw.as_mut_ptr(),
                raw.len(),
                module_buffer(body),
                timeout_ms,
            )
        };
        started(result, id)
    }
}

/// A callout or stream Envoy was asked to start: its id, or why it did not start.
fn started(result: ffi::HttpCalloutInitResult, id: u64) -> Result<u64, AbiError> {
    if result == ffi::CALLOUT_INIT_SUCCESS {
        Ok(id)
    } else {
        Err(AbiError::CalloutNotStarted(result))
    }
}

fn metrics(call: &'static str, result: ffi::MetricsResult) -> Result<(), AbiError> {
    if result == ffi::METRICS_SUCCESS {
        Ok(())
    } else {
        Err(AbiError::Metrics { call, result })
    }
}

// ------------------------------------------------------------------------------------------
// Scheduler
// ------------------------------------------------------------------------------------------

/// Posts events to one request's `on_scheduled` on its worker, from any thread. Deleted on
/// drop. Once the request is gone, a commit is a no-op in Envoy (it holds the filter weakly).
#[derive(Debug)]
pub struct Scheduler {
    ptr: ffi::HttpFilterSchedulerModulePtr,
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

// ------------------------------------------------------------------------------------------
// Config handle and metrics
// ------------------------------------------------------------------------------------------

/// A counter defined on the filter config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterId(usize);

/// A gauge defined on the filter config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GaugeId(usize);

/// The filter config's Envoy object (`DynamicModuleHttpFilterConfig*`). Valid until the
/// config's destroy hook (which drops the factory holding it); usable from any thread.
#[derive(Debug, Clone, Copy)]
pub struct ConfigHandle {
    ptr: ffi::HttpFilterConfigEnvoyPtr,
}

// SAFETY: the config-level metric calls only read the config's metric table (frozen after
// config creation) and touch Envoy stats, which are atomic.
unsafe impl Send for ConfigHandle {}
// SAFETY: as above.
unsafe impl Sync for ConfigHandle {}

impl ConfigHandle {
    /// # Safety
    /// `ptr` must be the `filter_config_envoy_ptr` Envoy passed to the config-new hook.
    pub unsafe fn from_raw(ptr: ffi::HttpFilterConfigEnvoyPtr) -> ConfigHandle {
        ConfigHandle { ptr }
    }

    /// Defines a counter, named `<metrics namespace>.<name>` in Envoy's stats. Only during
    /// the factory builder (config creation); afterwards Envoy answers Frozen.
    pub fn define_counter(&self, name: &str) -> Result<CounterId, AbiError> {
        let mut id: usize = 0;
        // SAFETY: the name is read during the call; `id` is written by Envoy.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_define_counter(
                self.ptr,
                module_buffer(name.as_bytes()),
                std::ptr::null_mut(),
                0,
                &mut id,
            )
        };
        metrics("http_filter_config_define_counter", result).map(|()| CounterId(id))
    }

    /// Adds `by` to a counter, from any thread.
    pub fn increment_counter(&self, id: CounterId, by: u64) -> Result<(), AbiError> {
        // SAFETY: no labels.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_increment_counter(
                self.ptr,
                id.0,
                std::ptr::null_mut(),
                0,
                by,
            )
        };
        metrics("http_filter_config_increment_counter", result)
    }

    /// Defines a gauge (see `define_counter`).
    pub fn define_gauge(&self, name: &str) -> Result<GaugeId, AbiError> {
        let mut id: usize = 0;
        // SAFETY: the name is read during the call; `id` is written by Envoy.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_define_gauge(
                self.ptr,
                module_buffer(name.as_bytes()),
                std::ptr::null_mut(),
                0,
                &mut id,
            )
        };
        metrics("http_filter_config_define_gauge", result).map(|()| GaugeId(id))
    }

    /// Sets a gauge, from any thread.
    pub fn set_gauge(&self, id: GaugeId, value: u64) -> Result<(), AbiError> {
        // SAFETY: no labels.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_set_gauge(
                self.ptr,
                id.0,
                std::ptr::null_mut(),
                0,
                value,
            )
        };
        metrics("http_filter_config_set_gauge", result)
    }

    /// A scheduler whose events run the config's `on_config_scheduled` on the main thread.
    /// None if Envoy made none.
    pub fn new_scheduler(&self) -> Option<ConfigScheduler> {
        // SAFETY: the config pointer is Envoy's, live until config destroy.
        let ptr = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(self.ptr)
        };
        (!ptr.is_null()).then_some(ConfigScheduler { ptr })
    }
}

// ------------------------------------------------------------------------------------------
// Config scheduler and the config's own callouts (main thread)
// ------------------------------------------------------------------------------------------

/// Posts events to the config's `on_config_scheduled`, which Envoy runs on the main thread.
/// Deleted on drop. Once the config is gone a commit is a no-op in Envoy (it holds the config
/// weakly); never commit after the drop: keep it behind a lock that the drop also takes.
#[derive(Debug)]
pub struct ConfigScheduler {
    ptr: ffi::HttpFilterConfigSchedulerModulePtr,
}

// SAFETY: Envoy's config scheduler commit locks a weak pointer and posts to the main
// dispatcher, from any thread. Delete is one call, made once (Drop).
unsafe impl Send for ConfigScheduler {}
// SAFETY: as above; commit takes no module-side state.
unsafe impl Sync for ConfigScheduler {}

impl ConfigScheduler {
    pub fn commit(&self, event_id: u64) {
        // SAFETY: the scheduler is live until Drop.
        unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                self.ptr, event_id,
            )
        }
    }
}

impl Drop for ConfigScheduler {
    fn drop(&mut self) {
        // SAFETY: created by config_scheduler_new, deleted once.
        unsafe { ffi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.ptr) }
    }
}

/// The config as the main thread's config hooks get it: what may only be done there (its
/// callouts, which Envoy keeps in maps no lock guards); this type is neither Send nor Sync,
/// and only those hooks make one.
#[derive(Debug)]
pub struct MainThreadConfig {
    ptr: ffi::HttpFilterConfigEnvoyPtr,
    /// Not Send, not Sync.
    _main_thread_only: std::marker::PhantomData<*const ()>,
}

impl MainThreadConfig {
    /// # Safety
    /// `ptr` must be the live config's Envoy pointer, and the caller on the main thread
    /// inside one of Envoy's config hooks.
    pub unsafe fn from_raw(ptr: ffi::HttpFilterConfigEnvoyPtr) -> MainThreadConfig {
        MainThreadConfig {
            ptr,
            _main_thread_only: std::marker::PhantomData,
        }
    }

    /// Starts a one-shot HTTP request to `cluster` (headers must include `:method`, `:path`
    /// and `host`) that outlives every request: its answer comes to the config's
    /// `on_config_callout_done` with the id returned, or never if the config is destroyed
    /// first. Timeouts count in whole milliseconds.
    pub fn http_callout(
        &self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout: Duration,
    ) -> Result<u64, AbiError> {
        let mut raw = module_headers(headers);
        let mut id: u64 = 0;
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        // SAFETY: everything passed is read during the call; `id` is written by Envoy.
        let result = unsafe {
            ffi::envoy_dynamic_module_callback_http_filter_config_http_callout(
                self.ptr,
                &mut id,
                module_buffer(cluster.as_bytes()),
                raw.as_mut_ptr(),
                raw.len(),
                module_buffer(body),
                timeout_ms,
            )
        };
        started(result, id)
    }
}

// ------------------------------------------------------------------------------------------
// Logging
// ------------------------------------------------------------------------------------------

/// Envoy log levels (`--component-log-level dynamic_modules:<level>` selects them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogLevel {
    Trace,
    Debug,
    Info,
    Warn,
    Error,
    Critical,
}

impl LogLevel {
    fn raw(self) -> ffi::LogLevel {
        match self {
            LogLevel::Trace => ffi::LOG_LEVEL_TRACE,
            LogLevel::Debug => ffi::LOG_LEVEL_DEBUG,
            LogLevel::Info => ffi::LOG_LEVEL_INFO,
            LogLevel::Warn => ffi::LOG_LEVEL_WARN,
            LogLevel::Error => ffi::LOG_LEVEL_ERROR,
            LogLevel::Critical => ffi::LOG_LEVEL_CRITICAL,
        }
    }
}

/// Whether Envoy would print a message at `level` (cheap; skip formatting otherwise).
pub fn log_enabled(level: LogLevel) -> bool {
    // SAFETY: plain query, any thread.
    unsafe { ffi::envoy_dynamic_module_callback_log_enabled(level.raw()) }
}

/// Writes `message` to Envoy's log under `[dynamic_modules]`, from any thread.
pub fn log(level: LogLevel, message: &str) {
    // SAFETY: the message is read during the call.
    unsafe {
        ffi::envoy_dynamic_module_callback_log(level.raw(), module_buffer(message.as_bytes()))
    }
}

/// The `log` crate's macros, into Envoy's log.
struct EnvoyLogger;

impl EnvoyLogger {
    fn level(level: ::log::Level) -> LogLevel {
        match level {
            ::log::Level::Error => LogLevel::Error,
            ::log::Level::Warn => LogLevel::Warn,
            ::log::Level::Info => LogLevel::Info,
            ::log::Level::Debug => LogLevel::Debug,
            ::log::Level::Trace => LogLevel::Trace,
        }
    }
}

impl ::log::Log for EnvoyLogger {
    fn enabled(&self, metadata: &::log::Metadata<'_>) -> bool {
        log_enabled(Self::level(metadata.level()))
    }

    fn log(&self, record: &::log::Record<'_>) {
        let level = Self::level(record.level());
        if log_enabled(level) {
            log(level, &record.args().to_string());
        }
    }

    fn flush(&self) {}
}

static LOGGER: EnvoyLogger = EnvoyLogger;

/// Routes the `log` crate to Envoy (once per process; later calls change nothing).
pub fn install_logger() {
    if ::log::set_logger(&LOGGER).is_ok() {
        ::log::set_max_level(::log::LevelFilter::Trace);
    }
}

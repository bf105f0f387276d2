//! Raw declarations of the part of Envoy's dynamic modules C ABI this module uses.
//!
//! Source: `source/extensions/dynamic_modules/abi/abi.h` in envoyproxy/envoy at commit
//! 0199da4a13cb999df12ad32db7d03942cfbf9abb (`ENVOY_DYNAMIC_MODULES_ABI_VERSION "v0.1.0"`).
//!
//! Why not the v1.40.0 header: Envoy 1.40.0 reports ABI `v0.2.0`, and no copy of the header
//! with that version string could be read here. The header's own rule is that a v0.1.y
//! module is compatible with a v0.2.x Envoy (a mismatch only logs a warning at load). That is
//! not taken on trust: every function declared below was exercised in the Envoy 1.40.0 binary
//! the tests run (see ABI-NOTES.md, "Checked in Envoy 1.40"), since a wrong signature is not
//! refused at load but corrupts memory. Changelog 1.40.0 changes nothing declared here except
//! the *values* of `source.address` (now with its port); it added the attribute
//! `xds.virtual_cluster_name`, whose position in the enum is after every id used here (the
//! ids used were checked to return what their names say).
//!
//! Conventions, as the header has them:
//! - C enums are `int`-sized: they cross as `u32` here, with the values as constants, so a
//!   value Envoy sends that this list does not know is never undefined behaviour.
//! - `bool` is C `_Bool` (one byte), the same as Rust's `bool`.
//! - A buffer struct (`{ptr, length}`) passed by value is two integer registers (SysV), which
//!   `#[repr(C)]` reproduces.
//! - `*_envoy_ptr` point at Envoy objects (Envoy owns them); `*_module_ptr` at the module's.
//!
//! Nothing else belongs in this file: the safe layer is `lib.rs`.

#![allow(dead_code)]

use std::ffi::{c_char, c_void};

// ------------------------------------------------------------------------------------------
// Types
// ------------------------------------------------------------------------------------------

/// `envoy_dynamic_module_type_envoy_buffer`: bytes owned by Envoy.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EnvoyBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

/// `envoy_dynamic_module_type_module_buffer`: bytes owned by the module.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ModuleBuffer {
    pub ptr: *const c_char,
    pub length: usize,
}

/// `envoy_dynamic_module_type_module_http_header`: a header owned by the module.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ModuleHttpHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

/// `envoy_dynamic_module_type_envoy_http_header`: a header owned by Envoy's header map.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EnvoyHttpHeader {
    pub key_ptr: *const c_char,
    pub key_length: usize,
    pub value_ptr: *const c_char,
    pub value_length: usize,
}

/// `envoy_dynamic_module_type_http_filter_config_envoy_ptr` (Envoy's DynamicModuleHttpFilterConfig).
pub type HttpFilterConfigEnvoyPtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_config_module_ptr` (ours).
pub type HttpFilterConfigModulePtr = *const c_void;
/// `envoy_dynamic_module_type_http_filter_per_route_config_module_ptr` (ours).
pub type HttpFilterPerRouteConfigModulePtr = *const c_void;
/// `envoy_dynamic_module_type_http_filter_envoy_ptr` (Envoy's DynamicModuleHttpFilter).
pub type HttpFilterEnvoyPtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_module_ptr` (ours).
pub type HttpFilterModulePtr = *const c_void;
/// `envoy_dynamic_module_type_http_filter_scheduler_module_ptr`: allocated by Envoy, deleted
/// by the module (scheduler_delete).
pub type HttpFilterSchedulerModulePtr = *mut c_void;
/// `envoy_dynamic_module_type_http_filter_config_scheduler_module_ptr`: allocated by Envoy,
/// deleted by the module (config_scheduler_delete).
pub type HttpFilterConfigSchedulerModulePtr = *mut c_void;

/// `envoy_dynamic_module_type_http_header_type`.
pub type HttpHeaderType = u32;
pub const HEADER_TYPE_REQUEST_HEADER: HttpHeaderType = 0;
pub const HEADER_TYPE_REQUEST_TRAILER: HttpHeaderType = 1;
pub const HEADER_TYPE_RESPONSE_HEADER: HttpHeaderType = 2;
pub const HEADER_TYPE_RESPONSE_TRAILER: HttpHeaderType = 3;

/// `envoy_dynamic_module_type_http_body_type`.
pub type HttpBodyType = u32;
pub const BODY_TYPE_RECEIVED_REQUEST_BODY: HttpBodyType = 0;
pub const BODY_TYPE_BUFFERED_REQUEST_BODY: HttpBodyType = 1;
pub const BODY_TYPE_RECEIVED_RESPONSE_BODY: HttpBodyType = 2;
pub const BODY_TYPE_BUFFERED_RESPONSE_BODY: HttpBodyType = 3;

/// `envoy_dynamic_module_type_log_level`.
pub type LogLevel = u32;
pub const LOG_LEVEL_TRACE: LogLevel = 0;
pub const LOG_LEVEL_DEBUG: LogLevel = 1;
pub const LOG_LEVEL_INFO: LogLevel = 2;
pub const LOG_LEVEL_WARN: LogLevel = 3;
pub const LOG_LEVEL_ERROR: LogLevel = 4;
pub const LOG_LEVEL_CRITICAL: LogLevel = 5;
pub const LOG_LEVEL_OFF: LogLevel = 6;

/// `envoy_dynamic_module_type_http_callout_init_result`.
pub type HttpCalloutInitResult = u32;
pub const CALLOUT_INIT_SUCCESS: HttpCalloutInitResult = 0;
pub const CALLOUT_INIT_MISSING_REQUIRED_HEADERS: HttpCalloutInitResult = 1;
pub const CALLOUT_INIT_CLUSTER_NOT_FOUND: HttpCalloutInitResult = 2;
pub const CALLOUT_INIT_DUPLICATE_CALLOUT_ID: HttpCalloutInitResult = 3;
pub const CALLOUT_INIT_CANNOT_CREATE_REQUEST: HttpCalloutInitResult = 4;

/// `envoy_dynamic_module_type_http_callout_result`.
pub type HttpCalloutResult = u32;
pub const CALLOUT_RESULT_SUCCESS: HttpCalloutResult = 0;
pub const CALLOUT_RESULT_RESET: HttpCalloutResult = 1;
pub const CALLOUT_RESULT_EXCEED_RESPONSE_BUFFER_LIMIT: HttpCalloutResult = 2;

/// `envoy_dynamic_module_type_http_stream_reset_reason` (streamed callouts: Envoy 1.40 always
/// passes LocalReset, 2, whatever the cause).
pub type HttpStreamResetReason = u32;

/// `envoy_dynamic_module_type_metrics_result`.
pub type MetricsResult = u32;
pub const METRICS_SUCCESS: MetricsResult = 0;
pub const METRICS_METRIC_NOT_FOUND: MetricsResult = 1;
pub const METRICS_INVALID_LABELS: MetricsResult = 2;
pub const METRICS_FROZEN: MetricsResult = 3;

/// `envoy_dynamic_module_type_attribute_id` (only the ids used; the enum counts from 0 in
/// header order).
pub type AttributeId = u32;
pub const ATTRIBUTE_REQUEST_PATH: AttributeId = 0;
pub const ATTRIBUTE_REQUEST_URL_PATH: AttributeId = 1;
pub const ATTRIBUTE_REQUEST_HOST: AttributeId = 2;
pub const ATTRIBUTE_REQUEST_METHOD: AttributeId = 4;
pub const ATTRIBUTE_REQUEST_ID: AttributeId = 9;
pub const ATTRIBUTE_RESPONSE_CODE: AttributeId = 15;
pub const ATTRIBUTE_RESPONSE_CODE_DETAILS: AttributeId = 16;
pub const ATTRIBUTE_RESPONSE_FLAGS: AttributeId = 17;
pub const ATTRIBUTE_SOURCE_ADDRESS: AttributeId = 24;
pub const ATTRIBUTE_SOURCE_PORT: AttributeId = 25;
pub const ATTRIBUTE_CONNECTION_ID: AttributeId = 28;
pub const ATTRIBUTE_UPSTREAM_REQUEST_ATTEMPT_COUNT: AttributeId = 53;
pub const ATTRIBUTE_XDS_CLUSTER_NAME: AttributeId = 57;
pub const ATTRIBUTE_XDS_ROUTE_NAME: AttributeId = 61;
pub const ATTRIBUTE_XDS_VIRTUAL_HOST_NAME: AttributeId = 63;

/// `envoy_dynamic_module_type_metadata_source`: where `get_metadata_*` look.
pub type MetadataSource = u32;
/// The stream's dynamic metadata.
pub const METADATA_SOURCE_DYNAMIC: MetadataSource = 0;
/// The matched route's `metadata`.
pub const METADATA_SOURCE_ROUTE: MetadataSource = 1;
/// The upstream cluster's `metadata`.
pub const METADATA_SOURCE_CLUSTER: MetadataSource = 2;
/// The upstream host's (LbEndpoint) `metadata`.
pub const METADATA_SOURCE_HOST: MetadataSource = 3;
/// The upstream host's locality (LocalityLbEndpoints) `metadata`.
pub const METADATA_SOURCE_HOST_LOCALITY: MetadataSource = 4;

/// `envoy_dynamic_module_type_on_http_filter_request_headers_status` and
/// `..._response_headers_status` (same values).
pub type HeadersStatus = u32;
pub const HEADERS_CONTINUE: HeadersStatus = 0;
pub const HEADERS_STOP_ITERATION: HeadersStatus = 1;
pub const HEADERS_CONTINUE_AND_DONT_END_STREAM: HeadersStatus = 2;
pub const HEADERS_STOP_ALL_ITERATION_AND_BUFFER: HeadersStatus = 3;
pub const HEADERS_STOP_ALL_ITERATION_AND_WATERMARK: HeadersStatus = 4;

/// `envoy_dynamic_module_type_on_http_filter_request_body_status` and
/// `..._response_body_status` (same values).
pub type BodyStatus = u32;
pub const BODY_CONTINUE: BodyStatus = 0;
pub const BODY_STOP_ITERATION_AND_BUFFER: BodyStatus = 1;
pub const BODY_STOP_ITERATION_AND_WATERMARK: BodyStatus = 2;
pub const BODY_STOP_ITERATION_NO_BUFFER: BodyStatus = 3;

/// `envoy_dynamic_module_type_on_http_filter_request_trailers_status` and
/// `..._response_trailers_status` (same values).
pub type TrailersStatus = u32;
pub const TRAILERS_CONTINUE: TrailersStatus = 0;
pub const TRAILERS_STOP_ITERATION: TrailersStatus = 1;

/// `envoy_dynamic_module_type_on_http_filter_local_reply_status`.
pub type LocalReplyStatus = u32;
pub const LOCAL_REPLY_CONTINUE: LocalReplyStatus = 0;

// ------------------------------------------------------------------------------------------
// Callbacks (Envoy's; exported by the envoy binary)
// ------------------------------------------------------------------------------------------

extern "C" {
    pub fn envoy_dynamic_module_callback_log(level: LogLevel, message: ModuleBuffer);
    pub fn envoy_dynamic_module_callback_log_enabled(level: LogLevel) -> bool;

    // Headers and trailers.
    pub fn envoy_dynamic_module_callback_http_get_header(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
        key: ModuleBuffer,
        result_buffer: *mut EnvoyBuffer,
        index: usize,
        optional_size: *mut usize,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_get_headers_size(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
    ) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_headers(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
        result_headers: *mut EnvoyHttpHeader,
    ) -> bool;
    /// A null `value.ptr` removes the header.
    pub fn envoy_dynamic_module_callback_http_set_header(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_add_header(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        header_type: HttpHeaderType,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;

    // Local replies.
    pub fn envoy_dynamic_module_callback_http_send_response(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        status_code: u32,
        headers_vector: *mut ModuleHttpHeader,
        headers_vector_size: usize,
        body: ModuleBuffer,
        details: ModuleBuffer,
    );
    // A response in parts (headers, data, trailers), which Envoy sends as given: no
    // `sendLocalReply` rewriting (that drops content-type from a reply without a body). In the
    // 1.40 binary each returns at once if the filter is destroyed, and each sets the filter's
    // local-reply flag, so the filter's own encoder hooks are skipped as for `send_response`.
    // `headers_vector` must hold `:status`. Envoy 1.40 reports empty response code details.
    pub fn envoy_dynamic_module_callback_http_send_response_headers(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        headers_vector: *mut ModuleHttpHeader,
        headers_vector_size: usize,
        end_stream: bool,
    );
    pub fn envoy_dynamic_module_callback_http_send_response_data(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        data: ModuleBuffer,
        end_stream: bool,
    );
    pub fn envoy_dynamic_module_callback_http_send_response_trailers(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        trailers_vector: *mut ModuleHttpHeader,
        trailers_vector_size: usize,
    );

    // Bodies.
    pub fn envoy_dynamic_module_callback_http_get_body_size(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        body_type: HttpBodyType,
    ) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_body_chunks_size(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        body_type: HttpBodyType,
    ) -> usize;
    pub fn envoy_dynamic_module_callback_http_get_body_chunks(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        body_type: HttpBodyType,
        result_buffer_vector: *mut EnvoyBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_append_body(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        body_type: HttpBodyType,
        data: ModuleBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_drain_body(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        body_type: HttpBodyType,
        number_of_bytes: usize,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_received_buffered_request_body(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_received_buffered_response_body(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
    ) -> bool;

    // Filter state.
    pub fn envoy_dynamic_module_callback_http_set_filter_state_bytes(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool;

    // Attributes.
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_string(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        attribute_id: AttributeId,
        result: *mut EnvoyBuffer,
    ) -> bool;
    pub fn envoy_dynamic_module_callback_http_filter_get_attribute_int(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        attribute_id: AttributeId,
        result: *mut u64,
    ) -> bool;

    // Metadata. `result` is written only when true is returned: false for metadata not
    // available (no route, no upstream host yet), an absent namespace or key, or a value that
    // is not a string. The bytes are Envoy's, valid until the hook returns (or a metadata
    // setter is called). Six register arguments, `result` on the stack (SysV: each buffer
    // takes two registers).
    pub fn envoy_dynamic_module_callback_http_get_metadata_string(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        metadata_source: MetadataSource,
        ns: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
    ) -> bool;

    // Metrics, defined on the filter config.
    pub fn envoy_dynamic_module_callback_http_filter_config_define_counter(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        counter_id_ptr: *mut usize,
    ) -> MetricsResult;
    pub fn envoy_dynamic_module_callback_http_filter_config_increment_counter(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;
    pub fn envoy_dynamic_module_callback_http_filter_increment_counter(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;
    pub fn envoy_dynamic_module_callback_http_filter_config_define_gauge(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        name: ModuleBuffer,
        label_names: *mut ModuleBuffer,
        label_names_length: usize,
        gauge_id_ptr: *mut usize,
    ) -> MetricsResult;
    pub fn envoy_dynamic_module_callback_http_filter_config_set_gauge(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;
    pub fn envoy_dynamic_module_callback_http_filter_set_gauge(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        id: usize,
        label_values: *mut ModuleBuffer,
        label_values_length: usize,
        value: u64,
    ) -> MetricsResult;

    // Per-filter scheduler.
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_new(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
    ) -> HttpFilterSchedulerModulePtr;
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_commit(
        scheduler_module_ptr: HttpFilterSchedulerModulePtr,
        event_id: u64,
    );
    pub fn envoy_dynamic_module_callback_http_filter_scheduler_delete(
        scheduler_module_ptr: HttpFilterSchedulerModulePtr,
    );

    // Flow.
    pub fn envoy_dynamic_module_callback_http_filter_continue_decoding(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
    );
    pub fn envoy_dynamic_module_callback_http_filter_continue_encoding(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
    );
    pub fn envoy_dynamic_module_callback_http_filter_get_worker_index(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
    ) -> u32;

    // One-shot HTTP callout, per filter.
    pub fn envoy_dynamic_module_callback_http_filter_http_callout(
        filter_envoy_ptr: HttpFilterEnvoyPtr,
        callout_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> HttpCalloutInitResult;

    // Config-level scheduler: commit from any thread, the event runs on the main thread.
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_new(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
    ) -> HttpFilterConfigSchedulerModulePtr;
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
        scheduler_module_ptr: HttpFilterConfigSchedulerModulePtr,
        event_id: u64,
    );
    pub fn envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
        scheduler_module_ptr: HttpFilterConfigSchedulerModulePtr,
    );

    // Config-level one-shot HTTP callout (main thread only, like the config's streams); its
    // answer comes to `on_http_filter_config_http_callout_done`.
    pub fn envoy_dynamic_module_callback_http_filter_config_http_callout(
        filter_config_envoy_ptr: HttpFilterConfigEnvoyPtr,
        callout_id_out: *mut u64,
        cluster_name: ModuleBuffer,
        headers: *mut ModuleHttpHeader,
        headers_size: usize,
        body: ModuleBuffer,
        timeout_milliseconds: u64,
    ) -> HttpCalloutInitResult;
}

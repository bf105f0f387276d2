//! What a hook answers Envoy, and how a callout ended: the ABI's enums as Rust's.

use crate::ffi;

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

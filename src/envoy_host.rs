//! Envoy as core's `Host`: each call maps onto one proxy-wasm ABI call of `host.rs`, and every
//! status becomes a `HostError` the flow decides about.

use idempotency_core::host::{Callout, HeaderPairs, Host, HostError, SetOutcome, SharedData};
use proxy_wasm::types::{BufferType, MapType};

use crate::host::{self, HostStatus};

/// The host the filter runs in; zero-sized, as the ABI knows the current context itself.
pub struct EnvoyHost;

thread_local! {
    /// The clock as first read in the current callback (nanoseconds since the epoch).
    static CALLBACK_NOW: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// A callback from Envoy begins: the clock is read again, at most once, when first needed.
/// Envoy runs one callback of a VM at a time and a callback lasts microseconds, so every
/// decision in it can share one reading (a host call each otherwise: a new key read it
/// three times, a cluster claim nine).
pub fn new_callback() {
    CALLBACK_NOW.with(|now| now.set(None));
}

fn callback_now_nanos() -> u64 {
    CALLBACK_NOW.with(|now| match now.get() {
        Some(nanos) => nanos,
        None => {
            let nanos = host::now_nanos();
            // A refused read (0) is not kept: the next call asks again.
            if nanos != 0 {
                now.set(Some(nanos));
            }
            nanos
        }
    })
}

fn error(status: HostStatus) -> HostError {
    HostError(status.to_string())
}

impl SharedData for EnvoyHost {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        match host::get_shared_data(key) {
            Ok(Some((value, cas))) => Ok(Some((value.unwrap_or_default(), cas))),
            Ok(None) => Ok(None),
            Err(status) => Err(error(status)),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError> {
        match host::set_shared_data(key, value, cas.unwrap_or(0)) {
            Ok(()) => Ok(SetOutcome::Stored),
            Err(HostStatus::CAS_MISMATCH) => Ok(SetOutcome::CasMismatch),
            Err(status) => Err(error(status)),
        }
    }
}

impl Host for EnvoyHost {
    fn now_ms(&self) -> u64 {
        callback_now_nanos() / 1_000_000
    }

    fn now_nanos(&self) -> u64 {
        callback_now_nanos()
    }

    fn request_headers(&self) -> Result<HeaderPairs, HostError> {
        host::get_header_pairs(MapType::HttpRequestHeaders).map_err(error)
    }

    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        host::get_header(MapType::HttpRequestHeaders, name).map_err(error)
    }

    fn request_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        host::get_buffer(BufferType::HttpRequestBody, 0, size)
            .map(Option::unwrap_or_default)
            .map_err(error)
    }

    fn request_trailers(&self) -> Result<HeaderPairs, HostError> {
        host::get_header_pairs(MapType::HttpRequestTrailers).map_err(error)
    }

    fn response_headers(&self) -> Result<HeaderPairs, HostError> {
        host::get_header_pairs(MapType::HttpResponseHeaders).map_err(error)
    }

    fn response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        host::get_buffer(BufferType::HttpResponseBody, 0, size)
            .map(Option::unwrap_or_default)
            .map_err(error)
    }

    fn replace_request_header(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        host::replace_header(MapType::HttpRequestHeaders, name, value).map_err(error)
    }

    fn remove_request_header(&self, name: &str) -> Result<(), HostError> {
        host::remove_header(MapType::HttpRequestHeaders, name).map_err(error)
    }

    fn set_request_body(&self, body: &[u8]) -> Result<(), HostError> {
        host::set_buffer(BufferType::HttpRequestBody, body).map_err(error)
    }

    fn response_trailers(&self) -> Result<HeaderPairs, HostError> {
        host::get_header_pairs(MapType::HttpResponseTrailers).map_err(error)
    }

    fn add_response_header(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        host::add_header(MapType::HttpResponseHeaders, name, value).map_err(error)
    }

    fn add_response_trailer(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        host::add_header(MapType::HttpResponseTrailers, name, value).map_err(error)
    }

    fn replace_response_header(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        host::replace_header(MapType::HttpResponseHeaders, name, value).map_err(error)
    }

    fn remove_response_header(&self, name: &str) -> Result<(), HostError> {
        host::remove_header(MapType::HttpResponseHeaders, name).map_err(error)
    }

    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
        host::get_property(path).map_err(error)
    }

    fn send_local_reply(
        &self,
        status: u16,
        headers: &[(&str, &[u8])],
        body: &[u8],
    ) -> Result<(), HostError> {
        host::send_local_response(u32::from(status), headers, body).map_err(error)
    }

    fn resume_request(&self) -> Result<(), HostError> {
        host::resume_request().map_err(error)
    }

    fn dispatch_callout(&self, callout: &Callout<'_>) -> Result<u32, HostError> {
        host::dispatch_http_call(
            callout.cluster,
            callout.headers.clone(),
            callout.body,
            callout.trailers.clone(),
            std::time::Duration::from_millis(callout.timeout_ms),
        )
        .map_err(error)
    }

    fn callout_response_headers(&self) -> Result<HeaderPairs, HostError> {
        host::get_header_pairs(MapType::HttpCallResponseHeaders).map_err(error)
    }

    fn callout_response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        host::get_buffer(BufferType::HttpCallResponseBody, 0, size)
            .map(Option::unwrap_or_default)
            .map_err(error)
    }

    fn callout_response_trailers(&self) -> Result<HeaderPairs, HostError> {
        host::get_header_pairs(MapType::HttpCallResponseTrailers).map_err(error)
    }

    fn open_grpc_stream(
        &self,
        cluster: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
    ) -> Result<u32, HostError> {
        host::open_grpc_stream(cluster, service, method, metadata).map_err(error)
    }

    fn send_grpc_message(&self, stream: u32, message: &[u8]) -> Result<(), HostError> {
        host::send_grpc_message(stream, message).map_err(error)
    }

    fn close_grpc_stream(&self, stream: u32, reset: bool) -> Result<(), HostError> {
        host::close_grpc_stream(stream, reset).map_err(error)
    }

    fn grpc_initial_metadata(&self) -> Result<HeaderPairs, HostError> {
        host::get_header_pairs(MapType::GrpcReceiveInitialMetadata).map_err(error)
    }

    fn grpc_message(&self, size: usize) -> Result<Vec<u8>, HostError> {
        host::get_buffer(BufferType::GrpcReceiveBuffer, 0, size)
            .map(Option::unwrap_or_default)
            .map_err(error)
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError> {
        host::set_effective_context(context_id).map_err(error)
    }

    fn define_counter(&self, name: &str) -> Result<u32, HostError> {
        host::define_counter(name).map_err(error)
    }

    fn publish(&self, name: &str, value: &[u8]) {
        // Refused outside a request (NotFound) or for a read-only name; the log line just
        // lacks the value then.
        if let Err(status) = host::set_property(&[name], value) {
            log::debug!("{name} not published for the access log: {status}");
        }
    }

    fn increment_counter(&self, id: u32) {
        host::increment_counter(id);
    }

    fn define_gauge(&self, name: &str) -> Result<u32, HostError> {
        host::define_gauge(name).map_err(error)
    }

    fn set_gauge(&self, id: u32, value: u64) {
        host::set_gauge(id, value);
    }

    fn register_queue(&self, name: &str) -> Result<u32, HostError> {
        host::register_shared_queue(name).map_err(error)
    }

    fn enqueue(&self, queue: u32, value: &[u8]) -> Result<(), HostError> {
        host::enqueue_shared_queue(queue, value).map_err(error)
    }

    fn dequeue(&self, queue: u32) -> Result<Option<Vec<u8>>, HostError> {
        host::dequeue_shared_queue(queue).map_err(error)
    }

    fn plugin_configuration(&self) -> Result<Vec<u8>, HostError> {
        host::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .map(Option::unwrap_or_default)
            .map_err(error)
    }

    fn set_tick_period_ms(&self, period_ms: u32) -> Result<(), HostError> {
        host::set_tick_period(std::time::Duration::from_millis(u64::from(period_ms))).map_err(error)
    }

    fn done(&self) -> Result<(), HostError> {
        host::done().map_err(error)
    }
}

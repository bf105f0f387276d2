//! HTTP callouts to the shared store: sending a protocol request to the configured cluster,
//! and reading whatever came back (a reset or timeout arrives with no headers at all).

use std::time::Duration;

use idempotency_core::config::StoreConfig;
use idempotency_core::store_client::MAX_STORE_ANSWER_BYTES;
use proxy_wasm::types::{BufferType, MapType};

use crate::host::{self, HostStatus};

/// The protocol operation, which is also its path under the store's prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOp {
    Claim,
    Complete,
    Release,
}

impl StoreOp {
    fn path(self) -> &'static str {
        match self {
            StoreOp::Claim => "/claim",
            StoreOp::Complete => "/complete",
            StoreOp::Release => "/release",
        }
    }
}

/// Sends `body` to the store; the answer arrives in the calling context's
/// `on_http_call_response` with the returned token.
pub fn send(store: &StoreConfig, op: StoreOp, body: &[u8]) -> Result<u32, HostStatus> {
    let path = format!("{}{}", store.path_prefix, op.path());
    let authorization = store.token.as_ref().map(|t| format!("Bearer {t}"));
    let mut headers = vec![
        (":method", "POST"),
        (":path", path.as_str()),
        (":authority", store.authority.as_str()),
        ("content-type", "application/json"),
    ];
    if let Some(a) = authorization.as_deref() {
        headers.push(("authorization", a));
    }
    host::dispatch_http_call(
        &store.cluster,
        headers,
        body,
        Duration::from_millis(store.timeout_ms),
    )
}

/// The status (None for a reset, timeout or unreadable answer) and body of a call's answer.
pub fn read_answer(num_headers: usize, body_size: usize) -> (Option<u16>, Vec<u8>) {
    if num_headers == 0 {
        return (None, Vec::new());
    }
    let status = host::get_header_pairs(MapType::HttpCallResponseHeaders)
        .ok()
        .and_then(|headers| host::status_of(&headers));
    if body_size > MAX_STORE_ANSWER_BYTES {
        return (status, Vec::new());
    }
    let body = host::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
        .ok()
        .flatten()
        .unwrap_or_default();
    (status, body)
}

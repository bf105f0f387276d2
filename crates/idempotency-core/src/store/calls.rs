//! Callouts to the shared store: the request for a protocol operation, and whatever came
//! back (a reset or timeout arrives with no headers at all).

use idempotency_protocol::wire::path;

use crate::config::StoreConfig;
use crate::host::{status_of, Callout, Host, HostError};
use crate::store::client::MAX_STORE_ANSWER_BYTES;

/// The protocol operation, which is also its path under the store's prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOp {
    Claim,
    Complete,
    Release,
    Renew,
    Settle,
    /// A caller's lookup route asking what a key holds.
    Lookup,
}

impl StoreOp {
    fn path(self) -> &'static str {
        match self {
            StoreOp::Claim => path::CLAIM,
            StoreOp::Complete => path::COMPLETE,
            StoreOp::Release => path::RELEASE,
            StoreOp::Renew => path::RENEW,
            StoreOp::Settle => path::SETTLE,
            StoreOp::Lookup => path::LOOKUP,
        }
    }
}

/// The path of `op` under the store's HTTP API.
pub fn path(store: &StoreConfig, op: StoreOp) -> String {
    format!("{}{}", store.path_prefix, op.path())
}

/// Sends `body` to the store; the answer arrives in the calling context with the returned
/// token.
pub fn send(
    host: &impl Host,
    store: &StoreConfig,
    op: StoreOp,
    body: &[u8],
) -> Result<u32, HostError> {
    let path = path(store, op);
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
    host.dispatch_callout(&Callout {
        cluster: &store.cluster,
        headers,
        body,
        trailers: Vec::new(),
        // A zero timeout means "none" to the host: never send one.
        timeout_ms: store.timeout_ms.max(1),
    })
}

/// A store callout's answer: its status (None for a reset, timeout or unreadable answer) and
/// body (empty when larger than any answer the protocol sends).
pub struct StoreAnswer {
    pub status: Option<u16>,
    pub body: Vec<u8>,
}

pub fn read_answer(host: &impl Host, num_headers: usize, body_size: usize) -> StoreAnswer {
    if num_headers == 0 {
        return StoreAnswer {
            status: None,
            body: Vec::new(),
        };
    }
    let status = host
        .callout_response_headers()
        .ok()
        .and_then(|headers| status_of(&headers));
    let body = if body_size > MAX_STORE_ANSWER_BYTES {
        Vec::new()
    } else {
        host.callout_response_body(body_size).unwrap_or_default()
    };
    StoreAnswer { status, body }
}

//! The native job floor: crates/job-floor-filter's steps as an Envoy dynamic module, over the
//! same bindings as the native filter (crates/dynamic-module-abi), so that `make bench` can
//! hold the native build to what its job costs natively. A benchmark tool, not a product:
//! it keeps no guarantee beyond the steps below. Per request it:
//!
//! 1. reads the request headers in one call (key, method, path, authority, authorization);
//! 2. waits for the whole body; hashes method, path, scope (authority and authorization) and
//!    key into the key's digest, and the body into its fingerprint (SHA-256 both); reads the
//!    clock once; increments one counter;
//! 3. looks the digest up in the process's map (`records.rs`, shared by every worker): a
//!    recorded response is answered as a local reply with its status, headers and body plus
//!    `idempotent-replayed: true` (or 422 when the fingerprint differs, 409 while the first
//!    is in flight); no record: claims the digest and lets the request on;
//! 4. on the response, reads its headers in one call and its body once it is whole, and
//!    records status, headers and body under the digest.
//!
//! Left out on purpose, as in the Wasm floor: rules and configuration (every request with a
//! key is protected), key validation, eviction and bounded memory (one entry per key,
//! forever), leases and their renewal, expiry, telling who answered, access-log fields, wait
//! mode, gRPC. The idempotency filter must do those too; they are what it may spend beyond
//! this floor.

mod records;

use std::time::SystemTime;

use dynamic_module_abi::{
    dynamic_module, BodyStatus, ConfigHandle, CounterId, FactoryBuilder, Filter, FilterFactory,
    HeaderMap, HeadersStatus, HttpFilter, Module,
};
use sha2::{Digest, Sha256};

use records::{Lookup, Recorded, Records};

const KEY_HEADER: &str = "idempotency-key";
const REPLAY_MARKER: (&str, &[u8]) = ("idempotent-replayed", b"true");

static FACTORY_BUILDER: FactoryBuilder = build_factory;

dynamic_module!(Module {
    name: "idempotency_native_job_floor",
    factory_builder: FACTORY_BUILDER,
});

/// Any configuration: the floor takes none. Its one counter is defined here, as Envoy
/// refuses definitions after the config is made.
fn build_factory(
    _name: &str,
    _config: &[u8],
    handle: ConfigHandle,
) -> Result<Box<dyn FilterFactory>, String> {
    let requests = handle
        .define_counter("job_floor.requests")
        .map_err(|e| e.to_string())?;
    Ok(Box::new(FloorFactory { requests }))
}

struct FloorFactory {
    requests: CounterId,
}

impl FilterFactory for FloorFactory {
    fn new_filter(&self, _filter: &Filter) -> Option<Box<dyn HttpFilter>> {
        Some(Box::new(FloorRequest {
            requests: self.requests,
            identity: None,
            claimed: None,
            status: 0,
            response_headers: Vec::new(),
        }))
    }
}

struct FloorRequest {
    requests: CounterId,
    /// The key's hash input so far, from the headers, while the body is awaited.
    identity: Option<Sha256>,
    /// The digest this request claimed and its fingerprint: its response is recorded there.
    claimed: Option<([u8; 32], [u8; 32])>,
    status: u16,
    response_headers: Vec<(String, Vec<u8>)>,
}

fn problem(filter: &Filter, status: u16, kind: &str) {
    let body = format!("{{\"type\":\"{kind}\"}}");
    filter.send_response(
        status,
        &[("content-type", b"application/problem+json")],
        body.as_bytes(),
    );
}

impl FloorRequest {
    /// The body is whole: hash, look up, replay or claim. True when the request goes on.
    fn decide(&mut self, filter: &Filter, body: &[u8]) -> bool {
        let Some(identity) = self.identity.take() else {
            return true;
        };
        let digest: [u8; 32] = identity.finalize().into();
        let fingerprint: [u8; 32] = Sha256::digest(body).into();
        let _now = SystemTime::now();
        let _ = filter.increment_counter(self.requests, 1);
        match Records::process().claim(digest, fingerprint) {
            Lookup::Claimed => {
                self.claimed = Some((digest, fingerprint));
                true
            }
            Lookup::Mismatch => {
                problem(filter, 422, "key-reused");
                false
            }
            Lookup::InFlight => {
                problem(filter, 409, "request-in-flight");
                false
            }
            Lookup::Recorded(recorded) => {
                let mut headers: Vec<(&str, &[u8])> = recorded
                    .headers
                    .iter()
                    .map(|(name, value)| (name.as_str(), value.as_slice()))
                    .collect();
                headers.push(REPLAY_MARKER);
                filter.send_response(recorded.status, &headers, &recorded.body);
                false
            }
        }
    }

    fn record(&mut self, body: Vec<u8>) {
        if let Some((digest, fingerprint)) = self.claimed.take() {
            let recorded = Recorded {
                status: self.status,
                headers: std::mem::take(&mut self.response_headers),
                body,
            };
            Records::process().record(digest, fingerprint, recorded);
        }
    }
}

impl HttpFilter for FloorRequest {
    fn on_request_headers(&mut self, filter: &Filter, end_of_stream: bool) -> HeadersStatus {
        let headers = filter.headers(HeaderMap::RequestHeaders);
        let find = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_slice())
        };
        let Some(key) = find(KEY_HEADER) else {
            return HeadersStatus::Continue;
        };
        let mut identity = Sha256::new();
        for part in [
            find(":method"),
            find(":path"),
            find(":authority"),
            find("authorization"),
            Some(key),
        ] {
            let part = part.unwrap_or_default();
            identity.update(u32::try_from(part.len()).unwrap_or(u32::MAX).to_le_bytes());
            identity.update(part);
        }
        self.identity = Some(identity);
        if !end_of_stream {
            return HeadersStatus::StopIteration;
        }
        if self.decide(filter, &[]) {
            HeadersStatus::Continue
        } else {
            HeadersStatus::StopIteration
        }
    }

    fn on_request_body(&mut self, filter: &Filter, end_of_stream: bool) -> BodyStatus {
        if self.identity.is_none() {
            return BodyStatus::Continue;
        }
        if !end_of_stream {
            return BodyStatus::StopIterationAndBuffer;
        }
        let body = filter.request_body().unwrap_or_default();
        if self.decide(filter, &body) {
            BodyStatus::Continue
        } else {
            BodyStatus::StopIterationNoBuffer
        }
    }

    fn on_response_headers(&mut self, filter: &Filter, end_of_stream: bool) -> HeadersStatus {
        if self.claimed.is_none() {
            return HeadersStatus::Continue; // a replay or a refusal of this filter's
        }
        let mut kept = Vec::new();
        for (name, value) in filter.headers(HeaderMap::ResponseHeaders) {
            if name == ":status" {
                self.status = std::str::from_utf8(&value)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
            } else if !name.starts_with(':') {
                kept.push((name, value));
            }
        }
        self.response_headers = kept;
        if end_of_stream {
            self.record(Vec::new());
        }
        HeadersStatus::Continue
    }

    fn on_response_body(&mut self, filter: &Filter, end_of_stream: bool) -> BodyStatus {
        if self.claimed.is_none() {
            return BodyStatus::Continue;
        }
        if !end_of_stream {
            return BodyStatus::StopIterationAndBuffer; // buffered until the body is whole
        }
        let body = filter.response_body().unwrap_or_default();
        self.record(body);
        BodyStatus::Continue
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests;

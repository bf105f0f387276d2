//! The job floor: a proxy-wasm filter that does every step an idempotency filter must do for
//! a request, and nothing more, so that `make bench` can hold the idempotency filter to what
//! its job costs in proxy-wasm rather than only to a filter that does nothing (the no-op
//! filter). Per request it:
//!
//! 1. reads the request headers in one call (key, method, path, authority, authorization);
//! 2. waits for the whole body; hashes method, path, scope (authority and authorization) and
//!    key into the key's digest, and the body into its fingerprint (SHA-256 both); reads the
//!    clock once; increments one counter;
//! 3. looks the digest up in shared data: a stored record is answered as a local reply with
//!    its recorded status, headers and body plus `idempotent-replayed: true` (or 422 when the
//!    fingerprint differs, 409 while the first is in flight); no record: claims the digest
//!    with a compare-and-swap and lets the request on;
//! 4. on the response, reads its headers in one call and its body once it is whole, and
//!    writes status, headers and body back to shared data under the digest.
//!
//! What it leaves out, on purpose: rules and configuration (every request with a key is
//! protected), key validation, eviction and bounded memory (one shared-data entry per key,
//! forever), leases and their renewal, expiry, telling who answered (every response is
//! recorded), access-log fields, cluster mode, wait mode, gRPC. The idempotency filter must do
//! those too; they are what it may spend beyond this floor.

use idempotency_protocol::digest::to_hex;
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, MetricType};
use sha2::{Digest, Sha256};

proxy_wasm::main! {{
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(FloorRoot { requests: None }) });
}}

const KEY_HEADER: &str = "idempotency-key";
const REPLAY_MARKER: (&str, &str) = ("idempotent-replayed", "true");
/// A claim's value: the request's fingerprint behind this tag, no response yet.
const IN_FLIGHT: u8 = 0;
const RECORDED: u8 = 1;

struct FloorRoot {
    requests: Option<u32>,
}

impl Context for FloorRoot {}

impl RootContext for FloorRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        // From the root: Envoy refuses metric definitions at the module's start.
        self.requests = hostcalls::define_metric(MetricType::Counter, "job_floor.requests").ok();
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(FloorRequest {
            counter: self.requests,
            request: None,
            claimed: None,
            status: None,
            response_headers: Vec::new(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// What the headers gave: the key's hash input so far.
struct Incoming {
    identity: Sha256,
}

struct FloorRequest {
    counter: Option<u32>,
    request: Option<Incoming>,
    /// The shared-data key this request claimed, and its fingerprint: its response is
    /// recorded there.
    claimed: Option<(String, [u8; 32])>,
    status: Option<u16>,
    response_headers: Vec<(String, String)>,
}

impl Context for FloorRequest {}

fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// A recorded response: tag, fingerprint, status, header count, headers, body.
fn encode(
    fingerprint: &[u8; 32],
    status: u16,
    headers: &[(String, String)],
    body: &[u8],
) -> Vec<u8> {
    let size = headers
        .iter()
        .map(|(n, v)| n.len() + v.len() + 8)
        .sum::<usize>()
        + body.len()
        + 48;
    let mut out = Vec::with_capacity(size);
    out.push(RECORDED);
    out.extend_from_slice(fingerprint);
    out.extend_from_slice(&status.to_le_bytes());
    out.extend_from_slice(&u32::try_from(headers.len()).unwrap_or(0).to_le_bytes());
    for (name, value) in headers {
        put(&mut out, name.as_bytes());
        put(&mut out, value.as_bytes());
    }
    put(&mut out, body);
    out
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, self.0.get(n..)?);
        self.0 = rest;
        Some(head)
    }
    fn u32(&mut self) -> Option<usize> {
        let bytes: [u8; 4] = self.take(4)?.try_into().ok()?;
        usize::try_from(u32::from_le_bytes(bytes)).ok()
    }
    fn field(&mut self) -> Option<&'a str> {
        let n = self.u32()?;
        std::str::from_utf8(self.take(n)?).ok()
    }
}

type Recorded<'a> = (u16, Vec<(&'a str, &'a str)>, &'a [u8]);

/// A record's response; None for a claim still in flight or bytes that do not parse.
fn decode(record: &[u8]) -> Option<Recorded<'_>> {
    let mut r = Reader(record.get(33..)?);
    let status = u16::from_le_bytes(r.take(2)?.try_into().ok()?);
    let count = r.u32()?;
    let mut headers = Vec::with_capacity(count.min(64) + 1);
    for _ in 0..count {
        headers.push((r.field()?, r.field()?));
    }
    let n = r.u32()?;
    Some((status, headers, r.take(n)?))
}

impl FloorRequest {
    fn answer(status: u32, body: &str) -> Action {
        let _ = hostcalls::send_http_response(
            status,
            vec![("content-type", "application/problem+json")],
            Some(body.as_bytes()),
        );
        Action::Pause
    }

    /// The body is whole: hash, look up, replay or claim.
    fn decide(&mut self, body_size: usize) -> Action {
        let Some(Incoming { identity }) = self.request.take() else {
            return Action::Continue;
        };
        let body =
            hostcalls::get_buffer(proxy_wasm::types::BufferType::HttpRequestBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default();
        let digest = identity.finalize();
        let fingerprint: [u8; 32] = Sha256::digest(&body).into();
        let _now = hostcalls::get_current_time();
        if let Some(counter) = self.counter {
            let _ = hostcalls::increment_metric(counter, 1);
        }
        let digest: [u8; 32] = digest.into();
        let key = to_hex(&digest);
        let (value, cas) = hostcalls::get_shared_data(&key).unwrap_or((None, None));
        match value.as_deref() {
            Some(record) if !record.is_empty() => {
                if record.get(1..33) != Some(&fingerprint[..]) {
                    return Self::answer(422, "{\"type\":\"key-reused\"}");
                }
                if record.first() == Some(&IN_FLIGHT) {
                    return Self::answer(409, "{\"type\":\"request-in-flight\"}");
                }
                let Some((status, mut headers, body)) = decode(record) else {
                    return Self::answer(503, "{\"type\":\"unreadable\"}");
                };
                headers.push(REPLAY_MARKER);
                let _ = hostcalls::send_http_response(u32::from(status), headers, Some(body));
                Action::Pause
            }
            _ => {
                let mut claim = Vec::with_capacity(33);
                claim.push(IN_FLIGHT);
                claim.extend_from_slice(&fingerprint);
                match hostcalls::set_shared_data(&key, Some(&claim), cas.or(Some(0))) {
                    Ok(()) => {
                        self.claimed = Some((key, fingerprint));
                        Action::Continue
                    }
                    Err(_) => Self::answer(409, "{\"type\":\"request-in-flight\"}"),
                }
            }
        }
    }
}

impl HttpContext for FloorRequest {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let headers =
            hostcalls::get_map(proxy_wasm::types::MapType::HttpRequestHeaders).unwrap_or_default();
        let find = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        let Some(key) = find(KEY_HEADER) else {
            return Action::Continue;
        };
        let mut identity = Sha256::new();
        for part in [
            find(":method"),
            find(":path"),
            find(":authority"),
            find("authorization"),
            Some(key),
        ] {
            let part = part.unwrap_or("");
            identity.update((part.len() as u32).to_le_bytes());
            identity.update(part.as_bytes());
        }
        self.request = Some(Incoming { identity });
        if end_of_stream {
            return self.decide(0);
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.request.is_none() {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.decide(body_size)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.claimed.is_none() {
            return Action::Continue; // a replay or a refusal of this filter's: not recorded
        }
        let headers =
            hostcalls::get_map(proxy_wasm::types::MapType::HttpResponseHeaders).unwrap_or_default();
        let mut kept = Vec::with_capacity(headers.len());
        for (name, value) in headers {
            if name == ":status" {
                self.status = value.parse().ok();
            } else if !name.starts_with(':') {
                kept.push((name, value));
            }
        }
        self.response_headers = kept;
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.claimed.is_none() {
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause; // buffered until the body is whole
        }
        let Some((key, fingerprint)) = self.claimed.take() else {
            return Action::Continue;
        };
        let body = hostcalls::get_buffer(
            proxy_wasm::types::BufferType::HttpResponseBody,
            0,
            body_size,
        )
        .ok()
        .flatten()
        .unwrap_or_default();
        let record = encode(
            &fingerprint,
            self.status.unwrap_or(0),
            &self.response_headers,
            &body,
        );
        let _ = hostcalls::set_shared_data(&key, Some(&record), None);
        Action::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::{decode, encode};

    #[test]
    fn a_record_reads_back_as_written() {
        let headers = vec![("content-type".to_string(), "application/json".to_string())];
        let record = encode(&[7; 32], 201, &headers, b"{\"id\":1}");
        let (status, read, body) = decode(&record).unwrap();
        assert_eq!(status, 201);
        assert_eq!(read, vec![("content-type", "application/json")]);
        assert_eq!(body, b"{\"id\":1}");
        assert!(decode(&record[..record.len() - 1]).is_none(), "cut short");
    }
}

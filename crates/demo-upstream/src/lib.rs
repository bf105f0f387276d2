//! A counting HTTP/1.1 upstream for the idempotency filter's end-to-end tests.
//!
//! Every ordinary request is an "execution": it is counted per request path
//! (without the query) and globally, and the answer carries the count, so a
//! test can tell a replayed response (same bytes) from a second execution.
//! Request headers choose the answer, so tests can provoke every case:
//!
//! | request header          | effect                                                          |
//! |-------------------------|-----------------------------------------------------------------|
//! | `x-demo-status: N`      | answer with status N (200..=599, default 201)                   |
//! | `x-demo-delay-ms: N`    | sleep N ms (at most 30000) after counting, before answering     |
//! | `x-demo-body-bytes: N`  | answer with exactly N bytes of a printable pattern (≤ 16 MiB)   |
//! | `x-demo-header: k=v`    | add response header `k: v` (repeatable; replaces a default `k`) |
//! | `x-demo-signed: N`      | act as a signed endpoint (webhook, payment callback), see below |
//! | `x-demo-reset: 1`       | close the connection without an answer, after counting (and any delay): an upstream that did the write and crashed |
//! | `x-demo-echo: 1`        | add `"headers"` to the JSON answer: every request header it received, by name (repeated ones joined with `, `) |
//!
//! A signed endpoint executes only a request whose `x-demo-signature` is
//! `sha256=<hex HMAC-SHA256 of the body under DEMO_SIGNING_KEY>`, as webhook
//! senders sign; a missing or wrong signature gets status N (400..=499: senders'
//! receivers answer 400, 401 or 403) and is not counted, so a test can send a
//! forged delivery and then the genuine one.
//!
//! An invalid control header gets `400` and is not counted. The execution is
//! counted once the request body has been read, before any delay, so a test
//! can see a request that is still in flight.
//!
//! Endpoints that are never counted as executions: `GET /healthz`, `GET /__count[?path=P]`,
//! `POST /__reset`, `POST /__fail-lookups?n=N`, and lookups (`/__count?path=P` counts those
//! of path P apart, as `lookups`). In fast mode every request gets `200 ok` at once.
//!
//! **Lookups**, as a payment service offers them: a write that carried an `Idempotency-Key`
//! and succeeded (2xx, answered or not: `x-demo-reset` after the write counts) is kept by
//! that key, once it has finished (after its delay), with the caller's `authorization`.
//! `GET <anything>/by-key/<key>` answers it (`200`, the write's own body and content type)
//! to the same caller, and `404` for a key it has not finished, has never seen, or that
//! another caller wrote. `POST /__fail-lookups?n=N` makes the next N lookups answer `503`.
//!
//! **Normalised paths** (`Options::normalize_paths`, `--normalize-paths`): a `GET` or `HEAD`
//! path is rewritten before it is routed, as nginx, Envoy's `normalize_path` with unescaped
//! slashes, Istio's `DECODE_AND_MERGE_SLASHES` and many web frameworks do: percent-decoded
//! (`%2F` and `%2e` included), `\` read as `/`, slashes merged, `.` and `..` segments
//! removed. A path that is then not `<anything>/by-key/<one segment>` has no route (`404`,
//! not counted): `/payments/by-key/..` is `/payments/`, and finds nothing.
//!
//! [`grpc_echo`] is another mode: an instant store for the benchmark's coordination floor.

pub mod grpc_echo;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Incoming};
use hyper::header::{
    HeaderMap, HeaderName, HeaderValue, AUTHORIZATION, CACHE_CONTROL, CONNECTION, CONTENT_LENGTH,
    CONTENT_TYPE, SET_COOKIE, TRANSFER_ENCODING,
};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;

/// Largest accepted `x-demo-delay-ms`.
pub const MAX_DELAY_MS: u64 = 30_000;
/// Largest accepted `x-demo-body-bytes` (16 MiB).
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;
/// Status of an ordinary execution when `x-demo-status` is absent.
pub const DEFAULT_STATUS: StatusCode = StatusCode::CREATED;

/// The pattern a `x-demo-body-bytes` body repeats (64 printable bytes).
pub const BODY_PATTERN: &[u8; 64] =
    b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-\n";

const X_DEMO_STATUS: HeaderName = HeaderName::from_static("x-demo-status");
const X_DEMO_DELAY_MS: HeaderName = HeaderName::from_static("x-demo-delay-ms");
const X_DEMO_BODY_BYTES: HeaderName = HeaderName::from_static("x-demo-body-bytes");
const X_DEMO_HEADER: HeaderName = HeaderName::from_static("x-demo-header");
const X_DEMO_SIGNED: HeaderName = HeaderName::from_static("x-demo-signed");
const X_DEMO_SIGNATURE: HeaderName = HeaderName::from_static("x-demo-signature");
const X_DEMO_RESET: HeaderName = HeaderName::from_static("x-demo-reset");
const X_DEMO_ECHO: HeaderName = HeaderName::from_static("x-demo-echo");

/// Marks a response that must not be sent: the connection is closed instead (`x-demo-reset`).
#[derive(Debug, Clone, Copy)]
pub struct CloseWithoutAnswer;

/// The key signed endpoints verify with. Public on purpose: this is a test upstream.
pub const DEMO_SIGNING_KEY: &[u8] = b"demo-signing-key";
const X_EXECUTION: HeaderName = HeaderName::from_static("x-execution");
const X_DEMO_UPSTREAM: HeaderName = HeaderName::from_static("x-demo-upstream");

/// The response body type of every answer.
pub type ResponseBody = Full<Bytes>;

/// How the server answers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Options {
    /// Answer every request with `200 ok` at once, counting nothing.
    pub fast: bool,
    /// Normalise a `GET` or `HEAD` path before routing it (see "Normalised paths").
    pub normalize_paths: bool,
}

/// Execution counters, per request path and in total, and the writes kept for lookups.
#[derive(Debug, Default)]
pub struct Counters {
    per_path: Mutex<HashMap<String, u64>>,
    total: AtomicU64,
    /// Finished writes by their idempotency key (see "Lookups" above).
    ledger: Mutex<HashMap<Vec<u8>, Written>>,
    /// Lookups still to fail with 503 (`/__fail-lookups`).
    failing_lookups: AtomicU64,
    /// Lookups answered, failed ones included, per request path.
    lookups: Mutex<HashMap<String, u64>>,
}

/// A finished write, as a lookup answers it.
#[derive(Debug, Clone)]
struct Written {
    authorization: Option<HeaderValue>,
    content_type: Option<HeaderValue>,
    body: Bytes,
    execution: u64,
}

impl Counters {
    /// Counts one execution of `path` and returns the new count for that path.
    pub fn record(&self, path: &str) -> u64 {
        let mut map = self.lock();
        self.total.fetch_add(1, Ordering::Relaxed);
        if let Some(n) = map.get_mut(path) {
            *n = n.saturating_add(1);
            *n
        } else {
            map.insert(path.to_owned(), 1);
            1
        }
    }

    /// Executions of `path` so far.
    pub fn executions(&self, path: &str) -> u64 {
        self.lock().get(path).copied().unwrap_or(0)
    }

    /// Lookups of `path` so far.
    pub fn lookups(&self, path: &str) -> u64 {
        self.lookups_per_path().get(path).copied().unwrap_or(0)
    }

    fn lookups_per_path(&self) -> MutexGuard<'_, HashMap<String, u64>> {
        self.lookups.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Executions of all paths so far.
    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Forgets every count and every write kept for lookups.
    pub fn reset(&self) {
        let mut map = self.lock();
        map.clear();
        self.total.store(0, Ordering::Relaxed);
        self.ledger().clear();
        self.failing_lookups.store(0, Ordering::Relaxed);
        self.lookups_per_path().clear();
    }

    fn ledger(&self) -> MutexGuard<'_, HashMap<Vec<u8>, Written>> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes one of the lookups `/__fail-lookups` asked to fail; false when none is left.
    fn fail_a_lookup(&self) -> bool {
        self.failing_lookups
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, u64>> {
        // A panic cannot happen while the lock is held, but a poisoned map is
        // still a valid map, so keep serving rather than fail.
        self.per_path.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The next connection, with Nagle off (small responses should not wait for it); accept
/// errors (typically EMFILE under load) back off briefly instead of spinning.
pub async fn accept(listener: &TcpListener) -> tokio::net::TcpStream {
    loop {
        match listener.accept().await {
            Ok((stream, _peer)) => {
                let _ = stream.set_nodelay(true);
                return stream;
            }
            Err(err) => {
                eprintln!("demo-upstream: accept failed: {err}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// Accepts connections on `listener` forever, serving each on its own task
/// with HTTP/1.1 keep-alive.
pub async fn serve(listener: TcpListener, options: Options, counters: Arc<Counters>) {
    loop {
        let stream = accept(&listener).await;
        let counters = Arc::clone(&counters);
        tokio::spawn(async move {
            let service = service_fn(move |req: Request<Incoming>| {
                let counters = Arc::clone(&counters);
                async move {
                    let resp = handle(req, options, &counters).await;
                    if resp.extensions().get::<CloseWithoutAnswer>().is_some() {
                        // An error from the service makes hyper drop the connection unanswered.
                        return Err(std::io::Error::other("x-demo-reset"));
                    }
                    Ok(resp)
                }
            });
            // Errors here are the client going away mid-exchange: nothing to do.
            let _ = http1::Builder::new()
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Answers one request.
pub async fn handle<B>(
    req: Request<B>,
    options: Options,
    counters: &Arc<Counters>,
) -> Response<ResponseBody>
where
    B: Body<Data = Bytes>,
{
    let (parts, body) = req.into_parts();
    if options.fast {
        drain(body).await;
        return plain(StatusCode::OK, Bytes::from_static(b"ok"));
    }
    let path = parts.uri.path();
    if path == "/healthz" {
        drain(body).await;
        return plain(StatusCode::OK, Bytes::from_static(b"ok"));
    }
    if path.starts_with("/__") {
        drain(body).await;
        return control(&parts.method, path, parts.uri.query(), counters);
    }
    let caller = parts.headers.get(AUTHORIZATION);
    if (parts.method == Method::GET || parts.method == Method::HEAD) && options.normalize_paths {
        drain(body).await;
        let Some(normalized) = normalized_path(path) else {
            return json(
                StatusCode::BAD_REQUEST,
                error_json("the path is not percent-encoded UTF-8"),
            );
        };
        return match normalized.split_once("/by-key/") {
            Some((_, key)) if !key.is_empty() && !key.contains('/') => {
                lookup(key, caller, counters)
            }
            _ => json(StatusCode::NOT_FOUND, error_json("no route for this path")),
        };
    }
    if parts.method == Method::GET || parts.method == Method::HEAD {
        if let Some((_, key)) = path.split_once("/by-key/") {
            drain(body).await;
            *counters
                .lookups_per_path()
                .entry(path.to_owned())
                .or_insert(0) += 1;
            let Some(key) = percent_decode(key) else {
                return json(
                    StatusCode::BAD_REQUEST,
                    error_json("the key is not percent-encoded UTF-8"),
                );
            };
            return lookup(&key, caller, counters);
        }
    }

    let spec = match ResponseSpec::from_headers(&parts.headers) {
        Ok(spec) => spec,
        Err(message) => {
            drain(body).await;
            return json(StatusCode::BAD_REQUEST, error_json(message));
        }
    };
    let mut mac = spec
        .signed
        .map(|refusal| (refusal, HmacSha256::new(DEMO_SIGNING_KEY)));
    let Some((body_bytes, digest)) = hash_body(body, mac.as_mut().map(|(_, m)| m)).await else {
        return json(
            StatusCode::BAD_REQUEST,
            error_json("request body could not be read"),
        );
    };
    if let Some((refusal, mac)) = mac {
        let expected = format!("sha256={}", hex(&mac.finish()));
        let given = parts
            .headers
            .get(X_DEMO_SIGNATURE)
            .map_or(&b""[..], HeaderValue::as_bytes);
        if !constant_time_eq(given.trim_ascii(), expected.as_bytes()) {
            // Refused before counting: a forged request never executes.
            return json(
                refusal,
                error_json("x-demo-signature does not sign this body"),
            );
        }
    }
    let execution = counters.record(path);
    let (answer, payload) = build_answer(&parts, &spec, execution, path, body_bytes, &digest);
    let kept = parts
        .headers
        .get("idempotency-key")
        .filter(|_| spec.status.is_success())
        .map(|key| {
            let written = Written {
                authorization: parts.headers.get(AUTHORIZATION).cloned(),
                content_type: answer.headers().get(CONTENT_TYPE).cloned(),
                body: payload,
                execution,
            };
            (key.as_bytes().to_vec(), written)
        });
    // The write finishes whether its caller stays or not (a service does not undo a payment
    // because the connection dropped): its delay and its record run on a task of their own.
    let (delay, ledger) = (spec.delay, Arc::clone(counters));
    let finished = tokio::spawn(async move {
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if let Some((key, written)) = kept {
            ledger.ledger().insert(key, written);
        }
    });
    let _ = finished.await;
    if spec.reset {
        let mut resp = plain(StatusCode::INTERNAL_SERVER_ERROR, Bytes::new());
        resp.extensions_mut().insert(CloseWithoutAnswer);
        return resp;
    }
    answer
}

/// The answer to an execution, as `x-demo-*` asked for it, and its body.
fn build_answer(
    parts: &hyper::http::request::Parts,
    spec: &ResponseSpec,
    execution: u64,
    path: &str,
    body_bytes: u64,
    digest: &[u8; 32],
) -> (Response<ResponseBody>, Bytes) {
    let no_body = parts.method == Method::HEAD
        || spec.status == StatusCode::NO_CONTENT
        || spec.status == StatusCode::NOT_MODIFIED;
    let (content_type, payload) = if no_body {
        (None, Bytes::new())
    } else if let Some(n) = spec.body_bytes {
        (
            Some(HeaderValue::from_static("text/plain")),
            pattern_body(n),
        )
    } else {
        let mut text = execution_json(
            execution,
            parts.method.as_str(),
            path,
            parts.uri.query().unwrap_or(""),
            body_bytes,
            digest,
        );
        if spec.echo {
            echo_headers(&mut text, &parts.headers);
        }
        (
            Some(HeaderValue::from_static("application/json")),
            Bytes::from(text),
        )
    };

    let mut resp = Response::new(Full::new(payload.clone()));
    *resp.status_mut() = spec.status;
    let headers = resp.headers_mut();
    if let Some(content_type) = content_type {
        headers.insert(CONTENT_TYPE, content_type);
    }
    headers.insert(X_EXECUTION, HeaderValue::from(execution));
    if let Ok(cookie) = HeaderValue::try_from(format!("demo-session={execution}; HttpOnly")) {
        headers.insert(SET_COOKIE, cookie);
    }
    headers.insert(X_DEMO_UPSTREAM, HeaderValue::from_static("1"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    apply_extra_headers(headers, spec.extra_headers.clone());
    (resp, payload)
}

/// A lookup of the write kept under `key` (decoded), for `caller`.
fn lookup(key: &str, caller: Option<&HeaderValue>, counters: &Counters) -> Response<ResponseBody> {
    if counters.fail_a_lookup() {
        return json(
            StatusCode::SERVICE_UNAVAILABLE,
            error_json("lookups are failing (/__fail-lookups)"),
        );
    }
    let found = counters
        .ledger()
        .get(key.as_bytes())
        .filter(|w| w.authorization.as_ref() == caller)
        .cloned();
    let Some(written) = found else {
        return json(
            StatusCode::NOT_FOUND,
            error_json("no finished write with this key"),
        );
    };
    let mut resp = Response::new(Full::new(written.body));
    let headers = resp.headers_mut();
    if let Some(content_type) = written.content_type {
        headers.insert(CONTENT_TYPE, content_type);
    }
    headers.insert(X_EXECUTION, HeaderValue::from(written.execution));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// What the control headers of a request ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseSpec {
    pub status: StatusCode,
    pub delay: Duration,
    pub body_bytes: Option<usize>,
    pub extra_headers: Vec<(HeaderName, HeaderValue)>,
    /// Execute only requests whose `x-demo-signature` signs the body; refuse the others
    /// with this status.
    pub signed: Option<StatusCode>,
    /// Close the connection instead of answering (`x-demo-reset: 1`).
    pub reset: bool,
    /// List the request headers received in the answer (`x-demo-echo: 1`).
    pub echo: bool,
}

impl ResponseSpec {
    /// Reads the `x-demo-*` request headers; the error says which one is invalid.
    pub fn from_headers(headers: &HeaderMap) -> Result<Self, &'static str> {
        let status = match headers.get(X_DEMO_STATUS) {
            None => DEFAULT_STATUS,
            Some(v) => parse_number(v)
                .filter(|n| (200..=599).contains(n))
                .and_then(|n| u16::try_from(n).ok())
                .and_then(|n| StatusCode::from_u16(n).ok())
                .ok_or("x-demo-status must be a number in 200..=599")?,
        };
        let delay = match headers.get(X_DEMO_DELAY_MS) {
            None => Duration::ZERO,
            Some(v) => parse_number(v)
                .filter(|n| *n <= MAX_DELAY_MS)
                .map(Duration::from_millis)
                .ok_or("x-demo-delay-ms must be a number in 0..=30000")?,
        };
        let body_bytes = match headers.get(X_DEMO_BODY_BYTES) {
            None => None,
            Some(v) => Some(
                parse_number(v)
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|n| *n <= MAX_BODY_BYTES)
                    .ok_or("x-demo-body-bytes must be a number in 0..=16777216")?,
            ),
        };
        let signed = match headers.get(X_DEMO_SIGNED) {
            None => None,
            Some(v) => Some(
                parse_number(v)
                    .filter(|n| (400..=499).contains(n))
                    .and_then(|n| u16::try_from(n).ok())
                    .and_then(|n| StatusCode::from_u16(n).ok())
                    .ok_or("x-demo-signed must be a number in 400..=499")?,
            ),
        };
        let reset = match headers.get(X_DEMO_RESET) {
            None => false,
            Some(v) if v.as_bytes() == b"1" => true,
            Some(_) => return Err("x-demo-reset must be 1"),
        };
        let echo = match headers.get(X_DEMO_ECHO) {
            None => false,
            Some(v) if v.as_bytes() == b"1" => true,
            Some(_) => return Err("x-demo-echo must be 1"),
        };
        let mut extra_headers = Vec::new();
        for v in headers.get_all(X_DEMO_HEADER) {
            extra_headers.push(parse_extra_header(v).ok_or(
                "x-demo-header must be name=value with a valid name and value \
                 (not content-length, transfer-encoding or connection)",
            )?);
        }
        Ok(Self {
            status,
            delay,
            body_bytes,
            extra_headers,
            signed,
            reset,
            echo,
        })
    }
}

fn parse_number(v: &HeaderValue) -> Option<u64> {
    v.to_str().ok()?.trim().parse().ok()
}

fn parse_extra_header(v: &HeaderValue) -> Option<(HeaderName, HeaderValue)> {
    let mut halves = v.as_bytes().splitn(2, |b| *b == b'=');
    let name = HeaderName::from_bytes(halves.next()?.trim_ascii()).ok()?;
    let value = HeaderValue::from_bytes(halves.next()?.trim_ascii()).ok()?;
    if name == CONTENT_LENGTH || name == TRANSFER_ENCODING || name == CONNECTION {
        return None;
    }
    Some((name, value))
}

/// Adds the `x-demo-header` headers: the first one with a given name replaces
/// a default header of that name, later ones with the same name are appended.
fn apply_extra_headers(headers: &mut HeaderMap, extra: Vec<(HeaderName, HeaderValue)>) {
    for (i, (name, value)) in extra.iter().enumerate() {
        let seen_before = extra.iter().take(i).any(|(n, _)| n == name);
        if !seen_before {
            headers.remove(name);
        }
        headers.append(name.clone(), value.clone());
    }
}

/// Reads and discards a request body, so the connection can be reused.
async fn drain<B: Body>(body: B) {
    let mut body = std::pin::pin!(body);
    // Bounded by the body itself: it ends, or fails, and then we stop.
    while let Some(frame) = body.frame().await {
        if frame.is_err() {
            break;
        }
    }
}

/// Reads a whole request body, returning its length and SHA-256, without
/// keeping it in memory; feeds `mac` too when given. `None` when the body
/// fails (the client went away).
async fn hash_body<B: Body<Data = Bytes>>(
    body: B,
    mut mac: Option<&mut HmacSha256>,
) -> Option<(u64, [u8; 32])> {
    let mut body = std::pin::pin!(body);
    let mut hasher = Sha256::new();
    let mut len: u64 = 0;
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame.ok()?.data_ref() {
            hasher.update(data);
            if let Some(mac) = mac.as_deref_mut() {
                mac.update(data);
            }
            len = len.saturating_add(data.len() as u64);
        }
    }
    Some((len, hasher.finalize().into()))
}

/// HMAC-SHA256 (RFC 2104), fed as the body streams in.
pub struct HmacSha256 {
    inner: Sha256,
    outer_pad: [u8; 64],
}

impl HmacSha256 {
    pub fn new(key: &[u8]) -> Self {
        // Keys longer than the block are hashed first; shorter ones are zero-padded.
        let mut block = [0u8; 64];
        let hashed;
        let key = if key.len() > block.len() {
            hashed = Sha256::digest(key);
            hashed.as_slice()
        } else {
            key
        };
        for (slot, b) in block.iter_mut().zip(key) {
            *slot = *b;
        }
        let mut inner = Sha256::new();
        inner.update(block.map(|b| b ^ 0x36));
        Self {
            inner,
            outer_pad: block.map(|b| b ^ 0x5c),
        }
    }

    pub fn update(&mut self, data: &[u8]) {
        self.inner.update(data);
    }

    pub fn finish(self) -> [u8; 32] {
        let mut outer = Sha256::new();
        outer.update(self.outer_pad);
        outer.update(self.inner.finalize());
        outer.finalize().into()
    }
}

/// Compares without stopping at the first difference, as a real verifier must.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    push_hex(&mut out, bytes);
    out
}

/// `n` bytes of [`BODY_PATTERN`], sliced out of one shared buffer.
pub fn pattern_body(n: usize) -> Bytes {
    static BUFFER: OnceLock<Bytes> = OnceLock::new();
    let buffer = BUFFER.get_or_init(|| {
        Bytes::from(
            BODY_PATTERN
                .iter()
                .copied()
                .cycle()
                .take(MAX_BODY_BYTES)
                .collect::<Vec<u8>>(),
        )
    });
    if n <= buffer.len() {
        buffer.slice(..n)
    } else {
        Bytes::new()
    }
}

/// The JSON body of an ordinary execution.
pub fn execution_json(
    execution: u64,
    method: &str,
    path: &str,
    query: &str,
    body_bytes: u64,
    sha256: &[u8; 32],
) -> String {
    let mut out = String::with_capacity(160 + path.len() + query.len());
    let _ = write!(out, "{{\"execution\":{execution},\"method\":");
    push_json_string(&mut out, method);
    out.push_str(",\"path\":");
    push_json_string(&mut out, path);
    out.push_str(",\"query\":");
    push_json_string(&mut out, query);
    let _ = write!(out, ",\"body_bytes\":{body_bytes},\"body_sha256\":\"");
    push_hex(&mut out, sha256);
    out.push_str("\"}");
    out
}

/// Adds `"headers":{...}` to an execution's JSON object (before its closing brace).
fn echo_headers(json: &mut String, headers: &HeaderMap) {
    if json.pop() != Some('}') {
        return;
    }
    json.push_str(",\"headers\":{");
    let mut first = true;
    for name in headers.keys() {
        let values: Vec<&str> = headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap_or("<not text>"))
            .collect();
        if !first {
            json.push(',');
        }
        first = false;
        push_json_string(json, name.as_str());
        json.push(':');
        push_json_string(json, &values.join(", "));
    }
    json.push_str("}}");
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for b in bytes {
        for nibble in [b >> 4, b & 0x0f] {
            if let Some(d) = DIGITS.get(usize::from(nibble)) {
                out.push(char::from(*d));
            }
        }
    }
}

fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn error_json(message: &str) -> String {
    let mut out = String::from("{\"error\":");
    push_json_string(&mut out, message);
    out.push('}');
    out
}

/// The uncounted `/__*` endpoints.
fn control(
    method: &Method,
    path: &str,
    query: Option<&str>,
    counters: &Counters,
) -> Response<ResponseBody> {
    match path {
        "/__count" => {
            if method != Method::GET && method != Method::HEAD {
                return json(StatusCode::METHOD_NOT_ALLOWED, error_json("use GET"));
            }
            match query.and_then(|q| query_param(q, "path")) {
                Some(p) => {
                    let mut out = String::from("{\"path\":");
                    push_json_string(&mut out, &p);
                    let _ = write!(
                        out,
                        ",\"executions\":{},\"lookups\":{}}}",
                        counters.executions(&p),
                        counters.lookups(&p)
                    );
                    json(StatusCode::OK, out)
                }
                None => json(
                    StatusCode::OK,
                    format!("{{\"total\":{}}}", counters.total()),
                ),
            }
        }
        "/__fail-lookups" => {
            if method != Method::POST {
                return json(StatusCode::METHOD_NOT_ALLOWED, error_json("use POST"));
            }
            match query
                .and_then(|q| query_param(q, "n"))
                .and_then(|n| n.parse::<u64>().ok())
            {
                Some(n) => {
                    counters.failing_lookups.store(n, Ordering::Relaxed);
                    json(StatusCode::OK, format!("{{\"failing_lookups\":{n}}}"))
                }
                None => json(StatusCode::BAD_REQUEST, error_json("n must be a number")),
            }
        }
        "/__reset" => {
            if method != Method::POST {
                return json(StatusCode::METHOD_NOT_ALLOWED, error_json("use POST"));
            }
            counters.reset();
            json(StatusCode::OK, String::from("{\"reset\":true}"))
        }
        _ => json(
            StatusCode::NOT_FOUND,
            error_json("unknown control endpoint"),
        ),
    }
}

/// The percent-decoded value of the first `name=` parameter of a query.
pub fn query_param(query: &str, name: &str) -> Option<String> {
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| percent_decode(v))
}

/// `path` as a normalising proxy or router passes it on (see "Normalised paths"): decoded,
/// `\` as `/`, slashes merged, dot segments removed (RFC 3986, 5.2.4), a trailing slash kept.
/// None when it does not decode to UTF-8.
pub fn normalized_path(path: &str) -> Option<String> {
    let decoded = percent_decode_path(path)?.replace('\\', "/");
    let mut kept: Vec<&str> = Vec::new();
    let mut ends_in_directory = false;
    for segment in decoded.split('/') {
        ends_in_directory = matches!(segment, "" | "." | "..");
        match segment {
            "" | "." => {}
            ".." => {
                kept.pop();
            }
            other => kept.push(other),
        }
    }
    let mut out = format!("/{}", kept.join("/"));
    if ends_in_directory && !kept.is_empty() {
        out.push('/');
    }
    Some(out)
}

/// Decodes `%XX` escapes (a path's: `+` stays `+`); a malformed escape is kept as is.
fn percent_decode_path(s: &str) -> Option<String> {
    percent_decode_with(s, false)
}

/// Decodes `%XX` escapes and `+` (as space); a malformed escape is kept as is.
pub fn percent_decode(s: &str) -> Option<String> {
    percent_decode_with(s, true)
}

fn percent_decode_with(s: &str, plus_is_space: bool) -> Option<String> {
    fn hex(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            b'A'..=b'F' => Some(b - b'A' + 10),
            _ => None,
        }
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'%' => {
                let decoded = bytes
                    .get(i + 1)
                    .and_then(|h| hex(*h))
                    .zip(bytes.get(i + 2).and_then(|l| hex(*l)));
                if let Some((h, l)) = decoded {
                    out.push(h << 4 | l);
                    i += 3;
                } else {
                    out.push(b'%');
                    i += 1;
                }
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                i += 1;
            }
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

fn plain(status: StatusCode, body: Bytes) -> Response<ResponseBody> {
    let mut resp = Response::new(Full::new(body));
    *resp.status_mut() = status;
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    resp
}

fn json(status: StatusCode, body: String) -> Response<ResponseBody> {
    let mut resp = Response::new(Full::new(Bytes::from(body)));
    *resp.status_mut() = status;
    let headers = resp.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_per_path_and_total() {
        let c = Counters::default();
        assert_eq!(c.record("/a"), 1);
        assert_eq!(c.record("/a"), 2);
        assert_eq!(c.record("/b"), 1);
        assert_eq!(c.executions("/a"), 2);
        assert_eq!(c.executions("/nope"), 0);
        assert_eq!(c.total(), 3);
        c.reset();
        assert_eq!(c.executions("/a"), 0);
        assert_eq!(c.total(), 0);
    }

    #[test]
    fn json_is_escaped_and_hex_is_lowercase() {
        let text = execution_json(3, "POST", "/x\"y", "a=\\", 0, &[0xab; 32]);
        assert_eq!(
            text,
            format!(
                "{{\"execution\":3,\"method\":\"POST\",\"path\":\"/x\\\"y\",\"query\":\"a=\\\\\",\
                 \"body_bytes\":0,\"body_sha256\":\"{}\"}}",
                "ab".repeat(32)
            )
        );
    }

    #[test]
    fn query_param_decodes() {
        assert_eq!(
            query_param("x=1&path=%2Forders%2F1", "path").as_deref(),
            Some("/orders/1")
        );
        assert_eq!(
            query_param("path=/a+b%2", "path").as_deref(),
            Some("/a b%2")
        );
        assert_eq!(query_param("x=1", "path"), None);
    }

    #[test]
    fn pattern_body_has_exact_length() {
        assert_eq!(pattern_body(0).len(), 0);
        let b = pattern_body(100);
        assert_eq!(b.len(), 100);
        assert_eq!(&b[..64], &BODY_PATTERN[..]);
        assert!(b
            .iter()
            .all(|c| c.is_ascii_graphic() || *c == b'\n' || *c == b'-'));
        assert_eq!(pattern_body(MAX_BODY_BYTES).len(), MAX_BODY_BYTES);
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // RFC 4231, test cases 2 and 6 (a key longer than the block).
        let mut mac = HmacSha256::new(b"Jefe");
        mac.update(b"what do ya want ");
        mac.update(b"for nothing?");
        assert_eq!(
            hex(&mac.finish()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let mut mac = HmacSha256::new(&[0xaa; 131]);
        mac.update(b"Test Using Larger Than Block-Size Key - Hash Key First");
        assert_eq!(
            hex(&mac.finish()),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd") && !constant_time_eq(b"abc", b"ab"));
    }

    #[tokio::test]
    async fn a_signed_endpoint_executes_only_the_genuine_request() {
        let counters = Arc::new(Counters::default());
        let body = r#"{"id":"evt_1"}"#;
        let mut mac = HmacSha256::new(DEMO_SIGNING_KEY);
        mac.update(body.as_bytes());
        let genuine = format!("sha256={}", hex(&mac.finish()));
        let send = |signature: Option<&str>| {
            let mut req = Request::post("/hooks").header(X_DEMO_SIGNED, "401");
            if let Some(s) = signature {
                req = req.header(X_DEMO_SIGNATURE, s);
            }
            req.body(Full::new(Bytes::from_static(body.as_bytes())))
                .unwrap()
        };
        let forged = handle(
            send(Some(&"sha256=".repeat(2))),
            Options::default(),
            &counters,
        )
        .await;
        assert_eq!(forged.status(), StatusCode::UNAUTHORIZED);
        let unsigned = handle(send(None), Options::default(), &counters).await;
        assert_eq!(unsigned.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(counters.executions("/hooks"), 0);
        let ok = handle(send(Some(&genuine)), Options::default(), &counters).await;
        assert_eq!(ok.status(), StatusCode::CREATED);
        assert_eq!(counters.executions("/hooks"), 1);
        let mut h = HeaderMap::new();
        h.insert(X_DEMO_SIGNED, HeaderValue::from_static("200"));
        assert!(ResponseSpec::from_headers(&h).is_err());
    }

    #[test]
    fn spec_rejects_bad_values() {
        let mut h = HeaderMap::new();
        h.insert(X_DEMO_STATUS, HeaderValue::from_static("99"));
        assert!(ResponseSpec::from_headers(&h).is_err());
        let mut h = HeaderMap::new();
        h.insert(X_DEMO_DELAY_MS, HeaderValue::from_static("30001"));
        assert!(ResponseSpec::from_headers(&h).is_err());
        let mut h = HeaderMap::new();
        h.insert(X_DEMO_HEADER, HeaderValue::from_static("content-length=3"));
        assert!(ResponseSpec::from_headers(&h).is_err());
        let mut h = HeaderMap::new();
        h.append(X_DEMO_HEADER, HeaderValue::from_static("X-A = b=c"));
        h.append(X_DEMO_STATUS, HeaderValue::from_static(" 503 "));
        let spec = ResponseSpec::from_headers(&h).unwrap();
        assert_eq!(spec.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            spec.extra_headers,
            vec![(
                HeaderName::from_static("x-a"),
                HeaderValue::from_static("b=c")
            )]
        );
    }
}

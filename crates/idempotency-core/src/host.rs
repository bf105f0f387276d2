//! Everything the filter asks of its host (Envoy), as one trait: the flow in [`crate::journey`]
//! and [`crate::plugin`] is written against it, the filter crate implements it once over the
//! proxy-wasm ABI, and core's tests implement it with a scriptable fake.
//!
//! Each call returns the host's refusal as a [`HostError`] instead of panicking: the flow
//! decides what a refusal means at each step.

use std::sync::Arc;

/// The host's shared data: the table, the owner tokens and the registries live in it.
pub trait SharedData {
    /// None when the key does not exist; otherwise its value (possibly empty) and cas.
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError>;
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError>;
}

/// Shared data behind a reference (as `OnLanded` is given it).
impl<T: SharedData + ?Sized> SharedData for &T {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        (**self).get(key)
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError> {
        (**self).set(key, value, cas)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetOutcome {
    Stored,
    CasMismatch,
}

/// A host call failed with an unexpected status (named for the log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostError(pub String);

/// Header pairs as the host lists them (names lower case, values as bytes).
pub type HeaderPairs = Vec<(String, Vec<u8>)>;

/// One HTTP callout, ready to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Callout<'a> {
    /// The Envoy cluster the callout goes to.
    pub cluster: &'a str,
    pub headers: Vec<(&'a str, &'a str)>,
    pub body: &'a [u8],
    pub trailers: Vec<(&'a str, &'a str)>,
    pub timeout_ms: u64,
}

/// A completion or release reported to a host that can land it without the root
/// ([`Host::hand_off_write`]): the store call as it goes on the store's stream (encoded with
/// call id 0; the carrier gives it its own), where it goes, and until when it matters.
#[derive(Debug, Clone)]
pub struct HandedOffWrite<'a> {
    /// Unique per root context for as long as the root lives.
    pub id: u64,
    /// The store's Envoy cluster and the `:authority` its stream carries.
    pub cluster: &'a str,
    pub authority: &'a str,
    /// The stream's `authorization` value, if the store wants one.
    pub authorization: Option<&'a str>,
    pub call: Vec<u8>,
    /// Host clock (`now_ms`): after this the write cannot matter any more.
    pub deadline_ms: u64,
    /// How long the root normally takes to settle it while it runs (the store's timeout plus
    /// the first retry's backoff): a host lands it itself only once it is unsettled longer.
    pub settles_within_ms: u64,
    /// The store's HTTP transport: the write as its root sends it (path, JSON body), which
    /// the host sends the same way (a store cluster may speak HTTP/1.1 only).
    pub http: Option<(String, Vec<u8>)>,
    /// What whoever lands it does once the store took it, as the root would on the store's
    /// answer (a completion of an unknown outcome marks its record as in the store: until
    /// then every worker's retry answers 409).
    pub on_landed: Option<&'a Arc<dyn OnLanded>>,
}

/// A handed-off write's consequence for the table once the store took it: plain data, as the
/// host may land the write on another thread.
pub trait OnLanded: Send + Sync + std::fmt::Debug {
    fn on_landed(&self, shared: &dyn SharedData);
}

/// The host: the current stream's headers and bodies, properties, local replies, callouts,
/// the clock, shared data, shared queues, counters and the root's timer.
///
/// The stream calls (`request_headers`, `response_body`, ...) act on the stream whose
/// callback is running; the host knows which one.
pub trait Host: SharedData {
    /// Milliseconds since the Unix epoch (0 if the host refuses).
    fn now_ms(&self) -> u64;
    fn now_nanos(&self) -> u64;

    fn request_headers(&self) -> Result<HeaderPairs, HostError>;
    /// One request header's value (None when absent): one small read where the whole map
    /// copies every header.
    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError>;
    /// The first `size` bytes of the buffered request body.
    fn request_body(&self, size: usize) -> Result<Vec<u8>, HostError>;
    /// The request's trailers (request trailers callback, and while the request is held).
    fn request_trailers(&self) -> Result<HeaderPairs, HostError>;
    /// Sets a request header before the request goes on (while the request is held).
    fn replace_request_header(&self, name: &str, value: &[u8]) -> Result<(), HostError>;
    /// Removes a request header before the request goes on (while the request is held).
    fn remove_request_header(&self, name: &str) -> Result<(), HostError>;
    /// Replaces the whole buffered request body before the request goes on.
    fn set_request_body(&self, body: &[u8]) -> Result<(), HostError>;
    fn response_headers(&self) -> Result<HeaderPairs, HostError>;
    /// The current chunk of the response body (`size` bytes).
    fn response_body(&self, size: usize) -> Result<Vec<u8>, HostError>;
    fn replace_response_header(&self, name: &str, value: &[u8]) -> Result<(), HostError>;
    fn remove_response_header(&self, name: &str) -> Result<(), HostError>;
    /// Adds a value to a response header (another value of a repeated one).
    fn add_response_header(&self, name: &str, value: &[u8]) -> Result<(), HostError>;
    /// The response's trailers (response trailers callback).
    fn response_trailers(&self) -> Result<HeaderPairs, HostError>;
    /// Adds a response trailer; on the last chunk of a response without trailers, Envoy
    /// gives it trailers to add to.
    fn add_response_trailer(&self, name: &str, value: &[u8]) -> Result<(), HostError>;
    /// A stream property such as `xds.route_name`; None when absent.
    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError>;

    /// Answers the request from the filter; the request goes no further.
    fn send_local_reply(
        &self,
        status: u16,
        headers: &[(&str, &[u8])],
        body: &[u8],
    ) -> Result<(), HostError>;
    /// Whether [`Host::send_reply_with_trailers`] works. Envoy turns a gRPC call's local reply
    /// into a trailers-only one, so a proxy-wasm host cannot send a recorded message with its
    /// trailers, and a replay takes the echo hop (`crate::grpc`); a host that sends a reply's
    /// headers, body and trailers itself (a dynamic module) replays it directly.
    fn sends_replies_with_trailers(&self) -> bool {
        false
    }
    /// Answers the request from the filter with exactly these headers (no `:status` among
    /// them), body and trailers, none changed by Envoy's local reply rules. Only called when
    /// [`Host::sends_replies_with_trailers`] says so.
    fn send_reply_with_trailers(
        &self,
        _status: u16,
        _headers: &[(&str, &[u8])],
        _body: &[u8],
        _trailers: &[(&str, &[u8])],
    ) -> Result<(), HostError> {
        Err(HostError(
            "this host cannot send a reply with trailers".into(),
        ))
    }
    /// Lets a paused request go on upstream.
    fn resume_request(&self) -> Result<(), HostError>;

    /// Sends a callout; its answer comes back to the calling context with the returned token.
    fn dispatch_callout(&self, callout: &Callout<'_>) -> Result<u32, HostError>;
    /// The headers of the callout answer being delivered.
    fn callout_response_headers(&self) -> Result<HeaderPairs, HostError>;
    /// The body of the callout answer being delivered.
    fn callout_response_body(&self, size: usize) -> Result<Vec<u8>, HostError>;
    /// The trailers of the callout answer being delivered; empty where the host hands none
    /// over (Envoy's dynamic modules give a callout's headers and body only).
    fn callout_response_trailers(&self) -> Result<HeaderPairs, HostError> {
        Ok(Vec::new())
    }

    /// Opens a bidirectional gRPC stream to `cluster`'s `service/method`; its messages and
    /// its close reach the context that opened it (the root).
    fn open_grpc_stream(
        &self,
        cluster: &str,
        service: &str,
        method: &str,
        metadata: &[(&str, &[u8])],
    ) -> Result<u32, HostError>;
    /// Sends one message; the host buffers it (no backpressure). Only the context that opened
    /// the stream may send: switch to it first.
    fn send_grpc_message(&self, stream: u32, message: &[u8]) -> Result<(), HostError>;
    /// Ends a stream the store closed, or resets one that stopped answering.
    fn close_grpc_stream(&self, stream: u32, reset: bool) -> Result<(), HostError>;
    /// The initial metadata of the stream whose headers are being delivered.
    fn grpc_initial_metadata(&self) -> Result<HeaderPairs, HostError>;
    /// The message being delivered on a stream.
    fn grpc_message(&self, size: usize) -> Result<Vec<u8>, HostError>;
    /// Makes `context_id` the context later host calls act on, until the callback returns or
    /// the next switch. Fails for a context that is gone.
    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError>;

    fn define_counter(&self, name: &str) -> Result<u32, HostError>;
    /// A lost increment is not worth failing a request over, so nothing is returned.
    fn increment_counter(&self, id: u32);
    /// Publishes a value of the current request for Envoy's access log (filter state
    /// `wasm.<name>`). Like a lost increment, a refused one is not worth failing a request
    /// over, so nothing is returned.
    fn publish(&self, name: &str, value: &[u8]);
    fn define_gauge(&self, name: &str) -> Result<u32, HostError>;
    /// Like a lost increment, a lost value is not worth failing a request over.
    fn set_gauge(&self, id: u32, value: u64);

    fn register_queue(&self, name: &str) -> Result<u32, HostError>;
    fn enqueue(&self, queue: u32, value: &[u8]) -> Result<(), HostError>;
    /// The next message, or None once the queue is empty.
    fn dequeue(&self, queue: u32) -> Result<Option<Vec<u8>>, HostError>;

    /// The plugin configuration bytes (root context only).
    fn plugin_configuration(&self) -> Result<Vec<u8>, HostError>;
    fn set_tick_period_ms(&self, period_ms: u32) -> Result<(), HostError>;
    /// Tells the host a root that asked for time to finish its work is done.
    fn done(&self) -> Result<(), HostError>;

    /// A completion or release the root now owns, reported when a request submits it (sent or
    /// not: a stream that is down must not hide it) and again whenever its bytes change (sent
    /// without its response body), under the same id. A host whose root may not run for a
    /// while (a worker with no request) lands it itself should the root not settle it in time;
    /// the store takes the same write twice harmlessly. Err: not kept (the root still sends it).
    fn hand_off_write(&self, _write: &HandedOffWrite<'_>) -> Result<(), HostError> {
        Ok(())
    }
    /// The write handed off under `id` is settled by the root: answered, or given up.
    fn write_settled(&self, _id: u64) {}
}

/// The `:status` of a response header map, if present and numeric.
pub fn status_of(headers: &[(String, Vec<u8>)]) -> Option<u16> {
    headers
        .iter()
        .find(|(n, _)| n == ":status")
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
        .and_then(|s| s.parse().ok())
}

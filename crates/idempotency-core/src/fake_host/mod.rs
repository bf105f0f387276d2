//! Test support: a scriptable host. Tests set what the current stream holds (headers, body,
//! properties, a callout's answer), make chosen host calls fail, move the clock, and read
//! back every effect the flow had, in order: local replies, callouts, resumes, header
//! edits, counters. Shared data is `FakeShared`, with Envoy's CAS semantics.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};

mod census;

pub(crate) use census::Tally;
use census::{map_bytes, Census};

use crate::host::{Callout, HandedOffWrite, HeaderPairs, Host, HostError, SetOutcome, SharedData};
use crate::outcome::Outcome;
use crate::table::fake_shared::FakeShared;

/// A write handed off to the host: id, the call as encoded, its deadline, and the time the
/// root normally takes to settle it.
pub(crate) type HandoffSeen = (u64, Vec<u8>, u64, u64);

/// What the flow did to the outside world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Effect {
    LocalReply {
        status: u16,
        headers: HeaderPairs,
        body: Vec<u8>,
    },
    /// A reply sent whole by a host that sends trailers (`sends_trailers`).
    ReplyWithTrailers {
        status: u16,
        headers: HeaderPairs,
        body: Vec<u8>,
        trailers: HeaderPairs,
    },
    Callout {
        token: u32,
        cluster: String,
        path: String,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
        trailers: Vec<(String, String)>,
        timeout_ms: u64,
    },
    Resume,
    StreamOpened {
        stream: u32,
        cluster: String,
        metadata: Vec<(String, Vec<u8>)>,
    },
    /// A message sent on `stream` while `context` was the effective context.
    StreamMessage {
        stream: u32,
        context: u32,
        message: Vec<u8>,
    },
    StreamClosed {
        stream: u32,
        reset: bool,
    },
    /// The effective context changed.
    Switched(u32),
    ReplaceResponseHeader(String, Vec<u8>),
    RemoveResponseHeader(String),
    RemoveRequestHeader(String),
    /// The buffered request body was replaced by this.
    RequestBodySet(Vec<u8>),
    AddResponseTrailer(String, Vec<u8>),
    AddResponseHeader(String, Vec<u8>),
    Done,
}

/// Host calls a test can make fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum HostCall {
    RequestHeaders,
    RequestBody,
    ResponseHeaders,
    ResponseBody,
    LocalReply,
    /// Only the reply with trailers (a local reply without them still goes).
    ReplyWithTrailers,
    Resume,
    Callout,
    SharedData,
    OpenStream,
    StreamSend,
}

pub(crate) struct FakeHost {
    pub shared: FakeShared,
    pub clock_ms: Cell<u64>,
    pub request_headers: RefCell<HeaderPairs>,
    pub request_body: RefCell<Vec<u8>>,
    pub request_trailers: RefCell<HeaderPairs>,
    /// Request headers the flow set, in order (kept apart from `effects`: every protected
    /// request sets one).
    pub request_header_edits: RefCell<HeaderPairs>,
    /// Local replies with these statuses are refused (as Envoy refuses a reply it cannot send).
    pub refused_statuses: RefCell<Vec<u16>>,
    pub response_headers: RefCell<HeaderPairs>,
    pub response_trailers: RefCell<HeaderPairs>,
    pub response_chunk: RefCell<Vec<u8>>,
    pub properties: RefCell<HashMap<String, Vec<u8>>>,
    /// The callout answer being delivered: its headers and body.
    pub callout_answer: RefCell<(HeaderPairs, Vec<u8>)>,
    /// ... and its trailers.
    pub callout_trailers: RefCell<HeaderPairs>,
    pub configuration: RefCell<Vec<u8>>,
    pub tick_period_ms: Cell<Option<u32>>,
    /// Plays a host that sends a reply's trailers itself (the native build); off, the Wasm one.
    pub sends_trailers: Cell<bool>,
    failing: RefCell<HashSet<HostCall>>,
    effects: RefCell<Vec<Effect>>,
    counters: RefCell<Vec<(String, u64)>>,
    queues: RefCell<Vec<(String, VecDeque<Vec<u8>>)>>,
    next_token: Cell<u32>,
    /// The message being delivered on a stream.
    pub grpc_message: RefCell<Vec<u8>>,
    pub grpc_initial_metadata: RefCell<HeaderPairs>,
    /// The context host calls act on; tests set it as Envoy would for each callback.
    pub effective_context: Cell<u32>,
    /// Contexts that are gone: switching to them fails, as in Envoy.
    pub gone_contexts: RefCell<HashSet<u32>>,
    /// What each context published for the access log, by name.
    published: RefCell<HashMap<(u32, String), Vec<u8>>>,
    /// Every host call and its bytes (see `census`).
    pub census: Census,
    /// The clock was read in the current callback: the filter's host reads it once per
    /// callback (`envoy_host::new_callback`), so the census counts it once too.
    clock_read: Cell<bool>,
    /// Writes handed off (`Host::hand_off_write`), in order: id, the call as encoded, its
    /// deadline and the time the root normally takes to settle it.
    pub handed_off: RefCell<Vec<HandoffSeen>>,
    /// Ids of handed-off writes reported settled, in order.
    pub settled_writes: RefCell<Vec<u64>>,
    /// Lands each handed-off write as it is handed off (the store took it), as a native
    /// main thread may do on another thread before the submitting hook goes on.
    pub lands_handoffs_at_once: Cell<bool>,
}

impl Default for FakeHost {
    fn default() -> Self {
        FakeHost {
            shared: FakeShared::default(),
            clock_ms: Cell::new(1_700_000_000_000),
            request_headers: RefCell::default(),
            request_body: RefCell::default(),
            request_trailers: RefCell::default(),
            request_header_edits: RefCell::default(),
            refused_statuses: RefCell::default(),
            response_headers: RefCell::default(),
            response_trailers: RefCell::default(),
            response_chunk: RefCell::default(),
            properties: RefCell::default(),
            callout_answer: RefCell::default(),
            callout_trailers: RefCell::default(),
            configuration: RefCell::default(),
            tick_period_ms: Cell::new(None),
            sends_trailers: Cell::new(false),
            failing: RefCell::default(),
            effects: RefCell::default(),
            counters: RefCell::default(),
            queues: RefCell::default(),
            next_token: Cell::new(1),
            grpc_message: RefCell::default(),
            grpc_initial_metadata: RefCell::default(),
            effective_context: Cell::new(0),
            gone_contexts: RefCell::default(),
            published: RefCell::default(),
            census: Census::default(),
            clock_read: Cell::new(false),
            handed_off: RefCell::default(),
            settled_writes: RefCell::default(),
            lands_handoffs_at_once: Cell::new(false),
        }
    }
}

fn pairs(list: &[(&str, &str)]) -> HeaderPairs {
    list.iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect()
}

impl FakeHost {
    /// What `context` published as `name` for the access log.
    pub fn published_in(&self, context: u32, name: &str) -> Option<String> {
        let published = self.published.borrow();
        let value = published.get(&(context, name.to_string()))?;
        Some(String::from_utf8_lossy(value).into_owned())
    }

    /// What the current context published as `name`.
    pub fn published(&self, name: &str) -> Option<String> {
        self.published_in(self.effective_context.get(), name)
    }

    /// A new callback from Envoy begins (see `clock_read`).
    pub fn new_callback(&self) {
        self.clock_read.set(false);
    }

    fn count_clock(&self) {
        if !self.clock_read.replace(true) {
            self.census.count("clock", 8, 0);
        }
    }

    pub fn fail(&self, call: HostCall) {
        self.failing.borrow_mut().insert(call);
    }

    pub fn heal(&self, call: HostCall) {
        self.failing.borrow_mut().remove(&call);
    }

    fn check(&self, call: HostCall) -> Result<(), HostError> {
        if self.failing.borrow().contains(&call) {
            Err(HostError(format!("{call:?} refused by the test")))
        } else {
            Ok(())
        }
    }

    pub fn advance_ms(&self, ms: u64) {
        self.clock_ms.set(self.clock_ms.get() + ms);
    }

    pub fn set_request(&self, headers: &[(&str, &str)], body: &[u8]) {
        *self.request_headers.borrow_mut() = pairs(headers);
        *self.request_body.borrow_mut() = body.to_vec();
    }

    pub fn set_response(&self, headers: &[(&str, &str)], body: &[u8]) {
        *self.response_headers.borrow_mut() = pairs(headers);
        *self.response_chunk.borrow_mut() = body.to_vec();
    }

    pub fn set_callout_answer(&self, status: Option<u16>, body: &[u8]) {
        let headers = match status {
            Some(s) => pairs(&[(":status", &s.to_string())]),
            None => Vec::new(),
        };
        *self.callout_answer.borrow_mut() = (headers, body.to_vec());
    }

    /// Every effect since the last call, in order.
    pub fn take_effects(&self) -> Vec<Effect> {
        std::mem::take(&mut *self.effects.borrow_mut())
    }

    /// The value of `rule`'s counter for `outcome`.
    pub fn counter(&self, rule: &str, outcome: Outcome) -> u64 {
        let name = outcome.metric_name(rule);
        self.counters
            .borrow()
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, v)| *v)
    }

    /// The value of the gauge `name`; None until it is defined.
    pub fn gauge(&self, name: &str) -> Option<u64> {
        self.counters
            .borrow()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
    }

    /// Messages waiting in the queue named `name`.
    pub fn queued(&self, name_prefix: &str) -> usize {
        self.queues
            .borrow()
            .iter()
            .filter(|(n, _)| n.starts_with(name_prefix))
            .map(|(_, q)| q.len())
            .sum()
    }

    fn record(&self, effect: Effect) {
        self.effects.borrow_mut().push(effect);
    }
}

impl SharedData for FakeHost {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        self.check(HostCall::SharedData)?;
        let found = self.shared.get(key);
        let size = found
            .as_ref()
            .map_or(0, |f| f.as_ref().map_or(0, |(v, _)| v.len() + 4));
        self.census.count("shared data get", size, key.len());
        found
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError> {
        self.check(HostCall::SharedData)?;
        self.census
            .count("shared data set", 0, key.len() + value.len() + 4);
        self.shared.set(key, value, cas)
    }
}

impl Host for FakeHost {
    fn now_ms(&self) -> u64 {
        self.count_clock();
        self.clock_ms.get()
    }

    fn now_nanos(&self) -> u64 {
        self.count_clock();
        self.clock_ms.get() * 1_000_000
    }

    fn request_headers(&self) -> Result<HeaderPairs, HostError> {
        self.check(HostCall::RequestHeaders)?;
        let headers = self.request_headers.borrow().clone();
        self.census.count(
            "request headers",
            map_bytes(headers.iter().map(|(n, v)| (n.as_bytes(), v.as_slice()))),
            0,
        );
        Ok(headers)
    }

    fn request_header(&self, name: &str) -> Result<Option<Vec<u8>>, HostError> {
        self.check(HostCall::RequestHeaders)?;
        let value = self
            .request_headers
            .borrow()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone());
        let read = value.as_ref().map_or(0, Vec::len);
        self.census.count("request header", read, name.len());
        Ok(value)
    }

    fn request_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        self.check(HostCall::RequestBody)?;
        let body = self.request_body.borrow();
        let read: Vec<u8> = body.iter().take(size).copied().collect();
        self.census.count("request body", read.len(), 0);
        Ok(read)
    }

    fn request_trailers(&self) -> Result<HeaderPairs, HostError> {
        self.check(HostCall::RequestHeaders)?;
        let trailers = self.request_trailers.borrow().clone();
        self.census.count(
            "request trailers",
            map_bytes(trailers.iter().map(|(n, v)| (n.as_bytes(), v.as_slice()))),
            0,
        );
        Ok(trailers)
    }

    fn response_headers(&self) -> Result<HeaderPairs, HostError> {
        self.check(HostCall::ResponseHeaders)?;
        let headers = self.response_headers.borrow().clone();
        self.census.count(
            "response headers",
            map_bytes(headers.iter().map(|(n, v)| (n.as_bytes(), v.as_slice()))),
            0,
        );
        Ok(headers)
    }

    fn response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        self.check(HostCall::ResponseBody)?;
        let chunk = self.response_chunk.borrow();
        let read: Vec<u8> = chunk.iter().take(size).copied().collect();
        self.census.count("response body", read.len(), 0);
        Ok(read)
    }

    fn replace_request_header(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        self.check(HostCall::RequestHeaders)?;
        self.census
            .count("header edits", 0, name.len() + value.len());
        self.request_header_edits
            .borrow_mut()
            .push((name.into(), value.to_vec()));
        Ok(())
    }

    fn remove_request_header(&self, name: &str) -> Result<(), HostError> {
        self.check(HostCall::RequestHeaders)?;
        self.census.count("header edits", 0, name.len());
        self.record(Effect::RemoveRequestHeader(name.into()));
        Ok(())
    }

    fn set_request_body(&self, body: &[u8]) -> Result<(), HostError> {
        self.check(HostCall::RequestBody)?;
        self.census.count("request body set", 0, body.len());
        *self.request_body.borrow_mut() = body.to_vec();
        self.record(Effect::RequestBodySet(body.to_vec()));
        Ok(())
    }

    fn response_trailers(&self) -> Result<HeaderPairs, HostError> {
        self.check(HostCall::ResponseHeaders)?;
        let trailers = self.response_trailers.borrow().clone();
        self.census.count(
            "response trailers",
            map_bytes(trailers.iter().map(|(n, v)| (n.as_bytes(), v.as_slice()))),
            0,
        );
        Ok(trailers)
    }

    fn add_response_header(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        self.census
            .count("header edits", 0, name.len() + value.len());
        self.record(Effect::AddResponseHeader(name.into(), value.to_vec()));
        Ok(())
    }

    fn add_response_trailer(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        self.census
            .count("header edits", 0, name.len() + value.len());
        self.record(Effect::AddResponseTrailer(name.into(), value.to_vec()));
        Ok(())
    }

    fn replace_response_header(&self, name: &str, value: &[u8]) -> Result<(), HostError> {
        self.census
            .count("header edits", 0, name.len() + value.len());
        self.record(Effect::ReplaceResponseHeader(name.into(), value.to_vec()));
        Ok(())
    }

    fn remove_response_header(&self, name: &str) -> Result<(), HostError> {
        self.census.count("header edits", 0, name.len());
        self.record(Effect::RemoveResponseHeader(name.into()));
        Ok(())
    }

    fn property(&self, path: &[&str]) -> Result<Option<Vec<u8>>, HostError> {
        let value = self.properties.borrow().get(&path.join(".")).cloned();
        let path_bytes = path.iter().map(|p| p.len() + 1).sum::<usize>();
        self.census
            .count("properties", value.as_ref().map_or(0, Vec::len), path_bytes);
        Ok(value)
    }

    fn send_local_reply(
        &self,
        status: u16,
        headers: &[(&str, &[u8])],
        body: &[u8],
    ) -> Result<(), HostError> {
        self.check(HostCall::LocalReply)?;
        let headers_size = map_bytes(headers.iter().map(|(n, v)| (n.as_bytes(), *v)));
        self.census
            .count("local reply", 0, headers_size + body.len());
        if self.refused_statuses.borrow().contains(&status) {
            return Err(HostError(format!("local reply {status} refused")));
        }
        self.record(Effect::LocalReply {
            status,
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_vec()))
                .collect(),
            body: body.to_vec(),
        });
        Ok(())
    }

    fn sends_replies_with_trailers(&self) -> bool {
        self.sends_trailers.get()
    }

    fn send_reply_with_trailers(
        &self,
        status: u16,
        headers: &[(&str, &[u8])],
        body: &[u8],
        trailers: &[(&str, &[u8])],
    ) -> Result<(), HostError> {
        self.check(HostCall::LocalReply)?;
        self.check(HostCall::ReplyWithTrailers)?;
        if !self.sends_trailers.get() {
            return Err(HostError(
                "this host cannot send a reply with trailers".into(),
            ));
        }
        let owned = |list: &[(&str, &[u8])]| -> HeaderPairs {
            list.iter()
                .map(|(n, v)| (n.to_string(), v.to_vec()))
                .collect()
        };
        self.record(Effect::ReplyWithTrailers {
            status,
            headers: owned(headers),
            body: body.to_vec(),
            trailers: owned(trailers),
        });
        Ok(())
    }

    fn resume_request(&self) -> Result<(), HostError> {
        self.check(HostCall::Resume)?;
        self.census.count("resume", 0, 0);
        self.record(Effect::Resume);
        Ok(())
    }

    fn dispatch_callout(&self, callout: &Callout<'_>) -> Result<u32, HostError> {
        self.check(HostCall::Callout)?;
        let sent = map_bytes(
            callout
                .headers
                .iter()
                .map(|(n, v)| (n.as_bytes(), v.as_bytes())),
        );
        self.census.count("callouts", 0, sent + callout.body.len());
        let token = self.next_token.get();
        self.next_token.set(token + 1);
        let header = |name: &str| {
            callout
                .headers
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
                .unwrap_or_default()
        };
        let owned = |list: &[(&str, &str)]| -> Vec<(String, String)> {
            list.iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect()
        };
        self.record(Effect::Callout {
            token,
            cluster: callout.cluster.to_string(),
            path: header(":path"),
            headers: owned(&callout.headers),
            body: callout.body.to_vec(),
            trailers: owned(&callout.trailers),
            timeout_ms: callout.timeout_ms,
        });
        Ok(token)
    }

    fn callout_response_headers(&self) -> Result<HeaderPairs, HostError> {
        let headers = self.callout_answer.borrow().0.clone();
        self.census.count(
            "callout answers",
            map_bytes(headers.iter().map(|(n, v)| (n.as_bytes(), v.as_slice()))),
            0,
        );
        Ok(headers)
    }

    fn callout_response_trailers(&self) -> Result<HeaderPairs, HostError> {
        Ok(self.callout_trailers.borrow().clone())
    }

    fn callout_response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        let read: Vec<u8> = self
            .callout_answer
            .borrow()
            .1
            .iter()
            .take(size)
            .copied()
            .collect();
        self.census.count("callout answers", read.len(), 0);
        Ok(read)
    }

    fn open_grpc_stream(
        &self,
        cluster: &str,
        _service: &str,
        _method: &str,
        metadata: &[(&str, &[u8])],
    ) -> Result<u32, HostError> {
        self.check(HostCall::OpenStream)?;
        let stream = self.next_token.get();
        self.next_token.set(stream + 1);
        self.record(Effect::StreamOpened {
            stream,
            cluster: cluster.to_string(),
            metadata: metadata
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_vec()))
                .collect(),
        });
        Ok(stream)
    }

    fn send_grpc_message(&self, stream: u32, message: &[u8]) -> Result<(), HostError> {
        self.check(HostCall::StreamSend)?;
        self.census.count("stream messages sent", 0, message.len());
        self.record(Effect::StreamMessage {
            stream,
            context: self.effective_context.get(),
            message: message.to_vec(),
        });
        Ok(())
    }

    fn close_grpc_stream(&self, stream: u32, reset: bool) -> Result<(), HostError> {
        self.record(Effect::StreamClosed { stream, reset });
        Ok(())
    }

    fn grpc_initial_metadata(&self) -> Result<HeaderPairs, HostError> {
        self.census.count("stream messages read", 0, 0);
        Ok(self.grpc_initial_metadata.borrow().clone())
    }

    fn grpc_message(&self, size: usize) -> Result<Vec<u8>, HostError> {
        let read: Vec<u8> = self
            .grpc_message
            .borrow()
            .iter()
            .take(size)
            .copied()
            .collect();
        self.census.count("stream messages read", read.len(), 0);
        Ok(read)
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), HostError> {
        self.census.count("context switches", 0, 0);
        if self.gone_contexts.borrow().contains(&context_id) {
            return Err(HostError(format!("context {context_id} is gone")));
        }
        self.effective_context.set(context_id);
        self.record(Effect::Switched(context_id));
        Ok(())
    }

    fn define_counter(&self, name: &str) -> Result<u32, HostError> {
        let mut counters = self.counters.borrow_mut();
        // As Envoy does: a name defined again (another root) is the same metric.
        if let Some(at) = counters.iter().position(|(n, _)| n == name) {
            return Ok(u32::try_from(at + 1).unwrap_or(u32::MAX));
        }
        counters.push((name.to_string(), 0));
        Ok(u32::try_from(counters.len()).unwrap_or(u32::MAX))
    }

    fn publish(&self, name: &str, value: &[u8]) {
        self.census
            .count("set_property", 0, name.len() + value.len());
        let context = self.effective_context.get();
        self.published
            .borrow_mut()
            .insert((context, name.to_string()), value.to_vec());
    }

    fn increment_counter(&self, id: u32) {
        self.census.count("metrics", 0, 8);
        let index = (id as usize).saturating_sub(1);
        if let Some((_, value)) = self.counters.borrow_mut().get_mut(index) {
            *value += 1;
        }
    }

    // Gauges share the counters' table: ids never collide and `gauge` reads them by name.
    fn define_gauge(&self, name: &str) -> Result<u32, HostError> {
        self.define_counter(name)
    }

    fn set_gauge(&self, id: u32, value: u64) {
        self.census.count("metrics", 0, 8);
        let index = (id as usize).saturating_sub(1);
        if let Some((_, current)) = self.counters.borrow_mut().get_mut(index) {
            *current = value;
        }
    }

    fn register_queue(&self, name: &str) -> Result<u32, HostError> {
        let mut queues = self.queues.borrow_mut();
        queues.push((name.to_string(), VecDeque::new()));
        Ok(u32::try_from(queues.len()).unwrap_or(u32::MAX))
    }

    fn enqueue(&self, queue: u32, value: &[u8]) -> Result<(), HostError> {
        self.census.count("queues", 0, value.len());
        let index = (queue as usize).saturating_sub(1);
        match self.queues.borrow_mut().get_mut(index) {
            Some((_, q)) => {
                q.push_back(value.to_vec());
                Ok(())
            }
            None => Err(HostError("no such queue".into())),
        }
    }

    fn dequeue(&self, queue: u32) -> Result<Option<Vec<u8>>, HostError> {
        self.census.count("queues", 0, 0);
        let index = (queue as usize).saturating_sub(1);
        Ok(self
            .queues
            .borrow_mut()
            .get_mut(index)
            .and_then(|(_, q)| q.pop_front()))
    }

    fn plugin_configuration(&self) -> Result<Vec<u8>, HostError> {
        Ok(self.configuration.borrow().clone())
    }

    fn set_tick_period_ms(&self, period_ms: u32) -> Result<(), HostError> {
        self.tick_period_ms.set(Some(period_ms));
        Ok(())
    }

    fn done(&self) -> Result<(), HostError> {
        self.record(Effect::Done);
        Ok(())
    }

    fn hand_off_write(&self, write: &HandedOffWrite<'_>) -> Result<(), HostError> {
        self.handed_off.borrow_mut().push((
            write.id,
            write.call.clone(),
            write.deadline_ms,
            write.settles_within_ms,
        ));
        if let (true, Some(on_landed)) = (self.lands_handoffs_at_once.get(), write.on_landed) {
            on_landed.on_landed(self);
        }
        Ok(())
    }

    fn write_settled(&self, id: u64) {
        self.settled_writes.borrow_mut().push(id);
    }
}

//! The worker's gRPC stream to one store, as the root context holds it: opened on the tick
//! and reopened with backoff, claims sent on it from request contexts, completions and
//! releases from the root, and each answer, failure or passed deadline handed to whoever
//! waits for it (a request's journey, or the store writes).
//!
//! Envoy routes a stream's messages to the context that opened it, and only that context may
//! send on it (`../shared/notes/envoy-proxy-wasm.md`): a request switches to the root to
//! send, and the root switches to the request to resume or answer it.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use idempotency_protocol::stream::{self, CallOp, Reply};

use crate::config::StoreConfig;
use crate::host::Host;
use crate::rule_handle::RuleHandle;
use crate::store::pending_write::PendingWrite;
use crate::store::stream::{NotSent, StoreStream, StreamLimits};

/// The store's streaming method (`proto/idempotency_store.proto`).
pub const SERVICE: &str = "idempotency.store.v1.Store";
pub const METHOD: &str = "Coordinate";
/// Largest message the filter sends until the store announces its own limit: the store's
/// default `--max-body-bytes`. A completion over the limit goes without its response body (a
/// replay then carries the omitted-body marker); one the store refuses as too large anyway is
/// sent again without it.
pub const MAX_MESSAGE_BYTES: usize = 4 * 1024 * 1024;
/// The initial metadata in which the store announces the largest message it takes.
pub const STORE_LIMIT_METADATA: &str = "x-idempotency-store-max-message-bytes";
/// Announced limits are taken within these bounds: below, not even a small completion would
/// go; above, one message would take most of the worker's 16 MiB write budget.
const ANNOUNCED_LIMIT_BOUNDS: std::ops::RangeInclusive<usize> = 4096..=(16 * 1024 * 1024);

/// A request whose claim is on the stream.
pub struct ClaimWaiter {
    /// The call's id on the stream (set when it is sent).
    pub call_id: u64,
    pub context_id: u32,
    /// The rule and the claim, to undo it should the request be gone when the answer comes.
    pub rule: Rc<RuleHandle>,
    pub call: CallOp,
}

/// Who waits for a call's answer; each carries the call it sent.
pub enum Waiter {
    Claim(ClaimWaiter),
    Write(PendingWrite),
}

impl Waiter {
    fn call(&self) -> &CallOp {
        match self {
            Waiter::Claim(claim) => &claim.call,
            Waiter::Write(write) => &write.call,
        }
    }
}

/// Why a call did not go out.
pub struct Unsent {
    pub waiter: Waiter,
    pub why: String,
}

/// Claims made while no stream is open wait for one, up to this many per stream.
const MAX_WAITING_FOR_STREAM: usize = 1024;

/// A claim waiting for the stream to open.
struct WaitingForStream {
    id: u64,
    waiter: Waiter,
    deadline_ms: u64,
}

pub struct StoreLink {
    pub store: Rc<StoreConfig>,
    stream: RefCell<StoreStream<Waiter>>,
    waiting: RefCell<VecDeque<WaitingForStream>>,
    /// The largest message the store takes, as it last announced it.
    max_message_bytes: std::cell::Cell<usize>,
}

impl StoreLink {
    pub fn new(store: Rc<StoreConfig>) -> StoreLink {
        StoreLink {
            store,
            stream: RefCell::new(StoreStream::new(StreamLimits::default())),
            waiting: RefCell::new(VecDeque::new()),
            max_message_bytes: std::cell::Cell::new(MAX_MESSAGE_BYTES),
        }
    }

    /// The largest message this stream may carry.
    pub fn max_message_bytes(&self) -> usize {
        self.max_message_bytes.get()
    }

    /// From the root: the stream `handle` opened with this initial metadata; the store's
    /// announced limit replaces the default. False when the stream is not this link's.
    pub fn on_initial_metadata(&self, host: &impl Host, handle: u32) -> bool {
        if self.handle() != Some(handle) {
            return false;
        }
        let metadata = match host.grpc_initial_metadata() {
            Ok(pairs) => pairs,
            Err(e) => {
                log::debug!("store stream metadata unreadable: {}", e.0);
                return true;
            }
        };
        let announced = metadata
            .iter()
            .find(|(name, _)| name == STORE_LIMIT_METADATA)
            .and_then(|(_, value)| {
                std::str::from_utf8(value)
                    .ok()?
                    .trim()
                    .parse::<usize>()
                    .ok()
            });
        if let Some(limit) = announced {
            let lo = *ANNOUNCED_LIMIT_BOUNDS.start();
            let hi = *ANNOUNCED_LIMIT_BOUNDS.end();
            let taken = limit.clamp(lo, hi);
            if taken != self.max_message_bytes.get() {
                log::info!(
                    "store {} takes messages of up to {limit} bytes; completions over {taken} \
                     go without their response body",
                    self.store.cluster
                );
            }
            self.max_message_bytes.set(taken);
        }
        true
    }

    /// The open stream's handle, if any.
    pub fn handle(&self) -> Option<u32> {
        self.stream.borrow().handle()
    }

    pub fn outstanding(&self) -> usize {
        self.stream.borrow().outstanding()
    }

    /// From the root: opens the stream when none is open and the backoff has passed (or,
    /// when claims wait for it or `writes_due`, the shorter on-demand pause), and sends the
    /// claims that waited for it. Returns the waiters whose calls could not be sent.
    pub fn open_if_due(&self, host: &impl Host, writes_due: bool) -> Vec<Waiter> {
        let now = host.now_ms();
        let due = {
            let stream = self.stream.borrow();
            let demand = writes_due || !self.waiting.borrow().is_empty();
            stream.due_to_open(now) || (demand && stream.due_on_demand(now))
        };
        if !due {
            return Vec::new();
        }
        let authorization = self.store.token.as_ref().map(|t| format!("Bearer {t}"));
        let metadata: Vec<(&str, &[u8])> = authorization
            .as_deref()
            .map(|a| ("authorization", a.as_bytes()))
            .into_iter()
            .collect();
        // The service as a GrpcService message, for its authority; the host takes it as text,
        // which it is unless a name is longer than 127 bytes (then the bare cluster name).
        let service = stream::envoy_grpc_service(&self.store.cluster, &self.store.authority);
        let target = std::str::from_utf8(&service).unwrap_or(&self.store.cluster);
        match host.open_grpc_stream(target, SERVICE, METHOD, &metadata) {
            Ok(handle) => {
                log::debug!("store stream to {} opened", self.store.cluster);
                self.stream.borrow_mut().opened(now, handle);
                self.send_waiting(host)
            }
            Err(e) => {
                log::warn!(
                    "store stream to cluster {} not opened: {}",
                    self.store.cluster,
                    e.0
                );
                self.stream.borrow_mut().open_failed(now);
                Vec::new()
            }
        }
    }

    /// Sends `waiter`'s call. `from_context` is the context running now; the send itself
    /// happens as the root, which owns the stream. A claim made while no stream is open
    /// waits for one, within its deadline: the caller wakes the root, which opens it.
    pub fn send(
        &self,
        host: &impl Host,
        root_context: u32,
        from_context: u32,
        mut waiter: Waiter,
    ) -> Result<u64, Box<Unsent>> {
        let id = self.stream.borrow_mut().next_call_id();
        if let Waiter::Claim(claim) = &mut waiter {
            claim.call_id = id;
        }
        let prepared = self.stream.borrow_mut().prepare(id, waiter.call());
        let outgoing = match prepared {
            Ok(o) => o,
            Err(NotSent::NoStream)
                if matches!(waiter, Waiter::Claim(_))
                    && self.waiting.borrow().len() < MAX_WAITING_FOR_STREAM =>
            {
                let deadline_ms = host.now_ms().saturating_add(self.timeout_ms(waiter.call()));
                self.waiting.borrow_mut().push_back(WaitingForStream {
                    id,
                    waiter,
                    deadline_ms,
                });
                return Ok(id);
            }
            Err(why) => {
                let why = match why {
                    NotSent::NoStream => "no stream to the store is open",
                    NotSent::TooManyOutstanding => "too many calls wait for the store",
                };
                return Err(Box::new(Unsent {
                    waiter,
                    why: why.to_string(),
                }));
            }
        };
        let switch = from_context != root_context;
        let sent = if switch {
            host.set_effective_context(root_context)
                .and_then(|()| host.send_grpc_message(outgoing.handle, &outgoing.message))
        } else {
            host.send_grpc_message(outgoing.handle, &outgoing.message)
        };
        if switch {
            if let Err(e) = host.set_effective_context(from_context) {
                log::error!("request context not restored after a store send: {}", e.0);
            }
        }
        match sent {
            Ok(()) => {
                let timeout_ms = self.timeout_ms(waiter.call());
                self.stream
                    .borrow_mut()
                    .track(outgoing.id, host.now_ms(), waiter, timeout_ms);
                Ok(outgoing.id)
            }
            Err(e) => Err(Box::new(Unsent {
                waiter,
                why: format!("stream send refused: {}", e.0),
            })),
        }
    }

    /// How long the store has to answer `call`: the store's timeout, and for a wait the
    /// wait's own length on top.
    fn timeout_ms(&self, call: &CallOp) -> u64 {
        match call {
            CallOp::Wait { wait_ms, .. } => self.store.timeout_ms.saturating_add(*wait_ms),
            _ => self.store.timeout_ms,
        }
    }

    /// From the root, once the stream is open: sends the claims that waited for it. Those
    /// the host refuses come back to be failed.
    fn send_waiting(&self, host: &impl Host) -> Vec<Waiter> {
        let waiting: Vec<WaitingForStream> = self.waiting.borrow_mut().drain(..).collect();
        let mut failed = Vec::new();
        for w in waiting {
            let prepared = self.stream.borrow_mut().prepare(w.id, w.waiter.call());
            let sent = prepared
                .map_err(|_| ())
                .and_then(|o| host.send_grpc_message(o.handle, &o.message).map_err(|_| ()));
            match sent {
                Ok(()) => {
                    let timeout = w.deadline_ms.saturating_sub(host.now_ms());
                    self.stream
                        .borrow_mut()
                        .track(w.id, host.now_ms(), w.waiter, timeout);
                }
                Err(()) => failed.push(w.waiter),
            }
        }
        failed
    }

    /// Whether claims wait for a stream (the root should open one).
    pub fn has_waiting(&self) -> bool {
        !self.waiting.borrow().is_empty()
    }

    /// Takes back the call `id` (its request went away); None if it was already answered.
    pub fn forget(&self, id: u64) -> Option<Waiter> {
        let mut waiting = self.waiting.borrow_mut();
        if let Some(at) = waiting.iter().position(|w| w.id == id) {
            return waiting.remove(at).map(|w| w.waiter);
        }
        drop(waiting);
        self.stream.borrow_mut().forget(id)
    }

    /// From the root: a message arrived on `handle`. None when it is not this link's stream
    /// or nobody waits for the answer any more.
    pub fn on_message(
        &self,
        host: &impl Host,
        handle: u32,
        size: usize,
    ) -> Option<(Waiter, Reply)> {
        if self.handle() != Some(handle) {
            return None;
        }
        let bytes = match host.grpc_message(size) {
            Ok(bytes) => bytes,
            Err(e) => {
                log::warn!("store stream message unreadable: {}", e.0);
                return None;
            }
        };
        match self.stream.borrow_mut().on_message(host.now_ms(), &bytes) {
            Ok(found) => found,
            Err(e) => {
                // Its call times out on the tick: the rule's failure policy applies then.
                log::warn!("store stream message is not an answer: {e}");
                None
            }
        }
    }

    /// From the root: `handle` closed. Every outstanding call failed (None if not ours).
    pub fn on_close(&self, host: &impl Host, handle: u32, status: u32) -> Option<Vec<Waiter>> {
        if self.handle() != Some(handle) {
            return None;
        }
        let name = grpc_status_name(status);
        // The store answers an unknown token UNAUTHENTICATED and its operators' token (which
        // an Envoy must never hold) PERMISSION_DENIED.
        if status == GRPC_UNAUTHENTICATED || status == GRPC_PERMISSION_DENIED {
            log::error!(
                "store stream to {} refused: {name} ({status}): the store does not accept \
                 this filter's store.token",
                self.store.cluster
            );
        } else {
            log::warn!(
                "store stream to {} closed: {name} ({status}); reopened after a backoff",
                self.store.cluster
            );
        }
        // Envoy keeps a remotely closed stream until it is closed here too.
        if let Err(e) = host.close_grpc_stream(handle, false) {
            log::debug!("closed store stream not released: {}", e.0);
        }
        Some(self.stream.borrow_mut().on_close(host.now_ms()))
    }

    /// From the root's tick: calls past their deadline. A stream that answered nothing since
    /// the oldest of them was sent is frozen (a stopped store closes nothing): reset it, and
    /// every other call on it fails too.
    /// Returns the calls that were sent, then those that never were.
    pub fn expire(&self, host: &impl Host) -> (Vec<Waiter>, Vec<Waiter>) {
        let now = host.now_ms();
        let expired = self.stream.borrow_mut().expire(now);
        let mut waiters = expired.waiters;
        // Claims that waited for a stream past their deadline.
        let mut waiting = self.waiting.borrow_mut();
        let (late, keep): (Vec<_>, Vec<_>) = waiting.drain(..).partition(|w| w.deadline_ms <= now);
        waiting.extend(keep);
        drop(waiting);
        let never_sent = late.into_iter().map(|w| w.waiter).collect();
        if expired.stream_frozen {
            if let Some(handle) = self.handle() {
                log::warn!(
                    "store stream to {} answered nothing before the deadline; reset",
                    self.store.cluster
                );
                if let Err(e) = host.close_grpc_stream(handle, true) {
                    log::debug!("frozen store stream not reset: {}", e.0);
                }
                waiters.extend(self.stream.borrow_mut().on_close(now));
            }
        }
        (waiters, never_sent)
    }
}

const GRPC_PERMISSION_DENIED: u32 = 7;
const GRPC_UNAUTHENTICATED: u32 = 16;

/// The name of a gRPC status code, for logs.
fn grpc_status_name(code: u32) -> &'static str {
    match code {
        0 => "OK",
        1 => "CANCELLED",
        2 => "UNKNOWN",
        3 => "INVALID_ARGUMENT",
        4 => "DEADLINE_EXCEEDED",
        GRPC_PERMISSION_DENIED => "PERMISSION_DENIED",
        8 => "RESOURCE_EXHAUSTED",
        11 => "OUT_OF_RANGE",
        12 => "UNIMPLEMENTED",
        13 => "INTERNAL",
        14 => "UNAVAILABLE",
        GRPC_UNAUTHENTICATED => "UNAUTHENTICATED",
        _ => "other",
    }
}

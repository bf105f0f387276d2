//! A loaded configuration's courier: the store streams and requests of every worker's root,
//! carried by the module's store thread (`store_client`) over its own connections to the
//! store (docs/how-it-works.md, "The native build: who runs where").
//!
//! A worker's root queues what it would ask of proxy-wasm (open, send, close) here; the store
//! thread makes the calls, frames and unframes gRPC, and leaves what the store says in the
//! root's inbox. Envoy's main thread takes no part.
//!
//! Lifetimes: the store thread holds the courier from its load until it has retired and its
//! handoff has landed every write its roots left; `retire`, from the configuration's drop,
//! closes every root's stream in its inbox (no root of it runs again).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use idempotency_core::grpc::frame::{frame_len, PREFIX_BYTES};

use crate::handoff::Handoff;
use crate::inbox::{Inbox, StreamEvent};
use crate::store_client::{Calls, StoreThread, StoreTraffic};
use crate::store_streams::WireEvent;
use crate::store_streams::MAX_FRAME_BYTES;
pub use crate::store_streams::{grpc_frame, StreamCalls, StreamTarget};

/// gRPC statuses the courier reports itself.
pub const GRPC_UNKNOWN: u32 = 2;
/// What Envoy's gRPC client reports for a reset stream (and so the Wasm build sees).
pub const GRPC_INTERNAL: u32 = 13;
pub const GRPC_UNAVAILABLE: u32 = 14;

/// Operations queued at most: past it a root's open, send or close is refused (and core
/// fails the call by its rules) rather than the queue growing while the store thread is
/// stuck.
const MAX_QUEUED: usize = 65_536;
/// New work (a claim, a wait, a lookup) is turned away past this, so the last quarter of the
/// queue is kept for completions, releases and renewals: a store thread that falls behind
/// refuses new claims (503 under `fail_closed`, nothing run) before it lets a running write's
/// lease lapse or its record go unsent.
const MAX_QUEUED_NEW_WORK: usize = MAX_QUEUED / 4 * 3;

/// What a worker's root asks of the store thread.
enum Operation {
    Open {
        token: u32,
        inbox: Arc<Inbox>,
        target: StreamTarget,
    },
    /// A whole gRPC frame.
    Send {
        token: u32,
        frame: Vec<u8>,
    },
    Close {
        token: u32,
        reset: bool,
    },
    /// The store ended its side (or broke the framing): end ours too, or reset, so Envoy
    /// frees the stream. Made on the next run, never inside Envoy's callback for it.
    Finish {
        stream_id: u64,
        reset: bool,
    },
}

#[derive(Default)]
struct Outbox {
    operations: VecDeque<Operation>,
    /// A run is on its way: later operations ride on it.
    armed: bool,
    retired: bool,
}

/// One open stream, on the store thread.
struct Route {
    token: u32,
    inbox: Arc<Inbox>,
    /// Bytes of a message not whole yet.
    partial: Vec<u8>,
}

#[derive(Default)]
struct Streams {
    by_stream: HashMap<u64, Route>,
    by_token: HashMap<u32, u64>,
}

pub struct Courier {
    me: Weak<Courier>,
    /// Run by the process's store thread (false: by its caller, in tests).
    attached: bool,
    /// The store's `host:port` by the cluster name core gives it.
    addresses: HashMap<String, String>,
    outbox: Mutex<Outbox>,
    /// Touched on the store thread only; a lock because the courier is shared.
    streams: Mutex<Streams>,
    next_token: AtomicU32,
    /// Operations refused because the queue was full.
    pub overflowed: AtomicU64,
    /// The roots' handed-off writes, landed from here when their roots do not.
    pub handoff: Handoff,
}

#[cfg(test)]
thread_local! {
    static LOADED_IN_TESTS: std::cell::RefCell<Option<Arc<Courier>>> =
        const { std::cell::RefCell::new(None) };
}

fn relock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Whole between statements: usable after a panic elsewhere.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The gRPC status a stream's trailers (or trailers-only headers) carry; without one, what
/// the HTTP status maps to (gRPC's HTTP-to-status table), else UNKNOWN.
fn status_of(headers: &[(String, Vec<u8>)]) -> u32 {
    let value = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
            .map(str::trim)
    };
    if let Some(status) = value("grpc-status").and_then(|s| s.parse().ok()) {
        return status;
    }
    match value(":status") {
        Some("400") => GRPC_INTERNAL,
        Some("401") => 16,
        Some("403") => 7,
        Some("404") => 12,
        Some("429" | "502" | "503" | "504") => GRPC_UNAVAILABLE,
        _ => GRPC_UNKNOWN,
    }
}

impl Courier {
    /// The courier of a configuration whose stores are at `addresses` (by cluster name),
    /// known to the store thread from now on.
    pub fn new(addresses: HashMap<String, String>) -> Arc<Courier> {
        #[cfg(test)]
        {
            let courier = Courier::made(addresses, false);
            LOADED_IN_TESTS.with(|loaded| *loaded.borrow_mut() = Some(Arc::clone(&courier)));
            courier
        }
        #[cfg(not(test))]
        {
            let courier = Courier::made(addresses, true);
            StoreThread::process().register(Arc::clone(&courier) as Arc<dyn StoreTraffic>);
            courier
        }
    }

    /// A courier the store thread runs (`attached`), or its caller (tests).
    fn made(addresses: HashMap<String, String>, attached: bool) -> Arc<Courier> {
        Arc::new_cyclic(|me| Courier {
            me: me.clone(),
            attached,
            addresses,
            outbox: Mutex::new(Outbox::default()),
            streams: Mutex::new(Streams::default()),
            next_token: AtomicU32::new(1),
            overflowed: AtomicU64::new(0),
            handoff: Handoff::default(),
        })
    }

    /// A courier for tests: nothing runs it but the test.
    #[cfg(test)]
    pub fn for_tests() -> Arc<Courier> {
        Courier::made(HashMap::new(), false)
    }

    /// The courier of the configuration this test thread loaded last (tests run it by hand,
    /// with the mocked ABI's streams and callouts standing for the store thread's).
    #[cfg(test)]
    pub fn loaded_last() -> Option<Arc<Courier>> {
        LOADED_IN_TESTS.with(|loaded| loaded.borrow().clone())
    }

    /// The store address the native build dials for `cluster`.
    pub fn address_of(&self, cluster: &str) -> Option<String> {
        self.addresses.get(cluster).cloned()
    }

    /// Queues `operation` and has the store thread run it (once per batch). Err when the
    /// configuration is gone or the queue is full.
    fn submit(&self, operation: Operation) -> Result<(), String> {
        self.submit_within(operation, MAX_QUEUED)
    }

    /// `submit`, refused once `bound` operations wait.
    fn submit_within(&self, operation: Operation, bound: usize) -> Result<(), String> {
        let mut outbox = relock(&self.outbox);
        if outbox.retired {
            return Err("the configuration is gone (a push replaced it)".into());
        }
        if outbox.operations.len() >= bound {
            let overflowed = self.overflowed.fetch_add(1, Ordering::Relaxed) + 1;
            // The first, then at each power of two.
            if overflowed.is_power_of_two() {
                log::error!(
                    "the store thread is not keeping up: {overflowed} store operation(s) \
                     refused so far"
                );
            }
            return Err("the store queue is full".into());
        }
        if !outbox.armed && self.attached {
            let me = self.me.upgrade().ok_or("the courier is going")?;
            StoreThread::process().run(me as Arc<dyn StoreTraffic>)?;
            outbox.armed = true;
        }
        outbox.operations.push_back(operation);
        Ok(())
    }

    /// A token for a root's stream.
    fn new_token(&self) -> u32 {
        loop {
            // Zero is proxy-wasm's "none"; a wrap after 4 billion skips it.
            let token = self.next_token.fetch_add(1, Ordering::Relaxed);
            if token != 0 {
                return token;
            }
        }
    }

    /// From a worker's root: a stream for `inbox`'s root; its events go there. The token
    /// names it in sends and closes.
    pub fn open(&self, inbox: &Arc<Inbox>, target: StreamTarget) -> Result<u32, String> {
        let token = self.new_token();
        self.submit(Operation::Open {
            token,
            inbox: Arc::clone(inbox),
            target,
        })?;
        Ok(token)
    }

    /// From a worker's root: one message, sent after everything queued before it.
    pub fn send(&self, token: u32, message: &[u8]) -> Result<(), String> {
        let bound = if idempotency_protocol::stream::asks_for_new_work(message) {
            MAX_QUEUED_NEW_WORK
        } else {
            MAX_QUEUED
        };
        self.submit_within(
            Operation::Send {
                token,
                frame: grpc_frame(message),
            },
            bound,
        )
    }

    /// From a worker's root: no event comes for the stream afterwards (as proxy-wasm's
    /// close and cancel).
    pub fn close(&self, token: u32, reset: bool) -> Result<(), String> {
        self.submit(Operation::Close { token, reset })
    }

    /// On the store thread: makes every queued call, in order, then lands what the roots
    /// left unsettled too long.
    pub fn run(&self, calls: &impl StreamCalls) {
        self.run_operations(calls);
        self.sweep(calls);
    }

    /// On the store thread: lands what the roots left unsettled too long.
    pub fn sweep(&self, calls: &impl StreamCalls) {
        self.handoff.sweep(calls, crate::ledger::now_ms());
    }

    /// Retired, and nothing left to land: the store thread lets it go.
    pub fn is_done(&self) -> bool {
        relock(&self.outbox).retired && !self.handoff.has_work()
    }

    /// The store thread lost its connections (its runtime was built again after a panic):
    /// every root's stream is closed in its inbox, and the handoff's attempts failed.
    pub fn streams_lost(&self) {
        let routes: Vec<Route> = {
            let mut streams = relock(&self.streams);
            streams.by_token.clear();
            streams.by_stream.drain().map(|(_, route)| route).collect()
        };
        for route in routes {
            route.inbox.deliver(StreamEvent::Closed {
                token: route.token,
                status: GRPC_UNAVAILABLE,
            });
        }
        self.handoff.streams_lost(crate::ledger::now_ms());
    }

    /// Every stream this courier has open (reset when it is done with).
    pub fn stream_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = relock(&self.streams).by_stream.keys().copied().collect();
        ids.extend(self.handoff.stream_ids());
        ids
    }

    fn run_operations(&self, calls: &impl StreamCalls) {
        let queued = {
            let mut outbox = relock(&self.outbox);
            outbox.armed = false;
            outbox.operations.len()
        };
        // One at a time, and only those queued now: a panic loses the one it hit, never the
        // rest (their roots still hear of every stream they opened).
        for _ in 0..queued {
            let Some(operation) = relock(&self.outbox).operations.pop_front() else {
                break;
            };
            match operation {
                Operation::Open {
                    token,
                    inbox,
                    target,
                } => self.start(calls, token, inbox, &target),
                Operation::Send { token, frame } => self.send_frame(calls, token, &frame),
                Operation::Close { token, reset } => {
                    let route = self.unroute_token(token);
                    // A close ends our side (the store then ends its own); a reset, or a
                    // stream that cannot be ended, goes at once.
                    if let Some(stream_id) = route {
                        if reset || !calls.send(stream_id, &[], true) {
                            calls.reset(stream_id);
                        }
                    }
                }
                Operation::Finish { stream_id, reset } => {
                    // False: Envoy freed it already.
                    if reset || !calls.send(stream_id, &[], true) {
                        calls.reset(stream_id);
                    }
                }
            }
        }
    }

    fn start(
        &self,
        calls: &impl StreamCalls,
        token: u32,
        inbox: Arc<Inbox>,
        target: &StreamTarget,
    ) {
        match target.start(calls) {
            Ok(stream_id) => {
                let mut streams = relock(&self.streams);
                streams.by_token.insert(token, stream_id);
                streams.by_stream.insert(
                    stream_id,
                    Route {
                        token,
                        inbox,
                        partial: Vec::new(),
                    },
                );
            }
            Err(why) => {
                log::warn!(
                    "store stream to cluster {} not started: {why}",
                    target.cluster
                );
                inbox.deliver(StreamEvent::Closed {
                    token,
                    status: GRPC_UNAVAILABLE,
                });
            }
        }
    }

    fn send_frame(&self, calls: &impl StreamCalls, token: u32, frame: &[u8]) {
        let stream_id = relock(&self.streams).by_token.get(&token).copied();
        // No route: the stream closed (its root has the Closed event, or will) and the calls
        // on it fail by core's rules.
        let Some(stream_id) = stream_id else { return };
        if !calls.send(stream_id, frame, false) {
            self.close_in_inbox(stream_id, GRPC_UNAVAILABLE);
        }
    }

    fn unroute_token(&self, token: u32) -> Option<u64> {
        let mut streams = relock(&self.streams);
        let stream_id = streams.by_token.remove(&token)?;
        streams.by_stream.remove(&stream_id);
        Some(stream_id)
    }

    /// Ends the route of `stream_id` and tells its root the stream closed with `status`.
    fn close_in_inbox(&self, stream_id: u64, status: u32) {
        let route = {
            let mut streams = relock(&self.streams);
            let route = streams.by_stream.remove(&stream_id);
            if let Some(route) = &route {
                streams.by_token.remove(&route.token);
            }
            route
        };
        if let Some(route) = route {
            route.inbox.deliver(StreamEvent::Closed {
                token: route.token,
                status,
            });
        }
    }

    /// On the store thread: what the store said on `stream_id`.
    pub fn on_stream_event(&self, stream_id: u64, event: WireEvent) {
        if self.handoff.owns(stream_id) {
            self.handoff
                .on_stream_event(stream_id, event, crate::ledger::now_ms());
            return;
        }
        match event {
            WireEvent::Headers {
                headers,
                end_stream: true,
            } => {
                // Trailers-only: the store refused the stream (or Envoy answered for it).
                self.close_in_inbox(stream_id, status_of(&headers));
            }
            WireEvent::Headers { headers, .. } => {
                let ok = headers.iter().any(|(n, v)| n == ":status" && v == b"200");
                if ok {
                    self.to_root(stream_id, |token| StreamEvent::InitialMetadata {
                        token,
                        headers,
                    });
                } else {
                    self.close_in_inbox(stream_id, status_of(&headers));
                    self.finish(stream_id, true);
                }
            }
            WireEvent::Data { data, end_stream } => {
                self.on_data(stream_id, &data);
                if end_stream {
                    // A gRPC answer ends with trailers; a body that ends is a broken one.
                    self.close_in_inbox(stream_id, GRPC_INTERNAL);
                }
            }
            WireEvent::Trailers(trailers) => {
                self.close_in_inbox(stream_id, status_of(&trailers));
                self.finish(stream_id, false);
            }
            // Complete after trailers finds no route; a stream completed without them
            // ended without a status.
            WireEvent::Complete => self.close_in_inbox(stream_id, GRPC_UNKNOWN),
            WireEvent::Reset => self.close_in_inbox(stream_id, GRPC_INTERNAL),
        }
    }

    fn to_root(&self, stream_id: u64, event: impl FnOnce(u32) -> StreamEvent) {
        let routed = relock(&self.streams)
            .by_stream
            .get(&stream_id)
            .map(|route| (route.token, Arc::clone(&route.inbox)));
        if let Some((token, inbox)) = routed {
            inbox.deliver(event(token));
        }
    }

    /// Appends `data` to the stream's partial message and hands the root every whole one.
    fn on_data(&self, stream_id: u64, data: &[u8]) {
        let mut messages = Vec::new();
        let mut malformed = false;
        let routed = {
            let mut streams = relock(&self.streams);
            let Some(route) = streams.by_stream.get_mut(&stream_id) else {
                return;
            };
            route.partial.extend_from_slice(data);
            // Bounded: each pass takes a whole frame off the front or stops.
            loop {
                match frame_len(&route.partial) {
                    None => break,
                    Some(Err(())) => {
                        malformed = true;
                        break;
                    }
                    Some(Ok(len)) if len > MAX_FRAME_BYTES => {
                        malformed = true;
                        break;
                    }
                    Some(Ok(len)) if route.partial.len() < len => break,
                    Some(Ok(len)) => {
                        let rest = route.partial.split_off(len);
                        let frame = std::mem::replace(&mut route.partial, rest);
                        // The courier never asks for compression: a compressed message is
                        // one it cannot read.
                        if frame.first() == Some(&1) {
                            malformed = true;
                            break;
                        }
                        messages.push(frame.get(PREFIX_BYTES..).unwrap_or_default().to_vec());
                    }
                }
            }
            (route.token, Arc::clone(&route.inbox))
        };
        let (token, inbox) = routed;
        for message in messages {
            inbox.deliver(StreamEvent::Message { token, message });
        }
        if malformed {
            log::warn!("store stream sent a frame that is not a plain gRPC message; reset");
            self.close_in_inbox(stream_id, GRPC_INTERNAL);
            self.finish(stream_id, true);
        }
    }

    /// Ends our side of a stream the store ended, on the next run: not inside the task that
    /// reads it. Nothing to do once the configuration is gone.
    fn finish(&self, stream_id: u64, reset: bool) {
        let _ = self.submit(Operation::Finish { stream_id, reset });
    }

    /// From the configuration's drop: no root of it runs again, so every root's stream is
    /// reset and closed in its inbox, and so is every open still queued; no more is taken.
    /// The handoff goes on landing what the roots left until it has nothing.
    pub fn retire(&self) {
        let queued = {
            let mut outbox = relock(&self.outbox);
            outbox.retired = true;
            std::mem::take(&mut outbox.operations)
        };
        for operation in queued {
            match operation {
                Operation::Open { token, inbox, .. } => inbox.deliver(StreamEvent::Closed {
                    token,
                    status: GRPC_UNAVAILABLE,
                }),
                // A send or close on a root's stream: the stream is reset below.
                Operation::Send { .. } | Operation::Close { .. } | Operation::Finish { .. } => {}
            }
        }
        let routes: Vec<(u64, Route)> = {
            let mut streams = relock(&self.streams);
            streams.by_token.clear();
            streams.by_stream.drain().collect()
        };
        if self.attached {
            StoreThread::process()
                .transport
                .reset_all(routes.iter().map(|(id, _)| *id));
        }
        for (_, route) in routes {
            route.inbox.deliver(StreamEvent::Closed {
                token: route.token,
                status: GRPC_UNAVAILABLE,
            });
        }
    }
}

impl StoreTraffic for Courier {
    fn address_of(&self, cluster: &str) -> Option<String> {
        Courier::address_of(self, cluster)
    }
    fn run(&self, calls: &Calls<'_>) {
        Courier::run(self, calls);
    }
    fn is_done(&self) -> bool {
        Courier::is_done(self)
    }
    fn stream_ids(&self) -> Vec<u64> {
        Courier::stream_ids(self)
    }
    fn on_stream_event(&self, id: u64, event: WireEvent) {
        Courier::on_stream_event(self, id, event);
    }
    fn streams_lost(&self) {
        Courier::streams_lost(self);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    type Pairs = Vec<(String, Vec<u8>)>;

    /// Envoy's side of the configuration's streams, scripted.
    #[derive(Default)]
    struct FakeEnvoy {
        started: RefCell<Vec<(String, Pairs)>>,
        sent: RefCell<Vec<(u64, Vec<u8>, bool)>>,
        resets: RefCell<Vec<u64>>,
        refuse_start: bool,
        refuse_send: bool,
    }

    impl StreamCalls for FakeEnvoy {
        fn start(&self, cluster: &str, headers: &[(&str, &[u8])]) -> Result<u64, String> {
            if self.refuse_start {
                return Err("cluster not found".into());
            }
            let headers = headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), v.to_vec()))
                .collect();
            self.started
                .borrow_mut()
                .push((cluster.to_owned(), headers));
            Ok(100 + self.started.borrow().len() as u64)
        }
        fn send(&self, stream_id: u64, data: &[u8], end_stream: bool) -> bool {
            self.sent
                .borrow_mut()
                .push((stream_id, data.to_vec(), end_stream));
            !self.refuse_send
        }
        fn reset(&self, stream_id: u64) {
            self.resets.borrow_mut().push(stream_id);
        }
    }

    fn courier() -> Arc<Courier> {
        Courier::for_tests()
    }

    fn target() -> StreamTarget {
        StreamTarget {
            cluster: "store".into(),
            authority: "idempotency-store".into(),
            path: "/idempotency.store.v1.Store/Coordinate".into(),
            metadata: vec![("authorization".into(), b"Bearer t".to_vec())],
        }
    }

    fn header(name: &str, value: &str) -> (String, Vec<u8>) {
        (name.to_owned(), value.as_bytes().to_vec())
    }

    #[test]
    fn a_stream_opens_as_grpc_sends_frames_and_reassembles_answers() {
        let (courier, envoy, inbox) = (courier(), FakeEnvoy::default(), Arc::new(Inbox::default()));
        let token = courier.open(&inbox, target()).unwrap();
        courier.send(token, b"claim").unwrap();
        courier.run(&envoy);
        let (cluster, headers) = envoy.started.borrow()[0].clone();
        assert_eq!(cluster, "store");
        for wanted in [
            header(":method", "POST"),
            header(":path", "/idempotency.store.v1.Store/Coordinate"),
            header(":authority", "idempotency-store"),
            header("content-type", "application/grpc"),
            header("te", "trailers"),
            header("authorization", "Bearer t"),
        ] {
            assert!(headers.contains(&wanted), "{wanted:?} in {headers:?}");
        }
        assert_eq!(
            *envoy.sent.borrow(),
            vec![(101, grpc_frame(b"claim"), false)]
        );

        courier.on_stream_event(
            101,
            WireEvent::Headers {
                headers: vec![header(":status", "200"), header("x-a", "1")],
                end_stream: false,
            },
        );
        // Two answers cut across three chunks.
        let mut bytes = grpc_frame(b"first");
        bytes.extend(grpc_frame(b"second"));
        let (a, rest) = bytes.split_at(3);
        let (b, c) = rest.split_at(9);
        for chunk in [a, b, c] {
            courier.on_stream_event(
                101,
                WireEvent::Data {
                    data: chunk.to_vec(),
                    end_stream: false,
                },
            );
        }
        courier.on_stream_event(101, WireEvent::Trailers(vec![header("grpc-status", "0")]));
        courier.on_stream_event(101, WireEvent::Complete);
        assert_eq!(
            inbox.take_all(),
            vec![
                StreamEvent::InitialMetadata {
                    token,
                    headers: vec![header(":status", "200"), header("x-a", "1")]
                },
                StreamEvent::Message {
                    token,
                    message: b"first".to_vec()
                },
                StreamEvent::Message {
                    token,
                    message: b"second".to_vec()
                },
                StreamEvent::Closed { token, status: 0 },
            ],
            "complete after the trailers adds nothing"
        );
        // Our side is ended on the next run, outside Envoy's callback.
        courier.run(&envoy);
        assert_eq!(envoy.sent.borrow().last(), Some(&(101, Vec::new(), true)));
        // A send after the close goes nowhere: the root has the Closed event.
        courier.send(token, b"late").unwrap();
        courier.run(&envoy);
        assert_eq!(envoy.sent.borrow().len(), 2);
    }

    #[test]
    fn a_stream_that_cannot_start_or_take_a_message_is_closed_in_its_root() {
        let courier = courier();
        let inbox = Arc::new(Inbox::default());
        let refusing = FakeEnvoy {
            refuse_start: true,
            ..FakeEnvoy::default()
        };
        let token = courier.open(&inbox, target()).unwrap();
        courier.send(token, b"claim").unwrap();
        courier.run(&refusing);
        assert_eq!(
            inbox.take_all(),
            vec![StreamEvent::Closed {
                token,
                status: GRPC_UNAVAILABLE
            }]
        );
        assert!(refusing.sent.borrow().is_empty());

        let full = FakeEnvoy {
            refuse_send: true,
            ..FakeEnvoy::default()
        };
        let token = courier.open(&inbox, target()).unwrap();
        courier.send(token, b"claim").unwrap();
        courier.run(&full);
        assert_eq!(
            inbox.take_all(),
            vec![StreamEvent::Closed {
                token,
                status: GRPC_UNAVAILABLE
            }]
        );
    }

    #[test]
    fn refusals_resets_and_broken_frames_close_with_a_status() {
        let (courier, envoy, inbox) = (courier(), FakeEnvoy::default(), Arc::new(Inbox::default()));
        let open = |n: usize| {
            let token = courier.open(&inbox, target()).unwrap();
            courier.run(&envoy);
            (token, 100 + n as u64)
        };
        let (t1, s1) = open(1);
        courier.on_stream_event(
            s1,
            WireEvent::Headers {
                headers: vec![header(":status", "200"), header("grpc-status", "16")],
                end_stream: true,
            },
        );
        let (t2, s2) = open(2);
        courier.on_stream_event(
            s2,
            WireEvent::Headers {
                headers: vec![header(":status", "503")],
                end_stream: false,
            },
        );
        let (t3, s3) = open(3);
        courier.on_stream_event(s3, WireEvent::Reset);
        let (t4, s4) = open(4);
        let mut compressed = grpc_frame(b"zip");
        compressed[0] = 1;
        courier.on_stream_event(
            s4,
            WireEvent::Data {
                data: compressed,
                end_stream: false,
            },
        );
        let (t5, s5) = open(5);
        courier.on_stream_event(s5, WireEvent::Complete);
        assert_eq!(
            inbox.take_all(),
            vec![
                StreamEvent::Closed {
                    token: t1,
                    status: 16
                },
                StreamEvent::Closed {
                    token: t2,
                    status: GRPC_UNAVAILABLE
                },
                StreamEvent::Closed {
                    token: t3,
                    status: GRPC_INTERNAL
                },
                StreamEvent::Closed {
                    token: t4,
                    status: GRPC_INTERNAL
                },
                StreamEvent::Closed {
                    token: t5,
                    status: GRPC_UNKNOWN
                },
            ]
        );
        courier.run(&envoy);
        assert_eq!(
            *envoy.resets.borrow(),
            vec![s2, s4],
            "what the store broke is reset"
        );
    }

    /// Review: a length prefix over any message the store may send (its announced limit is
    /// capped at 16 MiB) is garbage: the stream closes in its root and is reset at once,
    /// instead of the main thread buffering up to 4 GiB of whatever follows.
    #[test]
    fn a_frame_larger_than_any_store_message_closes_the_stream_at_once() {
        let (courier, envoy, inbox) = (courier(), FakeEnvoy::default(), Arc::new(Inbox::default()));
        let token = courier.open(&inbox, target()).unwrap();
        courier.run(&envoy);
        let mut data = vec![0u8];
        data.extend_from_slice(&u32::MAX.to_be_bytes());
        data.extend_from_slice(&[7u8; 1024]);
        courier.on_stream_event(
            101,
            WireEvent::Data {
                data,
                end_stream: false,
            },
        );
        assert_eq!(
            inbox.take_all(),
            vec![StreamEvent::Closed {
                token,
                status: GRPC_INTERNAL
            }]
        );
        courier.run(&envoy);
        assert_eq!(*envoy.resets.borrow(), vec![101]);
    }

    #[test]
    fn a_local_close_or_reset_delivers_nothing_to_the_root() {
        let (courier, envoy, inbox) = (courier(), FakeEnvoy::default(), Arc::new(Inbox::default()));
        let a = courier.open(&inbox, target()).unwrap();
        let b = courier.open(&inbox, target()).unwrap();
        courier.run(&envoy);
        courier.close(a, false).unwrap();
        courier.close(b, true).unwrap();
        courier.run(&envoy);
        assert_eq!(envoy.sent.borrow().last(), Some(&(101, Vec::new(), true)));
        assert_eq!(*envoy.resets.borrow(), vec![102]);
        courier.on_stream_event(101, WireEvent::Trailers(vec![header("grpc-status", "0")]));
        assert!(inbox.take_all().is_empty());
    }

    #[test]
    fn a_retired_configuration_closes_every_stream_and_takes_no_more() {
        let (courier, envoy) = (courier(), FakeEnvoy::default());
        let (worker_a, worker_b) = (Arc::new(Inbox::default()), Arc::new(Inbox::default()));
        let open_a = courier.open(&worker_a, target()).unwrap();
        courier.run(&envoy);
        // Worker B's open is still queued when Envoy destroys the configuration.
        let queued_b = courier.open(&worker_b, target()).unwrap();
        courier.retire();
        assert_eq!(
            worker_a.take_all(),
            vec![StreamEvent::Closed {
                token: open_a,
                status: GRPC_UNAVAILABLE
            }]
        );
        assert_eq!(
            worker_b.take_all(),
            vec![StreamEvent::Closed {
                token: queued_b,
                status: GRPC_UNAVAILABLE
            }]
        );
        assert!(courier.open(&worker_a, target()).is_err());
        assert!(courier.send(open_a, b"x").is_err());
        // Events the store thread might still have in flight find no route.
        courier.on_stream_event(101, WireEvent::Reset);
        assert!(worker_a.take_all().is_empty());
    }

    /// A store thread that does not keep up: past its bound the queue refuses a root's call
    /// (core fails it by its rules), counts it, and says so from the first refusal on.
    #[test]
    fn a_full_queue_refuses_counts_and_logs_from_the_first_refusal() {
        crate::abi::mock_abi::reset();
        crate::abi::install_logger();
        let (courier, inbox) = (courier(), Arc::new(Inbox::default()));
        for _ in 0..MAX_QUEUED {
            courier.open(&inbox, target()).unwrap();
        }
        assert!(courier.open(&inbox, target()).is_err());
        assert_eq!(courier.overflowed.load(Ordering::Relaxed), 1);
        let logs = crate::abi::mock_abi::with(|a| a.logs.clone());
        assert!(
            logs.iter()
                .any(|(_, line)| line.contains("1 store operation(s) refused")),
            "{logs:?}"
        );
    }

    /// Short of room, the queue turns new claims away first: the last quarter is kept for
    /// what finishes work already begun (a completion, release or renewal), so a store thread
    /// that falls behind refuses claims (nothing runs) before a running write's record or
    /// renewal goes unsent.
    #[test]
    fn a_filling_queue_refuses_new_claims_before_completions() {
        use idempotency_protocol::stream::{encode_call, Call, CallOp};
        let (courier, inbox) = (courier(), Arc::new(Inbox::default()));
        let stream = courier.open(&inbox, target()).unwrap();
        for _ in 1..MAX_QUEUED_NEW_WORK {
            courier.open(&inbox, target()).unwrap();
        }
        let call = |op| encode_call(&Call { id: 1, op });
        let claim = call(CallOp::Claim {
            key: "k".into(),
            fingerprint: "f".into(),
            lease_ms: 1_000,
            owner: "o".into(),
        });
        let release = call(CallOp::Release {
            key: "k".into(),
            owner: "o".into(),
        });
        assert!(
            courier.send(stream, &claim).is_err(),
            "new work turned away"
        );
        assert!(
            courier.send(stream, &release).is_ok(),
            "finishing work still taken"
        );
        while courier.open(&inbox, target()).is_ok() {}
        assert!(courier.send(stream, &release).is_err(), "full is full");
    }

    /// The store thread's runtime was built again after a panic: its streams went with it,
    /// without an event. Every root hears its stream closed (and opens another by core's
    /// rules); a root that heard nothing would wait on a stream that is gone.
    #[test]
    fn streams_lost_with_the_store_threads_runtime_are_closed_in_their_roots() {
        let (courier, envoy, inbox) = (courier(), FakeEnvoy::default(), Arc::new(Inbox::default()));
        let token = courier.open(&inbox, target()).unwrap();
        courier.run(&envoy);
        courier.streams_lost();
        assert_eq!(
            inbox.take_all(),
            vec![StreamEvent::Closed {
                token,
                status: GRPC_UNAVAILABLE
            }]
        );
        assert!(courier.stream_ids().is_empty());
    }

    /// A panic on the store thread while it makes a root's call loses that call only: the
    /// ones queued after it are made at the next run (the store thread's sweep makes one
    /// every 200 ms), so their roots hear of every stream they opened.
    #[test]
    fn a_panic_making_one_call_leaves_the_rest_for_the_next_run() {
        struct PanicsOnStart;
        impl StreamCalls for PanicsOnStart {
            fn start(&self, _cluster: &str, _headers: &[(&str, &[u8])]) -> Result<u64, String> {
                let started = std::hint::black_box(false);
                assert!(started, "the store thread panics (as asked)");
                Ok(0)
            }
            fn send(&self, _stream_id: u64, _data: &[u8], _end_stream: bool) -> bool {
                true
            }
            fn reset(&self, _stream_id: u64) {}
        }
        let (courier, envoy) = (courier(), FakeEnvoy::default());
        let (first, second) = (Arc::new(Inbox::default()), Arc::new(Inbox::default()));
        courier.open(&first, target()).unwrap();
        let token = courier.open(&second, target()).unwrap();
        let ran =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| courier.run(&PanicsOnStart)));
        assert!(ran.is_err());
        courier.run(&envoy);
        assert_eq!(envoy.started.borrow().len(), 1, "the second open is made");
        courier.streams_lost();
        assert_eq!(
            second.take_all(),
            vec![StreamEvent::Closed {
                token,
                status: GRPC_UNAVAILABLE
            }]
        );
    }

    /// A push that removes the filter: no root of the old configuration runs again, and its
    /// courier goes on landing what they handed off until the store has it.
    #[test]
    fn a_retired_configuration_lands_every_write_its_roots_handed_off() {
        use idempotency_protocol::stream::{decode_call, encode_answer, encode_call_parts};
        use idempotency_protocol::stream::{Answer, CallOp, Reply};
        let (courier, envoy) = (courier(), FakeEnvoy::default());
        let ledger = Arc::new(crate::ledger::Ledger::default());
        courier.handoff.adopt(Arc::clone(&ledger));
        let now = crate::ledger::now_ms();
        let call = encode_call_parts(
            0,
            &CallOp::Release {
                key: "k".repeat(64),
                owner: "o".into(),
            },
        );
        let write = idempotency_core::host::HandedOffWrite {
            id: 1,
            cluster: "store",
            authority: "idempotency-store",
            authorization: None,
            call,
            deadline_ms: now + 60_000,
            settles_within_ms: 0,
            http: None,
            on_landed: None,
        };
        ledger.record(&write, now).unwrap();
        courier.retire();
        drop(ledger);
        assert!(!courier.is_done(), "a write is left to land");
        courier.sweep(&envoy);
        let sent = envoy.sent.borrow().clone();
        let [(stream, frame, false)] = &sent[..] else {
            panic!("one send: {sent:?}");
        };
        let call = decode_call(&frame[PREFIX_BYTES..]).unwrap();
        let answer = grpc_frame(&encode_answer(&Answer {
            id: call.id,
            reply: Reply::Released,
        }));
        courier.on_stream_event(
            *stream,
            WireEvent::Data {
                data: answer,
                end_stream: false,
            },
        );
        assert!(courier.is_done(), "landed: the store thread lets it go");
    }
}

//! The store thread's landing of handed-off store writes (docs/native-host.md, "The write
//! handoff"): the entries of its roots' ledgers that stay unsettled past their grace are sent
//! on streams of the courier's own, one per store target, and retried with backoff until the
//! store answers or their deadline passes. Answers settle ledger entries only: never a root or
//! a request (a root settles its own copy when it runs; the store takes a duplicate
//! harmlessly: docs/store-protocol.md, "Idempotent for the same bytes", and a late release).
//!
//! A retired configuration's handoff goes on until its ledgers are empty: the store thread
//! holds its courier until then.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use idempotency_core::grpc::frame::{frame_len, PREFIX_BYTES};
use idempotency_protocol::stream::{decode_answer, decode_call, encode_call_parts};
use idempotency_protocol::stream::{FailureKind, Reply};

use crate::ledger::{DueWrite, Ledger};
use crate::store_streams::WireEvent;
use crate::store_streams::{grpc_frame, StreamCalls, StreamTarget, MAX_FRAME_BYTES};

fn relock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One of the handoff's own streams, to one store target.
struct Carrier {
    stream_id: u64,
    /// Bytes of an answer not whole yet.
    partial: Vec<u8>,
    /// Call id on this stream -> the ledger and entry it lands, and when it counts as lost.
    in_flight: HashMap<u64, InFlight>,
}

struct InFlight {
    ledger: Arc<Ledger>,
    entry_id: u64,
    answer_by_ms: u64,
}

#[derive(Default)]
struct State {
    ledgers: Vec<Arc<Ledger>>,
    carriers: HashMap<StreamTarget, Carrier>,
    by_stream: HashMap<u64, StreamTarget>,
    /// Streams the store ended: reset on the next sweep, outside Envoy's callback.
    to_reset: Vec<u64>,
    next_call_id: u64,
}

#[derive(Default)]
pub struct Handoff {
    state: Mutex<State>,
}

impl Handoff {
    /// From a worker's root as it is built: the courier looks at its ledger from now on.
    pub fn adopt(&self, ledger: Arc<Ledger>) {
        relock(&self.state).ledgers.push(ledger);
    }

    /// Whether any ledger holds an entry.
    pub fn has_work(&self) -> bool {
        relock(&self.state).ledgers.iter().any(|l| !l.is_empty())
    }

    /// Every stream is gone (the store thread's runtime was built again): their attempts
    /// failed, due again after their backoff.
    pub fn streams_lost(&self, now_ms: u64) {
        let mut state = relock(&self.state);
        let ids: Vec<u64> = state.by_stream.keys().copied().collect();
        for stream_id in ids {
            close(&mut state, stream_id, now_ms, false);
        }
    }

    /// The handoff's own streams.
    pub fn stream_ids(&self) -> Vec<u64> {
        relock(&self.state).by_stream.keys().copied().collect()
    }

    /// Whether `stream_id` is one of the handoff's own streams.
    pub fn owns(&self, stream_id: u64) -> bool {
        relock(&self.state).by_stream.contains_key(&stream_id)
    }

    /// On the store thread: sends every ledger entry due now, on its target's stream. No
    /// lock of the handoff is held across a start or a send.
    pub fn sweep(&self, calls: &impl StreamCalls, now_ms: u64) {
        let (to_reset, ledgers) = {
            let mut state = relock(&self.state);
            // A stream with an attempt unanswered in time is frozen (a store that stopped
            // answering keeps its connection): reset, its attempts failed, backed off.
            let frozen: Vec<u64> = state
                .carriers
                .values()
                .filter(|c| c.in_flight.values().any(|f| now_ms >= f.answer_by_ms))
                .map(|c| c.stream_id)
                .collect();
            for stream_id in frozen {
                close(&mut state, stream_id, now_ms, true);
            }
            // A ledger whose root is gone and which holds nothing is done with.
            state
                .ledgers
                .retain(|l| Arc::strong_count(l) > 1 || !l.is_empty());
            (std::mem::take(&mut state.to_reset), state.ledgers.clone())
        };
        for stream_id in to_reset {
            calls.reset(stream_id);
        }
        for ledger in ledgers {
            for due in ledger.take_due(now_ms) {
                if let Err(why) = self.send(calls, &due, &ledger, now_ms) {
                    ledger.failed(due.id, now_ms, &why);
                }
            }
        }
    }

    /// Sends one entry on its target's stream (started if none is open); why it did not go.
    fn send(
        &self,
        calls: &impl StreamCalls,
        due: &DueWrite,
        ledger: &Arc<Ledger>,
        now_ms: u64,
    ) -> Result<(), String> {
        let Ok(decoded) = decode_call(&due.call) else {
            log::error!("a handed-off store write is not a store call; given up");
            ledger.settle(due.id);
            return Ok(());
        };
        let open = relock(&self.state)
            .carriers
            .get(&due.target)
            .map(|c| c.stream_id);
        let stream_id = match open {
            Some(stream_id) => stream_id,
            None => {
                let stream_id = due.target.start(calls).map_err(|why| {
                    format!(
                        "stream to cluster {} not started: {why}",
                        due.target.cluster
                    )
                })?;
                let mut state = relock(&self.state);
                state.by_stream.insert(stream_id, due.target.clone());
                state.carriers.insert(
                    due.target.clone(),
                    Carrier {
                        stream_id,
                        partial: Vec::new(),
                        in_flight: HashMap::new(),
                    },
                );
                stream_id
            }
        };
        // In flight before the send, so that whatever Envoy reports inside it finds it.
        let call_id = {
            let mut state = relock(&self.state);
            state.next_call_id = state.next_call_id.wrapping_add(1);
            let call_id = state.next_call_id;
            let Some(carrier) = state.carriers.get_mut(&due.target) else {
                return Err("the stream closed as it started".into());
            };
            carrier.in_flight.insert(
                call_id,
                InFlight {
                    ledger: Arc::clone(ledger),
                    entry_id: due.id,
                    answer_by_ms: now_ms.saturating_add(due.answer_within_ms),
                },
            );
            call_id
        };
        let frame = grpc_frame(&encode_call_parts(call_id, &decoded.op));
        if !calls.send(stream_id, &frame, false) {
            // Every attempt on it fails, this one included.
            close(&mut relock(&self.state), stream_id, now_ms, false);
        }
        Ok(())
    }

    /// On the store thread: what the store said on one of the handoff's streams.
    pub fn on_stream_event(&self, stream_id: u64, event: WireEvent, now_ms: u64) {
        let mut state = relock(&self.state);
        match event {
            WireEvent::Headers {
                headers,
                end_stream,
            } => {
                let ok = headers.iter().any(|(n, v)| n == ":status" && v == b"200");
                if end_stream || !ok {
                    close(&mut state, stream_id, now_ms, !end_stream);
                }
            }
            WireEvent::Data { data, end_stream } => {
                on_data(&mut state, stream_id, &data, now_ms);
                if end_stream {
                    close(&mut state, stream_id, now_ms, true);
                }
            }
            WireEvent::Trailers(_) => close(&mut state, stream_id, now_ms, true),
            WireEvent::Complete | WireEvent::Reset => close(&mut state, stream_id, now_ms, false),
        }
    }
}

/// The stream ended: every attempt on it failed (due again after its backoff).
fn close(state: &mut State, stream_id: u64, now_ms: u64, reset: bool) {
    let Some(target) = state.by_stream.remove(&stream_id) else {
        return;
    };
    if let Some(carrier) = state.carriers.remove(&target) {
        for attempt in carrier.in_flight.into_values() {
            let why = "the store stream closed or stopped answering";
            attempt.ledger.failed(attempt.entry_id, now_ms, why);
        }
    }
    if reset {
        state.to_reset.push(stream_id);
    }
}

fn on_data(state: &mut State, stream_id: u64, data: &[u8], now_ms: u64) {
    let Some(target) = state.by_stream.get(&stream_id).cloned() else {
        return;
    };
    let Some(carrier) = state.carriers.get_mut(&target) else {
        return;
    };
    carrier.partial.extend_from_slice(data);
    let mut malformed = false;
    // Bounded: each pass takes a whole frame off the front or stops.
    loop {
        let len = match frame_len(&carrier.partial) {
            Some(Ok(len)) if len > MAX_FRAME_BYTES => {
                malformed = true;
                break;
            }
            Some(Ok(len)) if carrier.partial.len() >= len => len,
            Some(Err(())) => {
                malformed = true;
                break;
            }
            _ => break,
        };
        let rest = carrier.partial.split_off(len);
        let frame = std::mem::replace(&mut carrier.partial, rest);
        let Some(answer) = frame
            .get(PREFIX_BYTES..)
            .filter(|_| frame.first() == Some(&0))
            .and_then(|m| decode_answer(m).ok())
        else {
            malformed = true;
            break;
        };
        let Some(InFlight {
            ledger, entry_id, ..
        }) = carrier.in_flight.remove(&answer.id)
        else {
            continue;
        };
        match answer.reply {
            Reply::Failure {
                kind: FailureKind::BadRequest,
                detail,
            } => {
                log::warn!("handed-off store write refused by the store: {detail}");
                ledger.settle(entry_id);
            }
            Reply::Failure { detail, .. } => ledger.failed(entry_id, now_ms, &detail),
            Reply::NotOwner => ledger.not_owner(entry_id, now_ms),
            // A completion taken (one already there with the same bytes answers so too).
            Reply::Recorded => ledger.recorded(entry_id, now_ms),
            _ => ledger.landed(entry_id, now_ms),
        }
    }
    if malformed {
        log::warn!("handoff stream sent a frame that is not a plain store answer; reset");
        close(state, stream_id, now_ms, true);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    use idempotency_core::host::HandedOffWrite;
    use idempotency_protocol::stream::{decode_call, encode_answer, Answer, CallOp};

    /// Envoy's side of the handoff's streams, scripted.
    #[derive(Default)]
    struct FakeEnvoy {
        started: RefCell<Vec<String>>,
        sent: RefCell<Vec<(u64, Vec<u8>)>>,
        resets: RefCell<Vec<u64>>,
    }

    impl StreamCalls for FakeEnvoy {
        fn start(&self, cluster: &str, _headers: &[(&str, &[u8])]) -> Result<u64, String> {
            self.started.borrow_mut().push(cluster.to_owned());
            Ok(500 + self.started.borrow().len() as u64)
        }
        fn send(&self, stream_id: u64, data: &[u8], _end_stream: bool) -> bool {
            self.sent.borrow_mut().push((stream_id, data.to_vec()));
            true
        }
        fn reset(&self, stream_id: u64) {
            self.resets.borrow_mut().push(stream_id);
        }
    }

    const T0: u64 = 1_700_000_000_000;

    /// A handoff looking at one root's ledger, over a scripted Envoy.
    fn adopting_one_ledger() -> (Handoff, FakeEnvoy, Arc<Ledger>) {
        let (handoff, ledger) = (Handoff::default(), Arc::new(Ledger::default()));
        handoff.adopt(Arc::clone(&ledger));
        (handoff, FakeEnvoy::default(), ledger)
    }

    fn release(id: u64, owner: &str) -> (Vec<u8>, HandedOffWrite<'static>) {
        let call = encode_call_parts(
            0,
            &CallOp::Release {
                key: "k".repeat(64),
                owner: owner.into(),
            },
        );
        let write = HandedOffWrite {
            id,
            cluster: "store",
            authority: "idempotency-store",
            authorization: Some("Bearer t"),
            call: call.clone(),
            deadline_ms: T0 + 5_000,
            settles_within_ms: 350,
            http: None,
            on_landed: None,
        };
        (call, write)
    }

    /// A completion as a root hands it off.
    fn complete_call() -> Vec<u8> {
        encode_call_parts(
            0,
            &CallOp::Complete {
                key: "k".repeat(64),
                owner: "o".into(),
                ttl_ms: 1_000,
                record: b"rec".to_vec(),
                fingerprint: "f".repeat(64),
                tombstone_ms: 0,
            },
        )
    }

    /// The calls sent so far, decoded: stream, call id, op.
    fn sent(envoy: &FakeEnvoy) -> Vec<(u64, u64, CallOp)> {
        envoy
            .sent
            .borrow()
            .iter()
            .map(|(s, frame)| {
                let call = decode_call(&frame[PREFIX_BYTES..]).unwrap();
                (*s, call.id, call.op)
            })
            .collect()
    }

    fn answer(handoff: &Handoff, stream: u64, id: u64, reply: Reply, now: u64) {
        let data = grpc_frame(&encode_answer(&Answer { id, reply }));
        handoff.on_stream_event(
            stream,
            WireEvent::Data {
                data,
                end_stream: false,
            },
            now,
        );
    }

    #[test]
    fn an_entry_its_root_settles_in_time_is_never_sent() {
        let (handoff, envoy, ledger) = adopting_one_ledger();
        ledger.record(&release(1, "o1").1, T0).unwrap();
        handoff.sweep(&envoy, T0 + 349);
        ledger.settle(1);
        handoff.sweep(&envoy, T0 + 1_000);
        assert!(envoy.sent.borrow().is_empty() && ledger.is_empty());
    }

    #[test]
    fn an_idle_roots_write_is_landed_retried_through_an_outage_and_settled_by_the_answer() {
        let (handoff, envoy, ledger) = adopting_one_ledger();
        let (call, write) = release(7, "o7");
        ledger.record(&write, T0).unwrap();
        handoff.sweep(&envoy, T0 + 350);
        let first = sent(&envoy);
        let [(stream, call_id, op)] = &first[..] else {
            panic!("one send: {first:?}");
        };
        assert_eq!(*op, decode_call(&call).unwrap().op, "the root's very call");
        assert_eq!(*envoy.started.borrow(), vec!["store".to_owned()]);
        // The store is down: the stream resets; the entry is due again after a backoff.
        handoff.on_stream_event(*stream, WireEvent::Reset, T0 + 400);
        handoff.sweep(&envoy, T0 + 401);
        assert_eq!(sent(&envoy).len(), 1, "not before its backoff");
        handoff.sweep(&envoy, T0 + 700);
        let again = sent(&envoy);
        let (stream, call_id_2, _) = again[1].clone();
        assert_ne!(stream, again[0].0, "a new stream");
        assert_ne!(call_id_2, *call_id);
        // An answer to the old call finds nothing; the store busy is a failure too.
        answer(
            &handoff,
            stream,
            call_id_2,
            Reply::Failure {
                kind: FailureKind::Unavailable,
                detail: "busy".into(),
            },
            T0 + 710,
        );
        assert!(!ledger.is_empty());
        handoff.sweep(&envoy, T0 + 3_000);
        let (_, call_id_3, _) = sent(&envoy)[2].clone();
        answer(&handoff, stream, call_id_3, Reply::Released, T0 + 3_010);
        assert!(ledger.is_empty(), "landed");
        // The root, waking later, settles its own copy: nothing left to do here.
        ledger.settle(7);
        handoff.sweep(&envoy, T0 + 4_000);
        assert_eq!(sent(&envoy).len(), 3);
    }

    #[test]
    fn a_release_that_overtakes_its_claim_is_asked_again_before_it_counts_as_done() {
        let (handoff, envoy, ledger) = adopting_one_ledger();
        ledger.record(&release(9, "o9").1, T0).unwrap();
        let mut now = T0 + 350;
        for attempt in 1..=3 {
            handoff.sweep(&envoy, now);
            let calls = sent(&envoy);
            assert_eq!(calls.len(), attempt, "attempt {attempt}");
            let (stream, id, _) = calls[attempt - 1].clone();
            // The worker's claim is still on its way (its stream is slower than ours).
            answer(&handoff, stream, id, Reply::NotOwner, now + 5);
            now += 2_000;
        }
        assert!(ledger.is_empty(), "final after core's number of attempts");
    }

    #[test]
    fn a_completion_answered_not_the_owner_is_final_at_once() {
        let (handoff, envoy, ledger) = adopting_one_ledger();
        let call = complete_call();
        let (_, mut write) = release(4, "o");
        write.call = call;
        ledger.record(&write, T0).unwrap();
        handoff.sweep(&envoy, T0 + 350);
        let (stream, id, _) = sent(&envoy)[0].clone();
        answer(&handoff, stream, id, Reply::NotOwner, T0 + 360);
        assert!(ledger.is_empty());
    }

    /// Counts the times its write was taken by the store.
    #[derive(Debug, Default)]
    struct Taken(std::sync::atomic::AtomicU32);

    impl idempotency_core::host::OnLanded for Taken {
        fn on_landed(&self, _shared: &dyn idempotency_core::host::SharedData) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// An unknown outcome's completion the store thread lands marks its record as the store's
    /// (core's `on_landed`) when the store records it, and only then: a completion the store
    /// refuses as not the owner's leaves the record unmarked, so retries still never take
    /// the store's "free" for a settlement of a record it never got.
    #[test]
    fn a_completion_landed_by_the_store_tells_the_table_and_a_refused_one_does_not() {
        let complete = complete_call();
        for (reply, marked) in [(Reply::Recorded, 1), (Reply::NotOwner, 0)] {
            let (handoff, envoy, ledger) = adopting_one_ledger();
            let taken = Arc::new(Taken::default());
            let on_landed: Arc<dyn idempotency_core::host::OnLanded> = taken.clone();
            let (_, mut write) = release(3, "o");
            write.call = complete.clone();
            write.on_landed = Some(&on_landed);
            ledger.record(&write, T0).unwrap();
            handoff.sweep(&envoy, T0 + 350);
            let (stream, id, _) = sent(&envoy)[0].clone();
            answer(&handoff, stream, id, reply.clone(), T0 + 360);
            assert!(ledger.is_empty());
            assert_eq!(
                taken.0.load(std::sync::atomic::Ordering::Relaxed),
                marked,
                "{reply:?}"
            );
        }
    }

    #[test]
    fn a_store_that_stops_answering_gets_its_stream_reset_not_a_pile_of_attempts() {
        let (handoff, envoy, ledger) = adopting_one_ledger();
        ledger.record(&release(5, "o5").1, T0).unwrap();
        handoff.sweep(&envoy, T0 + 350);
        let (stream, _, _) = sent(&envoy)[0].clone();
        // No answer: sweeps within the answer bound send nothing more.
        handoff.sweep(&envoy, T0 + 500);
        assert_eq!(sent(&envoy).len(), 1);
        // Past it: the frozen stream is reset, the attempt failed and backed off.
        handoff.sweep(&envoy, T0 + 700);
        assert_eq!(*envoy.resets.borrow(), vec![stream]);
        assert_eq!(sent(&envoy).len(), 1, "not before its backoff");
        // Then again, on a new stream, one attempt in flight at a time.
        handoff.sweep(&envoy, T0 + 1_200);
        let calls = sent(&envoy);
        assert_eq!(calls.len(), 2);
        assert_ne!(calls[1].0, stream);
        handoff.sweep(&envoy, T0 + 1_300);
        assert_eq!(sent(&envoy).len(), 2);
    }

    #[test]
    fn an_answer_after_the_root_settled_finds_nothing_to_do() {
        let (handoff, envoy, ledger) = adopting_one_ledger();
        ledger.record(&release(6, "o6").1, T0).unwrap();
        handoff.sweep(&envoy, T0 + 350);
        let (stream, id, _) = sent(&envoy)[0].clone();
        // The worker woke and its own copy landed first.
        ledger.settle(6);
        answer(&handoff, stream, id, Reply::Released, T0 + 360);
        assert!(ledger.is_empty());
        handoff.sweep(&envoy, T0 + 5_000);
        assert_eq!(sent(&envoy).len(), 1);
    }

    /// An Envoy that resets a stream inside the send (as a local reply or a refused
    /// connection can), running the handoff's hook before the send returns.
    struct ResettingInline<'a> {
        handoff: &'a Handoff,
        envoy: FakeEnvoy,
    }

    impl StreamCalls for ResettingInline<'_> {
        fn start(&self, cluster: &str, headers: &[(&str, &[u8])]) -> Result<u64, String> {
            self.envoy.start(cluster, headers)
        }
        fn send(&self, stream_id: u64, data: &[u8], end_stream: bool) -> bool {
            self.envoy.send(stream_id, data, end_stream);
            self.handoff
                .on_stream_event(stream_id, WireEvent::Reset, T0 + 351);
            true
        }
        fn reset(&self, stream_id: u64) {
            self.envoy.reset(stream_id);
        }
    }

    #[test]
    fn a_stream_reset_inside_the_send_fails_the_attempt_without_a_deadlock() {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (handoff, _, ledger) = adopting_one_ledger();
            ledger.record(&release(8, "o8").1, T0).unwrap();
            let envoy = ResettingInline {
                handoff: &handoff,
                envoy: FakeEnvoy::default(),
            };
            handoff.sweep(&envoy, T0 + 350);
            // Failed at once (not left in flight): due again after its backoff only.
            handoff.sweep(&envoy, T0 + 400);
            let first = envoy.envoy.sent.borrow().len();
            handoff.sweep(&envoy, T0 + 600);
            let _ = done_tx.send((first, envoy.envoy.sent.borrow().len()));
        });
        let sends = done_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the sweep deadlocked on its own lock");
        assert_eq!(sends, (1, 2));
    }

    #[test]
    fn an_entry_past_its_deadline_is_given_up_and_counted() {
        let (handoff, envoy, ledger) = adopting_one_ledger();
        ledger.record(&release(1, "o").1, T0).unwrap();
        handoff.sweep(&envoy, T0 + 5_000);
        assert!(envoy.sent.borrow().is_empty());
        assert_eq!(ledger.census(), (0, 0, 1));
    }

    #[test]
    fn a_full_ledger_refuses_and_counts_and_a_rereport_replaces_its_entry() {
        let ledger = Ledger::default();
        let (_, mut write) = release(1, "o");
        let big = vec![0u8; idempotency_core::store::writes::RETRY_BUDGET_BYTES - 300];
        write.call = big;
        ledger.record(&write, T0).unwrap();
        // The same id again (sent without its body): replaces, never counts twice.
        ledger.record(&write, T0).unwrap();
        assert_eq!(ledger.census().0, 1);
        let (_, other) = release(2, "o2");
        assert!(ledger.record(&other, T0).is_err());
        assert_eq!(ledger.census().2, 1);
        ledger.settle(1);
        assert!(ledger.record(&other, T0).is_ok(), "room again once settled");
    }

    /// Review: a store (or whatever answers at its cluster) that announces a message larger
    /// than any store answer must not make the store thread buffer it until the answer
    /// deadline: Envoy's memory would grow with whatever it sends meanwhile.
    #[test]
    fn a_frame_larger_than_any_store_answer_resets_the_stream_at_once() {
        let (handoff, envoy, ledger) = adopting_one_ledger();
        ledger.record(&release(8, "o8").1, T0).unwrap();
        handoff.sweep(&envoy, T0 + 350);
        let (stream, _, _) = sent(&envoy)[0].clone();
        let mut data = vec![0u8];
        data.extend_from_slice(&u32::MAX.to_be_bytes());
        data.extend_from_slice(&[7u8; 1024]);
        handoff.on_stream_event(
            stream,
            WireEvent::Data {
                data,
                end_stream: false,
            },
            T0 + 351,
        );
        // Well within the attempt's answer bound: the stream is already done with.
        handoff.sweep(&envoy, T0 + 352);
        assert_eq!(*envoy.resets.borrow(), vec![stream], "reset, not buffered");
        // The attempt failed and is due again after its backoff, on a new stream.
        handoff.sweep(&envoy, T0 + 700);
        let calls = sent(&envoy);
        assert_eq!(calls.len(), 2);
        assert_ne!(calls[1].0, stream);
    }
}

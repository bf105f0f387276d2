//! Each request's filter: Envoy's hooks become events of core's journey, its verdicts
//! Envoy's statuses. While its journey waits for its root (a claim or lookup the store
//! answers, a duplicate held in wait mode, a write running upstream whose lease the root
//! renews, a detached write another thread runs), the request opens its mailbox and asks the
//! ticker for its root's tick: both commit this request's scheduler, and in its scheduled
//! hook the root takes what the store said and its tick, then the request takes its letters.
//! Nothing else ever acts on this request.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use idempotency_core::journey::{Event, Journey, RequestJourney, Verdict};

use crate::abi::{
    BodyStatus, CalloutResult, Filter, FilterHandle, HeadersStatus, HttpFilter, Scheduler,
    TrailersStatus,
};
use crate::inbox::WakerId;
use crate::mailbox;
use crate::root::WorkerRoot;
use crate::ticker::{Ticker, Ticket, Wake};
use crate::worker;

/// How a failed request's journey is to be settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    /// A panic or a busy journey: a write that may have run is an unknown outcome.
    Faulted,
    /// Failed before its write could go upstream: the write never ran.
    Unsent,
    Settled,
}

/// The scheduled event that means "the root's tick may be due".
const TICK_EVENT: u64 = 1;

struct SchedulerWake(Scheduler);

impl Wake for SchedulerWake {
    fn wake(&self) {
        self.0.commit(TICK_EVENT);
    }
}

pub struct NativeFilter {
    root: Rc<WorkerRoot>,
    journey: Rc<RefCell<RequestJourney>>,
    context_id: u32,
    /// This request, whose own callouts are forgotten when it goes.
    handle: Option<FilterHandle>,
    /// What commits this request's scheduler, made when its journey first waits for the
    /// root (its mailbox opens then).
    wake: Option<Arc<SchedulerWake>>,
    /// While the request is held: its entry in the ticker's timetable, and in its root's
    /// inbox (the store thread wakes it there when the store answers).
    ticking: Option<(Ticket, WakerId)>,
    /// A hook of this request panicked, or met its journey busy: the journey's state is not
    /// trusted any more.
    failed: bool,
    /// How the failed journey is settled, until it is (it was busy when the request failed).
    fault: Fault,
    /// The response has begun: too late for the filter to answer instead.
    responding: bool,
    /// Envoy ended the stream: nothing is sent on it any more.
    ended: bool,
}

impl NativeFilter {
    pub fn new(
        root: Rc<WorkerRoot>,
        journey: Rc<RefCell<RequestJourney>>,
        context_id: u32,
        handle: FilterHandle,
    ) -> NativeFilter {
        NativeFilter {
            root,
            journey,
            context_id,
            handle: Some(handle),
            wake: None,
            ticking: None,
            failed: false,
            fault: Fault::None,
            responding: false,
            ended: false,
        }
    }

    fn feed(&mut self, filter: &Filter, event: Event) -> Verdict {
        if self.failed {
            return self.failed_verdict();
        }
        let host = self.root.host_for(self.context_id, filter.handle());
        // Envoy runs one hook of a request at a time, only this request's hooks step its
        // journey, and the calls that make Envoy run its hooks inside them (its local reply,
        // its resume) wait until the hook returns (the ABI defers them). So the journey is
        // free here; were it not, the event could not be taken, and the request fails closed.
        let journey = Rc::clone(&self.journey);
        let Ok(mut journey) = journey.try_borrow_mut() else {
            log::error!("request journey busy at {event:?}; the request fails closed");
            self.fail_closed(filter);
            return self.failed_verdict();
        };
        let verdict = journey.on(&host, event);
        drop(journey);
        self.follow(filter);
        if self.failed {
            // Failed closed while following the step (no scheduler): its 503 stands, and a
            // request whose step let it through does not go upstream after all.
            return self.failed_verdict();
        }
        // The step may have recorded an unknown outcome, or met one overdue in the store, or
        // submitted a store write.
        self.root.pass_on();
        verdict
    }

    /// What a failed request's hook answers: its 503 is on its way, so a request hook must
    /// not let the request go upstream; a response already begun goes on.
    fn failed_verdict(&self) -> Verdict {
        if self.responding {
            Verdict::Continue
        } else {
            Verdict::Pause
        }
    }

    /// Ticks while the journey needs the root's: a held duplicate's wait ends on a tick,
    /// and a running write's lease is renewed on one (without it another worker could take
    /// the key over while the write still runs); a claim or a caller's lookup waiting for
    /// the store is moved on by the store's answer, which only a wake-up brings to an idle
    /// worker.
    fn follow(&mut self, filter: &Filter) {
        let needs_ticks = match self.journey.try_borrow() {
            Ok(journey) => matches!(
                journey.state(),
                Journey::Waiting(_)
                    | Journey::Executing(_)
                    | Journey::AwaitingStore(_)
                    | Journey::LookingUp { .. }
                    | Journey::DetachedElsewhere
            ),
            Err(_) => return,
        };
        if needs_ticks {
            self.tick(filter);
        } else {
            self.stop_ticking();
        }
    }

    /// Only the root moves this request on now, so its tick must come even if no other
    /// request reaches this worker.
    fn tick(&mut self, filter: &Filter) {
        if self.ticking.is_some() {
            return;
        }
        let period = self.root.tick_period_ms().max(1);
        let Some(wake) = self.wake(filter) else {
            // Nothing could bring the root's answer to it: it would hang. It has not gone
            // upstream yet (it waits for the root from this hook on), and now never will.
            log::error!("no scheduler for a request that waits for its root; it fails closed");
            self.fault = Fault::Unsent;
            self.fail_closed(filter);
            return;
        };
        let ticket = Ticker::process().every(
            Duration::from_millis(u64::from(period)),
            Arc::clone(&wake) as Arc<dyn Wake>,
        );
        let waker = self.root.inbox().add_waker(wake);
        self.ticking = Some((ticket, waker));
    }

    /// This request's scheduler, made (and its mailbox opened) the first time it is needed.
    fn wake(&mut self, filter: &Filter) -> Option<Arc<SchedulerWake>> {
        if self.wake.is_none() {
            let wake = Arc::new(SchedulerWake(filter.new_scheduler()?));
            mailbox::open(self.context_id, Arc::clone(&wake) as Arc<dyn Wake>);
            self.wake = Some(wake);
        }
        self.wake.clone()
    }

    /// The request is ending: letters it never took are handled as undelivered.
    fn close_mailbox(&mut self) {
        if self.wake.take().is_some() {
            self.root.undelivered(mailbox::close(self.context_id));
        }
    }

    /// The journey cannot be trusted with this request any more: it is settled as a fault
    /// (a write that may have run is an unknown outcome, never run again), and before the
    /// response began the request is answered 503 instead of going on.
    fn fail_closed(&mut self, filter: &Filter) {
        self.failed = true;
        if self.fault == Fault::None {
            self.fault = Fault::Faulted;
        }
        self.stop_ticking();
        self.settle_fault(Some(filter.handle()));
        if self.responding || self.ended {
            return;
        }
        // A resume the hook already asked for must not send it upstream after all.
        filter.withdraw_resume();
        crate::refusing_filter::answer_unavailable(
            filter,
            "the idempotency filter failed on this request",
        );
    }

    /// Settles a failed journey, in the request's own hook (`in_hook`) or at its destroy
    /// (where Envoy's view of the stream is not read any more).
    fn settle_fault(&mut self, in_hook: Option<FilterHandle>) {
        if self.fault == Fault::None || self.fault == Fault::Settled {
            return;
        }
        let host = match in_hook {
            Some(handle) => self.root.host_for(self.context_id, handle),
            None => self.root.host(),
        };
        match self.journey.try_borrow_mut() {
            Ok(mut journey) => {
                match self.fault {
                    Fault::Unsent => journey.recall_unsent(&host),
                    _ => journey.after_fault(&host),
                }
                self.fault = Fault::Settled;
            }
            Err(_) => log::error!("a failed request's journey is busy; settled when it ends"),
        }
        self.root.carry_to_main();
    }

    /// After this neither the ticker nor the store thread commits this request's scheduler.
    fn stop_ticking(&mut self) {
        if let Some((ticket, waker)) = self.ticking.take() {
            Ticker::process().cancel(ticket);
            self.root.inbox().remove_waker(waker);
        }
    }
}

fn headers_status(verdict: Verdict) -> HeadersStatus {
    match verdict {
        Verdict::Continue => HeadersStatus::Continue,
        Verdict::Pause => HeadersStatus::StopIteration,
    }
}

fn body_status(verdict: Verdict) -> BodyStatus {
    match verdict {
        Verdict::Continue => BodyStatus::Continue,
        Verdict::Pause => BodyStatus::StopIterationAndBuffer,
    }
}

fn trailers_status(verdict: Verdict) -> TrailersStatus {
    match verdict {
        Verdict::Continue => TrailersStatus::Continue,
        Verdict::Pause => TrailersStatus::StopIteration,
    }
}

impl HttpFilter for NativeFilter {
    fn on_request_headers(&mut self, filter: &Filter, end_of_stream: bool) -> HeadersStatus {
        let verdict = self.feed(filter, Event::RequestHeaders { end_of_stream });
        // Held at the headers for the store, not for the body: Envoy keeps the body
        // with flow control rather than a buffer whose limit answers 413, as the Wasm build
        // without `allow_on_headers_stop_iteration` does. The body's callbacks come after
        // the resume.
        let held_without_the_body = self
            .journey
            .try_borrow()
            .is_ok_and(|journey| matches!(journey.state(), Journey::AwaitingStore(_)));
        match verdict {
            Verdict::Pause if held_without_the_body => HeadersStatus::StopAllIterationAndWatermark,
            verdict => headers_status(verdict),
        }
    }

    fn on_request_body(&mut self, filter: &Filter, end_of_stream: bool) -> BodyStatus {
        let size = filter.request_body_size();
        let verdict = self.feed(
            filter,
            Event::RequestBody {
                size,
                end_of_stream,
            },
        );
        body_status(verdict)
    }

    fn on_request_trailers(&mut self, filter: &Filter) -> TrailersStatus {
        let verdict = self.feed(filter, Event::RequestTrailers);
        trailers_status(verdict)
    }

    fn on_response_headers(&mut self, filter: &Filter, end_of_stream: bool) -> HeadersStatus {
        self.responding = true;
        headers_status(self.feed(filter, Event::ResponseHeaders { end_of_stream }))
    }

    fn on_response_body(&mut self, filter: &Filter, end_of_stream: bool) -> BodyStatus {
        let size = filter.response_body_chunk_size();
        body_status(self.feed(
            filter,
            Event::ResponseBody {
                size,
                end_of_stream,
            },
        ))
    }

    fn on_response_trailers(&mut self, filter: &Filter) -> TrailersStatus {
        trailers_status(self.feed(filter, Event::ResponseTrailers))
    }

    fn on_stream_complete(&mut self, filter: &Filter) {
        self.ended = true;
        self.feed(filter, Event::StreamEnd);
        self.stop_ticking();
        self.close_mailbox();
    }

    fn on_scheduled(&mut self, filter: &Filter, _event_id: u64) {
        // A wake-up from the ticker, the store thread (a store answer) or the root (a
        // letter): the root takes what the store said, then its tick if due, then this
        // request takes what they left for it.
        self.root.drain_inbox();
        self.root.tick_if_due();
        if !self.failed {
            self.root.deliver_letters(self.context_id, filter.handle());
        }
        self.follow(filter);
    }

    /// The answer to one of this request's own callouts (the store's HTTP transport).
    fn on_http_callout_done(
        &mut self,
        filter: &Filter,
        callout_id: u64,
        _result: CalloutResult,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    ) {
        let Some(token) = crate::request_callouts::take(filter.handle().key(), callout_id) else {
            return;
        };
        let (num_headers, body_size) = (headers.len(), body.len());
        crate::request_callouts::delivering(headers, body, || {
            self.feed(
                filter,
                Event::CalloutAnswer {
                    token,
                    num_headers,
                    body_size,
                },
            )
        });
    }

    fn on_destroy(&mut self) {
        self.stop_ticking();
        self.close_mailbox();
        self.settle_fault(None);
        if let Some(handle) = self.handle {
            crate::request_callouts::forget(handle.key());
        }
        worker::forget(self.context_id);
    }

    /// A hook of this request panicked: its journey may be half-way through a step, so it
    /// is not fed again. A write it was running upstream may have run: core records it as an
    /// unknown outcome (a retry is never run again). Before the response began, the request
    /// is answered 503 instead of going on; after, the response goes on as it is.
    fn on_panic(&mut self, filter: &Filter) {
        // The panic unwound through the hook, which gave the journey back.
        self.fail_closed(filter);
    }
}

impl Drop for NativeFilter {
    fn drop(&mut self) {
        self.stop_ticking();
        self.close_mailbox();
    }
}

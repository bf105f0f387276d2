//! One request's journey through the filter: one state type ([`Journey`]), the events Envoy
//! delivers ([`Event`]), and one transition function ([`RequestJourney::on`]) that says, for
//! each state and event, what happens next. The steps themselves live in [`intake`] (rule,
//! key, fingerprint), [`claim`] (local and store claim: execute, replay, 409/422/503) and
//! [`response`] (release, or record the response as it streams to the client).
//!
//! Effects (local replies, callouts, resuming the request, counters, shared data) go
//! through [`Host`]; the verdict returned tells Envoy whether the stream pauses here.

pub mod access_log;
mod claim;
mod detached;
pub mod echo;
mod grpc;
mod intake;
mod lookup;
pub mod registry;
mod response;
mod wait;

use std::cell::RefCell;
use std::rc::Rc;

use crate::capture::ResponseCapture;
use crate::host::Host;
use crate::outcome::Outcome;
use crate::plugin::detached::{DetachedAnswer, DetachedCarry};
use crate::plugin::waits::{HoldTicket, WaitEnd};
use crate::plugin::Plugin;
use crate::problem::Problem;
use crate::resolve::lookup::{LookupParts, LookupRequest};
use crate::rule_handle::RuleHandle;
use crate::store::client::{StoreClaim, StoreFailure};
use crate::table::Held;
use detached::{DetachedIntake, DetachedRun};
use idempotency_protocol::naming::Digest;
use idempotency_protocol::record::RecordedResponse;
use registry::Journeys;

/// The request header that caps the router's retries of this request.
pub const NO_ROUTER_RETRIES: &str = "x-envoy-max-retries";

/// What Envoy delivers to a request's filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    RequestHeaders {
        end_of_stream: bool,
    },
    /// `size`: bytes of the request body buffered so far.
    RequestBody {
        size: usize,
        end_of_stream: bool,
    },
    RequestTrailers,
    /// The answer to a callout this request sent (no headers: reset or timeout).
    CalloutAnswer {
        token: u32,
        num_headers: usize,
        body_size: usize,
    },
    /// The answer to the claim this request sent on the store stream (delivered by the root,
    /// which made this request's context the effective one), or why none came.
    StoreReply {
        id: u64,
        answer: Result<StoreClaim, StoreFailure>,
    },
    /// The wait of a held duplicate is over (delivered by the root, which made this
    /// request's context the effective one).
    WaitOver(WaitEnd),
    /// The answer to this request's detached write (delivered by the root, in this
    /// request's context if it is still there).
    DetachedAnswer(DetachedAnswer),
    /// The store's answer to this request's lookup (its stream call `id`), delivered by the
    /// root as a store reply is.
    LookupAnswer {
        id: u64,
        found: Result<crate::lookup_route::Found, StoreFailure>,
    },
    ResponseHeaders {
        end_of_stream: bool,
    },
    /// `size`: bytes of this chunk of the response body.
    ResponseBody {
        size: usize,
        end_of_stream: bool,
    },
    ResponseTrailers,
    /// The stream is over (answered, or the client or upstream went away).
    StreamEnd,
}

/// What Envoy does with the stream after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Continue,
    /// Hold the stream: the filter answered, or waits for the body or the store.
    Pause,
}

/// Where the request is on its way.
pub enum Journey {
    /// Nothing seen yet.
    Arrived,
    /// No rule protects it, or the rule let it pass unprotected.
    Unprotected,
    /// Rule chosen and header-borne key parts read; waiting for the whole body.
    AwaitingBody(Box<PendingRequest>),
    /// Cluster mode: the local claim is held; the store is confirming it.
    AwaitingStore(StoreWait),
    /// A duplicate held until the first request with its key completes.
    Waiting(HeldDuplicate),
    /// This request holds the claim and went upstream.
    Executing(Execution),
    /// This request holds the claim; the root sent its copy upstream (`execution:
    /// "detached"`), and the request itself never goes on.
    Detached(DetachedRun),
    /// As `Detached`, but another root runs the write (and holds its claim): the host
    /// delivers its answer (`answered_elsewhere`), or tells that root the client left.
    DetachedElsewhere,
    /// The filter answered itself; its own reply must not be recorded.
    AnsweredLocally,
    /// A replay with an empty body was sent; these recorded headers, which Envoy strips from
    /// bodiless local replies, are restored when the reply passes back through the filter.
    Replaying { restore: Vec<(String, Vec<u8>)> },
    /// A gRPC replay with a message, sent through the echo hop; its answer becomes the
    /// recorded response as it passes back.
    ReplayHop(Box<grpc::ReplayHop>),
    /// A caller's lookup, waiting for the store's answer to its stream call.
    LookingUp {
        rule: Rc<RuleHandle>,
        call: StoreCall,
    },
    /// Recorded, released, or given up: nothing more to do.
    Finished,
}

/// What is kept from the request headers (they are gone once the body arrives).
pub struct PendingRequest {
    pub rule: Rc<RuleHandle>,
    pub method: String,
    pub path: String,
    pub content_type: String,
    /// Key parts read from headers and query; None for body sources.
    pub key_parts: Vec<Option<Vec<u8>>>,
    pub scope: Vec<Option<Vec<u8>>>,
    /// A gRPC call's refusal found in its metadata, answered once its body shows it unary.
    pub deferred: Option<(Outcome, Problem)>,
    /// The first of a gRPC rule's key metadata the call sent, if any: such a call is refused,
    /// never let through unprotected, should it send a second message or more than the rule
    /// buffers.
    pub key_metadata: Option<String>,
    /// A rule with `resolve`: what its lookup takes from the request headers.
    pub lookup: Option<Box<LookupParts>>,
}

/// A duplicate held while the first request with its key runs.
pub struct HeldDuplicate {
    pub rule: Rc<RuleHandle>,
    pub key: Digest,
    pub fingerprint: Digest,
    /// When its wait ends with a 409, wherever it waits.
    pub deadline_ms: u64,
    /// Cluster mode, the first request on another replica: the wait's call on the store
    /// stream, and its place among the worker's store waits. None: held in the local table.
    pub store_wait: Option<(u64, HoldTicket)>,
}

/// A claim held locally while the store confirms it.
pub struct StoreWait {
    pub rule: Rc<RuleHandle>,
    pub held: Held,
    /// The call carrying the claim.
    pub call: StoreCall,
    /// The owner this proxy claimed with (it chooses it, so it can release it).
    pub owner: String,
}

/// How a claim went to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreCall {
    /// An HTTP callout with this token.
    Callout(u32),
    /// A message on the worker's store stream with this id.
    Stream(u64),
}

/// A request that holds the claim and went upstream.
pub struct Execution {
    pub rule: Rc<RuleHandle>,
    pub held: Held,
    /// The store claim in cluster mode (None: local claim only).
    pub store_owner: Option<StoreOwner>,
    /// The response being copied, from its headers on.
    pub capture: Option<ResponseCapture>,
    /// When it went upstream: its record is remembered at least `ttl_seconds` from then.
    pub started_ms: u64,
    /// Some while the judgement of the upstream's answer waits for its body's first bytes
    /// (a `502` or `503`: a proxy's words tell whether it gave up; `gave_up::of_words`).
    pub proxy_words: Option<Vec<u8>>,
}

/// This request's claim in the store.
#[derive(Clone)]
pub struct StoreOwner {
    pub token: String,
    /// False when the store's answer was lost (fail_open): the claim may not exist, so
    /// writing to it is best effort and not counted as a store error.
    pub confirmed: bool,
}

/// The next state and what Envoy does now.
type Step = (Journey, Verdict);

/// One request's filter: its configuration and where it is.
pub struct RequestJourney {
    plugin: Rc<Plugin>,
    journey: Journey,
    /// The host's id of this request's context.
    context_id: u32,
    /// The configuration's journeys, in which the root finds this one by `context_id` to
    /// hand it a store stream's answer (see `shared`).
    journeys: Rc<Journeys>,
    /// What the filter decided so far, for the access log.
    decisions: access_log::Decisions,
    /// What Envoy holds of this request while it waits (its body, or what a rule that never
    /// reads the body may let Envoy buffer), charged to the worker's held duplicates.
    held_bytes: std::cell::Cell<usize>,
    /// A detached rule's copy of the request, from intake until it is sent.
    detached_intake: RefCell<Option<DetachedIntake>>,
    /// The request's context is gone (its client left): the root runs what is left of the
    /// journey in its own context.
    context_gone: std::cell::Cell<bool>,
    /// A rule with `resolve`: the lookup for this request's write, should its outcome be
    /// unknown.
    lookup: RefCell<Option<LookupRequest>>,
    /// The claim of a write running upstream, kept beside the state: a step takes the state
    /// out while it runs, and a fault in it (a panic the native build catches) would take
    /// the claim with it. See `after_fault`.
    running: Option<RunningClaim>,
}

/// What `after_fault` needs of a running write to record it as an unknown outcome.
struct RunningClaim {
    rule: Rc<RuleHandle>,
    held: Held,
    store_owner: Option<StoreOwner>,
    started_ms: u64,
}

impl RequestJourney {
    /// A journey only its own callbacks reach: claims go to the store by callout alone.
    pub fn new(plugin: Rc<Plugin>) -> RequestJourney {
        RequestJourney {
            plugin,
            journey: Journey::Arrived,
            context_id: 0,
            journeys: Rc::new(Journeys::default()),
            decisions: access_log::Decisions::default(),
            held_bytes: std::cell::Cell::new(0),
            detached_intake: RefCell::new(None),
            context_gone: std::cell::Cell::new(false),
            lookup: RefCell::new(None),
            running: None,
        }
    }

    /// A journey the root can also reach in `journeys`, to hand it the answer to a claim sent
    /// on the store stream; `context_id` is the host's id of the request's context.
    pub fn shared(
        plugin: Rc<Plugin>,
        journeys: &Rc<Journeys>,
        context_id: u32,
    ) -> Rc<RefCell<RequestJourney>> {
        let journey = Rc::new(RefCell::new(RequestJourney {
            plugin,
            journey: Journey::Arrived,
            context_id,
            journeys: Rc::clone(journeys),
            decisions: access_log::Decisions::default(),
            held_bytes: std::cell::Cell::new(0),
            detached_intake: RefCell::new(None),
            context_gone: std::cell::Cell::new(false),
            lookup: RefCell::new(None),
            running: None,
        }));
        journeys.register(context_id, &journey);
        journey
    }

    /// The root running this request's detached write elsewhere has its answer, which the
    /// host sends the client now: the response passing back is that answer.
    pub fn answered_elsewhere(&mut self) -> bool {
        if matches!(self.journey, Journey::DetachedElsewhere) {
            self.journey = Journey::Finished;
            return true;
        }
        false
    }

    /// Where the request is now.
    pub fn state(&self) -> &Journey {
        &self.journey
    }

    /// The root delivers an event after the request's context is gone: what the journey
    /// sends from now on goes as the root.
    pub fn context_is_gone(&self) {
        self.context_gone.set(true);
    }

    /// The context the journey's host calls act in: its own, or the root's once it is gone.
    fn acting_context(&self) -> u32 {
        if self.context_gone.get() {
            self.plugin.root_context.get()
        } else {
            self.context_id
        }
    }

    /// The transition function: every way a request moves through the filter.
    pub fn on(&mut self, host: &impl Host, event: Event) -> Verdict {
        if self.plugin.config.grpc_replay_echo {
            return self.on_event(host, event);
        }
        match (&self.journey, &event) {
            // Let through at once on every later callback (Envoy still makes each one).
            (Journey::Unprotected, _) => Verdict::Continue,
            (Journey::Arrived, Event::RequestHeaders { .. })
                if self.no_rule_covers_the_method(host) =>
            {
                self.journey = Journey::Unprotected;
                Verdict::Continue
            }
            _ => self.on_event(host, event),
        }
    }

    /// A mesh's reads are most of its requests, and no rule covers their method: told from
    /// `:method` alone, one small read (about half the CPU of reading the header map, which
    /// Envoy serialises whole), before anything else. Only where it can rule reads out: with
    /// a lookup route (or a rule on GET) every GET needs the map anyway, so the extra read
    /// would only cost the requests the filter protects.
    fn no_rule_covers_the_method(&self, host: &impl Host) -> bool {
        let prefilter = &self.plugin.prefilter;
        if prefilter.method_may_match(b"GET") {
            return false;
        }
        match host.request_header(":method") {
            Ok(Some(method)) => !prefilter.method_may_match(&method),
            // Unreadable: the map decides, as for any request.
            Ok(None) | Err(_) => false,
        }
    }

    /// Kept out of `on`: its compiled body is large, and a request no rule covers never
    /// enters it.
    #[inline(never)]
    fn on_event(&mut self, host: &impl Host, event: Event) -> Verdict {
        if self.plugin.config.grpc_replay_echo {
            return echo::on(host, event);
        }
        let journey = std::mem::replace(&mut self.journey, Journey::Finished);
        let running = running_claim(&journey);
        let (next, verdict) = self.step(host, journey, event);
        if let (Some(owner), None) = (running, running_claim(&next)) {
            // Recorded, released or given up: the root stops renewing its lease.
            self.plugin.leases.end(owner);
        }
        self.keep_running_claim(&next);
        self.journey = next;
        verdict
    }

    /// Copies a running write's claim when it starts running (or its store claim changes),
    /// drops it when the write is no longer running.
    fn keep_running_claim(&mut self, next: &Journey) {
        match next {
            Journey::Executing(run) => {
                let current = self.running.as_ref().is_some_and(|kept| {
                    kept.held == run.held
                        && kept.store_owner.as_ref().map(|o| (&o.token, o.confirmed))
                            == run.store_owner.as_ref().map(|o| (&o.token, o.confirmed))
                });
                if !current {
                    self.running = Some(RunningClaim {
                        rule: Rc::clone(&run.rule),
                        held: run.held.clone(),
                        store_owner: run.store_owner.clone(),
                        started_ms: run.started_ms,
                    });
                }
            }
            _ => self.running = None,
        }
    }

    /// The host fails the request closed right after the step that let its write go, before
    /// the request could reach the upstream (it answers it instead): the write never ran, so
    /// its claim is released, locally and in the store, never kept as an unknown outcome. A
    /// journey in any other state is settled as after a fault.
    pub fn recall_unsent(&mut self, host: &impl Host) {
        match std::mem::replace(&mut self.journey, Journey::Finished) {
            Journey::Executing(run) => {
                self.running = None;
                let owner = run.held.owner;
                let _ = self.release(host, run);
                self.plugin.leases.end(owner);
            }
            other => {
                self.journey = other;
                self.after_fault(host);
            }
        }
    }

    /// The host caught a fault (a panic) in one of this request's steps: its state may be
    /// lost half-way. A write that was running upstream may have run, so it is recorded as
    /// an unknown outcome, never run again by a retry (its rule's `on_unknown_outcome`
    /// decides, as for a client that left), and its lease is no longer renewed. The journey
    /// takes no more events. (A Wasm build has no such path: a trap ends its VM.)
    pub fn after_fault(&mut self, host: &impl Host) {
        // A journey still waiting (the fault was the host's, not a step's: a step takes its
        // state out while it runs) holds a claim nothing went upstream for: it is let go.
        match std::mem::replace(&mut self.journey, Journey::Finished) {
            Journey::AwaitingStore(wait) => {
                let _ = self.abandon_store_wait(host, wait);
            }
            Journey::Waiting(held) => {
                let _ = self.abandon_wait(held);
            }
            Journey::LookingUp { rule, call } => {
                let _ = self.abandon_lookup(&rule, call);
            }
            _ => {}
        }
        let Some(claim) = self.running.take() else {
            return;
        };
        let owner = claim.held.owner;
        let run = Execution {
            rule: claim.rule,
            held: claim.held,
            store_owner: claim.store_owner,
            capture: None,
            started_ms: claim.started_ms,
            proxy_words: None,
        };
        let report = crate::who_answered::EnvoyReport::read(host, 0);
        let _finished = self.unknown_outcome(host, run, &report);
        self.plugin.leases.end(owner);
    }

    fn step(&self, host: &impl Host, journey: Journey, event: Event) -> Step {
        use Event as E;
        use Journey as J;
        match (journey, event) {
            (J::Arrived, E::RequestHeaders { end_of_stream }) => {
                self.on_request_headers(host, end_of_stream)
            }
            (
                J::AwaitingBody(pending),
                E::RequestBody {
                    size,
                    end_of_stream,
                },
            ) => self.on_request_body(host, pending, size, end_of_stream),
            (J::AwaitingBody(pending), E::RequestTrailers) => {
                self.on_request_trailers(host, *pending)
            }
            // A claim sent at request headers (the rule never reads the body) is still
            // awaiting the store: what arrives meanwhile stays in Envoy's buffer, since
            // Continue would send the request upstream before the store has decided.
            (wait @ J::AwaitingStore(_), E::RequestBody { .. } | E::RequestTrailers) => {
                (wait, Verdict::Pause)
            }
            (
                J::AwaitingStore(wait),
                E::CalloutAnswer {
                    token,
                    num_headers,
                    body_size,
                },
            ) if wait.call == StoreCall::Callout(token) => {
                let answer = self.read_callout_claim(host, num_headers, body_size);
                resumed(host, self.on_store_claim(host, wait, answer))
            }
            (J::AwaitingStore(wait), E::StoreReply { id, answer })
                if wait.call == StoreCall::Stream(id) =>
            {
                resumed(host, self.on_store_claim(host, wait, answer))
            }
            (wait @ J::AwaitingStore(_), E::CalloutAnswer { .. } | E::StoreReply { .. }) => {
                (wait, Verdict::Pause)
            }
            // The client left while the store was confirming, or Envoy answered the request
            // itself (its timeout): nothing went upstream, and nothing will.
            (
                J::AwaitingStore(wait),
                E::StreamEnd
                | E::ResponseHeaders { .. }
                | E::ResponseBody { .. }
                | E::ResponseTrailers,
            ) => self.abandon_store_wait(host, wait),
            (J::LookingUp { rule, call }, E::LookupAnswer { id, found })
                if call == StoreCall::Stream(id) =>
            {
                self.lookup_answer(host, &rule, found)
            }
            (
                J::LookingUp { rule, call },
                E::CalloutAnswer {
                    token,
                    num_headers,
                    body_size,
                },
            ) if call == StoreCall::Callout(token) => {
                self.lookup_callout_answer(host, &rule, num_headers, body_size)
            }
            // The caller left, or Envoy answered it itself: that answer goes out.
            (
                J::LookingUp { rule, call },
                E::StreamEnd
                | E::ResponseHeaders { .. }
                | E::ResponseBody { .. }
                | E::ResponseTrailers,
            ) => self.abandon_lookup(&rule, call),
            (looking @ J::LookingUp { .. }, _) => (looking, Verdict::Pause),
            // A replay through the echo hop goes on from here: the root delivered this.
            (J::Waiting(held), E::WaitOver(end)) => {
                resumed(host, self.on_wait_over(host, held, end))
            }
            // A held duplicate whose client left costs nothing further.
            (J::Waiting(held), E::StreamEnd) => self.abandon_wait(held),
            // Envoy answered a held duplicate itself (its request or idle timeout fired): that
            // answer goes out, and the wait ends.
            (
                J::Waiting(held),
                E::ResponseHeaders { .. } | E::ResponseBody { .. } | E::ResponseTrailers,
            ) => self.abandon_wait(held),
            (wait @ J::Waiting(_), _) => (wait, Verdict::Pause),
            (J::Replaying { restore }, E::ResponseHeaders { .. }) => {
                restore_replay_headers(host, &restore);
                (J::AnsweredLocally, Verdict::Continue)
            }
            (J::ReplayHop(hop), E::ResponseHeaders { end_of_stream }) => {
                self.on_hop_headers(host, hop, end_of_stream)
            }
            (J::ReplayHop(hop), E::ResponseBody { end_of_stream, .. }) => {
                self.on_hop_body(host, hop, end_of_stream)
            }
            (J::Executing(run), E::ResponseHeaders { end_of_stream }) => {
                self.on_response_headers(host, run, end_of_stream)
            }
            (
                J::Executing(run),
                E::ResponseBody {
                    size,
                    end_of_stream,
                },
            ) => self.on_response_body(host, run, size, end_of_stream),
            (J::Executing(run), E::ResponseTrailers) if run.rule.rule.grpc.is_some() => {
                self.on_grpc_trailers(host, run)
            }
            (J::Executing(run), E::ResponseTrailers) if run.proxy_words.is_some() => {
                let status = run.capture.as_ref().map_or(0, |c| c.status());
                let words = run.proxy_words.as_deref().unwrap_or_default();
                let judged = crate::gave_up::of_ended_words(status, words);
                self.apply_judgement(host, run, judged, response::BodyAt::End)
            }
            (J::Executing(run), E::ResponseTrailers) => self.record(host, run),
            (J::Executing(run), E::StreamEnd) => self.on_cut_short(host, run),
            (J::Detached(run), E::DetachedAnswer(answer)) => {
                self.on_detached_answer(host, run, answer)
            }
            // The client left, or Envoy answered it itself (its stream timeout): the write
            // goes on, and its answer is only recorded.
            (
                J::Detached(mut run),
                E::StreamEnd
                | E::ResponseHeaders { .. }
                | E::ResponseBody { .. }
                | E::ResponseTrailers,
            ) => {
                run.client_here = false;
                (J::Detached(run), Verdict::Continue)
            }
            // The request itself never goes on: its copy is upstream already.
            (detached @ J::Detached(_), _) => (detached, Verdict::Pause),
            // Envoy answered the client itself, or the client left, before the root running
            // the write had the answer: it only records it.
            (
                J::DetachedElsewhere,
                E::StreamEnd
                | E::ResponseHeaders { .. }
                | E::ResponseBody { .. }
                | E::ResponseTrailers,
            ) => {
                self.plugin
                    .detached
                    .carry(DetachedCarry::ClientLeft(self.context_id));
                (J::Finished, Verdict::Continue)
            }
            (J::DetachedElsewhere, _) => (J::DetachedElsewhere, Verdict::Pause),
            // Everything else passes: an unprotected request, a local answer, or an event
            // that cannot change a decision already taken.
            (journey, _) => (journey, Verdict::Continue),
        }
    }

    /// Counts what happened to this request and adds it to its access-log outcome.
    fn note(&self, host: &impl Host, rule: &RuleHandle, outcome: Outcome) {
        rule.count(host, outcome);
        if self.plugin.config.access_log_fields {
            self.decisions.add(host, outcome);
        }
    }

    /// Sends a problem+json reply and stops the request here.
    fn answer_problem(&self, host: &impl Host, rule: &RuleHandle, problem: &Problem) -> Step {
        if rule.rule.grpc.is_some() {
            return self.answer_grpc_problem(host, rule, problem);
        }
        let body = problem.body(&rule.rule.name);
        let headers = problem.headers();
        let pairs: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
        send_local(host, &rule.rule.name, problem.status, &pairs, &body)
    }
}

/// The owner of the claim a request running upstream holds.
pub(super) fn running_claim(journey: &Journey) -> Option<u64> {
    match journey {
        Journey::Executing(run) => Some(run.held.owner),
        Journey::Detached(detached) => Some(detached.run.held.owner),
        _ => None,
    }
}

impl Drop for RequestJourney {
    /// A request Envoy let go of while it ran: its lease is no longer renewed.
    fn drop(&mut self) {
        if let Some(owner) = running_claim(&self.journey) {
            self.plugin.leases.end(owner);
        }
    }
}

/// Answers from the filter. Should the host refuse the answer (a replay's recorded headers,
/// say), a plain 503 problem goes instead; should it refuse that too, the request is held
/// rather than let on unprotected: Envoy's own timeouts end it. A replay, a 409 or a
/// fail-closed 503 must never turn into a write that runs.
fn send_local(
    host: &impl Host,
    rule: &str,
    status: u16,
    headers: &[(&str, &[u8])],
    body: &[u8],
) -> Step {
    let Err(e) = host.send_local_reply(status, headers, body) else {
        return (Journey::AnsweredLocally, Verdict::Pause);
    };
    log::error!(
        "rule {rule}: local reply ({status}) refused by the host: {}",
        e.0
    );
    let fallback = Problem::unavailable("the proxy could not send its answer");
    let fallback_headers = fallback.headers();
    let pairs: Vec<(&str, &[u8])> = fallback_headers
        .iter()
        .map(|(n, v)| (*n, v.as_bytes()))
        .collect();
    if let Err(e) = host.send_local_reply(fallback.status, &pairs, &fallback.body(rule)) {
        log::error!(
            "rule {rule}: the fallback 503 was refused too ({}); the request is held until \
             Envoy's own timeouts end it",
            e.0
        );
    }
    (Journey::AnsweredLocally, Verdict::Pause)
}

/// Answers with a response from the filter: a replay of a record (`as_replay`, marked so),
/// or a detached write's own response.
fn send_response(
    host: &impl Host,
    rule: &RuleHandle,
    response: &RecordedResponse,
    as_replay: bool,
) -> Step {
    let mut headers: Vec<(&str, &[u8])> = response
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_slice()))
        .collect();
    if as_replay {
        headers.push((rule.rule.replay_header.as_str(), b"true"));
    }
    if response.body_omitted {
        headers.push((rule.rule.body_omitted_header.as_str(), b"true"));
    }
    let (next, verdict) = send_local(
        host,
        &rule.rule.name,
        response.status,
        &headers,
        &response.body,
    );
    if response.body.is_empty() && matches!(next, Journey::AnsweredLocally) {
        // Envoy drops content-type from a local reply without a body; the reply passes back
        // through this filter, which puts it back (see `Journey::Replaying`).
        let restore: Vec<(String, Vec<u8>)> = response
            .headers
            .iter()
            .filter(|(n, _)| n == "content-type")
            .cloned()
            .collect();
        if !restore.is_empty() {
            return (Journey::Replaying { restore }, verdict);
        }
    }
    (next, verdict)
}

fn restore_replay_headers(host: &impl Host, restore: &[(String, Vec<u8>)]) {
    for (name, value) in restore {
        if let Err(e) = host.replace_response_header(name, value) {
            log::warn!("replayed {name} not restored: {}", e.0);
        }
    }
}

/// A request held for the store goes on once the store's answer says so.
fn resumed(host: &impl Host, (next, verdict): Step) -> Step {
    if verdict == Verdict::Continue {
        if let Err(e) = host.resume_request() {
            log::error!("request could not be resumed: {}", e.0);
        }
    }
    (next, verdict)
}

/// Lets the request go on without protection.
fn pass() -> Step {
    (Journey::Unprotected, Verdict::Continue)
}

#[cfg(test)]
mod tests;

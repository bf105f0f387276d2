//! Detached writes (`execution: "detached"`), as one worker keeps them: requests the filter
//! sends upstream itself, as callouts of the root context. Envoy cancels a request's own
//! callouts when its client leaves; the root's outlive the client, so the write completes,
//! is recorded, and a retry replays it. A request hands its write here and wakes the root,
//! which sends it (the SDK files a callout under the context that sends it) and, when the
//! answer comes, hands it back to the request's journey, which the root keeps alive.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use crate::config::Rule;
use crate::host::{status_of, Callout, HeaderPairs, Host};
use crate::rule_handle::RuleHandle;
use crate::table::Held;

/// Bytes of detached requests one worker holds at most (headers, body and trailers, while
/// the filter holds them and while Envoy sends them): beyond, a new detached write is
/// refused with 503 before it runs.
pub const MAX_DETACHED_BYTES: usize = 64 << 20;
/// Detached writes one worker has in flight at most.
pub const MAX_DETACHED_WRITES: usize = 4096;
/// What a detached write costs beyond its bytes (the callout's state in Envoy).
const DETACHED_OVERHEAD_BYTES: usize = 2048;
/// Envoy answers every callout by its timeout; one still unanswered this long after it is
/// given up as an unknown outcome, so that a lost answer cannot keep its key renewed forever.
const OVERDUE_GRACE_MS: u64 = 10_000;

/// One request, as the filter sends it upstream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ForwardedRequest {
    /// Pseudo-headers and the headers the upstream receives, in order.
    pub headers: Vec<(String, String)>,
    pub body: Rc<[u8]>,
    pub trailers: Vec<(String, String)>,
}

impl ForwardedRequest {
    pub fn bytes(&self) -> usize {
        let pairs = |list: &[(String, String)]| -> usize {
            list.iter().map(|(n, v)| n.len() + v.len()).sum()
        };
        pairs(&self.headers)
            .saturating_add(pairs(&self.trailers))
            .saturating_add(self.body.len())
            .saturating_add(DETACHED_OVERHEAD_BYTES)
    }
}

/// The answer to a detached write, read in the root before the request's context is made
/// the effective one (the callout's buffers belong to the root).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DetachedAnswer {
    /// Envoy refused to send it (no such cluster, headers it cannot send): nothing ran.
    NotSent(String),
    /// The callout's answer. `status` 0: the exchange failed without a response.
    Response {
        status: u16,
        headers: HeaderPairs,
        /// Empty when larger than the rule's `max_response_bytes` (`body_omitted`).
        body: Vec<u8>,
        body_omitted: bool,
        elapsed_ms: u64,
        timeout_ms: u64,
    },
}

/// A write waiting for the root to send it.
pub struct DetachedWrite {
    pub context_id: u32,
    pub rule: Rc<RuleHandle>,
    pub cluster: String,
    pub request: ForwardedRequest,
    pub timeout_ms: u64,
    pub ticket: DetachedTicket,
}

/// A sent write, until its answer comes.
pub struct InFlight {
    pub context_id: u32,
    pub rule: Rc<RuleHandle>,
    pub sent_ms: u64,
    pub timeout_ms: u64,
    /// Given back when the answer has been handled.
    pub ticket: DetachedTicket,
}

#[derive(Default)]
struct Budget {
    writes: Cell<usize>,
    bytes: Cell<usize>,
}

/// One detached write's place in the worker's budget, given back when it is dropped.
pub struct DetachedTicket {
    budget: Rc<Budget>,
    bytes: usize,
}

impl Drop for DetachedTicket {
    fn drop(&mut self) {
        let b = &self.budget;
        b.writes.set(b.writes.get().saturating_sub(1));
        b.bytes.set(b.bytes.get().saturating_sub(self.bytes));
    }
}

/// A detached write on its way to the root that sends it for this worker's (see
/// `DetachedWrites::send_elsewhere`): plain data, which that root pairs with its own handle of
/// the same rule, and runs as its own journey.
#[derive(Debug, Clone)]
pub struct PortableDetached {
    pub rule: Rule,
    pub held: Held,
    /// The store claim's owner token, and whether the store confirmed it (cluster mode).
    pub store_owner: Option<(String, bool)>,
    pub started_ms: u64,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub trailers: Vec<(String, String)>,
    pub timeout_ms: u64,
    /// The worker's request (its context id there), which the answer goes back to.
    pub origin: u32,
    /// Host clock when the worker handed it over (and stopped renewing its lease).
    pub handed_ms: u64,
}

/// What a worker whose detached writes run elsewhere carries there.
#[derive(Debug, Clone)]
pub enum DetachedCarry {
    Write(Box<PortableDetached>),
    /// The client of the worker's request `origin` left, or Envoy answered it: the answer
    /// is only recorded.
    ClientLeft(u32),
}

#[derive(Default)]
pub struct DetachedWrites {
    /// Another root sends this one's writes (the native build's main thread, which runs
    /// when this worker has no request): what this root would send waits in `outgoing`.
    elsewhere: Cell<bool>,
    outgoing: RefCell<Vec<DetachedCarry>>,
    /// How many roots' budgets this one holds (`send_for`; 0 and 1: its own).
    scale: Cell<usize>,
    budget: Rc<Budget>,
    queued: RefCell<Vec<DetachedWrite>>,
    in_flight: RefCell<HashMap<u32, InFlight>>,
}

impl DetachedWrites {
    /// From now on, this root's detached writes go to `outgoing` for the host to carry to
    /// the root that sends them.
    pub fn send_elsewhere(&self) {
        self.elsewhere.set(true);
    }

    /// This root sends for `roots` others: its budget is theirs together, up to
    /// `resolutions::MAX_SERVED_ROOTS` times a worker's.
    pub fn send_for(&self, roots: usize) {
        self.scale
            .set(roots.clamp(1, super::resolutions::MAX_SERVED_ROOTS));
    }

    pub fn sent_elsewhere(&self) -> bool {
        self.elsewhere.get()
    }

    pub fn carry(&self, what: DetachedCarry) {
        self.outgoing.borrow_mut().push(what);
    }

    pub fn has_outgoing(&self) -> bool {
        !self.outgoing.borrow().is_empty()
    }

    pub fn take_outgoing(&self) -> Vec<DetachedCarry> {
        std::mem::take(&mut *self.outgoing.borrow_mut())
    }

    /// A place for a write of `bytes`, or None when the worker holds its budget already.
    pub fn reserve(&self, bytes: usize) -> Option<DetachedTicket> {
        let b = &self.budget;
        let scale = self.scale.get().max(1);
        let fits = b.writes.get() < MAX_DETACHED_WRITES.saturating_mul(scale)
            && b.bytes.get().saturating_add(bytes) <= MAX_DETACHED_BYTES.saturating_mul(scale);
        if !fits {
            return None;
        }
        b.writes.set(b.writes.get().saturating_add(1));
        b.bytes.set(b.bytes.get().saturating_add(bytes));
        Some(DetachedTicket {
            budget: Rc::clone(&self.budget),
            bytes,
        })
    }

    /// Called from a request: the root sends the write when it wakes (the caller wakes it).
    pub fn queue(&self, write: DetachedWrite) {
        self.queued.borrow_mut().push(write);
    }

    /// Called from the root: sends every queued write. Those Envoy refused come back with
    /// why, for the root to hand to their requests.
    pub fn send_queued(&self, host: &impl Host) -> Vec<(DetachedWrite, String)> {
        let queued: Vec<DetachedWrite> = self.queued.borrow_mut().drain(..).collect();
        let mut refused = Vec::new();
        for write in queued {
            let request = &write.request;
            let sent = host.dispatch_callout(&Callout {
                cluster: &write.cluster,
                headers: pairs(&request.headers),
                body: &request.body,
                trailers: pairs(&request.trailers),
                timeout_ms: write.timeout_ms.max(1),
            });
            match sent {
                Ok(token) => {
                    let DetachedWrite {
                        context_id,
                        rule,
                        timeout_ms,
                        ticket,
                        ..
                    } = write;
                    let flight = InFlight {
                        context_id,
                        rule,
                        sent_ms: host.now_ms(),
                        timeout_ms,
                        ticket,
                    };
                    self.in_flight.borrow_mut().insert(token, flight);
                }
                Err(e) => {
                    let why = format!(
                        "Envoy refused the callout to cluster '{}': {}",
                        write.cluster, e.0
                    );
                    refused.push((write, why));
                }
            }
        }
        refused
    }

    /// Writes whose answer is overdue (their timeout and a grace period passed): taken out,
    /// for the root to end as unknown outcomes. A late answer then finds no write.
    pub fn take_overdue(&self, now_ms: u64) -> Vec<InFlight> {
        let mut in_flight = self.in_flight.borrow_mut();
        let overdue: Vec<u32> = in_flight
            .iter()
            .filter(|(_, f)| {
                now_ms
                    >= f.sent_ms
                        .saturating_add(f.timeout_ms)
                        .saturating_add(OVERDUE_GRACE_MS)
            })
            .map(|(token, _)| *token)
            .collect();
        overdue
            .into_iter()
            .filter_map(|token| in_flight.remove(&token))
            .collect()
    }

    /// Every write, queued and in flight, taken out (the root is going: Envoy cancels its
    /// callouts).
    pub fn take_all(&self) -> (Vec<DetachedWrite>, Vec<InFlight>) {
        let queued = self.queued.borrow_mut().drain(..).collect();
        let in_flight = self
            .in_flight
            .borrow_mut()
            .drain()
            .map(|(_, f)| f)
            .collect();
        (queued, in_flight)
    }

    /// The write whose callout answered with `token`, if it is one.
    pub fn take(&self, token: u32) -> Option<InFlight> {
        self.in_flight.borrow_mut().remove(&token)
    }

    /// Writes queued or in flight: a retired configuration's root stays for them.
    pub fn len(&self) -> usize {
        self.queued.borrow().len() + self.in_flight.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes the worker holds for detached writes now.
    pub fn bytes(&self) -> usize {
        self.budget.bytes.get()
    }
}

fn pairs(list: &[(String, String)]) -> Vec<(&str, &str)> {
    list.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect()
}

/// What an overdue write (see `take_overdue`) is ended with: no response.
pub fn overdue_answer(host: &impl Host, flight: &InFlight) -> DetachedAnswer {
    DetachedAnswer::Response {
        status: 0,
        headers: Vec::new(),
        body: Vec::new(),
        body_omitted: true,
        elapsed_ms: host.now_ms().saturating_sub(flight.sent_ms),
        timeout_ms: flight.timeout_ms,
    }
}

/// Reads the answer being delivered to the root for `flight`: its headers, and its body up
/// to the rule's `max_response_bytes`.
pub fn read_answer(
    host: &impl Host,
    flight: &InFlight,
    num_headers: usize,
    body_size: usize,
) -> DetachedAnswer {
    let elapsed_ms = host.now_ms().saturating_sub(flight.sent_ms);
    let lost = |headers: HeaderPairs| DetachedAnswer::Response {
        status: 0,
        headers,
        body: Vec::new(),
        body_omitted: true,
        elapsed_ms,
        timeout_ms: flight.timeout_ms,
    };
    if num_headers == 0 {
        return lost(Vec::new());
    }
    let headers = match host.callout_response_headers() {
        Ok(headers) => headers,
        Err(e) => {
            log::error!("detached write's response headers unreadable: {}", e.0);
            return lost(Vec::new());
        }
    };
    let Some(status) = status_of(&headers) else {
        return lost(headers);
    };
    let limit = flight.rule.rule.max_response_bytes;
    let (body, body_omitted) = if body_size > limit {
        (Vec::new(), true)
    } else {
        match host.callout_response_body(body_size) {
            Ok(body) => (body, false),
            Err(e) => {
                log::error!("detached write's response body unreadable: {}", e.0);
                (Vec::new(), true)
            }
        }
    };
    DetachedAnswer::Response {
        status,
        headers,
        body,
        body_omitted,
        elapsed_ms,
        timeout_ms: flight.timeout_ms,
    }
}

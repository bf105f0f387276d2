//! A worker's root for one configuration: core's `PluginRoot`, as a Wasm VM's root context
//! holds it, built by the first request the worker sees under that configuration, the time
//! of its next tick, and its store streams' inbox (see docs/how-it-works.md, "The native
//! build").

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_core::host::Host;
use idempotency_core::journey::RequestJourney;
use idempotency_core::root::PluginRoot;

use crate::carried::Refused;
use crate::host::NativeHost;
use crate::inbox::StreamEvent;
use crate::loaded::Shared;
use crate::mailbox::{self, Letter};
use crate::root_streams::RootStreams;
use crate::worker;

pub struct WorkerRoot {
    pub shared: Arc<Shared>,
    root: RefCell<PluginRoot>,
    configured: bool,
    /// What core asked for with `set_tick_period_ms`.
    tick_ms: Cell<u32>,
    /// Monotonic, as proxy-wasm's tick timer is: a wall clock stepped back would stall ticks.
    next_tick: Cell<Option<Instant>>,
    streams: RootStreams,
}

impl WorkerRoot {
    /// Configures core's root for this worker; the configuration was checked on the main
    /// thread already, so a refusal here is not expected: it is logged, and the worker's
    /// requests are answered 503 (`RefusingFilter`), as a failed Wasm VM's are.
    pub fn configure(shared: Arc<Shared>) -> WorkerRoot {
        let context_id = worker::new_root_context_id();
        let mut root = PluginRoot::new(context_id);
        // Envoy runs a request only in its own hooks: what the root has for one is mailed.
        root.deliver_by_mail();
        let tick_ms = Cell::new(0);
        let streams = RootStreams::new(Arc::clone(&shared.courier), context_id);
        let configured = {
            let host = NativeHost {
                configuration: &shared.configuration,
                metrics: &shared.metrics,
                tick_ms: &tick_ms,
                streams: Some(&streams),
                main: None,
                request: None,
            };
            root.on_configure(&host)
        };
        #[cfg(test)]
        let configured = configured && !REFUSE_NEXT_CONFIGURE.with(|refuse| refuse.replace(false));
        if !configured {
            log::error!(
                "this worker's root refused a configuration the module had accepted: its \
                 requests are answered 503"
            );
        }
        // A worker runs only while it has requests: the main thread resolves, and runs
        // detached writes, for it.
        root.resolve_elsewhere();
        root.send_detached_elsewhere();
        WorkerRoot {
            shared,
            root: RefCell::new(root),
            configured,
            tick_ms,
            next_tick: Cell::new(None),
            streams,
        }
    }

    pub fn host(&self) -> NativeHost<'_> {
        NativeHost {
            configuration: &self.shared.configuration,
            metrics: &self.shared.metrics,
            tick_ms: &self.tick_ms,
            streams: Some(&self.streams),
            main: None,
            request: None,
        }
    }

    /// The host for request `context_id` (`handle`), in that request's own hook.
    pub fn host_for(&self, context_id: u32, handle: crate::abi::FilterHandle) -> NativeHost<'_> {
        NativeHost {
            request: Some((context_id, handle)),
            ..self.host()
        }
    }

    /// Where the store thread leaves this root's store stream events.
    pub fn inbox(&self) -> &Arc<crate::inbox::Inbox> {
        &self.streams.inbox
    }

    pub fn new_request(&self, context_id: u32) -> Option<Rc<RefCell<RequestJourney>>> {
        if !self.configured {
            return None;
        }
        self.root.try_borrow().ok()?.new_request(context_id)
    }

    /// How often this root wants its tick.
    pub fn tick_period_ms(&self) -> u32 {
        self.tick_ms.get()
    }

    /// Runs the root's tick if it is due. Host calls act on no request afterwards: the caller
    /// points them back at its own request if it goes on.
    pub fn tick_if_due(&self) {
        let host = self.host();
        let now = Instant::now();
        if self.tick_ms.get() == 0 || self.next_tick.get().is_some_and(|due| now < due) {
            return;
        }
        self.next_tick.set(Some(
            now + Duration::from_millis(u64::from(self.tick_ms.get())),
        ));
        // A tick inside a tick (a request the tick resumes cannot start another) is skipped.
        if let Ok(mut root) = self.root.try_borrow_mut() {
            // The tick is the root's work, not the carrying request's (see `run_caught`).
            run_caught("the root's tick", || root.on_tick(&host));
        }
        // A request the tick answered or resumed may have carried or submitted work.
        self.pass_on();
    }

    /// What a step left goes on now (a request's, the tick's, a store answer's): work for the
    /// main thread's root is carried there, store writes are sent.
    pub fn pass_on(&self) {
        self.carry_to_main();
        self.post_mail();
        self.send_fresh_writes();
        // Sending may have failed a claim that waited for a stream.
        self.post_mail();
    }

    /// Posts what the root left for requests to their mailboxes; a letter no request takes
    /// is handled as undelivered now.
    fn post_mail(&self) {
        let Ok(root) = self.root.try_borrow() else {
            return; // busy further up this stack, which posts it when it ends
        };
        let mail = root.take_mail();
        if mail.is_empty() {
            return;
        }
        let host = self.host();
        for letter in mail {
            if let Err(Letter::Core(letter)) = mailbox::post(Letter::Core(Box::new(letter))) {
                run_caught("undelivered mail", || root.undelivered(&host, *letter));
            }
        }
    }

    /// Request `context_id` (`handle`), in its own hook, takes its letters.
    pub fn deliver_letters(&self, context_id: u32, handle: crate::abi::FilterHandle) {
        let letters = mailbox::take(context_id);
        if letters.is_empty() {
            return;
        }
        let Ok(root) = self.root.try_borrow() else {
            // Busy further up this stack: taken at the request's next wake-up.
            mailbox::put_back(context_id, letters);
            return;
        };
        let host = self.host_for(context_id, handle);
        for letter in letters {
            match letter {
                Letter::Core(mail) => root.deliver_mail(&host, *mail),
                Letter::DetachedReply(reply) => answer_detached(&root, &host, &reply),
            }
        }
        drop(root);
        // The step may have submitted a store write, or recorded an unknown outcome.
        self.pass_on();
    }

    /// Letters their request will never take (it ended first): a claim the store may hold
    /// for it is released.
    pub fn undelivered(&self, letters: Vec<Letter>) {
        if letters.is_empty() {
            return;
        }
        let Ok(root) = self.root.try_borrow() else {
            log::error!(
                "{} letter(s) of an ending request not handled: its root is busy; a claim \
                 among them ends with its lease",
                letters.len()
            );
            return;
        };
        let host = self.host();
        for letter in letters {
            if let Letter::Core(mail) = letter {
                root.undelivered(&host, *mail);
            }
        }
        drop(root);
        self.pass_on();
    }

    /// Carries what this root's requests leave for the main thread's root (see
    /// `main_root.rs`): the resolutions they took on, the detached writes they made and
    /// notices of those writes' clients leaving; and summons it.
    pub fn carry_to_main(&self) {
        let Ok(root) = self.root.try_borrow() else {
            return; // busy further up this stack, which carries them when it ends
        };
        let resolutions = root.has_resolutions_to_carry();
        let detached = root.has_detached_to_carry();
        if !resolutions && !detached {
            return;
        }
        if detached {
            let carried = root.detached_to_carry();
            if let Err(refused) = self
                .shared
                .carried
                .push_detached(&self.streams.inbox, carried)
            {
                // The main thread is not keeping up: kept for the next carry.
                root.keep_detached_to_carry(refused);
            }
        }
        if resolutions {
            match self.shared.carried.push(root.resolutions_to_carry()) {
                Ok(()) => {}
                // The main thread is not keeping up: kept here for the next carry.
                Err(Refused::Full(refused)) => root.keep_to_carry(&self.host(), refused),
                // The configuration is gone (a push): the next one's main root takes them.
                Err(Refused::Closed(refused)) => crate::carried::orphan(refused),
            }
        }
        self.shared.main_thread.summon();
    }

    /// Sends the store writes this root's requests submitted, at once: proxy-wasm wakes a
    /// root when its queue fills, a dynamic module does not (its tick would send them only
    /// at a later request's hook, and an idle worker's never: docs/how-it-works.md).
    fn send_fresh_writes(&self) {
        let Ok(root) = self.root.try_borrow() else {
            return; // busy further up this stack, which sends them at its end
        };
        if !root.has_fresh_writes() {
            return;
        }
        let host = self.host();
        run_caught("sending store writes", || root.send_fresh_writes(&host));
    }

    /// Hands core what the store streams said since the last time, in order, as proxy-wasm
    /// calls the root context for each. Host calls act on no request afterwards.
    pub fn drain_inbox(&self) {
        if self.streams.inbox.is_empty() {
            return;
        }
        // A root already busy further up this stack (a request it resumed came back here)
        // takes the events at its next wake-up instead.
        let Ok(mut root) = self.root.try_borrow_mut() else {
            return;
        };
        let host = self.host();
        let events = self.streams.inbox.take_all();
        for event in events {
            self.streams
                .delivering(event, |event| hand_to_core(&mut root, &host, event));
        }
        drop(root);
        // A store answer may have recorded an unknown outcome (or found one overdue), or
        // submitted a write.
        self.pass_on();
    }
}

/// Runs root work (a tick, a store event) inside whatever hook carries it. A panic in it must
/// not be charged to that request: the factory's barrier would let a new request pass
/// unprotected (a retry of a recorded write runs again), and a poisoned running write would
/// be answered 503 and dropped without a stream end (no unknown outcome recorded: its retry
/// takes the key over once the lease lapses). Caught here, logged, and the hook goes on.
/// One store stream event, as proxy-wasm calls a root context for it.
pub(crate) fn hand_to_core(root: &mut PluginRoot, host: &NativeHost<'_>, event: &StreamEvent) {
    run_caught("a store stream event", || match event {
        StreamEvent::InitialMetadata { token, .. } => root.on_grpc_initial_metadata(host, *token),
        StreamEvent::Message { token, message } => {
            root.on_grpc_message(host, *token, message.len());
        }
        StreamEvent::Closed { token, status } => root.on_grpc_close(host, *token, *status),
        StreamEvent::Reply(reply) => answer_elsewhere(reply),
    });
}

/// The main thread's root ran this request's detached write: its answer goes to the
/// request's mailbox, taken in the request's own hook.
fn answer_elsewhere(reply: &crate::inbox::Reply) {
    if mailbox::post(Letter::DetachedReply(Box::new(reply.clone()))).is_err() {
        log::debug!("a detached write's client left before its answer; it was recorded");
    }
}

/// The answer to the request's detached write, sent in its own hook.
fn answer_detached(root: &PluginRoot, host: &NativeHost<'_>, reply: &crate::inbox::Reply) {
    if !root.answered_elsewhere(reply.context_id) {
        return;
    }
    let headers: Vec<(&str, &[u8])> = reply
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_slice()))
        .collect();
    let trailers: Vec<(&str, &[u8])> = reply
        .trailers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_slice()))
        .collect();
    let sent = if trailers.is_empty() {
        host.send_local_reply(reply.status, &headers, &reply.body)
    } else {
        host.send_reply_with_trailers(reply.status, &headers, &reply.body, &trailers)
    };
    if let Err(e) = sent {
        log::warn!("a detached write's answer not sent to its client: {}", e.0);
    }
}

#[cfg(test)]
thread_local! {
    /// Fault injection: the next worker root built on this thread refuses its configuration.
    pub static REFUSE_NEXT_CONFIGURE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(crate) fn run_caught(what: &str, work: impl FnOnce()) {
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
    if let Err(payload) = ran {
        let text = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(not a string)");
        log::error!("panic in {what}: {text}; it is cut short");
    }
}

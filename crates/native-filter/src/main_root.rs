//! The configuration's root on Envoy's main thread: core's `PluginRoot` for the work that must
//! go on whether or not a worker has requests (docs/how-it-works.md, "The native build: the
//! main root").
//!
//! A worker's root runs only inside its requests' hooks: the ABI gives no per-worker timer,
//! and a configuration's callouts and scheduler belong to the main thread. An unknown outcome
//! a quiet worker recorded would wait for that worker's next request before anyone asked the
//! service about it. So a worker hands its resolutions here (core's `resolve_elsewhere`); this
//! root asks the service with the configuration's own callouts, which outlive every request,
//! settles the key in the process's shared data (and the store, over streams of the courier's
//! like a worker's), and runs on the configuration's scheduler: when a worker carries work
//! here, when the courier runs, and on the process ticker's sweeps while it holds any.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency_core::host::{Callout, HeaderPairs, HostError};
use idempotency_core::plugin::resolutions::PortableResolution;
use idempotency_core::root::PluginRoot;

use crate::abi::{CalloutResult, MainThreadConfig};
use crate::host::NativeHost;
use crate::inbox::StreamEvent;
use crate::loaded::Shared;
use crate::root::run_caught;
use crate::root_streams::RootStreams;
use crate::worker;

/// Resolutions carried from the workers, waiting for the main thread (bounded: each worker
/// holds at most core's budget, and the main thread takes them at its next run).
pub const MAX_CARRIED: usize = idempotency_core::plugin::resolutions::MAX_RESOLUTIONS;

/// What the workers leave for the main root.
#[derive(Default)]
pub struct Carried {
    resolutions: Mutex<Vec<PortableResolution>>,
}

impl Carried {
    /// From a worker: Err gives back what did not fit (the main thread is not keeping up).
    pub fn push(
        &self,
        resolutions: Vec<PortableResolution>,
    ) -> Result<(), Vec<PortableResolution>> {
        let mut held = self
            .resolutions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let room = MAX_CARRIED.saturating_sub(held.len());
        let mut resolutions = resolutions;
        let refused = resolutions.split_off(room.min(resolutions.len()));
        held.extend(resolutions);
        if refused.is_empty() {
            Ok(())
        } else {
            Err(refused)
        }
    }

    pub fn take_all(&self) -> Vec<PortableResolution> {
        std::mem::take(
            &mut *self
                .resolutions
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.resolutions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .is_empty()
    }
}

/// The configuration's one-shot callouts (a trait so the main root is tested without Envoy).
pub trait ConfigCallouts {
    fn callout(
        &self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u64, String>;
}

impl ConfigCallouts for MainThreadConfig {
    fn callout(
        &self,
        cluster: &str,
        headers: &[(&str, &[u8])],
        body: &[u8],
        timeout_ms: u64,
    ) -> Result<u64, String> {
        self.http_callout(cluster, headers, body, Duration::from_millis(timeout_ms))
            .map_err(|e| e.to_string())
    }
}

/// An answer as Envoy delivered it.
struct Answer {
    callout_id: u64,
    headers: HeaderPairs,
    body: Vec<u8>,
}

/// The main root's callouts in flight, by Envoy's id, under core's tokens; and the answer
/// being delivered, which `callout_response_*` read as proxy-wasm's do.
#[derive(Default)]
pub struct Callouts {
    tokens: RefCell<HashMap<u64, u32>>,
    next_token: Cell<u32>,
    current: RefCell<Option<(HeaderPairs, Vec<u8>)>>,
    /// Answers that came while the root was busy (Envoy may answer inside the call that
    /// started the callout), delivered once it is free.
    early: RefCell<Vec<Answer>>,
}

/// What a main root's host makes its callouts with, for one hook.
#[derive(Clone, Copy)]
pub struct MainCalls<'a> {
    pub config: &'a dyn ConfigCallouts,
    pub callouts: &'a Callouts,
}

impl MainCalls<'_> {
    pub fn dispatch(&self, callout: &Callout<'_>) -> Result<u32, HostError> {
        let headers: Vec<(&str, &[u8])> = callout
            .headers
            .iter()
            .map(|(n, v)| (*n, v.as_bytes()))
            .collect();
        if !callout.trailers.is_empty() {
            log::debug!("a callout's trailers are not sent (Envoy's callout takes none)");
        }
        let id = self
            .config
            .callout(callout.cluster, &headers, callout.body, callout.timeout_ms)
            .map_err(HostError)?;
        let callouts = self.callouts;
        let token = callouts.next_token.get().wrapping_add(1).max(1);
        callouts.next_token.set(token);
        callouts.tokens.borrow_mut().insert(id, token);
        Ok(token)
    }

    pub fn response_headers(&self) -> Result<HeaderPairs, HostError> {
        match &*self.callouts.current.borrow() {
            Some((headers, _)) => Ok(headers.clone()),
            None => Err(HostError("no callout answer is being delivered".into())),
        }
    }

    pub fn response_body(&self, size: usize) -> Result<Vec<u8>, HostError> {
        match &*self.callouts.current.borrow() {
            Some((_, body)) => Ok(body.get(..size).unwrap_or(body).to_vec()),
            None => Err(HostError("no callout answer is being delivered".into())),
        }
    }
}

pub struct MainRoot {
    shared: Arc<Shared>,
    root: RefCell<PluginRoot>,
    /// What core asked for with `set_tick_period_ms`.
    tick_ms: Cell<u32>,
    next_tick: Cell<Option<Instant>>,
    streams: RootStreams,
    callouts: Callouts,
}

impl MainRoot {
    /// Configures core's root on the main thread (the configuration was checked at load).
    pub fn configure(shared: Arc<Shared>, config: &dyn ConfigCallouts) -> Option<MainRoot> {
        let main = MainRoot {
            root: RefCell::new(PluginRoot::new(worker::new_root_context_id())),
            tick_ms: Cell::new(0),
            next_tick: Cell::new(None),
            streams: RootStreams::new(Arc::clone(&shared.courier)),
            callouts: Callouts::default(),
            shared,
        };
        let configured = {
            let host = main.host(config);
            worker::act_on_none();
            main.root.borrow_mut().on_configure(&host)
        };
        if !configured {
            log::error!("the main thread's root refused a configuration the module had accepted");
            return None;
        }
        Some(main)
    }

    fn host<'a>(&'a self, config: &'a dyn ConfigCallouts) -> NativeHost<'a> {
        NativeHost {
            configuration: &self.shared.configuration,
            metrics: &self.shared.metrics,
            tick_ms: &self.tick_ms,
            streams: Some(&self.streams),
            main: Some(MainCalls {
                config,
                callouts: &self.callouts,
            }),
        }
    }

    /// Takes what the workers carried here, what its store streams said, and its tick if
    /// due. True while it holds work (the ticker's sweeps bring the main thread back).
    pub fn run(&self, config: &dyn ConfigCallouts) -> bool {
        let carried = self.shared.carried.take_all();
        if let Ok(mut root) = self.root.try_borrow_mut() {
            let host = self.host(config);
            worker::act_on_none();
            if !carried.is_empty() {
                run_caught("resolutions carried here", || {
                    root.take_resolutions(&host, carried);
                });
            }
            self.drain_inbox(&host, &mut root);
            let now = Instant::now();
            let due = self.tick_ms.get() != 0 && self.next_tick.get().is_none_or(|at| now >= at);
            if due {
                let period = Duration::from_millis(u64::from(self.tick_ms.get()));
                self.next_tick.set(Some(now + period));
                run_caught("the main root's tick", || root.on_tick(&host));
            }
        } else if !carried.is_empty() {
            // Busy further up this stack: taken at the next run.
            let _kept = self.shared.carried.push(carried);
        }
        self.deliver_early(config);
        self.busy()
    }

    /// Whether this root holds work its ticks move on.
    pub fn busy(&self) -> bool {
        self.root
            .try_borrow()
            .map_or(true, |root| root.has_unfinished_work())
            || !self.streams.inbox.is_empty()
    }

    fn drain_inbox(&self, host: &NativeHost<'_>, root: &mut PluginRoot) {
        for event in self.streams.inbox.take_all() {
            self.streams.delivering(event, |event| {
                run_caught("a store stream event", || match event {
                    StreamEvent::InitialMetadata { token, .. } => {
                        root.on_grpc_initial_metadata(host, *token);
                    }
                    StreamEvent::Message { token, message } => {
                        root.on_grpc_message(host, *token, message.len());
                    }
                    StreamEvent::Closed { token, status } => {
                        root.on_grpc_close(host, *token, *status);
                    }
                });
            });
        }
    }

    /// Envoy answered the callout `callout_id` (main thread).
    pub fn on_callout_done(
        &self,
        config: &dyn ConfigCallouts,
        callout_id: u64,
        result: CalloutResult,
        headers: HeaderPairs,
        body: Vec<u8>,
    ) {
        if result != CalloutResult::Success {
            log::debug!("a callout of the main root ended without an answer: {result:?}");
        }
        self.callouts.early.borrow_mut().push(Answer {
            callout_id,
            headers,
            body,
        });
        self.deliver_early(config);
    }

    /// Hands core the answers whose callouts it knows, unless it is busy further up this
    /// stack (then they wait for the end of that call).
    fn deliver_early(&self, config: &dyn ConfigCallouts) {
        loop {
            let Ok(mut root) = self.root.try_borrow_mut() else {
                return;
            };
            let next = {
                let mut early = self.callouts.early.borrow_mut();
                let tokens = self.callouts.tokens.borrow();
                let known = early
                    .iter()
                    .position(|a| tokens.contains_key(&a.callout_id));
                known.map(|at| early.swap_remove(at))
            };
            let Some(answer) = next else {
                // Answers for no callout of ours: the root is free, so none is being started.
                self.callouts.early.borrow_mut().clear();
                return;
            };
            let Some(token) = self.callouts.tokens.borrow_mut().remove(&answer.callout_id) else {
                continue;
            };
            let host = self.host(config);
            worker::act_on_none();
            let num_headers = answer.headers.len();
            let body_size = answer.body.len();
            *self.callouts.current.borrow_mut() = Some((answer.headers, answer.body));
            run_caught("a callout's answer", || {
                root.on_callout_answer(&host, token, num_headers, body_size);
            });
            *self.callouts.current.borrow_mut() = None;
        }
    }
}

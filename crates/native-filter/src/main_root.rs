//! The configuration's root on Envoy's main thread: core's `PluginRoot` for the work that must
//! go on whether or not a worker has requests (docs/how-it-works.md, "The native build: who
//! runs where", the main root).
//!
//! A worker's root runs only inside its requests' hooks: the ABI gives no per-worker timer,
//! and a configuration's callouts and scheduler belong to the main thread. An unknown outcome
//! a quiet worker recorded would wait for that worker's next request before anyone asked the
//! service about it, and a detached write whose client left would have nobody to record its
//! answer or renew its lease. So a worker hands its resolutions and its detached writes here
//! (core's `resolve_elsewhere`, `send_detached_elsewhere`); this root asks the service and
//! sends the writes with the configuration's own callouts, which outlive every request,
//! settles keys in the process's shared data (and the store, over streams of the courier's
//! like a worker's), answers a detached write's client through its worker's inbox, and runs
//! on the configuration's scheduler (`main_thread.rs`): when a worker carries work here, when
//! its store streams answer, and on the process ticker's sweeps while it holds any.

use std::cell::{Cell, RefCell};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_core::host::HeaderPairs;
use idempotency_core::plugin::detached::DetachedCarry;
use idempotency_core::plugin::resolutions::PortableResolution;
use idempotency_core::root::PluginRoot;

use crate::abi::CalloutResult;
use crate::config_callouts::{Answer, Callouts, ConfigCallouts, MainCalls, Remote, Remotes};
use crate::host::NativeHost;
use crate::inbox::Inbox;
use crate::loaded::Shared;
use crate::root::{hand_to_core, run_caught};
use crate::root_streams::RootStreams;
use crate::worker;

/// The callouts of a configuration that is going: none.
struct Gone;

impl ConfigCallouts for Gone {
    fn callout(
        &self,
        _cluster: &str,
        _headers: &[(&str, &[u8])],
        _body: &[u8],
        _timeout_ms: u64,
    ) -> Result<u64, String> {
        Err("the configuration is going".into())
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
    /// Its contexts that stand for workers' requests (their detached writes).
    remotes: Remotes,
}

impl MainRoot {
    /// Configures core's root on the main thread (the configuration was checked at load).
    pub fn configure(shared: Arc<Shared>, config: &dyn ConfigCallouts) -> Option<MainRoot> {
        let context_id = worker::new_root_context_id();
        let main = MainRoot {
            root: RefCell::new(PluginRoot::new(context_id)),
            tick_ms: Cell::new(0),
            next_tick: Cell::new(None),
            streams: RootStreams::new(Arc::clone(&shared.courier), context_id),
            callouts: Callouts::default(),
            remotes: Remotes::default(),
            shared,
        };
        let configured = {
            let host = main.host(config);
            main.root
                .borrow_mut()
                .on_configure_to_resolve_for(&host, usize::MAX)
        };
        if !configured {
            log::error!("the main thread's root refused a configuration the module had accepted");
            return None;
        }
        // What its store streams say (on the store thread) brings the main thread here.
        main.streams
            .inbox
            .add_waker(Arc::clone(&main.shared.main_thread) as Arc<dyn crate::ticker::Wake>);
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
                remotes: &self.remotes,
            }),
            request: None,
        }
    }

    /// Takes what the workers carried here, what its store streams said, and its tick if
    /// due. True while it holds work (the ticker's sweeps bring the main thread back).
    pub fn run(&self, config: &dyn ConfigCallouts) -> bool {
        // Busy further up this stack: what waits is taken at the next run.
        if let Ok(mut root) = self.root.try_borrow_mut() {
            let host = self.host(config);
            let mut carried = self.shared.carried.take_all();
            carried.extend(crate::carried::take_orphans(|r| root.has_rule(&r.rule)));
            if !carried.is_empty() {
                run_caught("resolutions carried here", || {
                    root.take_resolutions(&host, carried);
                });
            }
            for (inbox, carry) in self.shared.carried.take_detached() {
                run_caught("a detached write carried here", || {
                    self.take_detached(&host, &mut root, inbox, carry);
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
        }
        self.deliver_early(config);
        self.busy()
    }

    /// A worker's detached write runs here as a context of this root's, which stands for the
    /// worker's request until it is answered or its client leaves.
    fn take_detached(
        &self,
        host: &NativeHost<'_>,
        root: &mut PluginRoot,
        inbox: Arc<Inbox>,
        carry: DetachedCarry,
    ) {
        match carry {
            DetachedCarry::Write(write) => {
                let context_id = worker::new_context_id();
                self.remotes.add(
                    context_id,
                    Remote {
                        inbox,
                        origin: write.origin,
                    },
                );
                root.take_detached(host, vec![(context_id, *write)]);
            }
            DetachedCarry::ClientLeft(origin) => {
                if let Some(context_id) = self.remotes.remove_origin(&inbox, origin) {
                    root.client_left(host, context_id);
                }
            }
        }
    }

    /// Its configuration is going, and Envoy cancels its callouts: the detached writes it
    /// sent are unknown outcomes (those not sent free their keys), and every resolution it
    /// holds, those included, is returned for the next configuration's main root.
    pub fn retire(&self) -> Vec<PortableResolution> {
        let Ok(mut root) = self.root.try_borrow_mut() else {
            log::error!("the main thread's root is busy as its configuration goes");
            return Vec::new();
        };
        let host = self.host(&Gone);
        run_caught("giving up detached writes", || root.give_up_detached(&host));
        root.surrender_resolutions()
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
            self.streams
                .delivering(event, |event| hand_to_core(root, host, event));
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::carried::{Carried, Refused, MAX_CARRIED};
    use idempotency_core::host::Callout;
    use idempotency_core::plugin::resolutions::PortableResolution;

    /// Envoy's callout ids as the fake hands them out, and what it was asked.
    #[derive(Default)]
    struct FakeCallouts {
        asked: RefCell<Vec<(String, u64)>>,
        refuse: Cell<bool>,
    }

    impl ConfigCallouts for FakeCallouts {
        fn callout(
            &self,
            cluster: &str,
            _headers: &[(&str, &[u8])],
            _body: &[u8],
            timeout_ms: u64,
        ) -> Result<u64, String> {
            if self.refuse.get() {
                return Err("no such cluster".into());
            }
            self.asked.borrow_mut().push((cluster.into(), timeout_ms));
            // Envoy's ids are its own: far from core's tokens.
            Ok(1_000 + self.asked.borrow().len() as u64)
        }
    }

    fn callout(cluster: &str) -> Callout<'_> {
        Callout {
            cluster,
            headers: vec![(":method", "GET"), (":path", "/payments/by-key/k")],
            body: b"",
            trailers: Vec::new(),
            timeout_ms: 500,
        }
    }

    #[test]
    fn each_callout_gets_its_own_token_and_a_refusal_is_an_error() {
        let fake = FakeCallouts::default();
        let callouts = Callouts::default();
        let remotes = crate::config_callouts::Remotes::default();
        let calls = MainCalls {
            config: &fake,
            callouts: &callouts,
            remotes: &remotes,
        };
        let first = calls.dispatch(&callout("payments")).unwrap();
        let second = calls.dispatch(&callout("payments")).unwrap();
        assert_ne!(first, second);
        assert_ne!(first, 0, "zero is proxy-wasm's none");
        assert_eq!(callouts.tokens.borrow().get(&1_001), Some(&first));
        assert_eq!(callouts.tokens.borrow().get(&1_002), Some(&second));
        fake.refuse.set(true);
        assert!(calls.dispatch(&callout("nowhere")).is_err());
        assert_eq!(
            callouts.tokens.borrow().len(),
            2,
            "a refused callout is not awaited"
        );
    }

    #[test]
    fn an_answer_is_read_only_while_it_is_delivered() {
        let fake = FakeCallouts::default();
        let callouts = Callouts::default();
        let remotes = crate::config_callouts::Remotes::default();
        let calls = MainCalls {
            config: &fake,
            callouts: &callouts,
            remotes: &remotes,
        };
        assert!(calls.response_headers().is_err());
        *callouts.current.borrow_mut() = Some((
            vec![(":status".into(), b"200".to_vec())],
            b"{\"paid\":true}".to_vec(),
        ));
        assert_eq!(calls.response_headers().unwrap().len(), 1);
        assert_eq!(calls.response_body(6).unwrap(), b"{\"paid");
        assert_eq!(calls.response_body(1 << 20).unwrap(), b"{\"paid\":true}");
    }

    #[test]
    fn the_carried_queue_gives_back_what_does_not_fit() {
        let carried = Carried::default();
        let one = || PortableResolution {
            rule: idempotency_core::config::Config::parse(
                br#"{"rules":[{"name":"pay","match":{"path_prefixes":["/p"]},
                "resolve":{"cluster":"c","path":"/p/{key}","settle_seconds":5}}]}"#,
            )
            .unwrap()
            .rules
            .remove(0),
            held: idempotency_core::table::Held {
                slot: None,
                key: [7; 32],
                fingerprint: [0; 32],
                owner: 1,
                took_over: false,
                evicted: None,
                completed_status: None,
                unlanded: None,
            },
            lookup: idempotency_core::resolve::lookup::LookupRequest {
                cluster: "c".into(),
                headers: Vec::new(),
                body: Vec::new(),
                key_metadata: Vec::new(),
                timeout_ms: 1,
            },
            unknown: Default::default(),
            due_ms: 0,
            adopted: false,
            store: None,
        };
        let full: Vec<PortableResolution> = (0..MAX_CARRIED).map(|_| one()).collect();
        assert!(carried.push(full).is_ok());
        let Err(Refused::Full(refused)) = carried.push(vec![one(), one()]) else {
            panic!("a full queue gives back what does not fit");
        };
        assert_eq!(refused.len(), 2);
        assert_eq!(carried.take_all().len(), MAX_CARRIED);
        assert!(carried.is_empty());
        assert!(carried.push(vec![one()]).is_ok());
        assert_eq!(
            carried.close().0.len(),
            1,
            "what was queued goes with the close"
        );
        let Err(Refused::Closed(after)) = carried.push(vec![one()]) else {
            panic!("a closed queue takes nothing");
        };
        assert_eq!(after.len(), 1);
    }
}

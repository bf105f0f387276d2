//! A filter configuration as Envoy creates it on the main thread: checked whole before Envoy
//! takes it (so a bad one is refused at load, naming the field), its metrics defined, then
//! shared read-only by every worker, each of which builds its own root from it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use idempotency_core::config::Config;
use idempotency_core::root::PluginRoot;

use std::cell::RefCell;

use crate::abi::{CalloutResult, ConfigHandle, MainThreadConfig};
use crate::carried::Carried;
use crate::courier::Courier;
use crate::host::NativeHost;
use crate::loaded::{Shared, RETIREMENTS};
use crate::main_root::MainRoot;
use crate::main_thread::MainThread;
use crate::metrics::Metrics;
use crate::refusing_filter::RefusingFilter;

impl Drop for Configuration {
    /// Envoy destroys the configuration on the main thread once none of its requests is left:
    /// its roots' store streams are closed, and its handoff lands what they left.
    fn drop(&mut self) {
        // Envoy cancels its callouts: the detached writes its main root has out become
        // unknown outcomes (`MainRoot::retire`), and its resolutions, those included, go to
        // the next configuration's main root (lost with this one, their keys would answer
        // "come back" until their TTL).
        let (mut left, unsent) = self.shared.carried.close();
        if let MainSlot::Built(main) = self.main.0.get_mut() {
            left.extend(main.retire());
        }
        crate::carried::orphan(left);
        if unsent > 0 {
            // Never sent, so never run; their claims lapse after their lease.
            log::warn!(
                "{unsent} detached write(s) were not sent: their configuration went first; \
                 their keys are free again once their lease passes"
            );
        }
        self.shared.courier.retire();
        self.shared.main_thread.retire();
        self.shared.retired.store(true, Ordering::Release);
        RETIREMENTS.fetch_add(1, Ordering::AcqRel);
    }
}

pub struct Configuration {
    pub shared: Arc<Shared>,
    /// `grpc_replay_echo`: its requests get the echo, with no root (see `echo_filter`).
    replay_echo: bool,
    /// The main thread's root, built when a worker first carries work to it.
    main: MainThreadOnly<RefCell<MainSlot>>,
}

enum MainSlot {
    NotBuilt,
    Built(Box<MainRoot>),
    /// Its configure failed (logged): what is carried here is dropped, and logged.
    Refused,
}

/// What only the configuration's main-thread hooks touch: each reaches it through the
/// `MainThreadConfig` only such a hook holds.
struct MainThreadOnly<T>(T);

// SAFETY: the value is reached only through `get`, which takes the proof of being in one of
// the configuration's main-thread hooks (`MainThreadConfig` is neither Send nor Sync, and made
// only there); Envoy runs those hooks one at a time, on the main thread. Envoy may destroy the
// configuration (drop) on whichever thread lets it go last, but then no hook of it runs any
// more and nothing else holds the value: it is never touched by two threads at once.
unsafe impl<T> Send for MainThreadOnly<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for MainThreadOnly<T> {}

impl<T> MainThreadOnly<T> {
    fn get(&self, _on_main_thread: &MainThreadConfig) -> &T {
        &self.0
    }
}

impl Configuration {
    /// Err names what is wrong; Envoy then refuses the filter.
    pub fn load(bytes: &[u8], handle: ConfigHandle) -> Result<Configuration, String> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        // Which build is running, once per process, so a log shows what a rollout loaded.
        static LOADED: std::sync::Once = std::sync::Once::new();
        LOADED.call_once(|| {
            log::info!(
                "idempotency-filter {} loaded (native build)",
                env!("CARGO_PKG_VERSION")
            );
        });
        let config = Config::parse(bytes).map_err(|e| e.to_string())?;
        let addresses = store_addresses(&config)?;
        let shared = Arc::new(Shared {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            configuration: bytes.to_vec(),
            metrics: Metrics::new(handle),
            courier: Courier::new(addresses),
            main_thread: MainThread::new(handle.new_scheduler()),
            carried: Carried::default(),
            retired: AtomicBool::new(false),
        });
        if config.grpc_replay_echo {
            crate::echo_filter::announce();
            shared.metrics.freeze();
            return Ok(Configuration {
                shared,
                replay_echo: true,
                main: MainThreadOnly(RefCell::new(MainSlot::NotBuilt)),
            });
        }
        // Built once here, as a Wasm filter's configuration is checked in a VM of its own:
        // every metric a worker's root will define is defined now, while Envoy allows it.
        let tick_ms = std::cell::Cell::new(0);
        let host = NativeHost {
            configuration: &shared.configuration,
            metrics: &shared.metrics,
            tick_ms: &tick_ms,
            streams: None,
            main: None,
            request: None,
        };
        // Checked only: a store stream is a worker root's (opening one here only logged a
        // warning at every load).
        let mut trial = PluginRoot::new(0);
        let accepted = trial.check_configuration(&host);
        shared.metrics.freeze();
        if !accepted {
            // Envoy never takes it: nothing keeps its courier on the store thread.
            shared.courier.retire();
            shared.main_thread.retire();
            return Err("the configuration was refused (the log line before says why)".into());
        }
        Ok(Configuration {
            shared,
            replay_echo: false,
            main: MainThreadOnly(RefCell::new(MainSlot::NotBuilt)),
        })
    }
}

thread_local! {
    /// This worker's roots, one per configuration.
    static ROOTS: crate::worker::Roots<crate::root::WorkerRoot> = crate::worker::Roots::default();
    /// The retirements this worker has already swept for.
    static RETIREMENTS_SEEN: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

impl crate::abi::FilterFactory for Configuration {
    fn new_filter(&self, filter: &crate::abi::Filter) -> Option<Box<dyn crate::abi::HttpFilter>> {
        if self.replay_echo {
            let echo = crate::echo_filter::EchoFilter::new(Arc::clone(&self.shared), filter);
            return Some(Box::new(echo));
        }
        sweep_retired_roots();
        let shared = &self.shared;
        let root = ROOTS.with(|roots| {
            roots.get_or_insert_with(shared.id, || {
                crate::root::WorkerRoot::configure(Arc::clone(shared))
            })
        });
        // The worker's upkeep runs at its requests when due, and what the store said while
        // no request of this worker could be woken is taken now (see docs/how-it-works.md).
        root.drain_inbox();
        root.tick_if_due();
        let context_id = crate::worker::new_context_id();
        let Some(journey) = root.new_request(context_id) else {
            // A root that refused the configuration (logged when it did), or one busy further
            // up this stack: nothing can protect this request.
            return Some(Box::new(RefusingFilter));
        };
        crate::worker::register(context_id);
        Some(Box::new(crate::filter::NativeFilter::new(
            root,
            journey,
            context_id,
            filter.handle(),
        )))
    }

    fn failed_filter(&self) -> Option<Box<dyn crate::abi::HttpFilter>> {
        if self.replay_echo {
            return None;
        }
        Some(Box::new(RefusingFilter))
    }

    fn on_config_scheduled(&self, config: &MainThreadConfig, _event_id: u64) {
        self.shared.main_thread.on_scheduled();
        self.run_main_root(config);
    }

    fn on_config_callout_done(
        &self,
        config: &MainThreadConfig,
        callout_id: u64,
        result: CalloutResult,
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
    ) {
        match self.main.get(config).try_borrow().as_deref() {
            Ok(MainSlot::Built(main)) => {
                main.on_callout_done(config, callout_id, result, headers, body);
            }
            _ => log::warn!("a callout answer for no main root of this configuration dropped"),
        }
        self.run_main_root(config);
    }
}

impl Configuration {
    /// Runs the main thread's root, building it when the workers first carry work here; the
    /// ticker's sweeps bring the main thread back while it holds work.
    fn run_main_root(&self, config: &MainThreadConfig) {
        let slot = self.main.get(config);
        if let Ok(mut slot) = slot.try_borrow_mut() {
            let work = !self.shared.carried.is_empty() || crate::carried::has_orphans();
            if matches!(*slot, MainSlot::NotBuilt) && work {
                *slot = match MainRoot::configure(Arc::clone(&self.shared), config) {
                    Some(main) => MainSlot::Built(Box::new(main)),
                    None => MainSlot::Refused,
                };
            }
        }
        // Shared while it runs: Envoy may answer a callout inside the call that starts it.
        let Ok(slot) = slot.try_borrow() else {
            return;
        };
        let busy = match &*slot {
            MainSlot::Built(main) => main.run(config),
            MainSlot::Refused => {
                // Not seen in practice (the configuration was checked at load); their keys
                // stay unknown, as under a worker that could hold no more.
                let dropped = self.shared.carried.take_all();
                if !dropped.is_empty() {
                    log::error!(
                        "{} resolution(s) dropped: the main thread's root refused the \
                         configuration",
                        dropped.len()
                    );
                }
                false
            }
            MainSlot::NotBuilt => false,
        };
        self.shared.main_thread.keep_ticking(busy);
    }
}

/// The store's `host:port` by cluster name, for every store a rule uses: the native build
/// dials the store itself, so a rule in cluster mode without one is refused at load.
fn store_addresses(config: &Config) -> Result<std::collections::HashMap<String, String>, String> {
    let mut addresses = std::collections::HashMap::new();
    for rule in &config.rules {
        let Some(store) = &rule.store else { continue };
        if store.transport == idempotency_core::config::StoreTransport::Http {
            // Its claims would be a request's callouts through Envoy's cluster and its writes
            // the module's: one path could fail alone, and a write whose renewals and
            // completion never land would run again once its lease lapsed.
            return Err(format!(
                "rule {:?}: store.transport: the native build speaks to the store over its \
                 stream only; \"http\" is the Wasm build's",
                rule.name
            ));
        }
        let Some(address) = &store.address else {
            return Err(format!(
                "rule {:?}: store.address: the native build connects to the store itself; \
                 give the store's host:port (cluster {:?} is the Wasm build's)",
                rule.name, store.cluster
            ));
        };
        match addresses.insert(store.cluster.clone(), address.clone()) {
            Some(other) if &other != address => {
                return Err(format!(
                    "rule {:?}: store.address: cluster {:?} is given two addresses, {other} \
                     and {address}",
                    rule.name, store.cluster
                ));
            }
            _ => {}
        }
    }
    Ok(addresses)
}

/// Drops this worker's roots of configurations Envoy let go of (their live requests keep
/// theirs until they end).
fn sweep_retired_roots() {
    let now = RETIREMENTS.load(Ordering::Acquire);
    if RETIREMENTS_SEEN.with(|seen| seen.replace(now)) == now {
        return;
    }
    ROOTS.with(|roots| roots.retain(|root| !root.shared.retired.load(Ordering::Acquire)));
}

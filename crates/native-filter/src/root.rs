//! A worker's root for one configuration: core's `PluginRoot`, as a Wasm VM's root context
//! holds it, built by the first request the worker sees under that configuration, and the
//! time of its next tick (see docs/how-it-works.md, "The native build").

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_core::journey::RequestJourney;
use idempotency_core::root::PluginRoot;

use crate::host::NativeHost;
use crate::loaded::Shared;
use crate::worker;

pub struct WorkerRoot {
    pub shared: Arc<Shared>,
    root: RefCell<PluginRoot>,
    configured: bool,
    /// What core asked for with `set_tick_period_ms`.
    tick_ms: Cell<u32>,
    /// Monotonic, as proxy-wasm's tick timer is: a wall clock stepped back would stall ticks.
    next_tick: Cell<Option<Instant>>,
}

impl WorkerRoot {
    /// Configures core's root for this worker; the configuration was checked on the main
    /// thread already, so a refusal here is only logged (the worker's requests then pass, as
    /// under an unconfigured Wasm root).
    pub fn configure(shared: Arc<Shared>) -> WorkerRoot {
        let context_id = worker::new_root_context_id();
        let mut root = PluginRoot::new(context_id);
        let tick_ms = Cell::new(0);
        let configured = {
            let host = NativeHost {
                configuration: &shared.configuration,
                metrics: &shared.metrics,
                tick_ms: &tick_ms,
            };
            worker::act_on_none();
            root.on_configure(&host)
        };
        if !configured {
            log::error!("this worker's root refused a configuration the module had accepted");
        }
        WorkerRoot {
            shared,
            root: RefCell::new(root),
            configured,
            tick_ms,
            next_tick: Cell::new(None),
        }
    }

    pub fn host(&self) -> NativeHost<'_> {
        NativeHost {
            configuration: &self.shared.configuration,
            metrics: &self.shared.metrics,
            tick_ms: &self.tick_ms,
        }
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
            worker::act_on_none();
            // The tick is the root's work, not the carrying request's: it runs inside whatever
            // hook happens to carry it (a new request's `new_filter`, a held or running
            // request's scheduled event). A panic in it must not be charged to that request:
            // the factory's barrier would let a new request pass unprotected (a retry of a
            // recorded write runs again), and a poisoned running write would be answered 503
            // and dropped without a stream end (no unknown outcome recorded: its retry takes
            // the key over once the lease lapses). Caught here, logged, and the hook goes on.
            let ticked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                root.on_tick(&host);
            }));
            worker::act_on_none();
            if let Err(payload) = ticked {
                let what = payload
                    .downcast_ref::<&str>()
                    .copied()
                    .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                    .unwrap_or("(not a string)");
                log::error!("panic in the root's tick: {what}; the tick is cut short");
            }
        }
    }
}

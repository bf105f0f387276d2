//! The module's own store client (docs/how-it-works.md, "The native build: who runs where"):
//! one thread of the module's, `idempotency-store`, runs every configuration's courier and
//! carries its streams and requests over connections it makes itself to `store.address`.
//! Envoy's main thread carries no store message: a stalled main thread (xDS, the admin API,
//! stats) neither delays a claim nor lets a lease lapse.
//!
//! The thread is supervised: a panic in a courier's work is caught, logged, and the thread's
//! runtime built again; the connections and streams went with it, and every root hears that
//! its stream closed (core fails what was in flight by its rules and opens a new one).

// Unit tests run couriers by hand (`Courier::loaded_last`): no store thread starts in them.
#![cfg_attr(test, allow(dead_code))]

mod transport;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::store_streams::WireEvent;
pub use transport::Calls;
use transport::Transport;

/// How often every courier's handoff is looked at: well under the first grace (the store's
/// timeout plus 100 ms), cheap when its ledgers hold nothing.
const SWEEP_EVERY: Duration = Duration::from_millis(200);

/// A configuration's store traffic as the store thread runs it (its courier).
pub trait StoreTraffic: Send + Sync {
    /// The store's `host:port` for the cluster core names.
    fn address_of(&self, cluster: &str) -> Option<String>;
    /// Makes the queued calls, then lands what is due (also every 200 ms: what a panic left
    /// queued goes then).
    fn run(&self, calls: &Calls<'_>);
    /// Retired, with nothing left to land: let go, its streams reset.
    fn is_done(&self) -> bool;
    fn stream_ids(&self) -> Vec<u64>;
    /// What the store said on stream `id`.
    fn on_stream_event(&self, id: u64, event: WireEvent);
    /// Every stream is gone without an event (the thread's runtime was built again).
    fn streams_lost(&self);
}

enum Work {
    /// A configuration's traffic, from its load until it retires and has landed every write
    /// its roots left.
    Register(Arc<dyn StoreTraffic>),
    /// Calls are queued.
    Run(Arc<dyn StoreTraffic>),
}

pub struct StoreThread {
    work: Option<UnboundedSender<Work>>,
    pub transport: Arc<Transport>,
}

impl StoreThread {
    /// The process's store thread, started on first use.
    pub fn process() -> &'static StoreThread {
        static THREAD: OnceLock<StoreThread> = OnceLock::new();
        THREAD.get_or_init(|| {
            let (sender, receiver) = unbounded_channel();
            let transport = Arc::new(Transport::default());
            let serving = Arc::clone(&transport);
            let started = std::thread::Builder::new()
                .name("idempotency-store".into())
                .spawn(move || serve(receiver, &serving));
            let work = match started {
                Ok(_) => Some(sender),
                Err(e) => {
                    log::error!("store thread not started: {e}; no store call can be made");
                    None
                }
            };
            StoreThread { work, transport }
        })
    }

    /// Sweeps `traffic` from now on.
    pub fn register(&self, traffic: Arc<dyn StoreTraffic>) {
        self.submit(Work::Register(traffic));
    }

    /// Runs `traffic`'s queued calls soon. Err: the thread is not running.
    pub fn run(&self, traffic: Arc<dyn StoreTraffic>) -> Result<(), String> {
        if self.submit(Work::Run(traffic)) {
            Ok(())
        } else {
            Err("the store thread is not running".into())
        }
    }

    fn submit(&self, work: Work) -> bool {
        self.work.as_ref().is_some_and(|w| w.send(work).is_ok())
    }
}

/// The thread's body: the runtime, built again after a panic.
fn serve(mut work: UnboundedReceiver<Work>, transport: &Arc<Transport>) {
    let mut couriers: Vec<Arc<dyn StoreTraffic>> = Vec::new();
    loop {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(e) => {
                log::error!("store thread's runtime not built: {e}; retried in 1 s");
                std::thread::sleep(Duration::from_secs(1));
                continue;
            }
        };
        let served = catch_unwind(AssertUnwindSafe(|| {
            runtime.block_on(run(&mut work, &mut couriers, transport))
        }));
        match served {
            // Every sender is gone: the process is ending.
            Ok(()) => return,
            Err(_) => {
                log::error!("the store thread panicked; its runtime is built again");
                // Its connections and streams went with the runtime: their roots hear so, and
                // open new ones by core's rules.
                transport.forget_all();
                for courier in &couriers {
                    let _ = catch_unwind(AssertUnwindSafe(|| courier.streams_lost()));
                }
            }
        }
    }
}

async fn run(
    work: &mut UnboundedReceiver<Work>,
    couriers: &mut Vec<Arc<dyn StoreTraffic>>,
    transport: &Arc<Transport>,
) {
    let mut sweeps = tokio::time::interval(SWEEP_EVERY);
    sweeps.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            next = work.recv() => match next {
                Some(Work::Register(courier)) => couriers.push(courier),
                Some(Work::Run(traffic)) => traffic.run(&Calls { transport, traffic: &traffic }),
                None => return,
            },
            _ = sweeps.tick() => {
                couriers.retain(|courier| {
                    if courier.is_done() {
                        transport.reset_all(courier.stream_ids());
                        return false;
                    }
                    courier.run(&Calls { transport, traffic: courier });
                    true
                });
            }
        }
    }
}

//! Bringing Envoy's main thread to a configuration's main root (`main_root.rs`): when a worker
//! carries work to it, when its store streams answer (its inbox's waker), and every 200 ms
//! while it holds work (the ticker). Only the main root needs the main thread: no store
//! message waits for it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::abi::ConfigScheduler;
use crate::ticker::{Ticker, Ticket, Wake};

/// How often a busy main root is brought back for its tick.
const TICK_EVERY: Duration = Duration::from_millis(200);

/// The scheduled event that runs the main root.
const MAIN_ROOT_EVENT: u64 = 1;

#[derive(Default)]
struct Held {
    /// None once the configuration is gone (or Envoy made none).
    scheduler: Option<ConfigScheduler>,
    /// A commit is on its way: later summons ride on it.
    armed: bool,
    ticket: Option<Ticket>,
}

pub struct MainThread {
    held: Mutex<Held>,
    /// The main root holds work: the ticker brings the main thread back for it.
    busy: AtomicBool,
}

/// The ticker's entry: summons only while the main root has work.
struct TickWake(std::sync::Weak<MainThread>);

impl Wake for TickWake {
    fn wake(&self) {
        if let Some(main) = self.0.upgrade() {
            if main.busy.load(Ordering::Acquire) || crate::carried::has_orphans() {
                main.summon();
            }
        }
    }
}

impl Wake for MainThread {
    fn wake(&self) {
        self.summon();
    }
}

impl MainThread {
    pub fn new(scheduler: Option<ConfigScheduler>) -> Arc<MainThread> {
        if scheduler.is_none() {
            log::error!("no configuration scheduler: unknown outcomes will not be resolved");
        }
        let main = Arc::new(MainThread {
            held: Mutex::new(Held {
                scheduler,
                ..Held::default()
            }),
            busy: AtomicBool::new(false),
        });
        let wake = Arc::new(TickWake(Arc::downgrade(&main)));
        let ticket = Ticker::process().every(TICK_EVERY, wake);
        main.lock().ticket = Some(ticket);
        main
    }

    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Brings the main thread to the main root soon (once per batch), unless the
    /// configuration is gone.
    pub fn summon(&self) {
        let mut held = self.lock();
        if held.armed {
            return;
        }
        // Committed under the lock: `retire` deletes the scheduler under it.
        if let Some(scheduler) = held.scheduler.as_ref() {
            scheduler.commit(MAIN_ROOT_EVENT);
            held.armed = true;
        }
    }

    /// On the main thread, as the scheduled event starts: later summons commit again.
    pub fn on_scheduled(&self) {
        self.lock().armed = false;
    }

    /// After each run of the main root: whether the ticker should bring it back.
    pub fn keep_ticking(&self, busy: bool) {
        self.busy.store(busy, Ordering::Release);
    }

    /// From the configuration's drop: no commit after this returns.
    pub fn retire(&self) {
        let (ticket, scheduler) = {
            let mut held = self.lock();
            (held.ticket.take(), held.scheduler.take())
        };
        if let Some(ticket) = ticket {
            Ticker::process().cancel(ticket);
        }
        drop(scheduler);
    }
}

//! Time for the workers' roots: proxy-wasm ticked each root; a dynamic module has no
//! per-worker timer, so one module thread keeps a timetable and, when an entry is due,
//! wakes it (commits its request's scheduler: the event runs on that request's own worker).
//!
//! An entry is removed under the timetable's lock, and the lock is held while waking, so once
//! `cancel` returns the ticker never touches that entry's scheduler again: its request may go.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// What the ticker wakes: a request's scheduler.
pub trait Wake: Send + Sync {
    fn wake(&self);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket(u64);

struct Entry {
    wake: Arc<dyn Wake>,
    due: Instant,
    period: Duration,
}

#[derive(Default)]
struct Timetable {
    entries: HashMap<Ticket, Entry>,
    next_ticket: u64,
    /// When the ticker thread wakes next on its own (None: it waits for an entry).
    next_wake: Option<Instant>,
}

#[derive(Default)]
pub struct Ticker {
    timetable: Mutex<Timetable>,
    changed: Condvar,
}

impl Ticker {
    /// The process's ticker, its thread started on first use.
    pub fn process() -> &'static Arc<Ticker> {
        static TICKER: OnceLock<Arc<Ticker>> = OnceLock::new();
        TICKER.get_or_init(|| {
            let ticker = Arc::new(Ticker::default());
            let runs = Arc::clone(&ticker);
            let started = std::thread::Builder::new()
                .name("idempotency-ticker".into())
                .spawn(move || runs.run_supervised());
            if let Err(e) = started {
                // Held requests then wait for their own deadline only through the next
                // request on their worker; logged, never fatal.
                log::error!("ticker thread not started: {e}");
            }
            ticker
        })
    }

    fn lock(&self) -> MutexGuard<'_, Timetable> {
        // A timetable is whole between statements: usable after a panic elsewhere.
        self.timetable
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Wakes `wake` every `period`, the first time one period from now, until cancelled.
    pub fn every(&self, period: Duration, wake: Arc<dyn Wake>) -> Ticket {
        let mut table = self.lock();
        table.next_ticket += 1;
        let ticket = Ticket(table.next_ticket);
        let due = Instant::now() + period;
        table.entries.insert(ticket, Entry { wake, due, period });
        // Waking the thread costs a context switch: only when it would sleep past this entry.
        let sooner = table.next_wake.is_none_or(|wake| due < wake);
        drop(table);
        if sooner {
            self.changed.notify_one();
        }
        ticket
    }

    /// After this returns the entry is never woken again.
    pub fn cancel(&self, ticket: Ticket) {
        self.lock().entries.remove(&ticket);
    }

    /// Wakes what is due now, then says how long until the next entry is (None: nothing).
    fn wake_due(&self, table: &mut Timetable, now: Instant) -> Option<Duration> {
        let mut next: Option<Instant> = None;
        for entry in table.entries.values_mut() {
            if entry.due <= now {
                // Due again before the wake: one that panics is tried a period later, not
                // at once for ever.
                entry.due = now + entry.period;
                entry.wake.wake();
            }
            next = Some(next.map_or(entry.due, |n| n.min(entry.due)));
        }
        next.map(|at| at.saturating_duration_since(now))
    }

    /// Runs the timetable; a panic in a wake is caught and logged and the ticker goes on, so
    /// no held request's wait is left without its end.
    fn run_supervised(&self) {
        loop {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run())).is_err() {
                log::error!("a wake panicked on the ticker thread; the ticker goes on");
            }
        }
    }

    fn run(&self) {
        let mut table = self.lock();
        loop {
            let now = Instant::now();
            let wait = self.wake_due(&mut table, now);
            // Nothing to wake: sleep until an entry comes (bounded, so a lost notify costs
            // a second at most).
            let wait = wait.unwrap_or(Duration::from_secs(1));
            table.next_wake = Some(now + wait);
            table = match self.changed.wait_timeout(table, wait) {
                Ok((table, _)) => table,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }
}

/// A wake that counts, for tests of what wakes requests.
#[cfg(test)]
#[derive(Default)]
pub struct CountWakes(pub std::sync::atomic::AtomicUsize);

#[cfg(test)]
impl Wake for CountWakes {
    fn wake(&self) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    use crate::ticker::CountWakes as Count;

    /// A wake that panics once.
    #[derive(Default)]
    struct PanicsOnce(std::sync::atomic::AtomicBool);

    impl Wake for PanicsOnce {
        fn wake(&self) {
            let first = !self.0.swap(true, Ordering::SeqCst);
            assert!(!first, "a wake panics (as asked, once)");
        }
    }

    /// The ticker thread used to die with a panicking wake: every held request's wait then
    /// ended only at a later request on its worker.
    #[test]
    fn a_panicking_wake_does_not_stop_the_ticker() {
        let ticker = Arc::new(Ticker::default());
        let runs = Arc::clone(&ticker);
        std::thread::spawn(move || runs.run_supervised());
        ticker.every(Duration::from_millis(5), Arc::new(PanicsOnce::default()));
        let count = Arc::new(Count::default());
        ticker.every(Duration::from_millis(5), count.clone());
        let deadline = Instant::now() + Duration::from_secs(5);
        while count.0.load(Ordering::SeqCst) < 5 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(count.0.load(Ordering::SeqCst) >= 5);
    }

    #[test]
    fn an_entry_is_woken_each_period_and_never_after_its_cancel() {
        let ticker = Arc::new(Ticker::default());
        let runs = Arc::clone(&ticker);
        std::thread::spawn(move || runs.run());
        let count = Arc::new(Count::default());
        let ticket = ticker.every(Duration::from_millis(5), count.clone());
        let deadline = Instant::now() + Duration::from_secs(5);
        while count.0.load(Ordering::SeqCst) < 3 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert!(count.0.load(Ordering::SeqCst) >= 3);
        ticker.cancel(ticket);
        let after_cancel = count.0.load(Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(count.0.load(Ordering::SeqCst), after_cancel);
    }
}

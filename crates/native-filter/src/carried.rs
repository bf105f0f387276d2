//! What the workers carry to the main thread's root (`main_root.rs`): the resolutions their
//! roots took on and the detached writes their requests made, as plain data, in a queue the
//! configuration shares.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use std::sync::Arc;

use idempotency_core::plugin::detached::DetachedCarry;
use idempotency_core::plugin::resolutions::PortableResolution;

use crate::inbox::Inbox;

/// Resolutions carried from the workers, waiting for the main thread (bounded: each worker
/// holds at most core's budget, and the main thread takes them at its next run).
pub const MAX_CARRIED: usize = idempotency_core::plugin::resolutions::MAX_RESOLUTIONS;

/// What the workers leave for the main root.
#[derive(Default)]
pub struct Carried {
    held: Mutex<Held>,
}

#[derive(Default)]
struct Held {
    resolutions: Vec<PortableResolution>,
    /// Detached writes (and their clients' leaving), with the inbox of the worker whose
    /// request each answers.
    detached: Vec<(Arc<Inbox>, DetachedCarry)>,
    /// The configuration is gone: what comes now goes to the orphanage.
    closed: bool,
}

/// Why `Carried::push` gave resolutions back.
pub enum Refused {
    /// The queue is full (the main thread is not keeping up): the worker keeps them.
    Full(Vec<PortableResolution>),
    /// The configuration is gone: for the orphanage.
    Closed(Vec<PortableResolution>),
}

impl Carried {
    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// From a worker: Err gives back what this queue does not take.
    pub fn push(&self, resolutions: Vec<PortableResolution>) -> Result<(), Refused> {
        let mut held = self.lock();
        if held.closed {
            return Err(Refused::Closed(resolutions));
        }
        let room = MAX_CARRIED.saturating_sub(held.resolutions.len());
        let mut resolutions = resolutions;
        let refused = resolutions.split_off(room.min(resolutions.len()));
        held.resolutions.extend(resolutions);
        if refused.is_empty() {
            Ok(())
        } else {
            Err(Refused::Full(refused))
        }
    }

    /// From a worker: Err gives back what does not fit (the worker keeps it for its next
    /// carry). A closed queue takes them all: a configuration is destroyed only once its
    /// requests are gone, so what comes then is only a notice that a client left.
    pub fn push_detached(
        &self,
        inbox: &Arc<Inbox>,
        carried: Vec<DetachedCarry>,
    ) -> Result<(), Vec<DetachedCarry>> {
        let mut held = self.lock();
        if held.closed {
            // Only notices come now (its requests are gone): nothing to send.
            return Ok(());
        }
        let room = MAX_CARRIED.saturating_sub(held.detached.len());
        let mut carried = carried;
        let refused = carried.split_off(room.min(carried.len()));
        held.detached
            .extend(carried.into_iter().map(|c| (Arc::clone(inbox), c)));
        if refused.is_empty() {
            Ok(())
        } else {
            Err(refused)
        }
    }

    pub fn take_detached(&self) -> Vec<(Arc<Inbox>, DetachedCarry)> {
        std::mem::take(&mut self.lock().detached)
    }

    pub fn take_all(&self) -> Vec<PortableResolution> {
        std::mem::take(&mut self.lock().resolutions)
    }

    /// The configuration is going: the resolutions queued, and how many detached writes
    /// were queued unsent (dropped); from now on it takes nothing more.
    pub fn close(&self) -> (Vec<PortableResolution>, usize) {
        let mut held = self.lock();
        held.closed = true;
        let unsent = std::mem::take(&mut held.detached)
            .iter()
            .filter(|(_, carry)| matches!(carry, DetachedCarry::Write(_)))
            .count();
        (std::mem::take(&mut held.resolutions), unsent)
    }

    pub fn is_empty(&self) -> bool {
        let held = self.lock();
        held.resolutions.is_empty() && held.detached.is_empty()
    }
}

/// Resolutions of retired configurations, for the next live configuration's main root that
/// has their rule, with when they were left.
static ORPHANS: Mutex<Vec<(Instant, PortableResolution)>> = Mutex::new(Vec::new());
/// How long an orphan waits for a configuration with its rule (a push that changed or removed
/// the rule leaves none); then the next main root gives it up as having no rule.
pub const ORPHAN_WAIT: Duration = Duration::from_secs(60);
/// At most this many wait there (a push during an outage that left many unknown outcomes);
/// beyond, they are logged and their keys stay unknown.
pub const MAX_ORPHANS: usize = 4 * MAX_CARRIED;

fn orphans() -> MutexGuard<'static, Vec<(Instant, PortableResolution)>> {
    ORPHANS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Hands a retired configuration's resolutions to the next live one.
pub fn orphan(resolutions: Vec<PortableResolution>) {
    if resolutions.is_empty() {
        return;
    }
    let mut held = orphans();
    let room = MAX_ORPHANS.saturating_sub(held.len());
    let mut resolutions = resolutions;
    let lost = resolutions.split_off(room.min(resolutions.len()));
    log::warn!(
        "{} resolution(s) of a retired configuration wait for the next one",
        resolutions.len()
    );
    let now = Instant::now();
    held.extend(resolutions.into_iter().map(|r| (now, r)));
    if !lost.is_empty() {
        log::error!(
            "{} resolution(s) of a retired configuration dropped: too many wait already; \
             their keys stay unknown (in cluster mode, another proxy takes each on once it \
             is overdue)",
            lost.len()
        );
    }
}

pub fn has_orphans() -> bool {
    !orphans().is_empty()
}

/// The orphans a configuration takes on: those `has_rule` says it has a rule for, and those
/// that waited `ORPHAN_WAIT` for one (to be given up); the rest wait on.
pub fn take_orphans(has_rule: impl Fn(&PortableResolution) -> bool) -> Vec<PortableResolution> {
    let mut held = orphans();
    let now = Instant::now();
    let (taken, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut *held)
        .into_iter()
        .partition(|(left, r)| has_rule(r) || now.saturating_duration_since(*left) >= ORPHAN_WAIT);
    *held = waiting;
    taken.into_iter().map(|(_, r)| r).collect()
}

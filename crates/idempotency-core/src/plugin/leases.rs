//! The leases of this worker's requests that are running upstream, renewed from the root's
//! tick before they lapse: a write that takes longer than its lease is then never taken over
//! while its proxy lives, and `lease_seconds` only bounds how long a key stays blocked after a
//! proxy died mid-request. Renewed in the local table, and in cluster mode in the store too,
//! in one call per rule and tick.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use crate::burst_log::BurstLog;
use crate::host::Host;
use crate::outcome::Outcome;
use crate::rule_handle::RuleHandle;
use crate::store::writes::{renew_every_ms, Links, StoreWrites};
use crate::table::{Completion, Held, Table};

/// A request running upstream with its claim.
struct LiveLease {
    rule: Rc<RuleHandle>,
    held: Held,
    /// Its claim in the store (cluster mode), when the store confirmed one.
    store_owner: Option<String>,
    renew_at_ms: u64,
    /// Past this, the lease is let lapse: no write is renewed beyond its rule's TTL, so a
    /// request Envoy never ends cannot hold a key (and its configuration) forever.
    renew_until_ms: u64,
}

/// A lease as the store names it: the key's digest and the store claim's owner, in hex.
pub type StoreLease = (String, String);

/// Live leases by the local claim's owner token (unique per claim).
pub struct Leases {
    live: RefCell<HashMap<u64, LiveLease>>,
    lost_log: RefCell<BurstLog>,
}

impl Default for Leases {
    fn default() -> Self {
        Leases {
            live: RefCell::new(HashMap::new()),
            lost_log: RefCell::new(BurstLog::new(10_000)),
        }
    }
}

impl Leases {
    /// A request went upstream holding `held`.
    pub fn begin(
        &self,
        rule: &Rc<RuleHandle>,
        held: &Held,
        store_owner: Option<String>,
        now_ms: u64,
    ) {
        let lease = LiveLease {
            rule: Rc::clone(rule),
            held: held.clone(),
            store_owner,
            renew_at_ms: now_ms.saturating_add(renew_every_ms(rule.rule.lease_ms)),
            renew_until_ms: now_ms.saturating_add(rule.rule.ttl_ms),
        };
        if let Ok(mut live) = self.live.try_borrow_mut() {
            live.insert(held.owner, lease);
        }
    }

    /// The lease of `owner` is renewed at the next `renew_due` (it was just taken over from
    /// another root, whose last renewal may be a while ago).
    pub fn renew_soon(&self, owner: u64) {
        if let Ok(mut live) = self.live.try_borrow_mut() {
            if let Some(lease) = live.get_mut(&owner) {
                lease.renew_at_ms = 0;
            }
        }
    }

    /// The request ended (recorded, released, or gone): its lease runs out on its own.
    pub fn end(&self, owner: u64) {
        if let Ok(mut live) = self.live.try_borrow_mut() {
            live.remove(&owner);
        }
    }

    pub fn len(&self) -> usize {
        self.live.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.borrow().is_empty()
    }

    /// From the root's tick: renews every lease due, locally and in the store. A lease some
    /// other request took over (it lapsed before a renewal landed, here or in the store) is
    /// counted and forgotten; one older than its rule's TTL is forgotten.
    pub fn renew_due(
        &self,
        host: &impl Host,
        table: &Table,
        writes: &StoreWrites,
        links: &Links<'_>,
    ) {
        let now = host.now_ms();
        if now == 0 {
            return; // the host clock failed: renew on the next tick rather than to 1970
        }
        let mut lost: Vec<u64> = Vec::new();
        // Store renewals per rule: one lease length, one store, one call.
        let mut for_store: Vec<(Rc<RuleHandle>, Vec<StoreLease>)> = Vec::new();
        {
            let mut live = self.live.borrow_mut();
            let taken_in_store = writes.take_lost_leases();
            if !taken_in_store.is_empty() {
                live.retain(|_, lease| {
                    !lease.store_owner.as_ref().is_some_and(|token| {
                        taken_in_store.contains(&store_lease(&lease.held, token))
                    })
                });
            }
            live.retain(|_, lease| {
                let within_ttl = now < lease.renew_until_ms;
                if !within_ttl {
                    log::warn!(
                        "rule {}: a request still running after ttl_seconds; its lease is no \
                         longer renewed",
                        lease.rule.rule.name
                    );
                }
                within_ttl
            });
            for (owner, lease) in live.iter_mut().filter(|(_, l)| l.renew_at_ms <= now) {
                let lease_ms = lease.rule.rule.lease_ms;
                lease.renew_at_ms = now.saturating_add(renew_every_ms(lease_ms));
                match table.renew(host, &lease.held, now, lease_ms) {
                    Ok(Completion::LostOwnership) => {
                        lost.push(*owner);
                        lease.rule.count(host, Outcome::LeaseLost);
                        if let Some(suppressed) = self.lost_log.borrow_mut().admit(now) {
                            log::warn!(
                                "rule {}: a live request's lease was taken over before it was \
                                 renewed ({suppressed} similar not logged)",
                                lease.rule.rule.name
                            );
                        }
                        continue;
                    }
                    Ok(_) => {}
                    Err(e) => log::warn!("lease not renewed locally: {e}"),
                }
                if let Some(token) = &lease.store_owner {
                    let item = store_lease(&lease.held, token);
                    match for_store
                        .iter_mut()
                        .find(|(rule, _)| Rc::ptr_eq(rule, &lease.rule))
                    {
                        Some((_, items)) => items.push(item),
                        None => for_store.push((Rc::clone(&lease.rule), vec![item])),
                    }
                }
            }
            for owner in &lost {
                live.remove(owner);
            }
        }
        for (rule, items) in for_store {
            writes.submit_renewals(host, links, &rule, items, now);
        }
    }
}

fn store_lease(held: &Held, owner: &str) -> StoreLease {
    (
        idempotency_protocol::naming::to_hex(&held.key),
        owner.to_string(),
    )
}

//! One configuration of the filter, as each worker holds it: its rules resolved to handles,
//! the shared table, owner tokens, and the root-side work requests leave behind (store
//! writes that outlive their request, upkeep of retired tables). `crate::root` is the root
//! context's life around it.

pub mod detached;
pub mod leases;
pub mod owner_tokens;
pub mod resolutions;
pub mod retention;
pub mod table_upkeep;
pub mod vm_roles;
pub mod waits;

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use crate::burst_log::BurstLog;
use crate::config::{Config, InFlightPolicy, StoreTransport};
use crate::host::Host;
use crate::rule_handle::RuleHandle;
use crate::rule_select::Prefilter;
use crate::store::link::StoreLink;
use crate::store::writes::{Links, StoreWrites};
use crate::table::{self, Table};
use detached::DetachedWrites;
use leases::Leases;
use owner_tokens::OwnerTokens;
use resolutions::Resolutions;
use retention::Retention;
use table_upkeep::TableUpkeep;
use waits::Waits;

/// Shared-data namespace of this filter (Istio sets no VM id, so keys need a prefix).
pub const NAMESPACE: &str = "envoy.filters.http.idempotency";

/// Whether a root's requests claim keys in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claims {
    Made,
    None,
}

/// Everything a request needs, built once per configuration.
pub struct Plugin {
    /// The configuration's settings; its rules live in `rules`.
    pub config: Config,
    /// In configuration order, which is also the order of selection.
    pub rules: Vec<Rc<RuleHandle>>,
    pub table: Table,
    pub owners: OwnerTokens,
    pub writes: StoreWrites,
    /// One gRPC stream per store the rules use over that transport.
    pub links: Vec<StoreLink>,
    /// The root context that owns the streams (set by the root once configured).
    pub root_context: Cell<u32>,
    /// Store failures seen by requests, logged once per burst.
    pub store_failures: RefCell<BurstLog>,
    /// Claims refused for a full table, logged once per burst.
    pub table_full_log: RefCell<BurstLog>,
    /// Unknown outcomes, logged once per burst (an upstream that times out does it to every
    /// write; each one is in the access log and the counters anyway).
    pub unknown_outcome_log: RefCell<BurstLog>,
    /// Replay hops that did not reach the replay echo (its route is missing), logged once
    /// per burst: every retry of a recorded call with a message fails the same way.
    pub echo_unrouted_log: RefCell<BurstLog>,
    /// Requests Envoy answered before they reached the upstream, logged once per burst (an
    /// upstream that is down or refuses streams does it to every write).
    pub never_reached_log: RefCell<BurstLog>,
    /// Keeps `table` in step with the tables other configurations use or retired.
    pub upkeep: TableUpkeep,
    /// How long evicted records had been kept.
    pub retention: Retention,
    /// Duplicates held until the first request with their key completes.
    pub waits: Waits,
    /// Requests running upstream, whose leases the root renews.
    pub leases: Leases,
    /// Writes the root sends upstream for detached rules.
    pub detached: DetachedWrites,
    /// Detached writes refused or run inline, logged once per burst.
    pub detached_log: RefCell<BurstLog>,
    /// Unknown outcomes this worker recorded and is resolving by asking the service.
    pub resolutions: Resolutions,
    /// Some rule has a lookup route (`lookup`): GETs are looked at for it.
    pub has_lookup_routes: bool,
    /// Which requests no rule can have anything to do with, by method and path.
    pub prefilter: Prefilter,
}

impl Plugin {
    /// Builds the configuration from its bytes and prepares the shared table; an error
    /// makes Envoy refuse the configuration.
    pub fn configure(host: &impl Host, bytes: &[u8]) -> Result<Plugin, String> {
        let config = Config::parse(bytes).map_err(|e| e.to_string())?;
        Plugin::build(host, config)
    }

    /// Builds a parsed configuration: prepares the shared table and resolves the rules.
    pub fn build(host: &impl Host, config: Config) -> Result<Plugin, String> {
        Plugin::build_for(host, config, Claims::Made)
    }

    /// `Claims::None`: for a root that makes no claims (it resolves for others): its table
    /// layout is not registered, so a late one cannot make a retired layout current again.
    pub fn build_for(
        host: &impl Host,
        mut config: Config,
        claims: Claims,
    ) -> Result<Plugin, String> {
        let salt = table::bucket_salt(host, NAMESPACE, host.now_nanos())
            .map_err(|e| format!("shared data table could not be created: {}", e.0))?;
        let table = Table::new(NAMESPACE, config.table_layout.clone(), salt);
        // A record lives at most a lease (claimed, not yet completed) plus its TTL.
        let record_life_ms = config
            .rules
            .iter()
            .map(|r| r.ttl_ms.saturating_add(r.lease_ms))
            .max()
            .unwrap_or(0);
        let upkeep = if claims == Claims::None {
            TableUpkeep::idle(NAMESPACE, &table, record_life_ms)
        } else if config.grpc_replay_echo {
            // The echo claims nothing: its table is never created nor registered.
            TableUpkeep::idle(NAMESPACE, &table, record_life_ms)
        } else {
            table
                .create_buckets(host)
                .map_err(|e| format!("shared data table could not be created: {}", e.0))?;
            TableUpkeep::adopt(host, NAMESPACE, &table, record_life_ms)
        };
        let rules: Vec<Rc<RuleHandle>> = std::mem::take(&mut config.rules)
            .into_iter()
            .map(|rule| Rc::new(RuleHandle::resolve(rule, host)))
            .collect();
        let mut links: Vec<StoreLink> = Vec::new();
        for store in rules.iter().filter_map(|r| r.store.as_ref()) {
            if store.transport == StoreTransport::Grpc && !links.iter().any(|l| l.store == *store) {
                links.push(StoreLink::new(Rc::clone(store)));
            }
        }
        let has_lookup_routes = rules.iter().any(|r| r.rule.lookup_route.is_some());
        let lookup_paths = rules
            .iter()
            .filter_map(|r| r.rule.lookup_route.as_ref().map(|l| l.path.as_str()));
        let prefilter = Prefilter::new(&rules, lookup_paths);
        let owners = OwnerTokens::allocate(host, &format!("{NAMESPACE}/owner-vm-sequence"));
        let writes = StoreWrites::new(
            host,
            &format!("{NAMESPACE}/store-writes/{}", owners.vm_number()),
        );
        Ok(Plugin {
            config,
            rules,
            table,
            owners,
            writes,
            links,
            root_context: Cell::new(0),
            store_failures: RefCell::new(BurstLog::new(10_000)),
            table_full_log: RefCell::new(BurstLog::new(10_000)),
            unknown_outcome_log: RefCell::new(BurstLog::new(10_000)),
            echo_unrouted_log: RefCell::new(BurstLog::new(10_000)),
            never_reached_log: RefCell::new(BurstLog::new(10_000)),
            upkeep,
            retention: Retention::define(host),
            waits: Waits::default(),
            leases: Leases::default(),
            detached: DetachedWrites::default(),
            detached_log: RefCell::new(BurstLog::new(10_000)),
            resolutions: Resolutions::default(),
            has_lookup_routes,
            prefilter,
        })
    }

    /// The streams, for the store writes.
    pub fn links(&self) -> Links<'_> {
        Links {
            links: &self.links,
            root_context: self.root_context.get(),
        }
    }

    /// Where resolutions settle their keys.
    pub fn settlers(&self) -> resolutions::Settlers<'_> {
        resolutions::Settlers {
            table: &self.table,
            writes: &self.writes,
            links: self.links(),
        }
    }

    /// This configuration's handle of `rule` (an HTTP rule's gRPC form included).
    pub fn handle_of(&self, rule: &crate::config::Rule) -> Option<Rc<RuleHandle>> {
        self.rules.iter().find_map(|handle| {
            if handle.rule == *rule {
                return Some(Rc::clone(handle));
            }
            let as_grpc = handle.grpc_calls.as_ref()?.as_grpc.as_ref().ok()?;
            (as_grpc.rule == *rule).then(|| Rc::clone(as_grpc))
        })
    }

    /// The stream that serves `rule`'s store, if it uses one.
    pub fn link_for(&self, rule: &RuleHandle) -> Option<&StoreLink> {
        let store = rule.store.as_ref()?;
        self.links.iter().find(|l| l.store == *store)
    }

    /// Some rule holds duplicates instead of answering 409 at once.
    pub fn holds_duplicates(&self) -> bool {
        self.rules
            .iter()
            .any(|r| r.rule.on_in_flight == InFlightPolicy::Wait)
    }

    /// The shortest lease of any rule: the tick must come often enough to renew it.
    pub fn shortest_lease_ms(&self) -> Option<u64> {
        self.rules.iter().map(|r| r.rule.lease_ms).min()
    }

    /// Cluster mode for at least one rule.
    pub fn uses_store(&self) -> bool {
        self.rules.iter().any(|r| r.store.is_some())
    }
}

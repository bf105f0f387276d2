//! The root context: loads and validates the configuration (Envoy refuses a bad one), creates
//! the shared table's buckets before traffic, and hands each request a filter.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use idempotency_core::burst_log::BurstLog;
use idempotency_core::config::{Config, StoreConfig};
use idempotency_core::table::Table;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType};

use crate::host;
use crate::http_filter::RequestFilter;
use crate::metrics::Metrics;
use crate::owner::OwnerTokens;
use crate::shared_table::EnvoySharedData;
use crate::store_writes::StoreWrites;
use crate::table_upkeep::TableUpkeep;

/// Shared-data namespace of this filter (Istio sets no VM id, so keys need a prefix).
const NAMESPACE: &str = "envoy.filters.http.idempotency";

/// Everything a request needs, built once per configuration.
pub struct FilterState {
    pub config: Config,
    pub table: Table,
    pub metrics: Metrics,
    pub owners: OwnerTokens,
    /// Per rule, the store that confirms its claims (cluster mode), shared with queued writes.
    pub stores: Vec<Option<Rc<StoreConfig>>>,
    pub writes: StoreWrites,
    /// Store failures seen by requests, logged once per burst.
    pub store_failures: RefCell<BurstLog>,
    /// Claims refused for a full table, logged once per burst.
    pub table_full_log: RefCell<BurstLog>,
    /// Keeps `table` in step with the tables other configurations use or retired.
    pub upkeep: TableUpkeep,
}

/// How often the root retries store writes that failed.
const STORE_RETRY_TICK: Duration = Duration::from_millis(200);
/// Without a store: how often the root looks after retired tables.
const UPKEEP_TICK: Duration = Duration::from_secs(1);

pub struct FilterRoot {
    state: Option<Rc<FilterState>>,
    /// Envoy is retiring this configuration (a push replaced it) but store writes still wait:
    /// the root stays until they are taken or their deadlines pass.
    finishing: bool,
}

impl FilterRoot {
    pub fn new(_context_id: u32) -> FilterRoot {
        FilterRoot {
            state: None,
            finishing: false,
        }
    }

    /// A finishing root whose writes are all taken tells Envoy it is done.
    fn finish_if_idle(&mut self) {
        if !self.finishing || self.state.as_ref().is_some_and(|s| s.writes.pending() > 0) {
            return;
        }
        self.finishing = false;
        match host::done() {
            Ok(()) => log::info!("retired configuration: every waiting store write was taken"),
            Err(status) => log::warn!("retired configuration not released: {status}"),
        }
    }

    fn configure(&self) -> Result<FilterState, String> {
        let bytes = host::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX)
            .map_err(|status| format!("plugin configuration unreadable: {status}"))?
            .unwrap_or_default();
        let config = Config::parse(&bytes).map_err(|e| e.to_string())?;
        let table = Table::new(NAMESPACE, config.table_capacity);
        table
            .create_buckets(&EnvoySharedData)
            .map_err(|e| format!("shared data table could not be created: {}", e.0))?;
        // A record lives at most a lease (claimed, not yet completed) plus its TTL.
        let max_record_life_ms = config
            .rules
            .iter()
            .map(|r| r.ttl_ms.saturating_add(r.lease_ms))
            .max()
            .unwrap_or(0);
        let upkeep = TableUpkeep::adopt(NAMESPACE, &table, max_record_life_ms);
        let metrics = Metrics::define(&config);
        let owners = OwnerTokens::allocate(&format!("{NAMESPACE}/owner-vm-sequence"));
        let stores: Vec<Option<Rc<StoreConfig>>> = config
            .rules
            .iter()
            .map(|r| r.store.clone().map(Rc::new))
            .collect();
        let writes = StoreWrites::new(&format!("{NAMESPACE}/store-writes/{}", owners.vm_number()));
        let tick = if stores.iter().any(Option::is_some) {
            STORE_RETRY_TICK
        } else {
            UPKEEP_TICK
        };
        host::set_tick_period(tick).map_err(|status| format!("tick period refused: {status}"))?;
        Ok(FilterState {
            config,
            table,
            metrics,
            owners,
            stores,
            writes,
            store_failures: RefCell::new(BurstLog::new(10_000)),
            table_full_log: RefCell::new(BurstLog::new(10_000)),
            upkeep,
        })
    }
}

impl Context for FilterRoot {
    /// A push retired this configuration. Completions and releases still waiting out a store
    /// outage live in this root: keep it (its tick and callouts go on) until they are taken
    /// or their deadlines pass, instead of losing them with it.
    fn on_done(&mut self) -> bool {
        let pending = self.state.as_ref().map_or(0, |s| s.writes.pending());
        if pending == 0 {
            return true;
        }
        log::warn!(
            "configuration retired with {pending} store write(s) still waiting; \
             kept until they are taken or their deadlines pass"
        );
        self.finishing = true;
        false
    }

    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(state) = &self.state {
            if !state
                .writes
                .on_answer(token_id, num_headers, body_size, &state.metrics)
            {
                log::debug!("answer for unknown store call {token_id} ignored");
            }
        }
        self.finish_if_idle();
    }
}

struct Unconfigured;
impl Context for Unconfigured {}
impl HttpContext for Unconfigured {}

impl RootContext for FilterRoot {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        match self.configure() {
            Ok(state) => {
                log::info!(
                    "configured {} rule(s); local table holds {} records in {} buckets",
                    state.config.rules.len(),
                    state.table.capacity(),
                    state.table.bucket_count()
                );
                self.state = Some(Rc::new(state));
                true
            }
            Err(message) => {
                // Returning false makes Envoy refuse this configuration.
                log::error!("{message}");
                false
            }
        }
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        if let Some(state) = &self.state {
            if state.writes.is_wake_queue(queue_id) {
                state.writes.on_wake(&state.metrics);
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(state) = &self.state {
            state.writes.on_tick(&state.metrics);
            state.upkeep.on_tick(host::now_ms());
        }
        self.finish_if_idle();
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None: an unconfigured root (Envoy refuses it anyway) gets a
        // filter that lets everything through.
        Some(match &self.state {
            Some(state) => Box::new(RequestFilter::new(Rc::clone(state))),
            None => Box::new(Unconfigured),
        })
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

//! The root context: loads and validates the configuration (Envoy refuses a bad one), creates
//! the shared table's buckets before traffic, and hands each request a filter.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use idempotency_core::burst_log::BurstLog;
use idempotency_core::config::{Config, StoreConfig};
use idempotency_core::table::Table;
use idempotency_core::table_lineage::{self, LineageWatch, TableEntry};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType};

use crate::host;
use crate::http_filter::RequestFilter;
use crate::metrics::Metrics;
use crate::owner::OwnerTokens;
use crate::shared_table::EnvoySharedData;
use crate::store_writes::StoreWrites;

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
    /// When the next retired table's records have all expired and it can be emptied.
    pub next_reclaim_ms: Cell<Option<u64>>,
    /// Keeps `table` aware of the tables other configurations use or retired.
    pub lineage: LineageWatch,
}

impl FilterState {
    /// Before a claim: catch up with a registry another configuration changed (a push that
    /// brought this configuration back without configuring it again).
    pub fn follow_lineage(&self, now_ms: u64) {
        match self.lineage.refresh(&EnvoySharedData, &self.table, now_ms) {
            Ok(None) => {}
            Ok(Some(lineage)) => {
                empty_tables(&lineage.to_reclaim);
                let next = lineage
                    .retired
                    .iter()
                    .filter_map(TableEntry::reclaimable_at_ms)
                    .min();
                self.next_reclaim_ms.set(next);
            }
            Err(e) => log::debug!("table registry unreadable: {}", e.0),
        }
    }
}

/// How often the root retries store writes that failed.
const STORE_RETRY_TICK: Duration = Duration::from_millis(200);
/// Single-proxy mode with a retired table: how often to check whether it can be emptied.
const RECLAIM_TICK: Duration = Duration::from_secs(60);

pub struct FilterRoot {
    state: Option<Rc<FilterState>>,
}

impl FilterRoot {
    pub fn new(_context_id: u32) -> FilterRoot {
        FilterRoot { state: None }
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
        let max_ttl_ms = config.rules.iter().map(|r| r.ttl_ms).max().unwrap_or(0);
        let lineage = LineageWatch::new(NAMESPACE, max_ttl_ms);
        let retired = adopt_lineage(&lineage, &table);
        let metrics = Metrics::define(&config);
        let owners = OwnerTokens::allocate(&format!("{NAMESPACE}/owner-vm-sequence"));
        let stores: Vec<Option<Rc<StoreConfig>>> = config
            .rules
            .iter()
            .map(|r| r.store.clone().map(Rc::new))
            .collect();
        let writes = StoreWrites::new(&format!("{NAMESPACE}/store-writes/{}", owners.vm_number()));
        let tick = if stores.iter().any(Option::is_some) {
            Some(STORE_RETRY_TICK)
        } else if !retired.is_empty() {
            Some(RECLAIM_TICK)
        } else {
            None
        };
        if let Some(period) = tick {
            host::set_tick_period(period)
                .map_err(|status| format!("tick period refused: {status}"))?;
        }
        let next_reclaim_ms = retired
            .iter()
            .filter_map(TableEntry::reclaimable_at_ms)
            .min();
        Ok(FilterState {
            config,
            table,
            metrics,
            owners,
            stores,
            writes,
            store_failures: RefCell::new(BurstLog::new(10_000)),
            table_full_log: RefCell::new(BurstLog::new(10_000)),
            next_reclaim_ms: Cell::new(next_reclaim_ms),
            lineage,
        })
    }
}

/// Registers this configuration's table, keeps the tables a capacity change replaced readable
/// until their records expire, and empties the ones whose records all have. Returns the
/// retired tables still kept. Failures only cost the old records, never the configuration.
fn adopt_lineage(watch: &LineageWatch, table: &Table) -> Vec<TableEntry> {
    let lineage = match watch.adopt(&EnvoySharedData, table, host::now_ms()) {
        Ok(lineage) => lineage,
        Err(e) => {
            log::warn!(
                "table registry unavailable ({}); earlier tables are not consulted",
                e.0
            );
            return Vec::new();
        }
    };
    empty_tables(&lineage.to_reclaim);
    for old in &lineage.retired {
        log::warn!(
            "local_table.capacity changed: the earlier table of {} buckets is still consulted \
             and its memory held until its records expire ({} ms from its retirement)",
            old.buckets,
            old.max_ttl_ms
        );
    }
    lineage.retired
}

pub(crate) fn empty_tables(tables: &[TableEntry]) {
    for old in tables {
        match Table::with_buckets(NAMESPACE, old.buckets).empty_all(&EnvoySharedData) {
            Ok(()) => log::info!(
                "emptied the retired local table of {} buckets: its records have expired",
                old.buckets
            ),
            Err(e) => log::warn!(
                "retired table of {} buckets not emptied: {}",
                old.buckets,
                e.0
            ),
        }
    }
}

impl Context for FilterRoot {
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
            let now = host::now_ms();
            if state.next_reclaim_ms.get().is_some_and(|at| now >= at) {
                state.next_reclaim_ms.set(None);
                match table_lineage::reclaim_due(&EnvoySharedData, NAMESPACE, now) {
                    Ok(due) => empty_tables(&due),
                    Err(e) => log::warn!("retired tables not reclaimed: {}", e.0),
                }
            }
        }
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

//! The root context: loads and validates the configuration (Envoy refuses a bad one), creates
//! the shared table's buckets before traffic, and hands each request a filter.

use std::rc::Rc;

use idempotency_core::config::Config;
use idempotency_core::table::Table;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType};

use crate::host;
use crate::http_filter::RequestFilter;
use crate::metrics::Metrics;
use crate::owner::OwnerTokens;
use crate::shared_table::EnvoySharedData;

/// Shared-data namespace of this filter (Istio sets no VM id, so keys need a prefix).
const NAMESPACE: &str = "envoy.filters.http.idempotency";

/// Everything a request needs, built once per configuration.
pub struct FilterState {
    pub config: Config,
    pub table: Table,
    pub metrics: Metrics,
    pub owners: OwnerTokens,
}

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
        let metrics = Metrics::define(&config);
        let owners = OwnerTokens::allocate(&format!("{NAMESPACE}/owner-vm-sequence"));
        Ok(FilterState {
            config,
            table,
            metrics,
            owners,
        })
    }
}

impl Context for FilterRoot {}

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

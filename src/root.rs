//! The root context: hands Envoy's root callbacks to core's `PluginRoot` (configure, store
//! writes on wake-ups and ticks, staying until they are taken) and gives each request its
//! filter.

use idempotency_core::root::PluginRoot;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::ContextType;

use crate::envoy_host::EnvoyHost;
use crate::http_filter::HttpFilter;

pub struct FilterRoot {
    root: PluginRoot,
}

impl FilterRoot {
    pub fn new(context_id: u32) -> FilterRoot {
        FilterRoot {
            root: PluginRoot::new(context_id),
        }
    }
}

impl Context for FilterRoot {
    fn on_done(&mut self) -> bool {
        crate::envoy_host::new_callback();
        self.root.on_done()
    }

    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        crate::envoy_host::new_callback();
        self.root
            .on_callout_answer(&EnvoyHost, token, num_headers, body_size);
    }

    fn on_grpc_stream_initial_metadata(&mut self, token_id: u32, _num_elements: u32) {
        crate::envoy_host::new_callback();
        self.root.on_grpc_initial_metadata(&EnvoyHost, token_id);
    }

    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        crate::envoy_host::new_callback();
        self.root
            .on_grpc_message(&EnvoyHost, token_id, message_size);
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        crate::envoy_host::new_callback();
        self.root.on_grpc_close(&EnvoyHost, token_id, status_code);
    }
}

struct Unconfigured;
impl Context for Unconfigured {}
impl HttpContext for Unconfigured {}

impl RootContext for FilterRoot {
    /// Once per VM (Envoy starts one for each worker, and its main thread's): which build is
    /// running, so a log shows what a rollout actually loaded.
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        log::info!("idempotency-filter {} loaded", env!("CARGO_PKG_VERSION"));
        true
    }

    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        crate::envoy_host::new_callback();
        self.root.on_configure(&EnvoyHost)
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        crate::envoy_host::new_callback();
        self.root.on_queue_ready(&EnvoyHost, queue_id);
    }

    fn on_tick(&mut self) {
        crate::envoy_host::new_callback();
        self.root.on_tick(&EnvoyHost);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None: an unconfigured root (Envoy refuses it anyway) gets a
        // filter that lets everything through.
        Some(match self.root.new_request(context_id) {
            Some(journey) => Box::new(HttpFilter::new(journey)),
            None => Box::new(Unconfigured),
        })
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

//! The idempotency filter for Envoy: a thin proxy-wasm adapter over `idempotency-core`.
//!
//! Where a request's journey is decided: `root.rs` loads the configuration and prepares the
//! shared table; `http_filter.rs` walks each request through `request_intake.rs` (rule, key,
//! fingerprint), `claim_flow.rs` (claim, replay, 409/422/503) and `response_recording.rs`. `host.rs` wraps the host ABI without panics,
//! `shared_table.rs` gives the core table its shared data, `table_upkeep.rs` keeps it in step
//! with the tables a capacity change retired, `metrics.rs` counts outcomes.
//! Cluster mode: `store_calls.rs` sends callouts to the store; `store_writes.rs` lets the
//! root context deliver completions even after the client has gone.

mod claim_flow;
mod host;
mod http_filter;
mod logging;
mod metrics;
mod owner;
mod request_intake;
mod response_recording;
mod root;
mod shared_table;
mod store_calls;
mod store_writes;
mod table_upkeep;

proxy_wasm::main! {{
    logging::install();
    proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::FilterRoot::new(context_id))
    });
}}

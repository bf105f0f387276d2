//! The idempotency filter for Envoy: a thin proxy-wasm adapter over `idempotency-core`.
//!
//! Where a request's journey is decided: not here, but in `idempotency_core::journey` (one
//! state type, one transition function) and `idempotency_core::plugin` (per configuration:
//! rules, table, store writes). This crate only feeds Envoy's callbacks to them:
//! `root.rs` (root context), `http_filter.rs` (each request), `envoy_host.rs` (core's `Host`
//! trait over the ABI), `host.rs` (the ABI calls themselves, without panics), `logging.rs`.

#[cfg(test)]
mod abi_tests;
mod envoy_host;
mod host;
mod http_filter;
mod logging;
mod root;

proxy_wasm::main! {{
    logging::install();
    proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::FilterRoot::new(context_id))
    });
}}

//! The idempotency filter as an Envoy dynamic module: `libidempotency_native.so`, built with
//! `make native`: `cargo build --profile native -p native-filter` (the profile unwinds, so the
//! hooks can catch panics) linked by scripts/link-static-unwind.sh (gcc's unwinder linked in,
//! so the module needs only glibc). The same core as the Wasm build, over a second host; see
//! docs/how-it-works.md, "The native build: who runs where".
//!
//! `abi` is crates/dynamic-module-abi, the bindings to Envoy's dynamic modules ABI (and the
//! exported hooks); `configuration.rs` is a filter configuration as
//! Envoy creates it (`loaded.rs` what the workers share of it), `root.rs` a worker's root for it, `filter.rs` each request, `mailbox.rs`
//! what the root leaves for a request until its own hook takes it,
//! `host.rs` core's `Host` over the ABI, `echo_filter.rs` the
//! gRPC replay echo's configuration, `worker.rs` what each worker thread holds,
//! `shared_data.rs` and `queues.rs` what proxy-wasm shared between workers, `metrics.rs` the
//! configuration's counters, `ticker.rs` the thread that gives roots their ticks,
//! `store_client/` the module's store thread and its connections to the store, `courier.rs` a
//! configuration's carrier of the roots' store streams on that thread, `inbox.rs` where their
//! events wait for a root's worker, `root_streams.rs` those streams as core's host sees them,
//! `ledger.rs` a root's handed-off completions and releases, `handoff.rs` the store thread's
//! landing of those an idle worker leaves unsettled, `store_streams.rs` what the courier's
//! and the handoff's streams share, `main_root.rs` the configuration's root on the main
//! thread, which resolves unknown outcomes for every worker, `main_thread.rs` what brings the
//! main thread to it, `carried.rs` what the workers hand it, `config_callouts.rs` its
//! callouts.

pub(crate) use dynamic_module_abi as abi;
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod attack_tests;
mod carried;
mod config_callouts;
mod configuration;
mod courier;
mod echo_filter;
mod filter;
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod grpc_tests;
mod handoff;
mod host;
mod inbox;
mod ledger;
mod loaded;
mod mailbox;
mod main_root;
mod main_thread;
mod metrics;
mod queues;
mod refusing_filter;
mod request_callouts;
mod root;
mod root_streams;
mod shared_data;
mod store_client;
mod store_streams;
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing)]
mod tests;
mod ticker;
mod worker;

use abi::{ConfigHandle, FilterFactory};

/// What each filter config is built with (called by the config-new hook).
pub(crate) static FACTORY_BUILDER: abi::FactoryBuilder = load_configuration;

abi::dynamic_module!(abi::Module {
    name: "idempotency_native",
    factory_builder: FACTORY_BUILDER,
});

/// The filter's JSON configuration, the same as the Wasm module's; refused with the field
/// named when it is wrong.
fn load_configuration(
    _name: &str,
    config: &[u8],
    handle: ConfigHandle,
) -> Result<Box<dyn FilterFactory>, String> {
    configuration::Configuration::load(config, handle)
        .map(|c| Box::new(c) as Box<dyn FilterFactory>)
}

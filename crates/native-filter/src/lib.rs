//! The idempotency filter as an Envoy dynamic module: `libidempotency_native.so`, built with
//! `cargo build --profile native -p native-filter` (the profile unwinds, so the hooks can
//! catch panics). `abi` binds Envoy's dynamic modules ABI; this file picks the filter.

pub mod abi;

use abi::{ConfigHandle, Filter, FilterFactory, HttpFilter};

/// What each filter config is built with (called by the config-new hook).
pub(crate) static FACTORY_BUILDER: abi::FactoryBuilder = pass_through;

/// For now: a filter that lets every request through untouched.
fn pass_through(
    _name: &str,
    _config: &[u8],
    _handle: ConfigHandle,
) -> Result<Box<dyn FilterFactory>, String> {
    Ok(Box::new(PassThrough))
}

struct PassThrough;

impl FilterFactory for PassThrough {
    fn new_filter(&self, _filter: &Filter) -> Option<Box<dyn HttpFilter>> {
        None
    }
}

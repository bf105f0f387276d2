//! The configuration as users write it: serde's shapes of the JSON, unknown fields refused,
//! and the defaults of every field left out. `validate` turns it into the model (`mod.rs`).

use serde::Deserialize;

use super::lookup_route::RawLookupRoute;
use super::{
    ExecutionMode, GatewayErrorPolicy, InFlightPolicy, OverloadPolicy, StoreErrorPolicy,
    StoreTransport, UnknownOutcomePolicy, MAX_TABLE_BYTES,
};
use crate::resolve::settings::RawResolve;
use idempotency_protocol::naming::rule::{default_scope_headers, RawKey, RawSource};

/// Raw JSON shape of the plugin configuration. Every field has a documented default.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawConfig {
    #[serde(default)]
    pub(super) local_table: RawLocalTable,
    #[serde(default = "default_metadata_namespace")]
    pub(super) route_metadata_namespace: Option<String>,
    #[serde(default)]
    pub(super) store: Option<RawStore>,
    #[serde(default)]
    pub(super) rules: Vec<RawRule>,
    /// This plugin is the far end of gRPC replays' hops (see `journey::echo`), and only that.
    #[serde(default)]
    pub(super) grpc_replay_echo: bool,
    /// Publish the rule, outcome and key hash as filter state for Envoy's access log.
    #[serde(default)]
    pub(super) access_log_fields: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawStore {
    pub(super) cluster: String,
    /// `host:port` the native build dials itself (the Wasm build goes through `cluster`).
    #[serde(default)]
    pub(super) address: Option<String>,
    #[serde(default = "default_store_authority")]
    pub(super) authority: String,
    #[serde(default = "default_store_timeout_ms")]
    pub(super) timeout_ms: u64,
    #[serde(default)]
    pub(super) token: Option<String>,
    #[serde(default = "default_store_path_prefix")]
    pub(super) path_prefix: String,
    #[serde(default)]
    pub(super) transport: StoreTransport,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[derive(Default)]
pub(super) struct RawLocalTable {
    /// See `RawLocalTable::budget` when absent.
    #[serde(default)]
    pub(super) max_bytes: Option<u64>,
    /// Derived from `max_bytes` when absent.
    #[serde(default)]
    pub(super) capacity: Option<u64>,
}

impl RawLocalTable {
    /// The budget given, or the default; a capacity given alone (as every configuration
    /// before the budget existed did) still loads: the budget then grows to give each slot
    /// `BUDGET_PER_GIVEN_SLOT`, so an upgrade never refuses a configuration that worked.
    pub(super) fn budget(&self) -> u64 {
        match (self.max_bytes, self.capacity) {
            (Some(max_bytes), _) => max_bytes,
            (None, Some(capacity)) => default_table_max_bytes()
                .max(capacity.saturating_mul(BUDGET_PER_GIVEN_SLOT))
                .min(MAX_TABLE_BYTES),
            (None, None) => default_table_max_bytes(),
        }
    }
}

/// Budget per slot when only `local_table.capacity` is set: room for an 869-byte response
/// inline (a typical answer to a write), and as much again for pages.
const BUDGET_PER_GIVEN_SLOT: u64 = 3072;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRule {
    pub(super) name: String,
    #[serde(default, rename = "match")]
    pub(super) matcher: RawMatch,
    #[serde(default)]
    pub(super) key: RawKey,
    #[serde(default)]
    pub(super) fingerprint: Option<RawFingerprint>,
    #[serde(default = "default_max_request_bytes")]
    pub(super) max_request_bytes: u64,
    #[serde(default = "default_scope_headers")]
    pub(super) scope_headers: Vec<String>,
    #[serde(default)]
    pub(super) scope_required: bool,
    #[serde(default = "default_ttl_seconds")]
    pub(super) ttl_seconds: u64,
    #[serde(default = "default_lease_seconds")]
    pub(super) lease_seconds: u64,
    /// After `ttl_seconds`, how long a completed record is kept as a tombstone (status and
    /// headers, no body); 0: none.
    #[serde(default)]
    pub(super) tombstone_seconds: u64,
    #[serde(default = "default_max_response_bytes")]
    pub(super) max_response_bytes: u64,
    #[serde(default = "default_release_on_status")]
    pub(super) release_on_status: Vec<String>,
    #[serde(default = "default_replay_header")]
    pub(super) replay_header: String,
    #[serde(default = "default_body_omitted_header")]
    pub(super) body_omitted_header: String,
    #[serde(default = "default_replay_skip_headers")]
    pub(super) replay_skip_headers: Vec<String>,
    #[serde(default)]
    pub(super) on_table_full: OverloadPolicy,
    #[serde(default)]
    pub(super) store: Option<RawStore>,
    #[serde(default)]
    pub(super) on_store_error: StoreErrorPolicy,
    #[serde(default)]
    pub(super) on_in_flight: InFlightPolicy,
    #[serde(default)]
    pub(super) wait_ms: Option<u64>,
    #[serde(default)]
    pub(super) on_unknown_outcome: UnknownOutcomePolicy,
    #[serde(default)]
    pub(super) on_gateway_error: GatewayErrorPolicy,
    #[serde(default)]
    pub(super) never_ran_header: Option<String>,
    #[serde(default)]
    pub(super) execution: ExecutionMode,
    #[serde(default)]
    pub(super) upstream_cluster: Option<String>,
    #[serde(default)]
    pub(super) upstream_timeout_ms: Option<u64>,
    #[serde(default)]
    pub(super) grpc: Option<RawGrpc>,
    #[serde(default)]
    pub(super) resolve: Option<RawResolve>,
    #[serde(default)]
    pub(super) lookup: Option<RawLookupRoute>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawGrpc {
    #[serde(default = "crate::grpc::status::default_release")]
    pub(super) release_on_status: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawMatch {
    #[serde(default)]
    pub(super) route_names: Vec<String>,
    #[serde(default)]
    pub(super) path_prefixes: Vec<String>,
    #[serde(default)]
    pub(super) hosts: Vec<String>,
    #[serde(default)]
    pub(super) virtual_hosts: Vec<String>,
    #[serde(default)]
    pub(super) methods: Option<Vec<String>>,
    /// gRPC services (`shop.v1.Orders`): every method of each.
    #[serde(default)]
    pub(super) grpc_services: Vec<String>,
    /// gRPC methods (`shop.v1.Orders/PlaceOrder`).
    #[serde(default)]
    pub(super) grpc_methods: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum RawFingerprint {
    Mode(String),
    Fields(RawFingerprintFields),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFingerprintFields {
    pub(super) fields: Vec<RawSource>,
}

pub(super) fn default_store_authority() -> String {
    "idempotency-store".to_string()
}
pub(super) fn default_store_timeout_ms() -> u64 {
    250
}
pub(super) fn default_store_path_prefix() -> String {
    idempotency_protocol::wire::path::PREFIX.to_string()
}

/// Suits a sidecar: 16,384 records with their responses inline up to about 1.3 KiB, and
/// pages for larger ones up to `max_response_bytes`.
pub(super) fn default_table_max_bytes() -> u64 {
    64 * 1024 * 1024
}
pub(super) fn default_metadata_namespace() -> Option<String> {
    Some("idempotency".to_string())
}
pub(super) fn default_max_request_bytes() -> u64 {
    1024 * 1024
}
pub(super) fn default_ttl_seconds() -> u64 {
    86_400
}
/// A live request's lease is renewed while it runs, so the lease only bounds how long a key
/// stays blocked after its proxy died mid-request; 30 s rides out a store outage of about
/// 20 s between renewals.
pub(super) fn default_lease_seconds() -> u64 {
    30
}
pub(super) fn default_max_response_bytes() -> u64 {
    1024 * 1024
}
/// Statuses that say the write never ran: server failures, timeouts, throttling, and a caller
/// the upstream did not authenticate or authorize (a forged or unsigned request recorded as
/// 401 would otherwise block the genuine one until the TTL passes).
pub(super) fn default_release_on_status() -> Vec<String> {
    ["5xx", "401", "403", "407", "408", "425", "429"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}
pub(super) fn default_replay_header() -> String {
    "idempotent-replayed".to_string()
}
pub(super) fn default_body_omitted_header() -> String {
    "idempotent-body-omitted".to_string()
}
/// Headers a retry must not receive again: credentials, per-response values, Envoy internals.
/// Hop-by-hop headers and content-length are always dropped and need not be listed.
pub fn default_replay_skip_headers() -> Vec<String> {
    [
        "set-cookie",
        "set-cookie2",
        "authorization",
        "proxy-authorization",
        "www-authenticate",
        "proxy-authenticate",
        "date",
        "server",
        "x-envoy-*",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

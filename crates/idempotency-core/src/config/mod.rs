//! The plugin configuration: what users write (serde, unknown fields refused) and the
//! validated, ready-to-use form the filter runs on.

use serde::Deserialize;

use crate::fingerprint::FingerprintMode;
use crate::grpc::GrpcRule;
pub mod lookup_route;

use crate::resolve::settings::{self as resolve_settings, RawResolve, Resolve, RuleFacts};
use crate::response_policy::{HeaderFilter, ReleasePolicy};
use crate::table::layout::Layout;
pub use idempotency_protocol::naming::rule::ConfigError;
use idempotency_protocol::naming::rule::{
    default_scope_headers, invalid, valid_header_name, validate_key, validate_name, validate_scope,
    validate_source, RawKey, RawSource,
};
use idempotency_protocol::naming::source::FieldSource;
use lookup_route::{self as lookup_settings, LookupRoute, RawLookupRoute};

/// Raw JSON shape of the plugin configuration. Every field has a documented default.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    local_table: RawLocalTable,
    #[serde(default = "default_metadata_namespace")]
    route_metadata_namespace: Option<String>,
    #[serde(default)]
    store: Option<RawStore>,
    #[serde(default)]
    rules: Vec<RawRule>,
    /// This plugin is the far end of gRPC replays' hops (see `grpc::echo`), and only that.
    #[serde(default)]
    grpc_replay_echo: bool,
    /// Publish the rule, outcome and key hash as filter state for Envoy's access log.
    #[serde(default)]
    access_log_fields: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    cluster: String,
    #[serde(default = "default_store_authority")]
    authority: String,
    #[serde(default = "default_store_timeout_ms")]
    timeout_ms: u64,
    #[serde(default)]
    token: Option<String>,
    #[serde(default = "default_store_path_prefix")]
    path_prefix: String,
    #[serde(default)]
    transport: StoreTransport,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
#[derive(Default)]
struct RawLocalTable {
    /// See `RawLocalTable::budget` when absent.
    #[serde(default)]
    max_bytes: Option<u64>,
    /// Derived from `max_bytes` when absent.
    #[serde(default)]
    capacity: Option<u64>,
}

impl RawLocalTable {
    /// The budget given, or the default; a capacity given alone (as every configuration
    /// before the budget existed did) still loads: the budget then grows to give each slot
    /// `BUDGET_PER_GIVEN_SLOT`, so an upgrade never refuses a configuration that worked.
    fn budget(&self) -> u64 {
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
struct RawRule {
    name: String,
    #[serde(default, rename = "match")]
    matcher: RawMatch,
    #[serde(default)]
    key: RawKey,
    #[serde(default)]
    fingerprint: Option<RawFingerprint>,
    #[serde(default = "default_max_request_bytes")]
    max_request_bytes: u64,
    #[serde(default = "default_scope_headers")]
    scope_headers: Vec<String>,
    #[serde(default)]
    scope_required: bool,
    #[serde(default = "default_ttl_seconds")]
    ttl_seconds: u64,
    #[serde(default = "default_lease_seconds")]
    lease_seconds: u64,
    #[serde(default = "default_max_response_bytes")]
    max_response_bytes: u64,
    #[serde(default = "default_release_on_status")]
    release_on_status: Vec<String>,
    #[serde(default = "default_replay_header")]
    replay_header: String,
    #[serde(default = "default_body_omitted_header")]
    body_omitted_header: String,
    #[serde(default = "default_replay_skip_headers")]
    replay_skip_headers: Vec<String>,
    #[serde(default)]
    on_table_full: OverloadPolicy,
    #[serde(default)]
    store: Option<RawStore>,
    #[serde(default)]
    on_store_error: StoreErrorPolicy,
    #[serde(default)]
    on_in_flight: InFlightPolicy,
    #[serde(default)]
    wait_ms: Option<u64>,
    #[serde(default)]
    on_unknown_outcome: UnknownOutcomePolicy,
    #[serde(default)]
    execution: ExecutionMode,
    #[serde(default)]
    upstream_cluster: Option<String>,
    #[serde(default)]
    upstream_timeout_ms: Option<u64>,
    #[serde(default)]
    grpc: Option<RawGrpc>,
    #[serde(default)]
    resolve: Option<RawResolve>,
    #[serde(default)]
    lookup: Option<RawLookupRoute>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGrpc {
    #[serde(default = "crate::grpc::status::default_release")]
    release_on_status: Vec<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    #[serde(default)]
    route_names: Vec<String>,
    #[serde(default)]
    path_prefixes: Vec<String>,
    #[serde(default)]
    hosts: Vec<String>,
    #[serde(default)]
    virtual_hosts: Vec<String>,
    #[serde(default)]
    methods: Option<Vec<String>>,
    /// gRPC services (`shop.v1.Orders`): every method of each.
    #[serde(default)]
    grpc_services: Vec<String>,
    /// gRPC methods (`shop.v1.Orders/PlaceOrder`).
    #[serde(default)]
    grpc_methods: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawFingerprint {
    Mode(String),
    Fields(RawFingerprintFields),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFingerprintFields {
    fields: Vec<RawSource>,
}

/// What to do when the local table has no free slot for a new key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverloadPolicy {
    /// Answer 503 problem+json with Retry-After: no write runs without protection.
    #[default]
    Reject,
    /// Let the request through unprotected (counted and logged).
    PassThrough,
}

/// What to do when the store cannot confirm a claim (down, slow, or answering garbage).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreErrorPolicy {
    /// 503 problem+json with Retry-After: the write does not run without the cluster-wide claim.
    #[default]
    FailClosed,
    /// Continue with the local claim only (this proxy still deduplicates its own retries).
    FailOpen,
}

/// What a duplicate gets while the first request with its key is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InFlightPolicy {
    /// 409 with Retry-After at once: the client retries.
    #[default]
    Conflict,
    /// Hold the duplicate until the first completes and replay its response to it (409 if
    /// `wait_ms` passes first, a retry-able 503 if the first is released).
    Wait,
}

/// What a write whose outcome is unknown leaves behind: Envoy answered after the request may
/// have reached the upstream (a route or per-try timeout, a reset after it was sent), or the
/// client left while it ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownOutcomePolicy {
    /// Keep the key taken until its TTL (or an operator's purge) and tell every retry that
    /// the first attempt may have completed: it is never run a second time.
    #[default]
    Record,
    /// Free the key so a retry runs the write again: only for upstreams known to roll a write
    /// back when their caller goes away.
    Release,
}

/// How a protected request that holds its key reaches the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecutionMode {
    /// Through Envoy's router, as any request: the client's connection carries it, so a
    /// client that leaves cuts it short and its outcome is unknown.
    #[default]
    Inline,
    /// Sent by the filter itself from the worker's root context, which outlives the client:
    /// the write completes and is recorded even if its client left, and a retry replays it.
    Detached,
}

/// Where and how long a detached write is sent (`execution: "detached"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DetachedUpstream {
    /// The Envoy cluster to send to; None: the cluster the request's route chose.
    pub cluster: Option<String>,
    /// The whole exchange, from sending the request to its response's last byte.
    pub timeout_ms: u64,
}

/// Envoy's own default route timeout: a detached write gets as long as a routed one would.
pub const DEFAULT_UPSTREAM_TIMEOUT_MS: u64 = 15_000;
pub const MAX_UPSTREAM_TIMEOUT_MS: u64 = 300_000;

/// How long a held duplicate waits by default, and at most.
pub const DEFAULT_WAIT_MS: u64 = 10_000;
pub const MAX_WAIT_MS: u64 = 60_000;

/// How the filter talks to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreTransport {
    /// One long-lived gRPC stream per worker, opened by the root context: a claim or a
    /// completion is one message on it (about a quarter of a callout's cost to Envoy).
    #[default]
    Grpc,
    /// One HTTP/2 callout per claim, completion and release (the store's JSON API).
    Http,
}

fn default_store_authority() -> String {
    "idempotency-store".to_string()
}
fn default_store_timeout_ms() -> u64 {
    250
}
fn default_store_path_prefix() -> String {
    idempotency_protocol::wire::path::PREFIX.to_string()
}

/// Suits a sidecar: 16,384 records with their responses inline up to about 1.3 KiB, and
/// pages for larger ones up to `max_response_bytes`.
fn default_table_max_bytes() -> u64 {
    64 * 1024 * 1024
}
fn default_metadata_namespace() -> Option<String> {
    Some("idempotency".to_string())
}
fn default_max_request_bytes() -> u64 {
    1024 * 1024
}
fn default_ttl_seconds() -> u64 {
    86_400
}
/// A live request's lease is renewed while it runs, so the lease only bounds how long a key
/// stays blocked after its proxy died mid-request; 30 s rides out a store outage of about
/// 20 s between renewals.
fn default_lease_seconds() -> u64 {
    30
}
fn default_max_response_bytes() -> u64 {
    1024 * 1024
}
/// Statuses that say the write never ran: server failures, timeouts, throttling, and a caller
/// the upstream did not authenticate or authorize (a forged or unsigned request recorded as
/// 401 would otherwise block the genuine one until the TTL passes).
fn default_release_on_status() -> Vec<String> {
    ["5xx", "401", "403", "407", "408", "425", "429"]
        .iter()
        .map(|s| s.to_string())
        .collect()
}
fn default_replay_header() -> String {
    "idempotent-replayed".to_string()
}
fn default_body_omitted_header() -> String {
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

/// Upper bounds that keep one rule from exhausting the proxy.
const MAX_CAPACITY: u64 = crate::table::layout::MAX_SLOTS;
const MIN_TABLE_BYTES: u64 = 1024 * 1024;
const MAX_TABLE_BYTES: u64 = 64 * 1024 * 1024 * 1024;
const MAX_TTL_SECONDS: u64 = 366 * 86_400;
const MAX_RESPONSE_BYTES: u64 = 64 * 1024 * 1024;

/// The store's own limits, from the protocol crate the store shares. The store refuses every
/// claim outside them, so a rule with a store that exceeds them would fail each request at
/// run time instead of once at configuration.
pub const STORE_MIN_LEASE_MS: u64 = idempotency_protocol::wire::MIN_LEASE_MS;
pub const STORE_MAX_LEASE_MS: u64 = idempotency_protocol::wire::MAX_LEASE_MS;
pub const STORE_MIN_TTL_MS: u64 = idempotency_protocol::wire::MIN_TTL_MS;
pub const STORE_MAX_TTL_MS: u64 = idempotency_protocol::wire::MAX_TTL_MS;

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The local table's slots and pages, laid out within `local_table.max_bytes`.
    pub table_layout: Layout,
    /// Route metadata namespace whose `rule` key names the rule for a route; None disables it.
    pub route_metadata_namespace: Option<String>,
    pub rules: Vec<Rule>,
    /// Derived once from the rules, so each request skips host calls no rule needs.
    pub(crate) needs_route_name: bool,
    pub(crate) needs_virtual_host: bool,
    /// The plugin answers gRPC replays' hops and protects nothing (`grpc_replay_echo`).
    pub grpc_replay_echo: bool,
    /// Each protected request publishes `idempotency_rule`, `idempotency_outcome` and
    /// `idempotency_key_hash` as filter state (`access_log_fields`): three host calls a
    /// request, so only when asked for.
    pub access_log_fields: bool,
}

/// One rule: which requests it protects and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub name: String,
    pub matcher: RuleMatch,
    pub key_required: bool,
    /// Where the key comes from, in order; several form one composite key.
    pub key_sources: Vec<FieldSource>,
    pub fingerprint: FingerprintMode,
    /// Largest request body buffered for the key or the fingerprint.
    pub max_request_bytes: usize,
    /// Lower-cased header names whose values scope the key (caller, tenant, host).
    pub scope_headers: Vec<String>,
    /// A request lacking a scope header other than `:authority` is refused with 401 rather
    /// than sharing one anonymous scope with every other such caller.
    pub scope_required: bool,
    pub ttl_ms: u64,
    pub lease_ms: u64,
    pub max_response_bytes: usize,
    pub release: ReleasePolicy,
    pub replay_header: String,
    pub body_omitted_header: String,
    pub replay_headers: HeaderFilter,
    pub on_table_full: OverloadPolicy,
    /// Cluster mode: the store that confirms every claim; None for single-proxy mode.
    pub store: Option<StoreConfig>,
    pub on_store_error: StoreErrorPolicy,
    pub on_in_flight: InFlightPolicy,
    /// How long a duplicate is held under `InFlightPolicy::Wait`.
    pub wait_ms: u64,
    pub on_unknown_outcome: UnknownOutcomePolicy,
    /// Some: `execution: "detached"`, sent from the root context to this upstream.
    pub detached: Option<DetachedUpstream>,
    /// Some: the rule protects gRPC unary calls (`grpc`, or gRPC services or methods in its
    /// match).
    pub grpc: Option<GrpcRule>,
    /// Some: an unknown outcome is resolved by asking the service (`resolve`).
    pub resolve: Option<Resolve>,
    /// Some: callers may ask what the filter holds for their key (`lookup`).
    pub lookup_route: Option<LookupRoute>,
}

/// Where and how the filter reaches the shared store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// Envoy cluster name (in Istio: `outbound|<port>||<fqdn>`).
    pub cluster: String,
    pub authority: String,
    pub timeout_ms: u64,
    /// Bearer token sent to the store.
    pub token: Option<String>,
    pub path_prefix: String,
    pub transport: StoreTransport,
}

impl AsRef<Rule> for Rule {
    fn as_ref(&self) -> &Rule {
        self
    }
}

/// Which requests a rule applies to. Empty lists match anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleMatch {
    pub route_names: Vec<String>,
    pub path_prefixes: Vec<String>,
    /// Whole paths (a gRPC method's `/service/Method`).
    pub paths: Vec<String>,
    /// Lower-cased hosts, compared without port.
    pub hosts: Vec<String>,
    /// Envoy virtual host names.
    pub virtual_hosts: Vec<String>,
    /// Upper-cased methods; never empty.
    pub methods: Vec<String>,
}

impl Config {
    /// Parses and validates the plugin configuration bytes (empty means "no rules").
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        let raw: RawConfig = if bytes.iter().all(|b| b.is_ascii_whitespace()) {
            serde_json::from_str("{}").map_err(|e| invalid("(root)", e.to_string()))?
        } else {
            serde_json::from_slice(bytes).map_err(|e| invalid("(json)", e.to_string()))?
        };
        Config::validate(raw)
    }

    fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
        let table = &raw.local_table;
        if table.capacity.is_some_and(|c| c == 0 || c > MAX_CAPACITY) {
            return Err(invalid(
                "local_table.capacity",
                format!("must be between 1 and {MAX_CAPACITY}"),
            ));
        }
        if !(MIN_TABLE_BYTES..=MAX_TABLE_BYTES).contains(&table.budget()) {
            return Err(invalid(
                "local_table.max_bytes",
                format!("must be between {MIN_TABLE_BYTES} and {MAX_TABLE_BYTES}"),
            ));
        }
        if let Some(ns) = &raw.route_metadata_namespace {
            if ns.trim().is_empty() {
                return Err(invalid(
                    "route_metadata_namespace",
                    "must not be empty (use null to disable)",
                ));
            }
        }
        if raw.grpc_replay_echo && !raw.rules.is_empty() {
            return Err(invalid(
                "grpc_replay_echo",
                "a replay echo protects nothing: configure it on its own listener, without rules",
            ));
        }
        let global_store = raw.store.map(|s| validate_store("store", s)).transpose()?;
        let mut rules = Vec::with_capacity(raw.rules.len());
        for (index, raw_rule) in raw.rules.into_iter().enumerate() {
            let rule = validate_rule(index, raw_rule, global_store.as_ref())?;
            if rules.iter().any(|r: &Rule| r.name == rule.name) {
                return Err(invalid(
                    format!("rules[{index}].name"),
                    format!("duplicate rule name '{}'", rule.name),
                ));
            }
            rules.push(rule);
        }
        let largest_body = rules
            .iter()
            .map(|r| r.max_response_bytes as u64)
            .max()
            .unwrap_or(0);
        let table = raw.local_table;
        // The echo records nothing: the smallest table, not a sidecar's 64 MiB.
        let (budget, capacity) = if raw.grpc_replay_echo {
            (MIN_TABLE_BYTES, None)
        } else {
            (table.budget(), table.capacity)
        };
        let table_layout =
            Layout::plan(budget, capacity, largest_body).map_err(|e| invalid(e.field, e.reason))?;
        Ok(Config {
            table_layout,
            route_metadata_namespace: raw.route_metadata_namespace,
            needs_route_name: rules.iter().any(|r| !r.matcher.route_names.is_empty()),
            needs_virtual_host: rules.iter().any(|r| !r.matcher.virtual_hosts.is_empty()),
            grpc_replay_echo: raw.grpc_replay_echo,
            access_log_fields: raw.access_log_fields,
            rules,
        })
    }
}

const MAX_STORE_TIMEOUT_MS: u64 = 60_000;

fn validate_store(at: &str, raw: RawStore) -> Result<StoreConfig, ConfigError> {
    if raw.cluster.trim().is_empty() {
        return Err(invalid(
            format!("{at}.cluster"),
            "must name an Envoy cluster",
        ));
    }
    if raw.authority.trim().is_empty() || raw.authority.bytes().any(|b| !b.is_ascii_graphic()) {
        return Err(invalid(format!("{at}.authority"), "must be a host name"));
    }
    if raw.timeout_ms == 0 || raw.timeout_ms > MAX_STORE_TIMEOUT_MS {
        // Zero would mean "no timeout" to Envoy: a stuck store would hold requests forever.
        return Err(invalid(
            format!("{at}.timeout_ms"),
            format!("must be between 1 and {MAX_STORE_TIMEOUT_MS}"),
        ));
    }
    if let Some(token) = &raw.token {
        if token.is_empty() || token.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err(invalid(
                format!("{at}.token"),
                "must be non-empty visible ASCII without spaces",
            ));
        }
    }
    if !raw.path_prefix.starts_with('/') || raw.path_prefix.ends_with('/') {
        return Err(invalid(
            format!("{at}.path_prefix"),
            "must start with '/' and not end with '/'",
        ));
    }
    Ok(StoreConfig {
        cluster: raw.cluster,
        authority: raw.authority,
        timeout_ms: raw.timeout_ms,
        token: raw.token,
        path_prefix: raw.path_prefix,
        transport: raw.transport,
    })
}

fn validate_rule(
    index: usize,
    raw: RawRule,
    global_store: Option<&StoreConfig>,
) -> Result<Rule, ConfigError> {
    let at = |field: &str| format!("rules[{index}].{field}");
    validate_name(index, &raw.name)?;
    let key_required = raw.key.required;
    let key_sources = validate_key(index, raw.key)?;
    let fingerprint = match raw.fingerprint {
        None => FingerprintMode::Body,
        Some(RawFingerprint::Mode(m)) if m == "body" => FingerprintMode::Body,
        Some(RawFingerprint::Mode(m)) if m == "none" => FingerprintMode::None,
        Some(RawFingerprint::Mode(m)) => {
            return Err(invalid(
                at("fingerprint"),
                format!("'{m}' is not \"body\", \"none\" or {{\"fields\": [...]}}"),
            ))
        }
        Some(RawFingerprint::Fields(f)) => {
            if f.fields.is_empty() {
                return Err(invalid(
                    at("fingerprint.fields"),
                    "must name at least one field",
                ));
            }
            let mut fields = Vec::with_capacity(f.fields.len());
            for (i, raw_field) in f.fields.into_iter().enumerate() {
                let field_at = format!("rules[{index}].fingerprint.fields[{i}]");
                let field = validate_source(&field_at, raw_field)?;
                if !field.in_body() {
                    return Err(invalid(
                        field_at,
                        "fingerprint fields are 'json' or 'form' body fields",
                    ));
                }
                fields.push(field);
            }
            FingerprintMode::Fields(fields)
        }
    };
    if raw.max_request_bytes == 0 || raw.max_request_bytes > MAX_RESPONSE_BYTES {
        return Err(invalid(
            at("max_request_bytes"),
            format!("must be between 1 and {MAX_RESPONSE_BYTES}"),
        ));
    }
    let scope_headers = validate_scope(index, &raw.scope_headers, raw.scope_required)?;
    if raw.ttl_seconds == 0 || raw.ttl_seconds > MAX_TTL_SECONDS {
        return Err(invalid(
            at("ttl_seconds"),
            format!("must be between 1 and {MAX_TTL_SECONDS}"),
        ));
    }
    if raw.lease_seconds == 0 || raw.lease_seconds > raw.ttl_seconds {
        return Err(invalid(
            at("lease_seconds"),
            "must be at least 1 and at most ttl_seconds",
        ));
    }
    if raw.max_response_bytes > MAX_RESPONSE_BYTES {
        return Err(invalid(
            at("max_response_bytes"),
            format!("must be at most {MAX_RESPONSE_BYTES}"),
        ));
    }
    let release = ReleasePolicy::parse(&raw.release_on_status)
        .map_err(|reason| invalid(at("release_on_status"), reason))?;
    for (field, value) in [
        ("replay_header", &raw.replay_header),
        ("body_omitted_header", &raw.body_omitted_header),
    ] {
        if !valid_header_name(&value.to_ascii_lowercase()) || value.starts_with(':') {
            return Err(invalid(at(field), "must be a regular HTTP header name"));
        }
    }
    let replay_headers = HeaderFilter::new(&raw.replay_skip_headers)
        .map_err(|reason| invalid(at("replay_skip_headers"), reason))?;
    let store = match raw.store {
        Some(s) => Some(validate_store(&at("store"), s)?),
        None => global_store.cloned(),
    };
    let ttl_ms = raw.ttl_seconds.saturating_mul(1000);
    let lease_ms = raw.lease_seconds.saturating_mul(1000);
    if store.is_some() {
        if !(STORE_MIN_TTL_MS..=STORE_MAX_TTL_MS).contains(&ttl_ms) {
            return Err(invalid(
                at("ttl_seconds"),
                format!(
                    "must be at most {} with a store: the store refuses longer records",
                    STORE_MAX_TTL_MS / 1000
                ),
            ));
        }
        if !(STORE_MIN_LEASE_MS..=STORE_MAX_LEASE_MS).contains(&lease_ms) {
            return Err(invalid(
                at("lease_seconds"),
                format!(
                    "must be at most {} with a store: the store refuses longer leases",
                    STORE_MAX_LEASE_MS / 1000
                ),
            ));
        }
    }
    let wait_ms = raw.wait_ms.unwrap_or(DEFAULT_WAIT_MS.min(lease_ms));
    if raw.wait_ms.is_some() && raw.on_in_flight != InFlightPolicy::Wait {
        return Err(invalid(
            at("wait_ms"),
            "only applies with on_in_flight: \"wait\"",
        ));
    }
    if wait_ms == 0 || wait_ms > MAX_WAIT_MS || wait_ms > lease_ms {
        // Past the lease the first request is presumed gone and the key is taken over.
        return Err(invalid(
            at("wait_ms"),
            format!("must be between 1 and {MAX_WAIT_MS}, and at most lease_seconds"),
        ));
    }
    let is_grpc = raw.grpc.is_some()
        || !raw.matcher.grpc_services.is_empty()
        || !raw.matcher.grpc_methods.is_empty();
    let grpc = match (is_grpc, raw.grpc) {
        (false, _) => None,
        (true, raw_grpc) => {
            let raw_grpc = raw_grpc.unwrap_or_else(|| RawGrpc {
                release_on_status: crate::grpc::status::default_release(),
            });
            let detached = raw.execution == ExecutionMode::Detached;
            if let Some((field, reason)) = grpc_conflict(&key_sources, &fingerprint, detached) {
                return Err(invalid(at(&field), reason));
            }
            let mut release = Vec::with_capacity(raw_grpc.release_on_status.len());
            for (i, entry) in raw_grpc.release_on_status.iter().enumerate() {
                let code = crate::grpc::status::parse(entry).map_err(|reason| {
                    invalid(
                        format!("rules[{index}].grpc.release_on_status[{i}]"),
                        reason,
                    )
                })?;
                if code == crate::grpc::status::OK {
                    return Err(invalid(
                        format!("rules[{index}].grpc.release_on_status[{i}]"),
                        "OK cannot release a claim: a call that succeeded is recorded",
                    ));
                }
                release.push(code);
            }
            Some(GrpcRule { release })
        }
    };
    let detached = validate_execution(
        &at,
        raw.execution,
        raw.upstream_cluster,
        raw.upstream_timeout_ms,
        store.as_ref(),
    )?;
    let resolve = match raw.resolve {
        None => None,
        Some(raw_resolve) => {
            let facts = RuleFacts {
                key_sources: key_sources.len(),
                scope_headers: &scope_headers,
                ttl_ms,
                releases_unknown: raw.on_unknown_outcome == UnknownOutcomePolicy::Release,
                is_grpc: grpc.is_some(),
                store_cluster: store.as_ref().map(|s| s.cluster.as_str()),
            };
            let validated =
                resolve_settings::validate(raw_resolve, &facts).map_err(|(field, why)| {
                    let at_field = if field.is_empty() {
                        at("resolve")
                    } else {
                        at(&format!("resolve.{field}"))
                    };
                    invalid(at_field, why)
                })?;
            Some(validated)
        }
    };
    let lookup_route = match raw.lookup {
        None => None,
        Some(raw_lookup) => {
            let validated = lookup_settings::validate(raw_lookup, &key_sources, grpc.is_some())
                .map_err(|(field, why)| {
                    let at_field = if field.is_empty() {
                        at("lookup")
                    } else {
                        at(&format!("lookup.{field}"))
                    };
                    invalid(at_field, why)
                })?;
            Some(validated)
        }
    };
    Ok(Rule {
        name: raw.name,
        matcher: validate_match(index, raw.matcher, grpc.is_some())?,
        key_required,
        key_sources,
        fingerprint,
        max_request_bytes: usize::try_from(raw.max_request_bytes)
            .map_err(|_| invalid(at("max_request_bytes"), "too large for this platform"))?,
        scope_headers,
        scope_required: raw.scope_required,
        ttl_ms,
        lease_ms,
        max_response_bytes: usize::try_from(raw.max_response_bytes)
            .map_err(|_| invalid(at("max_response_bytes"), "too large for this platform"))?,
        release,
        replay_header: raw.replay_header.to_ascii_lowercase(),
        body_omitted_header: raw.body_omitted_header.to_ascii_lowercase(),
        replay_headers,
        on_table_full: raw.on_table_full,
        store,
        on_store_error: raw.on_store_error,
        on_in_flight: raw.on_in_flight,
        wait_ms,
        on_unknown_outcome: raw.on_unknown_outcome,
        detached,
        grpc,
        resolve,
        lookup_route,
    })
}

/// What of a rule a gRPC call cannot honour, as (field, why); None when it can be a gRPC rule.
fn grpc_conflict(
    key_sources: &[FieldSource],
    fingerprint: &FingerprintMode,
    detached: bool,
) -> Option<(String, &'static str)> {
    if detached {
        return Some((
            "execution".to_string(),
            "\"detached\" is not supported for gRPC rules: a detached write is sent by HTTP \
             callout, which does not carry a gRPC response's trailers",
        ));
    }
    // A gRPC message is protobuf, not JSON or a form, and a gRPC path has no query.
    if let Some(i) = key_sources
        .iter()
        .position(|s| !matches!(s, FieldSource::Header(_)))
    {
        return Some((
            format!("key.sources[{i}]"),
            "a gRPC rule's key comes from metadata: use 'header' sources only",
        ));
    }
    if matches!(fingerprint, FingerprintMode::Fields(_)) {
        return Some((
            "fingerprint".to_string(),
            "a gRPC rule fingerprints the whole message: \"body\" or \"none\"",
        ));
    }
    None
}

impl Rule {
    /// This HTTP rule as it applies to the gRPC calls it matches: the same rule with gRPC's
    /// semantics (the status from the trailers, released by the default gRPC statuses, gRPC
    /// answers and replays). Err names what of the rule a gRPC call cannot honour (a key or
    /// fingerprint read from the body or the query, a detached execution): those calls pass
    /// unprotected.
    pub fn for_grpc_calls(&self) -> Result<Rule, String> {
        if let Some((field, reason)) = grpc_conflict(
            &self.key_sources,
            &self.fingerprint,
            self.detached.is_some(),
        ) {
            return Err(format!("{field}: {reason}"));
        }
        Ok(Rule {
            grpc: Some(GrpcRule {
                release: crate::grpc::status::default_release_codes(),
            }),
            ..self.clone()
        })
    }
}

/// The upstream of a detached rule; its settings are refused on an inline one, where they
/// would silently do nothing.
fn validate_execution(
    at: &dyn Fn(&str) -> String,
    mode: ExecutionMode,
    cluster: Option<String>,
    timeout_ms: Option<u64>,
    store: Option<&StoreConfig>,
) -> Result<Option<DetachedUpstream>, ConfigError> {
    if mode == ExecutionMode::Inline {
        for (field, given) in [
            ("upstream_cluster", cluster.is_some()),
            ("upstream_timeout_ms", timeout_ms.is_some()),
        ] {
            if given {
                return Err(invalid(
                    at(field),
                    "only applies with execution: \"detached\"",
                ));
            }
        }
        return Ok(None);
    }
    if let Some(name) = &cluster {
        if name.is_empty() || name.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err(invalid(
                at("upstream_cluster"),
                "must name an Envoy cluster (omit it to send to the route's cluster)",
            ));
        }
        if store.is_some_and(|s| s.cluster == *name) {
            return Err(invalid(
                at("upstream_cluster"),
                format!("'{name}' is the store's cluster: writes go to the service, not the store"),
            ));
        }
    }
    let timeout_ms = timeout_ms.unwrap_or(DEFAULT_UPSTREAM_TIMEOUT_MS);
    if timeout_ms == 0 || timeout_ms > MAX_UPSTREAM_TIMEOUT_MS {
        // Zero would mean "no timeout" to Envoy: a hung upstream would hold the key forever.
        return Err(invalid(
            at("upstream_timeout_ms"),
            format!("must be between 1 and {MAX_UPSTREAM_TIMEOUT_MS}"),
        ));
    }
    Ok(Some(DetachedUpstream {
        cluster,
        timeout_ms,
    }))
}

/// A gRPC name part: a service's dotted name or a method's name.
fn valid_grpc_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.')
}

fn validate_match(index: usize, raw: RawMatch, grpc: bool) -> Result<RuleMatch, ConfigError> {
    let at = |field: &str| format!("rules[{index}].match.{field}");
    let mut path_prefixes = raw.path_prefixes.clone();
    for (i, service) in raw.grpc_services.iter().enumerate() {
        if !valid_grpc_name(service) {
            return Err(invalid(
                format!("rules[{index}].match.grpc_services[{i}]"),
                format!("'{service}' is not a gRPC service name like \"shop.v1.Orders\""),
            ));
        }
        path_prefixes.push(format!("/{service}/"));
    }
    let mut paths = Vec::with_capacity(raw.grpc_methods.len());
    for (i, method) in raw.grpc_methods.iter().enumerate() {
        let valid = method.split_once('/').is_some_and(|(service, name)| {
            valid_grpc_name(service) && valid_grpc_name(name) && !name.contains('.')
        });
        if !valid {
            return Err(invalid(
                format!("rules[{index}].match.grpc_methods[{i}]"),
                format!("'{method}' is not a gRPC method like \"shop.v1.Orders/PlaceOrder\""),
            ));
        }
        paths.push(format!("/{method}"));
    }
    if grpc && raw.methods.is_some() {
        return Err(invalid(
            at("methods"),
            "a gRPC rule matches gRPC calls (always POST): name services or methods instead",
        ));
    }
    for (i, p) in raw.path_prefixes.iter().enumerate() {
        if !p.starts_with('/') {
            return Err(invalid(
                format!("rules[{index}].match.path_prefixes[{i}]"),
                format!("'{p}' must start with '/'"),
            ));
        }
    }
    let methods = match raw.methods {
        None if grpc => vec!["POST".to_string()],
        None => vec!["POST".to_string(), "PATCH".to_string()],
        Some(list) if list.is_empty() => {
            return Err(invalid(
                at("methods"),
                "must not be empty (omit it for POST and PATCH)",
            ))
        }
        Some(list) => {
            let mut out = Vec::with_capacity(list.len());
            for (i, m) in list.iter().enumerate() {
                if m.is_empty() || !m.bytes().all(|b| b.is_ascii_alphabetic()) {
                    return Err(invalid(
                        format!("rules[{index}].match.methods[{i}]"),
                        format!("'{m}' is not an HTTP method"),
                    ));
                }
                out.push(m.to_ascii_uppercase());
            }
            out
        }
    };
    for (i, r) in raw.route_names.iter().enumerate() {
        if r.is_empty() {
            return Err(invalid(
                format!("rules[{index}].match.route_names[{i}]"),
                "must not be empty",
            ));
        }
    }
    Ok(RuleMatch {
        route_names: raw.route_names,
        path_prefixes,
        paths,
        hosts: raw.hosts.iter().map(|h| h.to_ascii_lowercase()).collect(),
        virtual_hosts: raw.virtual_hosts,
        methods,
    })
}

#[cfg(test)]
mod tests;

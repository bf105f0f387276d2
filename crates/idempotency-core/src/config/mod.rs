//! The plugin configuration: the validated, ready-to-use model the filter runs on (here),
//! from what users write (`raw`: serde's shapes, unknown fields refused, the defaults) by
//! `validate`; `lookup_route` is a rule's `lookup` settings.

pub mod lookup_route;
mod raw;
mod validate;

use serde::Deserialize;

use crate::fingerprint::FingerprintMode;
use crate::grpc::GrpcRule;
use crate::resolve::settings::Resolve;
use crate::response_policy::{HeaderFilter, ReleasePolicy};
use crate::table::layout::Layout;
use idempotency_protocol::naming::rule::invalid;
pub use idempotency_protocol::naming::rule::ConfigError;
use idempotency_protocol::naming::source::FieldSource;
use idempotency_protocol::record::{RecordedResponse, Retention};
use lookup_route::LookupRoute;
pub use raw::default_replay_skip_headers;
use raw::RawConfig;
use validate::grpc_conflict;

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

/// What an upstream's answer that says someone behind Envoy gave up leaves behind: a
/// proxy's `504` or `502`, Envoy's words for a reset after sending in a `503`, gRPC's
/// `DEADLINE_EXCEEDED`, or a proxy's `UNAVAILABLE` (see `gave_up`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GatewayErrorPolicy {
    /// An unknown outcome, as Envoy's own timeout is: the write may have run behind the proxy.
    #[default]
    UnknownOutcome,
    /// The upstream's answer like any other: `release_on_status` (or `grpc.release_on_status`)
    /// decides, so a retry may run the write again.
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
    /// After `ttl_ms`, how long a completed record is kept without its body (a tombstone): a
    /// retry then gets the recorded status and headers with the body-omitted marker, never a
    /// second execution. 0: the record is gone at `ttl_ms`.
    pub tombstone_ms: u64,
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
    pub on_gateway_error: GatewayErrorPolicy,
    /// Lower case: a response header (or gRPC trailer) by which the service says it did not
    /// process the request, so that a gateway error carrying it is not an unknown outcome.
    pub never_ran_header: Option<String>,
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
    /// `host:port` of the store, resolved at each connection: the native build connects to
    /// it from threads of its own, off Envoy's main thread (the Wasm build uses `cluster`).
    pub address: Option<String>,
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
        validate::config(raw)
    }
}

impl Rule {
    /// How long `recorded` is kept as a tombstone after the TTL: a response is, for the
    /// rule's `tombstone_ms`; an unknown outcome is not one (it is settled or expires).
    pub fn tombstone_ms_for(&self, recorded: &RecordedResponse) -> u64 {
        match recorded.unknown {
            None => self.tombstone_ms,
            Some(_) => 0,
        }
    }

    /// How long a record of this rule's is kept: its TTL, then its tombstone.
    pub fn retention(&self) -> Retention {
        Retention {
            ttl_ms: self.ttl_ms,
            tombstone_ms: self.tombstone_ms,
        }
    }

    /// Whether `recorded`, recorded at `recorded_at_ms`, is at `now_ms` kept only as its
    /// tombstone: past the TTL, within the tombstone period (the table keeps it until then).
    pub fn only_tombstone_at(
        &self,
        recorded: &RecordedResponse,
        recorded_at_ms: u64,
        now_ms: u64,
    ) -> bool {
        self.tombstone_ms_for(recorded) > 0 && now_ms >= recorded_at_ms.saturating_add(self.ttl_ms)
    }

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
            // An HTTP lookup's answer cannot become a call's record: such a call's unknown
            // outcome stays unknown (a gRPC rule resolves with a call).
            resolve: None,
            ..self.clone()
        })
    }
}

#[cfg(test)]
mod tests;

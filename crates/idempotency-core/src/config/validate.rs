//! From what users wrote (`raw`) to the model the filter runs on (`mod.rs`): every bound
//! checked, every combination that could not work refused, each refusal naming its field.

use super::lookup_route as lookup_settings;
use super::raw::*;
use super::*;
use crate::resolve::settings::{self as resolve_settings, RuleFacts};
use idempotency_protocol::naming::rule::{
    invalid, valid_header_name, validate_key, validate_name, validate_scope, validate_source,
};

/// The validated configuration, or the first field refused and why.
pub(super) fn config(raw: RawConfig) -> Result<Config, ConfigError> {
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

const MAX_STORE_TIMEOUT_MS: u64 = 60_000;

fn validate_store(at: &str, raw: RawStore) -> Result<StoreConfig, ConfigError> {
    if raw.cluster.trim().is_empty() {
        return Err(invalid(
            format!("{at}.cluster"),
            "must name an Envoy cluster",
        ));
    }
    if let Some(address) = &raw.address {
        if !is_host_port(address) {
            return Err(invalid(
                format!("{at}.address"),
                "must be host:port (a name or IP, then a port from 1 to 65535; [v6]:port)",
            ));
        }
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
        address: raw.address,
        authority: raw.authority,
        timeout_ms: raw.timeout_ms,
        token: raw.token,
        path_prefix: raw.path_prefix,
        transport: raw.transport,
    })
}

/// `host:port`, `[v6]:port`: what a resolver takes, with a port that can be dialled.
fn is_host_port(address: &str) -> bool {
    let Some((host, port)) = address.rsplit_once(':') else {
        return false;
    };
    let port_ok = port.parse::<u16>().is_ok_and(|p| p != 0);
    let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => {
            !host.is_empty()
                && host
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_')
        }
    };
    port_ok && host_ok
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
    if raw.tombstone_seconds > MAX_TTL_SECONDS {
        return Err(invalid(
            at("tombstone_seconds"),
            format!("must be between 0 and {MAX_TTL_SECONDS}"),
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
    let never_ran_header = raw.never_ran_header.map(|h| h.to_ascii_lowercase());
    if let Some(name) = &never_ran_header {
        // Headers proxies set on every answer, their own included, would mark a proxy's.
        let set_by_proxies = ["date", "server", "via", "content-type", "content-length"]
            .contains(&name.as_str())
            || name.starts_with("x-envoy-")
            || name.starts_with("l5d-");
        if !valid_header_name(name)
            || name.starts_with(':')
            || name.starts_with("grpc-")
            || set_by_proxies
        {
            return Err(invalid(
                at("never_ran_header"),
                "must be a header of the service's own (not a pseudo-header, grpc-*, or one \
                 proxies set: date, server, via, content-*, x-envoy-*, l5d-*)",
            ));
        }
    }
    let replay_headers = HeaderFilter::new(&raw.replay_skip_headers)
        .map_err(|reason| invalid(at("replay_skip_headers"), reason))?;
    let store = match raw.store {
        Some(s) => Some(validate_store(&at("store"), s)?),
        None => global_store.cloned(),
    };
    let ttl_ms = raw.ttl_seconds.saturating_mul(1000);
    let tombstone_ms = raw.tombstone_seconds.saturating_mul(1000);
    let lease_ms = raw.lease_seconds.saturating_mul(1000);
    if store.is_some() {
        if tombstone_ms > STORE_MAX_TTL_MS {
            return Err(invalid(
                at("tombstone_seconds"),
                format!(
                    "must be at most {} with a store: the store refuses longer tombstones",
                    STORE_MAX_TTL_MS / 1000
                ),
            ));
        }
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
        ttl_ms,
    )?;
    let resolve = match raw.resolve {
        None => None,
        Some(raw_resolve) => {
            let key_metadata: Vec<String> = key_sources
                .iter()
                .filter_map(|source| match source {
                    FieldSource::Header(name) if grpc.is_some() => Some(name.clone()),
                    _ => None,
                })
                .collect();
            let facts = RuleFacts {
                key_sources: key_sources.len(),
                key_metadata: &key_metadata,
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
        tombstone_ms,
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
        on_gateway_error: raw.on_gateway_error,
        never_ran_header,
        detached,
        grpc,
        resolve,
        lookup_route,
    })
}

/// What of a rule a gRPC call cannot honour, as (field, why); None when it can be a gRPC rule.
pub(super) fn grpc_conflict(
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

/// The upstream of a detached rule; its settings are refused on an inline one, where they
/// would silently do nothing.
fn validate_execution(
    at: &dyn Fn(&str) -> String,
    mode: ExecutionMode,
    cluster: Option<String>,
    timeout_ms: Option<u64>,
    store: Option<&StoreConfig>,
    ttl_ms: u64,
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
    if timeout_ms >= ttl_ms {
        // The record would expire while the write may still run: a retry then runs it again.
        return Err(invalid(
            at("upstream_timeout_ms"),
            format!(
                "{timeout_ms} must be shorter than ttl_seconds ({} s): a write still running \
                 when its record expires would run again on the next retry",
                ttl_ms / 1000
            ),
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

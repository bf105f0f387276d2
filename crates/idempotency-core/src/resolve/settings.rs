//! A rule's `resolve` settings: how to look a write up at the service, what its answers mean,
//! and when and how often to ask. Validated here (the configuration calls in with the rule's
//! facts) so that a lookup that could never settle a key is refused when Envoy loads it.

use serde::Deserialize;

use super::template::PathTemplate;

/// As users write it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawResolve {
    /// The Envoy cluster of the service; absent: the cluster the request's route chose.
    #[serde(default)]
    cluster: Option<String>,
    /// Absent: GET, or for a gRPC rule POST (a unary call).
    #[serde(default)]
    method: Option<String>,
    path: String,
    /// Absent: the original request's `:authority`.
    #[serde(default)]
    authority: Option<String>,
    /// Request headers sent along with the lookup, beyond the rule's scope headers.
    #[serde(default)]
    headers: Vec<String>,
    /// Absent: 200. Not for gRPC rules, whose lookup's call status decides.
    #[serde(default)]
    took_effect_statuses: Option<Vec<u16>>,
    /// Absent: 404. Not for gRPC rules.
    #[serde(default)]
    never_ran_statuses: Option<Vec<u16>>,
    /// Replay a write that took effect with this status instead of the lookup's own.
    #[serde(default)]
    record_status: Option<u16>,
    settle_seconds: u64,
    #[serde(default = "default_timeout_ms")]
    timeout_ms: u64,
    #[serde(default = "default_max_attempts")]
    max_attempts: u32,
    #[serde(default = "default_backoff_seconds")]
    backoff_seconds: u64,
}

fn default_took_effect() -> Vec<u16> {
    vec![200]
}
fn default_never_ran() -> Vec<u16> {
    vec![404]
}
fn default_timeout_ms() -> u64 {
    2_000
}
fn default_max_attempts() -> u32 {
    8
}
fn default_backoff_seconds() -> u64 {
    2
}

/// The longest a lookup may take; a lookup is a read.
pub const MAX_TIMEOUT_MS: u64 = 60_000;
/// Attempts at most: with the backoff doubling, more would outlast any record.
pub const MAX_ATTEMPTS: u32 = 20;
/// The backoff doubles after each failed lookup, up to this.
pub const MAX_BACKOFF_MS: u64 = 300_000;
/// See `Resolve::adopt_after_ms`.
pub const ADOPT_SLACK_MS: u64 = 5_000;

/// Validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolve {
    pub cluster: Option<String>,
    pub method: String,
    pub path: PathTemplate,
    pub authority: Option<String>,
    /// Lower case: the headers a lookup carries from the request (scope headers included).
    pub forwarded_headers: Vec<String>,
    pub took_effect: Vec<u16>,
    pub never_ran: Vec<u16>,
    pub record_status: Option<u16>,
    pub settle_ms: u64,
    pub timeout_ms: u64,
    pub max_attempts: u32,
    pub backoff_ms: u64,
    /// A gRPC rule's lookup: a unary call of the method `path` names, with an empty request
    /// message and the key in the rule's key metadata. Its status decides: `OK` took effect
    /// (its message and trailers become the call's record), `NOT_FOUND` never ran.
    pub grpc: bool,
    /// A gRPC rule's key metadata, in the order of its key sources: the lookup carries each
    /// as the request sent it, and a `NOT_FOUND` counts only when the answer echoes them.
    pub key_metadata: Vec<String>,
    /// The store's cluster: a lookup never goes there, whatever the route chose.
    pub store_cluster: Option<String>,
}

/// The empty request message a gRPC lookup sends: an uncompressed frame of length 0.
pub const EMPTY_GRPC_MESSAGE: [u8; 5] = [0; 5];

/// What the lookup's status says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    TookEffect,
    NeverRan,
    /// Neither (an error, a timeout, a status the rule does not list): ask again later.
    Unsettled,
}

impl Resolve {
    pub fn verdict(&self, status: u16) -> Verdict {
        if self.took_effect.contains(&status) {
            Verdict::TookEffect
        } else if self.never_ran.contains(&status) {
            Verdict::NeverRan
        } else {
            Verdict::Unsettled
        }
    }

    /// How long past its due time a resolution still unsettled in the store is taken on by
    /// another proxy: the first lookup's timeout and some slack (a tick, the settle's way to
    /// the store) beyond it.
    pub fn adopt_after_ms(&self) -> u64 {
        self.timeout_ms.saturating_add(ADOPT_SLACK_MS)
    }

    /// How long after the `attempt`-th failed lookup (from 1) the next one goes.
    pub fn backoff_after(&self, attempt: u32) -> u64 {
        let doublings = attempt.saturating_sub(1).min(20);
        self.backoff_ms
            .saturating_mul(1u64 << doublings)
            .min(MAX_BACKOFF_MS)
    }
}

/// The rule facts a lookup depends on.
pub struct RuleFacts<'a> {
    pub key_sources: usize,
    pub scope_headers: &'a [String],
    pub ttl_ms: u64,
    /// `on_unknown_outcome: "release"`: nothing is ever left to resolve.
    pub releases_unknown: bool,
    pub is_grpc: bool,
    /// A gRPC rule's key metadata names, which its lookup carries.
    pub key_metadata: &'a [String],
    /// The store's cluster, which a lookup must not be sent to.
    pub store_cluster: Option<&'a str>,
}

/// Validates `raw` for a rule; Err is (the field under `resolve`, why).
pub fn validate(raw: RawResolve, rule: &RuleFacts<'_>) -> Result<Resolve, (String, String)> {
    let err = |field: &str, why: String| Err((field.to_string(), why));
    if rule.releases_unknown {
        return err(
            "",
            "a rule with on_unknown_outcome: \"release\" frees every unknown outcome: there is \
             nothing to resolve"
                .to_string(),
        );
    }
    let method = match (&raw.method, rule.is_grpc) {
        (None, false) => "GET".to_string(),
        (None, true) => "POST".to_string(),
        (Some(m), _) => m.to_ascii_uppercase(),
    };
    if rule.is_grpc && method != "POST" {
        return err("method", "a gRPC lookup is a call: POST".to_string());
    }
    if !["GET", "HEAD", "POST"].contains(&method.as_str()) {
        return err(
            "method",
            "must be GET, HEAD or POST (a lookup reads; it never writes)".to_string(),
        );
    }
    let path = if rule.is_grpc {
        PathTemplate::grpc_method(&raw.path)
    } else {
        PathTemplate::parse(&raw.path, rule.key_sources)
    }
    .map_err(|why| ("path".to_string(), why))?;
    if rule.is_grpc {
        for (field, given) in [
            ("took_effect_statuses", raw.took_effect_statuses.is_some()),
            ("never_ran_statuses", raw.never_ran_statuses.is_some()),
            ("record_status", raw.record_status.is_some()),
        ] {
            if given {
                return err(
                    field,
                    "not for a gRPC rule: its lookup's call status decides (OK took effect, \
                     NOT_FOUND never ran)"
                        .to_string(),
                );
            }
        }
    }
    let took_effect = raw.took_effect_statuses.unwrap_or_else(default_took_effect);
    let never_ran = raw.never_ran_statuses.unwrap_or_else(default_never_ran);
    // What names the write at the service must be what names its record here (the key and
    // the scope headers, hashed whole into the storage key): then every request that meets
    // the record, a retry through another replica taking the resolution on included, makes
    // the same lookup as the first. A value outside them could differ on a retry and ask
    // about another write, whose "not found" would free this one's key.
    if let Some(name) = path
        .headers()
        .find(|h| !rule.scope_headers.iter().any(|s| s == h))
    {
        return err(
            "path",
            format!(
                "{{header.{name}}}: '{name}' is not one of the rule's scope_headers, so a retry \
                 of the same key may carry another value and look up another write; add it \
                 to scope_headers (the key is then per {name} as well), or name the write \
                 with {{key}}"
            ),
        );
    }
    if raw.authority.is_none() && !rule.scope_headers.iter().any(|s| s == ":authority") {
        return err(
            "authority",
            "required when ':authority' is not one of the rule's scope_headers: the lookup's \
             would otherwise be a retry's, which may name another host"
                .to_string(),
        );
    }
    if let Some(cluster) = &raw.cluster {
        if cluster.is_empty() || cluster.bytes().any(|b| !b.is_ascii_graphic()) {
            return err(
                "cluster",
                "must name an Envoy cluster (omit it to ask the route's cluster)".to_string(),
            );
        }
        if rule.store_cluster == Some(cluster.as_str()) {
            return err("cluster", format!("'{cluster}' is the store's cluster"));
        }
    }
    if let Some(authority) = &raw.authority {
        if authority.is_empty() || authority.bytes().any(|b| !b.is_ascii_graphic()) {
            return err("authority", "must be a host name".to_string());
        }
    }
    let mut forwarded_headers: Vec<String> = Vec::new();
    let named = rule
        .scope_headers
        .iter()
        .map(String::as_str)
        .chain(raw.headers.iter().map(String::as_str))
        .chain(path.headers())
        .chain(rule.key_metadata.iter().map(String::as_str));
    for name in named {
        let lower = name.to_ascii_lowercase();
        if lower.starts_with(':') {
            continue; // the lookup has its own pseudo-headers
        }
        if HOP_BY_HOP.contains(&lower.as_str()) || lower.is_empty() {
            return err("headers", format!("'{name}' cannot be sent along"));
        }
        if !forwarded_headers.contains(&lower) {
            forwarded_headers.push(lower);
        }
    }
    for (field, statuses) in [
        ("took_effect_statuses", &took_effect),
        ("never_ran_statuses", &never_ran),
    ] {
        if statuses.is_empty() || statuses.iter().any(|s| !(100..=599).contains(s)) {
            return err(field, "must list HTTP statuses (100 to 599)".to_string());
        }
    }
    if let Some(both) = took_effect.iter().find(|s| never_ran.contains(s)) {
        return err(
            "never_ran_statuses",
            format!("{both} is also in took_effect_statuses"),
        );
    }
    if let Some(status) = raw.record_status {
        if !(200..=599).contains(&status) {
            return err(
                "record_status",
                "must be an HTTP status (200 to 599)".to_string(),
            );
        }
    }
    let settle_ms = raw.settle_seconds.saturating_mul(1000);
    if settle_ms == 0 || settle_ms >= rule.ttl_ms {
        return err(
            "settle_seconds",
            "must be at least 1 and less than ttl_seconds: the service's own time limit for a \
             write, after which a lookup's \"not found\" proves it never ran"
                .to_string(),
        );
    }
    if raw.timeout_ms == 0 || raw.timeout_ms > MAX_TIMEOUT_MS {
        return err(
            "timeout_ms",
            format!("must be between 1 and {MAX_TIMEOUT_MS}"),
        );
    }
    if raw.max_attempts == 0 || raw.max_attempts > MAX_ATTEMPTS {
        return err(
            "max_attempts",
            format!("must be between 1 and {MAX_ATTEMPTS}"),
        );
    }
    let backoff_ms = raw.backoff_seconds.saturating_mul(1000);
    if backoff_ms == 0 || backoff_ms > MAX_BACKOFF_MS {
        return err(
            "backoff_seconds",
            format!("must be between 1 and {}", MAX_BACKOFF_MS / 1000),
        );
    }
    Ok(Resolve {
        cluster: raw.cluster,
        method,
        path,
        authority: raw.authority,
        forwarded_headers,
        took_effect,
        never_ran,
        record_status: raw.record_status,
        settle_ms,
        timeout_ms: raw.timeout_ms,
        max_attempts: raw.max_attempts,
        backoff_ms,
        grpc: rule.is_grpc,
        key_metadata: rule.key_metadata.to_vec(),
        store_cluster: rule.store_cluster.map(str::to_string),
    })
}

/// Connection-specific headers: never sent along.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "upgrade",
    "content-length",
    "host",
    "proxy-connection",
];

#[cfg(test)]
mod tests {
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    use super::*;

    fn facts(scope_headers: &[String]) -> RuleFacts<'_> {
        RuleFacts {
            key_sources: 1,
            scope_headers,
            ttl_ms: 86_400_000,
            releases_unknown: false,
            is_grpc: false,
            key_metadata: &[],
            store_cluster: None,
        }
    }

    fn parse(json: &str) -> Result<Resolve, (String, String)> {
        let raw: RawResolve =
            serde_json::from_str(json).map_err(|e| (String::new(), e.to_string()))?;
        let scope = vec![":authority".to_string()];
        validate(raw, &facts(&scope))
    }

    #[test]
    fn defaults_ask_with_get_and_read_200_and_404() {
        let r = parse(r#"{"path":"/p/{key}","settle_seconds":30}"#).unwrap();
        assert_eq!(r.method, "GET");
        assert_eq!(r.verdict(200), Verdict::TookEffect);
        assert_eq!(r.verdict(404), Verdict::NeverRan);
        assert_eq!(r.verdict(503), Verdict::Unsettled);
        assert_eq!(
            (r.settle_ms, r.timeout_ms, r.max_attempts),
            (30_000, 2_000, 8)
        );
        assert_eq!(
            (1..=4).map(|a| r.backoff_after(a)).collect::<Vec<_>>(),
            vec![2_000, 4_000, 8_000, 16_000]
        );
        assert_eq!(r.backoff_after(20), MAX_BACKOFF_MS);
    }

    #[test]
    fn a_lookup_that_could_not_settle_a_key_is_refused() {
        for (json, field) in [
            (r#"{"path":"/p/{key}"}"#, ""),
            (
                r#"{"path":"/p/{key}","settle_seconds":0}"#,
                "settle_seconds",
            ),
            (
                r#"{"path":"/p/{key}","settle_seconds":86400}"#,
                "settle_seconds",
            ),
            (r#"{"path":"/p","settle_seconds":5}"#, "path"),
            (
                r#"{"path":"/p/{key}","settle_seconds":5,"method":"DELETE"}"#,
                "method",
            ),
            (
                r#"{"path":"/p/{key}","settle_seconds":5,"took_effect_statuses":[200],"never_ran_statuses":[200]}"#,
                "never_ran_statuses",
            ),
            (
                r#"{"path":"/p/{key}","settle_seconds":5,"timeout_ms":0}"#,
                "timeout_ms",
            ),
            (
                r#"{"path":"/p/{key}","settle_seconds":5,"max_attempts":0}"#,
                "max_attempts",
            ),
            (
                r#"{"path":"/p/{key}","settle_seconds":5,"headers":["connection"]}"#,
                "headers",
            ),
        ] {
            let (at, why) = parse(json).unwrap_err();
            assert_eq!(at, field, "{json}: {why}");
        }
        let raw: RawResolve =
            serde_json::from_str(r#"{"path":"/p/{key}","settle_seconds":5}"#).unwrap();
        let releases = RuleFacts {
            releases_unknown: true,
            ..facts(&[])
        };
        assert!(validate(raw, &releases)
            .unwrap_err()
            .1
            .contains("nothing to resolve"));
    }

    #[test]
    fn scope_headers_go_along_so_the_service_authorises_the_caller() {
        let raw: RawResolve = serde_json::from_str(
            r#"{"path":"/p/{key}?t={header.x-tenant}","settle_seconds":5,"headers":["X-Request-Id"]}"#,
        )
        .unwrap();
        let scope = vec![
            ":authority".to_string(),
            "authorization".to_string(),
            "x-tenant".to_string(),
        ];
        assert_eq!(
            validate(raw, &facts(&scope)).unwrap().forwarded_headers,
            vec!["authorization", "x-tenant", "x-request-id"]
        );
    }

    #[test]
    fn only_the_key_and_its_scope_choose_which_write_is_looked_up() {
        // A retry of the same key could carry another x-tenant; a replica taking the
        // resolution on would then ask about another tenant's write.
        let scope = vec![":authority".to_string(), "authorization".to_string()];
        let raw: RawResolve =
            serde_json::from_str(r#"{"path":"/t/{header.X-Tenant}/p/{key}","settle_seconds":5}"#)
                .unwrap();
        let (at, why) = validate(raw, &facts(&scope)).unwrap_err();
        assert_eq!(at, "path");
        assert!(
            why.contains("'x-tenant' is not one of the rule's scope_headers"),
            "{why}"
        );
        // Nor may the lookup's host be a retry's when the host is not part of the scope.
        let by_subject = vec!["x-verified-subject".to_string()];
        let raw: RawResolve =
            serde_json::from_str(r#"{"path":"/p/{key}","settle_seconds":5}"#).unwrap();
        let (at, why) = validate(raw, &facts(&by_subject)).unwrap_err();
        assert_eq!(at, "authority");
        assert!(
            why.contains("':authority' is not one of the rule's scope_headers"),
            "{why}"
        );
        let raw: RawResolve = serde_json::from_str(
            r#"{"path":"/p/{key}","settle_seconds":5,"authority":"payments.internal"}"#,
        )
        .unwrap();
        assert!(validate(raw, &facts(&by_subject)).is_ok());
    }
}

//! Which record the operator means: a hash from the access log, or the request itself (rule,
//! scope headers, key), hashed into the storage key by the functions the filter names its
//! records with (`idempotency-protocol`'s `naming`), exactly as the filter does on a request
//! (`journey/intake.rs`).

use std::path::Path;

use idempotency_protocol::naming::fields::RequestBody;
use idempotency_protocol::naming::rule::{rule_namings, RuleNaming as Rule};
use idempotency_protocol::naming::source::{
    complete_key, header_parts, FieldSource, SourceFailure,
};
use idempotency_protocol::naming::{request_scope, storage_key};

use crate::storage::{Digest, KeyPrefix};

/// A record, named exactly or by the start of its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Named {
    Key(Digest),
    Prefix(KeyPrefix),
}

/// The fewest hex digits `--hash` takes: the access log's `idempotency_key_hash`.
pub const MIN_HASH_HEX: usize = 16;

/// `--hash`: 64 hex digits name the key, 16 to 63 its start.
pub fn parse_hash(raw: &str) -> Result<Named, String> {
    let raw = raw.trim();
    if raw.len() < MIN_HASH_HEX || raw.len() > Digest::HEX_LEN {
        return Err(format!(
            "--hash takes {MIN_HASH_HEX} to 64 hex digits (the access log's idempotency_key_hash \
             has 16), got {}",
            raw.len()
        ));
    }
    if raw.len() == Digest::HEX_LEN {
        Digest::parse(raw).map(Named::Key)
    } else {
        KeyPrefix::parse(raw).map(Named::Prefix)
    }
    .map_err(|why| format!("--hash {why}"))
}

/// What the request carried that the storage key is made of. Header names are lower-case
/// (as Envoy gives them to the filter); a repeated header keeps its values in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestParts {
    pub headers: Vec<(String, Vec<u8>)>,
    /// `:path` with its query, for rules whose key comes from a query parameter.
    pub path: String,
    /// The request body, for rules whose key comes from body fields.
    pub body: Vec<u8>,
}

/// Reads `-H 'name: value'`. The value is trimmed as an HTTP parser trims it. `host` is
/// taken as `:authority`, which is what Envoy makes of an HTTP/1.1 Host header.
pub fn parse_header(raw: &str) -> Result<(String, Vec<u8>), String> {
    // A pseudo-header's own leading colon is part of its name.
    let split_at = raw
        .char_indices()
        .skip(1)
        .find(|&(_, c)| c == ':')
        .map(|(i, _)| i);
    let Some(at) = split_at else {
        return Err(format!(
            "-H {raw:?}: expected 'name: value' (for the caller's host, ':authority: api.example.com')"
        ));
    };
    let (name, value) = raw.split_at(at);
    let name = name.trim().to_ascii_lowercase();
    let value = value.get(1..).unwrap_or("").trim_matches([' ', '\t']);
    if name.is_empty()
        || name
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    {
        return Err(format!("-H {raw:?}: {name:?} is not a header name"));
    }
    let name = if name == "host" {
        ":authority".to_owned()
    } else {
        name
    };
    Ok((name, value.as_bytes().to_vec()))
}

/// The rule named `name` in the plugin configuration at `path`, or, without a file, a rule
/// of that name with every default the filter applies (scope `:authority` and
/// `authorization`, key from the `Idempotency-Key` header): the filter's own defaults
/// (`idempotency_protocol::naming::rule`, which its configuration validates with), not a copy.
pub fn load_rule(path: Option<&Path>, name: &str) -> Result<Rule, String> {
    let config = match path {
        Some(path) => {
            let bytes = std::fs::read(path)
                .map_err(|e| format!("cannot read --plugin-config {}: {e}", path.display()))?;
            rule_namings(&bytes).map_err(|e| {
                format!(
                    "--plugin-config {}: {e} (the file is the filter's JSON configuration, \
                     the `configuration` value of the Wasm filter in the Envoy config)",
                    path.display()
                )
            })?
        }
        None => {
            let minimal = serde_json::json!({ "rules": [{ "name": name }] });
            rule_namings(minimal.to_string().as_bytes()).map_err(|e| format!("--rule: {e}"))?
        }
    };
    let names: Vec<&str> = config.iter().map(|r| r.name.as_str()).collect();
    config
        .iter()
        .find(|r| r.name == name)
        .cloned()
        .ok_or_else(|| {
            format!(
                "no rule named {name:?} in the plugin configuration (its rules: {})",
                names.join(", ")
            )
        })
}

/// Adds `--key` as the value of the rule's key header. Only a rule whose key is one header
/// has "the" key; for `key.sources` the operator gives each source as the request had it.
pub fn add_key(rule: &Rule, parts: &mut RequestParts, key: &str) -> Result<(), String> {
    let [FieldSource::Header(header)] = rule.key_sources.as_slice() else {
        let sources: Vec<String> = rule.key_sources.iter().map(FieldSource::describe).collect();
        return Err(format!(
            "rule {:?} takes its key from key.sources ({}), not from one header: give each as \
             the request carried it (headers with -H, query parameters with --path, body \
             fields with --body-file), or name the record with --hash from the access log",
            rule.name,
            sources.join(", ")
        ));
    };
    if parts.headers.iter().any(|(n, _)| n == header) {
        return Err(format!(
            "the key is given twice: --key and -H '{header}: ...'; keep one"
        ));
    }
    parts
        .headers
        .push((header.clone(), key.as_bytes().to_vec()));
    Ok(())
}

fn key_failure(rule: &Rule, failure: &SourceFailure) -> String {
    let effect = if rule.key_required {
        "the filter answers such a request 400 and records nothing"
    } else {
        "the filter lets such a request pass unprotected and records nothing"
    };
    format!(
        "rule {:?}: the key's {} cannot be read: {} ({effect})",
        rule.name,
        failure.source(),
        failure.why()
    )
}

/// The storage key the filter computes for a request with these parts under `rule`: the
/// same calls, in the same order, as `journey/intake.rs`.
pub fn storage_key_for(rule: &Rule, parts: &RequestParts) -> Result<Digest, String> {
    let first = |name: &str| {
        parts
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    };
    let key_parts =
        header_parts(&rule.key_sources, first, &parts.path).map_err(|f| key_failure(rule, &f))?;
    let all_values = |name: &str| {
        parts
            .headers
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
            .collect()
    };
    let scope =
        request_scope(&rule.scope_headers, rule.scope_required, all_values).map_err(|header| {
            format!(
                "rule {:?} requires the scope header {header:?} (scope_required): the filter \
                 answers a request without it 401 and records nothing; give it with -H",
                rule.name
            )
        })?;
    let content_type = first("content-type")
        .and_then(|v| std::str::from_utf8(v).ok())
        .unwrap_or("");
    let mut body = RequestBody::new(content_type, &parts.body);
    let key =
        complete_key(&rule.key_sources, key_parts, &mut body).map_err(|f| key_failure(rule, &f))?;
    let scope: Vec<Option<&[u8]>> = scope.iter().map(|v| v.as_deref()).collect();
    Ok(Digest::from(&storage_key(&rule.name, &scope, &key)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use idempotency_protocol::naming::{scope_value, to_hex};

    /// The parts `-H 'name: value'` arguments give.
    fn parts(headers: &[(&str, &str)]) -> RequestParts {
        RequestParts {
            headers: headers
                .iter()
                .map(|(n, v)| parse_header(&format!("{n}: {v}")).unwrap())
                .collect(),
            ..RequestParts::default()
        }
    }

    /// What the filter computes for a request: `journey/intake.rs`'s calls, written out
    /// here on their own (the first value of the key header, every value of each scope
    /// header) so that the command cannot drift from them unnoticed.
    fn as_the_filter_computes(rule: &Rule, request: &[(&str, &[u8])]) -> String {
        let first = |name: &str| request.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
        let key_parts = header_parts(&rule.key_sources, first, "/orders/1").unwrap();
        let all = |name: &str| {
            request
                .iter()
                .filter(|(n, _)| *n == name)
                .map(|(_, v)| *v)
                .collect()
        };
        let scope = request_scope(&rule.scope_headers, rule.scope_required, all).unwrap();
        let mut body = RequestBody::new("", b"");
        let key = complete_key(&rule.key_sources, key_parts, &mut body).unwrap();
        let scope: Vec<Option<&[u8]>> = scope.iter().map(|v| v.as_deref()).collect();
        to_hex(&storage_key(&rule.name, &scope, &key))
    }

    #[test]
    fn rule_headers_and_key_give_the_filters_storage_key() {
        let rule = load_rule(None, "orders").unwrap();
        assert_eq!(rule.scope_headers, vec![":authority", "authorization"]);
        let mut named = parts(&[("host", "api"), ("authorization", "Bearer a")]);
        add_key(&rule, &mut named, "k1").unwrap();
        let digest = storage_key_for(&rule, &named).unwrap();
        // Pinned in core (key/mod.rs): the storage key of every release so far.
        assert_eq!(
            digest.as_str(),
            "a6df2d0df2d2a81489c8dcb9622e05d28bf3c78be8881699b2f4ce2c55d74d43"
        );
        let request: &[(&str, &[u8])] = &[
            (":authority", b"api"),
            ("authorization", b"Bearer a"),
            ("idempotency-key", b"\"k1\""),
        ];
        assert_eq!(digest.as_str(), as_the_filter_computes(&rule, request));
        // The quoted and the bare key are one key, as for the filter.
        let mut quoted = parts(&[(":authority", "api"), ("authorization", "Bearer a")]);
        add_key(&rule, &mut quoted, "\"k1\"").unwrap();
        assert_eq!(storage_key_for(&rule, &quoted).unwrap(), digest);
    }

    #[test]
    fn absent_and_repeated_scope_headers_count_as_for_the_filter() {
        let rule = load_rule(None, "orders").unwrap();
        // No Authorization header: absent, not empty.
        let mut anonymous = parts(&[(":authority", "api")]);
        add_key(&rule, &mut anonymous, "k").unwrap();
        let request: &[(&str, &[u8])] = &[(":authority", b"api"), ("idempotency-key", b"k")];
        assert_eq!(
            storage_key_for(&rule, &anonymous).unwrap().as_str(),
            as_the_filter_computes(&rule, request)
        );
        let mut empty = parts(&[(":authority", "api"), ("authorization", "")]);
        add_key(&rule, &mut empty, "k").unwrap();
        assert_ne!(
            storage_key_for(&rule, &empty).unwrap(),
            storage_key_for(&rule, &anonymous).unwrap()
        );
        // Two values of one header, in order.
        let mut twice = parts(&[
            (":authority", "api"),
            ("authorization", "Bearer a"),
            ("authorization", "Bearer b"),
        ]);
        add_key(&rule, &mut twice, "k").unwrap();
        let request: &[(&str, &[u8])] = &[
            (":authority", b"api"),
            ("authorization", b"Bearer a"),
            ("authorization", b"Bearer b"),
            ("idempotency-key", b"k"),
        ];
        let twice_digest = storage_key_for(&rule, &twice).unwrap();
        assert_eq!(
            twice_digest.as_str(),
            as_the_filter_computes(&rule, request)
        );
        let both = scope_value(&[b"Bearer a", b"Bearer b"]);
        let expected = storage_key("orders", &[Some(b"api"), both.as_deref()], b"k");
        assert_eq!(twice_digest.as_str(), to_hex(&expected));
    }

    #[test]
    fn a_plugin_configuration_gives_the_rules_own_scope_and_key_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plugin.json");
        std::fs::write(
            &path,
            br#"{"rules":[{"name":"payments","scope_headers":["x-tenant"],
                "key":{"header":"x-request-id"}},
                {"name":"hooks","key":{"sources":[{"header":"ce-id"},{"query":"order"}]}}]}"#,
        )
        .unwrap();
        let rule = load_rule(Some(&path), "payments").unwrap();
        let mut named = parts(&[("x-tenant", "t1"), ("authorization", "ignored")]);
        add_key(&rule, &mut named, "r-1").unwrap();
        let request: &[(&str, &[u8])] = &[
            ("x-tenant", b"t1"),
            ("authorization", b"ignored"),
            ("x-request-id", b"r-1"),
        ];
        assert_eq!(
            storage_key_for(&rule, &named).unwrap().as_str(),
            as_the_filter_computes(&rule, request)
        );
        let err = load_rule(Some(&path), "orders").unwrap_err();
        assert!(err.contains("payments, hooks"), "{err}");
        // A key from several sources: no single --key, but the sources themselves work.
        let hooks = load_rule(Some(&path), "hooks").unwrap();
        let err = add_key(&hooks, &mut parts(&[]), "x").unwrap_err();
        assert!(
            err.contains("key.sources") && err.contains("--hash"),
            "{err}"
        );
        let mut sourced = parts(&[(":authority", "api"), ("ce-id", "42")]);
        sourced.path = "/hooks?order=7".to_owned();
        let digest = storage_key_for(&hooks, &sourced).unwrap();
        let other = RequestParts {
            path: "/hooks?order=8".to_owned(),
            ..sourced.clone()
        };
        assert_ne!(storage_key_for(&hooks, &other).unwrap(), digest);
        let missing = RequestParts {
            path: "/hooks".to_owned(),
            ..sourced
        };
        let err = storage_key_for(&hooks, &missing).unwrap_err();
        assert!(err.contains("query parameter 'order'"), "{err}");
        let err = load_rule(Some(&dir.path().join("nope.json")), "x").unwrap_err();
        assert!(err.contains("cannot read"), "{err}");
        std::fs::write(&path, b"static_resources: {}").unwrap();
        let err = load_rule(Some(&path), "x").unwrap_err();
        assert!(err.contains("JSON configuration"), "{err}");
    }

    #[test]
    fn requests_the_filter_refuses_have_no_record() {
        let rule = load_rule(None, "orders").unwrap();
        let err = storage_key_for(&rule, &parts(&[(":authority", "api")])).unwrap_err();
        assert!(
            err.contains("header 'idempotency-key'") && err.contains("400"),
            "{err}"
        );
        let mut bad = parts(&[]);
        add_key(&rule, &mut bad, "two words").unwrap();
        assert!(storage_key_for(&rule, &bad)
            .unwrap_err()
            .contains("visible ASCII"));
        let mut twice = parts(&[("idempotency-key", "a")]);
        assert!(add_key(&rule, &mut twice, "a")
            .unwrap_err()
            .contains("twice"));
    }

    #[test]
    fn headers_read_like_curls() {
        assert_eq!(
            parse_header("Authorization:  Bearer a b ").unwrap(),
            ("authorization".to_owned(), b"Bearer a b".to_vec())
        );
        assert_eq!(
            parse_header(":authority: api.test:8080").unwrap(),
            (":authority".to_owned(), b"api.test:8080".to_vec())
        );
        assert_eq!(parse_header("Host: api").unwrap().0, ":authority");
        assert_eq!(parse_header("x-empty:").unwrap().1, b"");
        for bad in ["no-colon", ": value", "bad name: v", ":"] {
            assert!(parse_header(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_hash_is_a_key_or_the_start_of_one() {
        let full = "AB".repeat(32);
        assert_eq!(
            parse_hash(&full).unwrap(),
            Named::Key(Digest::parse(&full).unwrap())
        );
        assert_eq!(
            parse_hash("3f9c0a51d2e47b86").unwrap(),
            Named::Prefix(KeyPrefix::parse("3f9c0a51d2e47b86").unwrap())
        );
        for bad in [
            "3f9c0a51",
            "3f9c0a51d2e47b8",
            "3f9c0a51d2e47b8z",
            &"a".repeat(65),
        ] {
            assert!(parse_hash(bad).is_err(), "{bad}");
        }
    }
}

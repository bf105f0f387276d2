//! The plugin configuration (`idempotency_core::config::Config::parse`).

use arbitrary::{Result, Unstructured};
use idempotency_core::config::{
    Config, OverloadPolicy, Rule, StoreConfig, StoreErrorPolicy, StoreTransport,
    STORE_MAX_LEASE_MS, STORE_MAX_TTL_MS,
};
use idempotency_core::fingerprint::FingerprintMode;
use idempotency_core::table::layout::{Layout, MAX_SLOTS, MIN_INLINE_BYTES};
use idempotency_protocol::naming::source::FieldSource;
use serde_json::{json, Map, Value};

/// Any bytes, and configurations built from the input: parsing never panics, and a
/// configuration that parses is sound (its table layout names itself and reads back, its
/// rules are within every documented bound) and re-validates: rendered back to JSON from what
/// was validated, it parses to the same configuration.
pub fn plugin_config(data: &[u8]) {
    check(data);
    if let Ok(built) = build(&mut Unstructured::new(data)) {
        check(built.to_string().as_bytes());
    }
}

fn check(bytes: &[u8]) {
    let Ok(config) = Config::parse(bytes) else {
        return;
    };
    sound(&config);
    // The rendering takes the two settings whose validated form cannot be read back
    // (statuses that release, headers a replay skips) and the table budget from the input.
    let input: Value = if bytes.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        serde_json::from_slice(bytes).expect("a configuration that parses is JSON")
    };
    let rendered = render(&config, &input).to_string();
    let again = Config::parse(rendered.as_bytes())
        .unwrap_or_else(|e| panic!("{e}: rendered as {rendered}"));
    assert_eq!(again.rules, config.rules, "rendered as {rendered}");
    assert_eq!(again.table_layout, config.table_layout);
    assert_eq!(
        again.route_metadata_namespace,
        config.route_metadata_namespace
    );
}

fn sound(config: &Config) {
    let layout = &config.table_layout;
    assert_eq!(
        Layout::parse(&layout.tag()).as_ref(),
        Some(layout),
        "{layout:?}"
    );
    assert!(layout.buckets >= 1 && layout.slots() <= MAX_SLOTS.next_multiple_of(8));
    assert!(u64::from(layout.inline_bytes) >= MIN_INLINE_BYTES);
    for (i, rule) in config.rules.iter().enumerate() {
        assert!((1..=64).contains(&rule.name.len()));
        assert!(rule
            .name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        assert!(
            config.rules[..i].iter().all(|r| r.name != rule.name),
            "unique names"
        );
        assert!(!rule.key_sources.is_empty());
        assert!(!rule.matcher.methods.is_empty());
        assert!(rule
            .matcher
            .methods
            .iter()
            .all(|m| !m.is_empty() && m.bytes().all(|b| b.is_ascii_uppercase())));
        assert!(rule.lease_ms >= 1000 && rule.lease_ms <= rule.ttl_ms);
        assert!(rule.max_request_bytes >= 1);
        if let FingerprintMode::Fields(fields) = &rule.fingerprint {
            assert!(!fields.is_empty() && fields.iter().all(FieldSource::in_body));
        }
        if rule.store.is_some() {
            assert!(rule.ttl_ms <= STORE_MAX_TTL_MS && rule.lease_ms <= STORE_MAX_LEASE_MS);
        }
        if rule.scope_required {
            assert!(rule.scope_headers.iter().any(|h| h != ":authority"));
        }
    }
}

fn source_json(source: &FieldSource) -> Value {
    match source {
        FieldSource::Header(h) => json!({ "header": h }),
        FieldSource::Query(q) => json!({ "query": q }),
        FieldSource::Json(p) => json!({ "json": p }),
        FieldSource::Form(f) => json!({ "form": f }),
    }
}

fn store_json(store: &StoreConfig) -> Value {
    json!({
        "cluster": store.cluster,
        "authority": store.authority,
        "timeout_ms": store.timeout_ms,
        "token": store.token,
        "path_prefix": store.path_prefix,
        "transport": match store.transport {
            StoreTransport::Grpc => "grpc",
            StoreTransport::Http => "http",
        },
    })
}

fn rule_json(rule: &Rule, input: Option<&Value>) -> Value {
    let mut out = json!({
        "name": rule.name,
        "match": {
            "route_names": rule.matcher.route_names,
            "path_prefixes": rule.matcher.path_prefixes,
            "hosts": rule.matcher.hosts,
            "virtual_hosts": rule.matcher.virtual_hosts,
            "methods": rule.matcher.methods,
        },
        "key": {
            "required": rule.key_required,
            "sources": rule.key_sources.iter().map(source_json).collect::<Vec<_>>(),
        },
        "fingerprint": match &rule.fingerprint {
            FingerprintMode::Body => json!("body"),
            FingerprintMode::None => json!("none"),
            FingerprintMode::Fields(fields) => {
                json!({ "fields": fields.iter().map(source_json).collect::<Vec<_>>() })
            }
        },
        "max_request_bytes": rule.max_request_bytes,
        "scope_headers": rule.scope_headers,
        "scope_required": rule.scope_required,
        "ttl_seconds": rule.ttl_ms / 1000,
        "lease_seconds": rule.lease_ms / 1000,
        "max_response_bytes": rule.max_response_bytes,
        "replay_header": rule.replay_header,
        "body_omitted_header": rule.body_omitted_header,
        "on_table_full": match rule.on_table_full {
            OverloadPolicy::Reject => "reject",
            OverloadPolicy::PassThrough => "pass_through",
        },
        "on_store_error": match rule.on_store_error {
            StoreErrorPolicy::FailClosed => "fail_closed",
            StoreErrorPolicy::FailOpen => "fail_open",
        },
    });
    if let Value::Object(fields) = &mut out {
        if let Some(store) = &rule.store {
            fields.insert("store".to_string(), store_json(store));
        }
        for carried in ["release_on_status", "replay_skip_headers"] {
            if let Some(v) = input.and_then(|rule| rule.get(carried)) {
                fields.insert(carried.to_string(), v.clone());
            }
        }
    }
    out
}

fn render(config: &Config, input: &Value) -> Value {
    let input_rules = input.get("rules").and_then(Value::as_array);
    let rules: Vec<Value> = config
        .rules
        .iter()
        .enumerate()
        .map(|(i, rule)| rule_json(rule, input_rules.and_then(|r| r.get(i))))
        .collect();
    let mut out = Map::new();
    if let Some(table) = input.get("local_table") {
        out.insert("local_table".to_string(), table.clone());
    }
    out.insert(
        "route_metadata_namespace".to_string(),
        json!(config.route_metadata_namespace),
    );
    out.insert("rules".to_string(), Value::Array(rules));
    Value::Object(out)
}

// ---- configurations built from the input: mostly valid, each field sometimes not ----

/// One of the `valid` values mostly; one time in 32 one of `invalid` or anything.
fn one_of(u: &mut Unstructured<'_>, valid: &[Value], invalid: &[Value]) -> Result<Value> {
    if !u.ratio(1, 32)? {
        return Ok(u.choose(valid)?.clone());
    }
    if !invalid.is_empty() && u.arbitrary()? {
        return Ok(u.choose(invalid)?.clone());
    }
    Ok(match u.int_in_range(0..=4)? {
        0 => Value::Null,
        1 => json!(u.arbitrary::<bool>()?),
        2 => json!(u.arbitrary::<u64>()?),
        3 => json!(u.arbitrary::<i32>()?),
        _ => json!(u.arbitrary::<String>()?),
    })
}

/// Sets `name` in `obj`, two times out of three.
fn maybe<'a>(
    u: &mut Unstructured<'a>,
    obj: &mut Map<String, Value>,
    name: &str,
    make: impl FnOnce(&mut Unstructured<'a>) -> Result<Value>,
) -> Result<()> {
    if u.ratio(2, 3)? {
        let value = make(u)?;
        obj.insert(name.to_string(), value);
    }
    Ok(())
}

fn list_of<'a>(
    u: &mut Unstructured<'a>,
    min: usize,
    max: usize,
    mut item: impl FnMut(&mut Unstructured<'a>) -> Result<Value>,
) -> Result<Value> {
    // Now and then shorter than allowed.
    let min = if u.ratio(1, 16)? { 0 } else { min };
    let n = u.int_in_range(min..=max)?;
    Ok(Value::Array(
        (0..n).map(|_| item(u)).collect::<Result<_>>()?,
    ))
}

fn header_name(u: &mut Unstructured<'_>) -> Result<Value> {
    one_of(
        u,
        &[
            json!("idempotency-key"),
            json!("X-Request-Id"),
            json!("x-tenant"),
            json!("authorization"),
        ],
        &[json!(":authority"), json!("bad header"), json!("")],
    )
}

fn scope_header(u: &mut Unstructured<'_>) -> Result<Value> {
    one_of(
        u,
        &[
            json!(":authority"),
            json!("Authorization"),
            json!("x-tenant"),
        ],
        &[json!("bad header"), json!(":")],
    )
}

/// A source of one kind (`kinds`), sometimes of none or of two.
fn source(u: &mut Unstructured<'_>, kinds: &[&str]) -> Result<Value> {
    let mut obj = Map::new();
    let n = if u.ratio(1, 16)? {
        *u.choose(&[0, 2])?
    } else {
        1
    };
    for _ in 0..n {
        let kind = *u.choose(kinds)?;
        let value = match kind {
            "header" => header_name(u)?,
            "json" => one_of(
                u,
                &[json!("/id"), json!(""), json!("/a/0/~1b")],
                &[json!("id")],
            )?,
            _ => one_of(u, &[json!("id"), json!("order_no")], &[json!("")])?,
        };
        obj.insert(kind.to_string(), value);
    }
    Ok(Value::Object(obj))
}

fn store(u: &mut Unstructured<'_>) -> Result<Value> {
    let mut s = Map::new();
    let cluster = one_of(
        u,
        &[json!("store"), json!("outbound|8081||s.ns.svc")],
        &[json!(" ")],
    )?;
    s.insert("cluster".to_string(), cluster);
    maybe(u, &mut s, "authority", |u| {
        one_of(u, &[json!("idempotency-store")], &[json!("a b"), json!("")])
    })?;
    maybe(u, &mut s, "timeout_ms", |u| {
        one_of(
            u,
            &[json!(250), json!(1), json!(60_000)],
            &[json!(0), json!(60_001)],
        )
    })?;
    maybe(u, &mut s, "token", |u| {
        one_of(
            u,
            &[json!("s3cret"), Value::Null],
            &[json!(""), json!("a b")],
        )
    })?;
    maybe(u, &mut s, "path_prefix", |u| {
        one_of(
            u,
            &[json!("/v1"), json!("/idem/v1")],
            &[json!("/"), json!("v1")],
        )
    })?;
    maybe(u, &mut s, "transport", |u| {
        one_of(u, &[json!("grpc"), json!("http")], &[json!("udp")])
    })?;
    Ok(Value::Object(s))
}

fn matcher(u: &mut Unstructured<'_>) -> Result<Value> {
    let mut m = Map::new();
    maybe(u, &mut m, "route_names", |u| {
        list_of(u, 0, 2, |u| one_of(u, &[json!("r1")], &[json!("")]))
    })?;
    maybe(u, &mut m, "path_prefixes", |u| {
        list_of(u, 0, 2, |u| {
            one_of(u, &[json!("/orders"), json!("/")], &[json!("x")])
        })
    })?;
    maybe(u, &mut m, "hosts", |u| {
        list_of(u, 0, 2, |u| {
            one_of(u, &[json!("API.example"), json!("a")], &[])
        })
    })?;
    maybe(u, &mut m, "virtual_hosts", |u| {
        list_of(u, 0, 1, |u| one_of(u, &[json!("vh")], &[]))
    })?;
    maybe(u, &mut m, "methods", |u| {
        list_of(u, 1, 3, |u| {
            one_of(
                u,
                &[json!("post"), json!("PUT"), json!("delete")],
                &[json!("GET1"), json!("")],
            )
        })
    })?;
    Ok(Value::Object(m))
}

fn key(u: &mut Unstructured<'_>) -> Result<Value> {
    let mut k = Map::new();
    maybe(u, &mut k, "required", |u| {
        one_of(u, &[json!(true), json!(false)], &[])
    })?;
    // One way to name the key, or neither (the default header), or rarely both (refused).
    let both = u.ratio(1, 32)?;
    if both || u.arbitrary()? {
        k.insert("header".to_string(), header_name(u)?);
    }
    if both || u.arbitrary()? {
        let all = ["header", "query", "json", "form"];
        let sources = list_of(u, 1, 3, |u| source(u, &all))?;
        k.insert("sources".to_string(), sources);
        if !both {
            k.remove("header");
        }
    }
    Ok(Value::Object(k))
}

fn rule(u: &mut Unstructured<'_>) -> Result<Value> {
    let mut r = Map::new();
    let name = one_of(
        u,
        &[
            json!("orders"),
            json!("payments"),
            json!("a-b_C9"),
            json!("webhooks"),
            json!("r1"),
            json!("r2"),
        ],
        &[json!(""), json!("bad name"), json!("x".repeat(65))],
    )?;
    r.insert("name".to_string(), name);
    maybe(u, &mut r, "match", matcher)?;
    maybe(u, &mut r, "key", key)?;
    maybe(u, &mut r, "fingerprint", |u| {
        if u.ratio(1, 2)? {
            one_of(u, &[json!("body"), json!("none")], &[json!("fields")])
        } else {
            // Body fields, now and then a header or query one (refused).
            let kinds: &[&str] = if u.ratio(1, 16)? {
                &["header", "query"]
            } else {
                &["json", "form"]
            };
            Ok(json!({ "fields": list_of(u, 1, 3, |u| source(u, kinds))? }))
        }
    })?;
    maybe(u, &mut r, "max_request_bytes", |u| {
        one_of(
            u,
            &[json!(1), json!(1_048_576)],
            &[json!(0), json!(67_108_865)],
        )
    })?;
    maybe(u, &mut r, "scope_headers", |u| {
        list_of(u, 0, 3, scope_header)
    })?;
    maybe(u, &mut r, "scope_required", |u| {
        one_of(u, &[json!(false), json!(false), json!(true)], &[])
    })?;
    maybe(u, &mut r, "ttl_seconds", |u| {
        one_of(
            u,
            &[json!(86_400), json!(3_600), json!(31_536_000)],
            &[json!(0), json!(31_622_401), json!(1)],
        )
    })?;
    maybe(u, &mut r, "lease_seconds", |u| {
        one_of(
            u,
            &[json!(60), json!(1), json!(3_600)],
            &[json!(0), json!(86_401)],
        )
    })?;
    maybe(u, &mut r, "max_response_bytes", |u| {
        one_of(
            u,
            &[json!(0), json!(1_048_576), json!(67_108_864)],
            &[json!(67_108_865)],
        )
    })?;
    maybe(u, &mut r, "release_on_status", |u| {
        list_of(u, 0, 3, |u| {
            one_of(
                u,
                &[json!("5xx"), json!(" 4XX "), json!("429")],
                &[json!("600"), json!("x"), json!("0xx")],
            )
        })
    })?;
    maybe(u, &mut r, "replay_header", header_name)?;
    maybe(u, &mut r, "body_omitted_header", header_name)?;
    maybe(u, &mut r, "replay_skip_headers", |u| {
        list_of(u, 0, 3, |u| {
            one_of(
                u,
                &[json!("x-envoy-*"), json!("Date")],
                &[json!("*"), json!(" ")],
            )
        })
    })?;
    maybe(u, &mut r, "on_table_full", |u| {
        one_of(
            u,
            &[json!("reject"), json!("pass_through")],
            &[json!("drop")],
        )
    })?;
    if u.ratio(1, 4)? {
        r.insert("store".to_string(), store(u)?);
    }
    maybe(u, &mut r, "on_store_error", |u| {
        one_of(
            u,
            &[json!("fail_closed"), json!("fail_open")],
            &[json!("retry")],
        )
    })?;
    Ok(Value::Object(r))
}

fn build(u: &mut Unstructured<'_>) -> Result<Value> {
    let mut c = Map::new();
    maybe(u, &mut c, "local_table", |u| {
        let mut t = Map::new();
        maybe(u, &mut t, "max_bytes", |u| {
            one_of(
                u,
                &[json!(1_048_576), json!(4_194_304), json!(67_108_864)],
                &[json!(1), json!(68_719_476_737_u64)],
            )
        })?;
        maybe(u, &mut t, "capacity", |u| {
            one_of(
                u,
                &[json!(8), json!(64), json!(1_000)],
                &[json!(0), json!(16_384), json!(4_000_001)],
            )
        })?;
        Ok(Value::Object(t))
    })?;
    maybe(u, &mut c, "route_metadata_namespace", |u| {
        one_of(u, &[Value::Null, json!("idempotency")], &[json!(" ")])
    })?;
    if u.ratio(1, 4)? {
        c.insert("store".to_string(), store(u)?);
    }
    let rules = list_of(u, 1, 3, rule)?;
    c.insert("rules".to_string(), rules);
    Ok(Value::Object(c))
}

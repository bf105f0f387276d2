use super::*;
#[cfg(target_arch = "wasm32")]
use wasm_bindgen_test::wasm_bindgen_test as test;

#[test]
fn empty_config_has_defaults_and_no_rules() {
    let c = Config::parse(b"").unwrap();
    assert_eq!(c.table_layout.slots(), 16_384);
    assert!(c.table_layout.bound_bytes() <= 64 * 1024 * 1024);
    assert!(c.rules.is_empty());
    assert_eq!(c.route_metadata_namespace.as_deref(), Some("idempotency"));
}

#[test]
fn the_table_budget_sets_the_slots_and_pages_fit_the_largest_response() {
    let c = Config::parse(
        br#"{"local_table":{"max_bytes":268435456},
             "rules":[{"name":"a"},{"name":"b","max_response_bytes":8388608}]}"#,
    )
    .unwrap();
    let layout = &c.table_layout;
    assert_eq!(layout.slots(), 65_536);
    assert!(layout.class_for(8 * 1024 * 1024).is_some(), "{layout:?}");
    let given = Config::parse(br#"{"local_table":{"capacity":64}}"#).unwrap();
    assert_eq!(given.table_layout.slots(), 64);
}

#[test]
fn a_capacity_set_without_a_budget_still_loads_with_a_budget_that_fits_it() {
    // Configurations written before local_table.max_bytes existed.
    let c = Config::parse(br#"{"local_table":{"capacity":65536}}"#).unwrap();
    let layout = &c.table_layout;
    assert_eq!(layout.slots(), 65_536);
    assert!(layout.inline_bytes >= 512, "{layout:?}");
    assert!(layout.bound_bytes() <= 65_536 * 3072, "{layout:?}");
    // Given together, the budget is the budget.
    let err =
        Config::parse(br#"{"local_table":{"capacity":65536,"max_bytes":67108864}}"#).unwrap_err();
    assert_eq!(err.field, "local_table.capacity");
}

#[test]
fn wait_mode_is_bounded_by_wait_ms_and_the_lease() {
    let wait = |extra: &str| {
        Config::parse(
            format!(r#"{{"rules":[{{"name":"a","on_in_flight":"wait"{extra}}}]}}"#).as_bytes(),
        )
    };
    let r = &wait("").unwrap().rules[0];
    assert_eq!(
        (r.on_in_flight, r.wait_ms),
        (InFlightPolicy::Wait, DEFAULT_WAIT_MS)
    );
    let short_lease = wait(r#","lease_seconds":3"#).unwrap();
    assert_eq!(
        short_lease.rules[0].wait_ms, 3_000,
        "never beyond the lease"
    );
    assert_eq!(wait(r#","wait_ms":250"#).unwrap().rules[0].wait_ms, 250);
    for bad in [
        r#","wait_ms":0"#,
        r#","wait_ms":60001"#,
        r#","lease_seconds":5,"wait_ms":6000"#,
    ] {
        let e = wait(bad).unwrap_err().to_string();
        assert!(e.contains("rules[0].wait_ms"), "{bad}: {e}");
    }
    let e = Config::parse(br#"{"rules":[{"name":"a","wait_ms":100}]}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("only applies with on_in_flight"), "{e}");
    assert!(Config::parse(br#"{"rules":[{"name":"a","on_in_flight":"queue"}]}"#).is_err());
}

#[test]
fn rule_defaults_follow_the_documentation() {
    let c = Config::parse(br#"{"rules":[{"name":"orders"}]}"#).unwrap();
    let r = &c.rules[0];
    assert!(r.key_required);
    assert_eq!(
        r.key_sources,
        vec![FieldSource::Header("idempotency-key".into())]
    );
    assert_eq!(r.fingerprint, FingerprintMode::Body);
    assert_eq!(r.max_request_bytes, 1 << 20);
    assert_eq!(r.scope_headers, vec![":authority", "authorization"]);
    assert!(!r.scope_required);
    assert_eq!(r.ttl_ms, 86_400_000);
    assert_eq!(r.lease_ms, 30_000);
    assert_eq!(r.max_response_bytes, 1 << 20);
    assert_eq!(r.matcher.methods, vec!["POST", "PATCH"]);
    assert!(r.release.releases(503) && r.release.releases(429) && !r.release.releases(409));
    // The upstream refused the caller, so the write never ran: a retry must execute.
    for status in [401, 403, 407, 408, 425] {
        assert!(r.release.releases(status), "{status}");
    }
    for status in [400, 404, 409, 422] {
        assert!(!r.release.releases(status), "{status}");
    }
    assert_eq!(r.replay_header, "idempotent-replayed");
    assert_eq!(r.on_table_full, OverloadPolicy::Reject);
    assert_eq!(r.on_in_flight, InFlightPolicy::Conflict);
    assert_eq!(r.on_unknown_outcome, UnknownOutcomePolicy::Record);
    let released =
        Config::parse(br#"{"rules":[{"name":"orders","on_unknown_outcome":"release"}]}"#).unwrap();
    assert_eq!(
        released.rules[0].on_unknown_outcome,
        UnknownOutcomePolicy::Release
    );
    assert!(Config::parse(br#"{"rules":[{"name":"a","on_unknown_outcome":"retry"}]}"#).is_err());
}

#[test]
fn unknown_fields_are_refused_by_name() {
    let e = Config::parse(br#"{"rules":[{"name":"a","ttl":5}]}"#).unwrap_err();
    assert!(e.to_string().contains("unknown field `ttl`"), "{e}");
    let e = Config::parse(br#"{"rulez":[]}"#).unwrap_err();
    assert!(e.to_string().contains("rulez"), "{e}");
}

#[test]
fn bad_values_name_the_field() {
    let cases: &[(&[u8], &str)] = &[
        (
            br#"{"rules":[{"name":"a","lease_seconds":0}]}"#,
            "rules[0].lease_seconds",
        ),
        (
            br#"{"rules":[{"name":"a","ttl_seconds":10,"lease_seconds":20}]}"#,
            "rules[0].lease_seconds",
        ),
        (br#"{"rules":[{"name":"a b"}]}"#, "rules[0].name"),
        (br#"{"rules":[{"name":"a"},{"name":"a"}]}"#, "rules[1].name"),
        (
            br#"{"rules":[{"name":"a","match":{"path_prefixes":["x"]}}]}"#,
            "rules[0].match.path_prefixes[0]",
        ),
        (
            br#"{"rules":[{"name":"a","match":{"methods":[]}}]}"#,
            "rules[0].match.methods",
        ),
        (
            br#"{"rules":[{"name":"a","release_on_status":["6xx"]}]}"#,
            "rules[0].release_on_status",
        ),
        (
            br#"{"rules":[{"name":"a","scope_headers":["bad header"]}]}"#,
            "rules[0].scope_headers[0]",
        ),
        (br#"{"local_table":{"capacity":0}}"#, "local_table.capacity"),
        (
            br#"{"local_table":{"capacity":1000000,"max_bytes":67108864}}"#,
            "local_table.capacity",
        ),
        (
            br#"{"local_table":{"max_bytes":1000}}"#,
            "local_table.max_bytes",
        ),
        (
            br#"{"rules":[{"name":"a","on_table_full":"explode"}]}"#,
            "(json)",
        ),
    ];
    for (json, field) in cases {
        let e = Config::parse(json).unwrap_err();
        assert_eq!(&e.field, field, "{e}");
    }
}

/// The store's `record` command names a record from the same configuration file with
/// `rule_namings`, which reads only the naming fields: it must name every rule as the
/// filter does, defaults included, or an operator's lookup finds another record.
#[test]
fn the_record_command_names_rules_as_the_filter_does() {
    let json = br#"{"rules":[
        {"name":"plain"},
        {"name":"cb","key":{"required":false,"sources":[{"header":"CE-Source"},{"json":"/id"},{"query":"o"}]},
         "scope_headers":["X-Tenant","authorization"],"scope_required":true,"ttl_seconds":600},
        {"name":"hook","key":{"header":"X-GitHub-Delivery"},"scope_headers":[],"fingerprint":"none"}]}"#;
    let filter = Config::parse(json).unwrap();
    let namings = idempotency_protocol::naming::rule::rule_namings(json).unwrap();
    assert_eq!(namings.len(), filter.rules.len());
    for (naming, rule) in namings.iter().zip(&filter.rules) {
        assert_eq!(naming.name, rule.name);
        assert_eq!(naming.key_sources, rule.key_sources, "{}", rule.name);
        assert_eq!(naming.key_required, rule.key_required, "{}", rule.name);
        assert_eq!(naming.scope_headers, rule.scope_headers, "{}", rule.name);
        assert_eq!(naming.scope_required, rule.scope_required, "{}", rule.name);
    }
    // A naming field the filter refuses is refused the same way, naming the field.
    let bad = br#"{"rules":[{"name":"a","key":{"header":"x","sources":[{"json":"/id"}]}}]}"#;
    let filter = Config::parse(bad).unwrap_err();
    let namings = idempotency_protocol::naming::rule::rule_namings(bad).unwrap_err();
    assert_eq!(
        (namings.field, namings.reason),
        (filter.field, filter.reason)
    );
}

#[test]
fn key_sources_and_fingerprint_fields() {
    let c = Config::parse(
        br#"{"rules":[{"name":"cb","key":{"sources":[{"header":"CE-Source"},{"json":"/id"},{"form":"trade_no"},{"query":"o"}]},
            "fingerprint":{"fields":[{"json":"/amount"},{"form":"fee"}]}},
            {"name":"hook","key":{"header":"X-GitHub-Delivery"},"fingerprint":"none"}]}"#,
    )
    .unwrap();
    assert_eq!(
        c.rules[0].key_sources,
        vec![
            FieldSource::Header("ce-source".into()),
            FieldSource::Json("/id".into()),
            FieldSource::Form("trade_no".into()),
            FieldSource::Query("o".into()),
        ]
    );
    assert_eq!(
        c.rules[0].fingerprint,
        FingerprintMode::Fields(vec![
            FieldSource::Json("/amount".into()),
            FieldSource::Form("fee".into())
        ])
    );
    assert_eq!(
        c.rules[1].key_sources,
        vec![FieldSource::Header("x-github-delivery".into())]
    );
    assert_eq!(c.rules[1].fingerprint, FingerprintMode::None);
    for (json, field) in [
        (
            &br#"{"rules":[{"name":"a","key":{"header":"x","sources":[{"header":"y"}]}}]}"#[..],
            "rules[0].key",
        ),
        (
            &br#"{"rules":[{"name":"a","key":{"sources":[]}}]}"#[..],
            "rules[0].key.sources",
        ),
        (
            &br#"{"rules":[{"name":"a","key":{"sources":[{"json":"id"}]}}]}"#[..],
            "rules[0].key.sources[0].json",
        ),
        (
            &br#"{"rules":[{"name":"a","key":{"sources":[{"json":"/a","form":"b"}]}}]}"#[..],
            "rules[0].key.sources[0]",
        ),
        (
            &br#"{"rules":[{"name":"a","fingerprint":"all"}]}"#[..],
            "rules[0].fingerprint",
        ),
        (
            &br#"{"rules":[{"name":"a","fingerprint":{"fields":[{"header":"x"}]}}]}"#[..],
            "rules[0].fingerprint.fields[0]",
        ),
        (
            &br#"{"rules":[{"name":"a","max_request_bytes":0}]}"#[..],
            "rules[0].max_request_bytes",
        ),
    ] {
        assert_eq!(Config::parse(json).unwrap_err().field, field);
    }
}

#[test]
fn store_is_global_or_per_rule() {
    let c = Config::parse(
        br#"{"store":{"cluster":"store","token":"t"},
             "rules":[{"name":"a"},
                      {"name":"b","store":{"cluster":"other","timeout_ms":50},"on_store_error":"fail_open"}]}"#,
    )
    .unwrap();
    let a = c.rules[0].store.as_ref().unwrap();
    assert_eq!(
        (a.cluster.as_str(), a.timeout_ms, a.token.as_deref()),
        ("store", 250, Some("t"))
    );
    assert_eq!(a.authority, "idempotency-store");
    assert_eq!(c.rules[0].on_store_error, StoreErrorPolicy::FailClosed);
    let b = c.rules[1].store.as_ref().unwrap();
    assert_eq!((b.cluster.as_str(), b.timeout_ms), ("other", 50));
    assert_eq!(c.rules[1].on_store_error, StoreErrorPolicy::FailOpen);
    assert!(
        Config::parse(br#"{"rules":[{"name":"a"}]}"#).unwrap().rules[0]
            .store
            .is_none()
    );
    for address in [
        "127.0.0.1:8081",
        "[::1]:8081",
        "idempotency-store.ns.svc:8081",
    ] {
        let json = format!(
            r#"{{"rules":[{{"name":"a","store":{{"cluster":"s","address":"{address}"}}}}]}}"#
        );
        let parsed = Config::parse(json.as_bytes()).unwrap();
        assert_eq!(
            parsed.rules[0].store.as_ref().unwrap().address.as_deref(),
            Some(address)
        );
    }
    for (json, field) in [
        (
            &br#"{"store":{"cluster":"s","timeout_ms":0}}"#[..],
            "store.timeout_ms",
        ),
        (&br#"{"store":{"cluster":""}}"#[..], "store.cluster"),
        (
            &br#"{"store":{"cluster":"s","address":"store"}}"#[..],
            "store.address",
        ),
        (
            &br#"{"store":{"cluster":"s","address":"store:0"}}"#[..],
            "store.address",
        ),
        (
            &br#"{"store":{"cluster":"s","address":"[::1:8081"}}"#[..],
            "store.address",
        ),
        (
            &br#"{"store":{"cluster":"s","address":"a b:8081"}}"#[..],
            "store.address",
        ),
        (
            &br#"{"rules":[{"name":"a","store":{"cluster":"s","token":"a b"}}]}"#[..],
            "rules[0].store.token",
        ),
    ] {
        assert_eq!(Config::parse(json).unwrap_err().field, field);
    }
}

#[test]
fn scope_required_needs_a_header_that_identifies_the_caller() {
    let c = Config::parse(br#"{"rules":[{"name":"a","scope_required":true}]}"#).unwrap();
    assert!(c.rules[0].scope_required);
    let e = Config::parse(
        br#"{"rules":[{"name":"a","scope_headers":[":authority"],"scope_required":true}]}"#,
    )
    .unwrap_err();
    assert_eq!(e.field, "rules[0].scope_required");
    let e = Config::parse(br#"{"rules":[{"name":"a","scope_required":"yes"}]}"#).unwrap_err();
    assert_eq!(e.field, "(json)");
}

#[test]
fn with_a_store_lease_and_ttl_stay_within_what_the_store_accepts() {
    let store = r#""store":{"cluster":"s"}"#;
    let parse = |global: &str, rule: &str| {
        Config::parse(format!(r#"{{{global}"rules":[{{"name":"a"{rule}}}]}}"#).as_bytes())
    };
    // A day of lease and a year of TTL are the store's largest.
    let c = parse(
        &format!("{store},"),
        r#","ttl_seconds":31536000,"lease_seconds":86400"#,
    )
    .unwrap();
    assert_eq!(c.rules[0].lease_ms, STORE_MAX_LEASE_MS);
    assert_eq!(c.rules[0].ttl_ms, STORE_MAX_TTL_MS);
    for (global, rule, field) in [
        (
            format!("{store},"),
            r#","ttl_seconds":31536001"#.to_string(),
            "rules[0].ttl_seconds",
        ),
        (
            format!("{store},"),
            r#","ttl_seconds":172800,"lease_seconds":86401"#.to_string(),
            "rules[0].lease_seconds",
        ),
        (
            String::new(),
            format!(r#",{store},"ttl_seconds":172800,"lease_seconds":90000"#),
            "rules[0].lease_seconds",
        ),
        (
            format!("{store},"),
            r#","tombstone_seconds":31536001"#.to_string(),
            "rules[0].tombstone_seconds",
        ),
    ] {
        let e = parse(&global, &rule).unwrap_err();
        assert_eq!(e.field, field, "{e}");
        assert!(e.reason.contains("store"), "{e}");
    }
    // Single-proxy mode keeps its own, wider limits.
    let c = parse("", r#","ttl_seconds":31622400,"lease_seconds":172800"#).unwrap();
    assert_eq!(c.rules[0].lease_ms, 172_800_000);
}

#[test]
fn a_tombstone_period_is_optional_and_at_most_a_year_and_a_day() {
    let parse =
        |rule: &str| Config::parse(format!(r#"{{"rules":[{{"name":"a"{rule}}}]}}"#).as_bytes());
    assert_eq!(parse("").unwrap().rules[0].tombstone_ms, 0);
    let c = parse(r#","tombstone_seconds":15552000"#).unwrap();
    assert_eq!(c.rules[0].tombstone_ms, 15_552_000_000);
    let e = parse(r#","tombstone_seconds":31622401"#).unwrap_err();
    assert_eq!(e.field, "rules[0].tombstone_seconds", "{e}");
}

#[test]
fn methods_and_hosts_are_normalised() {
    let c = Config::parse(
        br#"{"rules":[{"name":"a","match":{"methods":["put","Post"],"hosts":["API.example"]}}]}"#,
    )
    .unwrap();
    assert_eq!(c.rules[0].matcher.methods, vec!["PUT", "POST"]);
    assert_eq!(c.rules[0].matcher.hosts, vec!["api.example"]);
}

#[test]
fn a_detached_rule_names_where_and_how_long_and_an_inline_one_refuses_those_settings() {
    let parse = |rule: &str| {
        Config::parse(
            format!(r#"{{"store":{{"cluster":"store"}},"rules":[{{"name":"a"{rule}}}]}}"#)
                .as_bytes(),
        )
    };
    let c = parse("").unwrap();
    assert_eq!(c.rules[0].detached, None, "inline unless asked");
    let c = parse(r#","execution":"detached""#).unwrap();
    assert_eq!(
        c.rules[0].detached,
        Some(DetachedUpstream {
            cluster: None,
            timeout_ms: DEFAULT_UPSTREAM_TIMEOUT_MS
        })
    );
    let c = parse(r#","execution":"detached","upstream_cluster":"pay","upstream_timeout_ms":2500"#)
        .unwrap();
    assert_eq!(
        c.rules[0].detached,
        Some(DetachedUpstream {
            cluster: Some("pay".into()),
            timeout_ms: 2500
        })
    );
    for (rule, field) in [
        (r#","upstream_cluster":"pay""#, "rules[0].upstream_cluster"),
        (
            r#","upstream_timeout_ms":100"#,
            "rules[0].upstream_timeout_ms",
        ),
        (
            r#","execution":"detached","upstream_cluster":"""#,
            "rules[0].upstream_cluster",
        ),
        (
            r#","execution":"detached","upstream_cluster":"store""#,
            "rules[0].upstream_cluster",
        ),
        (
            r#","execution":"detached","upstream_timeout_ms":0"#,
            "rules[0].upstream_timeout_ms",
        ),
        (
            r#","execution":"detached","upstream_timeout_ms":300001"#,
            "rules[0].upstream_timeout_ms",
        ),
    ] {
        let e = parse(rule).unwrap_err();
        assert_eq!(e.field, field, "{rule}: {e}");
    }
    let e = parse(r#","execution":"later""#).unwrap_err();
    assert_eq!(e.field, "(json)");
}

#[test]
fn a_detached_write_may_not_outlast_its_record() {
    let parse = |rule: &str| {
        Config::parse(
            format!(r#"{{"rules":[{{"name":"a","execution":"detached","ttl_seconds":10,"lease_seconds":5{rule}}}]}}"#)
                .as_bytes(),
        )
    };
    // The default timeout (15 s) outlasts a 10 s record, and so does one of exactly 10 s.
    for rule in ["", r#","upstream_timeout_ms":10000"#] {
        let e = parse(rule).unwrap_err();
        assert_eq!(e.field, "rules[0].upstream_timeout_ms", "{rule}: {e}");
        assert!(e.to_string().contains("ttl_seconds"), "{e}");
    }
    let c = parse(r#","upstream_timeout_ms":9999"#).unwrap();
    assert_eq!(
        c.rules[0].detached.as_ref().map(|d| d.timeout_ms),
        Some(9999)
    );
}

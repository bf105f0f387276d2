//! How a rule names its records: its name, where its key comes from, and the headers that
//! scope it. The filter's configuration validates these fields of a rule with these
//! functions, and the store's `record` command reads them from the same configuration file,
//! so both name a request's record alike.

use std::fmt;

use serde::Deserialize;

use crate::naming::source::FieldSource;

/// Longest rule name (it names metrics).
pub const MAX_RULE_NAME_LEN: usize = 64;

/// A configuration error that names the field and says why it was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid plugin configuration: {}: {}",
            self.field, self.reason
        )
    }
}

/// A [`ConfigError`] for `field`.
pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        reason: reason.into(),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKey {
    #[serde(default = "default_true")]
    pub required: bool,
    #[serde(default)]
    pub header: Option<String>,
    #[serde(default)]
    pub sources: Option<Vec<RawSource>>,
}

impl Default for RawKey {
    fn default() -> Self {
        RawKey {
            required: true,
            header: None,
            sources: None,
        }
    }
}

/// Exactly one of the fields names where a value comes from.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSource {
    #[serde(default)]
    pub header: Option<String>,
    #[serde(default)]
    pub query: Option<String>,
    #[serde(default)]
    pub json: Option<String>,
    #[serde(default)]
    pub form: Option<String>,
}

fn default_true() -> bool {
    true
}

/// The key's header when a rule names none.
fn default_key_header() -> String {
    "idempotency-key".to_string()
}

/// The scope when a rule names none: the host and the caller's credentials.
pub fn default_scope_headers() -> Vec<String> {
    vec![":authority".to_string(), "authorization".to_string()]
}

/// A character of a rule name or a metric label.
fn is_token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'-' || b == b'_'
}

/// A lower-case HTTP header name (or pseudo-header).
pub fn valid_header_name(name: &str) -> bool {
    let body = name.strip_prefix(':').unwrap_or(name);
    !body.is_empty()
        && body.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.!#$%&'*+^`|~".contains(&b)
        })
}

/// `rules[index].name`: a name metrics can carry.
pub fn validate_name(index: usize, name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > MAX_RULE_NAME_LEN || !name.bytes().all(is_token_char) {
        return Err(invalid(
            format!("rules[{index}].name"),
            format!(
                "must be 1 to {MAX_RULE_NAME_LEN} characters of [A-Za-z0-9_-] (it names metrics)"
            ),
        ));
    }
    Ok(())
}

/// `rules[index].key`: where the key comes from (one header by default).
pub fn validate_key(index: usize, key: RawKey) -> Result<Vec<FieldSource>, ConfigError> {
    let at = |field: &str| format!("rules[{index}].{field}");
    let key_sources = match (key.header, key.sources) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                at("key"),
                "set either 'header' or 'sources', not both",
            ))
        }
        (header, None) => {
            let header = header
                .unwrap_or_else(default_key_header)
                .to_ascii_lowercase();
            if !valid_header_name(&header) || header.starts_with(':') {
                return Err(invalid(
                    at("key.header"),
                    "must be a regular HTTP header name",
                ));
            }
            vec![FieldSource::Header(header)]
        }
        (None, Some(list)) => {
            if list.is_empty() {
                return Err(invalid(at("key.sources"), "must name at least one source"));
            }
            let mut sources = Vec::with_capacity(list.len());
            for (i, raw_source) in list.into_iter().enumerate() {
                let source_at = format!("rules[{index}].key.sources[{i}]");
                sources.push(validate_source(&source_at, raw_source)?);
            }
            sources
        }
    };
    Ok(key_sources)
}

/// `rules[index].scope_headers`, lower-cased, and `scope_required` checked against them.
pub fn validate_scope(
    index: usize,
    headers: &[String],
    required: bool,
) -> Result<Vec<String>, ConfigError> {
    let at = |field: &str| format!("rules[{index}].{field}");
    let mut scope_headers = Vec::with_capacity(headers.len());
    for (i, h) in headers.iter().enumerate() {
        let lower = h.to_ascii_lowercase();
        if !valid_header_name(&lower) {
            return Err(invalid(
                format!("rules[{index}].scope_headers[{i}]"),
                format!("'{h}' is not a header name"),
            ));
        }
        scope_headers.push(lower);
    }
    if required && scope_headers.iter().all(|h| h == ":authority") {
        // Nothing would ever be required: refuse rather than give a false sense of safety.
        return Err(invalid(
            at("scope_required"),
            "needs a scope header other than ':authority' in scope_headers",
        ));
    }
    Ok(scope_headers)
}

/// One key source or fingerprint field: exactly one of header, query, json or form.
pub fn validate_source(at: &str, raw: RawSource) -> Result<FieldSource, ConfigError> {
    let given = [&raw.header, &raw.query, &raw.json, &raw.form]
        .iter()
        .filter(|v| v.is_some())
        .count();
    if given != 1 {
        return Err(invalid(
            at,
            "must have exactly one of 'header', 'query', 'json' or 'form'",
        ));
    }
    if let Some(h) = raw.header {
        let lower = h.to_ascii_lowercase();
        if !valid_header_name(&lower) || lower.starts_with(':') {
            return Err(invalid(
                format!("{at}.header"),
                format!("'{h}' is not a header name"),
            ));
        }
        return Ok(FieldSource::Header(lower));
    }
    if let Some(q) = raw.query {
        if q.is_empty() {
            return Err(invalid(format!("{at}.query"), "must not be empty"));
        }
        return Ok(FieldSource::Query(q));
    }
    if let Some(p) = raw.json {
        // RFC 6901: "" is the whole document, otherwise each token starts with '/'.
        if !(p.is_empty() || p.starts_with('/')) {
            return Err(invalid(
                format!("{at}.json"),
                format!("'{p}' is not a JSON Pointer (it must start with '/')"),
            ));
        }
        return Ok(FieldSource::Json(p));
    }
    match raw.form {
        Some(f) if !f.is_empty() => Ok(FieldSource::Form(f)),
        _ => Err(invalid(format!("{at}.form"), "must not be empty")),
    }
}

/// The naming part of one rule, validated as the filter validates it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleNaming {
    pub name: String,
    pub key_sources: Vec<FieldSource>,
    /// A request without the key is refused (400) rather than let through unprotected.
    pub key_required: bool,
    pub scope_headers: Vec<String>,
    pub scope_required: bool,
}

/// The naming fields of a rule in the filter's configuration; the rest of the rule is the
/// filter's to validate, and is skipped here.
#[derive(Deserialize)]
struct NamingFields {
    name: String,
    #[serde(default)]
    key: RawKey,
    #[serde(default = "default_scope_headers")]
    scope_headers: Vec<String>,
    #[serde(default)]
    scope_required: bool,
}

#[derive(Deserialize)]
struct ConfigRules {
    rules: Vec<NamingFields>,
}

/// How each rule of the filter's configuration (its JSON) names its records.
pub fn rule_namings(config: &[u8]) -> Result<Vec<RuleNaming>, ConfigError> {
    let parsed: ConfigRules =
        serde_json::from_slice(config).map_err(|e| invalid("(json)", e.to_string()))?;
    let mut namings = Vec::with_capacity(parsed.rules.len());
    for (index, rule) in parsed.rules.into_iter().enumerate() {
        validate_name(index, &rule.name)?;
        let key_required = rule.key.required;
        namings.push(RuleNaming {
            key_sources: validate_key(index, rule.key)?,
            scope_headers: validate_scope(index, &rule.scope_headers, rule.scope_required)?,
            scope_required: rule.scope_required,
            key_required,
            name: rule.name,
        });
    }
    Ok(namings)
}

//! A rule's `lookup` settings: the path of its lookup route, and whether it shows the
//! recorded response itself.

use serde::Deserialize;

use idempotency_protocol::naming::source::FieldSource;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLookupRoute {
    path: String,
    #[serde(default)]
    include_response: bool,
}

/// Validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupRoute {
    /// Matched exactly, without the query, for `GET` and `HEAD`.
    pub path: String,
    /// Answer with the recorded status, headers and body, not only the state.
    pub include_response: bool,
}

/// Validates `raw` for a rule whose key comes from `key_sources`; Err is (field, why).
pub fn validate(
    raw: RawLookupRoute,
    key_sources: &[FieldSource],
    is_grpc: bool,
) -> Result<LookupRoute, (String, String)> {
    let err = |field: &str, why: &str| Err((field.to_string(), why.to_string()));
    if is_grpc {
        return err("", "not available for gRPC rules");
    }
    let path = raw.path;
    if !path.starts_with('/')
        || path.contains(['?', '#'])
        || path.bytes().any(|b| !b.is_ascii_graphic())
    {
        return err("path", "must be a path starting with '/', without a query");
    }
    if key_sources.iter().any(FieldSource::in_body) {
        return err(
            "",
            "the key must come from headers or the query: a lookup is a GET without a body",
        );
    }
    Ok(LookupRoute {
        path,
        include_response: raw.include_response,
    })
}

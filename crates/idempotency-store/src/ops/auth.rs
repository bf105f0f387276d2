//! Who may call what: the data-plane and operator bearer tokens, compared in constant time,
//! and the mark a request's connection gets once it authenticated.

use std::sync::Arc;

use axum::http::{header, HeaderMap};
use subtle::ConstantTimeEq;

use crate::admission::ConnectionAuth;

/// A bearer token, compared in constant time so that response timing does not reveal how
/// much of a guessed token was right.
#[derive(Clone)]
struct Secret(Arc<[u8]>);

impl Secret {
    fn matches(&self, presented: Option<&str>) -> bool {
        presented.is_some_and(|p| bool::from(p.as_bytes().ct_eq(&self.0)))
    }
}

/// Who may call what. The data plane (claim, complete, release, renew, the stream) takes the
/// token every Envoy holds in its plugin configuration; the operator routes (lookup, search,
/// purge) take a token of their own, so that what an Envoy's `/config_dump` shows cannot read
/// or purge records. Neither kind of route takes the other's token.
#[derive(Clone)]
pub struct Auth {
    /// None only with `--insecure-no-auth` (local demos).
    data_plane: Option<Secret>,
    /// None: the operator routes are disabled.
    operator: Option<Secret>,
}

/// An authorization decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// No token, or not the route's: 401.
    Unauthorized,
    /// The other kind of token, or routes that are disabled: 403, saying why.
    Forbidden(&'static str),
}

/// The 403 details, which the `record` command shows as they are.
pub const OPERATOR_ROUTES_DISABLED: &str = "the operator routes (record lookup, search and \
     purge) are disabled on this store: start it with --operator-token-file PATH (or \
     IDEMPOTENCY_STORE_OPERATOR_TOKEN) to enable them";
pub const DATA_PLANE_TOKEN_ON_OPERATOR_ROUTE: &str = "this is the data-plane token (the one \
     the filter sends), which operator routes do not accept: use the operator token \
     (--operator-token-file, IDEMPOTENCY_STORE_OPERATOR_TOKEN)";
pub const OPERATOR_TOKEN_ON_DATA_PLANE: &str = "this is the operator token, which data-plane \
     routes do not accept: the filter sends the data-plane token (--token-file, \
     IDEMPOTENCY_STORE_TOKEN)";

impl Auth {
    /// The data plane needs `token`; the operator routes are disabled.
    pub fn bearer(token: &str) -> Self {
        Self {
            data_plane: Some(Secret(Arc::from(token.as_bytes()))),
            operator: None,
        }
    }

    /// No token on the data plane (`--insecure-no-auth`, local demos only); the operator
    /// routes are disabled.
    pub fn insecure() -> Self {
        Self {
            data_plane: None,
            operator: None,
        }
    }

    /// The operator routes need `token`.
    #[must_use]
    pub fn with_operator_token(mut self, token: &str) -> Self {
        self.operator = Some(Secret(Arc::from(token.as_bytes())));
        self
    }

    /// May these headers call a data-plane route?
    pub fn data_plane(&self, headers: &HeaderMap) -> Verdict {
        let presented = presented(headers);
        if self.operator.as_ref().is_some_and(|o| o.matches(presented)) {
            return Verdict::Forbidden(OPERATOR_TOKEN_ON_DATA_PLANE);
        }
        match &self.data_plane {
            None => Verdict::Allowed,
            Some(token) if token.matches(presented) => Verdict::Allowed,
            Some(_) => Verdict::Unauthorized,
        }
    }

    /// May these headers call an operator route?
    pub fn operator(&self, headers: &HeaderMap) -> Verdict {
        let Some(operator) = &self.operator else {
            return Verdict::Forbidden(OPERATOR_ROUTES_DISABLED);
        };
        let presented = presented(headers);
        if self
            .data_plane
            .as_ref()
            .is_some_and(|d| d.matches(presented))
        {
            return Verdict::Forbidden(DATA_PLANE_TOKEN_ON_OPERATOR_ROUTE);
        }
        if operator.matches(presented) {
            Verdict::Allowed
        } else {
            Verdict::Unauthorized
        }
    }
}

fn presented(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_credentials)
}

fn bearer_credentials(value: &str) -> Option<&str> {
    let (scheme, rest) = value.split_once(' ')?;
    // The auth scheme is case-insensitive (RFC 9110 section 11.1).
    scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
}

/// A request passed its route's token check: its connection no longer waits to
/// authenticate (see [`crate::admission`]). Requests not served by `server::serve_with` (a router
/// called directly) carry no connection.
pub(crate) fn connection_authenticated(extensions: &axum::http::Extensions) {
    if let Some(auth) = extensions.get::<ConnectionAuth>() {
        auth.authenticated();
    }
}

//! How the HTTP front ends answer: problem+json for every refusal and failure, and the
//! handler shape of a `POST /v1/...` whose body is parsed, validated and performed.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::metrics::Rejection;
use crate::ops::auth::Verdict;
use crate::ops::{perform, AppState, V1Operation};
use crate::protocol::{self, BadRequest, Problem};
use crate::storage::StorageError;

pub fn problem(status: StatusCode, kind: &str, title: &str, detail: impl Into<String>) -> Response {
    problem_with_outcome(status, kind, title, detail, None)
}

pub(crate) fn problem_with_outcome(
    status: StatusCode,
    kind: &str,
    title: &str,
    detail: impl Into<String>,
    outcome: Option<&str>,
) -> Response {
    let body = Problem {
        kind: kind.to_owned(),
        title: title.to_owned(),
        status: status.as_u16(),
        detail: detail.into(),
        outcome: outcome.map(str::to_owned),
    };
    let mut resp = (status, Json(body)).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    resp
}

/// The answer to a request its route's auth refused.
pub(crate) fn refusal(st: &AppState, verdict: Verdict) -> Response {
    if let Verdict::Forbidden(why) = verdict {
        st.metrics.rejected(Rejection::Forbidden);
        return problem(
            StatusCode::FORBIDDEN,
            protocol::PROBLEM_FORBIDDEN,
            "Forbidden",
            why,
        );
    }
    st.metrics.rejected(Rejection::Unauthorized);
    let mut resp = problem(
        StatusCode::UNAUTHORIZED,
        protocol::PROBLEM_UNAUTHORIZED,
        "Unauthorized",
        "missing or wrong `authorization: Bearer <token>` header",
    );
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

pub(crate) fn bad_request(st: &AppState, err: BadRequest) -> Response {
    st.metrics.rejected(Rejection::BadRequest);
    problem(
        StatusCode::BAD_REQUEST,
        protocol::PROBLEM_BAD_REQUEST,
        "Bad request",
        err.0,
    )
}

/// Why a request never reached storage.
pub(crate) enum Refusal {
    TooLarge,
    Bad(BadRequest),
}

impl Refusal {
    pub(crate) fn respond(self, st: &AppState) -> Response {
        match self {
            Self::Bad(bad) => bad_request(st, bad),
            Self::TooLarge => {
                st.metrics.rejected(Rejection::TooLarge);
                problem(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    protocol::PROBLEM_TOO_LARGE,
                    "Payload too large",
                    "request body exceeds the configured --max-body-bytes",
                )
            }
        }
    }
}

/// Buffers the body (within the limit) and parses + validates it.
pub(crate) fn parse_body<T>(
    body: Result<Bytes, BytesRejection>,
    parse: impl FnOnce(&[u8]) -> Result<T, BadRequest>,
) -> Result<T, Refusal> {
    let bytes = body.map_err(|rej| {
        if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
            Refusal::TooLarge
        } else {
            Refusal::Bad(BadRequest(format!("unreadable body: {}", rej.body_text())))
        }
    })?;
    parse(&bytes).map_err(Refusal::Bad)
}

/// The detail a 503 (HTTP) or an `UNAVAILABLE` failure (gRPC) carries for `e`.
pub(crate) fn unavailable_detail(e: &StorageError) -> String {
    match e {
        StorageError::Full(why) => why.clone(),
        StorageError::Backend(_) => {
            "the storage backend failed; the outcome of this call is unknown, retry later".into()
        }
    }
}

pub(crate) fn unavailable(e: &StorageError) -> Response {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        protocol::PROBLEM_UNAVAILABLE,
        "Storage backend unavailable",
        unavailable_detail(e),
    )
}

pub(crate) fn not_owner(detail: &str) -> Response {
    problem_with_outcome(
        StatusCode::CONFLICT,
        protocol::PROBLEM_NOT_OWNER,
        "Not the owner",
        detail,
        Some("not_owner"),
    )
}

/// The handler of a `POST /v1/...` whose JSON body `parse` reads and validates.
pub(crate) async fn post_handler<Op: V1Operation>(
    st: AppState,
    body: Result<Bytes, BytesRejection>,
    parse: impl FnOnce(&[u8]) -> Result<Op, BadRequest>,
) -> Response {
    match parse_body(body, parse) {
        Ok(op) => perform(&st, op).await,
        Err(refusal) => refusal.respond(&st),
    }
}

//! HTTP front of the store: routing, bearer auth, body limits, and mapping
//! storage outcomes and failures onto status codes and problem+json.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use subtle::ConstantTimeEq;
use tokio::net::TcpListener;

use crate::metrics::{self, Metrics, Operation, Rejection};
use crate::protocol::{self, BadRequest, ClaimResponse, OutcomeResponse, Problem, RecordResponse};
use crate::storage::{CompleteOutcome, Digest, OwnerToken, ReleaseOutcome, Storage, StorageError};

/// Base64 inflates a 1 MiB response to ~1.4 MiB; 4 MiB leaves room for that
/// plus JSON framing and headroom for larger recorded responses.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// Who may call `/v1`. `Disabled` exists only for local demos
/// (`--insecure-no-auth`).
#[derive(Clone)]
pub enum Auth {
    Bearer(Arc<[u8]>),
    Disabled,
}

impl Auth {
    pub fn bearer(token: &str) -> Self {
        Self::Bearer(Arc::from(token.as_bytes()))
    }

    fn allows(&self, headers: &HeaderMap) -> bool {
        let Self::Bearer(expected) = self else {
            return true;
        };
        let Some(presented) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_credentials)
        else {
            return false;
        };
        // Constant time so response timing does not reveal how much of a
        // guessed token was right.
        bool::from(presented.as_bytes().ct_eq(expected))
    }
}

fn bearer_credentials(value: &str) -> Option<&str> {
    let (scheme, rest) = value.split_once(' ')?;
    // The auth scheme is case-insensitive (RFC 9110 section 11.1).
    scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
}

#[derive(Clone)]
pub struct AppState {
    pub storage: Arc<dyn Storage>,
    pub metrics: Arc<Metrics>,
    pub auth: Auth,
}

pub fn router(state: AppState, max_body_bytes: usize) -> Router {
    let v1 = Router::new()
        .route("/v1/claim", post(claim))
        .route("/v1/complete", post(complete))
        .route("/v1/release", post(release))
        .route("/v1/records/{key}", get(lookup))
        // route_layer: auth only for matched routes, so unknown paths are a
        // plain 404 rather than a misleading 401.
        .route_layer(middleware::from_fn_with_state(state.clone(), require_auth));
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/metrics", get(metrics_text))
        .merge(v1)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

/// Serves HTTP/1.1 and cleartext HTTP/2 (prior knowledge) on one listener
/// until `shutdown` resolves, then drains in-flight requests.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt as _;
    // Small JSON exchanges: don't let Nagle hold back the last segment.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("set_nodelay failed: {e}");
        }
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

pub fn problem(status: StatusCode, kind: &str, title: &str, detail: impl Into<String>) -> Response {
    problem_with_outcome(status, kind, title, detail, None)
}

fn problem_with_outcome(
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

async fn require_auth(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if st.auth.allows(req.headers()) {
        return next.run(req).await;
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

fn bad_request(st: &AppState, err: BadRequest) -> Response {
    st.metrics.rejected(Rejection::BadRequest);
    problem(
        StatusCode::BAD_REQUEST,
        protocol::PROBLEM_BAD_REQUEST,
        "Bad request",
        err.0,
    )
}

/// Why a request never reached storage.
enum Refusal {
    TooLarge,
    Bad(BadRequest),
}

impl Refusal {
    fn respond(self, st: &AppState) -> Response {
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
fn parse_body<T>(
    body: Result<Bytes, BytesRejection>,
    parse: fn(&[u8]) -> Result<T, BadRequest>,
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

fn backend_failure(st: &AppState, op: Operation, started: Instant, e: &StorageError) -> Response {
    tracing::warn!(operation = op.as_str(), error = %e, "storage backend failed");
    st.metrics.record_operation(op, "error", started.elapsed());
    st.metrics.backend_error(st.storage.backend_name());
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        protocol::PROBLEM_UNAVAILABLE,
        "Storage backend unavailable",
        "the storage backend failed; the outcome of this call is unknown, retry later",
    )
}

fn not_owner(detail: &str) -> Response {
    problem_with_outcome(
        StatusCode::CONFLICT,
        protocol::PROBLEM_NOT_OWNER,
        "Not the owner",
        detail,
        Some("not_owner"),
    )
}

/// Runs one `/v1` operation (storage call plus its metrics) on a task of its
/// own and waits for the response it builds.
///
/// When the client gives up (Envoy's callout timeout) hyper drops the handler
/// future. If the storage call were awaited in the handler itself it would be
/// cancelled at whatever `.await` it had reached: a write the backend had
/// already committed (or was about to) would go uncounted in
/// `operations_total`/`operation_duration_seconds`. A spawned task does not
/// belong to the handler: dropping the handler drops only the `JoinHandle`,
/// which detaches the task, so the operation always runs to its end and
/// records its outcome whether or not anyone is left to read the answer.
///
/// At process exit a detached task may be cut short, but nothing is lost that
/// matters: every backend applies a write atomically (one redb transaction,
/// committed by the embedded writer thread before it answers; one Redis
/// script; one locked map update), and the metrics die with the process anyway.
async fn run_detached(
    st: &AppState,
    op: Operation,
    started: Instant,
    work: impl Future<Output = Response> + Send + 'static,
) -> Response {
    match tokio::spawn(work).await {
        Ok(resp) => resp,
        // Only a panic in the operation (or a runtime shutting down) gets
        // here; answer like any other backend failure, never re-panic.
        Err(e) => backend_failure(
            st,
            op,
            started,
            &StorageError::Backend(format!("operation task failed: {e}")),
        ),
    }
}

async fn claim(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let req = match parse_body(body, protocol::parse_claim) {
        Ok(req) => req,
        Err(refusal) => return refusal.respond(&st),
    };
    let started = Instant::now();
    let task_st = st.clone();
    run_detached(&st, Operation::Claim, started, async move {
        claim_op(&task_st, req, started).await
    })
    .await
}

async fn claim_op(st: &AppState, req: protocol::ClaimRequest, started: Instant) -> Response {
    // The client's own token if it chose one, else a fresh one from the CSPRNG.
    let owner = match req.owner.map_or_else(OwnerToken::generate, Ok) {
        Ok(owner) => owner,
        Err(e) => return backend_failure(st, Operation::Claim, started, &e),
    };
    match st
        .storage
        .claim(&req.key, &req.fingerprint, req.lease_ms, &owner)
        .await
    {
        Ok(outcome) => {
            let name = protocol::claim_outcome_name(&outcome);
            st.metrics
                .record_operation(Operation::Claim, name, started.elapsed());
            Json(ClaimResponse::from(outcome)).into_response()
        }
        Err(e) => backend_failure(st, Operation::Claim, started, &e),
    }
}

async fn complete(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let req = match parse_body(body, protocol::parse_complete) {
        Ok(req) => req,
        Err(refusal) => return refusal.respond(&st),
    };
    let started = Instant::now();
    let task_st = st.clone();
    run_detached(&st, Operation::Complete, started, async move {
        complete_op(&task_st, req, started).await
    })
    .await
}

async fn complete_op(st: &AppState, req: protocol::CompleteRequest, started: Instant) -> Response {
    match st
        .storage
        .complete(&req.key, &req.owner, req.ttl_ms, req.record)
        .await
    {
        Ok(outcome) => {
            let name = protocol::complete_outcome_name(outcome);
            st.metrics
                .record_operation(Operation::Complete, name, started.elapsed());
            match outcome {
                CompleteOutcome::Completed => Json(OutcomeResponse::new(name)).into_response(),
                CompleteOutcome::NotOwner => not_owner(
                    "no in-flight record for this key is owned by this owner, \
                     and no completion with these bytes exists",
                ),
            }
        }
        Err(e) => backend_failure(st, Operation::Complete, started, &e),
    }
}

async fn release(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let req = match parse_body(body, protocol::parse_release) {
        Ok(req) => req,
        Err(refusal) => return refusal.respond(&st),
    };
    let started = Instant::now();
    let task_st = st.clone();
    run_detached(&st, Operation::Release, started, async move {
        release_op(&task_st, req, started).await
    })
    .await
}

async fn release_op(st: &AppState, req: protocol::ReleaseRequest, started: Instant) -> Response {
    match st.storage.release(&req.key, &req.owner).await {
        Ok(outcome) => {
            let name = protocol::release_outcome_name(outcome);
            st.metrics
                .record_operation(Operation::Release, name, started.elapsed());
            match outcome {
                ReleaseOutcome::Released => Json(OutcomeResponse::new(name)).into_response(),
                ReleaseOutcome::NotOwner => {
                    not_owner("no in-flight record for this key is owned by this owner")
                }
            }
        }
        Err(e) => backend_failure(st, Operation::Release, started, &e),
    }
}

async fn lookup(State(st): State<AppState>, key: Result<Path<String>, PathRejection>) -> Response {
    let key = match key
        .map_err(|rej| BadRequest(format!("bad path: {}", rej.body_text())))
        .and_then(|Path(raw)| protocol::parse_key(&raw))
    {
        Ok(k) => k,
        Err(bad) => return bad_request(&st, bad),
    };
    let started = Instant::now();
    let task_st = st.clone();
    run_detached(&st, Operation::Lookup, started, async move {
        lookup_op(&task_st, key, started).await
    })
    .await
}

async fn lookup_op(st: &AppState, key: Digest, started: Instant) -> Response {
    match st.storage.lookup(&key).await {
        Ok(Some(view)) => {
            st.metrics
                .record_operation(Operation::Lookup, "found", started.elapsed());
            Json(RecordResponse::from(view)).into_response()
        }
        Ok(None) => {
            st.metrics
                .record_operation(Operation::Lookup, "not_found", started.elapsed());
            problem(
                StatusCode::NOT_FOUND,
                protocol::PROBLEM_NOT_FOUND,
                "Not found",
                "no live record for this key",
            )
        }
        Err(e) => backend_failure(st, Operation::Lookup, started, &e),
    }
}

async fn metrics_text(State(st): State<AppState>) -> Response {
    match st.metrics.encode() {
        Ok(text) => ([(header::CONTENT_TYPE, metrics::CONTENT_TYPE)], text).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn not_found() -> Response {
    problem(
        StatusCode::NOT_FOUND,
        protocol::PROBLEM_NOT_FOUND,
        "Not found",
        "no such endpoint",
    )
}

async fn method_not_allowed() -> Response {
    problem(
        StatusCode::METHOD_NOT_ALLOWED,
        protocol::PROBLEM_METHOD_NOT_ALLOWED,
        "Method not allowed",
        "this endpoint does not accept that method",
    )
}

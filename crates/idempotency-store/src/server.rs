//! HTTP front of the store: the listener and its connection limits, routing,
//! bearer auth, body limits, and mapping storage outcomes and failures onto
//! status codes and problem+json.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::Uri;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder as AutoBuilder;
use subtle::ConstantTimeEq;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tower_service::Service as _;

use crate::admission::{ConnectionAuth, Gate};
use crate::metrics::{self, Metrics, Operation, Rejection};
use crate::operator;
use crate::protocol::{
    self, BadRequest, ClaimResponse, OutcomeResponse, Problem, RecordResponse, RenewResponse,
};
use crate::storage::{
    self, ClaimOutcome, CompleteOutcome, Digest, OwnerToken, RecordView, ReleaseOutcome,
    SettleOutcome, Storage, StorageError,
};
use crate::waits::{HeldWait, WaitOutcome, WaitRoom};

/// Base64 inflates a 1 MiB response to ~1.4 MiB; 4 MiB leaves room for that
/// plus JSON framing and headroom for larger recorded responses.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

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

#[derive(Clone)]
pub struct AppState {
    pub storage: Arc<dyn Storage>,
    pub metrics: Arc<Metrics>,
    pub auth: Auth,
    /// Cancelled when the store starts shutting down: long-lived gRPC streams end then
    /// (after answering what they hold) instead of holding the shutdown for its grace period.
    pub draining: tokio_util::sync::CancellationToken,
    /// Filters' waits for keys in flight (gRPC stream only).
    pub waits: Arc<WaitRoom>,
    /// The one prefix search that may run at a time on this store instance: on Redis each
    /// walks the keyspace, and operators do not need two at once.
    pub searches: Arc<Semaphore>,
}

/// How often a wait looks at its key again when the backend is shared with other store
/// instances, whose completions do not wake it.
pub const SHARED_BACKEND_WAIT_POLL: Duration = Duration::from_millis(50);

impl AppState {
    /// The state with a wait room of `max_waits` sized for `storage`.
    pub fn new(
        storage: Arc<dyn Storage>,
        metrics: Arc<Metrics>,
        auth: Auth,
        draining: tokio_util::sync::CancellationToken,
        max_waits: usize,
    ) -> Self {
        let poll = storage
            .shared_with_other_instances()
            .then_some(SHARED_BACKEND_WAIT_POLL);
        Self {
            storage,
            metrics,
            auth,
            draining,
            waits: Arc::new(WaitRoom::new(max_waits, poll)),
            searches: Arc::new(Semaphore::new(1)),
        }
    }
}

/// What the router serves and how much it accepts.
#[derive(Debug, Clone, Copy)]
pub struct RouterOptions {
    /// Largest request body, and largest message of the gRPC stream (`--max-body-bytes`).
    pub max_body_bytes: usize,
    /// Calls one gRPC stream may have running at once, and apart from them, waits it may hold.
    pub max_calls_per_stream: usize,
    /// Whether `/metrics` is served here; false when it has a listener of its own
    /// (`--metrics-listen`, see [`metrics_router`]).
    pub serve_metrics: bool,
}

impl Default for RouterOptions {
    fn default() -> Self {
        Self {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_calls_per_stream: crate::grpc::DEFAULT_MAX_CALLS_IN_FLIGHT,
            serve_metrics: true,
        }
    }
}

pub fn router(state: AppState, max_body_bytes: usize) -> Router {
    router_with(
        state,
        RouterOptions {
            max_body_bytes,
            ..RouterOptions::default()
        },
    )
}

pub fn router_with(state: AppState, options: RouterOptions) -> Router {
    use idempotency_protocol::wire::path;
    let max_body_bytes = options.max_body_bytes;
    let at = |operation: &str| format!("{}{operation}", path::PREFIX);
    let data_plane = Router::new()
        .route(&at(path::CLAIM), post(claim))
        .route(&at(path::COMPLETE), post(complete))
        .route(&at(path::RELEASE), post(release))
        .route(&at(path::RENEW), post(renew))
        .route(&at(path::SETTLE), post(settle))
        .route(&at(path::LOOKUP), post(data_plane_lookup))
        // route_layer: auth only for matched routes, so unknown paths are a
        // plain 404 rather than a misleading 401.
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_data_plane,
        ));
    let operator = Router::new()
        .route(&at(path::RECORDS), get(search))
        .route(
            &format!("{}/{{key}}", at(path::RECORDS)),
            get(lookup).delete(purge),
        )
        .route(
            &format!("{}/{{key}}{}", at(path::RECORDS), path::SETTLE),
            post(operator_settle),
        )
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_operator,
        ));
    let v1 = data_plane.merge(operator);
    let streams =
        crate::grpc::StoreStreams::new(state.clone(), options.max_calls_per_stream, max_body_bytes);
    let stream_path = format!(
        "/{}/{{*method}}",
        crate::grpc::pb::store_server::SERVICE_NAME
    );
    // Kubernetes probes /healthz on the main port, wherever the metrics are.
    let mut app = Router::new().route("/healthz", get(|| async { "ok" }));
    if options.serve_metrics {
        app = app.route("/metrics", get(metrics_text));
    }
    app.merge(v1)
        // The gRPC stream, on the same port: it authenticates by metadata itself.
        .route_service(&stream_path, streams.service())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state)
}

/// `/metrics` alone, for a listener of its own (`--metrics-listen`), so that it can be kept
/// off the network the data plane reaches.
pub fn metrics_router(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Defaults of [`ConnectionLimits`], also the CLI defaults.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_UNAUTHENTICATED_TIMEOUT: Duration = Duration::from_secs(5);
pub const DEFAULT_MAX_UNAUTHENTICATED_PER_PEER: u32 = 64;
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(300);
pub const DEFAULT_MAX_CONNECTIONS: u32 = 1024;
pub const DEFAULT_H2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
pub const DEFAULT_H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// What one client connection may cost the store, so that silent, half-open
/// or abandoned connections cannot pile up or hold shutdown.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// A new connection must deliver its first request's headers within this
    /// (any protocol, including a stalled HTTP/2 preface); on HTTP/1.1 every
    /// later request's headers too, idle keep-alive time included (hyper's
    /// own header-read timer).
    pub header_read_timeout: Duration,
    /// A connection with no request in flight for this long is closed
    /// (HTTP/2: GOAWAY first).
    pub idle_timeout: Duration,
    /// Connections served at once. Beyond it the store stops accepting, so
    /// further clients wait in the kernel's listen backlog until one closes.
    pub max_connections: u32,
    /// A connection that has not shown a valid token within this long after it opened is
    /// closed (see [`crate::admission`]).
    pub unauthenticated_timeout: Duration,
    /// Connections that have not shown a valid token yet, at most, at once: a newer one
    /// closes the oldest. `None`: a quarter of `max_connections`. At most `max_connections`;
    /// the rest is kept for authenticated connections.
    pub max_unauthenticated: Option<u32>,
    /// Of those, at most this many from one IP address: a newer one closes that peer's
    /// oldest.
    pub max_unauthenticated_per_peer: u32,
    /// HTTP/2 PING interval, and how long an unanswered PING may wait before
    /// the connection is dropped (a peer that vanished without a FIN).
    pub h2_keepalive_interval: Duration,
    pub h2_keepalive_timeout: Duration,
    /// After the shutdown signal (or an idle close), how long a connection
    /// may take to finish what it is doing before it is dropped.
    pub shutdown_grace: Duration,
}

impl ConnectionLimits {
    /// How many connections may wait to authenticate at once: `max_unauthenticated`, or a
    /// quarter of `max_connections`; at least 1, at most `max_connections`.
    pub fn unauthenticated_share(&self) -> u32 {
        self.max_unauthenticated
            .unwrap_or(self.max_connections / 4)
            .clamp(1, self.max_connections.max(1))
    }
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            unauthenticated_timeout: DEFAULT_UNAUTHENTICATED_TIMEOUT,
            max_unauthenticated: None,
            max_unauthenticated_per_peer: DEFAULT_MAX_UNAUTHENTICATED_PER_PEER,
            h2_keepalive_interval: DEFAULT_H2_KEEPALIVE_INTERVAL,
            h2_keepalive_timeout: DEFAULT_H2_KEEPALIVE_TIMEOUT,
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
        }
    }
}

/// Serves HTTP/1.1 and cleartext HTTP/2 (prior knowledge) on one listener
/// with the default [`ConnectionLimits`] until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, app, ConnectionLimits::default(), shutdown).await
}

/// Serves until `shutdown` resolves, then stops accepting, asks every
/// connection to finish (HTTP/1.1: after its current request; HTTP/2:
/// GOAWAY) and returns once all have closed, or after
/// `limits.shutdown_grace` at the latest.
pub async fn serve_with(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_observed(
        listener,
        app,
        limits,
        metrics::ConnectionMetrics::default(),
        shutdown,
    )
    .await
}

/// [`serve_with`], counting its connections in `observed` (the data-plane listener's
/// [`Metrics::connections`]).
pub async fn serve_observed(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    observed: metrics::ConnectionMetrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let gate = Gate::new(
        usize::try_from(limits.unauthenticated_share()).unwrap_or(usize::MAX),
        usize::try_from(limits.max_unauthenticated_per_peer).unwrap_or(usize::MAX),
        observed,
    );
    let mut builder = AutoBuilder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.h2_keepalive_interval)
        .keep_alive_timeout(limits.h2_keepalive_timeout);
    let builder = Arc::new(builder);
    let slots = Arc::new(Semaphore::new(
        usize::try_from(limits.max_connections).unwrap_or(usize::MAX),
    ));
    // A receiver cloned from this one sees the close even if it was sent
    // before the connection's task first looked.
    let (close_tx, close_rx) = watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // Take a slot before accepting: at the limit, new clients stay in
        // the listen backlog instead of costing a task and buffers each.
        let slot = tokio::select! {
            () = &mut shutdown => break,
            slot = Arc::clone(&slots).acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
        };
        let (tcp, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    if !is_connection_error(&e) {
                        // Out of file descriptors, say: back off rather than spin.
                        tracing::warn!("accept failed: {e}");
                        tokio::select! {
                            () = &mut shutdown => break,
                            () = tokio::time::sleep(Duration::from_secs(1)) => {}
                        }
                    }
                    continue;
                }
            },
        };
        // Small JSON exchanges: don't let Nagle hold back the last segment.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("set_nodelay failed: {e}");
        }
        // Taken whoever it is: at a limit, the oldest connection still waiting to
        // authenticate goes instead (see `admission`).
        let auth = gate.admit(peer.ip());
        tokio::spawn(serve_connection(
            Arc::clone(&builder),
            tcp,
            app.clone(),
            limits,
            close_rx.clone(),
            Admitted { slot, auth },
        ));
        // Let the new connection read its first request (a filter's carries its token, and
        // is there already) before the next accept may push it out.
        tokio::task::yield_now().await;
    }
    // Refuse new clients at once (and reset those still in the backlog)
    // rather than leave them waiting for an answer that will not come.
    drop(listener);
    drop(close_rx);
    drop(close_tx);
    // Every connection task holds a slot until it ends, and ends within the
    // grace period; the extra second covers the tasks' own scheduling.
    let all = limits.max_connections;
    let drained = tokio::time::timeout(
        limits.shutdown_grace.saturating_add(Duration::from_secs(1)),
        slots.acquire_many(all),
    )
    .await;
    if drained.is_err() {
        tracing::warn!("shutdown: some connections did not close in time");
    }
    Ok(())
}

fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        e.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    )
}

/// Requests a connection has in flight, and when it last finished one.
struct Activity {
    opened: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds after `opened` the last request finished; `u64::MAX`
    /// while none has been received yet.
    last_done_ms: AtomicU64,
}

/// Marks a request in flight until dropped (also when hyper drops the
/// request's future because the client went away).
struct Busy(Arc<Activity>);

impl Activity {
    fn begin(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        // Not idle from now on, even before the request finishes.
        self.last_done_ms.store(self.elapsed_ms(), Ordering::SeqCst);
        Busy(Arc::clone(self))
    }

    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn busy(&self) -> bool {
        self.in_flight.load(Ordering::SeqCst) > 0
    }

    fn ever_used(&self) -> bool {
        self.last_done_ms.load(Ordering::SeqCst) != u64::MAX
    }

    /// When the connection becomes closable unless something happens first.
    fn idle_deadline(&self, limits: &ConnectionLimits) -> Instant {
        let now = Instant::now();
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return now + limits.idle_timeout;
        }
        match self.last_done_ms.load(Ordering::SeqCst) {
            u64::MAX => self.opened + limits.header_read_timeout,
            ms => self.opened + Duration::from_millis(ms) + limits.idle_timeout,
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0
            .last_done_ms
            .store(self.0.elapsed_ms(), Ordering::SeqCst);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A connection's place: its slot of `max_connections`, returned when it ends, and its
/// standing with the gate.
struct Admitted {
    slot: OwnedSemaphorePermit,
    auth: ConnectionAuth,
}

/// Serves one connection until it ends, it has been idle too long, it did not authenticate
/// in time or was evicted, or the server shuts down.
async fn serve_connection(
    builder: Arc<AutoBuilder<TokioExecutor>>,
    tcp: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    mut close: watch::Receiver<()>,
    admitted: Admitted,
) {
    let Admitted { slot: _slot, auth } = admitted;
    let activity = Arc::new(Activity {
        opened: Instant::now(),
        in_flight: AtomicUsize::new(0),
        last_done_ms: AtomicU64::new(u64::MAX),
    });
    let service = {
        let activity = Arc::clone(&activity);
        let auth = auth.clone();
        hyper::service::service_fn(move |mut req: Request<Incoming>| {
            let busy = activity.begin();
            // The routes that check a token mark the connection when it is right.
            req.extensions_mut().insert(auth.clone());
            // Router is always ready (its poll_ready is a no-op), so it can
            // be called without polling readiness first.
            let answer = app.clone().call(req.map(Body::new));
            async move {
                let resp = answer.await;
                drop(busy);
                resp
            }
        })
    };
    let conn = builder.serve_connection(TokioIo::new(tcp), service);
    let mut conn = std::pin::pin!(conn);
    // Set once the connection has been asked to finish: it gets
    // `shutdown_grace` more, then it is dropped.
    let mut closing: Option<Instant> = None;
    let auth_deadline = activity.opened + limits.unauthenticated_timeout;
    loop {
        let deadline = match closing {
            Some(since) => since + limits.shutdown_grace,
            None if !auth.is_authenticated() => activity.idle_deadline(&limits).min(auth_deadline),
            None => activity.idle_deadline(&limits),
        };
        tokio::select! {
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            // A newer connection needed its room: it had its chance to authenticate, and
            // what it was doing (a /healthz, a refusal) is not worth a grace period.
            () = auth.evicted() => {
                tracing::debug!("closing a connection that had not authenticated: evicted");
                return;
            }
            // Err: the server dropped the sender, which also means close.
            _ = close.changed(), if closing.is_none() => {
                conn.as_mut().graceful_shutdown();
                closing = Some(Instant::now());
            }
            () = tokio::time::sleep_until(deadline.into()) => {
                if closing.is_some() {
                    tracing::debug!("dropping a connection that did not finish in time");
                    return;
                }
                if Instant::now() >= auth_deadline && !auth.is_authenticated() && auth.expire() {
                    tracing::debug!("closing a connection that did not authenticate in time");
                    // Nothing to finish: closed at once (an HTTP/2 GOAWAY would wait for a
                    // PING that a peer holding connections does not answer).
                    if !activity.busy() {
                        return;
                    }
                    conn.as_mut().graceful_shutdown();
                    closing = Some(Instant::now());
                    continue;
                }
                if Instant::now() >= activity.idle_deadline(&limits) {
                    if !activity.ever_used() {
                        // Never sent a whole request: nothing to finish, and
                        // a GOAWAY would wait for a PING such a peer will
                        // not answer.
                        tracing::debug!("closing a connection that sent no request in time");
                        return;
                    }
                    conn.as_mut().graceful_shutdown();
                    closing = Some(Instant::now());
                }
            }
        }
    }
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

async fn require_data_plane(State(st): State<AppState>, req: Request, next: Next) -> Response {
    match st.auth.data_plane(req.headers()) {
        Verdict::Allowed => {
            connection_authenticated(req.extensions());
            next.run(req).await
        }
        refused => refusal(&st, refused),
    }
}

async fn require_operator(State(st): State<AppState>, req: Request, next: Next) -> Response {
    match st.auth.operator(req.headers()) {
        Verdict::Allowed => {
            connection_authenticated(req.extensions());
            next.run(req).await
        }
        refused => refusal(&st, refused),
    }
}

/// A request passed its route's token check: its connection no longer waits to
/// authenticate (see [`crate::admission`]). Requests not served by [`serve_with`] (a router
/// called directly) carry no connection.
pub(crate) fn connection_authenticated(extensions: &axum::http::Extensions) {
    if let Some(auth) = extensions.get::<ConnectionAuth>() {
        auth.authenticated();
    }
}

/// The answer to a request its route's auth refused.
fn refusal(st: &AppState, verdict: Verdict) -> Response {
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

fn count_failure(st: &AppState, op: Operation, started: Instant, e: &StorageError) {
    match e {
        // The writer logs when the file reaches its bound; the refusals are counted (the
        // embedded backend's own counter, and this outcome).
        StorageError::Full(why) => {
            tracing::debug!(operation = op.as_str(), "refused: {why}");
            st.metrics
                .record_operation(op, metrics::STORE_FULL, started.elapsed());
        }
        StorageError::Backend(_) => {
            tracing::warn!(operation = op.as_str(), error = %e, "storage backend failed");
            st.metrics.record_operation(op, "error", started.elapsed());
            st.metrics.backend_error(st.storage.backend_name());
        }
    }
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

fn unavailable(e: &StorageError) -> Response {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        protocol::PROBLEM_UNAVAILABLE,
        "Storage backend unavailable",
        unavailable_detail(e),
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
async fn run_detached<Op: V1Operation>(
    st: &AppState,
    started: Instant,
    work: impl Future<Output = Result<Op::Outcome, StorageError>> + Send + 'static,
) -> Result<Op::Outcome, StorageError> {
    match tokio::spawn(work).await {
        Ok(result) => result,
        // Only a panic in the operation (or a runtime shutting down) gets
        // here; answer like any other backend failure, never re-panic.
        Err(e) => {
            let e = StorageError::Backend(format!("operation task failed: {e}"));
            count_failure(st, Op::OPERATION, started, &e);
            Err(e)
        }
    }
}

/// One `/v1` operation: what it asks of storage and how its outcome is answered. Every
/// operation runs the same way (see [`perform`]): validated input, the storage call on a task
/// of its own, its outcome counted and timed under [`Self::OPERATION`], a 503 on failure.
pub(crate) trait V1Operation: Send + 'static {
    const OPERATION: Operation;
    type Outcome: Send + 'static;

    /// The key whose in-flight record this operation may end: waits for it look again.
    fn settles(&self) -> Option<Digest> {
        None
    }

    fn run(
        self,
        storage: &dyn Storage,
    ) -> impl Future<Output = Result<Self::Outcome, StorageError>> + Send;

    /// The outcome's metrics label.
    fn name(outcome: &Self::Outcome) -> &'static str;

    /// The HTTP answer.
    fn answer(outcome: Self::Outcome) -> Response;
}

impl V1Operation for protocol::ClaimRequest {
    const OPERATION: Operation = Operation::Claim;
    type Outcome = ClaimOutcome;

    async fn run(self, storage: &dyn Storage) -> Result<ClaimOutcome, StorageError> {
        // The client's own token if it chose one, else a fresh one from the CSPRNG.
        let owner = self.owner.map_or_else(OwnerToken::generate, Ok)?;
        storage
            .claim(&self.key, &self.fingerprint, self.lease_ms, &owner)
            .await
    }

    fn name(outcome: &ClaimOutcome) -> &'static str {
        protocol::claim_outcome_name(outcome)
    }

    fn answer(outcome: ClaimOutcome) -> Response {
        Json(ClaimResponse::from(outcome)).into_response()
    }
}

impl V1Operation for protocol::CompleteRequest {
    fn settles(&self) -> Option<Digest> {
        Some(self.key.clone())
    }

    const OPERATION: Operation = Operation::Complete;
    type Outcome = CompleteOutcome;

    async fn run(self, storage: &dyn Storage) -> Result<CompleteOutcome, StorageError> {
        storage
            .complete_or_create(
                &self.key,
                &self.owner,
                self.ttl_ms,
                self.record,
                self.fingerprint.as_ref(),
            )
            .await
    }

    fn name(outcome: &CompleteOutcome) -> &'static str {
        protocol::complete_outcome_name(*outcome)
    }

    fn answer(outcome: CompleteOutcome) -> Response {
        match outcome {
            CompleteOutcome::Completed => {
                Json(OutcomeResponse::new(Self::name(&outcome))).into_response()
            }
            CompleteOutcome::NotOwner => not_owner(
                "no in-flight record for this key is owned by this owner, \
                 and no completion with these bytes exists",
            ),
        }
    }
}

impl V1Operation for protocol::ReleaseRequest {
    fn settles(&self) -> Option<Digest> {
        Some(self.key.clone())
    }

    const OPERATION: Operation = Operation::Release;
    type Outcome = ReleaseOutcome;

    async fn run(self, storage: &dyn Storage) -> Result<ReleaseOutcome, StorageError> {
        storage.release(&self.key, &self.owner).await
    }

    fn name(outcome: &ReleaseOutcome) -> &'static str {
        protocol::release_outcome_name(*outcome)
    }

    fn answer(outcome: ReleaseOutcome) -> Response {
        match outcome {
            ReleaseOutcome::Released => {
                Json(OutcomeResponse::new(Self::name(&outcome))).into_response()
            }
            ReleaseOutcome::NotOwner => {
                not_owner("no in-flight record for this key is owned by this owner")
            }
        }
    }
}

/// Keeps the key of every lease in flight: nothing ends, so no wait looks again.
impl V1Operation for protocol::RenewRequest {
    const OPERATION: Operation = Operation::Renew;
    /// The indexes of the leases that were lost.
    type Outcome = Vec<u32>;

    async fn run(self, storage: &dyn Storage) -> Result<Vec<u32>, StorageError> {
        storage::renew_batch(storage, &self.leases, self.lease_ms).await
    }

    fn name(lost: &Vec<u32>) -> &'static str {
        protocol::renew_outcome_name(lost)
    }

    fn answer(lost: Vec<u32>) -> Response {
        Json(RenewResponse::renewed(lost)).into_response()
    }
}

/// Settles an unknown outcome; only completed records change, so no wait looks again.
impl V1Operation for protocol::SettleRequest {
    const OPERATION: Operation = Operation::Settle;
    type Outcome = SettleOutcome;

    async fn run(self, storage: &dyn Storage) -> Result<SettleOutcome, StorageError> {
        let settled = storage
            .settle(&self.key, &self.current, self.replacement.clone())
            .await?;
        if settled != SettleOutcome::NotFound {
            // Leave a trace of the decision in the store's log: an unknown outcome, settled.
            let how = if self.replacement.is_some() {
                "replaced with what the service reported"
            } else {
                "removed: the write never ran"
            };
            let by = self.by.as_str();
            tracing::info!(
                key = self.key.as_str(),
                how,
                by,
                "settled an unknown outcome"
            );
        }
        Ok(settled)
    }

    fn name(outcome: &SettleOutcome) -> &'static str {
        match outcome {
            SettleOutcome::Replaced => "replaced",
            SettleOutcome::Removed => "removed",
            SettleOutcome::NotFound => "not_found",
        }
    }

    fn answer(outcome: SettleOutcome) -> Response {
        match outcome {
            SettleOutcome::Replaced => {
                Json(OutcomeResponse::new(protocol::outcome::REPLACED)).into_response()
            }
            SettleOutcome::Removed => {
                Json(OutcomeResponse::new(protocol::outcome::REMOVED)).into_response()
            }
            SettleOutcome::NotFound => problem(
                StatusCode::CONFLICT,
                protocol::PROBLEM_NOT_OWNER,
                "Not the record named",
                "the key does not hold exactly the completed record given as current \
                 (settled already, replaced, expired, or still in flight); nothing changed",
            ),
        }
    }
}

/// A lookup by the key in its path (an operator's), or on the stream (a filter's, for a
/// caller asking about its own key).
pub(crate) struct Lookup(pub(crate) Digest);

impl V1Operation for Lookup {
    const OPERATION: Operation = Operation::Lookup;
    type Outcome = Option<RecordView>;

    async fn run(self, storage: &dyn Storage) -> Result<Option<RecordView>, StorageError> {
        storage.lookup(&self.0).await
    }

    fn name(outcome: &Option<RecordView>) -> &'static str {
        if outcome.is_some() {
            "found"
        } else {
            "not_found"
        }
    }

    fn answer(outcome: Option<RecordView>) -> Response {
        match outcome {
            Some(view) => Json(RecordResponse::from(view)).into_response(),
            None => problem(
                StatusCode::NOT_FOUND,
                protocol::PROBLEM_NOT_FOUND,
                "Not found",
                "no live record for this key",
            ),
        }
    }
}

/// The handler of a `POST /v1/...` whose JSON body `parse` reads and validates.
async fn post_handler<Op: V1Operation>(
    st: AppState,
    body: Result<Bytes, BytesRejection>,
    parse: impl FnOnce(&[u8]) -> Result<Op, BadRequest>,
) -> Response {
    match parse_body(body, parse) {
        Ok(op) => perform(&st, op).await,
        Err(refusal) => refusal.respond(&st),
    }
}

async fn claim(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    post_handler(st, body, protocol::parse_claim).await
}

async fn complete(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    post_handler(st, body, protocol::parse_complete).await
}

async fn release(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    post_handler(st, body, protocol::parse_release).await
}

async fn renew(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    post_handler(st, body, protocol::parse_renew).await
}

async fn settle(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    post_handler(st, body, |bytes| {
        protocol::parse_settle(bytes, None, protocol::Settler::Filter)
    })
    .await
}

/// A filter asks what a key holds for a caller's lookup route (the HTTP transport's form of
/// the stream's `lookup`).
async fn data_plane_lookup(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    post_handler(st, body, |bytes| {
        let raw: protocol::LookupBody = serde_json::from_slice(bytes)
            .map_err(|e| BadRequest(format!("invalid JSON body: {e}")))?;
        protocol::parse_key(&raw.key).map(Lookup)
    })
    .await
}

/// An operator settles an unknown outcome (`idempotency-store record resolve`).
async fn operator_settle(
    State(st): State<AppState>,
    key: Result<Path<String>, PathRejection>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let key = match key {
        Ok(Path(key)) => key,
        Err(rej) => return bad_request(&st, BadRequest(format!("bad path: {}", rej.body_text()))),
    };
    post_handler(st, body, |bytes| {
        protocol::parse_settle(bytes, Some(&key), protocol::Settler::Operator)
    })
    .await
}

/// The record key a `/v1/records/{key}` path names.
fn path_key(key: Result<Path<String>, PathRejection>) -> Result<Digest, BadRequest> {
    key.map_err(|rej| BadRequest(format!("bad path: {}", rej.body_text())))
        .and_then(|Path(raw)| protocol::parse_key(&raw))
}

async fn lookup(State(st): State<AppState>, key: Result<Path<String>, PathRejection>) -> Response {
    match path_key(key) {
        Ok(key) => perform(&st, Lookup(key)).await,
        Err(bad) => bad_request(&st, bad),
    }
}

async fn purge(State(st): State<AppState>, key: Result<Path<String>, PathRejection>) -> Response {
    match path_key(key) {
        Ok(key) => perform(&st, operator::Purge(key)).await,
        Err(bad) => bad_request(&st, bad),
    }
}

async fn search(State(st): State<AppState>, uri: Uri) -> Response {
    let search = match operator::parse_search(uri.query()) {
        Ok(search) => search,
        Err(bad) => return bad_request(&st, bad),
    };
    // Refused at once rather than queued: a queue of searches would each walk the keyspace.
    let Ok(place) = Arc::clone(&st.searches).try_acquire_owned() else {
        st.metrics.rejected(Rejection::Throttled);
        let mut resp = problem(
            StatusCode::TOO_MANY_REQUESTS,
            protocol::PROBLEM_TOO_MANY_REQUESTS,
            "Too many requests",
            format!(
                "another prefix search is running on this store instance, which runs one at \
                 a time: retry in {} s",
                operator::SEARCH_RETRY_AFTER_SECS
            ),
        );
        resp.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(operator::SEARCH_RETRY_AFTER_SECS),
        );
        return resp;
    };
    perform(&st, operator::Throttled { search, place }).await
}

/// Runs a validated operation on a task of its own (see [`run_detached`]) and counts and
/// times its outcome: the one implementation behind the HTTP API and the gRPC stream.
pub(crate) async fn execute<Op: V1Operation>(
    st: &AppState,
    op: Op,
) -> Result<Op::Outcome, StorageError> {
    let started = Instant::now();
    let task_st = st.clone();
    run_detached::<Op>(
        st,
        started,
        async move { counted(&task_st, op, started).await },
    )
    .await
}

/// [`execute`] for a caller that already runs on a task no client owns (a stream's call:
/// the stream spawned it, and a client that leaves drops nothing of it), so the operation
/// runs to its end without a task of its own: one task and one wake-up less per call.
pub(crate) async fn execute_on_own_task<Op: V1Operation>(
    st: &AppState,
    op: Op,
) -> Result<Op::Outcome, StorageError> {
    counted(st, op, Instant::now()).await
}

/// The storage call, its outcome counted and timed, and the waits it settles told.
async fn counted<Op: V1Operation>(
    st: &AppState,
    op: Op,
    started: Instant,
) -> Result<Op::Outcome, StorageError> {
    let settles = op.settles();
    let result = op.run(st.storage.as_ref()).await;
    match &result {
        Ok(outcome) => {
            st.metrics
                .record_operation(Op::OPERATION, Op::name(outcome), started.elapsed())
        }
        Err(e) => count_failure(st, Op::OPERATION, started, e),
    }
    // Whatever the outcome: a waiter only looks again, which is cheap.
    if let Some(key) = &settles {
        st.waits.settled(key);
    }
    result
}

/// A filter's wait for a key in flight, in the place `held` took for it, counted and timed as
/// `operation="wait"`. Not run detached: a wait changes nothing, so a client that leaves may
/// cancel it.
pub(crate) async fn wait_for(
    st: &AppState,
    held: &HeldWait,
    request: protocol::WaitRequest,
) -> Result<WaitOutcome, StorageError> {
    let started = Instant::now();
    let result = held
        .wait(
            st.storage.as_ref(),
            &request.fingerprint,
            Duration::from_millis(request.wait_ms),
        )
        .await;
    match &result {
        Ok(outcome) => {
            st.metrics
                .record_operation(Operation::Wait, outcome.name(), started.elapsed())
        }
        Err(e) => count_failure(st, Operation::Wait, started, e),
    }
    result
}

/// A wait answered "still in flight" at once, because its stream or this store instance
/// holds as many as it may: counted like a wait that ran out.
pub(crate) fn wait_refused(st: &AppState) -> WaitOutcome {
    let outcome = WaitOutcome::InFlight { retry_after_ms: 1 };
    st.metrics
        .record_operation(Operation::Wait, outcome.name(), Duration::ZERO);
    outcome
}

/// [`execute`], answered over HTTP.
async fn perform<Op: V1Operation>(st: &AppState, op: Op) -> Response {
    match execute(st, op).await {
        Ok(outcome) => Op::answer(outcome),
        Err(e) => unavailable(&e),
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

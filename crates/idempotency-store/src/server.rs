//! The store's listener and its HTTP front end: connection limits, the router (the data
//! plane's `/v1` routes here, the operator's from [`crate::operator`], the gRPC stream from
//! [`crate::grpc`]), body limits, `/healthz` and `/metrics`.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder as AutoBuilder;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tower_service::Service as _;

use crate::admission::{ConnectionAuth, Gate};
use crate::metrics;
use crate::operator;
use crate::ops::answer::{post_handler, problem, refusal};
use crate::ops::auth::{connection_authenticated, Verdict};
use crate::ops::operations::Lookup;
use crate::ops::AppState;
use crate::protocol::{self, BadRequest};

/// Base64 inflates a 1 MiB response to ~1.4 MiB; 4 MiB leaves room for that
/// plus JSON framing and headroom for larger recorded responses.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

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
    let v1 = data_plane.merge(operator::routes(state.clone()));
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
/// [`metrics::Metrics::connections`]).
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

async fn require_data_plane(State(st): State<AppState>, req: Request, next: Next) -> Response {
    match st.auth.data_plane(req.headers()) {
        Verdict::Allowed => {
            connection_authenticated(req.extensions());
            next.run(req).await
        }
        refused => refusal(&st, refused),
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

//! The store's operations, under its HTTP, gRPC and operator front ends: the state every
//! front end shares, and one way to run an operation (validated input, the storage call,
//! its outcome counted and timed, the waits it settles told).

pub mod answer;
pub mod auth;
pub mod operations;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::Response;
use tokio::sync::Semaphore;

use crate::metrics::{self, Metrics, Operation};
use crate::protocol;
use crate::storage::{Digest, Storage, StorageError};
use crate::waits::{HeldWait, WaitOutcome, WaitRoom};
use answer::unavailable;
use auth::Auth;

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
pub(crate) async fn run_detached<Op: V1Operation>(
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
pub(crate) async fn counted<Op: V1Operation>(
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

pub(crate) fn count_failure(st: &AppState, op: Operation, started: Instant, e: &StorageError) {
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

/// [`execute`], answered over HTTP.
pub(crate) async fn perform<Op: V1Operation>(st: &AppState, op: Op) -> Response {
    match execute(st, op).await {
        Ok(outcome) => Op::answer(outcome),
        Err(e) => unavailable(&e),
    }
}

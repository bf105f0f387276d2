//! Prometheus metrics for `/metrics`. Label values are `&'static str` from a
//! closed set, so label cardinality stays bounded whatever clients send.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operation {
    Claim,
    Complete,
    Release,
    Lookup,
    /// An operator's `DELETE /v1/records/{key}`.
    Purge,
    /// An operator's prefix search, `GET /v1/records?prefix=`.
    Search,
    /// A filter's wait for a key in flight to end (its duration is the wait's).
    Wait,
    /// A batch of lease renewals, counted once per call.
    Renew,
    /// An unknown outcome settled: its record replaced or removed.
    Settle,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Complete => "complete",
            Self::Release => "release",
            Self::Lookup => "lookup",
            Self::Purge => "purge",
            Self::Search => "search",
            Self::Wait => "wait",
            Self::Renew => "renew",
            Self::Settle => "settle",
        }
    }
}

/// The outcome of a claim refused because the store is full (the embedded file at its bound).
pub const STORE_FULL: &str = "store_full";

/// The outcomes of a purge: a record removed, or none there.
pub const PURGE_OUTCOMES: [&str; 2] = [idempotency_protocol::wire::outcome::PURGED, "not_found"];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rejection {
    Unauthorized,
    /// The other kind of token than the route takes, or the operator routes disabled.
    Forbidden,
    BadRequest,
    TooLarge,
    /// A prefix search while another ran (429).
    Throttled,
}

impl Rejection {
    pub const ALL: [Rejection; 5] = [
        Self::Unauthorized,
        Self::Forbidden,
        Self::BadRequest,
        Self::TooLarge,
        Self::Throttled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unauthorized => "unauthorized",
            Self::Forbidden => "forbidden",
            Self::BadRequest => "bad_request",
            Self::TooLarge => "too_large",
            Self::Throttled => "throttled",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct OpOutcome {
    operation: &'static str,
    outcome: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct Op {
    operation: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct Backend {
    backend: &'static str,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

/// Whether a connection has shown a valid token yet (see `admission`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConnectionState {
    Authenticated,
    Unauthenticated,
}

impl ConnectionState {
    pub const ALL: [ConnectionState; 2] = [Self::Authenticated, Self::Unauthenticated];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Authenticated => "authenticated",
            Self::Unauthenticated => "unauthenticated",
        }
    }
}

/// Why the store closed a connection that had not authenticated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WaitingClosed {
    /// `--unauthenticated-timeout-secs` passed.
    Timeout,
    /// A newer connection needed room (`--max-unauthenticated-connections`).
    Evicted,
    /// A newer connection of the same peer needed room
    /// (`--max-unauthenticated-connections-per-peer`).
    PeerLimit,
}

impl WaitingClosed {
    pub const ALL: [WaitingClosed; 3] = [Self::Timeout, Self::Evicted, Self::PeerLimit];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Evicted => "evicted",
            Self::PeerLimit => "peer_limit",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

/// The connections of the data-plane listener: how many are open in each state, and why
/// those that never authenticated were closed. Clones share the same values; the default is
/// registered nowhere (for a listener not worth exporting).
#[derive(Clone, Debug, Default)]
pub struct ConnectionMetrics {
    open: Family<StateLabel, Gauge>,
    waiting_closed: Family<Reason, Counter>,
}

impl ConnectionMetrics {
    pub fn opened(&self, state: ConnectionState) {
        self.open
            .get_or_create(&StateLabel {
                state: state.as_str(),
            })
            .inc();
    }

    pub fn closed(&self, state: ConnectionState) {
        self.open
            .get_or_create(&StateLabel {
                state: state.as_str(),
            })
            .dec();
    }

    pub fn waiting_closed(&self, why: WaitingClosed) {
        self.waiting_closed
            .get_or_create(&Reason {
                reason: why.as_str(),
            })
            .inc();
    }
}

fn duration_histogram() -> Histogram {
    // 0.25 ms .. ~4 s: covers an in-memory hit up to a struggling fsync/Redis.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 15))
}

/// Group-commit statistics of the embedded backend's writer. Created by the
/// backend (it exists before `Metrics` does) and registered with
/// [`Metrics::register_embedded_batches`]; clones share the same values.
#[derive(Clone, Debug)]
pub struct BatchMetrics {
    commits: Counter,
    batch_size: Histogram,
    /// What the file takes on disk after the last commit, and its bound (0: none).
    file_bytes: Gauge,
    max_file_bytes: Gauge,
    /// New claims refused because the file is at its bound.
    claims_refused: Counter,
    // The histogram's own count and sum are not readable outside the
    // prometheus-client crate; these mirror them for tests and logs.
    batches: Counter,
    batched_operations: Counter,
}

impl Default for BatchMetrics {
    fn default() -> Self {
        Self {
            commits: Counter::default(),
            // 1 .. 256 operations per write transaction (the writer's cap).
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 9)),
            file_bytes: Gauge::default(),
            max_file_bytes: Gauge::default(),
            claims_refused: Counter::default(),
            batches: Counter::default(),
            batched_operations: Counter::default(),
        }
    }
}

impl BatchMetrics {
    /// One write transaction of `ops` operations was attempted; `committed`
    /// tells whether it reached the disk.
    pub fn record_batch(&self, ops: usize, committed: bool) {
        self.batch_size.observe(ops as f64);
        self.batches.inc();
        self.batched_operations
            .inc_by(u64::try_from(ops).unwrap_or(u64::MAX));
        if committed {
            self.commits.inc();
        }
    }

    /// The file takes `bytes` on disk now.
    pub fn set_file_bytes(&self, bytes: u64) {
        self.file_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// The file's bound (`--max-db-bytes`).
    pub fn set_max_file_bytes(&self, bytes: u64) {
        self.max_file_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// A new claim was refused because the file is at its bound.
    pub fn claim_refused(&self) {
        self.claims_refused.inc();
    }

    /// What the file took on disk after the last commit.
    pub fn file_bytes(&self) -> u64 {
        u64::try_from(self.file_bytes.get()).unwrap_or(0)
    }

    /// New claims refused so far because the file was at its bound.
    pub fn claims_refused(&self) -> u64 {
        self.claims_refused.get()
    }

    /// Write transactions committed so far.
    pub fn commits(&self) -> u64 {
        self.commits.get()
    }

    /// Write transactions attempted so far (committed or not).
    pub fn batches(&self) -> u64 {
        self.batches.get()
    }

    /// Operations carried by all attempted write transactions.
    pub fn batched_operations(&self) -> u64 {
        self.batched_operations.get()
    }
}

pub struct Metrics {
    registry: Registry,
    operations: Family<OpOutcome, Counter>,
    durations: Family<Op, Histogram, fn() -> Histogram>,
    backend_errors: Family<Backend, Counter>,
    rejected: Family<Reason, Counter>,
    connections: ConnectionMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let operations = Family::<OpOutcome, Counter>::default();
        let durations =
            Family::<Op, Histogram, fn() -> Histogram>::new_with_constructor(duration_histogram);
        let backend_errors = Family::<Backend, Counter>::default();
        let rejected = Family::<Reason, Counter>::default();
        // Counter names get their `_total` suffix from the encoder.
        registry.register(
            "idempotency_store_operations",
            "Store operations by outcome",
            operations.clone(),
        );
        registry.register(
            "idempotency_store_operation_duration_seconds",
            "Time spent in the storage backend per operation",
            durations.clone(),
        );
        registry.register(
            "idempotency_store_backend_errors",
            "Storage backend failures (answered with 503)",
            backend_errors.clone(),
        );
        registry.register(
            "idempotency_store_rejected_requests",
            "Requests refused before reaching storage",
            rejected.clone(),
        );
        let connections = ConnectionMetrics::default();
        registry.register(
            "idempotency_store_connections",
            "Client connections open on the data-plane listener, by whether they have shown \
             a valid token yet",
            connections.open.clone(),
        );
        registry.register(
            "idempotency_store_unauthenticated_connections_closed",
            "Connections closed before they showed a valid token: timeout \
             (--unauthenticated-timeout-secs), evicted or peer_limit (room for a newer \
             connection)",
            connections.waiting_closed.clone(),
        );
        for state in ConnectionState::ALL {
            let _ = connections.open.get_or_create(&StateLabel {
                state: state.as_str(),
            });
        }
        for why in WaitingClosed::ALL {
            let _ = connections.waiting_closed.get_or_create(&Reason {
                reason: why.as_str(),
            });
        }
        Self {
            registry,
            operations,
            durations,
            backend_errors,
            rejected,
            connections,
        }
    }

    /// The data-plane listener's connection metrics, for [`crate::server::serve_observed`].
    pub fn connections(&self) -> ConnectionMetrics {
        self.connections.clone()
    }

    /// Exposes the embedded backend's group-commit statistics.
    pub fn register_embedded_batches(&mut self, batches: &BatchMetrics) {
        self.registry.register(
            "idempotency_store_embedded_commits",
            "Write transactions committed (one fsync each) by the embedded backend",
            batches.commits.clone(),
        );
        self.registry.register(
            "idempotency_store_batch_size",
            "Operations group-committed per embedded write transaction",
            batches.batch_size.clone(),
        );
        self.registry.register(
            "idempotency_store_embedded_file_bytes",
            "Bytes the embedded store's file takes on disk (allocated blocks, as du counts them)",
            batches.file_bytes.clone(),
        );
        self.registry.register(
            "idempotency_store_embedded_max_file_bytes",
            "The embedded store's bound on its file (--max-db-bytes; 0: none)",
            batches.max_file_bytes.clone(),
        );
        self.registry.register(
            "idempotency_store_embedded_claims_refused",
            "New claims refused (503) because the embedded store's file was at its bound",
            batches.claims_refused.clone(),
        );
    }

    pub fn record_operation(&self, op: Operation, outcome: &'static str, took: Duration) {
        self.operations
            .get_or_create(&OpOutcome {
                operation: op.as_str(),
                outcome,
            })
            .inc();
        self.durations
            .get_or_create(&Op {
                operation: op.as_str(),
            })
            .observe(took.as_secs_f64());
    }

    /// Gives the error counters their series at 0 before anything has failed, so that
    /// `rate()`, alerts and dashboards see them from the start instead of a missing series.
    /// Purges too: an operator removing records is worth an alert of its own.
    pub fn start_error_counters_at_zero(&self, backend: &'static str) {
        let _ = self.backend_errors.get_or_create(&Backend { backend });
        for why in Rejection::ALL {
            let _ = self.rejected.get_or_create(&Reason {
                reason: why.as_str(),
            });
        }
        for outcome in PURGE_OUTCOMES {
            let _ = self.operations.get_or_create(&OpOutcome {
                operation: Operation::Purge.as_str(),
                outcome,
            });
        }
    }

    pub fn backend_error(&self, backend: &'static str) {
        self.backend_errors
            .get_or_create(&Backend { backend })
            .inc();
    }

    pub fn rejected(&self, why: Rejection) {
        self.rejected
            .get_or_create(&Reason {
                reason: why.as_str(),
            })
            .inc();
    }

    /// OpenMetrics text exposition.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_counters_are_exported_at_zero_before_any_error() {
        let metrics = Metrics::new();
        let before = metrics.encode().unwrap();
        assert!(!before.contains("idempotency_store_backend_errors_total{"));
        metrics.start_error_counters_at_zero("redis");
        let text = metrics.encode().unwrap();
        assert!(text.contains("idempotency_store_backend_errors_total{backend=\"redis\"} 0"));
        for why in Rejection::ALL {
            let line = format!(
                "idempotency_store_rejected_requests_total{{reason=\"{}\"}} 0",
                why.as_str()
            );
            assert!(text.contains(&line), "{line} missing from\n{text}");
        }
        for outcome in PURGE_OUTCOMES {
            let line = format!(
                "idempotency_store_operations_total{{operation=\"purge\",outcome=\"{outcome}\"}} 0"
            );
            assert!(text.contains(&line), "{line} missing from\n{text}");
        }
    }
}

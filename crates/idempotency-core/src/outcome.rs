//! The outcomes an on-call engineer watches, one counter per rule and outcome.

/// What happened to one request (or, for `Released`, to its claim).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Claimed and sent upstream.
    Executed,
    /// Answered from the recorded response.
    Replayed,
    /// Answered from a record's tombstone (past `ttl_seconds`, within `tombstone_seconds`):
    /// its status and headers with the body-omitted marker.
    ReplayedTombstone,
    /// 409: the same key is still in flight.
    Conflict,
    /// 422: the key was used with another payload.
    Mismatch,
    /// 400: a required key was missing.
    MissingKey,
    /// 400: the key was malformed.
    InvalidKey,
    /// 401: the rule requires a scope header that the request lacks.
    MissingScope,
    /// The upstream answered with a status that releases the claim.
    Released,
    /// A matched request went upstream unprotected (optional key absent, or a fail-open policy).
    PassedThrough,
    /// Every slot of the new key's bucket held a claim in flight (single-proxy mode).
    TableFull,
    /// A new key took the slot of another key's completed record before its TTL (the local
    /// table is full; see the retention gauge).
    Evicted,
    /// A new key found no slot because its bucket's completed records are all on their way to
    /// the store, which eviction leaves alone (cluster mode, an outage): the store alone
    /// guards the key, or, with the store down, the store error policy decides.
    KeptForStore,
    /// The response was recorded without its body (larger than `max_response_bytes` or than
    /// the local table's largest page, or cut short): a retry gets the body-omitted marker.
    BodyOmitted,
    /// An in-flight claim past its lease was taken over.
    TakenOver,
    /// The response could not be recorded (ownership lost, or a host error).
    NotRecorded,
    /// The local table could not be read or written (a host error); the table-full policy applied.
    TableError,
    /// Cluster mode: the store could not be used (down, slow, refused, or garbage).
    StoreError,
    /// Cluster mode: the store failed and the rule failed open (local claim only).
    StoreFailOpen,
    /// Cluster mode: a completion or release was given up before the store took it (its
    /// deadline passed during an outage, or the retry buffer's byte budget was spent).
    StoreWriteDropped,
    /// A duplicate held while the first request with its key ran (`on_in_flight: "wait"`).
    Waited,
    /// A held duplicate answered with the first request's recorded response.
    ReplayedAfterWait,
    /// A held duplicate answered 409: the first was still running when `wait_ms` passed.
    WaitTimedOut,
    /// A held duplicate answered 503 with Retry-After: the first request's claim was released
    /// (it failed, or its lease lapsed), so a retry executes.
    WaitReleased,
    /// Envoy answered after the request may have reached the upstream (a route or per-try
    /// timeout, a reset after it was sent), or the client left while it ran: the write may
    /// have happened. Its key stays taken (`on_unknown_outcome: "record"`) or is freed.
    OutcomeUnknown,
    /// A retry (or a held duplicate) told that its first attempt's outcome is unknown.
    OutcomeUnknownAnswered,
    /// The router sent a protected request upstream more than once although the filter asked
    /// it not to retry (`x-envoy-max-retries: 0`): the write may have run more than once.
    Resent,
    /// A live request's lease could not be renewed: another request took its key over (its
    /// proxy's renewals did not reach the store before the lease ended).
    LeaseLost,
    /// A write sent upstream by the filter itself (`execution: "detached"`), so that it
    /// completes even if its client leaves.
    Detached,
    /// A detached write that completed after its client had left: recorded, so the client's
    /// retry replays it instead of learning nothing.
    CompletedAfterClientLeft,
    /// A gRPC call on a protected path that is not unary (no request message, or several):
    /// let through unprotected.
    GrpcStreaming,
    /// A gRPC call with its rule's key metadata that sent a second request message: refused
    /// with `INVALID_ARGUMENT` before any of it went upstream. Let through, a unary method
    /// would run on its first message, again under a recorded key.
    GrpcStreamWithKey,
    /// A gRPC call (or a gRPC-Web one) matched by an HTTP rule that a gRPC call cannot honour
    /// (its key or fingerprint read from the body or the query, or a detached execution): let
    /// through unprotected.
    GrpcOnHttpRule,
    /// A gRPC replay's hop that did not reach the replay echo (no route to it): the retry got
    /// UNAVAILABLE and nothing ran. The configuration is missing the echo's route.
    ReplayEchoUnrouted,
    /// An unknown outcome resolved by asking the service (`resolve`): it took effect, and
    /// what the service answered is now the key's record.
    ResolvedTookEffect,
    /// An unknown outcome resolved by asking the service: the write never ran, so the key is
    /// freed and the next retry executes.
    ResolvedNeverRan,
    /// A lookup that settled nothing (an error, a timeout, an unlisted status): asked again
    /// after a backoff.
    ResolutionRetried,
    /// Every lookup of an unknown outcome settled nothing: left for an operator.
    ResolutionGaveUp,
    /// A caller asked the rule's lookup route what the filter holds for its key.
    LookedUp,
}

impl Outcome {
    pub const ALL: [Outcome; 39] = [
        Outcome::Executed,
        Outcome::Replayed,
        Outcome::ReplayedTombstone,
        Outcome::Conflict,
        Outcome::Mismatch,
        Outcome::MissingKey,
        Outcome::InvalidKey,
        Outcome::MissingScope,
        Outcome::Released,
        Outcome::PassedThrough,
        Outcome::TableFull,
        Outcome::Evicted,
        Outcome::KeptForStore,
        Outcome::BodyOmitted,
        Outcome::TakenOver,
        Outcome::NotRecorded,
        Outcome::TableError,
        Outcome::StoreError,
        Outcome::StoreFailOpen,
        Outcome::StoreWriteDropped,
        Outcome::Waited,
        Outcome::ReplayedAfterWait,
        Outcome::WaitTimedOut,
        Outcome::WaitReleased,
        Outcome::OutcomeUnknown,
        Outcome::OutcomeUnknownAnswered,
        Outcome::Resent,
        Outcome::LeaseLost,
        Outcome::Detached,
        Outcome::CompletedAfterClientLeft,
        Outcome::GrpcStreaming,
        Outcome::GrpcStreamWithKey,
        Outcome::GrpcOnHttpRule,
        Outcome::ReplayEchoUnrouted,
        Outcome::ResolvedTookEffect,
        Outcome::ResolvedNeverRan,
        Outcome::ResolutionRetried,
        Outcome::ResolutionGaveUp,
        Outcome::LookedUp,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::Replayed => "replayed",
            Outcome::ReplayedTombstone => "replayed_tombstone",
            Outcome::Conflict => "conflict",
            Outcome::Mismatch => "mismatch",
            Outcome::MissingKey => "missing_key",
            Outcome::InvalidKey => "invalid_key",
            Outcome::MissingScope => "missing_scope",
            Outcome::Released => "released",
            Outcome::PassedThrough => "passed_through",
            Outcome::TableFull => "table_full",
            Outcome::KeptForStore => "kept_for_store",
            Outcome::Evicted => "evicted",
            Outcome::BodyOmitted => "body_omitted",
            Outcome::TakenOver => "taken_over",
            Outcome::NotRecorded => "not_recorded",
            Outcome::TableError => "table_error",
            Outcome::StoreError => "store_error",
            Outcome::StoreFailOpen => "store_fail_open",
            Outcome::StoreWriteDropped => "store_write_dropped",
            Outcome::Waited => "waited",
            Outcome::ReplayedAfterWait => "replayed_after_wait",
            Outcome::WaitTimedOut => "wait_timed_out",
            Outcome::WaitReleased => "wait_released",
            Outcome::OutcomeUnknown => "outcome_unknown",
            Outcome::OutcomeUnknownAnswered => "outcome_unknown_answered",
            Outcome::Resent => "resent",
            Outcome::LeaseLost => "lease_lost",
            Outcome::Detached => "detached",
            Outcome::CompletedAfterClientLeft => "completed_after_client_left",
            Outcome::GrpcStreaming => "grpc_streaming",
            Outcome::GrpcStreamWithKey => "grpc_stream_with_key",
            Outcome::GrpcOnHttpRule => "grpc_on_http_rule",
            Outcome::ReplayEchoUnrouted => "replay_echo_unrouted",
            Outcome::ResolvedTookEffect => "resolved_took_effect",
            Outcome::ResolvedNeverRan => "resolved_never_ran",
            Outcome::ResolutionRetried => "resolution_retried",
            Outcome::ResolutionGaveUp => "resolution_gave_up",
            Outcome::LookedUp => "looked_up",
        }
    }

    /// Dense index, for per-rule metric tables.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Stat name under Envoy's `wasmcustom.` prefix; `stats_tags` turn the rule into a label.
    pub fn metric_name(self, rule: &str) -> String {
        format!("idempotency.rule.{rule}.{}", self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    #[test]
    fn indexes_are_dense_and_names_unique() {
        for (i, o) in Outcome::ALL.iter().enumerate() {
            assert_eq!(o.index(), i);
        }
        let mut names: Vec<_> = Outcome::ALL.iter().map(|o| o.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Outcome::ALL.len());
        assert_eq!(
            Outcome::Executed.metric_name("orders"),
            "idempotency.rule.orders.executed"
        );
    }
}

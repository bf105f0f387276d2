//! The data plane's operations: what each asks of storage and how its outcome is answered
//! over HTTP (the gRPC stream answers the same outcomes in its own messages).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::metrics::Operation;
use crate::ops::answer::{not_owner, problem};
use crate::ops::V1Operation;
use crate::protocol::{self, ClaimResponse, OutcomeResponse, RecordResponse, RenewResponse};
use crate::storage::{
    self, ClaimOutcome, CompleteOutcome, Digest, OwnerToken, RecordView, ReleaseOutcome,
    SettleOutcome, Storage, StorageError,
};

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
                self.tombstone_ms,
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

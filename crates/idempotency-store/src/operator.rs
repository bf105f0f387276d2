//! The operators' front end, `/v1/records...` on the operator token only: a record's lookup,
//! a search by key prefix (the short hash an access log shows), the purge of one record and
//! the settling of an unknown outcome. Each runs like every `/v1` operation (`ops::execute`:
//! on a task of its own, counted and timed), and answers bad input with a 400 that names
//! what is wrong.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use axum::Router;
use idempotency_protocol::wire::{outcome, search, PurgeResponse, SearchResponse};

use crate::metrics::{Operation, Rejection};
use crate::ops::answer::{bad_request, post_handler, problem, refusal};
use crate::ops::auth::{connection_authenticated, Verdict};
use crate::ops::operations::Lookup;
use crate::ops::{perform, AppState, V1Operation};
use crate::protocol::{self, BadRequest, RecordResponse, PROBLEM_NOT_FOUND};
use crate::storage::{
    Digest, KeyPrefix, PrefixMatches, RecordState, RecordView, Storage, StorageError,
};

/// `GET /v1/records?prefix=<hex>[&limit=<n>]`, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Search {
    pub prefix: KeyPrefix,
    pub limit: usize,
}

/// How a refusal names a parameter the client sent: short and printable, whatever it was.
fn shown(raw: &str) -> String {
    raw.chars()
        .take(64)
        .flat_map(char::escape_default)
        .collect()
}

/// Reads the query string of a prefix search. Unknown and repeated parameters are refused,
/// as unknown body fields are elsewhere: a typo must not widen or narrow a search silently.
pub fn parse_search(query: Option<&str>) -> Result<Search, BadRequest> {
    let (mut prefix, mut limit) = (None, None);
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let slot = match name {
            search::PREFIX => &mut prefix,
            search::LIMIT => &mut limit,
            other => {
                return Err(BadRequest(format!(
                    "unknown query parameter `{}` (expected `{}` and optionally `{}`)",
                    shown(other),
                    search::PREFIX,
                    search::LIMIT
                )))
            }
        };
        if slot.replace(value).is_some() {
            return Err(BadRequest(format!(
                "query parameter `{name}`: given more than once"
            )));
        }
    }
    let prefix = prefix.ok_or_else(|| {
        BadRequest(format!(
            "query parameter `{}`: required (the first {} to 64 hex characters of a key)",
            search::PREFIX,
            search::MIN_PREFIX_HEX
        ))
    })?;
    let prefix = KeyPrefix::parse(prefix)
        .map_err(|why| BadRequest(format!("query parameter `{}`: {why}", search::PREFIX)))?;
    let limit = match limit {
        None => search::MAX_LIMIT,
        Some(raw) => raw
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=search::MAX_LIMIT).contains(n))
            .ok_or_else(|| {
                BadRequest(format!(
                    "query parameter `{}`: must be an integer between 1 and {}, got `{}`",
                    search::LIMIT,
                    search::MAX_LIMIT,
                    shown(raw)
                ))
            })?,
    };
    Ok(Search { prefix, limit })
}

impl V1Operation for Search {
    const OPERATION: Operation = Operation::Search;
    type Outcome = PrefixMatches;

    async fn run(self, storage: &dyn Storage) -> Result<PrefixMatches, StorageError> {
        storage.find_by_prefix(&self.prefix, self.limit).await
    }

    fn name(outcome: &PrefixMatches) -> &'static str {
        if outcome.keys.is_empty() {
            "not_found"
        } else {
            "found"
        }
    }

    /// Always 200, with no keys when nothing matched: a search that finds nothing did
    /// not fail, and `exhaustive` says how sure the answer is.
    fn answer(outcome: PrefixMatches) -> Response {
        Json(SearchResponse {
            keys: outcome.keys.iter().map(|k| k.as_str().to_owned()).collect(),
            truncated: outcome.truncated,
            exhaustive: outcome.exhaustive,
        })
        .into_response()
    }
}

/// A search that holds the store instance's one search place while it runs, on its task to
/// its end even if the client has gone (see `ops::execute`), so the throttle counts the
/// searches that really run.
pub struct Throttled {
    pub search: Search,
    pub place: tokio::sync::OwnedSemaphorePermit,
}

impl V1Operation for Throttled {
    const OPERATION: Operation = Operation::Search;
    type Outcome = PrefixMatches;

    async fn run(self, storage: &dyn Storage) -> Result<PrefixMatches, StorageError> {
        let Self { search, place } = self;
        let found = search.run(storage).await;
        drop(place);
        found
    }

    fn name(outcome: &PrefixMatches) -> &'static str {
        Search::name(outcome)
    }

    fn answer(outcome: PrefixMatches) -> Response {
        Search::answer(outcome)
    }
}

/// How long a client whose search was refused should wait: about the longest a search runs
/// (the Redis backend stops one after 2 s).
pub const SEARCH_RETRY_AFTER_SECS: u64 = 2;

/// `DELETE /v1/records/{key}`.
pub struct Purge(pub Digest);

impl V1Operation for Purge {
    const OPERATION: Operation = Operation::Purge;
    type Outcome = Option<RecordView>;

    fn settles(&self) -> Option<Digest> {
        Some(self.0.clone())
    }

    async fn run(self, storage: &dyn Storage) -> Result<Option<RecordView>, StorageError> {
        let removed = storage.purge(&self.0).await?;
        if let Some(view) = &removed {
            // The one write no client of the filter makes: leave a trace of it.
            let state = match view.state {
                RecordState::InFlight => outcome::IN_FLIGHT,
                RecordState::Completed => outcome::COMPLETED,
            };
            tracing::info!(key = self.0.as_str(), state, "purged a record");
        }
        Ok(removed)
    }

    fn name(outcome: &Option<RecordView>) -> &'static str {
        if outcome.is_some() {
            outcome::PURGED
        } else {
            "not_found"
        }
    }

    fn answer(outcome: Option<RecordView>) -> Response {
        match outcome {
            Some(view) => Json(PurgeResponse {
                outcome: outcome::PURGED.to_owned(),
                purged: RecordResponse::from(view),
            })
            .into_response(),
            None => problem(
                StatusCode::NOT_FOUND,
                PROBLEM_NOT_FOUND,
                "Not found",
                "no live record for this key; nothing was purged",
            ),
        }
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
        Ok(key) => perform(&st, Purge(key)).await,
        Err(bad) => bad_request(&st, bad),
    }
}

async fn search(State(st): State<AppState>, uri: Uri) -> Response {
    let search = match parse_search(uri.query()) {
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
                SEARCH_RETRY_AFTER_SECS
            ),
        );
        resp.headers_mut().insert(
            header::RETRY_AFTER,
            HeaderValue::from(SEARCH_RETRY_AFTER_SECS),
        );
        return resp;
    };
    perform(&st, Throttled { search, place }).await
}

/// The operator routes (`/v1/records...`), on the operator token only.
pub fn routes(state: AppState) -> Router<AppState> {
    use idempotency_protocol::wire::path;
    let at = |operation: &str| format!("{}{operation}", path::PREFIX);
    Router::new()
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
        ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_search_needs_a_hex_prefix_of_at_least_eight_digits() {
        let ok = parse_search(Some("prefix=3F9C0A51d2e47b86")).unwrap();
        assert_eq!(ok.prefix.as_str(), "3f9c0a51d2e47b86");
        assert_eq!(ok.limit, search::MAX_LIMIT);
        let full = "a".repeat(64);
        let ok = parse_search(Some(&format!("limit=1&prefix={full}"))).unwrap();
        assert_eq!((ok.prefix.as_str(), ok.limit), (full.as_str(), 1));
        for (query, names) in [
            (None, "`prefix`: required"),
            (Some(""), "`prefix`: required"),
            (Some("limit=3"), "`prefix`: required"),
            (Some("prefix=3f9c0a5"), "8 to 64"),
            (Some("prefix="), "8 to 64"),
            (Some(&*format!("prefix={full}0")), "8 to 64"),
            (Some("prefix=3f9c0a5z"), "hex"),
            (Some("prefix=%33f9c0a51"), "hex"),
            (Some("prefix=3f9c0a51&limit=0"), "`limit`"),
            (Some("prefix=3f9c0a51&limit=21"), "between 1 and 20"),
            (Some("prefix=3f9c0a51&limit=-1"), "`limit`"),
            (Some("prefix=3f9c0a51&limit"), "`limit`"),
            (Some("prefix=3f9c0a51&prefix=3f9c0a51"), "more than once"),
            (
                Some("prefix=3f9c0a51&lmit=3"),
                "unknown query parameter `lmit`",
            ),
            (Some("\u{7}=1"), "unknown query parameter `\\u{7}`"),
        ] {
            let err = parse_search(query).unwrap_err();
            assert!(err.0.contains(names), "{query:?}: {}", err.0);
        }
    }
}

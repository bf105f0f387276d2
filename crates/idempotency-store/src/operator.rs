//! The operators' endpoints beside the lookup: a search by key prefix (the short hash an
//! access log shows) and the purge of one record. Both run like every `/v1` operation
//! (`server::execute`: on a task of their own, counted and timed), and answer bad input
//! with a 400 that names what is wrong.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use idempotency_protocol::wire::{outcome, search, PurgeResponse, SearchResponse};

use crate::metrics::Operation;
use crate::protocol::{BadRequest, RecordResponse, PROBLEM_NOT_FOUND};
use crate::server::{problem, V1Operation};
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
/// its end even if the client has gone (see `server::execute`), so the throttle counts the
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
